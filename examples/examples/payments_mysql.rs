//! The payments example on MySQL or MariaDB: each event adds `amount_cents`
//! to `accounts.balance` (a NON-idempotent effect, so a duplicate applied
//! twice would show in the balance), claimed in the same transaction.
//!
//! Environment: `DATABASE_URL` (required, `mysql://user:password@host/db`),
//! `KAFKA_BROKERS` (default `localhost:9092`), `TOPIC` (default
//! `payments`), `GROUP_ID` (default `payments-v1`), `DEDUP_TTL` (default
//! `4h`), `KAFKA_SESSION_TIMEOUT_MS` (default librdkafka's 45000: how long
//! the group waits for a member that died before giving its partitions to
//! another), `METRICS_ADDR` (serve `/metrics` and the health probes there).
//! Flag: `--exit-when-idle <ttl>` exits 0 after that long without a message.
//! Creates its tables on start (`accounts(id, balance)`, and `ledger`: one
//! row per payment applied); its last line is
//! `applied=N skipped=N dead_lettered=N`.
//!
//! `DATABASE_URL=mysql://dedup:dedup@127.0.0.1/dedup cargo run -p dedup-examples --example payments_mysql -- --exit-when-idle 10s`

#![allow(clippy::print_stdout)]

use dedup_core::{HandlerError, HandlerExt, Ttl, idempotent};
use dedup_examples::{env_or, exit_when_idle, until_idle};
use dedup_kafka::Consumer;
use dedup_mysql::{MySqlStore, MySqlTx};

#[derive(serde::Deserialize)]
struct PaymentReceived {
    event_id: uuid::Uuid,
    account_id: String,
    amount_cents: i64,
}

#[idempotent(key = "event_id", ttl = "4h", scope = "payments::record_payment")]
async fn record_payment(tx: &mut MySqlTx, ev: PaymentReceived) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (account_id, event_id, amount_cents) VALUES (?, ?, ?)")
        .bind(&ev.account_id)
        .bind(ev.event_id.to_string())
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES (?, ?) \
         ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
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
    let idle_limit = exit_when_idle("payments_mysql")?;
    let database_url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL must be set (mysql://user:password@host/database)")?;
    let ttl: Ttl = env_or("DEDUP_TTL", "4h").parse()?;

    let store = MySqlStore::connect(&database_url).await?;
    store.migrate().await?;
    for table in [
        "CREATE TABLE IF NOT EXISTS accounts \
         (id VARCHAR(255) PRIMARY KEY, balance BIGINT NOT NULL) ENGINE = InnoDB",
        "CREATE TABLE IF NOT EXISTS ledger (seq BIGINT AUTO_INCREMENT PRIMARY KEY, \
         account_id VARCHAR(255) NOT NULL, event_id CHAR(36) NOT NULL, \
         amount_cents BIGINT NOT NULL) ENGINE = InnoDB",
    ] {
        sqlx::query(table).execute(store.pool()).await?;
    }

    let mut builder = Consumer::builder(store)
        .set_from_env("KAFKA_CFG_")
        .brokers(env_or("KAFKA_BROKERS", "localhost:9092"))
        .group_id(env_or("GROUP_ID", "payments-v1"))
        .handle(env_or("TOPIC", "payments"), record_payment.with_ttl(ttl));
    if let Ok(ms) = std::env::var("KAFKA_SESSION_TIMEOUT_MS") {
        builder = builder.set("session.timeout.ms", ms);
    }
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
