//! Payments with a NON-idempotent effect: each event adds `amount_cents` to
//! `accounts.balance`, so a duplicate applied twice would show in the balance.
//!
//! Environment: `KAFKA_BROKERS` (default `localhost:9092`), `DATABASE_URL`
//! (required), `TOPIC` (default `payments`), `GROUP_ID` (default
//! `payments-v1`), `DEDUP_TTL` (default `4h`), `DEDUP_MAX_BUFFERED` (most
//! messages buffered per partition before it pauses, default the
//! library's), `KAFKA_SESSION_TIMEOUT_MS`
//! (default librdkafka's 45000: how long the group waits for a member that
//! died before giving its partitions to another), `KAFKA_STATISTICS_INTERVAL_MS`
//! (how often consumer lag is measured; default 5000), `METRICS_ADDR` (serve
//! `/metrics`, `/livez`, `/readyz` and `/healthz` there),
//! `DEDUP_KEY_CONCURRENCY` (up to this many transactions of one partition
//! at once, each account's payments still in order; the pool is sized for
//! it; default 0: one at a time), `EFFECT_MS` (each payment's transaction
//! also runs a statement taking this many milliseconds, or a random time in
//! a range like `0-40`: a stand-in for a slow effect, for the benchmarks
//! and crash tests), `DEDUP_RETRY_TIERS` (retry tiers by delay, like
//! `5s,30s`: a payment that keeps failing transiently waits in
//! `<TOPIC>.retry-5s`, then `<TOPIC>.retry-30s`, while its partition moves
//! on; create those topics with as many partitions as `TOPIC`; unset: no
//! tiers), `DEDUP_RETRY_HOLD_KEYS=1` (with tiers: while a payment of an
//! account waits in a tier, that account's later payments follow it there,
//! so each account's are applied in order).
//! Flag: `--exit-when-idle <ttl>` exits 0 after that long without a message.
//! Creates its tables on start (`accounts`, and `ledger`: one row per
//! payment applied, in the order applied); its last line is
//! `applied=N skipped=N dead_lettered=N`.
//!
//! `cargo run -p dedup-examples --example payments -- --exit-when-idle 10s`

#![allow(clippy::print_stdout)]

use dedup_core::{HandlerError, HandlerExt, Ttl, idempotent};
use dedup_examples::{env_or, exit_when_idle, until_idle};
use dedup_kafka::Consumer;
use dedup_postgres::{PgConfig, PgStore, PgTx};

#[derive(serde::Deserialize)]
struct PaymentReceived {
    event_id: uuid::Uuid,
    account_id: String,
    amount_cents: i64,
}

/// `EFFECT_MS`: the slow statement's duration in seconds, fixed or a
/// range, read once.
static EFFECT: std::sync::OnceLock<Option<(f64, f64)>> = std::sync::OnceLock::new();

fn effect_seconds() -> Result<Option<(f64, f64)>, Box<dyn std::error::Error>> {
    let Ok(ms) = std::env::var("EFFECT_MS") else {
        return Ok(None);
    };
    let bad = || format!("EFFECT_MS must be milliseconds like 10 or 0-40, not {ms:?}");
    let (low, high) = ms.split_once('-').unwrap_or((&ms, &ms));
    let (low, high): (f64, f64) = (
        low.trim().parse().map_err(|_| bad())?,
        high.trim().parse().map_err(|_| bad())?,
    );
    if !(0.0..=high).contains(&low) {
        return Err(bad().into());
    }
    Ok(Some((low / 1000.0, high / 1000.0)))
}

#[idempotent(key = "event_id", ttl = "4h", scope = "payments::record_payment")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), HandlerError> {
    if let Some(&Some((low, high))) = EFFECT.get() {
        sqlx::query("SELECT pg_sleep($1 + random() * ($2 - $1))")
            .bind(low)
            .bind(high)
            .execute(&mut **tx)
            .await?;
    }
    sqlx::query("INSERT INTO ledger (account_id, event_id, amount_cents) VALUES ($1, $2, $3)")
        .bind(&ev.account_id)
        .bind(ev.event_id)
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
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

    let key_concurrency = dedup_examples::key_concurrency()?;
    EFFECT
        .set(effect_seconds()?)
        .map_err(|_| "EFFECT_MS is read once")?;

    // A transaction of each partition's at once holds a connection each.
    let pool_size = u32::try_from(key_concurrency.max(10)).unwrap_or(u32::MAX);
    let store = PgStore::connect_with(
        &database_url,
        PgConfig::default().with_max_connections(pool_size),
    )
    .await?;
    store.migrate().await?;
    for table in [
        "CREATE TABLE IF NOT EXISTS accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
        "CREATE TABLE IF NOT EXISTS ledger (seq bigserial PRIMARY KEY, account_id text NOT NULL, \
         event_id uuid NOT NULL, amount_cents bigint NOT NULL)",
    ] {
        sqlx::query(table).execute(store.pool()).await?;
    }

    // Any librdkafka setting from KAFKA_CFG_<NAME> (e.g.
    // KAFKA_CFG_GROUP_PROTOCOL=consumer).
    let mut builder = Consumer::builder(store)
        .set_from_env("KAFKA_CFG_")
        .brokers(env_or("KAFKA_BROKERS", "localhost:9092"))
        .group_id(env_or("GROUP_ID", "payments-v1"))
        .key_concurrency(key_concurrency)
        .handle(env_or("TOPIC", "payments"), record_payment.with_ttl(ttl));
    if let Some(tiers) = dedup_examples::retry_tiers()? {
        builder = builder.retry_tiers_with(tiers);
    }
    if let Ok(n) = std::env::var("DEDUP_MAX_BUFFERED") {
        builder = builder.max_buffered_per_partition(n.parse()?);
    }
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
