//! The dead-letter pages: the topics, one topic's letters newest first
//! (read by offsets from each partition's end, never the whole topic),
//! one letter, and a replay (`dlq replay` itself, dry run first).

use std::collections::{BTreeMap, HashMap};

use hyper::StatusCode;
use maud::{Markup, html};
use rdkafka::consumer::Consumer as _;
use rdkafka::message::{Headers as _, Message as _};

use super::pages::{encode, failed, layout};
use super::{Answer, Asked, Console, blocking};
use crate::claims::Claims;
use crate::dlq::{DeadLetter, event_id, parse_key, preview};
use crate::kafka::{self, TIMEOUT};
use crate::time::{human_seconds, rfc3339_millis};
use crate::{Failure, KafkaArgs};

/// Dead letters on one page.
const PAGE: usize = 50;

/// Records read per partition in a first step back from the end; each
/// further step reads twice as many, up to [`MAX_STEP`].
const FIRST_STEP: i64 = 100;
const MAX_STEP: i64 = 5_000;

/// The most records one page reads looking for matches: a search of a
/// larger topic goes on from the next page.
const SCAN_LIMIT: u64 = 100_000;

/// The most of a payload a page shows.
const SHOWN_BYTES: usize = 64 * 1024;

/// Whether a topic's name says it holds dead letters.
fn is_dead_letter_topic(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    ["dlq", "dlt", "dead-letter", "deadletter", "dead_letter"]
        .iter()
        .any(|end| lower.ends_with(end))
}

/// A consumer that reads and commits nothing (it never joins a group).
/// (It reads the settings file and starts a client: run it with
/// [`blocking`].)
pub(crate) fn reader(kafka: &KafkaArgs) -> Result<kafka::KafkaConsumer, Failure> {
    let group = format!("dedup-console-{}", uuid::Uuid::new_v4().simple());
    kafka::consumer(kafka, &group)
}

/// A topic name as Kafka allows it, or none.
pub(super) fn valid_topic(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 249
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// `/dlq`: the dead-letter topics and how many records each holds.
pub(crate) async fn topics(console: &Console, asked: &Asked) -> Answer {
    // The "another topic" form.
    if let Some(topic) = asked.query.get("topic").filter(|t| valid_topic(t)) {
        return Answer::Redirect(format!("/dlq/{topic}"));
    }
    let kafka = console.kafka().clone();
    let listed = blocking(move || {
        let consumer = reader(&kafka)?;
        let metadata = consumer
            .fetch_metadata(None, TIMEOUT)
            .map_err(|e| kafka::unreachable_brokers(&e))?;
        let mut topics = Vec::new();
        for topic in metadata.topics() {
            if !is_dead_letter_topic(topic.name()) {
                continue;
            }
            let mut records = 0;
            for p in topic.partitions() {
                let (low, high) = consumer
                    .fetch_watermarks(topic.name(), p.id(), TIMEOUT)
                    .map_err(|e| kafka::unreachable_brokers(&e))?;
                records += high - low;
            }
            topics.push((topic.name().to_owned(), topic.partitions().len(), records));
        }
        topics.sort();
        Ok(topics)
    })
    .await;
    let topics = match listed {
        Ok(t) => t,
        Err(e) => return failed(console, "Dead letters", &e),
    };
    let body = html! {
        @if topics.is_empty() {
            p.notice { "No dead-letter topic on these brokers (names ending in .dlq, -dlq, .dlt ...)." }
        } @else {
            div.scroll { table {
                thead { tr { th { "topic" } th.num { "partitions" } th.num { "records" } } }
                tbody {
                    @for (name, partitions, records) in &topics {
                        tr {
                            td { a href={ "/dlq/" (name) } { code { (name) } } }
                            td.num { (partitions) } td.num { (records) }
                        }
                    }
                }
            } }
        }
        form.inline method="get" action="/dlq" {
            label { "Another topic " input name="topic" placeholder="orders.failed"; }
            button type="submit" { "Open" }
        }
    };
    Answer::Page(StatusCode::OK, layout(Some(console), "Dead letters", body))
}

/// What a topic page lists.
#[derive(Default)]
pub(super) struct Filter {
    pub(super) kind: Option<String>,
    pub(super) search: Option<String>,
}

impl Filter {
    fn matches(&self, letter: &DeadLetter) -> bool {
        if let Some(kind) = &self.kind
            && letter.kind.as_deref().unwrap_or("(none)") != kind
        {
            return false;
        }
        let Some(q) = &self.search else {
            return true;
        };
        let text = |bytes: Option<&[u8]>| {
            bytes.is_some_and(|b| String::from_utf8_lossy(b).contains(q.as_str()))
        };
        text(letter.msg.key())
            || text(letter.msg.payload())
            || letter.at() == *q
            || letter.origin.as_ref().is_some_and(|o| o.to_string() == *q)
    }
}

/// A page of a topic's dead letters, newest first.
struct Window {
    letters: Vec<DeadLetter>,
    /// Records read, and of them, per kind.
    scanned: u64,
    kinds: BTreeMap<String, usize>,
    /// Records in the topic.
    total: i64,
    /// Where the next page starts, per partition, if anything is left.
    next: Option<HashMap<i32, i64>>,
}

/// Reads back from each partition's end (or from `before`) until a page
/// of matches is found, the topic's start is reached or [`SCAN_LIMIT`]
/// records were read. A page is the newest matches by time, each
/// partition's in offset order (a partition is never reordered, whatever
/// its producers' clocks say), so the next page starts below the oldest
/// shown of each partition and repeats or skips nothing.
fn newest(
    consumer: &kafka::KafkaConsumer,
    topic: &str,
    filter: &Filter,
    before: &HashMap<i32, i64>,
) -> Result<Window, Failure> {
    let marks = kafka::watermarks(consumer, topic)?;
    let total = marks.iter().map(|(_, low, high)| high - low).sum();
    let lows: HashMap<i32, i64> = marks.iter().map(|&(p, low, _)| (p, low)).collect();
    let mut upper: HashMap<i32, i64> = marks
        .iter()
        .map(|&(p, low, high)| (p, before.get(&p).map_or(high, |&b| b.min(high)).max(low)))
        .collect();
    // Per partition, its newest matches (at most a page, highest offset
    // last), and above which offset a match was let go for the next page.
    let mut kept: HashMap<i32, Vec<DeadLetter>> = HashMap::new();
    let mut dropped: HashMap<i32, i64> = HashMap::new();
    let (mut kinds, mut scanned, mut step) = (BTreeMap::new(), 0u64, FIRST_STEP);
    loop {
        let found: usize = kept.values().map(Vec::len).sum();
        let ranges: HashMap<i32, (i64, i64)> = upper
            .iter()
            .filter(|&(p, &up)| up > lows[p])
            .map(|(&p, &up)| (p, ((up - step).max(lows[&p]), up)))
            .collect();
        if ranges.is_empty() || found >= PAGE || scanned >= SCAN_LIMIT {
            break;
        }
        // This step's matches: each partition's last (newest) PAGE.
        let mut step_matches: HashMap<i32, std::collections::VecDeque<DeadLetter>> = HashMap::new();
        kafka::visit_ranges(consumer, topic, &ranges, |msg| {
            let letter = DeadLetter::parse(msg);
            scanned += 1;
            *kinds
                .entry(letter.kind.clone().unwrap_or_else(|| "(none)".to_owned()))
                .or_insert(0) += 1;
            if filter.matches(&letter) {
                let p = letter.msg.partition();
                let run = step_matches.entry(p).or_default();
                run.push_back(letter);
                if run.len() > PAGE {
                    let gone = run.pop_front().expect("longer than a page");
                    let at = dropped.entry(p).or_insert(i64::MIN);
                    *at = (*at).max(gone.msg.offset() + 1);
                }
            }
        })?;
        // Older than what is kept: kept only while a partition has less
        // than a page.
        for (p, run) in step_matches {
            let have = kept.entry(p).or_default();
            let room = PAGE.saturating_sub(have.len());
            let mut run: Vec<DeadLetter> = run.into_iter().collect();
            let cut = run.len().saturating_sub(room);
            for gone in run.drain(..cut) {
                let at = dropped.entry(p).or_insert(i64::MIN);
                *at = (*at).max(gone.msg.offset() + 1);
            }
            run.append(have);
            *have = run;
        }
        // Read down to each range's start (records or not: markers,
        // compacted offsets).
        for (&p, &(from, _)) in &ranges {
            upper.insert(p, from);
        }
        step = (step * 2).min(MAX_STEP);
    }
    // The page: repeatedly the newest head among the partitions.
    let mut letters = Vec::new();
    while letters.len() < PAGE {
        let Some((&p, _)) = kept
            .iter()
            .filter_map(|(p, run)| run.last().map(|l| (p, l)))
            .max_by(|(pa, a), (pb, b)| a.millis().cmp(&b.millis()).then(pb.cmp(pa)))
        else {
            break;
        };
        letters.push(kept.get_mut(&p).and_then(Vec::pop).expect("a head"));
    }
    // The next page: below what was read, except where a match was left
    // for it (from just above the newest of those).
    for (p, run) in &kept {
        if let Some(newest_left) = run.last() {
            let at = dropped.entry(*p).or_insert(i64::MIN);
            *at = (*at).max(newest_left.msg.offset() + 1);
        }
    }
    let exhausted = upper.iter().all(|(p, &up)| up <= lows[p]) && dropped.is_empty();
    let next = (!exhausted).then(|| {
        let mut next = upper.clone();
        for (p, at) in dropped {
            next.insert(p, at.max(next[&p]));
        }
        next
    });
    Ok(Window {
        letters,
        scanned,
        kinds,
        total,
        next,
    })
}

/// A page cursor as a query value: `partition:offset,...`.
fn cursor_text(next: &HashMap<i32, i64>) -> String {
    let mut parts: Vec<_> = next.iter().collect();
    parts.sort();
    parts
        .iter()
        .map(|(p, o)| format!("{p}:{o}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn cursor(text: Option<&str>) -> HashMap<i32, i64> {
    text.unwrap_or("")
        .split(',')
        .filter_map(|pair| {
            let (p, o) = pair.split_once(':')?;
            Some((p.trim().parse().ok()?, o.trim().parse().ok()?))
        })
        .collect()
}

/// `/dlq/<topic>`: its dead letters, newest first, by kind, searchable.
pub(crate) async fn topic(console: &Console, topic: &str, asked: &Asked) -> Answer {
    if !valid_topic(topic) {
        return super::not_found(console);
    }
    let filter = Filter {
        kind: asked.query.get("kind").map(str::to_owned),
        search: asked.query.get("q").map(str::to_owned),
    };
    let before = cursor(asked.query.get("before"));
    let kafka = console.kafka().clone();
    let name = topic.to_owned();
    let started = std::time::Instant::now();
    let read = blocking(move || {
        let consumer = reader(&kafka)?;
        let filter = filter;
        let window = newest(&consumer, &name, &filter, &before)?;
        Ok((window, filter))
    })
    .await;
    let (window, filter) = match read {
        Ok(read) => read,
        Err(e) => return failed(console, topic, &e),
    };
    let took = started.elapsed();
    let base = format!("/dlq/{topic}");
    let with = |kind: Option<&str>| {
        let mut url = base.clone();
        let mut sep = '?';
        if let Some(kind) = kind {
            url.push_str(&format!("{sep}kind={}", encode(kind)));
            sep = '&';
        }
        if let Some(q) = &filter.search {
            url.push_str(&format!("{sep}q={}", encode(q)));
        }
        url
    };
    let older = window.next.as_ref().map(|next| {
        let url = with(filter.kind.as_deref());
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}before={}", cursor_text(next))
    });
    let body = html! {
        p {
            (window.total) " records in the topic. "
            span.small { "Read " (window.scanned) " from the end in " (format!("{:.0} ms", took.as_secs_f64() * 1000.0)) "." }
        }
        nav.kinds {
            a.kind.current[filter.kind.is_none()] href=(with(None)) { "all" }
            @for (kind, n) in &window.kinds {
                a.kind.current[filter.kind.as_deref() == Some(kind.as_str())] href=(with(Some(kind))) {
                    (kind) " " span.count { (n) }
                }
            }
            @if let Some(kind) = &filter.kind {
                @if !window.kinds.contains_key(kind) {
                    a.kind.current href=(with(Some(kind))) { (kind) }
                }
            }
        }
        p.hint { "Counts by kind are of the records read for this page." }
        form.inline method="get" action=(base) {
            @if let Some(kind) = &filter.kind { input type="hidden" name="kind" value=(kind); }
            label { "Search " input type="search" name="q" value=(filter.search.as_deref().unwrap_or("")) placeholder="key, event id, text of the payload"; }
            button type="submit" { "Search" }
        }
        @if window.letters.is_empty() {
            p.notice id="no-letters" { "No dead letter here" @if filter.kind.is_some() || filter.search.is_some() { " matches" } "." }
        } @else {
            div.scroll { table id="letters" {
                thead { tr { th { "when" } th { "kind" } th { "key" } th { "error" } th { "original" } th { "at" } } }
                tbody {
                    @for letter in &window.letters {
                        @let at = format!("{}/{}/{}", topic, letter.msg.partition(), letter.msg.offset());
                        tr {
                            td.small { (letter.millis().map(rfc3339_millis).unwrap_or_default()) }
                            td { span.kind { (letter.kind.as_deref().unwrap_or("(none)")) } }
                            td { code { (preview(letter.msg.key(), 40)) } }
                            td.error-text { (letter.error.as_deref().map(|e| shorten(e, 120)).unwrap_or_default()) }
                            td.small { (letter.origin.as_ref().map(ToString::to_string).unwrap_or_default()) }
                            td { a href={ "/dlq/" (at) } { (letter.msg.partition()) "/" (letter.msg.offset()) } }
                        }
                    }
                }
            } }
        }
        @if let Some(older) = &older {
            p { a id="older" href=(older) { "Older →" } }
        }
        @if !console.read_only() {
            (super::replay::replay_form(console, topic, &filter))
        }
    };
    Answer::Page(StatusCode::OK, layout(Some(console), topic, body))
}

/// At most `max` bytes of `text`, at a character boundary.
fn shorten(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// `/dlq/<topic>/<partition>/<offset>`: one dead letter.
pub(crate) async fn letter(
    console: &Console,
    topic: &str,
    partition: i32,
    offset: i64,
    asked: &Asked,
) -> Answer {
    if !valid_topic(topic) {
        return super::not_found(console);
    }
    let kafka = console.kafka().clone();
    let name = topic.to_owned();
    let read = blocking(move || {
        let consumer = reader(&kafka)?;
        let marks = kafka::watermarks(&consumer, &name)?;
        let Some(&(_, low, high)) = marks.iter().find(|(p, _, _)| *p == partition) else {
            return Ok(None);
        };
        if offset < low || offset >= high {
            return Ok(None);
        }
        let ranges = HashMap::from([(partition, (offset, offset + 1))]);
        Ok(kafka::read_ranges(&consumer, &name, &ranges)?
            .remove(&partition)
            .and_then(|mut records| records.pop())
            .filter(|msg| msg.offset() == offset)
            .map(DeadLetter::parse))
    })
    .await;
    let letter = match read {
        Ok(Some(letter)) => letter,
        Ok(None) => {
            return Answer::Page(
                StatusCode::NOT_FOUND,
                layout(
                    Some(console),
                    "No such record",
                    html! { p.notice { "No record at " code { (topic) "/" (partition) "/" (offset) } " (deleted by retention, or never written)." } p { a href={ "/dlq/" (topic) } { "Back to " (topic) } } },
                ),
            );
        }
        Err(e) => return failed(console, topic, &e),
    };
    let key_spec = asked.query.get("key").unwrap_or(console.key()).to_owned();
    let claim = claim_of(console, &letter, &key_spec).await;
    let title = format!("{topic}/{partition}/{offset}");
    let body = html! {
        p { a href={ "/dlq/" (topic) } { "← " (topic) } }
        div.card id="why" {
            dl {
                dt { "kind" } dd { span.kind id="kind" { (letter.kind.as_deref().unwrap_or("(none)")) } }
                dt { "reason" } dd.error-text id="reason" { (letter.error.as_deref().unwrap_or("(none)")) }
                dt { "handler" } dd { code { (letter.handler.as_deref().unwrap_or("(none)")) } }
                @if let Some(id) = letter.schema_id { dt { "schema id" } dd id="schema-id" { (id) } }
                dt { "original" } dd { (letter.origin.as_ref().map(ToString::to_string).unwrap_or_else(|| "(unknown: no dedup.original.* headers)".to_owned())) }
                dt { "dead-lettered at" } dd { (letter.millis().map(rfc3339_millis).unwrap_or_default()) }
                @if letter.replays > 0 { dt { "replayed before" } dd { (letter.replays) " times" } }
                @if letter.truncated { dt { "payload" } dd.warning { "cut to fit the dead-letter topic: a replay would send a different event, so it is not replayed (the original is whole in its topic)" } }
                @if let Some(why) = &letter.malformed { dt { "headers" } dd.error { (why) } }
            }
        }
        section {
            h2 { "Its claim" }
            (claim)
            form.inline method="get" action={ "/dlq/" (title) } {
                label { "Key " input name="key" value=(key_spec) size="30"; }
                button type="submit" { "Look up" }
            }
        }
        section {
            h2 { "Key" }
            pre { (preview(letter.msg.key(), 1024)) }
            h2 { "Payload" }
            (payload(letter.msg.payload()))
            h2 { "Headers" }
            div.scroll { table id="headers" {
                thead { tr { th { "name" } th { "value" } } }
                tbody {
                    @for h in letter.msg.headers().into_iter().flat_map(|hs| hs.iter()) {
                        tr { td { code { (h.key) } } td.small { (preview(h.value, 2048)) } }
                    }
                }
            } }
        }
    };
    Answer::Page(StatusCode::OK, layout(Some(console), &title, body))
}

/// Whether the letter's event holds a claim, as far as the console can tell.
async fn claim_of(console: &Console, letter: &DeadLetter, key_spec: &str) -> Markup {
    let Some(db) = console.db() else {
        return html! { p.hint { "Start the console with a database to see whether this event holds a claim." } };
    };
    let Some(scope) = letter.handler.as_deref() else {
        return html! { p.hint { "No dedup.handler header: the handler's scope is unknown." } };
    };
    let parts = match parse_key(key_spec) {
        Ok(parts) if !parts.is_empty() => parts,
        Ok(_) => return html! { p.hint { "Name where the handler takes the event id from." } },
        Err(e) => return html! { p.error { (e.to_string()) } },
    };
    let Some(id) = event_id(letter, &parts) else {
        return html! { p.notice id="claim-state" { "This record has no " code { (key_spec) } ": no event id, so no claim (a keyless event is dead-lettered, never claimed)." } };
    };
    let looked = async {
        let claims = Claims::connect(db).await?;
        let key = Claims::key(scope, &id)?;
        Ok::<_, Failure>((claims.record(&key).await?, key))
    }
    .await;
    match looked {
        Err(e) => html! { p.error { (e.to_string()) } },
        Ok((None, key)) => html! {
            p.notice id="claim-state" { "No claim for " code { (key) } ": the event was not applied; a replay applies it." }
        },
        Ok((Some(record), key)) if record.live() => html! {
            p.warning id="claim-state" {
                "Live claim for " code { (key) } " until " (crate::time::rfc3339(record.expires_at))
                @if record.in_progress { " (a lease in progress)" } @else { ": applied through another copy or path; a replay with a claim check skips it" }
                ". " a href={ "/claims?scope=" (encode(scope)) "&key=" (encode(&id)) } { "See the claim" }
            }
        },
        Ok((Some(record), key)) => html! {
            p.notice id="claim-state" { "The claim for " code { (key) } " expired " (human_seconds(-record.expires_in_seconds())) " ago: a replay applies the event again." }
        },
    }
}

/// A payload as a person can read it: JSON indented, text as text,
/// anything else in hex; at most [`SHOWN_BYTES`] of it.
fn payload(bytes: Option<&[u8]>) -> Markup {
    let Some(bytes) = bytes else {
        return html! { p.hint { "(no payload)" } };
    };
    let cut = bytes.len() > SHOWN_BYTES;
    let note = html! { @if cut { p.hint { "Showing the first " (SHOWN_BYTES / 1024) " KiB of " (bytes.len()) " bytes." } } };
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes) {
        let pretty = serde_json::to_string_pretty(&value).unwrap_or_default();
        return html! { p.hint { "JSON, " (bytes.len()) " bytes" } pre id="payload" { (shorten(&pretty, SHOWN_BYTES)) } (note) };
    }
    let shown = &bytes[..bytes.len().min(SHOWN_BYTES)];
    match std::str::from_utf8(shown) {
        Ok(text) => {
            html! { p.hint { "Text, " (bytes.len()) " bytes" } pre id="payload" { (text) } (note) }
        }
        Err(e) if e.error_len().is_none() => {
            // Cut inside a character: the text up to it.
            let text = std::str::from_utf8(&shown[..e.valid_up_to()]).unwrap_or_default();
            html! { p.hint { "Text, " (bytes.len()) " bytes" } pre id="payload" { (text) } (note) }
        }
        Err(_) => {
            let shown = &bytes[..bytes.len().min(4096)];
            html! {
                p.hint { "Binary, " (bytes.len()) " bytes" @if bytes.len() > 4096 { "; the first 4 KiB in hex" } }
                pre id="payload" { (hex_dump(shown)) }
            }
        }
    }
}

/// Offset, 16 bytes in hex, and their printable characters, per line.
fn hex_dump(bytes: &[u8]) -> String {
    let mut out = String::new();
    for (n, row) in bytes.chunks(16).enumerate() {
        let hex: Vec<String> = row.iter().map(|b| format!("{b:02x}")).collect();
        let text: String = row
            .iter()
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    b as char
                } else {
                    '.'
                }
            })
            .collect();
        out.push_str(&format!("{:08x}  {:<47}  {text}\n", n * 16, hex.join(" ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_what_it_wrote() {
        let next = HashMap::from([(0, 15), (2, 0), (1, 7)]);
        assert_eq!(cursor_text(&next), "0:15,1:7,2:0");
        assert_eq!(cursor(Some(&cursor_text(&next))), next);
        assert!(cursor(Some("x:1,2")).is_empty());
    }

    #[test]
    fn binary_payloads_are_shown_in_hex_and_long_ones_cut() {
        assert_eq!(
            hex_dump(b"ab\x00\xff"),
            "00000000  61 62 00 ff                                      ab..\n"
        );
        let long = "é".repeat(SHOWN_BYTES);
        let shown = payload(Some(long.as_bytes())).into_string();
        assert!(shown.contains("Showing the first 64 KiB"), "{shown}");
        assert!(shown.len() < SHOWN_BYTES + 1024);
        let json = payload(Some(br#"{"a":"<b>"}"#)).into_string();
        assert!(
            json.contains("&lt;b&gt;") && json.contains("JSON"),
            "escaped: {json}"
        );
        assert!(is_dead_letter_topic("orders.dlq") && is_dead_letter_topic("orders-DLT"));
        assert!(!is_dead_letter_topic("orders") && !valid_topic("a/b") && valid_topic("a.b-c_1"));
    }
}
