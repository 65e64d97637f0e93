//! Kafka to Kafka, exactly once, no database: reads payment events
//! `{event_id, account_id, amount_cents}` and writes each distinct event
//! once, with `"enriched": true`, keyed by its account.
//!
//! Each batch is one Kafka transaction: the outputs, the claims (in the
//! compacted changelog `<group>-dedup-claims`), the dead letters and the
//! input offsets commit together. Duplicates produced upstream (the same
//! `event_id` again within the TTL, on the same partition) are skipped
//! through the claims, which Kafka's transactions alone would not do.
//! Readers of the output must use `isolation.level=read_committed`.
//!
//! Environment: `KAFKA_BROKERS` (default `localhost:9092`), `TOPIC`
//! (default `payments`), `OUTPUT_TOPIC` (default `payments.enriched`),
//! `GROUP_ID` (default `enrich-v1`), `DEDUP_TTL` (default `1d`),
//! `DEDUP_BATCH_SIZE` (most messages per batch, default the library's),
//! `TRANSACTIONAL_ID` (default: a new one per start), `KAFKA_CFG_*`
//! passed through, `METRICS_ADDR` (serve `/metrics` and the health checks
//! there), `DEDUP_RETRY_TIERS` (tier delays like `5s,30s`: retry tiers
//! `<TOPIC>.retry-5s`...), `ACCOUNTS_FILE` (reference data: a JSON object
//! of account id to account name, read for each payment and added to its
//! output; a payment whose account it does not list yet fails
//! transiently, as a lookup of data that lags would, and with retry tiers
//! waits in them for the account to appear). Poison goes to
//! `<TOPIC>.dlq`. Flag:
//! `--exit-when-idle <ttl>`. Runs until SIGINT or SIGTERM (or idle), then
//! commits the batch in hand and prints `applied=N skipped=N dead_lettered=N`.
//!
//! `cargo run -p dedup-examples --example enrich` (Ctrl-C to stop)

#![allow(clippy::print_stdout)]

use dedup_core::{HandlerError, HandlerExt, Ttl, idempotent};
use dedup_examples::{env_or, exit_when_idle, until_idle};
use dedup_kafka::{Outputs, TransactionalConsumer};

#[derive(serde::Deserialize, serde::Serialize)]
struct Payment {
    event_id: String,
    account_id: String,
    amount_cents: i64,
}

#[derive(serde::Serialize)]
struct Enriched<'a> {
    #[serde(flatten)]
    payment: &'a Payment,
    enriched: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    account_name: Option<String>,
}

/// `ACCOUNTS_FILE`, read once at start.
static ACCOUNTS_FILE: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();

/// The name of `account` in the reference data, if `ACCOUNTS_FILE` is set:
/// an account it does not list (yet) is a transient failure.
fn account_name(account: &str) -> Result<Option<String>, HandlerError> {
    let Some(path) = ACCOUNTS_FILE.get().and_then(Option::as_ref) else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).map_err(HandlerError::transient)?;
    let accounts: std::collections::HashMap<String, String> =
        serde_json::from_str(&text).map_err(HandlerError::transient)?;
    match accounts.get(account) {
        Some(name) => Ok(Some(name.clone())),
        None => Err(HandlerError::transient(format!(
            "account {account} is not in the reference data yet"
        ))),
    }
}

/// The output topic, read once at start (a handler has no arguments of its
/// own beyond the outputs and the event).
static OUTPUT_TOPIC: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[idempotent(key = "event_id", ttl = "1d")]
async fn enrich(out: &mut Outputs, ev: Payment) -> Result<(), HandlerError> {
    let topic = OUTPUT_TOPIC
        .get()
        .map_or("payments.enriched", String::as_str);
    let account_name = account_name(&ev.account_id)?;
    out.send(
        topic,
        &ev.account_id,
        &Enriched {
            payment: &ev,
            enriched: true,
            account_name,
        },
    )?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let idle_limit = exit_when_idle("enrich")?;
    let ttl: Ttl = env_or("DEDUP_TTL", "1d").parse()?;
    OUTPUT_TOPIC
        .set(env_or("OUTPUT_TOPIC", "payments.enriched"))
        .expect("set once");
    ACCOUNTS_FILE
        .set(std::env::var_os("ACCOUNTS_FILE").map(Into::into))
        .expect("set once");
    let mut builder =
        TransactionalConsumer::builder(env_or("TOPIC", "payments"), enrich.with_ttl(ttl))
            .set_from_env("KAFKA_CFG_")
            .brokers(env_or("KAFKA_BROKERS", "localhost:9092"))
            .group_id(env_or("GROUP_ID", "enrich-v1"));
    if let Some(tiers) = dedup_examples::retry_tiers()? {
        builder = builder.retry_tiers_with(tiers);
    }
    if let Ok(id) = std::env::var("TRANSACTIONAL_ID") {
        builder = builder.transactional_id(id);
    }
    if let Ok(n) = std::env::var("DEDUP_BATCH_SIZE") {
        builder = builder.batch_size(n.parse()?);
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
