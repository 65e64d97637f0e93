//! Lease mode end to end (real Kafka, real PostgreSQL): handlers whose
//! effect lies outside the database, here an in-process "provider" that
//! records every call with the token it came under.

use dedup_tests::common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dedup_core::{HandlerError, Lease, idempotent};
use dedup_kafka::{Consumer, ConsumerBuilder, RetryPolicy, StatsSnapshot};
use dedup_postgres::PgStore;
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use common::{brokers, create_topic, producer, start, unique};

#[derive(serde::Deserialize)]
struct Charge {
    event_id: String,
    /// Each test charges accounts of its own (the provider is shared).
    account: String,
    /// How long the call to the provider takes.
    millis: u64,
}

/// One call the provider received.
#[derive(Debug, Clone)]
struct Call {
    event_id: String,
    token: u64,
    started: Instant,
    finished: Instant,
}

static PROVIDER: Mutex<Vec<(String, Call)>> = Mutex::new(Vec::new());

fn calls(account: &str) -> Vec<Call> {
    PROVIDER
        .lock()
        .unwrap()
        .iter()
        .filter(|(a, _)| a == account)
        .map(|(_, call)| call.clone())
        .collect()
}

async fn call_provider(lease: &Lease, ev: Charge) -> Result<(), HandlerError> {
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(ev.millis)).await;
    let call = Call {
        event_id: ev.event_id,
        token: lease.token(),
        started,
        finished: Instant::now(),
    };
    PROVIDER.lock().unwrap().push((ev.account, call));
    Ok(())
}

#[idempotent(
    key = "event_id",
    ttl = "4h",
    lease = "30s",
    scope = "lease-test::charge"
)]
async fn charge(lease: &Lease, ev: Charge) -> Result<(), HandlerError> {
    call_provider(lease, ev).await
}

/// A lease of one second, which a slow call outlives without extending.
#[idempotent(
    key = "event_id",
    ttl = "4h",
    lease = "1s",
    scope = "lease-test::short"
)]
async fn charge_briefly(lease: &Lease, ev: Charge) -> Result<(), HandlerError> {
    call_provider(lease, ev).await
}

async fn store(pool: &PgPool) -> PgStore {
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    store
}

fn consumer(store: &PgStore, group: &str) -> ConsumerBuilder<PgStore> {
    Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(group)
        .commit_interval(Duration::from_millis(200))
        // Two attempts, 20 ms apart at first: a held lease outlasts that
        // budget many times over, and must be waited out, not dead-lettered.
        .retry(
            RetryPolicy::default()
                .with_max_attempts(2)
                .with_backoff(Duration::from_millis(20), Duration::from_millis(200)),
        )
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
}

async fn send(topic: &str, charges: &[(&str, &str, u64)]) {
    let producer = producer();
    for (id, account, millis) in charges {
        let payload = format!(r#"{{"event_id":"{id}","account":"{account}","millis":{millis}}}"#);
        producer
            .send(
                FutureRecord::to(topic).key(*id).payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }
}

fn by_event(calls: &[Call]) -> HashMap<&str, usize> {
    let mut counts = HashMap::new();
    for call in calls {
        *counts.entry(call.event_id.as_str()).or_default() += 1;
    }
    counts
}

fn finished(s: &StatsSnapshot) -> u64 {
    s.applied + s.skipped + s.dead_lettered
}

#[sqlx::test(migrations = false)]
async fn each_effect_runs_once_and_redeliveries_are_skipped(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(2).await;
    let account = unique("once");
    let ids: Vec<String> = (0..20).map(|i| format!("{account}-{i}")).collect();
    let mut charges: Vec<(&str, &str, u64)> = Vec::new();
    for id in &ids {
        charges.push((id, &account, 5));
        charges.push((id, &account, 5));
    }
    send(&topic, &charges).await;

    let running = start(consumer(&store, &unique("g")).handle_leased(&topic, charge));
    running
        .wait_for("40 finished", |s| finished(&s) == 40)
        .await;
    let stats = running.stop().await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (20, 20, 0)
    );
    let calls = calls(&account);
    assert_eq!(calls.len(), 20, "{calls:?}");
    assert!(by_event(&calls).values().all(|&n| n == 1), "{calls:?}");
    let done: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dedup_claims WHERE scope = 'lease-test::charge' \
         AND NOT in_progress AND token IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .expect("claims");
    assert_eq!(done, 20, "every lease completed");
}

/// Two consumer groups run the same handler (one scope) over the same
/// events, so every event reaches two consumers at about the same time:
/// one holds the lease while the other waits, then skips.
#[sqlx::test(migrations = false)]
async fn two_consumers_racing_on_one_key_make_one_call(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let account = unique("race");
    let ids: Vec<String> = (0..10).map(|i| format!("{account}-{i}")).collect();
    let charges: Vec<(&str, &str, u64)> = ids
        .iter()
        .map(|id| (id.as_str(), account.as_str(), 150))
        .collect();
    send(&topic, &charges).await;

    let a = start(consumer(&store, &unique("a")).handle_leased(&topic, charge));
    let b = start(consumer(&store, &unique("b")).handle_leased(&topic, charge));
    a.wait_for("a finished all", |s| finished(&s) == 10).await;
    b.wait_for("b finished all", |s| finished(&s) == 10).await;
    let (a, b) = (a.stop().await, b.stop().await);
    assert_eq!(a.applied + b.applied, 10, "{a:?} {b:?}");
    assert_eq!(a.skipped + b.skipped, 10, "{a:?} {b:?}");
    assert_eq!(a.dead_lettered + b.dead_lettered, 0);
    let calls = calls(&account);
    assert_eq!(calls.len(), 10, "one call per event: {calls:?}");
    assert!(by_event(&calls).values().all(|&n| n == 1), "{calls:?}");
}

/// A holder whose call outlives its lease (no `extend`) is overtaken: the
/// other consumer waits for the lease to expire, takes the claim over with
/// a greater token and completes; the stale holder's completion is refused
/// and its message finished without a second completion.
#[sqlx::test(migrations = false)]
async fn a_stale_holders_completion_is_refused(pool: PgPool) {
    let store = store(&pool).await;
    let slow_topic = create_topic(1).await;
    let fast_topic = create_topic(1).await;
    let account = unique("stale");
    let id = format!("{account}-0");
    // The quick consumer is ready first: once the slow holder has its 1-s
    // lease, the event reaches the quick one within a poll, not after a
    // start (which alone can outlast the lease on a loaded machine).
    let fast = start(consumer(&store, &unique("fast")).handle_leased(&fast_topic, charge_briefly));
    fast.wait_for("the fast one has its partition", |s| s.assignments >= 1)
        .await;
    // The same event, slow on one topic and quick on the other.
    send(&slow_topic, &[(&id, &account, 2500)]).await;
    let slow = start(consumer(&store, &unique("slow")).handle_leased(&slow_topic, charge_briefly));
    // Let the slow holder take its lease first.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM dedup_claims WHERE scope = 'lease-test::short' AND in_progress",
        )
        .fetch_one(&pool)
        .await
        .expect("claims");
        if held == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slow consumer never took its lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    send(&fast_topic, &[(&id, &account, 1)]).await;
    fast.wait_for("the fast one finished", |s| finished(&s) == 1)
        .await;
    slow.wait_for("the slow one finished", |s| finished(&s) == 1)
        .await;
    let (slow, fast) = (slow.stop().await, fast.stop().await);
    assert_eq!((fast.applied, fast.retries > 0), (1, true), "{fast:?}");
    assert_eq!(
        (slow.applied, slow.skipped),
        (0, 1),
        "refused, finished: {slow:?}"
    );

    let calls = calls(&account);
    assert_eq!(calls.len(), 2, "{calls:?}");
    let (stale, newer) = if calls[0].token < calls[1].token {
        (&calls[0], &calls[1])
    } else {
        (&calls[1], &calls[0])
    };
    assert!(
        newer.started >= stale.started + Duration::from_millis(900),
        "the newer holder waited for the lease to expire: {calls:?}"
    );
    assert!(stale.finished > newer.finished, "{calls:?}");
    let (in_progress, token): (bool, i64) = sqlx::query_as(
        "SELECT in_progress, token FROM dedup_claims WHERE scope = 'lease-test::short'",
    )
    .fetch_one(&pool)
    .await
    .expect("claim");
    assert!(!in_progress, "done");
    assert_eq!(
        token.unsigned_abs(),
        newer.token,
        "done under the newer token"
    );
}

/// `charges` (examples/charges.rs) is killed with SIGKILL right after its
/// call to the provider for one event, before the lease completes. A
/// second run of the same group takes the claim over once the lease has
/// expired, with a greater token, calls again and completes; every other
/// event was called once.
#[sqlx::test(migrations = false)]
async fn a_consumer_killed_mid_effect_is_taken_over_with_a_greater_token(pool: PgPool) {
    use std::os::unix::process::ExitStatusExt;

    let topic = create_topic(1).await;
    let group = unique("charges");
    let producer = producer();
    for i in 0..10 {
        let payload = format!(r#"{{"event_id":"c{i}","account_id":"a","amount_cents":{i}}}"#);
        producer
            .send(
                FutureRecord::to(&topic).key("a").payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }
    let run = |crash: Option<&str>| {
        let mut cmd = std::process::Command::new(common::example("charges"));
        cmd.env("DATABASE_URL", common::database_url(&pool))
            .env("KAFKA_BROKERS", brokers())
            .env("TOPIC", &topic)
            .env("GROUP_ID", &group)
            .env("KAFKA_SESSION_TIMEOUT_MS", "6000")
            .args(["--exit-when-idle", "8s"])
            .env_remove("CRASH_MID_CHARGE");
        if let Some(id) = crash {
            cmd.env("CRASH_MID_CHARGE", id);
        }
        tokio::task::spawn_blocking(move || cmd.output().expect("run charges"))
    };

    let killed = run(Some("c4")).await.expect("join");
    assert_eq!(
        killed.status.signal(),
        Some(9),
        "SIGKILLed mid-charge: {}",
        String::from_utf8_lossy(&killed.stderr)
    );
    let (in_progress, first_token): (bool, i64) = sqlx::query_as(
        "SELECT in_progress, token FROM dedup_claims WHERE scope = 'charges::charge' AND key = 'c4'",
    )
    .fetch_one(&pool)
    .await
    .expect("c4's claim");
    assert!(in_progress, "the lease was left in progress");

    let second = run(None).await.expect("join");
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let calls: Vec<(String, i64, f64)> = sqlx::query_as(
        "SELECT event_id, token, extract(epoch FROM called_at)::float8 FROM provider_calls \
         ORDER BY called_at",
    )
    .fetch_all(&pool)
    .await
    .expect("calls");
    let of = |id: &str| calls.iter().filter(|(e, ..)| e == id).collect::<Vec<_>>();
    for i in (0..10).filter(|&i| i != 4) {
        assert_eq!(of(&format!("c{i}")).len(), 1, "c{i}: {calls:?}");
    }
    let c4 = of("c4");
    assert_eq!(
        c4.len(),
        2,
        "called by the killed holder and the next: {calls:?}"
    );
    assert_eq!(c4[0].1, first_token);
    assert!(c4[1].1 > c4[0].1, "a greater token: {calls:?}");
    assert!(
        c4[1].2 - c4[0].2 >= 4.5,
        "taken over only once the 5 s lease expired: {calls:?}"
    );
    let (in_progress, token): (bool, i64) = sqlx::query_as(
        "SELECT in_progress, token FROM dedup_claims WHERE scope = 'charges::charge' AND key = 'c4'",
    )
    .fetch_one(&pool)
    .await
    .expect("c4's claim");
    assert!(
        !in_progress && token == c4[1].1,
        "done under the newer token"
    );
    let done: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dedup_claims WHERE scope = 'charges::charge' AND NOT in_progress",
    )
    .fetch_one(&pool)
    .await
    .expect("claims");
    assert_eq!(done, 10);
}

/// Key-ordered concurrency in lease mode: on one partition, ten keys of
/// four numbered charges each, every provider call taking 100 ms; with
/// key_concurrency(8) calls of different keys overlap (up to eight), and
/// each key's calls run one at a time, in order, once each.
#[sqlx::test(migrations = false)]
async fn a_partition_runs_calls_of_different_keys_at_once_and_each_keys_in_order(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let account = unique("keyed");
    let producer = producer();
    let (keys, steps) = (10, 4);
    for seq in 0..steps {
        for key in 0..keys {
            let id = format!("{account}-k{key}-{seq}");
            let payload = format!(r#"{{"event_id":"{id}","account":"{account}","millis":100}}"#);
            producer
                .send(
                    FutureRecord::to(&topic)
                        .key(&format!("k{key}"))
                        .payload(&payload),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)
                .expect("produced");
        }
    }

    let running = start(
        consumer(&store, &unique("g"))
            .key_concurrency(8)
            .handle_leased(&topic, charge),
    );
    running
        .wait_for("all finished", |s| finished(&s) == keys * steps)
        .await;
    let stats = running.stop().await;
    assert_eq!(
        (stats.applied, stats.skipped),
        (keys * steps, 0),
        "{stats:?}"
    );
    let calls = calls(&account);
    assert_eq!(calls.len() as u64, keys * steps, "one call per event");
    for key in 0..keys {
        let prefix = format!("{account}-k{key}-");
        let mut of_key: Vec<&Call> = calls
            .iter()
            .filter(|c| c.event_id.starts_with(&prefix))
            .collect();
        of_key.sort_by_key(|c| c.started);
        let seqs: Vec<String> = of_key
            .iter()
            .map(|c| c.event_id[prefix.len()..].to_owned())
            .collect();
        assert_eq!(seqs, ["0", "1", "2", "3"], "key {key}'s calls in order");
        for pair in of_key.windows(2) {
            assert!(
                pair[0].finished <= pair[1].started,
                "two calls of key {key} at once"
            );
        }
    }
    let most = calls
        .iter()
        .map(|c| {
            calls
                .iter()
                .filter(|o| o.started <= c.started && c.started < o.finished)
                .count()
        })
        .max()
        .unwrap_or(0);
    assert!(
        (4..=8).contains(&most),
        "calls of different keys overlap, at most 8 at once: {most}"
    );
}
