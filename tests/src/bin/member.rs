//! One member of a consumer group, as its own process, for the scaling
//! tests: they start several, stop them, and SIGKILL one. Each applied event
//! becomes a row of `applied` (no key: an event applied twice shows as two
//! rows) saying which member applied it and when, so a test can tell which
//! partitions moved at each rebalance and how long each stood still.
//!
//! Environment: `DATABASE_URL`, `KAFKA_BROKERS`, `TOPIC`, `GROUP_ID`,
//! `MEMBER` (its name in `applied`), `HANDLER_SLEEP_MS` (per event, default
//! 0), `COMMIT_INTERVAL_MS`, `REVOKE_TIMEOUT_MS`, `BATCH_SIZE`, and any
//! librdkafka setting as `KAFKA_CFG_<NAME>`. The tables (`applied`, the
//! claims) must exist. Runs until SIGTERM; its last line is
//! `applied=N skipped=N dead_lettered=N redelivered=N assignments=N revoked=N`.

#![allow(clippy::print_stdout)]

use std::sync::OnceLock;
use std::time::Duration;

use dedup_core::idempotent;
use dedup_kafka::Consumer;
use dedup_postgres::{PgStore, PgTx};

/// A numbered event of one partition.
#[derive(serde::Deserialize)]
struct Numbered {
    event_id: uuid::Uuid,
    partition: i32,
    seq: i64,
    /// When the test sent it, in milliseconds since the Unix epoch.
    sent_at_ms: i64,
}

static MEMBER: OnceLock<String> = OnceLock::new();
static SLEEP: OnceLock<Duration> = OnceLock::new();

#[idempotent(key = "event_id", ttl = "4h")]
async fn record(tx: &mut PgTx, ev: Numbered) -> Result<(), sqlx::Error> {
    let sleep = SLEEP.get().copied().unwrap_or_default();
    if !sleep.is_zero() {
        tokio::time::sleep(sleep).await;
    }
    sqlx::query(
        "INSERT INTO applied (event_id, partition, seq, member, sent_at) \
         VALUES ($1, $2, $3, $4, to_timestamp($5::float8 / 1000))",
    )
    .bind(ev.event_id.to_string())
    .bind(ev.partition)
    .bind(ev.seq)
    .bind(MEMBER.get().map(String::as_str).unwrap_or("?"))
    .bind(ev.sent_at_ms as f64)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

fn var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} must be set"))
}

fn millis(name: &str) -> Result<Option<Duration>, Box<dyn std::error::Error>> {
    Ok(match std::env::var(name) {
        Ok(ms) => Some(Duration::from_millis(ms.parse()?)),
        Err(_) => None,
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(false)
        .init();
    MEMBER.get_or_init(|| std::env::var("MEMBER").unwrap_or_else(|_| "member".into()));
    SLEEP.get_or_init(|| {
        millis("HANDLER_SLEEP_MS")
            .ok()
            .flatten()
            .unwrap_or_default()
    });
    let store = PgStore::connect(&var("DATABASE_URL")?).await?;
    let mut builder = Consumer::builder(store)
        .set_from_env("KAFKA_CFG_")
        .brokers(var("KAFKA_BROKERS")?)
        .group_id(var("GROUP_ID")?)
        .handle(var("TOPIC")?, record);
    if let Some(interval) = millis("COMMIT_INTERVAL_MS")? {
        builder = builder.commit_interval(interval);
    }
    if let Some(timeout) = millis("REVOKE_TIMEOUT_MS")? {
        builder = builder.revoke_timeout(timeout);
    }
    if let Ok(n) = std::env::var("BATCH_SIZE") {
        builder = builder.batch_size(n.parse()?);
    }
    let s = builder.build()?.run().await?;
    println!(
        "{s} redelivered={} assignments={} revoked={}",
        s.redelivered, s.assignments, s.revoked_partitions
    );
    Ok(())
}
