//! Payments with a NON-idempotent effect: each event adds `amount_cents` to
//! `accounts.balance`, so a duplicate applied twice would show in the balance.
//!
//! Environment: `KAFKA_BROKERS` (default `localhost:9092`), `DATABASE_URL`
//! (required), `TOPIC` (default `payments`), `GROUP_ID` (default
//! `payments-v1`), `DEDUP_TTL` (default `4h`), `KAFKA_SESSION_TIMEOUT_MS`
//! (default librdkafka's 45000: how long the group waits for a member that
//! died before giving its partitions to another), `KAFKA_STATISTICS_INTERVAL_MS`
//! (how often consumer lag is measured; default 5000), `METRICS_ADDR` (serve
//! `/metrics`, `/livez`, `/readyz` and `/healthz` there).
//! Flag: `--exit-when-idle <ttl>` exits 0 after that long without a message.
//! Creates its tables on start; its last line is
//! `applied=N skipped=N dead_lettered=N`.
//!
//! `cargo run -p dedup-examples --example payments -- --exit-when-idle 10s`

#![allow(clippy::print_stdout)]

use dedup_core::{HandlerError, HandlerExt, Ttl, idempotent};
use dedup_examples::{env_or, exit_when_idle, until_idle};
use dedup_kafka::Consumer;
use dedup_postgres::{PgStore, PgTx};

#[derive(serde::Deserialize)]
struct PaymentReceived {
    event_id: uuid::Uuid,
    account_id: String,
    amount_cents: i64,
}

#[idempotent(key = "event_id", ttl = "4h", scope = "payments::record_payment")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
    )
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let idle_limit = exit_when_idle("payments")?;
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    let ttl: Ttl = env_or("DEDUP_TTL", "4h").parse()?;

    let store = PgStore::connect(&database_url).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    // Any librdkafka setting from KAFKA_CFG_<NAME> (e.g.
    // KAFKA_CFG_GROUP_PROTOCOL=consumer).
    let mut builder = Consumer::builder(store)
        .set_from_env("KAFKA_CFG_")
        .brokers(env_or("KAFKA_BROKERS", "localhost:9092"))
        .group_id(env_or("GROUP_ID", "payments-v1"))
        .handle(env_or("TOPIC", "payments"), record_payment.with_ttl(ttl));
    if let Ok(ms) = std::env::var("KAFKA_SESSION_TIMEOUT_MS") {
        builder = builder.set("session.timeout.ms", ms);
    }
    if let Ok(ms) = std::env::var("KAFKA_STATISTICS_INTERVAL_MS") {
        builder = builder.set("statistics.interval.ms", ms);
    }
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
    println!("{summary}");
    Ok(())
}
