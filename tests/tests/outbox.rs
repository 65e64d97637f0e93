//! The outbox and its relay end to end: a real PostgreSQL (one database per
//! test), the real broker of scripts/kafka.sh, and for the outage test a
//! second broker of its own that the test stops and starts again.

use dedup_tests::common;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use dedup_core::{OutboxMessage, idempotent};
use dedup_kafka::{Consumer, Relay, RelayStats, RetryPolicy, StatsSnapshot};
use dedup_postgres::{OutboxConfig, OutboxReader, OutboxWriter, PgTx, Retention};
use dedup_tests::{PaymentReceived, credit, payment, store, total_balance as balance};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Message as _, OwnedMessage};
use sqlx::PgPool;

use common::{
    OwnBroker, brokers, create_topic, create_topic_on, database_url, drain, example, header,
    last_line, producer, unique,
};

/// A downstream service: deduplicates on the relay's `event-id` header and
/// adds to a balance (NOT idempotent), so a double apply shows.
#[idempotent(key = "header:event-id", ttl = "4h")]
async fn credit_relayed_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

async fn migrated_outbox(pool: &PgPool) -> OutboxReader {
    let outbox = OutboxWriter::default();
    outbox.migrate(pool).await.expect("migrate outbox");
    outbox.reader(pool.clone())
}

/// Enqueues `(key, payload)` events in one transaction.
async fn enqueue(pool: &PgPool, topic: &str, events: &[(String, Vec<u8>)]) -> Vec<String> {
    let mut tx = pool.begin().await.expect("begin");
    let mut ids = Vec::new();
    for (key, payload) in events {
        let message = OutboxMessage::bytes(topic, payload.clone()).with_key(key.as_str());
        ids.push(
            dedup_postgres::enqueue(&mut tx, message)
                .await
                .expect("enqueue"),
        );
    }
    tx.commit().await.expect("commit");
    ids
}

/// Back-offs short enough for a test to see the relay recover.
fn quick_retry() -> RetryPolicy {
    RetryPolicy::default().with_backoff(Duration::from_millis(100), Duration::from_secs(1))
}

/// A relay running in the background until dropped or stopped.
struct RunningRelay {
    stats: std::sync::Arc<RelayStats>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<dedup_kafka::RelayStatsSnapshot, dedup_kafka::Error>>,
}

impl RunningRelay {
    /// A relay with the default 30 s delivery timeout: a shorter one can
    /// time out a send the broker already wrote on a loaded machine, and the
    /// re-send would break the tests that count copies.
    fn start(source: OutboxReader, brokers: &str, batch_size: usize) -> Self {
        Self::start_with(source, brokers, batch_size, Duration::from_secs(30))
    }

    fn start_with(
        source: OutboxReader,
        brokers: &str,
        batch_size: usize,
        delivery_timeout: Duration,
    ) -> Self {
        let relay = Relay::builder(source)
            .brokers(brokers)
            .batch_size(batch_size)
            .poll_interval(Duration::from_millis(200))
            .delivery_timeout(delivery_timeout)
            .retry(quick_retry())
            .build()
            .expect("relay");
        Self::run(relay)
    }

    /// Runs `relay` in the background.
    fn run(relay: Relay<OutboxReader>) -> Self {
        let stats = relay.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        }));
        RunningRelay {
            stats,
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) -> dedup_kafka::RelayStatsSnapshot {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task)
            .await
            .expect("relay task")
            .expect("relay ran")
    }
}

/// Waits until the outbox has nothing pending.
async fn wait_until_published(source: &OutboxReader, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let pending = source.pending().await.expect("pending");
        if pending == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{pending} events still pending after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads `topic` from the beginning until `distinct` different event ids
/// have arrived (copies included in what it returns).
async fn read_events(brokers: &str, topic: &str, distinct: usize) -> Vec<OwnedMessage> {
    let mut seen = HashSet::new();
    common::read_until(brokers, topic, |read| {
        if let Some(msg) = read.last() {
            seen.insert(header(msg, "event-id").expect("event-id header").to_owned());
        }
        seen.len() >= distinct
    })
    .await
}

/// Per key, the payloads' `n` in the order they arrived, first copies only.
fn sequences(messages: &[OwnedMessage]) -> HashMap<String, Vec<u64>> {
    let mut seen = HashSet::new();
    let mut out: HashMap<String, Vec<u64>> = HashMap::new();
    let mut by_partition: Vec<&OwnedMessage> = messages.iter().collect();
    by_partition.sort_by_key(|m| (m.partition(), m.offset()));
    for msg in by_partition {
        if !seen.insert(header(msg, "event-id").expect("event-id").to_owned()) {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_slice(msg.payload().expect("payload")).expect("json");
        out.entry(value["key"].as_str().expect("key").to_owned())
            .or_default()
            .push(value["n"].as_u64().expect("n"));
    }
    out
}

fn numbered(key: &str, n: u64) -> (String, Vec<u8>) {
    (
        key.to_owned(),
        serde_json::json!({ "key": key, "n": n })
            .to_string()
            .into_bytes(),
    )
}

/// Runs a downstream consumer of `topic` until idle and returns its counts.
async fn drain_downstream(pool: &PgPool, topic: &str) -> StatsSnapshot {
    let builder = Consumer::builder(store_only(pool))
        .brokers(brokers())
        .group_id(unique("downstream"))
        .commit_interval(Duration::from_millis(200))
        .handle(topic, credit_relayed_payment);
    drain(builder, Duration::from_secs(3)).await
}

/// A store on an already set-up database.
fn store_only(pool: &PgPool) -> dedup_postgres::PgStore {
    dedup_postgres::PgStore::from_pool(pool.clone())
}

#[sqlx::test(migrations = false)]
async fn an_enqueue_that_rolls_back_publishes_nothing(pool: PgPool) {
    let source = migrated_outbox(&pool).await;
    let topic = create_topic(1).await;

    let mut tx = pool.begin().await.expect("begin");
    dedup_postgres::enqueue(
        &mut tx,
        OutboxMessage::bytes(&topic, "never happened").with_key("k"),
    )
    .await
    .expect("enqueue");
    tx.rollback().await.expect("rollback");
    let committed = enqueue(&pool, &topic, &[("k".to_owned(), b"happened".to_vec())]).await;

    let relay = RunningRelay::start(source.clone(), &brokers(), 100);
    wait_until_published(&source, Duration::from_secs(60)).await;
    let stats = relay.stop().await;
    assert_eq!(stats.published, 1);

    let messages = read_events(&brokers(), &topic, 1).await;
    assert_eq!(messages[0].payload(), Some(&b"happened"[..]));
    assert_eq!(
        header(&messages[0], "event-id"),
        Some(committed[0].as_str())
    );
    // Nothing else was ever written to the topic.
    assert_eq!(records_in(&topic), 1, "exactly one message in the topic");
}

#[sqlx::test(migrations = false)]
async fn a_relay_killed_after_publishing_publishes_again_and_downstream_applies_once(pool: PgPool) {
    relay_killed_after_publishing(&pool, &[]).await;
}

/// The same through the broker's SASL_SSL listener (SCRAM-SHA-512 over TLS
/// verified against the test CA), the relay taking its settings from
/// `KAFKA_CFG_*` as a deployment gives them.
#[sqlx::test(migrations = false)]
async fn over_sasl_ssl_a_relay_killed_after_publishing_publishes_again_and_downstream_applies_once(
    pool: PgPool,
) {
    let secured = common::secured_env();
    let env: Vec<(&str, &str)> = secured
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    relay_killed_after_publishing(&pool, &env).await;
}

/// A relay (with `env` beside the test's database and brokers) dies after
/// the broker acknowledged an event and before marking it; the restart
/// publishes it again once the lease expired, and the downstream consumer
/// applies it once.
async fn relay_killed_after_publishing(pool: &PgPool, env: &[(&str, &str)]) {
    let pool = pool.clone();
    store(&pool).await; // accounts + dedup table
    let source = migrated_outbox(&pool).await;
    let topic = create_topic(1).await;
    enqueue(
        &pool,
        &topic,
        &[(
            "acct".to_owned(),
            payment(uuid::Uuid::new_v4(), "acct", 500),
        )],
    )
    .await;

    let binary = example("outbox");
    // A 3 s delivery timeout: the crashed relay's lease lasts 18 s.
    let run = |failpoint: Option<&str>| {
        let mut cmd = Command::new(&binary);
        cmd.args(["--role", "relay", "--exit-when-idle", "1s"])
            .env("DATABASE_URL", database_url(&pool))
            .env("KAFKA_BROKERS", brokers())
            .env("RELAY_DELIVERY_TIMEOUT_MS", "3000");
        for (k, v) in env {
            cmd.env(k, v);
        }
        match failpoint {
            Some(f) => cmd.env("DEDUP_FAILPOINT", f),
            None => cmd.env_remove("DEDUP_FAILPOINT"),
        };
        cmd.output().expect("run the outbox example")
    };

    // Dies after the broker acknowledged the event, before marking it.
    let crashed_at = Instant::now();
    let crashed = run(Some("relay-after-publish"));
    assert!(
        !crashed.status.success(),
        "the failpoint must kill the relay"
    );
    assert_eq!(source.pending().await.expect("pending"), 1, "not marked");

    // The restart takes the event over once the dead relay's lease expired.
    let restarted = run(None);
    assert!(
        restarted.status.success(),
        "{}",
        String::from_utf8_lossy(&restarted.stderr)
    );
    assert_eq!(
        last_line(&restarted),
        "relay: published=1 failed=0 batches=1"
    );
    assert!(
        crashed_at.elapsed() >= Duration::from_secs(18),
        "published again only after the lease expired: {:?}",
        crashed_at.elapsed()
    );
    assert_eq!(source.pending().await.expect("pending"), 0);

    // Two copies in the topic, one id; the downstream consumer applies one.
    let copies = common::read(&topic, 2).await;
    assert_eq!(
        header(&copies[0], "event-id"),
        header(&copies[1], "event-id")
    );
    let downstream = drain_downstream(&pool, &topic).await;
    assert_eq!(
        (downstream.applied, downstream.skipped),
        (1, 1),
        "{downstream}"
    );
    assert_eq!(balance(&pool).await, 500, "applied exactly once");
}

#[sqlx::test(migrations = false)]
async fn two_relays_publish_every_event_in_order_per_key(pool: PgPool) {
    let source = migrated_outbox(&pool).await;
    let other_source = migrated_outbox(&pool).await;
    let topic = create_topic(4).await;
    // 60 keys, batches of 20: two relays' batches share some keys (an
    // overtaking would show) and not others (both relays get work). A
    // relay holds the keys of up to two batches (one in flight while it
    // leases the next): with 40 keys or fewer, the first relay started
    // could hold every key for the whole run and the other get nothing.
    let keys: Vec<String> = (0..60).map(|k| format!("key-{k:02}")).collect();
    const ROUNDS: u64 = 20;

    for n in 0..ROUNDS {
        let events: Vec<_> = keys.iter().map(|k| numbered(k, n)).collect();
        enqueue(&pool, &topic, &events).await;
    }
    // Small batches, so the relays take turns through the backlog; both
    // sources are ready first, so the relays start together.
    let first = RunningRelay::start(source.clone(), &brokers(), 20);
    let second = RunningRelay::start(other_source, &brokers(), 20);
    wait_until_published(&source, Duration::from_secs(120)).await;
    let (a, b) = (first.stop().await, second.stop().await);
    assert_eq!(a.published + b.published, 60 * ROUNDS, "{a} / {b}");
    assert!(
        a.published > 0 && b.published > 0,
        "both relays published: {a} / {b}"
    );

    let messages = read_events(&brokers(), &topic, keys.len() * ROUNDS as usize).await;
    assert_eq!(messages.len(), keys.len() * ROUNDS as usize, "no copies");
    let sequences = sequences(&messages);
    let in_order: Vec<u64> = (0..ROUNDS).collect();
    for key in &keys {
        assert_eq!(sequences[key], in_order, "order of {key}");
    }
}

#[sqlx::test(migrations = false)]
async fn a_poison_event_holds_back_only_its_own_key(pool: PgPool) {
    let source = migrated_outbox(&pool).await;
    let topic = create_topic(1).await;
    // Over the producer's message.max.bytes: refused on every attempt.
    let poison = vec![b'x'; 2_000_000];
    let mut events = vec![("stuck".to_owned(), poison)];
    events.extend((1..=30).map(|n| numbered("stuck", n)));
    events.extend((0..10).map(|k| numbered(&format!("fine-{k}"), 0)));
    enqueue(&pool, &topic, &events).await;

    // Batches of 20: the first one is the poison event and 19 of its key.
    let relay = RunningRelay::start(source.clone(), &brokers(), 20);
    let deadline = Instant::now() + Duration::from_secs(60);
    while source.pending().await.expect("pending") > 31 {
        assert!(
            Instant::now() < deadline,
            "the other keys were stalled behind the poison event"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = relay.stop().await;
    assert!(stats.failed >= 1, "{stats}");

    let (attempts, last_error): (i32, Option<String>) =
        sqlx::query_as("SELECT attempts, last_error FROM dedup_outbox ORDER BY seq LIMIT 1")
            .fetch_one(&pool)
            .await
            .expect("poison row");
    assert!(attempts >= 1);
    let last_error = last_error.expect("the reason is recorded");
    assert!(last_error.contains("MessageSizeTooLarge"), "{last_error}");

    let messages = read_events(&brokers(), &topic, 10).await;
    let sequences = sequences(&messages);
    assert_eq!(sequences.len(), 10, "only the other keys: {sequences:?}");
    assert!(!sequences.contains_key("stuck"), "nothing of the stuck key");
}

#[sqlx::test(migrations = false)]
async fn the_relay_catches_up_after_the_broker_comes_back(pool: PgPool) {
    let broker = OwnBroker::start("outage-test", 9192).await;
    let source = migrated_outbox(&pool).await;
    let topic = create_topic_on(&broker.address, 2).await;
    let keys = ["a", "b", "c", "d", "e"];
    // Short, so sends to the stopped broker fail within the test.
    let relay =
        RunningRelay::start_with(source.clone(), &broker.address, 100, Duration::from_secs(3));

    let before: Vec<_> = keys.iter().map(|k| numbered(k, 0)).collect();
    enqueue(&pool, &topic, &before).await;
    wait_until_published(&source, Duration::from_secs(60)).await;

    broker.run("stop").await;
    for n in 1..=4 {
        let events: Vec<_> = keys.iter().map(|k| numbered(k, n)).collect();
        enqueue(&pool, &topic, &events).await;
    }
    // The relay tries, fails, keeps everything pending and backs off.
    let deadline = Instant::now() + Duration::from_secs(60);
    while relay.stats.snapshot().failed == 0 {
        assert!(
            Instant::now() < deadline,
            "the relay never noticed the outage"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        source.pending().await.expect("pending"),
        20,
        "nothing is marked while the broker is down"
    );

    broker.run("start").await;
    wait_until_published(&source, Duration::from_secs(120)).await;
    let stats = relay.stop().await;
    assert!(stats.failed > 0, "{stats}");

    let messages = read_events(&broker.address, &topic, 25).await;
    let sequences = sequences(&messages);
    for key in keys {
        assert_eq!(
            sequences[key],
            [0, 1, 2, 3, 4],
            "every event of {key}, in order"
        );
    }
}

#[sqlx::test(migrations = false)]
async fn the_outbox_example_is_exactly_once_along_the_chain(pool: PgPool) {
    let payments = create_topic(2).await;
    let recorded = create_topic(2).await;
    let producer = producer();
    let mut total = 0;
    let mut sent = Vec::new();
    for i in 0..20 {
        let account = format!("acct-{}", i % 4);
        let cents = 100 + i;
        total += cents;
        sent.push((
            account.clone(),
            payment(uuid::Uuid::new_v4(), &account, cents),
        ));
    }
    // Every fourth payment is sent twice, as a retrying producer would.
    let duplicates: Vec<_> = sent.iter().step_by(4).cloned().collect();
    for (account, body) in sent.iter().chain(&duplicates) {
        producer
            .send(
                rdkafka::producer::FutureRecord::to(&payments)
                    .key(account)
                    .payload(body),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }

    let group = unique("g");
    let output = Command::new(example("outbox"))
        .args(["--exit-when-idle", "3s"])
        .env("DATABASE_URL", database_url(&pool))
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", &payments)
        .env("RECORDED_TOPIC", &recorded)
        .env("GROUP_ID", &group)
        .output()
        .expect("run the outbox example");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = last_line(&output);
    assert!(
        line.starts_with(
            "payments: applied=20 skipped=5 dead_lettered=0 | relay: published=20 failed=0 "
        ) && line.ends_with(" | notices: applied=20 skipped=0 dead_lettered=0"),
        "{line}"
    );
    assert_eq!(balance(&pool).await, total);
    let (notices, notice_cents): (i64, i64) = sqlx::query_as(
        "SELECT count(*), coalesce(sum(amount_cents), 0)::int8 FROM payment_notices",
    )
    .fetch_one(&pool)
    .await
    .expect("notices");
    assert_eq!(
        (notices, notice_cents),
        (20, total),
        "one notice per payment"
    );
}

/// Sent rows past their retention (default: kept an hour) are purged in
/// bounded batches until none is left, not one batch per purge interval:
/// 25,000 rows sent two hours ago are all gone one purge in, and an event
/// enqueued meanwhile is still published.
#[sqlx::test(migrations = false)]
async fn a_purge_deletes_every_sent_row_past_its_retention(pool: PgPool) {
    let source = migrated_outbox(&pool).await;
    sqlx::query(
        "INSERT INTO dedup_outbox \
         (event_id, topic, payload, header_names, header_values, enqueued_at, sent_at) \
         SELECT g::text, 'sent', '\\x00', '{}', '{}', now() - interval '2 hours', \
                now() - interval '2 hours' \
         FROM generate_series(1, 25000) g",
    )
    .execute(&pool)
    .await
    .expect("old sent rows");
    let topic = create_topic(1).await;
    enqueue(&pool, &topic, &[("k".to_owned(), b"fresh".to_vec())]).await;
    let relay = Relay::builder(source.clone())
        .brokers(brokers())
        .purge_interval(Duration::from_secs(10))
        .build()
        .expect("relay");
    let running = RunningRelay::run(relay);
    // One purge happens at 10 s; the next would come at 20 s.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let stats = running.stop().await;
    let old: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dedup_outbox WHERE sent_at < now() - interval '1 hour'",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(old, 0, "every row past its retention purged");
    assert_eq!(stats.published, 1, "{stats:?}");
}

/// The number of records in partition 0 of `topic`.
fn records_in(topic: &str) -> i64 {
    let watcher: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("watcher");
    let (low, high) = watcher
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .expect("watermarks");
    high - low
}

/// No transaction stays open while the broker acknowledges: with
/// `idle_in_transaction_session_timeout` (1 s) shorter than the producer's
/// linger (1.5 s), a relay that held its rows in a transaction lost it on
/// every batch, never marked anything and published copies for ever.
#[sqlx::test(migrations = false)]
async fn a_relay_publishes_once_under_a_short_idle_in_transaction_timeout(pool: PgPool) {
    migrated_outbox(&pool).await;
    sqlx::query(
        "DO $$ BEGIN EXECUTE format( \
             'ALTER DATABASE %I SET idle_in_transaction_session_timeout = ''1s''', \
             current_database()); END $$",
    )
    .execute(&pool)
    .await
    .expect("set the timeout");
    // New sessions get the setting.
    let strict = PgPool::connect(&database_url(&pool)).await.expect("pool");
    let timeout: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&strict)
        .await
        .expect("show");
    assert_eq!(timeout, "1s");
    let source = OutboxWriter::default().reader(strict.clone());
    let topic = create_topic(1).await;
    let events: Vec<_> = (0..10).map(|n| numbered("k", n)).collect();
    enqueue(&strict, &topic, &events).await;

    let relay = Relay::builder(source.clone())
        .brokers(brokers())
        .set("linger.ms", "1500")
        .poll_interval(Duration::from_millis(200))
        .retry(quick_retry())
        .build()
        .expect("relay");
    let running = RunningRelay::run(relay);
    wait_until_published(&source, Duration::from_secs(30)).await;
    let stats = running.stop().await;
    assert_eq!((stats.published, stats.failed), (10, 0), "{stats}");
    let messages = read_events(&brokers(), &topic, 10).await;
    assert_eq!(sequences(&messages)["k"], (0..10).collect::<Vec<u64>>());
    assert_eq!(records_in(&topic), 10, "each event published once");
}

/// Transactions committed in the current database so far.
async fn transactions(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .expect("xact_commit")
}

/// Notifications that piled up while the broker was down do not cost a
/// database round each afterwards: 20,000 single-event transactions
/// enqueued during a 20-s outage, then once the backlog is published the
/// idle relay commits only its polls (about one a second) and its gauges.
#[sqlx::test(migrations = false)]
async fn notifications_piled_up_in_an_outage_do_not_cost_a_round_each(pool: PgPool) {
    const EVENTS: usize = 20_000;
    let broker = OwnBroker::start("relay-backlog", 9196).await;
    let source = migrated_outbox(&pool).await;
    let topic = create_topic_on(&broker.address, 4).await;
    let relay = Relay::builder(source.clone())
        .brokers(&broker.address)
        .delivery_timeout(Duration::from_secs(3))
        .retry(quick_retry())
        .build()
        .expect("relay");
    let running = RunningRelay::run(relay);
    enqueue(&pool, &topic, &[numbered("first", 0)]).await;
    wait_until_published(&source, Duration::from_secs(60)).await;

    broker.run("stop").await;
    let stopped_at = Instant::now();
    // Its own connections, closed afterwards: a backend reports its
    // counts when it exits, not later inside the measured window.
    let writers = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&database_url(&pool))
        .await
        .expect("writers");
    let tasks: Vec<_> = (0..8)
        .map(|w| {
            let (writers, topic) = (writers.clone(), topic.clone());
            tokio::spawn(async move {
                for n in (w..EVENTS).step_by(8) {
                    let key = format!("key-{}", n % 50);
                    enqueue(&writers, &topic, &[numbered(&key, n as u64)]).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("writer");
    }
    writers.close().await;
    let enqueued_in = stopped_at.elapsed();
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(enqueued_in)).await;
    broker.run("start").await;
    wait_until_published(&source, Duration::from_secs(180)).await;

    // Let the publishing rounds' counts reach the statistics: a backend
    // left idle reports what it has not yet reported after 10 s
    // (PGSTAT_IDLE_INTERVAL), which must not land in the measured window.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let before = transactions(&pool).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let idle = transactions(&pool).await - before;
    let stats = running.stop().await;
    assert_eq!(stats.published, EVENTS as u64 + 1, "{stats}");
    assert!(
        idle < 50,
        "{idle} transactions in 10 idle seconds after the backlog (enqueued in {enqueued_in:?})"
    );
    eprintln!("idle transactions in 10 s: {idle}; 20,000 enqueued in {enqueued_in:?}");
}

/// Delete-on-publish through Kafka: every event reaches the topic once, in
/// order per key, and no row is left behind.
#[sqlx::test(migrations = false)]
async fn delete_on_publish_leaves_no_row_once_the_broker_has_the_event(pool: PgPool) {
    let writer = OutboxWriter::new(OutboxConfig::default().with_retention(Retention::Delete))
        .expect("config");
    writer.migrate(&pool).await.expect("migrate");
    let source = writer.reader(pool.clone());
    let topic = create_topic(1).await;
    let events: Vec<_> = (0..20)
        .map(|n| numbered(&format!("k{}", n % 4), n))
        .collect();
    enqueue(&pool, &topic, &events).await;

    let relay = RunningRelay::start(source.clone(), &brokers(), 100);
    wait_until_published(&source, Duration::from_secs(60)).await;
    let stats = relay.stop().await;
    assert_eq!(stats.published, 20, "{stats}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_outbox")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, 0, "published rows are deleted");

    let messages = read_events(&brokers(), &topic, 20).await;
    let sequences = sequences(&messages);
    for k in 0..4u64 {
        let expected: Vec<u64> = (0..20).filter(|n| n % 4 == k).collect();
        assert_eq!(sequences[&format!("k{k}")], expected, "order of k{k}");
    }
    assert_eq!(records_in(&topic), 20, "each event once");
}

/// Settings under which a live relay's batch could outlast its lease (and
/// be published beside it by another relay) are refused at build time.
#[sqlx::test(migrations = false)]
async fn a_relay_refuses_timeouts_its_lease_cannot_cover(pool: PgPool) {
    let source = migrated_outbox(&pool).await;
    let build = |relay: dedup_kafka::RelayBuilder<OutboxReader>| match relay.build() {
        Ok(_) => "built".to_owned(),
        Err(e) => e.to_string(),
    };
    for key in [
        "delivery.timeout.ms",
        "message.timeout.ms",
        "acks",
        "request.required.acks",
    ] {
        let error = build(Relay::builder(source.clone()).set(key, "0"));
        assert!(error.contains(&format!("{key:?}")), "{key}: {error}");
    }
    let error = build(
        Relay::builder(source.clone())
            .delivery_timeout(Duration::from_secs(30))
            .lease_timeout(Duration::from_secs(30)),
    );
    assert!(error.contains("lease_timeout"), "{error}");
    assert!(error.contains("delivery timeout"), "{error}");
    let error = build(Relay::builder(source.clone()).lease_timeout(Duration::MAX));
    assert!(error.contains("at most"), "{error}");
    let error = build(Relay::builder(source.clone()).delivery_timeout(Duration::MAX));
    assert!(error.contains("at most"), "{error}");
    assert_eq!(
        build(
            Relay::builder(source)
                .delivery_timeout(Duration::from_secs(10))
                .lease_timeout(Duration::from_secs(11))
        ),
        "built"
    );
}

/// A batch whose sends are slow to queue (a full producer queue, no broker)
/// stops sending at half its lease margin, so nothing it sent can still be
/// in flight when its lease expires and another relay takes it over: 5 of
/// 20 events are tried (the queue holds 5), the other 15 wait a round.
#[sqlx::test(migrations = false)]
async fn a_batch_stops_sending_before_its_lease_could_expire(pool: PgPool) {
    let source = migrated_outbox(&pool).await;
    let events: Vec<_> = (0..20).map(|n| numbered(&format!("key-{n}"), n)).collect();
    enqueue(&pool, "no-broker", &events).await;
    // Nothing listens on port 1: every send times out after 2 s.
    let relay = Relay::builder(source.clone())
        .brokers("127.0.0.1:1")
        .set("queue.buffering.max.messages", "5")
        .delivery_timeout(Duration::from_secs(2))
        .lease_timeout(Duration::from_secs(3))
        .batch_size(20)
        .retry(
            RetryPolicy::default().with_backoff(Duration::from_secs(60), Duration::from_secs(60)),
        )
        .build()
        .expect("relay");
    let running = RunningRelay::run(relay);
    let deadline = Instant::now() + Duration::from_secs(30);
    while running.stats.snapshot().batches == 0 {
        assert!(Instant::now() < deadline, "the first batch never finished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = running.stop().await;
    let tried: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_outbox WHERE attempts > 0")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!((stats.failed, tried), (5, 5), "{stats}");
    let leased: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_outbox_leases")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(leased, 0, "the untried 15 were released at once");
}

/// The relay takes librdkafka settings from the environment as the
/// consumers do (`KAFKA_CFG_<NAME>`, how a Kubernetes ConfigMap or Secret
/// reaches it): one librdkafka refuses stops it at start-up with an error
/// that names the variable and never shows its value, which may be a
/// password.
#[sqlx::test(migrations = false)]
async fn the_relay_names_a_refused_setting_from_the_environment_but_not_its_value(pool: PgPool) {
    let mut child = Command::new(example("outbox"))
        .args(["--role", "relay"])
        .env("DATABASE_URL", database_url(&pool))
        .env("KAFKA_BROKERS", brokers())
        .env("KAFKA_CFG_NO_SUCH__SETTING", "hunter2-secret")
        .env_remove("DEDUP_FAILPOINT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the outbox example");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the relay started despite a setting librdkafka refuses");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let output = child.wait_with_output().expect("output");
    assert!(
        !output.status.success(),
        "a refused setting stops the relay"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("KAFKA_CFG_NO_SUCH__SETTING"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

/// Where [`record_and_announce`] enqueues its announcements, by input topic.
static ANNOUNCE_TO: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// Credits the payment and enqueues an announcement of it, in one
/// transaction: the outbox event is made while the payment's span is
/// current.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_and_announce(
    tx: &mut PgTx,
    ev: PaymentReceived,
    meta: &dedup_core::Meta,
) -> Result<(), dedup_core::HandlerError> {
    credit(tx, &ev)
        .await
        .map_err(dedup_core::HandlerError::transient)?;
    let to = ANNOUNCE_TO
        .lock()
        .expect("lock")
        .iter()
        .find(|(input, _)| input == meta.topic())
        .map(|(_, output)| output.clone())
        .ok_or_else(|| dedup_core::HandlerError::permanent("no output topic"))?;
    let body = payment(uuid::Uuid::new_v4(), &ev.account_id, ev.amount_cents);
    let message = OutboxMessage::bytes(to, body).with_key(ev.account_id.as_str());
    dedup_postgres::enqueue(tx, message)
        .await
        .map_err(dedup_core::HandlerError::transient)?;
    Ok(())
}

/// One trace from end to end, for each of three records produced with a
/// `traceparent` of its own (consumed as one batch when they come
/// together, each event still in its own span): a consumer that credits
/// it and enqueues an outbox event in the same transaction, the relay that
/// publishes it, and the next consumer. The spans (in OpenTelemetry's
/// in-memory exporter) of each record share its trace id and chain parent
/// to child: the producer's span, `process <input>` (consumer), `send
/// <output>` (producer), `process <output>` (consumer).
#[sqlx::test(migrations = false)]
async fn one_trace_follows_each_event_through_the_outbox_and_the_relay(pool: PgPool) {
    use opentelemetry::trace::{SpanId, SpanKind, TraceId};
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());

    let store = store(&pool).await;
    let outbox = migrated_outbox(&pool).await;
    let input = create_topic(1).await;
    let output = create_topic(1).await;
    ANNOUNCE_TO
        .lock()
        .expect("lock")
        .push((input.clone(), output.clone()));
    let upstream = "00f067aa0ba902b7";
    let p = producer();
    // Produces `payload` with a trace of its own: its trace id.
    let traced = async |payload: &[u8]| {
        let trace = uuid::Uuid::new_v4().simple().to_string();
        let traceparent = format!("00-{trace}-{upstream}-01");
        p.send(
            rdkafka::producer::FutureRecord::to(&input)
                .key("traced")
                .payload(payload)
                .headers(
                    rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                        key: "traceparent",
                        value: Some(&traceparent),
                    }),
                ),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
        TraceId::from_hex(&trace).expect("hex")
    };
    let mut traces = Vec::new();
    for i in 0..3 {
        traces.push(traced(&payment(uuid::Uuid::new_v4(), &format!("traced-{i}"), 7)).await);
    }
    // And a poison one, traced too: dead-lettered from its own span.
    let poisoned = traced(b"not json").await;

    let first = drain(
        Consumer::builder(store.clone())
            .brokers(brokers())
            .group_id(unique("g"))
            .handle(&input, record_and_announce)
            // Lingers long enough that the four make one batch.
            .batch_linger(Duration::from_secs(2)),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        (first.applied, first.dead_lettered, first.batches),
        (3, 1, 1),
        "{first:?}"
    );
    let relay = RunningRelay::start(outbox.clone(), &brokers(), 10);
    wait_until_published(&outbox, Duration::from_secs(60)).await;
    relay.stop().await;
    let next = drain(
        Consumer::builder(store)
            .brokers(brokers())
            .group_id(unique("g"))
            .handle(&output, credit_relayed_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(next.applied, 3, "{next:?}");

    let finished = exporter.get_finished_spans().expect("spans");
    // The batch's own span links to the four.
    let batch = finished
        .iter()
        .find(|s| s.name == format!("process {input}") && s.links.len() == 4)
        .expect("the batch's span, linked to its four messages");
    // The dead letter continues the poison message's trace, from the span
    // it was processed in.
    let processed = finished
        .iter()
        .find(|s| s.span_context.trace_id() == poisoned && s.name == format!("process {input}"))
        .expect("the poison message's span");
    let dead = common::read_exactly(&brokers(), &format!("{input}.dlq"), 1).await;
    assert_eq!(
        header(&dead[0], "traceparent"),
        Some(format!("00-{poisoned}-{}-01", processed.span_context.span_id()).as_str())
    );
    assert!(
        traces
            .iter()
            .all(|t| batch.links.iter().any(|l| l.span_context.trace_id() == *t))
    );
    for trace in traces {
        let spans: Vec<_> = finished
            .iter()
            .filter(|s| s.span_context.trace_id() == trace)
            .collect();
        let find = |name: &str| {
            spans
                .iter()
                .find(|s| s.name == name)
                .copied()
                .unwrap_or_else(|| {
                    let names: Vec<_> = spans.iter().map(|s| s.name.clone()).collect();
                    panic!("no span {name:?} in trace {trace}: {names:?}")
                })
        };
        let consumed = find(&format!("process {input}"));
        let sent = find(&format!("send {output}"));
        let next = find(&format!("process {output}"));
        assert_eq!(
            consumed.parent_span_id,
            SpanId::from_hex(upstream).expect("hex")
        );
        assert!(consumed.parent_span_is_remote);
        assert_eq!(sent.parent_span_id, consumed.span_context.span_id());
        assert_eq!(next.parent_span_id, sent.span_context.span_id());
        assert_eq!(
            (
                consumed.span_kind.clone(),
                sent.span_kind.clone(),
                next.span_kind.clone()
            ),
            (SpanKind::Consumer, SpanKind::Producer, SpanKind::Consumer)
        );
        let attribute = |span: &opentelemetry_sdk::trace::SpanData, key: &str| {
            span.attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(
            attribute(consumed, "messaging.system").as_deref(),
            Some("kafka")
        );
        assert_eq!(
            attribute(consumed, "messaging.destination.name").as_deref(),
            Some(input.as_str())
        );
        assert!(attribute(consumed, "messaging.kafka.offset").is_some());
    }
    let _ = provider.shutdown();
}
