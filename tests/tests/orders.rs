//! Effects that must not go backwards, end to end (real Kafka, real
//! PostgreSQL): the orders example guards its upsert by the order's version,
//! so a status replayed after its claim's TTL, or sent out of order, leaves
//! the newer state alone.

use dedup_tests::common;

use std::time::{Duration, Instant};

use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use common::{brokers, create_topic, database_url, example, last_line, producer, unique};

/// Runs the orders example with a 2 s TTL until it has been idle for 3 s;
/// returns its summary line.
async fn run_orders(pool: &PgPool, topic: &str, group: &str) -> String {
    let mut cmd = std::process::Command::new(example("orders"));
    cmd.args(["--exit-when-idle", "3s"])
        .env("DATABASE_URL", database_url(pool))
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", topic)
        .env("GROUP_ID", group)
        .env("DEDUP_TTL", "2s");
    let output = tokio::task::spawn_blocking(move || cmd.output().expect("run orders"))
        .await
        .expect("join");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    last_line(&output)
}

async fn send(topic: &str, events: &[(&uuid::Uuid, &str, i64)]) {
    let producer = producer();
    for (id, status, version) in events {
        let event = serde_json::json!({ "event_id": id, "order_id": "o-1", "status": status, "version": version });
        producer
            .send(
                FutureRecord::to(topic)
                    .key("o-1")
                    .payload(&event.to_string()),
                Duration::from_secs(10),
            )
            .await
            .expect("produce");
    }
}

async fn order(pool: &PgPool) -> (String, i64, i32) {
    sqlx::query_as("SELECT status, version, updates FROM orders WHERE id = 'o-1'")
        .fetch_one(pool)
        .await
        .expect("the order")
}

#[sqlx::test(migrations = false)]
async fn a_status_replayed_after_its_ttl_or_out_of_order_does_not_overwrite_a_newer_one(
    pool: PgPool,
) {
    let topic = create_topic(1).await;
    let group = unique("orders");
    let ids: Vec<uuid::Uuid> = (0..5).map(|_| uuid::Uuid::new_v4()).collect();

    // created, paid (sent twice: skipped within the TTL), shipped.
    send(
        &topic,
        &[
            (&ids[0], "created", 1),
            (&ids[1], "paid", 2),
            (&ids[1], "paid", 2),
            (&ids[2], "shipped", 3),
        ],
    )
    .await;
    assert_eq!(
        run_orders(&pool, &topic, &group).await,
        "applied=3 skipped=1 dead_lettered=0"
    );
    assert_eq!(order(&pool).await, ("shipped".into(), 3, 3));

    // Every claim is past its 2 s TTL: the store no longer knows the events.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let live: i64 =
            sqlx::query_scalar("SELECT count(*) FROM dedup_claims WHERE expires_at > now()")
                .fetch_one(&pool)
                .await
                .expect("live claims");
        if live == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{live} claims still live");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // "paid" replayed past its TTL, then "delivered" (v5) before the
    // "out for delivery" (v4) it follows. Each is claimed and applied (the
    // replay as new, by design), and the guard keeps the newest state.
    send(
        &topic,
        &[
            (&ids[1], "paid", 2),
            (&ids[4], "delivered", 5),
            (&ids[3], "out for delivery", 4),
        ],
    )
    .await;
    assert_eq!(
        run_orders(&pool, &topic, &group).await,
        "applied=3 skipped=0 dead_lettered=0"
    );
    assert_eq!(
        order(&pool).await,
        ("delivered".into(), 5, 4),
        "only v5 wrote; the replayed v2 and the late v4 left it alone"
    );
}
