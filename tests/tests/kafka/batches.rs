//! Batches: many messages per transaction, a batch handler called once per batch, and the examples agreeing on every count at volume.

use super::*;

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
