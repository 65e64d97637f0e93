//! One table of failure scenarios run through both runtimes, the database
//! runtime (`Consumer` over PostgreSQL) and the Kafka-only runtime
//! (`TransactionalConsumer`), against the real broker and database: the
//! same input must end the same way in both (what was applied, skipped and
//! dead-lettered, with which kind), because both go through one failure
//! policy (dedup-kafka's `pipeline`).
//!
//! Scenarios that only one runtime has (a read-only database, a lease, a
//! refused output record) and those that need a service stopped (an outage
//! of the database or the broker, a rebalance mid-batch, shutdown
//! mid-retry) are in each runtime's own suite: `kafka`, `transactional`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dedup_core::{HandlerError, idempotent};
use dedup_kafka::{
    Consumer, OutputRecord, Outputs, RetryPolicy, StatsSnapshot, TransactionalConsumer,
};
use dedup_postgres::{PgStore, PgTx};
use dedup_tests::common::{
    brokers, create_topic, database_url, drain, header, producer, read_exactly, unique,
};
use dedup_tests::store;
use rdkafka::message::Message as _;
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

/// An event; the flags say how its handler behaves.
#[derive(serde::Deserialize)]
struct Ev {
    event_id: Option<String>,
    /// Fails permanently (the handler says so).
    #[serde(default)]
    fail: bool,
    /// Panics in the handler.
    #[serde(default)]
    panic: bool,
    /// Panics while it is decoded.
    #[serde(default, deserialize_with = "panics_if_true")]
    #[allow(dead_code)]
    boom: bool,
    /// Hangs past the attempt timeout, the first time.
    #[serde(default)]
    hang: bool,
    /// Fails as transient this many times, then succeeds.
    #[serde(default)]
    transient: u32,
    /// Fails as the environment's fault for this long after its first
    /// attempt, then succeeds.
    #[serde(default)]
    outage_ms: u64,
}

fn panics_if_true<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    let boom = <bool as serde::Deserialize>::deserialize(d)?;
    assert!(!boom, "decoding this event panics");
    Ok(boom)
}

/// Per event id: when it was first tried, and how often.
static TRIED: Mutex<BTreeMap<String, (Instant, u32)>> = Mutex::new(BTreeMap::new());

/// What the event's flags make of this attempt; `Ok` to apply it. Each
/// runtime's events carry ids of their own, so the two never share a count.
async fn behave(ev: &Ev) -> Result<(), HandlerError> {
    let id = ev.event_id.clone().unwrap_or_default();
    let (first, attempt) = {
        let mut tried = TRIED.lock().expect("lock");
        let entry = tried.entry(id).or_insert((Instant::now(), 0));
        entry.1 += 1;
        *entry
    };
    if ev.fail {
        return Err(HandlerError::permanent("the event says fail"));
    }
    if ev.panic {
        panic!("the event says panic");
    }
    if ev.hang && attempt == 1 {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    if attempt <= ev.transient {
        return Err(HandlerError::transient("the event says not yet"));
    }
    if first.elapsed() < Duration::from_millis(ev.outage_ms) {
        return Err(dedup_core::StoreError::environment("the downstream is down").into());
    }
    Ok(())
}

#[idempotent(key = "event_id", ttl = "1h")]
async fn into_database(tx: &mut PgTx, ev: Ev) -> Result<(), HandlerError> {
    behave(&ev).await?;
    sqlx::query("INSERT INTO scenario_applied (event_id) VALUES ($1)")
        .bind(&ev.event_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The Kafka-only runtime's output topic of each scenario run, by the run's
/// id (the prefix of its events' ids): the runs go at once.
static OUTPUTS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

#[idempotent(key = "event_id", ttl = "1h")]
async fn into_kafka(out: &mut Outputs, ev: Ev) -> Result<(), HandlerError> {
    behave(&ev).await?;
    let id = ev.event_id.unwrap_or_default();
    let topic = OUTPUTS
        .lock()
        .expect("lock")
        .iter()
        .find(|(run, _)| id.starts_with(&format!("{run}-")))
        .map(|(_, topic)| topic.clone())
        .expect("an output topic");
    out.push(
        OutputRecord::new(&topic)
            .key(&id)
            .payload(id.clone().into_bytes()),
    );
    Ok(())
}

/// One scenario: its messages (ids get a per-run prefix), and what must
/// become of them.
struct Scenario {
    name: &'static str,
    messages: &'static [&'static str],
    applied: u64,
    skipped: u64,
    /// The dead letters' kinds, in offset order.
    dead: &'static [&'static str],
    /// At least this many retries.
    retries: u64,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "poison of every kind, between good events",
        messages: &[
            r#"{"event_id": "a"}"#,
            "not json",
            r#"{"amount": 1}"#,
            r#"{"event_id": ""}"#,
            r#"{"event_id": "f", "fail": true}"#,
            r#"{"event_id": "b"}"#,
        ],
        applied: 2,
        skipped: 0,
        dead: &["decode", "key", "key", "handler"],
        retries: 0,
    },
    Scenario {
        name: "duplicates within the TTL",
        messages: &[
            r#"{"event_id": "a"}"#,
            r#"{"event_id": "a"}"#,
            r#"{"event_id": "b"}"#,
            r#"{"event_id": "a"}"#,
        ],
        applied: 2,
        skipped: 2,
        dead: &[],
        retries: 0,
    },
    Scenario {
        name: "a panic in the handler, and one in decoding",
        messages: &[
            r#"{"event_id": "a"}"#,
            r#"{"event_id": "p", "panic": true}"#,
            r#"{"event_id": "d", "boom": true}"#,
            r#"{"event_id": "b"}"#,
        ],
        applied: 2,
        skipped: 0,
        dead: &["panic", "panic"],
        retries: 0,
    },
    Scenario {
        name: "a handler that hangs past the attempt timeout",
        messages: &[r#"{"event_id": "h", "hang": true}"#, r#"{"event_id": "b"}"#],
        applied: 2,
        skipped: 0,
        dead: &[],
        retries: 1,
    },
    Scenario {
        name: "transient failures, then success",
        messages: &[r#"{"event_id": "t", "transient": 2}"#],
        applied: 1,
        skipped: 0,
        dead: &[],
        retries: 2,
    },
    Scenario {
        name: "transient failures past max_attempts",
        messages: &[
            r#"{"event_id": "t", "transient": 99}"#,
            r#"{"event_id": "b"}"#,
        ],
        applied: 1,
        skipped: 0,
        dead: &["handler"],
        retries: 3,
    },
    Scenario {
        name: "the environment down for two seconds",
        messages: &[r#"{"event_id": "o", "outage_ms": 2000}"#],
        applied: 1,
        skipped: 0,
        dead: &[],
        retries: 1,
    },
];

/// The retry policy of both runtimes here: quick, four attempts.
fn retry() -> RetryPolicy {
    RetryPolicy::default()
        .with_backoff(Duration::from_millis(50), Duration::from_millis(200))
        .with_outage_backoff(Duration::from_millis(200))
        .with_max_attempts(4)
}

/// The messages of `scenario` on a new topic, their ids prefixed by `run`.
async fn topic_of(scenario: &Scenario, run: &str) -> String {
    let topic = create_topic(1).await;
    let p = producer();
    for (i, m) in scenario.messages.iter().enumerate() {
        let payload = m.replace(r#""event_id": ""#, &format!(r#""event_id": "{run}-"#));
        // The empty id stays empty: a key error either way.
        let payload = payload.replace(&format!(r#""event_id": "{run}-""#), r#""event_id": """#);
        p.send(
            FutureRecord::to(&topic)
                .key(&i.to_string())
                .payload(&payload),
            Duration::from_secs(10),
        )
        .await
        .expect("produced");
    }
    topic
}

/// What became of a scenario's messages in one runtime.
#[derive(Debug, PartialEq)]
struct Ended {
    applied: u64,
    skipped: u64,
    dead: Vec<String>,
    retries_at_least: bool,
}

fn ended(stats: &StatsSnapshot, dead: Vec<String>, scenario: &Scenario) -> Ended {
    Ended {
        applied: stats.applied,
        skipped: stats.skipped,
        dead,
        retries_at_least: stats.retries >= scenario.retries,
    }
}

/// The kinds of the `n` dead letters of `topic`, in offset order.
async fn dead_kinds(topic: &str, n: usize) -> Vec<String> {
    if n == 0 {
        return Vec::new();
    }
    let mut dead = read_exactly(&brokers(), &format!("{topic}.dlq"), n).await;
    dead.sort_by_key(|m| header(m, "dedup.original.offset").and_then(|o| o.parse::<i64>().ok()));
    dead.iter()
        .map(|m| header(m, "dedup.error.kind").unwrap_or_default().to_owned())
        .collect()
}

async fn through_the_database(pool: &PgPool, store: &PgStore, scenario: &Scenario) -> Ended {
    let run = unique("db");
    let topic = topic_of(scenario, &run).await;
    let consumer = Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(unique("g"))
        .retry(retry())
        .attempt_timeout(Duration::from_secs(2))
        .handle(&topic, into_database);
    let stats = drain(consumer, Duration::from_secs(3)).await;
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM scenario_applied WHERE event_id LIKE $1")
            .bind(format!("{run}-%"))
            .fetch_one(pool)
            .await
            .expect("count");
    assert_eq!(
        applied as u64, stats.applied,
        "{}: rows and counters agree",
        scenario.name
    );
    ended(
        &stats,
        dead_kinds(&topic, scenario.dead.len()).await,
        scenario,
    )
}

async fn through_kafka(scenario: &Scenario) -> Ended {
    let run = unique("kafka");
    let topic = topic_of(scenario, &run).await;
    let out = create_topic(1).await;
    OUTPUTS
        .lock()
        .expect("lock")
        .push((run.clone(), out.clone()));
    let consumer = TransactionalConsumer::builder(&topic, into_kafka)
        .brokers(brokers())
        .group_id(unique("g"))
        .retry(retry())
        .attempt_timeout(Duration::from_secs(2))
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    let done = tokio::time::timeout(
        Duration::from_secs(120),
        consumer.run_until(async move {
            while stats.idle_for() < Duration::from_secs(3) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }),
    )
    .await
    .expect("drained within 2 min")
    .expect("consumer ran");
    let outputs = read_exactly(&brokers(), &out, done.applied as usize).await;
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
    for m in &outputs {
        *seen
            .entry(m.key().unwrap_or_default().to_vec())
            .or_default() += 1;
    }
    assert!(
        seen.values().all(|&n| n == 1),
        "{}: each output once",
        scenario.name
    );
    ended(
        &done,
        dead_kinds(&topic, scenario.dead.len()).await,
        scenario,
    )
}

/// Every scenario through both runtimes, all runs at once (each has its
/// own topics, group and event ids).
#[sqlx::test(migrations = false)]
async fn both_runtimes_end_every_scenario_the_same_way(pool: PgPool) {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    // A pool with room for every run at once (sqlx::test's has 5
    // connections): a run waiting for one past its attempt timeout would
    // be retried, and end otherwise than the scenario says.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(SCENARIOS.len() as u32 * 2)
        .connect(&database_url(&pool))
        .await
        .expect("a pool for every run");
    let store = store(&pool).await;
    sqlx::query("CREATE TABLE scenario_applied (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .expect("table");
    // The Kafka-only runtime needs a multi-thread runtime (its clients'
    // blocking calls run in block_in_place); sqlx::test's is not.
    let kafka: Vec<_> = SCENARIOS
        .iter()
        .map(|scenario| {
            tokio::task::spawn_blocking(move || {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("a runtime")
                    .block_on(through_kafka(scenario))
            })
        })
        .collect();
    let database: Vec<_> = SCENARIOS
        .iter()
        .map(|scenario| {
            let (pool, store) = (pool.clone(), store.clone());
            tokio::spawn(async move { through_the_database(&pool, &store, scenario).await })
        })
        .collect();
    for ((scenario, database), kafka) in SCENARIOS.iter().zip(database).zip(kafka) {
        let expected = Ended {
            applied: scenario.applied,
            skipped: scenario.skipped,
            dead: scenario.dead.iter().map(|k| (*k).to_owned()).collect(),
            retries_at_least: true,
        };
        let database = database.await.expect("joined");
        assert_eq!(
            database, expected,
            "{}: the database runtime",
            scenario.name
        );
        let kafka = kafka.await.expect("joined");
        assert_eq!(kafka, expected, "{}: the Kafka-only runtime", scenario.name);
    }
}
