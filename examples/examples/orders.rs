//! Order status events `{event_id, order_id, status}` upserted into `orders`.
//! The upsert alone is idempotent for one event, but not across events: a
//! late duplicate of an old status would overwrite a newer one. The dedup
//! claim makes each status event count once.
//!
//! Environment: `DATABASE_URL` (required), `KAFKA_BROKERS` (default
//! `localhost:9092`), `TOPIC` (default `orders`), `GROUP_ID` (default
//! `orders-v1`). Runs until SIGINT or SIGTERM, then finishes in-flight work,
//! commits and prints `applied=N skipped=N dead_lettered=N`.
//!
//! `DATABASE_URL=... cargo run -p dedup-examples --example orders` (Ctrl-C to stop)

#![allow(clippy::print_stdout)]

use dedup_core::{HandlerError, idempotent};
use dedup_kafka::Consumer;
use dedup_postgres::{PgStore, PgTx};

#[derive(serde::Deserialize)]
struct OrderStatusChanged {
    event_id: uuid::Uuid,
    order_id: String,
    status: String,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn update_order(tx: &mut PgTx, ev: OrderStatusChanged) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO orders (id, status, updates) VALUES ($1, $2, 1) \
         ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status, updates = orders.updates + 1",
    )
    .bind(&ev.order_id)
    .bind(&ev.status)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let store = PgStore::connect(&std::env::var("DATABASE_URL")?).await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, status text NOT NULL, updates int NOT NULL)")
        .execute(store.pool())
        .await?;
    let purger = store.spawn_purger(Default::default());
    let consumer = Consumer::builder(store)
        .set_from_env("KAFKA_CFG_")
        .brokers(std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "localhost:9092".into()))
        .group_id(std::env::var("GROUP_ID").unwrap_or_else(|_| "orders-v1".into()))
        .handle(
            std::env::var("TOPIC").unwrap_or_else(|_| "orders".into()),
            update_order,
        )
        .build()?;
    // With METRICS_ADDR set: /metrics and /healthz.
    dedup_examples::serve_metrics(Some(consumer.stats()))?;
    let summary = consumer.run().await?;
    purger.stop().await;
    println!("{summary}");
    Ok(())
}
