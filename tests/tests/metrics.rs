//! Metrics, consumer lag, health and the start-up TTL check: scraped over
//! HTTP from the examples (`METRICS_ADDR`), against the real Kafka and
//! PostgreSQL.

use dedup_tests::common;
use dedup_tests::common::free_port;

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedup_core::{HandlerExt, Ttl, idempotent};
use dedup_kafka::{Consumer, Relay, TtlCheck};
use dedup_postgres::PgTx;
use dedup_tests::{PaymentReceived, credit, payment, store};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use common::{
    KillOnDrop, brokers, create_topic, create_topic_with, database_url, example, producer, unique,
};

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

/// `GET path` on 127.0.0.1:`port`: the status and the body, or `None` while
/// nothing listens.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    request(port, "GET", path).await
}

/// `method path` on 127.0.0.1:`port`, as [`get`].
async fn request(port: u16, method: &str, path: &str) -> Option<(u16, String)> {
    let request = format!("{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        stream.write_all(request.as_bytes()).ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let status = response.split_whitespace().nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
        Some((status, body))
    })
    .await
    .expect("join")
}

/// The sum of the samples of `name` whose labels include all of `labels`
/// (`None` if there is none).
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
        if metric != name {
            continue;
        }
        if labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        {
            let value: f64 = value.parse().expect("a number");
            found = Some(found.unwrap_or(0.0) + value);
        }
    }
    found
}

/// The counters a payments example's `/metrics` shows for `topic`.
fn outcome(text: &str, topic: &str, outcome: &str) -> u64 {
    sample(
        text,
        "dedup_messages_total",
        &[("topic", topic), ("outcome", outcome)],
    )
    .unwrap_or(0.0) as u64
}

/// A stream with duplicates and poison through the payments example: the
/// counters it serves equal its last line, lag is above 0 while the backlog
/// drains and 0 after, and every duplicate left one duplicate-age sample.
/// `count` payment events with 10 % duplicates and some malformed produced
/// to a new topic of two partitions: the topic and how many of each.
fn produce_payments(topic: &str, count: u64) -> (u64, u64, u64) {
    let produced = Command::new(example("produce"))
        .args([
            "--count",
            &count.to_string(),
            "--duplicates",
            "0.1",
            "--malformed",
            "0.002",
        ])
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", topic)
        .output()
        .expect("run the producer");
    assert!(produced.status.success());
    // produced=N distinct=N duplicates=N malformed=N total_cents=N
    let line = common::last_line(&produced);
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {line:?}"))
    };
    (field("distinct"), field("duplicates"), field("malformed"))
}

/// Runs `consumer` (an example serving `/metrics` on `port`, exiting when
/// idle) over `topic`, which holds `distinct`, `duplicates` and
/// `malformed` events, scraping as it goes: the metrics count each outcome
/// as produced, lag shows the backlog and drains to 0, and the example's
/// own count agrees. The same for both runtimes.
async fn assert_metrics_match(
    mut consumer: Command,
    port: u16,
    topic: &str,
    (distinct, duplicates, malformed): (u64, u64, u64),
) {
    let child = consumer
        .args(["--exit-when-idle", "6s"])
        .env("KAFKA_STATISTICS_INTERVAL_MS", "200")
        .env("KAFKA_CFG_STATISTICS_INTERVAL_MS", "200")
        .env("METRICS_ADDR", format!("127.0.0.1:{port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the example");
    let mut child = KillOnDrop(Some(child));

    let deadline = Instant::now() + Duration::from_secs(90);
    let lag = |text: &str| sample(text, "dedup_consumer_lag", &[("topic", topic)]);
    let mut most_behind = 0.0_f64;
    let scraped = loop {
        assert!(Instant::now() < deadline, "the stream did not drain");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some((200, text)) = get(port, "/metrics").await else {
            continue;
        };
        most_behind = most_behind.max(lag(&text).unwrap_or(0.0));
        let finished = outcome(&text, topic, "applied")
            + outcome(&text, topic, "skipped")
            + outcome(&text, topic, "dead_lettered");
        if finished == distinct + duplicates + malformed && lag(&text) == Some(0.0) {
            break text;
        }
    };
    assert!(most_behind > 0.0, "a backlog shows as lag");
    let applied = outcome(&scraped, topic, "applied");
    let skipped = outcome(&scraped, topic, "skipped");
    let dead = outcome(&scraped, topic, "dead_lettered");
    assert_eq!((applied, skipped, dead), (distinct, duplicates, malformed));
    let ages = sample(
        &scraped,
        "dedup_duplicate_age_seconds_count",
        &[("topic", topic)],
    );
    assert_eq!(ages, Some(skipped as f64), "one age per duplicate");
    assert!(sample(&scraped, "dedup_batch_size_count", &[("topic", topic)]) > Some(0.0));
    assert!(
        sample(
            &scraped,
            "dedup_handler_duration_seconds_count",
            &[("topic", topic)]
        ) > Some(0.0)
    );
    assert_eq!(sample(&scraped, "dedup_outage", &[]), Some(0.0));
    assert!(
        sample(&scraped, "dedup_in_flight", &[("topic", topic)]).is_some(),
        "in flight is reported"
    );

    let output = child
        .0
        .take()
        .expect("child")
        .wait_with_output()
        .expect("exit");
    assert!(output.status.success());
    assert_eq!(
        common::last_line(&output),
        format!("applied={applied} skipped={skipped} dead_lettered={dead}"),
        "the metrics and the example's own count agree"
    );
}

#[sqlx::test(migrations = false)]
async fn the_payments_example_serves_metrics_that_match_its_counts(pool: PgPool) {
    let topic = create_topic(2).await;
    let counts = produce_payments(&topic, 8000);
    let payments = common::payments(&pool, &topic, &unique("g"));
    assert_metrics_match(payments, free_port(), &topic, counts).await;
}

/// The Kafka-only runtime records the same series with the same labels:
/// the same input gives the same counts as the database runtime's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_enrich_example_serves_the_same_metrics() {
    let topic = create_topic(2).await;
    // More than the database runtime's test: this runtime drains 8,000 in
    // two transactions, and lag (librdkafka's statistics, every 200 ms,
    // against the offsets committed when they are served) may then never
    // be seen above 0.
    let counts = produce_payments(&topic, 40_000);
    let mut enrich = Command::new(example("enrich"));
    enrich
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", &topic)
        .env("OUTPUT_TOPIC", create_topic(2).await)
        .env("GROUP_ID", unique("g"))
        .env_remove("DEDUP_FAILPOINT");
    assert_metrics_match(enrich, free_port(), &topic, counts).await;
}

/// `/healthz` is 503 while the consumer waits for its group to assign it
/// partitions (here: a member that stopped polling holds the rebalance up),
/// and 200 once it has them.
#[sqlx::test(migrations = false)]
async fn healthz_is_503_until_the_group_assigns_then_200(pool: PgPool) {
    let topic = create_topic(1).await;
    let group = unique("g");
    // A member that joins, then stops polling: the next rebalance waits for
    // it until it leaves (closed below). Its max.poll.interval.ms and
    // session timeout, after which it would be gone by itself, are far
    // longer than the example can take to start on a loaded machine (at
    // 30 s and 6 s, the group once assigned within the 3 s this test
    // waits).
    let stuck: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", &group)
        .set("session.timeout.ms", "45000")
        .set("max.poll.interval.ms", "600000")
        .create()
        .expect("member");
    stuck.subscribe(&[&topic]).expect("subscribe");
    let deadline = Instant::now() + Duration::from_secs(30);
    while stuck.assignment().map_or(0, |a| a.count()) == 0 {
        assert!(Instant::now() < deadline, "the first member never joined");
        let _ = stuck.poll(Duration::from_millis(100));
    }

    let port = free_port();
    let child = common::payments(&pool, &topic, &group)
        .env("METRICS_ADDR", format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the payments example");
    let _child = KillOnDrop(Some(child));
    // The server starts just before the consumer runs.
    let deadline = Instant::now() + Duration::from_secs(30);
    let first = loop {
        assert!(Instant::now() < deadline, "/healthz never answered");
        if let Some(answer) = get(port, "/healthz").await
            && answer.1.contains("\"running\":true")
        {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(first.0, 503, "not ready before the assignment: {}", first.1);
    let waiting: serde_json::Value = serde_json::from_str(&first.1).expect("JSON");
    assert_eq!(waiting["live"], true, "{waiting}");
    let payments = &waiting["components"][0];
    assert_eq!(payments["kind"], "consumer", "{waiting}");
    assert_eq!(payments["joined"], false, "{waiting}");
    // Still waiting a few seconds later: the rebalance is held up.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, body) = get(port, "/healthz").await.expect("answer");
    assert_eq!(status, 503, "{body}");

    let (status, _) = get(port, "/livez").await.expect("answer");
    assert_eq!(status, 200, "live while it waits for its group");

    // The stuck member leaves (closing, it answers the rebalance): the
    // group assigns the partition to the example.
    drop(stuck);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        assert!(Instant::now() < deadline, "never ready");
        // (The partition count is refreshed every second.)
        if let Some((200, body)) = get(port, "/healthz").await
            && body.contains("\"assigned_partitions\":1")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A 1 s TTL on a topic that keeps records for a week: the payments example
/// warns at start-up; under `TtlCheck::Strict` the consumer refuses to
/// start. A TTL longer than the topic keeps records (retention plus a
/// segment) passes silently and under `Strict` too.
#[sqlx::test(migrations = false)]
async fn the_ttl_is_checked_against_the_topics_retention(pool: PgPool) {
    let store = store(&pool).await;
    let week = create_topic_with(&brokers(), 1, &[("retention.ms", "604800000")]).await;
    let hour = create_topic_with(
        &brokers(),
        1,
        &[("retention.ms", "3600000"), ("segment.ms", "600000")],
    )
    .await;
    let warned = |topic: &str, ttl: &str| {
        let output = common::payments(&pool, topic, &unique("g"))
            .args(["--exit-when-idle", "1s"])
            .env("DEDUP_TTL", ttl)
            .output()
            .expect("run the payments example");
        assert!(output.status.success());
        String::from_utf8_lossy(&output.stderr).contains("is shorter than topic")
    };
    assert!(warned(&week, "1s"), "a 1 s TTL on a week's retention warns");
    assert!(
        !warned(&hour, "4h"),
        "4h covers an hour and a 10-minute segment"
    );

    let strict = |topic: &str, ttl: u64| {
        Consumer::builder(store.clone())
            .brokers(brokers())
            .group_id(unique("g"))
            .ttl_check(TtlCheck::Strict)
            .handle(
                topic,
                record_payment.with_ttl(Ttl::from_secs(ttl).expect("ttl")),
            )
            .build()
            .expect("consumer")
    };
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        strict(&week, 1).run_until(std::future::pending()),
    )
    .await
    .expect("refuses at once")
    .expect_err("Strict refuses a TTL shorter than the retention");
    assert!(
        refused.to_string().contains("is shorter than topic"),
        "{refused}"
    );
    let started = strict(&hour, 4 * 3600)
        .run_until(tokio::time::sleep(Duration::from_secs(2)))
        .await;
    assert!(started.is_ok(), "{started:?}");
}

/// The queries of every panel of the Grafana dashboard.
fn dashboard_queries() -> Vec<String> {
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../../dashboards/dedup.json"))
            .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            queries.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    queries
}

/// The metric names `text` mentions (histograms by their base name).
fn metric_names(text: &str, into: &mut BTreeSet<String>) {
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("dedup_") {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| word.strip_suffix(s))
                .unwrap_or(word);
            into.insert(base.to_owned());
        }
    }
}

/// Every panel of the dashboard is per service, so that one Prometheus
/// scraping several services shows them apart: each series it selects is
/// filtered by the `job` and `instance` variables, and each aggregation
/// keeps `job`.
#[test]
fn every_dashboard_panel_is_per_service() {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    for expr in dashboard_queries() {
        for (at, _) in expr.match_indices("dedup_") {
            if expr[..at].ends_with(is_word) {
                continue;
            }
            let rest = &expr[at..];
            let name_end = rest.find(|c: char| !is_word(c)).unwrap_or(rest.len());
            let selector = rest[name_end..]
                .strip_prefix('{')
                .and_then(|s| s.split_once('}'))
                .map(|(inside, _)| inside)
                .unwrap_or_else(|| panic!("{} has no selector in {expr}", &rest[..name_end]));
            for filter in [r#"job=~"$job""#, r#"instance=~"$instance""#] {
                assert!(selector.contains(filter), "{filter} missing in {expr}");
            }
        }
        for op in ["sum", "max", "min", "avg", "count"] {
            for (at, _) in expr.match_indices(op) {
                if expr[..at].ends_with(is_word) || expr[at + op.len()..].starts_with(is_word) {
                    continue;
                }
                let grouping = expr[at + op.len()..]
                    .trim_start()
                    .strip_prefix("by (")
                    .and_then(|s| s.split_once(')'))
                    .map(|(labels, _)| labels);
                assert!(
                    grouping.is_some_and(|g| g.split(", ").any(|l| l == "job")),
                    "{op} without `by (job, ..)` in {expr}"
                );
            }
        }
    }
}

/// Every metric the Grafana dashboard and the alert rules query is
/// exported by a running consumer and relay (the outbox example runs
/// both).
#[sqlx::test(migrations = false)]
async fn the_dashboard_queries_only_exported_metrics(pool: PgPool) {
    let mut queried = BTreeSet::new();
    for expr in dashboard_queries() {
        metric_names(&expr, &mut queried);
    }
    assert!(queried.len() >= 10, "{queried:?}");
    let alerts = include_str!("../../dashboards/alerts.yml");
    let rules: String = alerts
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let before = queried.len();
    metric_names(&rules, &mut queried);
    assert!(queried.contains("dedup_ttl_seconds"), "{queried:?}");
    assert!(
        queried.len() > before,
        "the alerts query more than the dashboard"
    );

    let payments = create_topic(1).await;
    let recorded = create_topic(1).await;
    // With a retry tier, for the tiers' row.
    common::create_named_topic(&format!("{payments}.retry-1m"), 1).await;
    let producer = producer();
    for i in 0..10 {
        let body = payment(uuid::Uuid::new_v4(), "acct", i);
        producer
            .send(
                FutureRecord::to(&payments).key("acct").payload(&body),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }
    let port = free_port();
    let child = Command::new(example("outbox"))
        .env("DATABASE_URL", database_url(&pool))
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", &payments)
        .env("RECORDED_TOPIC", &recorded)
        .env("GROUP_ID", unique("g"))
        .env("DEDUP_RETRY_TIERS", "1m")
        .env("METRICS_ADDR", format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the outbox example");
    let _child = KillOnDrop(Some(child));
    // Lag comes with librdkafka's statistics, every 5 s by default.
    let deadline = Instant::now() + Duration::from_secs(60);
    let missing = loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some((200, text)) = get(port, "/metrics").await else {
            continue;
        };
        let exported: BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let missing: Vec<_> = queried
            .iter()
            .filter(|q| !exported.contains(q.as_str()))
            .cloned()
            .collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing;
        }
    };
    assert!(
        missing.is_empty(),
        "queried by the dashboard, never exported: {missing:?}"
    );
}

/// `serve_http` on the builder: nothing is served before the consumer runs;
/// while it runs `/readyz` turns 200 once it is assigned, `/metrics` counts
/// what it applied, other paths are 404 and other methods 405; a second
/// consumer cannot take the same address (its build fails, naming it); and
/// once `run_until` returns, nothing answers any more.
#[sqlx::test(migrations = false)]
async fn serve_http_serves_while_the_consumer_runs(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    let consumer = Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(&group)
        .handle(&topic, record_payment)
        .serve_http("127.0.0.1:0")
        .build()
        .expect("consumer");
    let addr = consumer.http_addr().expect("serve_http binds at build");
    let port = addr.port();
    assert_eq!(get(port, "/livez").await, None, "served only while running");
    let again = Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(unique("g"))
        .handle(&topic, record_payment)
        .serve_http(addr.to_string())
        .build()
        .expect_err("the address is taken");
    assert!(again.to_string().contains(&addr.to_string()), "{again}");

    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(60);
    let ready = loop {
        assert!(Instant::now() < deadline, "never ready");
        if let Some((200, body)) = get(port, "/readyz").await {
            break body;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let ready: serde_json::Value = serde_json::from_str(&ready).expect("JSON");
    assert_eq!(ready["ready"], true, "{ready}");
    let component = &ready["components"][0];
    assert_eq!(component["name"], group.as_str(), "{ready}");
    assert_eq!(component["kind"], "consumer", "{ready}");
    assert_eq!(component["joined"], true, "{ready}");
    assert!(component["since_last_poll_seconds"].is_f64(), "{ready}");
    assert_eq!(get(port, "/livez").await.map(|a| a.0), Some(200));
    assert_eq!(get(port, "/healthz").await.map(|a| a.0), Some(200));

    producer()
        .send(
            FutureRecord::to(&topic)
                .key("acct")
                .payload(&payment(uuid::Uuid::new_v4(), "acct", 5)),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats.snapshot().applied < 1 {
        assert!(Instant::now() < deadline, "never applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, text) = get(port, "/metrics").await.expect("answer");
    assert_eq!(status, 200);
    assert_eq!(outcome(&text, &topic, "applied"), 1, "{text}");
    // What the TTL alert compares: the handler's TTL and how long the
    // topic keeps records, read at start-up.
    let ttl = sample(&text, "dedup_ttl_seconds", &[("topic", &topic)]);
    assert_eq!(ttl, Some(4.0 * 3600.0), "{text}");
    let kept = sample(&text, "dedup_topic_readable_seconds", &[("topic", &topic)]);
    assert!(kept.is_some_and(|s| s > 4.0 * 3600.0), "{text}");
    assert_eq!(get(port, "/nope").await.map(|a| a.0), Some(404));
    assert_eq!(
        request(port, "POST", "/readyz").await.map(|a| a.0),
        Some(405)
    );

    let _ = stop.send(());
    running.await.expect("join").expect("ran");
    assert_eq!(get(port, "/livez").await, None, "stopped with the consumer");
}

/// A relay's health: ready while its outbox answers; over a database that
/// does not answer it is live (its loop turns) but not ready, and says it
/// is waiting out an outage.
#[sqlx::test(migrations = false)]
async fn the_relay_serves_its_health(pool: PgPool) {
    let store = store(&pool).await;
    dedup_postgres::OutboxWriter::default()
        .migrate(&pool)
        .await
        .expect("migrate the outbox");
    let relay = |outbox| {
        Relay::builder(outbox)
            .brokers(brokers())
            .poll_interval(Duration::from_millis(200))
            .store_timeout(Duration::from_secs(1))
            .serve_http("127.0.0.1:0")
            .build()
            .expect("relay")
    };
    // Runs `relay` until `/readyz` answers `want` with a relay whose
    // `field` is `value`: that answer, and what `/livez` said then.
    let health = async |relay: Relay<dedup_postgres::OutboxReader>,
                        want: u16,
                        (field, value): (&str, bool)| {
        let port = relay.http_addr().expect("bound").port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        }));
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = None;
        let body = loop {
            assert!(
                Instant::now() < deadline,
                "/readyz never {want} with {field}={value}: {last:?}"
            );
            last = get(port, "/readyz").await;
            if let Some((status, body)) = &last
                && *status == want
            {
                let body: serde_json::Value = serde_json::from_str(body).expect("JSON");
                if body["components"][0][field] == value {
                    break body;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let live = get(port, "/livez").await.map(|a| a.0);
        let _ = stop.send(());
        running.await.expect("join").expect("ran");
        (body, live)
    };

    let (answering, live) =
        health(relay(store.outbox_reader()), 200, ("store_answered", true)).await;
    let component = &answering["components"][0];
    assert_eq!(component["kind"], "relay", "{answering}");
    assert_eq!(component["store_answered"], true, "{answering}");
    assert_eq!(component["outage"], false, "{answering}");
    assert_eq!(live, Some(200));

    // Nothing listens on port 1: every statement fails at once.
    let nowhere = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://dedup@127.0.0.1:1/dedup")
        .expect("a lazy pool");
    let down = dedup_postgres::PgStore::from_pool(nowhere).outbox_reader();
    let (failing, live) = health(relay(down), 503, ("outage", true)).await;
    let component = &failing["components"][0];
    assert_eq!(component["outage"], true, "{failing}");
    assert_eq!(component["store_answered"], false, "{failing}");
    assert_eq!(live, Some(200), "live: its loop turns while it waits");
}

/// A manifest of deploy/kubernetes: its documents.
fn manifest(name: &str) -> Vec<String> {
    let path = format!("{}/../deploy/kubernetes/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.split("\n---\n").map(str::to_owned).collect()
}

/// The document of `kind` in `docs`.
fn document<'a>(docs: &'a [String], kind: &str) -> &'a str {
    docs.iter()
        .find(|d| d.lines().any(|l| l == format!("kind: {kind}")))
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// A ConfigMap's `data`, read line by line (`  KEY: "value"`; the
/// manifests' own layout, which deploy/kubernetes/check decodes strictly).
fn config_map_data(doc: &str) -> Vec<(String, String)> {
    doc.lines()
        .skip_while(|l| *l != "data:")
        .skip(1)
        .take_while(|l| l.starts_with("  ") || l.is_empty())
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (k, v) = l.trim().split_once(": ").expect("key: value");
            (k.to_owned(), v.trim_matches('"').to_owned())
        })
        .collect()
}

/// The paths a workload's probes GET, and its container's `args`.
fn probes_and_args(doc: &str) -> (BTreeSet<String>, Vec<String>) {
    let paths = doc
        .lines()
        .filter_map(|l| l.trim().strip_prefix("path: "))
        .map(str::to_owned)
        .collect();
    let args = doc
        .lines()
        .find_map(|l| l.trim().strip_prefix("args: "))
        .map(|a| serde_json::from_str(a).expect("args as a flow list"))
        .unwrap_or_default();
    (paths, args)
}

/// Runs an example as its manifest runs it (the ConfigMap's settings, the
/// probes' port from its METRICS_ADDR, the container's args; only where the
/// database, the brokers and the topics are is this test's) and expects
/// every path its probes GET to answer 200 once it has started, and
/// `/metrics` too.
async fn serves_its_probes(
    example_name: &str,
    manifest_name: &str,
    kind: &str,
    pool: &PgPool,
    extra: &[(&str, String)],
) {
    let docs = manifest(manifest_name);
    let (paths, args) = probes_and_args(document(&docs, kind));
    assert!(
        paths.contains("/livez") && paths.contains("/readyz"),
        "{paths:?}"
    );
    let mut cmd = Command::new(example(example_name));
    let mut port = None;
    for (key, value) in config_map_data(document(&docs, "ConfigMap")) {
        match key.as_str() {
            "KAFKA_BROKERS" => cmd.env(key, brokers()),
            "TOPIC" => cmd.env(key, create_topic(1).await),
            "GROUP_ID" => cmd.env(key, unique("g")),
            "METRICS_ADDR" => {
                let (_, p) = value.rsplit_once(':').expect("host:port");
                port = Some(p.parse::<u16>().expect("a port"));
                // The manifest's port; loopback only.
                cmd.env(key, format!("127.0.0.1:{p}"))
            }
            _ => cmd.env(key, value),
        };
    }
    let port = port.expect("the ConfigMap sets METRICS_ADDR");
    cmd.env("DATABASE_URL", database_url(pool))
        .env_remove("DEDUP_FAILPOINT")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (key, value) in extra {
        cmd.env(key, value);
    }
    let _child = KillOnDrop(Some(cmd.spawn().expect("start the example")));
    for path in paths.iter().map(String::as_str).chain(["/metrics"]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = None;
        while last.as_ref().is_none_or(|(status, _)| *status != 200) {
            assert!(
                Instant::now() < deadline,
                "{example_name} as {manifest_name} runs it: {path} answered {last:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            last = get(port, path).await;
        }
    }
}

/// What deploy/kubernetes runs is served: the payments example with the
/// StatefulSet's settings (static membership by pod name included) and the
/// outbox example in the relay Deployment's role each answer 200 on every
/// path their probes GET, on the port the manifests name. (The manifests'
/// own consistency and schema are checked by deploy/kubernetes/check.)
#[sqlx::test(migrations = false)]
async fn the_manifests_probe_what_the_examples_serve(pool: PgPool) {
    serves_its_probes(
        "payments",
        "payments.yaml",
        "StatefulSet",
        &pool,
        &[("KAFKA_CFG_GROUP_INSTANCE_ID", "payments-0".to_owned())],
    )
    .await;
    serves_its_probes("outbox", "relay.yaml", "Deployment", &pool, &[]).await;
}

/// Key-ordered concurrency's gauges, from the payments example: while six
/// accounts' payments run (each transaction held 3 s by `EFFECT_MS`), the
/// two later payments of one account wait behind its first:
/// `dedup_key_running` 6 and `dedup_key_waiting` 2 for the partition; both
/// 0 once all eight are applied.
#[sqlx::test(migrations = false)]
async fn key_concurrency_shows_running_and_waiting_events_per_partition(pool: PgPool) {
    let topic = create_topic(1).await;
    let p = producer();
    for (account, payments) in [("a", 3), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)] {
        for _ in 0..payments {
            p.send(
                FutureRecord::to(&topic).key(account).payload(&payment(
                    uuid::Uuid::new_v4(),
                    account,
                    1,
                )),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
        }
    }
    let port = free_port();
    let child = common::payments(&pool, &topic, &unique("g"))
        .env("METRICS_ADDR", format!("127.0.0.1:{port}"))
        .env("DEDUP_KEY_CONCURRENCY", "8")
        .env("EFFECT_MS", "3000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the payments example");
    let _child = KillOnDrop(Some(child));
    let partition = [("topic", topic.as_str()), ("partition", "0")];
    let gauges = |text: &str| {
        (
            sample(text, "dedup_key_running", &partition),
            sample(text, "dedup_key_waiting", &partition),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "never six running, two waiting");
        if let Some((200, text)) = get(port, "/metrics").await
            && gauges(&text) == (Some(6.0), Some(2.0))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // a's three one after another: about 9 s.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "never all applied and idle");
        if let Some((200, text)) = get(port, "/metrics").await
            && outcome(&text, &topic, "applied") == 8
            && gauges(&text) == (Some(0.0), Some(0.0))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Fails every event transiently: a downstream that answers 503.
#[idempotent(key = "event_id", ttl = "4h")]
async fn always_unavailable(
    _tx: &mut PgTx,
    _ev: PaymentReceived,
) -> Result<(), dedup_core::HandlerError> {
    Err(dedup_core::HandlerError::transient(
        "the downstream answers 503",
    ))
}

/// A retry tier's metrics: the move is counted per tier
/// (`dedup_retry_moved_total{tier}`) and as an outcome, and the tier's
/// partition says how long until its next record is due
/// (`dedup_retry_due_seconds`).
#[sqlx::test(migrations = false)]
async fn retry_tiers_show_moves_per_tier_and_when_the_next_is_due(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let tier = format!("{topic}.retry-1m");
    common::create_named_topic(&tier, 1).await;
    let port = free_port();
    let consumer = Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(unique("g"))
        .retry_tiers(["1m"])
        .handle(&topic, always_unavailable)
        .serve_http(format!("127.0.0.1:{port}"))
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    producer()
        .send(
            FutureRecord::to(&topic)
                .key("acct")
                .payload(&payment(uuid::Uuid::new_v4(), "acct", 5)),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        assert!(
            Instant::now() < deadline,
            "no due time: {}",
            stats.snapshot()
        );
        if let Some((200, text)) = get(port, "/metrics").await
            && sample(&text, "dedup_retry_due_seconds", &[("topic", &tier)])
                .is_some_and(|s| s > 0.0)
        {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let moved = sample(
        &text,
        "dedup_retry_moved_total",
        &[("topic", &topic), ("tier", "1m")],
    );
    assert_eq!(moved, Some(1.0), "{text}");
    assert_eq!(outcome(&text, &topic, "moved"), 1, "{text}");
    let due = sample(&text, "dedup_retry_due_seconds", &[("topic", &tier)]).expect("due");
    assert!((30.0..=60.0).contains(&due), "{due}");
    assert_eq!(stats.snapshot().moved, 1);
    let _ = stop.send(());
    running.await.expect("join").expect("ran");
}
