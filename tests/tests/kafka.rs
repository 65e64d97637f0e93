//! End to end through a real Apache Kafka broker (started by
//! scripts/kafka.sh on 127.0.0.1:9092) and a real PostgreSQL, one database
//! per test, random topic and group names per test.
//!
//! The handlers add to a balance (NON-idempotent), so a double apply shows.

use dedup_tests::common;

use std::process::Command;
use std::time::{Duration, Instant};

use dedup_core::{Describe as _, HandlerExt, Ttl, idempotent};
use dedup_kafka::{Consumer, ConsumerBuilder, RetryPolicy};
use dedup_postgres::{PgStore, PgTx};
use dedup_tests::{PaymentReceived, credit, payment, store, total_balance as balance};
use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;

use common::{
    KillOnDrop, brokers, create_topic, database_url, drain, example, header, last_line, producer,
    read_exactly, start, unique,
};

async fn produce(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &[u8],
    headers: Option<OwnedHeaders>,
) {
    let mut record = FutureRecord::to(topic).key(key).payload(payload);
    if let Some(headers) = headers {
        record = record.headers(headers);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
}

/// Produces every `(key, payload)` without waiting for each in turn, then
/// waits until all are acknowledged.
async fn produce_all(
    producer: &FutureProducer,
    topic: &str,
    records: impl IntoIterator<Item = (String, Vec<u8>)>,
) {
    let mut deliveries = Vec::new();
    for (key, payload) in records {
        let record = FutureRecord::<str, [u8]>::to(topic)
            .key(&key)
            .payload(&payload);
        let delivery = producer
            .send_result(record)
            .map_err(|(e, _)| e)
            .expect("queued");
        deliveries.push(delivery);
    }
    for delivery in deliveries {
        delivery
            .await
            .expect("delivered")
            .map_err(|(e, _)| e)
            .expect("produced");
    }
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

/// Slow enough that a rebalance or a shutdown lands mid-stream.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_slowly(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    tokio::time::sleep(Duration::from_millis(15)).await;
    credit(tx, &ev).await
}

/// The first call in a database kills its own connection (SQLSTATE 57P01,
/// as a failover or a restart would); later calls succeed. The gate is a
/// sequence because sequences do not roll back.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_losing_connection_once(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT CASE WHEN nextval('connection_loss_gate') = 1 THEN pg_terminate_backend(pg_backend_pid()) END")
        .execute(&mut **tx)
        .await?;
    credit(tx, &ev).await
}

fn consumer(store: &PgStore, group: &str) -> ConsumerBuilder<PgStore> {
    Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(group)
        .commit_interval(Duration::from_millis(200))
        .retry(
            RetryPolicy::default()
                .with_backoff(Duration::from_millis(20), Duration::from_millis(200)),
        )
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
}

#[sqlx::test(migrations = false)]
async fn ttl_cases_end_to_end(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    // Long enough that the duplicate surely arrives within it on a loaded
    // machine, short enough to wait out.
    let ttl = Ttl::from_secs(6).unwrap();
    let running =
        start(consumer(&store, &unique("g")).handle(&topic, record_payment.with_ttl(ttl)));
    let producer = producer();
    let event = payment(uuid::Uuid::new_v4(), "acct", 100);

    produce(&producer, &topic, "acct", &event, None).await;
    running
        .wait_for("first delivery applied", |s| s.applied == 1)
        .await;
    // The claim was taken before this, so it has expired by then.
    let expired_by = Instant::now() + ttl.as_duration() + Duration::from_millis(300);
    assert_eq!(balance(&pool).await, 100, "(A) the first delivery applies");

    produce(&producer, &topic, "acct", &event, None).await;
    running
        .wait_for("duplicate skipped", |s| s.skipped == 1)
        .await;
    assert_eq!(
        balance(&pool).await,
        100,
        "(B) a duplicate within the TTL is skipped"
    );

    tokio::time::sleep_until(expired_by.into()).await;
    produce(&producer, &topic, "acct", &event, None).await;
    running
        .wait_for("late redelivery applied", |s| s.applied == 2)
        .await;
    assert_eq!(
        balance(&pool).await,
        200,
        "(C) after the TTL the event applies again"
    );

    let stats = running.stop().await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (2, 1, 0)
    );
}

#[sqlx::test(migrations = false)]
async fn poison_messages_are_dead_lettered_and_the_partition_moves_on(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let traced = OwnedHeaders::new().insert(Header {
        key: "trace-id",
        value: Some("t-42"),
    });
    produce(
        &producer,
        &topic,
        "k1",
        b"{\"event_id\": \"e1\", oops",
        Some(traced),
    )
    .await;
    produce(
        &producer,
        &topic,
        "k2",
        br#"{"account_id": "a", "amount_cents": 5}"#,
        None,
    )
    .await;
    produce(
        &producer,
        &topic,
        "k3",
        br#"{"event_id": "", "account_id": "a", "amount_cents": 5}"#,
        None,
    )
    .await;
    for i in 0..3 {
        produce(
            &producer,
            &topic,
            "good",
            &payment(uuid::Uuid::new_v4(), "a", 10 + i),
            None,
        )
        .await;
    }

    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payment));
    running
        .wait_for("3 applied and 3 dead-lettered", |s| {
            s.applied == 3 && s.dead_lettered == 3
        })
        .await;
    running.stop().await;
    assert_eq!(
        balance(&pool).await,
        10 + 11 + 12,
        "the good messages after the poison ones are applied"
    );

    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 3).await;
    let kinds: Vec<_> = dead
        .iter()
        .map(|m| header(m, "dedup.error.kind").unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["decode", "decode", "key"],
        "malformed JSON, missing key field, empty key"
    );
    for (i, m) in dead.iter().enumerate() {
        assert_eq!(header(m, "dedup.original.topic"), Some(topic.as_str()));
        assert_eq!(header(m, "dedup.original.partition"), Some("0"));
        assert_eq!(
            header(m, "dedup.original.offset"),
            Some(i.to_string().as_str())
        );
        assert_eq!(
            header(m, "dedup.attempts"),
            Some("1"),
            "permanent errors are not retried"
        );
        assert_eq!(header(m, "dedup.handler"), Some(record_payment.scope()));
        assert!(!header(m, "dedup.error.message").unwrap().is_empty());
        assert_eq!(
            m.key(),
            Some(format!("k{}", i + 1).as_bytes()),
            "the original key is kept"
        );
    }
    assert_eq!(
        dead[0].payload(),
        Some(&b"{\"event_id\": \"e1\", oops"[..]),
        "the original bytes are kept"
    );
    assert_eq!(
        header(&dead[0], "trace-id"),
        Some("t-42"),
        "the original headers are kept"
    );
    assert!(
        header(&dead[2], "dedup.error.message")
            .unwrap()
            .contains("empty")
    );
}

/// Event ids are unique per tenant only: the claim is on both.
#[idempotent(key = "header:tenant, event_id", ttl = "4h")]
async fn record_tenant_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

#[sqlx::test(migrations = false)]
async fn a_composite_key_claims_per_tenant_and_a_missing_part_is_dead_lettered(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let event = |id: &str, cents: i64| {
        serde_json::json!({ "event_id": id, "account_id": "acct", "amount_cents": cents })
            .to_string()
            .into_bytes()
    };
    let tenant = |name: &'static str| {
        Some(OwnedHeaders::new().insert(Header {
            key: "tenant",
            value: Some(name),
        }))
    };
    let records = [
        (tenant("t-a"), event("e1", 1)),
        (tenant("t-b"), event("e1", 2)),
        (tenant("t-a"), event("e1", 4)),
        (tenant("a,b"), event("c", 8)),
        (tenant("a"), event("b,c", 16)),
        (None, event("e2", 32)),
        (tenant("t-a"), event("", 64)),
        (tenant("t-a"), event("e3", 128)),
    ];
    for (headers, payload) in records {
        produce(&producer, &topic, "k", &payload, headers).await;
    }

    let running = start(consumer(&store, &unique("g")).handle(&topic, record_tenant_payment));
    running
        .wait_for("5 applied, 1 skipped, 2 dead-lettered", |s| {
            s.applied + s.skipped + s.dead_lettered == 8
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (5, 1, 2)
    );
    assert_eq!(
        balance(&pool).await,
        1 + 2 + 8 + 16 + 128,
        "t-b's e1 is not t-a's; (\"a,b\", \"c\") is not (\"a\", \"b,c\")"
    );
    let mut ids: Vec<String> = sqlx::query_scalar("SELECT key FROM dedup_claims WHERE scope = $1")
        .bind(record_tenant_payment.scope())
        .fetch_all(&pool)
        .await
        .unwrap();
    ids.sort();
    assert_eq!(
        ids,
        [r"a,b\,c", r"a\,b,c", "t-a,e1", "t-a,e3", "t-b,e1"],
        "the claims as the CLI finds them (`--key t-a --key e1`)"
    );

    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    for (m, part) in dead.iter().zip(["`tenant` header", "key part `event_id`"]) {
        assert_eq!(header(m, "dedup.error.kind"), Some("key"));
        let message = header(m, "dedup.error.message").unwrap();
        assert!(message.contains(part), "{message:?} names {part}");
    }
}

/// The claim keeps a fingerprint of the fields that make a payment.
#[idempotent(key = "event_id", ttl = "4h", fingerprint = "account_id, amount_cents")]
async fn record_payment_checked(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

/// Sends, in one partition: e1, e2, e1 again written otherwise (a
/// redelivery), e1 and e2 with other amounts (reused ids), e3; then, once
/// those are finished, e3 with another amount (against a committed claim).
/// Returns the stats and the dead-letter topic.
async fn send_reused_ids(
    pool: &PgPool,
    tune: impl FnOnce(ConsumerBuilder<PgStore>) -> ConsumerBuilder<PgStore>,
    finished: u64,
) -> (dedup_kafka::StatsSnapshot, String) {
    let store = store(pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let event = |id: &str, cents: i64| {
        format!(r#"{{"event_id":"{id}","account_id":"acct","amount_cents":{cents}}}"#).into_bytes()
    };
    let resent = br#"{ "amount_cents": 1, "account_id": "acct", "event_id": "e1", "sent_at": 2 }"#;
    let first = [
        event("e1", 1),
        event("e2", 2),
        resent.to_vec(),
        event("e1", 100),
        event("e2", 200),
        event("e3", 4),
    ];
    for payload in first {
        produce(&producer, &topic, "k", &payload, None).await;
    }
    let running =
        start(tune(consumer(&store, &unique("g"))).handle(&topic, record_payment_checked));
    running
        .wait_for("the first six finished", |s| {
            s.applied + s.skipped + s.dead_lettered == finished - 1
        })
        .await;
    produce(&producer, &topic, "k", &event("e3", 400), None).await;
    running
        .wait_for("the last one finished", |s| {
            s.applied + s.skipped + s.dead_lettered == finished
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(
        balance(pool).await,
        1 + 2 + 4,
        "each id applied once, with its first content"
    );
    (stats, format!("{topic}.dlq"))
}

/// The three reused ids are dead-lettered in offset order with their kind.
async fn assert_reused_ids_dead_lettered(stats: &dedup_kafka::StatsSnapshot, dlq: &str) {
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (3, 1, 3)
    );
    let dead = read_exactly(&brokers(), dlq, 3).await;
    let offsets: Vec<_> = dead
        .iter()
        .map(|m| header(m, "dedup.original.offset").unwrap().to_owned())
        .collect();
    assert_eq!(offsets, ["3", "4", "6"]);
    for m in &dead {
        assert_eq!(header(m, "dedup.error.kind"), Some("fingerprint_mismatch"));
        let message = header(m, "dedup.error.message").unwrap();
        assert!(message.contains("reused an id"), "{message}");
    }
}

#[sqlx::test(migrations = false)]
async fn a_reused_id_with_other_content_is_dead_lettered_not_skipped(pool: PgPool) {
    let (stats, dlq) = send_reused_ids(&pool, |c| c, 7).await;
    assert_reused_ids_dead_lettered(&stats, &dlq).await;
}

#[sqlx::test(migrations = false)]
async fn a_reused_id_is_dead_lettered_message_by_message_too(pool: PgPool) {
    let (stats, dlq) = send_reused_ids(&pool, |c| c.batch_size(1), 7).await;
    assert_reused_ids_dead_lettered(&stats, &dlq).await;
}

#[sqlx::test(migrations = false)]
async fn a_reused_id_can_be_skipped_with_a_warning_instead(pool: PgPool) {
    let (stats, dlq) = send_reused_ids(
        &pool,
        |c| c.on_fingerprint_mismatch(dedup_kafka::OnFingerprintMismatch::Skip),
        7,
    )
    .await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (3, 4, 0),
        "nothing dead-lettered to {dlq}"
    );
}

#[sqlx::test(migrations = false)]
async fn a_lost_database_connection_is_retried_and_applied_once(pool: PgPool) {
    let store = store(&pool).await;
    sqlx::query("CREATE SEQUENCE connection_loss_gate")
        .execute(&pool)
        .await
        .unwrap();
    let topic = create_topic(1).await;
    produce(
        &producer(),
        &topic,
        "a",
        &payment(uuid::Uuid::new_v4(), "a", 77),
        None,
    )
    .await;

    let running =
        start(consumer(&store, &unique("g")).handle(&topic, record_payment_losing_connection_once));
    running
        .wait_for("applied after a retry", |s| s.applied == 1)
        .await;
    let stats = running.stop().await;
    assert!(
        stats.retries >= 1,
        "the lost connection must have been retried: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0);
    assert_eq!(balance(&pool).await, 77);
}

#[sqlx::test(migrations = false)]
async fn a_rebalance_mid_stream_applies_every_event_exactly_once(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(4).await;
    let group = unique("g");
    let producer = producer();
    let mut expected = 0;
    let mut events = Vec::new();
    for i in 0..240 {
        let account = format!("acct-{}", i % 8);
        let event = payment(uuid::Uuid::new_v4(), &account, i + 1);
        expected += i + 1;
        events.push((account, event));
    }
    // Every 6th event again, as a retrying producer would.
    let duplicates: Vec<_> = events.iter().step_by(6).cloned().collect();
    for (account, event) in events.iter().chain(&duplicates) {
        produce(&producer, &topic, account, event, None).await;
    }

    // A small buffer makes partitions pause and resume around the rebalance.
    let builder = || {
        consumer(&store, &group)
            .max_buffered_per_partition(4)
            .handle(&topic, record_payment_slowly)
    };
    let first = start(builder());
    first
        .wait_for("the first consumer under way", |s| s.applied >= 30)
        .await;
    let second = start(builder());
    let deadline = Instant::now() + Duration::from_secs(90);
    while first.stats.snapshot().applied + second.stats.snapshot().applied < 240 {
        assert!(
            Instant::now() < deadline,
            "not every event was applied: {} + {}",
            first.stats.snapshot(),
            second.stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (a, b) = (first.stop().await, second.stop().await);
    assert!(
        b.applied + b.skipped > 0,
        "the second consumer got partitions: {a} / {b}"
    );
    assert_eq!(
        a.applied + b.applied,
        240,
        "each distinct event applied exactly once: {a} / {b}"
    );
    assert_eq!(balance(&pool).await, expected);
}

#[sqlx::test(migrations = false)]
async fn shutdown_commits_what_finished(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(2).await;
    let group = unique("g");
    let producer = producer();
    for i in 0..60 {
        produce(
            &producer,
            &topic,
            &format!("k{}", i % 4),
            &payment(uuid::Uuid::new_v4(), "a", 1),
            None,
        )
        .await;
    }

    // Stop mid-stream.
    // Small batches, so that the stop lands between them.
    let running = start(
        consumer(&store, &group)
            .batch_size(4)
            .handle(&topic, record_payment_slowly),
    );
    running.wait_for("some applied", |s| s.applied >= 20).await;
    let first = running.stop().await;
    assert!(
        first.applied < 60,
        "the stop should land mid-stream: {first}"
    );

    // The restart reprocesses nothing that finished: no duplicates to skip.
    let second = drain(
        consumer(&store, &group)
            .batch_size(4)
            .handle(&topic, record_payment_slowly),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        second.skipped, 0,
        "a finished message was delivered again: {first} then {second}"
    );
    assert_eq!(first.applied + second.applied, 60);
    assert_eq!(balance(&pool).await, 60);
}

#[sqlx::test(migrations = false)]
async fn a_crash_between_database_commit_and_offset_commit_is_skipped_on_restart(pool: PgPool) {
    let topic = create_topic(1).await;
    let group = unique("g");
    produce(
        &producer(),
        &topic,
        "acct",
        &payment(uuid::Uuid::new_v4(), "acct", 500),
        None,
    )
    .await;
    let run = |failpoint| run_payments(&pool, &topic, &group, failpoint);

    // The process dies right after the database commit, before any offset commit.
    let crashed = run(Some("after-commit"));
    assert!(
        !crashed.status.success(),
        "the failpoint must kill the process"
    );
    assert_eq!(
        balance(&pool).await,
        500,
        "the effect committed before the crash"
    );

    // The restarted consumer gets the message again and skips it.
    let restarted = run(None);
    assert!(
        restarted.status.success(),
        "{}",
        String::from_utf8_lossy(&restarted.stderr)
    );
    let stdout = String::from_utf8_lossy(&restarted.stdout);
    assert_eq!(
        stdout.lines().last(),
        Some("applied=0 skipped=1 dead_lettered=0"),
        "{stdout}"
    );
    assert_eq!(
        balance(&pool).await,
        500,
        "applied exactly once across the crash"
    );
}

/// A crash after a dead letter is acknowledged and before its offset is
/// committed: the restarted consumer neither dead-letters the message again
/// (the dead-letter topic holds exactly one copy) nor, once the cause is
/// gone, applies it. Run as the payments example, killed at the failpoint.
#[sqlx::test(migrations = false)]
async fn a_crash_after_a_dead_letter_neither_copies_nor_applies_it(pool: PgPool) {
    let topic = create_topic(1).await;
    let group = unique("g");
    // The database refuses account "blocked" (a CHECK-like rule of the
    // event's data, SQLSTATE 23514): dead-lettered at once.
    sqlx::raw_sql(
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL); \
         CREATE FUNCTION refuse_blocked() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.id = 'blocked' THEN \
             RAISE EXCEPTION 'account blocked' USING ERRCODE = 'check_violation'; \
         END IF; RETURN NEW; END $$; \
         CREATE TRIGGER refuse_blocked BEFORE INSERT OR UPDATE ON accounts \
         FOR EACH ROW EXECUTE FUNCTION refuse_blocked();",
    )
    .execute(&pool)
    .await
    .expect("schema");
    let producer = producer();
    produce(&producer, &topic, "x", b"not json", None).await;
    let blocked = payment(uuid::Uuid::new_v4(), "blocked", 1000);
    produce(&producer, &topic, "blocked", &blocked, None).await;
    let good = payment(uuid::Uuid::new_v4(), "acct", 5);
    produce(&producer, &topic, "acct", &good, None).await;
    let run = |failpoint| run_payments(&pool, &topic, &group, failpoint);

    // Both dead letters acknowledged, then the process dies before any
    // offset commit (every 5 s).
    let crashed = run(Some("after-dead-letter:2"));
    assert!(
        !crashed.status.success(),
        "the failpoint must kill the process: {}",
        String::from_utf8_lossy(&crashed.stderr)
    );
    assert_eq!(balance(&pool).await, 0, "nothing applied before the crash");

    // The cause is fixed: the blocked account would now be credited.
    sqlx::query("DROP TRIGGER refuse_blocked ON accounts")
        .execute(&pool)
        .await
        .expect("unblock");
    let restarted = run(None);
    assert!(
        restarted.status.success(),
        "{}",
        String::from_utf8_lossy(&restarted.stderr)
    );
    let stdout = String::from_utf8_lossy(&restarted.stdout);
    assert_eq!(
        stdout.lines().last(),
        Some("applied=1 skipped=0 dead_lettered=0"),
        "{stdout}"
    );
    assert_eq!(
        balance(&pool).await,
        5,
        "the dead-lettered payment is not applied by its redelivery"
    );
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    let offsets: Vec<_> = dead
        .iter()
        .map(|m| header(m, "dedup.original.offset").map(str::to_owned))
        .collect();
    assert_eq!(
        offsets,
        [Some("0".into()), Some("1".into())],
        "one copy each"
    );
}

/// A dead letter's record belongs to that message, not to its offset: a
/// topic deleted and created again (offsets from 0 again) within the TTL
/// gets its new messages applied, never skipped as dead-lettered before.
#[sqlx::test(migrations = false)]
async fn a_topic_created_again_is_not_taken_for_its_dead_letters(pool: PgPool) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(&producer, &topic, "k", b"not json", None).await;
    let first = drain(
        consumer(&store, &unique("g")).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(first.dead_lettered, 1, "{first:?}");

    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin");
    let options = AdminOptions::new();
    admin
        .delete_topics(&[&topic], &options)
        .await
        .expect("delete")
        .into_iter()
        .for_each(|r| {
            r.expect("deleted");
        });
    // Deletion finishes in the background: retry the creation until the
    // name is free.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let created = admin
            .create_topics(
                &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
                &options,
            )
            .await
            .expect("create");
        if created.iter().all(Result::is_ok) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the topic was not created again: {created:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Offset 0 again, a different message.
    let event = payment(uuid::Uuid::new_v4(), "acct", 9);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sent = producer
            .send(
                FutureRecord::to(&topic).key("acct").payload(&event),
                Duration::from_secs(10),
            )
            .await;
        match sent {
            Ok(_) => break,
            Err((e, _)) => {
                assert!(Instant::now() < deadline, "producing to the new topic: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    let second = drain(
        consumer(&store, &unique("g")).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        (second.applied, second.already_dead_lettered),
        (1, 0),
        "{second:?}"
    );
    assert_eq!(balance(&pool).await, 9);
}

/// Runs the payments example until idle, killed at `failpoint` if given.
/// The crashed member holds its partition until its session times out;
/// kept short so that a restart gets it soon.
fn run_payments(
    pool: &PgPool,
    topic: &str,
    group: &str,
    failpoint: Option<&str>,
) -> std::process::Output {
    let mut cmd = common::payments(pool, topic, group);
    cmd.args(["--exit-when-idle", "3s"])
        .env("KAFKA_SESSION_TIMEOUT_MS", "6000");
    if let Some(f) = failpoint {
        cmd.env("DEDUP_FAILPOINT", f);
    }
    cmd.output().expect("run the payments example")
}

/// Fails transiently, forever, for the account "stuck".
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_stuck_account(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), dedup_core::HandlerError> {
    if ev.account_id == "stuck" {
        return Err(dedup_core::HandlerError::transient(
            "the downstream ledger timed out",
        ));
    }
    credit(tx, &ev).await?;
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn a_retrying_partition_does_not_stall_the_others(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(2).await;
    let producer = producer();
    let send = |partition: i32, payload: Vec<u8>| {
        let (producer, topic) = (producer.clone(), topic.clone());
        async move {
            let record = FutureRecord::<str, [u8]>::to(&topic)
                .partition(partition)
                .payload(&payload);
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)
                .expect("produced");
        }
    };
    send(0, payment(uuid::Uuid::new_v4(), "stuck", 1)).await;
    send(0, payment(uuid::Uuid::new_v4(), "after-stuck", 1)).await;

    let retry = RetryPolicy::default()
        .with_max_attempts(12)
        .with_backoff(Duration::from_millis(1000), Duration::from_millis(1500));
    let running = start(
        consumer(&store, &unique("g"))
            // One handler at a time: backing off must not hold the slot.
            .max_concurrent_partitions(1)
            .retry(retry)
            .handle(&topic, record_payment_stuck_account),
    );
    // Partition 0 is in its retry loop (8 to 16 s of back-off in all) when
    // partition 1's messages arrive; they must not wait for it.
    running
        .wait_for("partition 0 retrying", |s| s.retries >= 1)
        .await;
    for _ in 0..20 {
        send(1, payment(uuid::Uuid::new_v4(), "flowing", 1)).await;
    }
    running
        .wait_for("partition 1 applied", |s| s.applied >= 20)
        .await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "partition 1 finished while partition 0 was still retrying: {during}"
    );

    // Partition 0 keeps its order: the stuck message is dead-lettered after
    // its attempts, then the one behind it is applied.
    running
        .wait_for("stuck message dead-lettered", |s| {
            s.dead_lettered == 1 && s.applied == 21
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.attempts"), Some("12"));
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("handler"));
    assert_eq!(balance(&pool).await, 21);
}

#[sqlx::test(migrations = false)]
async fn the_produce_and_payments_examples_agree_on_every_count(pool: PgPool) {
    let topic = create_topic(3).await;
    let produced = Command::new(example("produce"))
        .args([
            "--count",
            "300",
            "--duplicates",
            "0.2",
            "--malformed",
            "0.05",
            "--accounts",
            "7",
        ])
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", &topic)
        .output()
        .expect("run produce");
    assert!(
        produced.status.success(),
        "{}",
        String::from_utf8_lossy(&produced.stderr)
    );
    // produced=N distinct=N duplicates=N malformed=N total_cents=N
    let counts: std::collections::HashMap<String, i64> = last_line(&produced)
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.parse().expect("a number")))
        .collect();
    assert!(
        counts["duplicates"] > 0 && counts["malformed"] > 0,
        "{counts:?}"
    );

    let consumed = common::payments(&pool, &topic, &unique("g"))
        .args(["--exit-when-idle", "2s"])
        .output()
        .expect("run payments");
    assert!(
        consumed.status.success(),
        "{}",
        String::from_utf8_lossy(&consumed.stderr)
    );
    assert_eq!(
        last_line(&consumed),
        format!(
            "applied={} skipped={} dead_lettered={}",
            counts["distinct"], counts["duplicates"], counts["malformed"]
        )
    );
    assert_eq!(
        balance(&pool).await,
        counts["total_cents"],
        "every distinct payment exactly once"
    );
}

#[sqlx::test(migrations = false)]
async fn the_orders_example_shuts_down_gracefully_on_sigterm(pool: PgPool) {
    let topic = create_topic(1).await;
    let producer = producer();
    let ids: Vec<String> = (0..3).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    let events = [
        (&ids[0], "created", 1),
        (&ids[1], "paid", 2),
        (&ids[1], "paid", 2),
        (&ids[2], "shipped", 3),
    ];
    for (id, status, version) in events {
        let event = serde_json::json!({ "event_id": id, "order_id": "o-1", "status": status, "version": version });
        produce(&producer, &topic, "o-1", event.to_string().as_bytes(), None).await;
    }

    let log_path = std::env::temp_dir().join(format!("{topic}.orders.log"));
    let child = Command::new(example("orders"))
        .env("DATABASE_URL", database_url(&pool))
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", &topic)
        .env("GROUP_ID", unique("g"))
        .stdout(std::process::Stdio::piped())
        // Logs to a file, not a pipe nobody drains while waiting for the exit.
        .stderr(std::fs::File::create(&log_path).expect("log file"))
        .spawn()
        .expect("start orders");
    let mut child = KillOnDrop(Some(child));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let row: Option<(String, i32)> =
            sqlx::query_as("SELECT status, updates FROM orders WHERE id = 'o-1'")
                .fetch_optional(&pool)
                .await
                .unwrap_or(None);
        if let Some((status, 3)) = row {
            assert_eq!(status, "shipped");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the orders example did not apply the events"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let pid = child.0.as_ref().expect("running").id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    while child
        .0
        .as_mut()
        .expect("running")
        .try_wait()
        .expect("wait")
        .is_none()
    {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "the orders example did not exit after SIGTERM:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let output = child
        .0
        .take()
        .expect("exited")
        .wait_with_output()
        .expect("orders output");
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        output.status.success(),
        "SIGTERM must end in exit 0:\n{log}"
    );
    assert_eq!(last_line(&output), "applied=3 skipped=1 dead_lettered=0");
}

/// Refuses negative amounts: a permanent failure in the middle of a batch.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_refusing_negatives(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), dedup_core::HandlerError> {
    credit(tx, &ev).await?;
    if ev.amount_cents < 0 {
        return Err(dedup_core::HandlerError::permanent("negative amount"));
    }
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn a_poison_message_inside_a_batch_is_isolated(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    // All produced before the consumer starts, so they arrive as one batch.
    for i in 0..5 {
        produce(
            &producer,
            &topic,
            "k",
            &payment(uuid::Uuid::new_v4(), "a", 10 + i),
            None,
        )
        .await;
    }
    produce(
        &producer,
        &topic,
        "k",
        &payment(uuid::Uuid::new_v4(), "a", -1000),
        None,
    )
    .await;
    for i in 0..5 {
        produce(
            &producer,
            &topic,
            "k",
            &payment(uuid::Uuid::new_v4(), "a", 20 + i),
            None,
        )
        .await;
    }

    let running = start(
        consumer(&store, &unique("g"))
            .batch_linger(Duration::from_millis(200))
            .handle(&topic, record_payment_refusing_negatives),
    );
    running
        .wait_for("10 applied, 1 dead-lettered", |s| {
            s.applied == 10 && s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    assert!(
        stats.batch_replays >= 1,
        "the batch with the poison was rolled back and replayed: {stats:?}"
    );
    // The negative amount's own write was rolled back with its transaction.
    assert_eq!(
        balance(&pool).await,
        (10..15).sum::<i64>() + (20..25).sum::<i64>()
    );
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("handler"));
    assert_eq!(header(&dead[0], "dedup.original.offset"), Some("5"));
}

#[sqlx::test(migrations = false)]
async fn batches_commit_many_messages_per_transaction(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let mut expected = 0;
    for i in 0..300 {
        let event = payment(uuid::Uuid::new_v4(), "a", i);
        produce(&producer, &topic, "k", &event, None).await;
        if i % 10 == 0 {
            produce(&producer, &topic, "k", &event, None).await; // a producer retry
        }
        expected += i;
    }
    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payment));
    running
        .wait_for("all applied", |s| s.applied == 300 && s.skipped == 30)
        .await;
    let stats = running.stop().await;
    assert!(
        stats.batches >= 2 && stats.batches <= 100,
        "330 messages should take a few batch transactions, not one each: {stats:?}"
    );
    assert_eq!(stats.batch_replays, 0);
    assert_eq!(balance(&pool).await, expected);
}

/// Receives all claimed events of a batch in one call.
#[idempotent(key = "event_id", ttl = "4h", batch)]
async fn record_payments_in_bulk(
    tx: &mut PgTx,
    events: Vec<PaymentReceived>,
) -> Result<(), dedup_core::HandlerError> {
    BULK_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    for ev in &events {
        credit(tx, ev).await?;
    }
    Ok(())
}

static BULK_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[sqlx::test(migrations = false)]
async fn a_batch_handler_gets_each_batch_in_one_call(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    for i in 0..100 {
        let event = payment(uuid::Uuid::new_v4(), "a", i);
        produce(&producer, &topic, "k", &event, None).await;
        if i % 4 == 0 {
            produce(&producer, &topic, "k", &event, None).await;
        }
    }
    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payments_in_bulk));
    running
        .wait_for("all applied", |s| s.applied == 100 && s.skipped == 25)
        .await;
    let stats = running.stop().await;
    let calls = BULK_CALLS.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (1..50).contains(&calls),
        "100 events should come in a few calls, not one each: {calls}, {stats:?}"
    );
    assert_eq!(balance(&pool).await, (0..100).sum::<i64>());
}

/// A database that turns read-only (SQLSTATE 25006) is the environment's
/// fault, not the events': they wait, none is dead-lettered, and once the
/// database is writable again every one is applied once.
#[sqlx::test(migrations = false)]
async fn a_read_only_database_is_waited_out_not_dead_lettered(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let running = start(
        consumer(&store, &unique("g"))
            .retry(
                RetryPolicy::default()
                    .with_backoff(Duration::from_millis(20), Duration::from_millis(200))
                    .with_outage_backoff(Duration::from_secs(1)),
            )
            .handle(&topic, record_payment),
    );
    let producer = producer();
    let send = |cents| {
        let event = payment(uuid::Uuid::new_v4(), "acct", cents);
        let producer = producer.clone();
        let topic = topic.clone();
        async move { produce(&producer, &topic, "acct", &event, None).await }
    };
    send(1).await;
    running
        .wait_for("the first event", |s| s.applied == 1)
        .await;

    common::set_read_only(&pool, true).await;
    for _ in 0..20 {
        send(10).await;
    }
    running
        .wait_for("the read-only database to be retried", |s| s.retries >= 3)
        .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "read-only is not the events' fault: {during}"
    );
    assert_eq!(during.applied, 1, "{during}");
    assert_eq!(running.stats.waiting_out(), 1, "its one partition waits");

    common::set_read_only(&pool, false).await;
    running
        .wait_for("every event applied after the outage", |s| s.applied == 21)
        .await;
    assert_eq!(running.stats.waiting_out(), 0);
    let after = running.stop().await;
    assert_eq!(after.dead_lettered, 0, "{after}");
    assert_eq!(after.outages, 1, "one outage, counted once");
    assert_eq!(balance(&pool).await, 201, "each event applied exactly once");
}

/// With `max_outage` set, an outage that outlasts it stops the consumer with
/// an error instead of waiting for ever: nothing is dead-lettered, nothing
/// committed past the waiting event, and the next run applies it once.
#[sqlx::test(migrations = false)]
async fn an_outage_longer_than_max_outage_stops_the_consumer_and_loses_nothing(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    common::set_read_only(&pool, true).await;
    let event = payment(uuid::Uuid::new_v4(), "acct", 5);
    produce(&producer(), &topic, "acct", &event, None).await;
    let impatient = consumer(&store, &group)
        .retry(
            RetryPolicy::default()
                .with_outage_backoff(Duration::from_millis(500))
                .with_max_outage(Duration::from_secs(3)),
        )
        .handle(&topic, record_payment)
        .build()
        .expect("consumer");
    let stats = impatient.stats();
    let started = Instant::now();
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        impatient.run_until(std::future::pending()),
    )
    .await
    .expect("the consumer must stop once the outage outlasts max_outage");
    let err = ran.expect_err("an outage past max_outage is an error");
    assert!(err.to_string().contains("max_outage"), "{err}");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "not before max_outage: {:?}",
        started.elapsed()
    );
    let during = stats.snapshot();
    assert_eq!(during.dead_lettered, 0, "{during:?}");
    assert_eq!(during.applied, 0, "{during:?}");

    common::set_read_only(&pool, false).await;
    let after = drain(
        consumer(&store, &group).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        after.applied, 1,
        "the waiting event was not committed: {after:?}"
    );
    assert_eq!(balance(&pool).await, 5, "applied once");
}

/// A broker that cannot take a dead letter is an outage like the
/// database's: with `max_outage` set the consumer stops with an error
/// instead of retrying for ever, the poison message's offset is not
/// committed, and the next run dead-letters it once.
#[sqlx::test(migrations = false)]
async fn a_dead_letter_the_broker_cannot_take_is_bounded_by_max_outage(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    produce(&producer(), &topic, "k", b"not json", None).await;
    let impatient = consumer(&store, &group)
        .retry(
            RetryPolicy::default()
                .with_outage_backoff(Duration::from_millis(300))
                .with_max_outage(Duration::from_secs(3)),
        )
        // The dead-letter producer's broker is not there.
        .dead_letter_producer_set("bootstrap.servers", "127.0.0.1:1")
        .dead_letter_timeout(Duration::from_millis(500))
        .handle(&topic, record_payment)
        .build()
        .expect("consumer");
    let stats = impatient.stats();
    let started = Instant::now();
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        impatient.run_until(std::future::pending()),
    )
    .await
    .expect("the consumer must stop once the dead letter's outage outlasts max_outage");
    let err = ran.expect_err("an outage past max_outage is an error");
    assert!(err.to_string().contains("max_outage"), "{err}");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(stats.snapshot().dead_lettered, 0);

    let after = drain(
        consumer(&store, &group).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        after.dead_lettered, 1,
        "the poison was not committed: {after:?}"
    );
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(dead[0].payload(), Some(&b"not json"[..]));
}

/// Opens an account: a plain INSERT, so a second event for the same account
/// violates the primary key (SQLSTATE 23505), which is that event's fault.
#[idempotent(key = "event_id", ttl = "4h")]
async fn open_account(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO accounts (id, balance) VALUES ($1, $2)")
        .bind(&ev.account_id)
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The database rejecting an event's own data is dead-lettered at once,
/// with the SQLSTATE in the reason, and the partition moves on.
#[sqlx::test(migrations = false)]
async fn an_integrity_violation_of_the_events_data_is_dead_lettered_at_once(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let running = start(
        consumer(&store, &unique("g"))
            .batch_size(1)
            .handle(&topic, open_account),
    );
    let producer = producer();
    for account in ["a", "a", "b"] {
        let event = payment(uuid::Uuid::new_v4(), account, 5);
        produce(&producer, &topic, account, &event, None).await;
    }
    running
        .wait_for("two opened, one dead-lettered", |s| {
            s.applied == 2 && s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.retries, 0, "not retried: {stats}");
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.attempts"), Some("1"));
    let message = header(&dead[0], "dedup.error.message").unwrap_or_default();
    assert!(message.contains("23505"), "{message}");
    assert_eq!(balance(&pool).await, 10);
}

/// A message that cannot be decoded is known to be bad before any
/// transaction: it is dead-lettered where it stands and its neighbours
/// still go as batches, instead of each batch being replayed message by
/// message.
#[sqlx::test(migrations = false)]
async fn malformed_messages_do_not_slow_their_batches(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let records = (0..2000).map(|i| {
        let payload = if i % 100 == 99 {
            b"{not json".to_vec()
        } else {
            payment(uuid::Uuid::new_v4(), "a", 1)
        };
        ("k".to_owned(), payload)
    });
    produce_all(&producer, &topic, records).await;
    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payment));
    running
        .wait_for("1,980 applied and 20 dead-lettered", |s| {
            s.applied == 1980 && s.dead_lettered == 20
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.batch_replays, 0, "{stats:?}");
    assert!(stats.batches >= 8, "{stats:?}");
    assert_eq!(balance(&pool).await, 1980);
}

/// A payment whose decoding panics for one amount: user code (a
/// `Deserialize` impl) that the runtime must contain.
#[derive(Debug, serde::Deserialize)]
struct PanickyPayment {
    event_id: String,
    account_id: String,
    #[serde(deserialize_with = "amount_or_panic")]
    amount_cents: i64,
}

fn amount_or_panic<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    let amount = <i64 as serde::Deserialize>::deserialize(d)?;
    assert_ne!(amount, 666, "a Deserialize impl that panics");
    Ok(amount)
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_panicky_payment(tx: &mut PgTx, ev: PanickyPayment) -> Result<(), sqlx::Error> {
    let ev = PaymentReceived {
        event_id: ev.event_id,
        account_id: ev.account_id,
        amount_cents: ev.amount_cents,
    };
    credit(tx, &ev).await
}

/// A panic while decoding one message of a batch fails that message (a dead
/// letter of kind `panic`), not the partition's worker, which would drop
/// the messages it buffered and let a new worker commit past them.
#[sqlx::test(migrations = false)]
async fn a_panicking_decode_is_dead_lettered_and_its_neighbours_applied(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    for i in 0..11 {
        let cents = if i == 5 { 666 } else { 1 };
        let event = payment(uuid::Uuid::new_v4(), "a", cents);
        produce(&producer, &topic, "k", &event, None).await;
    }
    let running = start(
        consumer(&store, &unique("g"))
            .batch_linger(Duration::from_millis(200))
            .handle(&topic, record_panicky_payment),
    );
    running
        .wait_for("10 applied, 1 dead-lettered", |s| {
            s.applied == 10 && s.dead_lettered == 1
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("panic"));
    assert_eq!(header(&dead[0], "dedup.original.offset"), Some("5"));
    assert_eq!(balance(&pool).await, 10);
}

/// A fatal client error stops the consumer with an error instead of leaving
/// it running deaf: two instances with one `group.instance.id` (static
/// membership), the older one fenced by the broker.
#[sqlx::test(migrations = false)]
async fn a_fenced_static_member_stops_with_an_error(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    let instance = unique("instance");
    let member = |store: &PgStore| {
        consumer(store, &group)
            .set("group.instance.id", &instance)
            .handle(&topic, record_payment)
            .build()
            .expect("consumer")
    };
    let first = member(&store);
    let first_stats = first.stats();
    let first = tokio::spawn(first.run_until(std::future::pending()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while first_stats.idle_for() == Duration::ZERO {
        assert!(Instant::now() < deadline, "the first member never joined");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second =
        tokio::spawn(member(&store).run_until(tokio::time::sleep(Duration::from_secs(40))));
    let fenced = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the fenced member must stop within 30 s")
        .expect("task");
    let err = fenced.expect_err("fenced is an error");
    assert!(err.to_string().contains("fatal"), "{err}");
    second.abort();
}

/// A poison message just under Kafka's size limit: its dead letter (the
/// original plus dedup's headers) still fits, instead of being refused by
/// the producer and retried for ever while the partition stalls.
#[sqlx::test(migrations = false)]
async fn a_message_near_the_size_limit_is_dead_lettered_not_stalled(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(&producer, &topic, "k", &vec![b'x'; 999_900], None).await;
    let event = payment(uuid::Uuid::new_v4(), "a", 7);
    produce(&producer, &topic, "k", &event, None).await;
    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payment));
    running
        .wait_for("dead-lettered, and the next one applied", |s| {
            s.dead_lettered == 1 && s.applied == 1
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(
        dead[0].payload().map(<[u8]>::len),
        Some(999_900),
        "kept whole"
    );
    assert_eq!(balance(&pool).await, 7);
}

/// A dead letter larger than its topic takes keeps a cut payload, says so,
/// and the partition moves on.
#[sqlx::test(migrations = false)]
async fn a_dead_letter_too_large_for_its_topic_keeps_a_cut_payload(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let dlq = common::create_topic_with(&brokers(), 1, &[("max.message.bytes", "100000")]).await;
    let producer = producer();
    produce(&producer, &topic, "k", &vec![b'x'; 200_000], None).await;
    let event = payment(uuid::Uuid::new_v4(), "a", 3);
    produce(&producer, &topic, "k", &event, None).await;
    let running = start(
        consumer(&store, &unique("g"))
            .handle(&topic, record_payment)
            .dead_letter_topic(&topic, &dlq),
    );
    running
        .wait_for("dead-lettered, and the next one applied", |s| {
            s.dead_lettered == 1 && s.applied == 1
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &dlq, 1).await;
    assert_eq!(
        dead[0].payload().map(<[u8]>::len),
        Some(dedup_kafka::TRUNCATED_PAYLOAD_BYTES)
    );
    assert_eq!(header(&dead[0], "dedup.payload.truncated"), Some("true"));
    assert_eq!(header(&dead[0], "dedup.original.size"), Some("200000"));
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("decode"));
}

/// A dead-letter topic that can never be written stops the consumer with an
/// error that says what to do, instead of retrying silently for ever; the
/// poison message's offset is not committed.
#[sqlx::test(migrations = false)]
async fn an_unwritable_dead_letter_topic_stops_the_consumer(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(&producer, &topic, "k", b"not json", None).await;
    let consumer = consumer(&store, &unique("g"))
        .handle(&topic, record_payment)
        .dead_letter_topic(&topic, "no such topic: spaces are invalid")
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    let result = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run_until(std::future::pending()),
    )
    .await
    .expect("the consumer must stop on its own");
    let err = result.expect_err("an unwritable dead-letter topic is fatal");
    assert!(err.to_string().contains("cannot be written"), "{err}");
    assert_eq!(stats.snapshot().dead_lettered, 0);
}

/// Slower than its own TTL: the claim taken at the start of the
/// transaction would expire before the commit.
#[idempotent(key = "event_id", ttl = "2s")]
async fn record_payment_slower_than_its_ttl(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    tokio::time::sleep(Duration::from_secs(3)).await;
    credit(tx, &ev).await
}

/// A handler that runs longer than its TTL still commits a live claim (its
/// TTL restarts at the commit), so the duplicate right behind it is skipped.
#[sqlx::test(migrations = false)]
async fn a_handler_slower_than_its_ttl_still_applies_once(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let event = payment(uuid::Uuid::new_v4(), "a", 5);
    produce(&producer, &topic, "k", &event, None).await;
    produce(&producer, &topic, "k", &event, None).await;
    let running = start(
        consumer(&store, &unique("g"))
            .batch_size(1)
            .handle(&topic, record_payment_slower_than_its_ttl),
    );
    running
        .wait_for("applied, then skipped", |s| s.applied + s.skipped == 2)
        .await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.skipped), (1, 1), "{stats}");
    assert_eq!(balance(&pool).await, 5);
}

/// With the smallest buffer, fetching pauses and resumes for nearly every
/// message; a worker that drains between the dispatcher's send and its
/// pause must not leave the partition paused for good.
#[sqlx::test(migrations = false)]
async fn a_tiny_buffer_pauses_and_resumes_without_stalling(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let records = (0..300).map(|_| ("k".to_owned(), payment(uuid::Uuid::new_v4(), "a", 1)));
    produce_all(&producer, &topic, records).await;
    let running = start(
        consumer(&store, &unique("g"))
            .max_buffered_per_partition(2)
            .batch_size(1)
            // Each resume fetches again: do not wait long for data there.
            .set("fetch.wait.max.ms", "10")
            .handle(&topic, record_payment),
    );
    running
        .wait_for("every event applied", |s| s.applied == 300)
        .await;
    running.stop().await;
    assert_eq!(balance(&pool).await, 300);
}

/// The backend the first attempt ran on, frozen by that attempt itself.
static FROZEN_BACKEND: std::sync::Mutex<Option<i32>> = std::sync::Mutex::new(None);

/// Freezes the transaction's database backend (`kill -STOP`) unless
/// `frozen` holds one already, as a database host that vanishes without
/// closing its connections does: the transaction's next statement hangs.
async fn freeze_backend_once(
    tx: &mut PgTx,
    frozen: &std::sync::Mutex<Option<i32>>,
) -> Result<(), sqlx::Error> {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await?;
    let first = {
        let mut frozen = frozen.lock().unwrap();
        frozen.is_none().then(|| *frozen = Some(pid)).is_some()
    };
    if first {
        signal_backend("-STOP", pid);
    }
    Ok(())
}

fn signal_backend(signal: &str, pid: i32) {
    let sent = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(sent.success(), "kill {signal} {pid}");
}

/// Thaws the backend `.0` froze however the test ends, so that it never
/// outlives the test holding its database.
struct Thaw(&'static std::sync::Mutex<Option<i32>>);

impl Thaw {
    /// Thaws it now.
    fn now(&self) {
        let pid = self.0.lock().unwrap().expect("frozen");
        signal_backend("-CONT", pid);
    }
}

impl Drop for Thaw {
    fn drop(&mut self) {
        let frozen = *self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pid) = frozen {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
        }
    }
}

/// Freezes its own database backend on the first attempt; the statement
/// after it hangs.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_on_a_backend_that_hangs(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    freeze_backend_once(tx, &FROZEN_BACKEND).await?;
    credit(tx, &ev).await
}

/// An attempt that hangs (its database backend frozen) is abandoned after
/// the attempt timeout and retried; once the backend thaws, the event is
/// applied exactly once.
#[sqlx::test(migrations = false)]
async fn a_hanging_attempt_is_abandoned_and_retried(pool: PgPool) {
    let thaw = Thaw(&FROZEN_BACKEND);
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(
        &producer,
        &topic,
        "k",
        &payment(uuid::Uuid::new_v4(), "a", 9),
        None,
    )
    .await;
    let running = start(
        consumer(&store, &unique("g"))
            .attempt_timeout(Duration::from_secs(2))
            // Few attempts: the abandoned attempt's lock timeouts must not
            // use them up.
            .retry(
                RetryPolicy::default()
                    .with_max_attempts(2)
                    .with_backoff(Duration::from_millis(200), Duration::from_secs(1))
                    .with_outage_backoff(Duration::from_secs(1)),
            )
            .handle(&topic, record_payment_on_a_backend_that_hangs),
    );
    running
        .wait_for("the hanging attempt retried", |s| s.retries >= 1)
        .await;
    // Frozen well past the attempt timeout, the lock timeout (5 s) and the
    // two attempts: waited out, not dead-lettered.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(running.stats.snapshot().dead_lettered, 0);
    thaw.now();
    running.wait_for("applied", |s| s.applied == 1).await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.dead_lettered), (1, 0), "{stats}");
    assert_eq!(balance(&pool).await, 9, "applied exactly once");
}

/// The backend a batch's attempt ran on, frozen mid-batch by that attempt.
static FROZEN_BATCH_BACKEND: std::sync::Mutex<Option<i32>> = std::sync::Mutex::new(None);

/// Credits the payment; the first time it meets the account `freeze`, it
/// freezes its own database backend (`kill -STOP`) after crediting: the
/// batch's claims, taken before any body ran, stay locked by a backend that
/// answers nothing, and the batch's next statement hangs.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_freezing_its_batch(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await?;
    if ev.account_id == "freeze" {
        freeze_backend_once(tx, &FROZEN_BATCH_BACKEND).await?;
    }
    Ok(())
}

/// A database backend frozen while it holds a whole batch's claim locks,
/// for much longer than the attempt timeout: the batch is abandoned and
/// replayed message by message, and every replayed claim meets the frozen
/// transaction's lock. That is contention, not the events' fault: nothing
/// is dead-lettered however long it lasts (with a lock timeout of 200 ms
/// and 3 attempts, the old rule dead-lettered the batch's events within a
/// second), and once the backend thaws every event is applied exactly once.
#[sqlx::test(migrations = false)]
async fn a_frozen_backend_holding_a_batchs_claims_dead_letters_nothing(pool: PgPool) {
    let thaw = Thaw(&FROZEN_BATCH_BACKEND);
    const EVENTS: i64 = 20;
    let store = dedup_tests::store_with(
        &pool,
        dedup_postgres::PgConfig::default().with_lock_timeout(Duration::from_millis(200)),
    )
    .await;
    let topic = create_topic(1).await;
    let records = (0..EVENTS).map(|i| {
        let account = if i == 5 {
            "freeze".to_owned()
        } else {
            format!("acct-{i}")
        };
        (account.clone(), payment(uuid::Uuid::new_v4(), &account, 1))
    });
    produce_all(&producer(), &topic, records).await;
    let running = start(
        consumer(&store, &unique("g"))
            .attempt_timeout(Duration::from_secs(2))
            // The idle partition's first batch waits for all 20.
            .batch_linger(Duration::from_secs(2))
            // Few, short attempts: were lock timeouts counted against them,
            // the replayed events would be dead-lettered at once.
            .retry(
                RetryPolicy::default()
                    .with_max_attempts(3)
                    .with_backoff(Duration::from_millis(50), Duration::from_millis(200))
                    .with_outage_backoff(Duration::from_secs(1)),
            )
            .handle(&topic, record_payment_freezing_its_batch),
    );
    running
        .wait_for("the frozen batch replayed and retried", |s| {
            s.batch_replays >= 1 && s.retries >= 5
        })
        .await;
    // Frozen for 10 s: five attempt timeouts, fifty lock timeouts.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "contention is waited out: {during}"
    );
    thaw.now();
    running
        .wait_for("every event finished", |s| {
            s.applied + s.skipped == EVENTS as u64
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats}");
    assert_eq!(
        balance(&pool).await,
        EVENTS,
        "each event applied exactly once: {stats}"
    );
}

/// A broker killed with SIGKILL mid-stream and started again: the consumer
/// rides it out, and every event is applied exactly once (nothing lost,
/// nothing doubled), none dead-lettered.
#[sqlx::test(migrations = false)]
async fn a_broker_killed_mid_stream_loses_and_doubles_nothing(pool: PgPool) {
    let broker = common::OwnBroker::start("kill-test", 9194).await;
    let store = store(&pool).await;
    let topic = common::create_topic_with(&broker.address, 2, &[]).await;
    let producer = common::producer_on(&broker.address);
    let records = (0..1000).map(|i| {
        let account = format!("acct-{}", i % 10);
        let payload = payment(uuid::Uuid::new_v4(), &account, 1);
        (account, payload)
    });
    produce_all(&producer, &topic, records).await;
    let running = start(
        consumer(&store, &unique("g"))
            .brokers(&broker.address)
            .batch_size(20)
            .handle(&topic, record_payment_slowly),
    );
    running
        .wait_for("part of the stream applied", |s| s.applied >= 100)
        .await;
    broker.run("kill").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.run("start").await;
    running
        .wait_for("every event applied after the broker's return", |s| {
            s.applied == 1000
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats}");
    assert_eq!(stats.applied, 1000, "{stats}");
    assert_eq!(
        balance(&pool).await,
        1000,
        "each event applied exactly once"
    );
}

/// A payment numbered within its account, so the order of applying shows.
#[derive(Debug, serde::Deserialize)]
struct NumberedPayment {
    event_id: String,
    account_id: String,
    seq: i64,
}

/// Records each payment as a row; `n` is the order of applying.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_numbered(tx: &mut PgTx, ev: NumberedPayment) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO applied (account, seq) VALUES ($1, $2)")
        .bind(&ev.account_id)
        .bind(ev.seq)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// PostgreSQL stopped for 60 s while 2,000 events stream through 4
/// partitions: the consumer waits it out without leaving its group, and once
/// the database is back every event is applied exactly once, in order within
/// its partition, and none is dead-lettered. The database is a cluster of
/// the test's own, so the tests beside it never notice.
#[tokio::test]
async fn a_database_stopped_for_a_minute_is_waited_out_in_order() {
    const ACCOUNTS: i64 = 20;
    const EVENTS: i64 = 2000;
    let pg = common::OwnPostgres::start("outage-kafka", 5442).await;
    // The pool as a service would make it: default settings.
    let pool = PgPool::connect(&pg.url).await.expect("own database");
    let store = store(&pool).await;
    sqlx::query(
        "CREATE TABLE applied (n bigserial PRIMARY KEY, account text NOT NULL, seq bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("create applied");
    let topic = create_topic(4).await;
    let producer = producer();
    let events = |range: std::ops::Range<i64>| {
        range.map(|i| {
            let account = format!("acct-{}", i % ACCOUNTS);
            let payload = serde_json::json!({
                "event_id": uuid::Uuid::new_v4(),
                "account_id": account,
                "seq": i / ACCOUNTS + 1,
            });
            (account, payload.to_string().into_bytes())
        })
    };
    produce_all(&producer, &topic, events(0..800)).await;
    let running = start(
        consumer(&store, &unique("g"))
            .retry(
                RetryPolicy::default()
                    .with_backoff(Duration::from_millis(20), Duration::from_millis(200))
                    .with_outage_backoff(Duration::from_secs(5)),
            )
            .batch_size(20)
            // An attempt that hangs on the vanished database (rather than
            // failing) is abandoned and waited out well within the minute.
            .attempt_timeout(Duration::from_secs(15))
            .handle(&topic, record_numbered),
    );
    running
        .wait_for("part of the stream applied", |s| s.applied >= 200)
        .await;

    pg.run("stop").await;
    let stopped = Instant::now();
    // The rest of the stream arrives while the database is down.
    produce_all(&producer, &topic, events(800..EVENTS)).await;
    tokio::time::sleep(Duration::from_secs(60).saturating_sub(stopped.elapsed())).await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "an outage is not the events' fault: {during:?}"
    );
    assert!(during.outages >= 1, "the outage is seen: {during:?}");
    assert!(
        running.stats.waiting_out() >= 1,
        "waiting it out: {during:?}"
    );
    assert!(during.applied < EVENTS as u64, "{during:?}");

    pg.run("start").await;
    running
        .wait_for("every event applied after the database's return", |s| {
            s.applied == EVENTS as u64
        })
        .await;
    assert_eq!(running.stats.waiting_out(), 0, "the outage is over");
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(stats.applied, EVENTS as u64, "{stats:?}");
    assert_eq!(
        stats.assignments, 1,
        "the consumer stayed in its group throughout: {stats:?}"
    );

    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT (account, seq)) FROM applied")
            .fetch_one(&pool)
            .await
            .expect("counts");
    assert_eq!(
        (rows, distinct),
        (EVENTS, EVENTS),
        "each event applied exactly once"
    );
    // Each account is one key, so one partition: its events in order.
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY account ORDER BY n) AS prev \
         FROM applied) t WHERE seq <> coalesce(prev, 0) + 1",
    )
    .fetch_one(&pool)
    .await
    .expect("order");
    assert_eq!(out_of_order, 0, "applied in order within each partition");
    pool.close().await;
}
