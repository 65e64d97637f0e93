//! Order status events `{event_id, order_id, status, version}` written into
//! `orders`: the effect must not go backwards.
//!
//! The dedup claim makes each status event count once within its TTL. It
//! cannot order two different events of one order, and it forgets an event
//! after the TTL: a status that arrives after a newer one (a producer that
//! sent them out of order, a replay of the topic past the TTL, a partition
//! handed over mid-way) would overwrite the newer state. So the upsert is
//! guarded by the order's version too: it writes only over an older one.
//! See "Effects that must not go backwards" in the book's Semantics chapter.
//!
//! Environment: `DATABASE_URL` (required), `KAFKA_BROKERS` (default
//! `localhost:9092`), `TOPIC` (default `orders`), `GROUP_ID` (default
//! `orders-v1`), `DEDUP_TTL` (default `4h`). Flag: `--exit-when-idle <ttl>`.
//! Runs until SIGINT or SIGTERM (or idle), then finishes in-flight work,
//! commits and prints `applied=N skipped=N dead_lettered=N`.
//!
//! `DATABASE_URL=... cargo run -p dedup-examples --example orders` (Ctrl-C to stop)

#![allow(clippy::print_stdout)]

use dedup_core::{HandlerError, HandlerExt, Ttl, idempotent};
use dedup_examples::{env_or, exit_when_idle, until_idle};
use dedup_kafka::Consumer;
use dedup_postgres::{PgStore, PgTx};

#[derive(serde::Deserialize)]
struct OrderStatusChanged {
    event_id: uuid::Uuid,
    order_id: String,
    status: String,
    /// The order's version this status belongs to: the producer's sequence
    /// per order (a counter, or the source row's version column).
    version: i64,
}

/// Writes the status only over an older version: a late event, however it
/// came, leaves newer state alone. `updates` counts the writes that
/// happened.
#[idempotent(key = "event_id", ttl = "4h")]
async fn update_order(tx: &mut PgTx, ev: OrderStatusChanged) -> Result<(), HandlerError> {
    let written = sqlx::query(
        "INSERT INTO orders (id, status, version, updates) VALUES ($1, $2, $3, 1) \
         ON CONFLICT (id) DO UPDATE \
         SET status = EXCLUDED.status, version = EXCLUDED.version, updates = orders.updates + 1 \
         WHERE orders.version < EXCLUDED.version",
    )
    .bind(&ev.order_id)
    .bind(&ev.status)
    .bind(ev.version)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if written == 0 {
        tracing::info!(order = %ev.order_id, version = ev.version, "an older status than the order's: left as it is");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let idle_limit = exit_when_idle("orders")?;
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    let ttl: Ttl = env_or("DEDUP_TTL", "4h").parse()?;
    let store = PgStore::connect(&database_url).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, status text NOT NULL, \
         version bigint NOT NULL, updates int NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    // A table from before the guard: its orders count as version 0, so the
    // first versioned status of each writes.
    sqlx::query("ALTER TABLE orders ADD COLUMN IF NOT EXISTS version bigint NOT NULL DEFAULT 0")
        .execute(store.pool())
        .await?;
    let purger = store.spawn_purger(Default::default());
    let mut builder = Consumer::builder(store)
        .set_from_env("KAFKA_CFG_")
        .brokers(env_or("KAFKA_BROKERS", "localhost:9092"))
        .group_id(env_or("GROUP_ID", "orders-v1"))
        .handle(env_or("TOPIC", "orders"), update_order.with_ttl(ttl));
    // With METRICS_ADDR set: /metrics and the health probes.
    if let Some(addr) = dedup_examples::metrics_addr() {
        builder = builder.serve_http(addr);
    }
    let consumer = builder.build()?;
    let stats = consumer.stats();
    let summary = consumer
        .run_until(until_idle(
            stats,
            idle_limit,
            dedup_kafka::shutdown_signal(),
        ))
        .await?;
    purger.stop().await;
    println!("{summary}");
    Ok(())
}
