//! Kafka-only handlers through the transactional consumer, against a real
//! broker: each distinct event's output exactly once for `read_committed`
//! readers, duplicates skipped through claims restored from the changelog,
//! poison dead-lettered inside the transaction, claims expiring on record
//! timestamps, crashes at each step of the transaction, and retry tiers
//! (moves in the transaction, tiers read with their input partitions).

use dedup_tests::common;

use std::collections::{HashMap, HashSet};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{KillOnDrop, brokers, create_topic, header, unique};
use dedup_core::{Describe, Error, Handler, HandlerError, Headers, KeyError, Ttl};
use dedup_kafka::{OutputRecord, Outputs, StatsSnapshot, TransactionalConsumer};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::KafkaError;
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

/// Forwards `{event_id, n}` to `out` as `{event_id, n, forwarded: true}`;
/// `"fail": true` fails permanently, `"big": N` makes an N-byte output.
#[derive(Clone)]
struct Forward {
    out: String,
    ttl: Ttl,
}

#[derive(serde::Deserialize)]
struct Event {
    event_id: Option<String>,
    n: i64,
    #[serde(default)]
    fail: bool,
    #[serde(default)]
    big: usize,
    /// Panics in the handler.
    #[serde(default)]
    panic: bool,
    /// Hangs the first time any event says so.
    #[serde(default)]
    hang: bool,
    /// Fails as the environment's fault (a store error of the
    /// environment in its chain), every time.
    #[serde(default)]
    outage: bool,
    /// Fails as the environment's fault for this many seconds after the
    /// event's first attempt.
    #[serde(default)]
    outage_secs: u64,
    /// The output topic, if not the handler's.
    #[serde(default)]
    to: Option<String>,
    /// Waits this long (a slow lookup), logged in [`RUNS`].
    #[serde(default)]
    sleep_ms: u64,
    /// Holds its thread this long without awaiting (a handler that
    /// computes).
    #[serde(default)]
    compute_ms: u64,
    /// Fails transiently (a downstream's 503) for this many seconds after
    /// the event's first attempt; its success is logged in [`SUCCEEDED`].
    #[serde(default)]
    transient_secs: u64,
}

/// When each event with `transient_secs` succeeded, by id.
static SUCCEEDED: std::sync::Mutex<Vec<(String, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// Each call with `sleep_ms`: its event id, when it started and ended.
static RUNS: std::sync::Mutex<Vec<(String, std::time::Instant, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// When each event with `outage_secs` was first tried, by id.
static OUTAGE_FROM: std::sync::Mutex<Vec<(String, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// How long ago the event `id` was first tried.
fn first_tried(id: &str) -> Duration {
    let mut from = OUTAGE_FROM.lock().expect("lock");
    if let Some((_, at)) = from.iter().find(|(seen, _)| seen == id) {
        return at.elapsed();
    }
    from.push((id.to_owned(), std::time::Instant::now()));
    Duration::ZERO
}

/// How many calls with `compute_ms` have ended.
static COMPUTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Set by the first event that hung.
static HUNG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Describe for Forward {
    type Event = Event;

    fn scope(&self) -> &str {
        "forward"
    }

    fn ttl(&self) -> Ttl {
        self.ttl
    }

    fn key(&self, event: &Event, _: &dyn Headers) -> Result<String, KeyError> {
        event
            .event_id
            .clone()
            .ok_or(KeyError::MissingField { field: "event_id" })
    }

    fn decode(&self, payload: &[u8]) -> Result<Event, Error> {
        dedup_core::decode::json(payload)
    }
}

impl Handler for Forward {
    type Tx = Outputs;

    async fn handle(&self, out: &mut Outputs, ev: Event) -> Result<(), HandlerError> {
        if ev.fail {
            return Err(HandlerError::permanent("the event says fail"));
        }
        if ev.panic {
            panic!("the event says panic");
        }
        if ev.hang && !HUNG.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        if ev.outage_secs > 0
            && first_tried(ev.event_id.as_deref().unwrap_or_default())
                < Duration::from_secs(ev.outage_secs)
        {
            return Err(
                dedup_core::StoreError::environment("the enrichment service is down").into(),
            );
        }
        if ev.transient_secs > 0 {
            let id = ev.event_id.as_deref().unwrap_or_default();
            if first_tried(id) < Duration::from_secs(ev.transient_secs) {
                return Err(HandlerError::transient(
                    "the enrichment service answers 503",
                ));
            }
            SUCCEEDED
                .lock()
                .expect("lock")
                .push((id.to_owned(), std::time::Instant::now()));
        }
        if ev.outage {
            return Err(dedup_core::StoreError::environment(
                "the enrichment service is unreachable",
            )
            .into());
        }
        let id = ev.event_id.unwrap_or_default();
        if ev.compute_ms > 0 {
            std::thread::sleep(Duration::from_millis(ev.compute_ms));
            COMPUTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        if ev.sleep_ms > 0 {
            let started = std::time::Instant::now();
            tokio::time::sleep(Duration::from_millis(ev.sleep_ms)).await;
            RUNS.lock()
                .expect("lock")
                .push((id.clone(), started, std::time::Instant::now()));
        }
        if ev.big > 0 {
            out.push(
                OutputRecord::new(&self.out)
                    .key(&id)
                    .payload(vec![b'x'; ev.big]),
            );
            return Ok(());
        }
        out.send(
            ev.to.as_deref().unwrap_or(&self.out),
            &id,
            &serde_json::json!({"event_id": id, "n": ev.n, "forwarded": true}),
        )
    }
}

fn producer() -> FutureProducer {
    common::producer()
}

/// Produces `payload` keyed by `key` (the same key, the same partition),
/// stamped `at` ms if given.
async fn send(producer: &FutureProducer, topic: &str, key: &str, payload: &[u8], at: Option<i64>) {
    let mut record = FutureRecord::to(topic).key(key).payload(payload);
    if let Some(at) = at {
        record = record.timestamp(at);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .expect("produced");
}

/// Produces `payload` keyed by `key`, as is.
async fn send_raw(producer: &FutureProducer, topic: &str, key: &str, payload: &[u8]) {
    send(producer, topic, key, payload, None).await;
}

/// A transactional consumer running in the background until stopped.
struct Member {
    stats: std::sync::Arc<dedup_kafka::Stats>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<StatsSnapshot, dedup_kafka::Error>>,
}

impl Member {
    fn start(consumer: TransactionalConsumer<Forward>) -> Self {
        let stats = consumer.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run_until(async move {
            let _ = stopped.await;
        }));
        Member { stats, stop, task }
    }

    /// Stops it; what it did.
    async fn stop(self) -> StatsSnapshot {
        let _ = self.stop.send(());
        self.task.await.expect("joined").expect("ran")
    }
}

/// Waits until `done` holds; fails the test after `secs` seconds.
async fn wait_until(what: &str, secs: u64, done: impl Fn() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        assert!(
            started.elapsed() < Duration::from_secs(secs),
            "not within {secs} s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An input and an output topic of `partitions` partitions each, and a
/// group: `(topic, out, group)`.
async fn topics(partitions: i32) -> (String, String, String) {
    (
        create_topic(partitions).await,
        create_topic(partitions).await,
        unique("tx"),
    )
}

/// [`topics`] holding the events `e0..e<n>`, then `extra` (key, payload).
async fn events_and(partitions: i32, n: i64, extra: &[(&str, &[u8])]) -> (String, String, String) {
    let (topic, out, group) = topics(partitions).await;
    let p = producer();
    send_events(&p, &topic, 0..n).await;
    for (key, payload) in extra {
        send_raw(&p, &topic, key, payload).await;
    }
    (topic, out, group)
}

/// Produces the events `e<i>` for each `i` of `range`, keyed by their ids.
async fn send_events(producer: &FutureProducer, topic: &str, range: std::ops::Range<i64>) {
    send_events_with(producer, topic, range, serde_json::json!({})).await;
}

/// [`send_events`], each event with `extra`'s fields too.
async fn send_events_with(
    producer: &FutureProducer,
    topic: &str,
    range: std::ops::Range<i64>,
    extra: serde_json::Value,
) {
    for i in range {
        let id = format!("e{i}");
        let mut payload = serde_json::json!({"event_id": id, "n": i});
        payload
            .as_object_mut()
            .expect("an object")
            .extend(extra.as_object().expect("an object").clone());
        send(producer, topic, &id, payload.to_string().as_bytes(), None).await;
    }
}

/// The ids `e0..e<n>` and `extra`, sorted: what `out` holds, each once, when
/// every event was output once ([`outputs`]).
fn each_once(n: i64, extra: &[&str]) -> Vec<String> {
    let mut ids: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
    ids.extend(extra.iter().map(|id| (*id).to_owned()));
    ids.sort();
    ids
}

/// The event ids output to `out` (committed), sorted.
async fn outputs(out: &str) -> Vec<String> {
    let mut seen = ids(&read_all(out, "read_committed").await);
    seen.sort();
    seen
}

fn event(id: &str, n: i64) -> Vec<u8> {
    serde_json::json!({"event_id": id, "n": n})
        .to_string()
        .into_bytes()
}

/// Runs a transactional consumer of `topic` in `group` until it has been
/// idle for 3 s after its assignment.
async fn drain(topic: &str, group: &str, handler: Forward) -> StatsSnapshot {
    drain_with(TransactionalConsumer::builder(topic, handler).group_id(group)).await
}

async fn drain_with(builder: dedup_kafka::TransactionalConsumerBuilder<Forward>) -> StatsSnapshot {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let consumer = builder.brokers(brokers()).build().expect("consumer");
    let stats = consumer.stats();
    let idle = async move {
        while stats.idle_for() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), consumer.run_until(idle))
        .await
        .expect("drained within 2 min")
        .expect("consumer ran")
}

/// Every record of `topic` a reader with `isolation` sees: each partition
/// read from its start to its end, and (`read_committed`) past every
/// transaction still open (aborted by its timeout if its producer died).
async fn read_all(topic: &str, isolation: &str) -> Vec<OwnedMessage> {
    let config = |isolation: &str| {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", brokers())
            .set("group.id", unique("reader"))
            .set("isolation.level", isolation)
            .set("enable.partition.eof", "true")
            .set("enable.auto.commit", "false");
        c
    };
    let reader: BaseConsumer = config(isolation).create().expect("reader");
    let probe: BaseConsumer = config("read_uncommitted").create().expect("probe");
    let metadata = probe
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let partitions = metadata.topics()[0].partitions().len() as i32;
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        assignment
            .add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    reader.assign(&assignment).expect("assign");
    let mut out = Vec::new();
    let mut done = HashSet::new();
    let started = std::time::Instant::now();
    while (done.len() as i32) < partitions {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "{topic}: not read to its end in 90 s"
        );
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(msg)) => out.push(msg.detach()),
            Some(Err(KafkaError::PartitionEOF(p))) => {
                // At the end, unless a transaction still holds it back.
                let (_, high) = probe
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                let (_, end) = reader
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                if end >= high {
                    done.insert(p);
                }
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            None => {}
        }
    }
    out.sort_by_key(|m| (m.partition(), m.offset()));
    out
}

fn ids(records: &[OwnedMessage]) -> Vec<String> {
    records
        .iter()
        .map(|m| {
            let v: serde_json::Value =
                serde_json::from_slice(m.payload().expect("payload")).expect("json");
            v["event_id"].as_str().expect("event_id").to_owned()
        })
        .collect()
}

fn forward(out: &str, ttl: &str) -> Forward {
    Forward {
        out: out.to_owned(),
        ttl: ttl.parse().expect("ttl"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_distinct_event_is_output_once_and_poison_is_dead_lettered() {
    let (topic, out, group) = topics(3).await;
    let p = producer();
    let mut distinct = HashSet::new();
    for i in 0..60 {
        let id = format!("e{i}");
        send(&p, &topic, &id, &event(&id, i), None).await;
        distinct.insert(id.clone());
        if i % 5 == 0 {
            send(&p, &topic, &id, &event(&id, i), None).await;
        }
    }
    send(&p, &topic, "bad", b"not json", None).await;
    send(&p, &topic, "keyless", br#"{"n": 1}"#, None).await;
    send_raw(
        &p,
        &topic,
        "failing",
        br#"{"event_id": "f1", "n": 1, "fail": true}"#,
    )
    .await;
    let stats = drain(&topic, &group, forward(&out, "1h")).await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (60, 12, 3),
        "{stats}"
    );
    let output = read_all(&out, "read_committed").await;
    let seen = ids(&output);
    assert_eq!(seen.len(), 60, "one output per distinct event");
    assert_eq!(seen.iter().cloned().collect::<HashSet<_>>(), distinct);
    let key_of_e3 = output
        .iter()
        .find(|m| m.key() == Some(&b"e3"[..]))
        .expect("e3's output");
    assert!(key_of_e3.payload().is_some());
    let dead = read_all(&format!("{topic}.dlq"), "read_committed").await;
    let kinds: HashMap<String, String> = dead
        .iter()
        .map(|m| {
            (
                String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
                header(m, "dedup.error.kind").unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    assert_eq!(kinds["bad"], "decode");
    assert_eq!(kinds["keyless"], "key");
    assert_eq!(kinds["failing"], "handler");
    let bad = dead
        .iter()
        .find(|m| m.key() == Some(&b"bad"[..]))
        .expect("bad");
    assert_eq!(bad.payload(), Some(&b"not json"[..]), "the original bytes");
    assert_eq!(header(bad, "dedup.original.topic"), Some(topic.as_str()));
    assert!(header(bad, "dedup.original.offset").is_some());
    assert_eq!(header(bad, "dedup.handler"), Some("forward"));
    // The claims are in the changelog: one per distinct event, in a record
    // per transaction and partition.
    let changelog = read_all(&format!("{group}-dedup-claims"), "read_committed").await;
    let claimed: Vec<String> = changelog.iter().flat_map(claims_in).collect();
    assert_eq!(claimed.len(), 60, "{claimed:?}");
    assert_eq!(claimed.iter().collect::<HashSet<_>>().len(), 60);
    assert!(
        changelog.len() < claimed.len(),
        "{} records for 60 claims: a transaction's claims of a partition share one",
        changelog.len()
    );
    // Running again finds nothing new: the offsets committed with the outputs.
    let again = drain(&topic, &group, forward(&out, "1h")).await;
    assert_eq!(
        (again.applied, again.skipped, again.dead_lettered),
        (0, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_owner_restores_the_claims_and_skips_a_late_duplicate() {
    let (topic, out, group) = topics(2).await;
    let p = producer();
    send_events(&p, &topic, 0..20).await;
    let first = drain(&topic, &group, forward(&out, "1h")).await;
    assert_eq!(first.applied, 20, "{first}");
    // The same events again, upstream's retry minutes later, after the
    // first consumer is gone: only the changelog remembers them.
    send_events(&p, &topic, 0..20).await;
    send(&p, &topic, "e20", &event("e20", 20), None).await;
    let second = drain(&topic, &group, forward(&out, "1h")).await;
    assert_eq!((second.applied, second.skipped), (1, 20), "{second}");
    let seen = ids(&read_all(&out, "read_committed").await);
    assert_eq!(seen.len(), 21, "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_handed_over_in_a_rebalance_keep_their_claims() {
    let (topic, out, group) = topics(4).await;
    let p = producer();
    send_events(&p, &topic, 0..40).await;
    // One member takes everything, then a second joins and takes half.
    let a = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .build()
        .expect("a");
    let a = Member::start(a);
    wait_until("a applied 40", 60, || a.stats.snapshot().applied >= 40).await;
    let b = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .build()
        .expect("b");
    let b = Member::start(b);
    wait_until("b got partitions", 120, || {
        b.stats.health().assigned_partitions > 0
    })
    .await;
    let health = b.stats.health();
    assert!(
        health.is_ready(),
        "joined and its coordinator answered: {health:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    send_events(&p, &topic, 0..40).await;
    let skipped = || a.stats.snapshot().skipped + b.stats.snapshot().skipped;
    let started = std::time::Instant::now();
    while skipped() < 40 && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (a, b) = (a.stop().await, b.stop().await);
    assert!(b.skipped > 0, "b took over partitions with claims: {b}");
    assert_eq!(a.applied + b.applied, 40, "a {a}, b {b}");
    assert_eq!(a.skipped + b.skipped, 40, "a {a}, b {b}");
    assert_eq!(ids(&read_all(&out, "read_committed").await).len(), 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_expire_on_record_timestamps_and_are_tombstoned() {
    let (topic, out, group) = topics(1).await;
    let p = producer();
    let t0 = 1_700_000_000_000i64;
    // ttl 10 s on the records' clock, whatever the wall clock does.
    send(&p, &topic, "a", &event("a", 1), Some(t0)).await;
    send(&p, &topic, "b", &event("b", 2), Some(t0 + 1_000)).await;
    send(&p, &topic, "a", &event("a", 1), Some(t0 + 9_999)).await; // within: skipped
    let first = drain(&topic, &group, forward(&out, "10s")).await;
    assert_eq!((first.applied, first.skipped), (2, 1), "{first}");
    // c moves the partition's stream time past a's and b's expiry: a new
    // consumer, restored from the changelog, tombstones both.
    send(&p, &topic, "c", &event("c", 3), Some(t0 + 30_000)).await;
    let second = drain(&topic, &group, forward(&out, "10s")).await;
    assert_eq!((second.applied, second.skipped), (1, 0), "{second}");
    send(&p, &topic, "a", &event("a", 1), Some(t0 + 31_000)).await; // after the TTL: again
    send(&p, &topic, "c", &event("c", 3), Some(t0 + 31_000)).await; // within c's: skipped
    let third = drain(&topic, &group, forward(&out, "10s")).await;
    assert_eq!((third.applied, third.skipped), (1, 1), "{third}");
    let seen = ids(&read_all(&out, "read_committed").await);
    assert_eq!(seen, ["a", "b", "c", "a"]);
    // a and b in the first transaction's record (or two, if the batch was
    // cut), c in the next, a again in the last; a's and b's tombstoned once
    // c came.
    let changelog = read_all(&format!("{group}-dedup-claims"), "read_committed").await;
    let records: Vec<(&[u8], Vec<String>)> = changelog
        .iter()
        .filter(|m| m.payload().is_some())
        .map(|m| (m.key().expect("a key"), claims_in(m)))
        .collect();
    let claimed: Vec<&str> = records
        .iter()
        .flat_map(|(_, c)| c.iter().map(String::as_str))
        .collect();
    assert_eq!(
        claimed,
        ["forward/a", "forward/b", "forward/c", "forward/a"],
        "{records:?}"
    );
    let mut tombstoned: Vec<&[u8]> = changelog
        .iter()
        .filter(|m| m.payload().is_none())
        .filter_map(|m| m.key())
        .collect();
    tombstoned.sort();
    let mut before_c: Vec<&[u8]> = records[..records.len() - 2].iter().map(|r| r.0).collect();
    before_c.sort();
    assert_eq!(tombstoned, before_c, "a and b's, once c came");
}

/// The claims of a changelog record (format 2: see
/// dedup-kafka/src/transactional/changelog.rs), read as an operator
/// would: each claim's readable `scope/id`.
fn claims_in(record: &OwnedMessage) -> Vec<String> {
    assert_eq!(record.key().map(|k| (k.len(), k[0])), Some((17, b'b')));
    let value = record.payload().expect("a record, not a tombstone");
    assert_eq!(value[0], 2, "format 2");
    let mut at = 1;
    let mut out = Vec::new();
    while at < value.len() {
        at += 16 + 8 + 8;
        at += if value[at] == 1 { 17 } else { 1 };
        let len = usize::from(u16::from_be_bytes([value[at], value[at + 1]]));
        out.push(String::from_utf8_lossy(&value[at + 2..at + 2 + len]).into_owned());
        at += 2 + len;
    }
    out
}

/// A changelog written by an earlier version (a record per claim, keyed by
/// the claim's digest) is restored as it was: its claims skip their
/// duplicates, and once they expire they are tombstoned by their digest,
/// beside the new records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_an_earlier_version_wrote_are_restored_and_tombstoned() {
    use sha2::Digest as _;
    let (topic, out, group) = topics(1).await;
    let changelog =
        common::create_topic_with(&brokers(), 1, &[("cleanup.policy", "compact")]).await;
    let run = || {
        drain_with(
            TransactionalConsumer::builder(&topic, forward(&out, "10s"))
                .group_id(&group)
                .changelog_topic(&changelog),
        )
    };
    let p = producer();
    let t0 = 1_700_000_000_000i64;
    let digest =
        |id: &str| sha2::Sha256::digest(format!("forward\0{id}").as_bytes())[..16].to_vec();
    // What the earlier version wrote for a and b, claimed at t0, 10 s.
    for id in ["a", "b"] {
        let mut value = vec![1];
        value.extend_from_slice(&t0.to_be_bytes());
        value.extend_from_slice(&(t0 + 10_000).to_be_bytes());
        value.push(0);
        value.extend_from_slice(format!("forward/{id}").as_bytes());
        p.send(
            FutureRecord::to(&changelog)
                .partition(0)
                .key(&digest(id)[..])
                .payload(&value),
            Duration::from_secs(10),
        )
        .await
        .expect("an old claim");
    }
    // a again within its TTL: skipped on the old claim; c applied.
    send(&p, &topic, "a", &event("a", 1), Some(t0 + 5_000)).await;
    send(&p, &topic, "c", &event("c", 3), Some(t0 + 6_000)).await;
    let first = run().await;
    assert_eq!((first.applied, first.skipped), (1, 1), "{first}");
    // d moves stream time past a's and b's expiry: both old claims are
    // tombstoned by their digests; then b is applied again.
    send(&p, &topic, "d", &event("d", 4), Some(t0 + 12_000)).await;
    let second = run().await;
    assert_eq!((second.applied, second.skipped), (1, 0), "{second}");
    send(&p, &topic, "b", &event("b", 2), Some(t0 + 13_000)).await;
    let third = run().await;
    assert_eq!((third.applied, third.skipped), (1, 0), "{third}");
    assert_eq!(
        ids(&read_all(&out, "read_committed").await),
        ["c", "d", "b"]
    );
    let written = read_all(&changelog, "read_committed").await;
    let mut tombstoned: Vec<Vec<u8>> = written
        .iter()
        .filter(|m| m.payload().is_none())
        .filter_map(|m| m.key().map(<[u8]>::to_vec))
        .collect();
    tombstoned.sort();
    let mut old = vec![digest("a"), digest("b")];
    old.sort();
    assert_eq!(tombstoned, old);
    let claimed: Vec<String> = written[2..]
        .iter()
        .filter(|m| m.payload().is_some())
        .flat_map(claims_in)
        .collect();
    assert_eq!(claimed, ["forward/c", "forward/d", "forward/b"]);
}

/// The linger is for a consumer that was idle: behind a full batch, the
/// next takes what is queued and goes, as the database runtime does (a
/// 30 s linger held the last, partial batch of a backlog for 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_goes_without_waiting_for_the_linger() {
    let (topic, out, group) = events_and(1, 25, &[]).await;
    let consumer = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .batch_size(10)
        .batch_linger(Duration::from_secs(30))
        .build()
        .expect("consumer");
    let member = Member::start(consumer);
    let stats = member.stats.clone();
    // The first batch, from idle, fills up before its linger ends; the
    // other two follow a full batch.
    wait_until(
        "the backlog of 25 is applied without a 30 s linger",
        20,
        || stats.snapshot().applied == 25,
    )
    .await;
    member.stop().await;
    assert_eq!(outputs(&out).await, each_once(25, &[]));
}

/// Large records make smaller transactions: a batch is full at
/// `batch_bytes` of keys and payloads, whatever its count, so a backlog of
/// them never makes one transaction too long for its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_records_fill_a_transaction_by_bytes() {
    let (topic, out, group) = topics(1).await;
    let n = 12;
    // About 420 bytes each: three fill 1,000.
    let pad = serde_json::json!({"pad": "x".repeat(400)});
    send_events_with(&producer(), &topic, 0..n, pad).await;
    let stats = drain_with(
        TransactionalConsumer::builder(&topic, forward(&out, "1h"))
            .group_id(&group)
            .batch_bytes(1000),
    )
    .await;
    assert_eq!(stats.applied, n as u64, "{stats}");
    assert!(
        stats.batches >= 4,
        "{n} records of 420 bytes in transactions of at most 3: {stats}"
    );
    assert_eq!(
        outputs(&out).await,
        each_once(n, &[]),
        "each event output once"
    );
}

/// Decisions depend on the input alone, not on where batches or restarts
/// cut it: the same records, stamped out of order, run through one consumer
/// at once and through three consumers one after another (each restored
/// from the changelog and the committed offsets) apply the same events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_timestamps_get_the_same_decisions_however_the_input_is_cut() {
    let t0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
        - 3_600_000;
    let x1 = event("x", 1);
    let y2 = event("y", 2);
    let x3 = event("x", 3);
    let z5 = event("z", 5);
    let z6 = event("z", 6);
    let y7 = event("y", 7);
    // TTL 10 s on the records' clock.
    let records: [(&str, &[u8], i64); 7] = [
        ("x", &x1, t0),
        // Stream time t0+20s: x's claim (to t0+10s) has expired.
        ("y", &y2, t0 + 20_000),
        // Stamped within x's TTL, but met after its expiry in stream time:
        // applied, claimed to t0+30s.
        ("x", &x3, t0 + 1_000),
        // Dead-lettered, and still moves stream time on, to t0+40s.
        ("p", b"not json", t0 + 40_000),
        // Claimed at stream time t0+40s (not at its stamp), to t0+50s...
        ("z", &z5, t0 + 5_000),
        // ...so this duplicate is skipped.
        ("z", &z6, t0 + 35_000),
        // y's claim (to t0+30s) has expired in stream time: applied.
        ("y", &y7, t0 + 21_000),
    ];
    let mut runs = Vec::new();
    for cuts in [&[7][..], &[2, 4, 7][..]] {
        let (topic, out, group) = topics(1).await;
        let p = producer();
        let mut from = 0;
        for &to in cuts {
            for &(key, payload, at) in &records[from..to] {
                send(&p, &topic, key, payload, Some(at)).await;
            }
            from = to;
            drain(&topic, &group, forward(&out, "10s")).await;
        }
        let applied: Vec<(String, i64)> = read_all(&out, "read_committed")
            .await
            .iter()
            .map(|m| {
                let v: serde_json::Value =
                    serde_json::from_slice(m.payload().expect("payload")).expect("json");
                (
                    v["event_id"].as_str().expect("id").to_owned(),
                    v["n"].as_i64().expect("n"),
                )
            })
            .collect();
        runs.push(applied);
    }
    let expected: Vec<(String, i64)> = [("x", 1), ("y", 2), ("x", 3), ("z", 5), ("y", 7)]
        .iter()
        .map(|(id, n)| ((*id).to_owned(), *n))
        .collect();
    assert_eq!(runs[0], expected, "in one run");
    assert_eq!(runs[1], expected, "cut in three runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_too_large_dead_letters_its_event_and_the_rest_go_on() {
    let topic = create_topic(1).await;
    // The broker takes records up to 20 kB on this topic; the producer
    // refuses what exceeds its own limit (1 MB) before sending.
    let out = common::create_topic_with(&brokers(), 1, &[("max.message.bytes", "20000")]).await;
    let p = producer();
    send(&p, &topic, "e1", &event("e1", 1), None).await;
    send_raw(
        &p,
        &topic,
        "huge",
        br#"{"event_id": "huge", "n": 2, "big": 2000000}"#,
    )
    .await;
    // Many small outputs beside the large one: the broker refuses the
    // request holding them all, and the one at fault must be found.
    let mut expected = vec!["e1".to_owned()];
    for i in 0..300 {
        let id = format!("m{i}");
        send(&p, &topic, &id, &event(&id, i), None).await;
        expected.push(id);
    }
    send_raw(
        &p,
        &topic,
        "large",
        br#"{"event_id": "large", "n": 4, "big": 50000}"#,
    )
    .await;
    send(&p, &topic, "e5", &event("e5", 5), None).await;
    expected.push("e5".to_owned());
    let stats = drain(&topic, &unique("tx"), forward(&out, "1h")).await;
    assert_eq!((stats.applied, stats.dead_lettered), (302, 2), "{stats}");
    assert_eq!(ids(&read_all(&out, "read_committed").await), expected);
    let dead = read_all(&format!("{topic}.dlq"), "read_committed").await;
    let kinds: Vec<(&[u8], Option<&str>)> = dead
        .iter()
        .map(|m| (m.key().unwrap_or_default(), header(m, "dedup.error.kind")))
        .collect();
    assert_eq!(
        kinds,
        [
            (&b"huge"[..], Some("output")),
            (&b"large"[..], Some("output"))
        ]
    );
}

/// The enrich example, killed at each step of its transaction and at random
/// moments while a stream with 10% late duplicates flows, then failing a
/// transaction in-process (abort and rewind) as it drains: the committed
/// output holds each distinct event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrich_killed_anywhere_outputs_each_distinct_event_once() {
    let topic = create_topic(3).await;
    let out = create_topic(3).await;
    let group = unique("enrich");
    // The stream: payments p0, p1, ... at ~400/s, each tenth sent again 200
    // events later (a producer's retry, late: by then its original may have
    // been applied by an earlier process, and only restored claims know it).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stream = {
        let (topic, stop) = (topic.clone(), stop.clone());
        tokio::spawn(async move {
            let p = producer();
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for _ in 0..4 {
                    send(&p, &topic, &format!("p{i}"), &payment(i), None).await;
                    if i >= 200 && (i - 200).is_multiple_of(10) {
                        send(
                            &p,
                            &topic,
                            &format!("p{}", i - 200),
                            &payment(i - 200),
                            None,
                        )
                        .await;
                    }
                    i += 1;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            i
        })
    };
    let run = |failpoint: Option<&str>, transactional_id: &str| {
        enrich(&topic, &out, &group, transactional_id, failpoint, "5s")
    };
    let id = unique("enrich-tx");
    // Each step of the transaction, on the 2nd batch of a run: the process
    // aborts (SIGABRT, no clean-up) there.
    for point in [
        "transaction-before-outputs:2",
        "transaction-before-offsets:2",
        "transaction-before-acks:2",
        "transaction-before-commit:2",
        "transaction-after-commit:2",
    ] {
        let child = run(Some(point), &id).spawn().expect("spawned");
        let status = exit_within(child, Duration::from_secs(90));
        assert!(!status.success(), "{point}: the failpoint must stop it");
    }
    // kill -9 once a run has written output, a moment later, with a new
    // transactional id each time (its open transaction then ends by the
    // broker's timeout).
    for extra_ms in [0u64, 150, 400] {
        let child = run(None, &unique("enrich-tx")).spawn().expect("spawned");
        kill_once_written(child, &[&out], extra_ms).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = stream.await.expect("stream");
    // A last burst, so the draining run has a batch to fail and run again.
    let p = producer();
    for i in sent..sent + 1_000 {
        send(&p, &topic, &format!("p{i}"), &payment(i), None).await;
    }
    // The killed runs stay members until their sessions (6 s) expire: the
    // draining run, joining before, could be given no partition and stop
    // idle after 5 s, having run nothing.
    tokio::time::sleep(Duration::from_secs(7)).await;
    until_offsets_stable(&topic, &group, 3);
    let log = drain_run(run(Some("transaction-fails-before-commit:1:4"), &id));
    let tail: Vec<&str> = log.lines().rev().take(30).collect();
    assert!(
        log.contains("failpoint: failing here once")
            && log.contains("running the batch again")
            && log.contains("the batch runs again from its first offsets"),
        "the draining run failed a transaction 4 times, ran it again in hand 3 times, then \
         rewound its partitions: {tail:?}"
    );
    let distinct: HashSet<String> = (0..sent + 1_000).map(|i| format!("p{i}")).collect();
    let output = read_all(&out, "read_committed").await;
    let seen = ids(&output);
    let unique_seen: HashSet<String> = seen.iter().cloned().collect();
    assert_eq!(
        unique_seen.len(),
        distinct.len(),
        "every distinct event came out"
    );
    assert_eq!(unique_seen, distinct);
    assert_eq!(seen.len(), distinct.len(), "none twice");
    for m in &output {
        let v: serde_json::Value =
            serde_json::from_slice(m.payload().expect("payload")).expect("json");
        assert_eq!(v["enriched"], true);
        assert_eq!(
            m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            v["account_id"].as_str().map(str::to_owned)
        );
    }
}

/// Messages taken for the next batch while a transaction waits for its
/// acknowledgements (its offsets already in it) start the next batch, but
/// where that transaction's batch is rewound they are dropped, since they
/// are fetched again: a backlog run in batches of 100, whose third
/// transaction fails four times (three runs in hand, then its partitions
/// go back to its first offsets), outputs each event once, in its
/// partition's order, and claims none twice (a carried message kept
/// across the rewind would come again and be skipped as a duplicate; one
/// dropped without the rewind would be lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_carried_into_the_next_batch_survive_a_rewind_once_each() {
    let topic = create_topic(3).await;
    let out = create_topic(3).await;
    let group = unique("enrich");
    let p = producer();
    let n = 1_500u64;
    for i in 0..n {
        send(&p, &topic, &format!("p{i}"), &payment(i), None).await;
    }
    let mut cmd = enrich(
        &topic,
        &out,
        &group,
        &unique("enrich-tx"),
        Some("transaction-fails-before-commit:3:4"),
        "5s",
    );
    cmd.env("DEDUP_BATCH_SIZE", "100").env("DEBUG_LOG", "1");
    let run = cmd.stderr(Stdio::piped()).output().expect("enrich ran");
    let log = String::from_utf8_lossy(&run.stderr).into_owned();
    let summary = String::from_utf8_lossy(&run.stdout).into_owned();
    let tail: Vec<&str> = log.lines().rev().take(30).collect();
    assert!(run.status.success(), "the run ends by idleness: {tail:?}");
    assert!(
        log.contains("the batch runs again from its first offsets"),
        "the third transaction's partitions were rewound: {tail:?}"
    );
    // The log's fields, without their colours: `carried=N`.
    let carried: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("batch gathered"))
        .filter_map(|l| {
            let plain = without_colours(l);
            let at = plain.find("carried=")? + "carried=".len();
            plain[at..].split_whitespace().next()?.parse().ok()
        })
        .collect();
    assert!(
        carried.iter().any(|&c| c > 0),
        "a batch started with messages taken while the last one committed: {carried:?}"
    );
    assert!(
        summary.contains(&format!("applied={n} skipped=0 dead_lettered=0")),
        "each event claimed once, none met twice: {summary}"
    );
    let output = read_all(&out, "read_committed").await;
    let seen = ids(&output);
    let distinct: HashSet<String> = seen.iter().cloned().collect();
    assert_eq!(seen.len(), n as usize, "none twice");
    assert_eq!(distinct, (0..n).map(|i| format!("p{i}")).collect());
    // Per account (the output's key, so one output partition), the events
    // of one input partition come out in their input order.
    let mut input_partition: HashMap<String, i32> = HashMap::new();
    for m in read_all(&topic, "read_committed").await {
        let key = String::from_utf8_lossy(m.key().expect("key")).into_owned();
        input_partition.insert(key, m.partition());
    }
    let mut last: HashMap<(String, i32), u64> = HashMap::new();
    for id in &seen {
        let i: u64 = id[1..].parse().expect("p<i>");
        let lane = (format!("acct-{}", i % 7), input_partition[id]);
        if let Some(&before) = last.get(&lane) {
            assert!(
                before < i,
                "{id} came out after p{before}, which followed it"
            );
        }
        last.insert(lane, i);
    }
}

/// The Kafka-only runtime through the broker's SASL_SSL listener
/// (SCRAM-SHA-512 over TLS verified against the test CA; the enrich example
/// takes its settings from `KAFKA_CFG_*`, and only that listener is its
/// bootstrap server): killed (SIGKILL) once it has written, then drained by
/// another run, it outputs each distinct event once, late duplicates
/// included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrich_over_sasl_ssl_killed_outputs_each_distinct_event_once() {
    let topic = create_topic(3).await;
    let out = create_topic(3).await;
    let group = unique("enrich");
    let p = producer();
    for i in 0..600u64 {
        send(&p, &topic, &format!("p{i}"), &payment(i), None).await;
        if i >= 100 && i.is_multiple_of(10) {
            send(
                &p,
                &topic,
                &format!("p{}", i - 100),
                &payment(i - 100),
                None,
            )
            .await;
        }
    }
    let secured = common::secured_env();
    let run = || {
        let mut cmd = enrich(&topic, &out, &group, &unique("enrich-tx"), None, "5s");
        for (k, v) in &secured {
            cmd.env(k, v);
        }
        cmd
    };
    kill_once_written(run().spawn().expect("spawned"), &[&out], 150).await;
    // The killed run stays a member until its session (6 s) expires.
    tokio::time::sleep(Duration::from_secs(7)).await;
    until_offsets_stable(&topic, &group, 3);
    drain_run(run());
    let distinct: HashSet<String> = (0..600).map(|i| format!("p{i}")).collect();
    let seen = ids(&read_all(&out, "read_committed").await);
    assert_eq!(seen.len(), distinct.len(), "none twice");
    assert_eq!(seen.into_iter().collect::<HashSet<_>>(), distinct);
}

fn payment(i: u64) -> Vec<u8> {
    serde_json::json!({"event_id": format!("p{i}"), "account_id": format!("acct-{}", i % 7), "amount_cents": i})
        .to_string()
        .into_bytes()
}

/// Records in `topic` as its high watermarks count them (aborted ones
/// and transaction markers too): grows as soon as anything is written.
fn records_in(topic: &str) -> i64 {
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("probe");
    (0..3)
        .map(|p| {
            let (low, high) = probe
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            high - low
        })
        .sum()
}

/// The enrich example from `topic` to `out` in `group`, failing at
/// `failpoint` if set, exiting when idle for `idle`; its stderr dropped.
fn enrich(
    topic: &str,
    out: &str,
    group: &str,
    transactional_id: &str,
    failpoint: Option<&str>,
    idle: &str,
) -> Command {
    let mut cmd = Command::new(common::example("enrich"));
    cmd.env("KAFKA_BROKERS", brokers())
        .env("TOPIC", topic)
        .env("OUTPUT_TOPIC", out)
        .env("GROUP_ID", group)
        .env("TRANSACTIONAL_ID", transactional_id)
        .env("KAFKA_CFG_SESSION_TIMEOUT_MS", "6000")
        .env_remove("DEDUP_FAILPOINT")
        .args(["--exit-when-idle", idle])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(point) = failpoint {
        cmd.env("DEDUP_FAILPOINT", point);
    }
    cmd
}

/// `line` without its terminal colour codes (`ESC [ .. m`).
fn without_colours(line: &str) -> String {
    let mut parts = line.split('\u{1b}');
    let mut plain = parts.next().unwrap_or_default().to_owned();
    for part in parts {
        plain.push_str(part.split_once('m').map_or(part, |(_, rest)| rest));
    }
    plain
}

/// Runs `cmd` to its end, which must be idleness; its log.
fn drain_run(mut cmd: Command) -> String {
    let last = cmd.stderr(Stdio::piped()).output().expect("enrich ran");
    let log = String::from_utf8_lossy(&last.stderr).into_owned();
    let tail: Vec<&str> = log.lines().rev().take(30).collect();
    assert!(
        last.status.success(),
        "the last run ends by idleness: {tail:?}"
    );
    log
}

/// Waits until no transaction left open by a killed run (with a
/// transactional id of its own, so ended only by the broker's timeout)
/// still holds `group`'s offsets on `topic`. Until then a new member's
/// offset fetch waits on them: it has its partitions but receives nothing,
/// and its idleness clock (`--exit-when-idle`) runs out before its first
/// message. A read_committed member's fetch asks for stable offsets and is
/// retried by librdkafka until they are.
fn until_offsets_stable(topic: &str, group: &str, partitions: i32) {
    let member: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("isolation.level", "read_committed")
        .create()
        .expect("member");
    let mut asked = TopicPartitionList::new();
    for p in 0..partitions {
        asked.add_partition(topic, p);
    }
    member
        .committed_offsets(asked, Duration::from_secs(60))
        .expect("the killed runs' transactions end within the broker's timeout");
}

/// Kills `child` (SIGKILL) `extra_ms` after it first wrote to one of
/// `topics` (any record, even one of a transaction still open); fails if it
/// wrote nothing in 90 s.
async fn kill_once_written(child: std::process::Child, topics: &[&str], extra_ms: u64) {
    let written = || topics.iter().map(|t| records_in(t)).sum::<i64>();
    let before = written();
    let mut child = KillOnDrop(Some(child));
    let started = std::time::Instant::now();
    while written() == before {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the run wrote nothing to {topics:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(extra_ms)).await;
    let pid = child.0.as_ref().map(|c| c.id()).expect("pid");
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    let _ = child.0.take().map(|mut c| c.wait());
}

/// Waits for `child` to exit, killing it and failing after `limit`.
fn exit_within(child: std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let mut child = KillOnDrop(Some(child));
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = child.0.as_mut().and_then(|c| c.try_wait().expect("wait")) {
            child.0 = None;
            return status;
        }
        assert!(
            started.elapsed() < limit,
            "the run did not stop within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The failure rules of the database runtime hold here too (one pipeline):
/// a panicking handler fails its own event (dead letter kind `panic`), not
/// the consumer; an attempt that hangs past the attempt timeout is the
/// environment's fault, abandoned and retried, never dead-lettered, even
/// with a single attempt allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_fails_its_event_and_a_hang_is_waited_out() {
    let (topic, out, group) = events_and(
        1,
        10,
        &[
            ("panicky", br#"{"event_id": "p1", "n": 1, "panic": true}"#),
            ("hanging", br#"{"event_id": "h1", "n": 1, "hang": true}"#),
        ],
    )
    .await;
    let stats = drain_with(
        TransactionalConsumer::builder(&topic, forward(&out, "1h"))
            .group_id(&group)
            .attempt_timeout(Duration::from_secs(1))
            .retry(dedup_kafka::RetryPolicy::default().with_max_attempts(1)),
    )
    .await;
    assert_eq!((stats.applied, stats.dead_lettered), (11, 1), "{stats}");
    assert!(stats.retries >= 1, "the hung attempt was retried: {stats}");
    let dead = read_all(&format!("{topic}.dlq"), "read_committed").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].key(), Some(&b"panicky"[..]));
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("panic"));
    assert!(
        header(&dead[0], "dedup.error.message").is_some_and(|m| m.contains("the event says panic")),
        "{:?}",
        header(&dead[0], "dedup.error.message")
    );
    let seen = ids(&read_all(&out, "read_committed").await);
    assert_eq!(seen.len(), 11, "{seen:?}");
    assert!(seen.contains(&"h1".to_owned()));
}

/// A topic holding one event whose handler meets an outage every time, an
/// output topic, and a group: `(topic, out, group)`.
async fn one_event_in_an_outage() -> (String, String, String) {
    let topic = create_topic(1).await;
    let out = create_topic(1).await;
    send(
        &producer(),
        &topic,
        "o",
        br#"{"event_id": "o1", "n": 1, "outage": true}"#,
        None,
    )
    .await;
    (topic, out, unique("tx"))
}

/// An outage longer than `max_outage` stops the consumer with an error
/// that says so, and dead-letters nothing: the event stays uncommitted for
/// the next run, as in the database runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_max_outage_stops_the_consumer() {
    let (topic, out, group) = one_event_in_an_outage().await;
    let consumer = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .retry(
            dedup_kafka::RetryPolicy::default()
                .with_outage_backoff(Duration::from_millis(200))
                .with_max_outage(Duration::from_secs(2)),
        )
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run_until(std::future::pending::<()>()),
    )
    .await
    .expect("stopped by max_outage within a minute");
    let error = ran
        .expect_err("the consumer stops with an error")
        .to_string();
    assert!(error.contains("max_outage"), "{error}");
    let snapshot = stats.snapshot();
    assert_eq!(snapshot.dead_lettered, 0, "{snapshot}");
    assert!(snapshot.outages >= 1, "the outage is seen: {snapshot}");
    assert_nothing_committed(&topic, &out, &group).await;
}

/// Neither an output nor a dead letter nor an input offset of `group` on
/// `topic` was committed.
async fn assert_nothing_committed(topic: &str, out: &str, group: &str) {
    assert!(read_all(out, "read_committed").await.is_empty());
    assert!(
        read_all(&format!("{topic}.dlq"), "read_committed")
            .await
            .is_empty()
    );
    assert_eq!(
        common::committed(topic, group, 0),
        Offset::Invalid,
        "no offset committed"
    );
}

/// A stop while a message waits out an outage (no `max_outage`: for ever)
/// ends the wait at once: the consumer returns, its batch uncommitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_ends_the_wait_of_a_message_waiting_out_an_outage() {
    let (topic, out, group) = one_event_in_an_outage().await;
    let consumer = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .retry(dedup_kafka::RetryPolicy::default().with_outage_backoff(Duration::from_secs(30)))
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    let waiting = stats.clone();
    let stop = async move {
        while waiting.snapshot().outages == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Well into a wait that would last up to 30 s.
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let stopped_at = std::time::Instant::now();
    let ran = tokio::time::timeout(Duration::from_secs(60), consumer.run_until(stop))
        .await
        .expect("the stop ended the wait");
    let snapshot = ran.expect("a clean stop");
    assert!(
        stopped_at.elapsed() < Duration::from_secs(45),
        "prompt: {:?}",
        stopped_at.elapsed()
    );
    assert_eq!(
        (snapshot.applied, snapshot.dead_lettered),
        (0, 0),
        "{snapshot}"
    );
    assert_nothing_committed(&topic, &out, &group).await;
}

/// A handler waiting out an outage longer than `max.poll.interval.ms`
/// (retries of one event, the batch's transaction not yet open) keeps its
/// consumer in the group: it goes on polling, so it is neither expelled nor
/// handed its partitions again, and the batch commits once, with every
/// event in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_waiting_out_an_outage_stays_in_its_group() {
    let slow: &[u8] = br#"{"event_id": "s1", "n": 1, "outage_secs": 15}"#;
    let (topic, out, group) = events_and(2, 10, &[("slow", slow)]).await;
    let stats = drain_with(
        TransactionalConsumer::builder(&topic, forward(&out, "1h"))
            .group_id(&group)
            .set("session.timeout.ms", "6000")
            .set("max.poll.interval.ms", "6000")
            .retry(
                dedup_kafka::RetryPolicy::default().with_outage_backoff(Duration::from_millis(500)),
            ),
    )
    .await;
    assert_eq!((stats.applied, stats.dead_lettered), (11, 0), "{stats}");
    assert!(stats.outages >= 1, "the outage was waited out: {stats}");
    assert_eq!(
        (stats.assignments, stats.revoked_partitions),
        (1, 0),
        "assigned once, never revoked: {stats}"
    );
    assert_eq!(
        outputs(&out).await,
        each_once(10, &["s1"]),
        "each event output once"
    );
}

/// Handlers that never wait run on the consumer's own task: a batch of
/// them that takes longer to judge than `max.poll.interval.ms` still keeps
/// the consumer in its group and its health live (the judging gives the
/// run loop's polls their turn), and each event is output once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_handlers_that_never_wait_keeps_the_consumer_in_its_group() {
    let (topic, out, group) = topics(2).await;
    let n = 16;
    let compute = serde_json::json!({"compute_ms": 600});
    send_events_with(&producer(), &topic, 0..n, compute).await;
    let consumer = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .set("session.timeout.ms", "6000")
        .set("max.poll.interval.ms", "6000")
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    // The longest the loop went without turning while the handlers ran
    // (from the first one's end to the last commit; not the restore
    // before), sampled on a task of its own: the consumer's thread is
    // held by each handler.
    let (watched, done) = (
        stats.clone(),
        std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
    );
    let sampling = tokio::spawn({
        let done = done.clone();
        async move {
            let mut longest = Duration::ZERO;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                if COMPUTED.load(std::sync::atomic::Ordering::SeqCst) > 0
                    && watched.snapshot().applied < n as u64
                {
                    longest = longest.max(watched.health().since_last_poll);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            longest
        }
    });
    let idle = {
        let stats = stats.clone();
        async move {
            while stats.idle_for() < Duration::from_secs(3) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let ran = tokio::time::timeout(Duration::from_secs(120), consumer.run_until(idle)).await;
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let longest = sampling.await.expect("sampled");
    ran.expect("drained within 2 min").expect("consumer ran");
    let stats = stats.snapshot();
    assert_eq!(
        (stats.applied, stats.dead_lettered),
        (n as u64, 0),
        "{stats}"
    );
    assert_eq!(
        (stats.assignments, stats.revoked_partitions),
        (1, 0),
        "assigned once, never revoked: {stats}"
    );
    assert!(
        longest < Duration::from_secs(3),
        "the loop went {longest:?} without a poll while {n} events of 600 ms were judged"
    );
    assert_eq!(
        outputs(&out).await,
        each_once(n, &[]),
        "each event output once"
    );
}

/// A changelog topic that deletes by retention would forget claims: the
/// consumer refuses it before it reads anything, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changelog_deleting_by_retention_is_refused() {
    let topic = create_topic(1).await;
    let out = create_topic(1).await;
    let changelog = common::create_topic_with(&brokers(), 1, &[("cleanup.policy", "delete")]).await;
    send(&producer(), &topic, "e", &event("e1", 1), None).await;
    let consumer = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(unique("tx"))
        .changelog_topic(&changelog)
        .build()
        .expect("consumer");
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run_until(std::future::pending::<()>()),
    )
    .await
    .expect("refused within a minute");
    let error = ran.expect_err("refused").to_string();
    assert!(error.contains("cleanup.policy=\"delete\""), "{error}");
    assert!(read_all(&out, "read_committed").await.is_empty());
}

/// The start-up TTL check holds in the Kafka-only runtime too: under
/// `TtlCheck::Strict` a 1 h TTL on a topic that keeps records for a week
/// refuses to start (a replay from the start would output again every
/// record older than an hour), naming both; a topic kept for less than the
/// TTL starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_shorter_than_the_topics_retention_is_refused_under_strict() {
    let week = common::create_topic_with(&brokers(), 1, &[("retention.ms", "604800000")]).await;
    let hour = common::create_topic_with(
        &brokers(),
        1,
        &[("retention.ms", "1800000"), ("segment.ms", "600000")],
    )
    .await;
    let out = create_topic(1).await;
    let strict = |topic: &str| {
        TransactionalConsumer::builder(topic, forward(&out, "1h"))
            .brokers(brokers())
            .group_id(unique("tx"))
            .ttl_check(dedup_kafka::TtlCheck::Strict)
            .build()
            .expect("consumer")
    };
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        strict(&week).run_until(std::future::pending::<()>()),
    )
    .await
    .expect("refused within a minute");
    let error = ran.expect_err("refused").to_string();
    assert!(error.contains("is shorter than topic"), "{error}");
    assert!(error.contains(&week), "{error}");
    let started = strict(&hour)
        .run_until(tokio::time::sleep(Duration::from_secs(2)))
        .await;
    assert!(started.is_ok(), "{started:?}");
}

/// A member joining while another waits out an outage gets its partitions
/// at once: the waiting member goes on polling, so it sees the rebalance,
/// drops its batch before its transaction (the partitions may now be
/// another's) and runs what it keeps again. Each event is output once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_while_a_batch_waits_drops_it_and_outputs_each_event_once() {
    let slow: &[u8] = br#"{"event_id": "r1", "n": 1, "outage_secs": 20}"#;
    let (topic, out, group) = events_and(4, 40, &[("slow", slow)]).await;
    let member = |name: &str| {
        TransactionalConsumer::builder(&topic, forward(&out, "1h"))
            .brokers(brokers())
            .group_id(&group)
            .transactional_id(format!("{group}-{name}"))
            .retry(
                dedup_kafka::RetryPolicy::default().with_outage_backoff(Duration::from_millis(500)),
            )
            .build()
            .expect("member")
    };
    let a = Member::start(member("a"));
    wait_until("a met the outage", 60, || a.stats.health().outage).await;
    let outage_from = std::time::Instant::now();
    // More for every partition while a's batch waits: its polls receive
    // them and pause their partitions, which must all move again.
    send_events(&producer(), &topic, 40..80).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = Member::start(member("b"));
    wait_until("b got partitions", 60, || {
        b.stats.health().assigned_partitions > 0
    })
    .await;
    // Not after a's batch: the outage lasts 20 s.
    assert!(
        outage_from.elapsed() < Duration::from_secs(15),
        "b got its partitions {:?} into a's wait",
        outage_from.elapsed()
    );
    let health = a.stats.health();
    assert!(
        health.is_live() && health.since_last_poll < Duration::from_secs(5),
        "a waiting is alive: {health:?}"
    );
    wait_until("81 applied", 120, || {
        a.stats.snapshot().applied + b.stats.snapshot().applied >= 81
    })
    .await;
    let (a, b) = (a.stop().await, b.stop().await);
    assert!(a.revoked_partitions > 0, "a lost partitions mid-batch: {a}");
    assert_eq!(a.applied + b.applied, 81, "a {a}, b {b}");
    assert_eq!(
        outputs(&out).await,
        each_once(80, &["r1"]),
        "each event output once"
    );
}

/// Two output topics whose `max.message.bytes` is below what the producer
/// puts in one request: each topic's requests are refused though no record
/// is at fault. Both topics' records go one at a time (finding a topic at
/// fault must not forget the other's, or the two would take turns for
/// ever), in as many transactions as keep those sends within the
/// transaction's timeout; every event is output once, none dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_refused_together_on_two_topics_go_one_at_a_time() {
    let topic = create_topic(1).await;
    let small = [("max.message.bytes", "1000")];
    let a = common::create_topic_with(&brokers(), 1, &small).await;
    let b = common::create_topic_with(&brokers(), 1, &small).await;
    let p = producer();
    let mut want = Vec::new();
    // One topic's records after the other's: each topic's fill requests
    // while the other's go one at a time.
    for (prefix, to) in [("b", &b), ("a", &a)] {
        for i in 0..300 {
            let id = format!("{prefix}{i}");
            let payload = serde_json::json!({"event_id": id, "n": i, "to": to});
            send_raw(&p, &topic, &id, payload.to_string().as_bytes()).await;
            want.push(id);
        }
    }
    want.sort();
    let stats = drain(&topic, &unique("tx"), forward(&a, "1h")).await;
    assert_eq!((stats.applied, stats.dead_lettered), (600, 0), "{stats}");
    let mut seen = outputs(&a).await;
    seen.extend(outputs(&b).await);
    seen.sort();
    assert_eq!(seen, want, "each event output once");
}

/// An event whose record the Kafka-only handler reads.
#[derive(serde::Deserialize)]
struct Tagged {
    event_id: String,
    /// Fails its first attempt (a transient error): its retry decodes the
    /// record again.
    #[serde(default)]
    flaky: bool,
}

/// Events whose first attempt failed already.
static FLAKED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Where [`forward_record`] writes, by input topic.
static RECORDS_TO: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// Outputs what it saw of each event's record, to the output topic set for
/// its input topic in [`RECORDS_TO`].
#[dedup_core::idempotent(key = "event_id", ttl = "1h")]
async fn forward_record(
    out: &mut Outputs,
    ev: Tagged,
    meta: &dedup_core::Meta,
) -> Result<(), HandlerError> {
    if ev.flaky && !FLAKED.lock().expect("lock").contains(&ev.event_id) {
        FLAKED.lock().expect("lock").push(ev.event_id.clone());
        return Err(HandlerError::transient(
            "the first attempt of a flaky event",
        ));
    }
    let seen = serde_json::json!({
        "id": ev.event_id,
        "partition": meta.partition(),
        "offset": meta.offset(),
        "key": meta.key_str(),
        "tenant": meta.header_str("tenant"),
        "timestamp": meta.timestamp_millis(),
    });
    let to = RECORDS_TO
        .lock()
        .expect("lock")
        .iter()
        .find(|(input, _)| input == meta.topic())
        .map(|(_, output)| output.clone())
        .ok_or_else(|| HandlerError::permanent("no output topic for this input"))?;
    out.send(&to, &ev.event_id, &seen)
}

/// The Kafka-only runtime gives a handler that takes `meta: &Meta` each
/// event's own record (partition, offset, key, headers, timestamp), also on
/// the retry of an attempt that failed (the event is decoded again there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_sees_the_record_of_each_event_also_when_retried() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = create_topic(2).await;
    let out = create_topic(1).await;
    RECORDS_TO
        .lock()
        .expect("lock")
        .push((topic.clone(), out.clone()));
    let p = producer();
    let mut produced = HashMap::new();
    let mut traces = HashMap::new();
    for i in 0..6_i64 {
        let id = unique("m");
        let body = serde_json::json!({ "event_id": id, "flaky": i % 2 == 0 }).to_string();
        let tenant = format!("tenant-{i}");
        let trace = uuid::Uuid::new_v4().simple().to_string();
        let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
        let record = FutureRecord::to(&topic)
            .key(&id)
            .payload(&body)
            .timestamp(1_700_000_000_000 + i)
            .headers(
                rdkafka::message::OwnedHeaders::new()
                    .insert(rdkafka::message::Header {
                        key: "tenant",
                        value: Some(&tenant),
                    })
                    .insert(rdkafka::message::Header {
                        key: "traceparent",
                        value: Some(&traceparent),
                    }),
            );
        traces.insert(id.clone(), trace);
        let delivery = p
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
        produced.insert(
            id.clone(),
            serde_json::json!({
                "id": id,
                "partition": delivery.partition,
                "offset": delivery.offset,
                "key": id,
                "tenant": tenant,
                "timestamp": 1_700_000_000_000 + i,
            }),
        );
    }
    let consumer = TransactionalConsumer::builder(&topic, forward_record)
        .brokers(brokers())
        .group_id(unique("tx"))
        .retry(
            dedup_kafka::RetryPolicy::default()
                .with_backoff(Duration::from_millis(10), Duration::from_millis(50)),
        )
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    let idle = async move {
        while stats.idle_for() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let ran = tokio::time::timeout(Duration::from_secs(120), consumer.run_until(idle))
        .await
        .expect("drained within 2 min")
        .expect("consumer ran");
    assert_eq!((ran.applied, ran.retries), (6, 3), "{ran:?}");
    let outputs = read_all(&out, "read_committed").await;
    let seen: HashMap<String, serde_json::Value> = outputs
        .iter()
        .map(|m| {
            let v: serde_json::Value =
                serde_json::from_slice(m.payload().expect("payload")).expect("JSON");
            (v["id"].as_str().expect("id").to_owned(), v)
        })
        .collect();
    assert_eq!(seen, produced);
    // Each output carries its event's trace on (feature `opentelemetry`).
    for m in &outputs {
        let id = std::str::from_utf8(m.key().expect("key")).expect("UTF-8");
        let parent = header(m, "traceparent").unwrap_or_default();
        assert!(parent.contains(&traces[id]), "{id}: {parent:?}");
    }
}

/// Key-ordered concurrency in the Kafka-only runtime: one partition, eight
/// keys of five events whose handler waits 60 ms each, and a copy of one
/// event under another record key. With key_concurrency(8) calls of
/// different keys overlap while each key's run in order and never two at
/// once; the copy is judged after its original whatever its key, and
/// skipped; every distinct event is output once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_concurrency_runs_keys_at_once_each_in_order() {
    let (topic, out, group) = topics(1).await;
    let p = producer();
    let tag = unique("kc");
    let body = |id: &str, seq: i64| {
        serde_json::json!({"event_id": id, "n": seq, "sleep_ms": 60})
            .to_string()
            .into_bytes()
    };
    for seq in 0..5 {
        for k in 0..8 {
            let id = format!("{tag}-k{k}-{seq}");
            send(&p, &topic, &format!("k{k}"), &body(&id, seq), None).await;
            if (k, seq) == (3, 2) {
                // Its copy at once, under a key nothing else holds: only
                // its claim makes it wait for the original.
                send(&p, &topic, "elsewhere", &body(&id, seq), None).await;
            }
        }
    }
    let stats = drain_with(
        TransactionalConsumer::builder(&topic, forward(&out, "1h"))
            .group_id(&group)
            .key_concurrency(8),
    )
    .await;
    assert_eq!((stats.applied, stats.skipped), (40, 1), "{stats}");
    let output = read_all(&out, "read_committed").await;
    let seen = ids(&output);
    assert_eq!(seen.len(), 40, "one output per distinct event");
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 40);

    let runs: Vec<_> = RUNS
        .lock()
        .expect("lock")
        .iter()
        .filter(|(id, _, _)| id.starts_with(&tag))
        .cloned()
        .collect();
    assert_eq!(runs.len(), 40, "one call per distinct event");
    for k in 0..8 {
        let prefix = format!("{tag}-k{k}-");
        let mut of_key: Vec<_> = runs.iter().filter(|r| r.0.starts_with(&prefix)).collect();
        of_key.sort_by_key(|r| r.1);
        let seqs: Vec<&str> = of_key.iter().map(|r| &r.0[prefix.len()..]).collect();
        assert_eq!(seqs, ["0", "1", "2", "3", "4"], "k{k}'s calls in order");
        for pair in of_key.windows(2) {
            assert!(pair[0].2 <= pair[1].1, "two calls of k{k} at once");
        }
    }
    let most = runs
        .iter()
        .map(|r| runs.iter().filter(|o| o.1 <= r.1 && r.1 < o.2).count())
        .max()
        .unwrap_or(0);
    assert!(
        (4..=8).contains(&most),
        "calls of different keys overlap, at most 8: {most}"
    );
}

/// Retry tiers in the Kafka-only runtime: an event failing transiently
/// for 5 s moves (in its batch's transaction, after one attempt: the
/// runtime's default) to the 2 s tier, then the 5 s tier, while the 50
/// events behind it are output within a second or two; it is output once when its failure has passed, and a duplicate of
/// it met in the input afterwards is skipped (the tier's partition shares
/// its input partition's claims). Each tier holds one copy, saying its
/// origin, tier, attempts and due time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transiently_failing_event_waits_in_tiers_while_the_rest_go_on_and_is_output_once() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let (topic, out, group) = topics(2).await;
    let (first, second) = (format!("{topic}.retry-2s"), format!("{topic}.retry-5s"));
    common::create_named_topic(&first, 2).await;
    common::create_named_topic(&second, 2).await;
    let id = unique("slow");
    let slow = serde_json::json!({"event_id": id, "n": -1, "transient_secs": 5})
        .to_string()
        .into_bytes();
    let p = producer();
    send_raw(&p, &topic, &id, &slow).await;
    send_events(&p, &topic, 0..50).await;
    let consumer = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .retry_tiers(["2s", "5s"])
        .build()
        .expect("consumer");
    let member = Member::start(consumer);
    let stats = member.stats.clone();
    wait_until("the other 50 events output", 30, || {
        stats.snapshot().applied >= 50
    })
    .await;
    let succeeded = |id: &str| {
        SUCCEEDED
            .lock()
            .expect("lock")
            .iter()
            .any(|(seen, _)| seen == id)
    };
    assert!(
        !succeeded(&id),
        "the other events were output while the failing one waited in a tier"
    );
    wait_until("the failing event output from the second tier", 60, || {
        stats.snapshot().applied >= 51
    })
    .await;
    // A duplicate of it, met in the input: its claim was taken from the
    // tier's partition of the same number.
    send_raw(&p, &topic, &id, &slow).await;
    wait_until("the duplicate skipped", 30, || {
        stats.snapshot().skipped >= 1
    })
    .await;
    let done = member.stop().await;
    assert_eq!(
        (done.applied, done.skipped, done.moved, done.dead_lettered),
        (51, 1, 2, 0),
        "{done:?}"
    );
    assert_eq!(outputs(&out).await, each_once(50, &[id.as_str()]));
    let origin = read_all(&topic, "read_committed")
        .await
        .into_iter()
        .find(|m| ids(std::slice::from_ref(m)) == std::slice::from_ref(&id))
        .expect("the original");
    for (tier, name, attempts) in [(&first, "2s", 1), (&second, "5s", 2)] {
        let copies = read_all(tier, "read_committed").await;
        assert_eq!(
            ids(&copies),
            std::slice::from_ref(&id),
            "{tier} holds one copy"
        );
        let copy = &copies[0];
        assert_eq!(
            copy.partition(),
            origin.partition(),
            "a move keeps its partition"
        );
        assert_eq!(header(copy, "dedup.retry.tier"), Some(name));
        assert_eq!(header(copy, "dedup.origin.topic"), Some(topic.as_str()));
        assert_eq!(
            header(copy, "dedup.origin.offset"),
            Some(origin.offset().to_string().as_str())
        );
        assert_eq!(
            header(copy, "dedup.retry.attempt"),
            Some(attempts.to_string().as_str())
        );
        assert_eq!(header(copy, "dedup.error.kind"), Some("handler"));
        let due: i64 = header(copy, "dedup.retry.due")
            .expect("due")
            .parse()
            .expect("ms");
        let stamped = copy.timestamp().to_millis().expect("timestamp");
        assert!(due > stamped, "due after its move: {due} <= {stamped}");
    }
}

/// With a signing key the Kafka-only runtime signs its moves and reads
/// them back; a record written into its tier without the key's signature
/// (naming the input as its origin) is dead-lettered as itself, kind
/// `forged_tier_headers`, and nothing of it is output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_record_without_the_keys_signature_is_dead_lettered_as_itself() {
    use rdkafka::message::{Header, OwnedHeaders};
    let (topic, out, group) = topics(1).await;
    let tier = format!("{topic}.retry-2s");
    common::create_named_topic(&tier, 1).await;
    let p = producer();
    let forged = [
        ("dedup.origin.topic", topic.as_str()),
        ("dedup.origin.partition", "0"),
        ("dedup.origin.offset", "7"),
        ("dedup.retry.tier", "2s"),
    ]
    .into_iter()
    .fold(OwnedHeaders::new(), |h, (key, value)| {
        h.insert(Header {
            key,
            value: Some(value.as_bytes()),
        })
    });
    let payload = event("forged", 1);
    let record = FutureRecord::to(&tier)
        .key("forged")
        .payload(&payload)
        .headers(forged);
    p.send(record, Duration::from_secs(10))
        .await
        .expect("produced");
    // Fails for its first second: moved to the tier, applied from it.
    let id = unique("slow");
    let slow = serde_json::json!({"event_id": id, "n": -1, "transient_secs": 1})
        .to_string()
        .into_bytes();
    send_raw(&p, &topic, &id, &slow).await;
    send_events(&p, &topic, 0..5).await;
    let tiers = dedup_kafka::RetryTiers::new(["2s"])
        .expect("tiers")
        .signing_key(dedup_kafka::TierKey::new("a-test-key-of-more-than-16-bytes").expect("key"));
    let consumer = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
        .brokers(brokers())
        .group_id(&group)
        .retry_tiers_with(tiers)
        .build()
        .expect("consumer");
    let member = Member::start(consumer);
    let stats = member.stats.clone();
    wait_until(
        "the moved event applied, the forged one dead-lettered",
        60,
        || {
            let s = stats.snapshot();
            s.applied >= 6 && s.dead_lettered >= 1
        },
    )
    .await;
    let done = member.stop().await;
    assert_eq!(
        (done.applied, done.moved, done.dead_lettered),
        (6, 1, 1),
        "{done:?}"
    );
    assert_eq!(outputs(&out).await, each_once(5, &[id.as_str()]));
    let moved = read_all(&tier, "read_committed").await;
    assert!(
        moved
            .iter()
            .any(|m| header(m, "dedup.retry.signature").is_some()),
        "the runtime's own move is signed"
    );
    let dead = read_all(&format!("{topic}.dlq"), "read_committed").await;
    assert_eq!(ids(&dead), ["forged"]);
    assert_eq!(
        header(&dead[0], "dedup.error.kind"),
        Some("forged_tier_headers")
    );
    assert_eq!(
        header(&dead[0], "dedup.original.topic"),
        Some(tier.as_str())
    );
    assert_eq!(header(&dead[0], "dedup.original.offset"), Some("0"));
}

/// Tiers that cannot be read with their input partitions are refused:
/// a tier topic of another partition count at start-up, key hold-back
/// and reading tiers elsewhere at build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_the_kafka_only_runtime_cannot_keep_are_refused() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let (topic, out, group) = topics(2).await;
    common::create_named_topic(&format!("{topic}.retry-2s"), 3).await;
    let builder = || {
        TransactionalConsumer::builder(&topic, forward(&out, "1h"))
            .brokers(brokers())
            .group_id(&group)
    };
    let refused = builder()
        .retry_tiers(["2s"])
        .run_until(std::future::pending())
        .await
        .expect_err("a tier of 3 partitions for an input of 2");
    assert!(
        refused.to_string().contains("has 3 partitions"),
        "{refused}"
    );
    for tiers in [
        dedup_kafka::RetryTiers::new(["2s"])
            .expect("tiers")
            .hold_keys(true),
        dedup_kafka::RetryTiers::new(["2s"])
            .expect("tiers")
            .read(dedup_kafka::ReadTiers::Elsewhere),
    ] {
        let refused = builder()
            .retry_tiers_with(tiers)
            .build()
            .expect_err("refused");
        assert!(
            refused.to_string().contains("Kafka-only runtime"),
            "{refused}"
        );
    }
}

/// The enrich example with retry tiers, its reference data lacking one
/// account (one payment in 50): that account's payments move to the 1 s tier, then
/// the 10 s tier, while the others are output. Killed at each step of a
/// transaction holding moves and at random moments, then drained after
/// the account appeared: each payment is output once or dead-lettered
/// once, never both, and each tier holds at most one committed copy of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrich_killed_while_moving_to_tiers_outputs_or_dead_letters_each_event_once() {
    let topic = create_topic(3).await;
    let out = create_topic(3).await;
    let tiers = [format!("{topic}.retry-1s"), format!("{topic}.retry-10s")];
    for tier in &tiers {
        common::create_named_topic(tier, 3).await;
    }
    let group = unique("enrich-tiers");
    let accounts = std::env::temp_dir().join(format!("{}.json", unique("accounts")));
    let write_accounts = |late: bool| {
        let mut listed: serde_json::Map<String, serde_json::Value> = (0..7)
            .map(|a| (format!("acct-{a}"), format!("Account {a}").into()))
            .collect();
        if late {
            listed.insert("acct-late".into(), "Account late".into());
        }
        std::fs::write(&accounts, serde_json::Value::from(listed).to_string()).expect("written");
    };
    write_accounts(false);
    // Before each run, 300 more payments: every run has moves to make.
    let chunk = 300u64;
    let mut sent = 0u64;
    let p = producer();
    // One transactional id for every run: each aborts its killed
    // predecessor's open transaction as it starts, which would otherwise
    // hold the partitions' read_committed readers (and its successor's
    // idleness clock) until the broker times it out.
    let transactional_id = unique("enrich-tx");
    let run = |failpoint: Option<&str>| {
        let mut cmd = enrich(&topic, &out, &group, &transactional_id, failpoint, "15s");
        cmd.env("DEDUP_RETRY_TIERS", "1s,10s")
            .env("ACCOUNTS_FILE", &accounts);
        cmd
    };
    // Each step of the transaction, on a run's 2nd batch (likely one with
    // moves).
    for point in [
        "transaction-before-offsets:2",
        "transaction-before-acks:2",
        "transaction-before-commit:2",
        "transaction-after-commit:2",
    ] {
        send_late_payments(&p, &topic, sent..sent + chunk).await;
        sent += chunk;
        let child = run(Some(point)).spawn().expect("spawned");
        let status = exit_within(child, Duration::from_secs(90));
        assert!(!status.success(), "{point}: the failpoint must stop it");
    }
    // kill -9 once a run has moved something, a moment later.
    for extra_ms in [0u64, 300, 1_500] {
        send_late_payments(&p, &topic, sent..sent + chunk).await;
        sent += chunk;
        let child = run(None).spawn().expect("spawned");
        kill_once_written(child, &[&tiers[0], &tiers[1]], extra_ms).await;
    }
    // The account appears; the killed runs' sessions (6 s) expire.
    write_accounts(true);
    tokio::time::sleep(Duration::from_secs(7)).await;
    drain_run(run(None));
    let output = ids(&read_all(&out, "read_committed").await);
    let dead = ids(&read_all(&format!("{topic}.dlq"), "read_committed").await);
    let distinct: HashSet<String> = output.iter().chain(&dead).cloned().collect();
    let all: HashSet<String> = (0..sent).map(|i| format!("p{i}")).collect();
    let failing: HashSet<String> = (0..sent)
        .filter(|&i| is_late(i))
        .map(|i| format!("p{i}"))
        .collect();
    assert_eq!(distinct, all, "every payment output or dead-lettered");
    assert_eq!(
        output.len() + dead.len(),
        all.len(),
        "none output twice, dead-lettered twice, or both"
    );
    for tier in &tiers {
        let copies = ids(&read_all(tier, "read_committed").await);
        let once: HashSet<&String> = copies.iter().collect();
        assert_eq!(
            once.len(),
            copies.len(),
            "{tier}: a payment moved there twice"
        );
        assert!(
            copies.iter().all(|id| failing.contains(id)),
            "{tier}: only the failing account's payments move"
        );
    }
    let _ = std::fs::remove_file(&accounts);
    let moved = ids(&read_all(&tiers[0], "read_committed").await);
    assert!(
        moved.iter().any(|id| output.contains(id)),
        "payments moved were output once their account appeared"
    );
}

/// librdkafka drops a partition's resume that reaches the partition after
/// a newer request of its own thread (around an assignment), and returns
/// Ok all the same. A retry tier's partition, paused until its record is
/// due and then resumed with that resume dropped (failpoint
/// `tier-resume-lost`), stayed paused for good, its record never run. The
/// enrich example resumes, between batches and at most once a second,
/// every partition nothing holds: the record is output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_partition_whose_resume_is_dropped_is_still_read() {
    let topic = create_topic(1).await;
    let out = create_topic(1).await;
    let tier = format!("{topic}.retry-10s");
    common::create_named_topic(&tier, 1).await;
    // A record moved to the tier before, due in 6 s (its header's due time,
    // before its timestamp plus the tier's 10 s): time for the example to
    // start and fetch it before it is due, so that it is held.
    let due = (chrono_ms() + 6_000).to_string();
    let headers = moved_headers(&topic, "0", "10s", &due, "1");
    producer()
        .send(
            FutureRecord::to(&tier)
                .partition(0)
                .key("p7")
                .payload(&payment(7))
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
    let mut cmd = enrich(
        &topic,
        &out,
        &unique("enrich"),
        &unique("enrich-tx"),
        Some("tier-resume-lost:1"),
        "15s",
    );
    cmd.env("DEDUP_RETRY_TIERS", "10s");
    let log = drain_run(cmd);
    let tail: Vec<&str> = log.lines().rev().take(20).collect();
    assert!(
        log.contains("failpoint: failing here once"),
        "the tier partition's resume was dropped: {tail:?}"
    );
    let output = ids(&read_all(&out, "read_committed").await);
    assert_eq!(output, vec!["p7".to_owned()], "{tail:?}");
}

/// Whether payment `i` of [`send_late_payments`] is of the account that
/// the reference data lacks at first.
fn is_late(i: u64) -> bool {
    i % 50 == 3
}

/// Produces the payments `p<i>` of `range`, one in 50 of account
/// `acct-late`, the others of `acct-0`..`acct-6`.
async fn send_late_payments(p: &FutureProducer, topic: &str, range: std::ops::Range<u64>) {
    for i in range {
        let id = format!("p{i}");
        let account = match is_late(i) {
            true => "acct-late".to_owned(),
            false => format!("acct-{}", i % 7),
        };
        let payload = serde_json::json!({"event_id": id, "account_id": account, "amount_cents": i});
        send(p, topic, &id, payload.to_string().as_bytes(), None).await;
    }
}

/// A rolling deploy that adds retry tiers: a member without them and one
/// with them share a group. The range assignor gives the new member every
/// tier partition, some without their input partition (the old member
/// reads it); it leaves those unread instead of stopping, and reads them
/// once the old member has gone. Every event, and a record waiting in
/// each tier partition, is output once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_and_without_tiers_share_a_group_through_a_deploy() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let (topic, out, group) = topics(2).await;
    let tier = format!("{topic}.retry-2s");
    common::create_named_topic(&tier, 2).await;
    let p = producer();
    // A record waiting in each tier partition, moved there before.
    for partition in 0..2 {
        let id = format!("waiting-{partition}");
        let at = chrono_ms();
        let (origin_partition, due) = (partition.to_string(), at.to_string());
        let headers = moved_headers(&topic, &origin_partition, "2s", &due, "4");
        p.send(
            FutureRecord::to(&tier)
                .partition(partition)
                .key(&id)
                .payload(&event(&id, -1))
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .expect("produced");
    }
    let member = |tiers: bool| {
        let mut builder = TransactionalConsumer::builder(&topic, forward(&out, "1h"))
            .brokers(brokers())
            .group_id(&group)
            .set("session.timeout.ms", "6000");
        if tiers {
            builder = builder.retry_tiers(["2s"]);
        }
        Member::start(builder.build().expect("consumer"))
    };
    let old = member(false);
    let old_stats = old.stats.clone();
    wait_until("the old member assigned", 60, || {
        old_stats.health().assigned_partitions == 2
    })
    .await;
    let new = member(true);
    let new_stats = new.stats.clone();
    // The input split between them, both tier partitions the new one's.
    wait_until("the new member assigned beside the old one", 60, || {
        old_stats.health().assigned_partitions == 1 && new_stats.health().assigned_partitions == 3
    })
    .await;
    send_events(&p, &topic, 0..100).await;
    let applied = || old_stats.snapshot().applied + new_stats.snapshot().applied;
    wait_until(
        "the input's events and the record waiting with its input partition output",
        60,
        || applied() >= 101,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        applied(),
        101,
        "the tier partition whose input partition the old member reads stays unread"
    );
    assert!(
        !new.task.is_finished(),
        "the member with tiers runs beside the one without"
    );
    let old_done = old.stop().await;
    wait_until(
        "the waiting records output once the old member left",
        60,
        || new_stats.snapshot().applied + old_done.applied >= 102,
    )
    .await;
    new.stop().await;
    assert_eq!(
        outputs(&out).await,
        each_once(100, &["waiting-0", "waiting-1"])
    );
}

/// The headers of a record moved to tier `tier` from offset 0 of
/// `partition` of `topic`, due (and stamped) at `due` ms, after `attempt`
/// attempts: what the runtime writes when it moves one.
fn moved_headers(
    topic: &str,
    partition: &str,
    tier: &str,
    due: &str,
    attempt: &str,
) -> rdkafka::message::OwnedHeaders {
    [
        ("dedup.origin.topic", topic),
        ("dedup.origin.partition", partition),
        ("dedup.origin.offset", "0"),
        ("dedup.origin.timestamp", due),
        ("dedup.retry.tier", tier),
        ("dedup.retry.due", due),
        ("dedup.retry.attempt", attempt),
    ]
    .into_iter()
    .fold(rdkafka::message::OwnedHeaders::new(), |h, (key, value)| {
        h.insert(rdkafka::message::Header {
            key,
            value: Some(value),
        })
    })
}

/// Milliseconds since the epoch.
fn chrono_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// The Kafka-only runtime as a principal missing ACLs (the SCRAM user
/// `dedup` over SASL_SSL; every resource of the test has ACLs for someone
/// else only): missing Read on the input topic, then on the group, then any
/// right on the dead-letter topic, then Write on its transactional ids
/// (one prefixed ACL for the ids it makes), each stops the start with the
/// ACL to add named, nothing output. Allowed only
/// to see the dead-letter topic, it starts: the transaction holding the
/// malformed event cannot commit, so nothing is committed past it and
/// nothing dead-lettered, until Write is granted; then each event is output
/// once and the malformed one dead-lettered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_acl_is_named_at_start_or_holds_the_partition() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let (topic, out, group) = events_and(1, 10, &[("bad", b"not json")]).await;
    send_events(&producer(), &topic, 10..15).await;
    let dlq = format!("{topic}.dlq");
    // The transactional ids dedup makes, new at every start.
    let ids = format!("{group}-dedup-");
    let built = || {
        let (brokers, settings) = common::secured_settings();
        settings
            .into_iter()
            .fold(
                TransactionalConsumer::builder(&topic, forward(&out, "1h"))
                    .brokers(brokers)
                    .group_id(&group),
                |b, (k, v)| b.set(k, v),
            )
            .build()
            .expect("built")
    };
    let refused = || common::start_error(60, built().run_until(std::future::pending()));
    common::each_missing_acl_is_named(refused, &topic, &group, &dlq).await;
    // Its transactional ids, with ACLs for someone else only: the error
    // names the one prefixed ACL that covers every start's.
    let prefixed = [
        "--transactional-id",
        &ids,
        "--resource-pattern-type",
        "prefixed",
    ];
    common::only_for_someone_else(&prefixed);
    let said = refused().await;
    assert!(
        said.contains(&format!(
            "--operation Write --transactional-id {ids} --resource-pattern-type prefixed"
        )),
        "{said}"
    );
    assert!(
        outputs(&out).await.is_empty(),
        "nothing output while refused"
    );

    common::acl(
        &[
            &["--allow-principal", "User:dedup", "--operation", "Write"][..],
            &prefixed,
        ]
        .concat(),
    );
    let member = Member::start(built());
    // The transaction with the dead letter aborted and tried again: held.
    let stats = member.stats.clone();
    wait_until("the refused transaction tried again", 60, || {
        stats.snapshot().retries >= 2
    })
    .await;
    let held = member.stats.snapshot();
    assert_eq!(held.dead_lettered, 0, "{held}");
    match common::committed(&topic, &group, 0) {
        Offset::Offset(at) => assert!(at <= 10, "committed past the held event: {at}"),
        other => assert_eq!(other, Offset::Invalid),
    }
    common::allow_dedup("Write", "--topic", &dlq);
    wait_until("every event output or dead-lettered", 60, || {
        let s = stats.snapshot();
        s.applied == 15 && s.dead_lettered == 1
    })
    .await;
    member.stop().await;
    assert_eq!(
        outputs(&out).await,
        each_once(15, &[]),
        "each event output once"
    );
    assert_eq!(common::committed(&topic, &group, 0), Offset::Offset(16));
    let dead = read_all(&dlq, "read_committed").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("decode"));
}

/// The Kafka-only runtime with OAUTHBEARER tokens from a provider in code,
/// through the SASL_SSL listener, tokens living 10 s (the test broker makes
/// each connection re-authenticate when its token expires): for half a
/// minute of events, each is output once, and the provider was asked again
/// and again. With a provider dedup cannot create the changelog (rdkafka's
/// admin client takes no tokens from code): a start without it names the
/// command that creates it, and nothing is consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_from_a_provider_reach_every_client_of_the_kafka_only_runtime() {
    use dedup_kafka::{OAuthToken, TokenError};
    use std::sync::atomic::{AtomicU32, Ordering};
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let (topic, out, group) = topics(2).await;
    let calls = std::sync::Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let provider = move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async {
            let (jwt, expires) =
                dedup_tests::oidc::unsigned_jwt_text("dedup", Duration::from_secs(10));
            Ok::<_, TokenError>(OAuthToken::new(jwt, "dedup", expires))
        }
    };
    let built = || {
        let (brokers, settings) = common::secured_settings();
        settings
            .into_iter()
            .filter(|(k, _)| !k.starts_with("sasl."))
            .fold(
                TransactionalConsumer::builder(&topic, forward(&out, "1h"))
                    .brokers(brokers)
                    .group_id(&group),
                |b, (k, v)| b.set(k, v),
            )
            .set("sasl.mechanisms", "OAUTHBEARER")
            .oauth_token_provider(provider.clone())
            .build()
            .expect("built")
    };
    send_events(&producer(), &topic, 0..10).await;
    let changelog = format!("{group}-dedup-claims");
    let said = common::start_error(60, built().run_until(std::future::pending())).await;
    assert!(
        said.contains(&format!(
            "--create --topic {changelog} --partitions 2 --config cleanup.policy=compact"
        )),
        "{said}"
    );
    assert_eq!(common::committed(&topic, &group, 0), Offset::Invalid);
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .create()
            .expect("admin");
    let compacted =
        rdkafka::admin::NewTopic::new(&changelog, 2, rdkafka::admin::TopicReplication::Fixed(1))
            .set("cleanup.policy", "compact");
    for created in admin
        .create_topics([&compacted], &rdkafka::admin::AdminOptions::new())
        .await
        .expect("create the changelog")
    {
        created.expect("the changelog created");
    }

    let member = Member::start(built());
    let p = producer();
    for round in 1..30 {
        send_events(&p, &topic, round * 10..round * 10 + 10).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let stats = member.stats.clone();
    wait_until("every event output", 60, || stats.snapshot().applied == 300).await;
    let ran = member.stop().await;
    assert_eq!(ran.dead_lettered, 0, "{ran}");
    assert_eq!(
        outputs(&out).await,
        each_once(300, &[]),
        "each event output once"
    );
    // 10-s tokens renewed at 60% of their life, over more than 30 s, by
    // each client: surely more than 3.
    let asked = calls.load(Ordering::SeqCst);
    assert!(asked > 3, "the provider was asked {asked} times");
}

/// A broker whose own certificate has expired (a broker of the test's own,
/// presenting it on SASL_SSL): the Kafka-only runtime's start stops within
/// seconds with the verification failure named and what can cause it (an
/// expiry among them: librdkafka does not pass OpenSSL's reason on), never
/// the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_with_an_expired_certificate_stops_the_start() {
    let broker = common::OwnBroker::start_secured("expired-cert", 9202, "expired").await;
    // Its listener answers TLS (a broker just started may drop the first
    // handshakes, which librdkafka reports as a transport failure and the
    // start waits out), with the expired certificate: OpenSSL's own word.
    let ca = format!(
        "{}/ca.pem",
        std::env::var("DEDUP_TLS_DIR").unwrap_or_else(|_| "/var/tmp/dedup-tls".into())
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut probe = Command::new("openssl");
        probe
            .args(["s_client", "-connect", &broker.address, "-CAfile", &ca])
            .stdin(Stdio::null());
        let said = tokio::task::spawn_blocking(move || probe.output())
            .await
            .expect("join")
            .expect("openssl");
        if String::from_utf8_lossy(&said.stdout).contains("certificate has expired") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the broker never presented its expired certificate"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (_, settings) = common::secured_settings();
    let consumer = settings
        .into_iter()
        .fold(
            TransactionalConsumer::builder("orders", forward("out", "1h"))
                .brokers(&broker.address)
                .group_id(unique("g")),
            |b, (k, v)| b.set(k, v),
        )
        .build()
        .expect("built");
    let started = std::time::Instant::now();
    let said = common::start_error(60, consumer.run_until(std::future::pending())).await;
    assert!(
        said.contains("could not verify the brokers' certificate"),
        "{said}"
    );
    assert!(
        said.contains("or expired") && said.contains("openssl s_client"),
        "{said}"
    );
    assert!(!said.contains("dedup-secret"), "{said}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "refused at once, not waited out"
    );
}
