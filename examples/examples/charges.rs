//! Lease mode: each event is a charge at a payment provider, an effect
//! outside the claims' database. The "provider" here is the table
//! `provider_calls`, written outside any claim's transaction, as an HTTP
//! call would be: one row per call, with the lease's fencing token. A
//! provider that deduplicates by the event id makes the charge once; the
//! rows show every call made.
//!
//! Environment: `KAFKA_BROKERS` (default `localhost:9092`), `DATABASE_URL`
//! (required), `TOPIC` (default `charges`), `GROUP_ID` (default
//! `charges-v1`), `KAFKA_SESSION_TIMEOUT_MS`, `DEDUP_KEY_CONCURRENCY` (up
//! to this many calls of one partition at once, each account's charges
//! still in order: records are keyed by account; default 0: one at a
//! time), and for the crash tests
//! `CRASH_MID_CHARGE=<event id>`: the process SIGKILLs itself right after
//! that event's call, before its lease completes.
//! Flag: `--exit-when-idle <ttl>` exits 0 after that long without a message.
//! Its last line is `applied=N skipped=N dead_lettered=N`.
//!
//! `cargo run -p dedup-examples --example charges -- --exit-when-idle 10s`

#![allow(clippy::print_stdout)]

use dedup_core::{HandlerError, Lease, idempotent};
use dedup_examples::{env_or, exit_when_idle, until_idle};
use dedup_kafka::Consumer;
use dedup_postgres::PgStore;
use sqlx::PgPool;

#[derive(serde::Deserialize)]
struct ChargeRequested {
    event_id: String,
    account_id: String,
    amount_cents: i64,
}

/// The provider's connection, outside every claim's transaction.
static PROVIDER: std::sync::OnceLock<PgPool> = std::sync::OnceLock::new();

/// A lease of 5 s: a call takes well under it (a longer one would call
/// `lease.extend()`), and a consumer that dies mid-call holds its events'
/// redeliveries back that long.
#[idempotent(key = "event_id", ttl = "4h", lease = "5s", scope = "charges::charge")]
async fn charge(lease: &Lease, ev: ChargeRequested) -> Result<(), HandlerError> {
    let provider = PROVIDER.get().expect("set in main");
    // The provider's idempotency key would be `ev.event_id`; the token lets
    // it refuse a stale holder.
    sqlx::query(
        "INSERT INTO provider_calls (event_id, account_id, amount_cents, token) \
         VALUES ($1, $2, $3, $4)",
    )
    .bind(&ev.event_id)
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .bind(i64::try_from(lease.token()).unwrap_or(i64::MAX))
    .execute(provider)
    .await?;
    if std::env::var("CRASH_MID_CHARGE").is_ok_and(|id| id == ev.event_id) {
        // Crash as hard as a crash can: no unwinding, no rollback, the
        // lease left in progress.
        eprintln!("crashing mid-charge of {} (CRASH_MID_CHARGE)", ev.event_id);
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &std::process::id().to_string()])
            .status();
        std::process::abort();
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let idle_limit = exit_when_idle("charges")?;
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;

    let store = PgStore::connect(&database_url).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS provider_calls (event_id text NOT NULL, \
         account_id text NOT NULL, amount_cents bigint NOT NULL, token bigint NOT NULL, \
         called_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(store.pool())
    .await?;
    PROVIDER
        .set(PgPool::connect(&database_url).await?)
        .map_err(|_| "the provider is set once")?;

    let mut builder = Consumer::builder(store)
        .set_from_env("KAFKA_CFG_")
        .brokers(env_or("KAFKA_BROKERS", "localhost:9092"))
        .group_id(env_or("GROUP_ID", "charges-v1"))
        .key_concurrency(dedup_examples::key_concurrency()?)
        .handle_leased(env_or("TOPIC", "charges"), charge);
    if let Ok(ms) = std::env::var("KAFKA_SESSION_TIMEOUT_MS") {
        builder = builder.set("session.timeout.ms", ms);
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
