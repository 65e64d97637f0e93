//! `/`: the consumer groups (members, lag per partition, from Kafka) and
//! the services (outcome rates, outages, from their `/metrics`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::StatusCode;
use hyper::body::Bytes;
use maud::{Markup, html};
use rdkafka::consumer::Consumer as _;
use rdkafka::{Offset, TopicPartitionList};

use super::pages::{encode, layout};
use super::{Answer, Asked, Console, blocking};
use crate::Failure;
use crate::kafka::{self, TIMEOUT};

/// How long a metrics endpoint has to answer.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);

/// The largest metrics text read.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

/// The most consumer groups shown.
const MAX_GROUPS: usize = 100;

/// The groups of dedup's own tools (replays, inspections, this console).
fn is_tool_group(name: &str) -> bool {
    [
        "dedup-inspect-",
        "dedup-replay.",
        "dedup-console-",
        "dedup-retry-",
    ]
    .iter()
    .any(|prefix| name.starts_with(prefix))
}

/// `/`, or with `?fragment=overview` only its refreshing part.
pub(crate) async fn page(console: &Console, asked: &Asked) -> Answer {
    let overview = overview(console).await;
    if asked.query.get("fragment") == Some("overview") {
        return Answer::Fragment(overview);
    }
    let body = html! {
        p.hint { "Refreshes every 5 seconds." }
        div id="overview" data-refresh="/?fragment=overview" { (overview) }
    };
    Answer::Page(StatusCode::OK, layout(Some(console), "Overview", body))
}

async fn overview(console: &Console) -> Markup {
    let services = services(console).await;
    // The groups the services name are shown even while they have no
    // member (all stopped, or crashed).
    let named: Vec<String> = services
        .iter()
        .filter_map(|s| s.state.as_ref().ok())
        .flat_map(|m| m.groups.keys().cloned())
        .collect();
    let groups = {
        let kafka = console.kafka().clone();
        blocking(move || groups(&kafka, &named)).await
    };
    html! {
        @if !console.metrics().is_empty() {
            section {
                h2 { "Services" }
                @for service in &services { (service_card(service)) }
            }
        }
        section {
            h2 { "Consumer groups" }
            @match &groups {
                Err(e) => p.error { (e.to_string()) },
                Ok((groups, idle)) => {
                    @if groups.is_empty() { p.notice { "No consumer group with members on these brokers." } }
                    @for group in groups { (group_card(group)) }
                    @if !idle.is_empty() {
                        details {
                            summary { (idle.len()) " groups without members" }
                            p.small { @for name in idle { code { (name) } " " } }
                        }
                    }
                },
            }
        }
    }
}

/// One consumer group as Kafka tells it.
struct Group {
    name: String,
    state: String,
    members: Vec<Member>,
    /// Per topic and partition: committed offset (if any) and end.
    lag: BTreeMap<(String, i32), (Option<i64>, i64)>,
}

struct Member {
    client_id: String,
    host: String,
    assigned: Vec<(String, Vec<i32>)>,
}

/// The groups on the brokers (not dedup's tools') that have members or
/// that a service names, with their members and the lag of the partitions
/// their members hold; and the names of the others.
fn groups(
    kafka_args: &crate::KafkaArgs,
    named: &[String],
) -> Result<(Vec<Group>, Vec<String>), Failure> {
    let group = format!("dedup-console-{}", uuid::Uuid::new_v4().simple());
    let reader = kafka::consumer(kafka_args, &group)?;
    let list = reader
        .fetch_group_list(None, TIMEOUT)
        .map_err(|e| kafka::unreachable_brokers(&e))?;
    let (mut groups, mut idle) = (Vec::new(), Vec::new());
    let mut infos: Vec<_> = list.groups().iter().collect();
    infos.sort_by_key(|info| info.name());
    for info in infos {
        if is_tool_group(info.name()) {
            continue;
        }
        let wanted = !info.members().is_empty() || named.iter().any(|n| n == info.name());
        if !wanted || groups.len() >= MAX_GROUPS {
            idle.push(info.name().to_owned());
            continue;
        }
        let members: Vec<Member> = info
            .members()
            .iter()
            .map(|m| Member {
                client_id: m.client_id().to_owned(),
                host: m.client_host().to_owned(),
                assigned: m.assignment().map(assignment).unwrap_or_default(),
            })
            .collect();
        let mut lag = BTreeMap::new();
        let mut tpl = TopicPartitionList::new();
        for member in &members {
            for (topic, partitions) in &member.assigned {
                for &p in partitions {
                    tpl.add_partition(topic, p);
                }
            }
        }
        if tpl.count() > 0 {
            let committed = committed(kafka_args, info.name(), tpl)?;
            for ((topic, p), at) in committed {
                let (_, high) = reader
                    .fetch_watermarks(&topic, p, TIMEOUT)
                    .map_err(|e| kafka::unreachable_brokers(&e))?;
                lag.insert((topic, p), (at, high));
            }
        }
        groups.push(Group {
            name: info.name().to_owned(),
            state: info.state().to_owned(),
            members,
            lag,
        });
    }
    Ok((groups, idle))
}

/// `group`'s committed offsets of the partitions in `tpl`, read as a
/// client that does not join it.
fn committed(
    kafka_args: &crate::KafkaArgs,
    group: &str,
    tpl: TopicPartitionList,
) -> Result<Vec<(Partition, Option<i64>)>, Failure> {
    let asker = kafka::consumer(kafka_args, group)?;
    let committed = asker
        .committed_offsets(tpl, TIMEOUT)
        .map_err(|e| Failure::new(format!("reading group {group:?}'s offsets: {e}")))?;
    Ok(committed
        .elements()
        .iter()
        .map(|e| {
            let at = match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            };
            ((e.topic().to_owned(), e.partition()), at)
        })
        .collect())
}

/// A member's assignment in the classic consumer protocol: version
/// (int16), then topics, each a name (int16 length) and its partitions
/// (int32 count, int32 each); user data after.
fn assignment(bytes: &[u8]) -> Vec<(String, Vec<i32>)> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, tail) = (bytes.get(..n)?, bytes.get(n..)?);
        *bytes = tail;
        Some(head)
    }
    fn int16(bytes: &mut &[u8]) -> Option<i16> {
        Some(i16::from_be_bytes(take(bytes, 2)?.try_into().ok()?))
    }
    fn int32(bytes: &mut &[u8]) -> Option<i32> {
        Some(i32::from_be_bytes(take(bytes, 4)?.try_into().ok()?))
    }
    let parse = |mut bytes: &[u8]| -> Option<Vec<(String, Vec<i32>)>> {
        let bytes = &mut bytes;
        int16(bytes)?;
        let topics = int32(bytes)?;
        let mut out = Vec::new();
        for _ in 0..topics.clamp(0, 10_000) {
            let len = usize::try_from(int16(bytes)?).ok()?;
            let name = String::from_utf8(take(bytes, len)?.to_vec()).ok()?;
            let count = int32(bytes)?;
            let mut partitions = Vec::new();
            for _ in 0..count.clamp(0, 100_000) {
                partitions.push(int32(bytes)?);
            }
            out.push((name, partitions));
        }
        Some(out)
    };
    parse(bytes).unwrap_or_default()
}

fn group_card(group: &Group) -> Markup {
    let total: i64 = group
        .lag
        .values()
        .map(|(at, high)| at.map_or(0, |at| (high - at).max(0)))
        .sum();
    html! {
        div.card.group {
            h3 { code { (group.name) } " " span.badge { (group.state) } }
            p { "members " strong { (group.members.len()) }
                @if !group.lag.is_empty() { ", lag " strong.lag { (total) } } }
            @if !group.members.is_empty() {
                div.scroll { table.members {
                    thead { tr { th { "member" } th { "host" } th { "partitions" } } }
                    tbody { @for m in &group.members {
                        tr { td { (m.client_id) } td.small { (m.host) }
                             td.small { @for (topic, ps) in &m.assigned { (topic) " " (format!("{ps:?}")) " " } } }
                    } }
                } }
            }
            @if !group.lag.is_empty() {
                div.scroll { table.lag {
                    thead { tr { th { "topic" } th.num { "partition" } th.num { "committed" } th.num { "end" } th.num { "lag" } } }
                    tbody { @for ((topic, p), (at, high)) in &group.lag {
                        tr { td { (topic) } td.num { (p) }
                             td.num { @match at { Some(at) => (at), None => "none" } }
                             td.num { (high) }
                             td.num { @match at { Some(at) => ((high - at).max(0)), None => "—" } } }
                    } }
                } }
            }
        }
    }
}

/// The previous scrape of each endpoint: when, and its counters.
#[derive(Default)]
pub(crate) struct Scrapes(Mutex<HashMap<String, Scrape>>);

/// When an endpoint was read, and its counters then.
type Scrape = (Instant, HashMap<String, f64>);

/// A topic and partition.
type Partition = (String, i32);

/// Per outcome: the total, and per second where known.
type Outcomes = BTreeMap<String, (f64, Option<f64>)>;

/// A sample's labels, in order.
type Labels = Vec<(String, String)>;

/// One service, as its metrics tell.
struct Service {
    /// The endpoint without credentials.
    shown: String,
    state: Result<Metrics, String>,
}

#[derive(Default)]
struct Metrics {
    /// Per group: in an outage, paused partitions.
    groups: BTreeMap<String, (bool, f64)>,
    /// Per (handler, topic): per outcome, total and per second (from the
    /// previous scrape).
    handlers: BTreeMap<(String, String), Outcomes>,
}

/// Every endpoint at once: a slow one costs its timeout, not the sum.
async fn services(console: &Console) -> Vec<Service> {
    let mut scrapes = tokio::task::JoinSet::new();
    for (n, url) in console.metrics().iter().enumerate() {
        let url = url.clone();
        scrapes.spawn(async move { (n, scrape(&url).await) });
    }
    let mut answers: Vec<(usize, Result<String, String>)> = scrapes.join_all().await;
    answers.sort_by_key(|(n, _)| *n);
    answers
        .into_iter()
        .map(|(n, answer)| {
            let url = &console.metrics()[n];
            Service {
                shown: shown_url(url),
                state: answer.map(|text| read_metrics(console.scrapes(), url, &text)),
            }
        })
        .collect()
}

/// A URL as a page may show it: scheme, host, port and path; never its
/// credentials (whatever they hold, `/` included: everything up to the
/// last `@` goes) or its query (which may hold a token).
fn shown_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    let before_query = rest.split(['?', '#']).next().unwrap_or("");
    let from_host = before_query
        .rfind('@')
        .map_or(before_query, |at| &before_query[at + 1..]);
    format!("{scheme}://{from_host}")
}

/// GETs a metrics endpoint (`http://host:port/path`).
async fn scrape(url: &str) -> Result<String, String> {
    let uri: hyper::Uri = url.parse().map_err(|_| "not a URL".to_owned())?;
    if uri.scheme_str() != Some("http") {
        return Err("only http:// metrics endpoints".to_owned());
    }
    let host = uri.host().ok_or("no host")?.to_owned();
    let port = uri.port_u16().unwrap_or(80);
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let fetch = async {
        let stream = tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port))
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, format!("{host}:{port}"))
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("answered {}", response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_METRICS_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        String::from_utf8(body.to_vec()).map_err(|_| "not text".to_owned())
    };
    tokio::time::timeout(SCRAPE_TIMEOUT, fetch)
        .await
        .map_err(|_| format!("no answer in {SCRAPE_TIMEOUT:?}"))?
}

/// One sample of Prometheus' text format: name, labels, value. Written
/// here rather than taken from `prometheus-parse`, which splits labels on
/// every `,` and `=` (a consumer group may hold both) and brings chrono
/// and a regex engine: label values are read as the format quotes them.
fn sample(line: &str) -> Option<(&str, Labels, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find('{') {
        Some(brace) => (&line[..brace], &line[brace + 1..]),
        None => {
            let (name, value) = line.split_once(' ')?;
            return Some((
                name,
                Vec::new(),
                value.split_whitespace().next()?.parse().ok()?,
            ));
        }
    };
    let mut labels = Vec::new();
    let mut chars = rest.char_indices().peekable();
    let end = loop {
        while chars.next_if(|(_, c)| *c == ',' || *c == ' ').is_some() {}
        let (start, c) = chars.next()?;
        if c == '}' {
            break start;
        }
        let mut key = String::from(c);
        for (_, c) in chars.by_ref() {
            if c == '=' {
                break;
            }
            key.push(c);
        }
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()?.1 {
                '"' => break,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        }
        labels.push((key, value));
    };
    let value = rest[end + 1..].split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

/// The dedup metrics of one scrape, with rates from the previous one.
fn read_metrics(scrapes: &Scrapes, url: &str, text: &str) -> Metrics {
    let mut metrics = Metrics::default();
    let mut counters = HashMap::new();
    let label = |labels: &[(String, String)], name: &str| {
        labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    for (name, labels, value) in text.lines().filter_map(sample) {
        match name {
            "dedup_outage" => {
                metrics.groups.entry(label(&labels, "group")).or_default().0 = value > 0.0;
            }
            "dedup_paused_partitions" => {
                metrics.groups.entry(label(&labels, "group")).or_default().1 = value;
            }
            "dedup_messages_total" | "dedup_retries_total" => {
                let outcome = if name == "dedup_retries_total" {
                    "retried".to_owned()
                } else {
                    label(&labels, "outcome")
                };
                let handler = (label(&labels, "handler"), label(&labels, "topic"));
                let key = format!("{}\u{0}{}\u{0}{outcome}", handler.0, handler.1);
                let total = counters.entry(key).or_insert(0.0);
                *total += value;
                let entry = metrics.handlers.entry(handler).or_default();
                entry.entry(outcome).or_insert((0.0, None)).0 += value;
            }
            _ => {}
        }
    }
    let now = Instant::now();
    let mut previous = scrapes.0.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((then, before)) = previous.get(url) {
        let seconds = now.duration_since(*then).as_secs_f64();
        if seconds > 0.5 {
            for ((handler, topic), outcomes) in &mut metrics.handlers {
                for (outcome, (total, rate)) in outcomes.iter_mut() {
                    let key = format!("{handler}\u{0}{topic}\u{0}{outcome}");
                    if let Some(earlier) = before.get(&key) {
                        *rate = Some(((*total - earlier) / seconds).max(0.0));
                    }
                }
            }
        }
    }
    previous.insert(url.to_owned(), (now, counters));
    metrics
}

fn service_card(service: &Service) -> Markup {
    html! {
        div.card.service {
            h3 { code { (service.shown) } }
            @match &service.state {
                Err(e) => p.error { "unreachable: " (e) },
                Ok(m) => {
                    @for (group, (outage, paused)) in &m.groups {
                        p {
                            "group " code { (group) } ": "
                            @if *outage { strong.outage { "waiting out an outage (database or broker)" } } @else { span.ok { "running" } }
                            @if *paused > 0.0 { ", " (paused) " partitions paused" }
                        }
                    }
                    @if m.handlers.is_empty() {
                        p.hint { "No events handled yet." }
                    } @else {
                        div.scroll { table.outcomes {
                            thead { tr {
                                th { "handler (scope)" } th { "topic" }
                                @for (_, label) in MAIN_OUTCOMES { th.num { (label) } }
                                th { "other" }
                            } }
                            tbody { @for ((handler, topic), outcomes) in &m.handlers {
                                tr {
                                    td { a href={ "/claims?scope=" (encode(handler)) } { code { (handler) } } }
                                    td.small { (topic) }
                                    @for (outcome, _) in MAIN_OUTCOMES {
                                        td.num data-outcome=(outcome) { (outcome_cell(outcomes.get(outcome))) }
                                    }
                                    td.small {
                                        @for (outcome, (total, _)) in outcomes {
                                            @if *total > 0.0 && !MAIN_OUTCOMES.iter().any(|(o, _)| o == outcome) {
                                                (outcome) " " (total) " "
                                            }
                                        }
                                    }
                                }
                            } }
                        } }
                        p.hint { "Totals since each service started; per second since the previous look." }
                    }
                }
            }
        }
    }
}

/// The outcomes with a column of their own.
const MAIN_OUTCOMES: [(&str, &str); 4] = [
    ("applied", "applied"),
    ("skipped", "duplicates skipped"),
    ("dead_lettered", "dead-lettered"),
    ("retried", "retried"),
];

/// A total, and its rate where known.
fn outcome_cell(value: Option<&(f64, Option<f64>)>) -> String {
    match value {
        None => "0".to_owned(),
        Some((total, None)) => format!("{total}"),
        Some((total, Some(rate))) => format!("{total} ({rate:.1}/s)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_samples_are_read_with_their_labels() {
        let (name, labels, value) =
            sample(r#"dedup_messages_total{topic="p",handler="a::b",outcome="applied"} 42"#)
                .unwrap();
        assert_eq!((name, value), ("dedup_messages_total", 42.0));
        assert_eq!(labels[1], ("handler".to_owned(), "a::b".to_owned()));
        let (_, labels, _) = sample(r#"x{a="q\"u\\o,te}"} 1 1700000000"#).unwrap();
        assert_eq!(labels, [("a".to_owned(), r#"q"u\o,te}"#.to_owned())]);
        assert_eq!(sample("up 1").map(|s| s.2), Some(1.0));
        assert!(sample("# HELP x y").is_none() && sample("x{a=1} 2").is_none());
    }

    #[test]
    fn rates_come_from_two_scrapes() {
        let scrapes = Scrapes::default();
        let text = |n: u32| {
            format!(
                "dedup_messages_total{{topic=\"t\",handler=\"h\",outcome=\"applied\"}} {n}\ndedup_outage{{group=\"g\"}} 1\n"
            )
        };
        let first = read_metrics(&scrapes, "u", &text(10));
        assert_eq!(
            first.handlers[&("h".into(), "t".into())]["applied"],
            (10.0, None)
        );
        assert_eq!(first.groups["g"], (true, 0.0));
        // As if the first scrape were a second earlier.
        scrapes.0.lock().unwrap().get_mut("u").unwrap().0 -= Duration::from_secs(1);
        let second = read_metrics(&scrapes, "u", &text(30));
        let (total, rate) = second.handlers[&("h".into(), "t".into())]["applied"];
        assert_eq!(total, 30.0);
        assert!(rate.is_some_and(|r| (r - 20.0).abs() < 1.0), "{rate:?}");
    }

    #[test]
    fn assignments_and_urls_are_read_safely() {
        let mut bytes = vec![
            0, 0, 0, 0, 0, 1, 0, 1, b't', 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 5,
        ];
        assert_eq!(assignment(&bytes), [("t".to_owned(), vec![3, 5])]);
        bytes.truncate(15);
        assert!(
            assignment(&bytes).is_empty(),
            "cut short: nothing, no panic"
        );
        for url in [
            "http://user:secret@host:9464/metrics",
            "http://host:9464/metrics?token=secret",
            "http://user:se/cret@host:9464/metrics",
        ] {
            let shown = shown_url(url);
            assert!(
                !shown.contains("secret") && !shown.contains("cret"),
                "{url}: {shown}"
            );
        }
        assert_eq!(
            shown_url("http://a:b@host:9464/metrics?t=1"),
            "http://host:9464/metrics"
        );
    }
}
