//! Exactly once along a chain: payments consumed -> balance changed and a
//! `payment-recorded` event enqueued in the same transaction -> the relay
//! publishes it -> a downstream `#[idempotent]` consumer records a notice.
//!
//! Both effects are NOT idempotent (a balance is added to, a notice row is
//! inserted), so a duplicate applied anywhere along the chain would show.
//!
//! Environment: `KAFKA_BROKERS` (default `localhost:9092`), `DATABASE_URL`
//! (required), `TOPIC` (default `payments`), `RECORDED_TOPIC` (default
//! `payment-recorded`), `GROUP_ID` (default `payments-v1`; the downstream
//! group is `<GROUP_ID>-notices`), `RELAY_DELIVERY_TIMEOUT_MS` (default
//! 30000; a batch stays leased 15 s longer than this), `METRICS_ADDR`
//! (serve `/metrics` and the health probes of the relay and both consumers
//! there), `KAFKA_CFG_<NAME>` (librdkafka settings, for the consumers and
//! the relay).
//! Flags: `--role all|relay` (default `all`: both consumers and the relay;
//! `relay`: only the relay), `--exit-when-idle <ttl>` exits 0 once nothing
//! has happened for that long and the outbox is empty. Its last line is
//! `payments: applied=N skipped=N dead_lettered=N | relay: published=N
//! failed=N batches=N | notices: applied=N skipped=N dead_lettered=N`.
//!
//! `cargo run -p dedup-examples --example outbox -- --exit-when-idle 10s`

#![allow(clippy::print_stdout)]

use std::sync::LazyLock;
use std::time::Duration;

use dedup_core::{HandlerError, OutboxMessage, Ttl, idempotent};
use dedup_examples::env_or;
use dedup_kafka::http::HttpEndpoints;
use dedup_kafka::{Consumer, Relay, StatsSnapshot};
use dedup_postgres::{OutboxReader, OutboxWriter, PgStore, PgTx};

#[derive(serde::Deserialize)]
struct PaymentReceived {
    event_id: uuid::Uuid,
    account_id: String,
    amount_cents: i64,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct PaymentRecorded {
    payment_id: uuid::Uuid,
    account_id: String,
    amount_cents: i64,
    balance_cents: i64,
}

static RECORDED_TOPIC: LazyLock<String> =
    LazyLock::new(|| env_or("RECORDED_TOPIC", "payment-recorded"));

/// Consume -> change -> emit, as one transaction.
#[idempotent(key = "event_id", ttl = "4h", scope = "outbox::record_payment")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), HandlerError> {
    let balance: i64 = sqlx::query_scalar(
        "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance \
         RETURNING balance",
    )
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .fetch_one(&mut **tx)
    .await?;
    let recorded = PaymentRecorded {
        payment_id: ev.event_id,
        account_id: ev.account_id.clone(),
        amount_cents: ev.amount_cents,
        balance_cents: balance,
    };
    // Keyed by account: one account's events keep their order. The
    // relay gives it a fresh event id, carried in the `event-id` header.
    dedup_postgres::enqueue(
        tx,
        OutboxMessage::json(RECORDED_TOPIC.as_str(), &recorded)?.with_key(ev.account_id),
    )
    .await?;
    Ok(())
}

/// The downstream service: deduplicates on the relay's `event-id` header.
#[idempotent(key = "header:event-id", ttl = "4h", scope = "outbox::record_notice")]
async fn record_notice(tx: &mut PgTx, ev: PaymentRecorded) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO payment_notices (payment_id, account_id, amount_cents) VALUES ($1, $2, $3)",
    )
    .bind(ev.payment_id.to_string())
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

struct Args {
    relay_only: bool,
    idle: Option<Ttl>,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let usage = "usage: outbox [--role all|relay] [--exit-when-idle <ttl>]";
    let mut parsed = Args {
        relay_only: false,
        idle: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--exit-when-idle" => {
                parsed.idle = Some(args.next().ok_or(usage)?.parse()?);
            }
            "--role" => match args.next().as_deref() {
                Some("all") => parsed.relay_only = false,
                Some("relay") => parsed.relay_only = true,
                _ => return Err(usage.into()),
            },
            other => return Err(format!("unknown argument {other:?}; {usage}").into()),
        }
    }
    Ok(parsed)
}

/// Completes once the outbox has been empty, and `quiet` true, for `limit`.
async fn idle(outbox: &OutboxReader, limit: Duration, quiet: impl Fn(Duration) -> bool) {
    let mut empty_since = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if outbox.pending().await.map_or(true, |n| n > 0) {
            empty_since = tokio::time::Instant::now();
        } else if empty_since.elapsed() >= limit && quiet(limit) {
            return;
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let args = args()?;
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    let brokers = env_or("KAFKA_BROKERS", "localhost:9092");
    let group = env_or("GROUP_ID", "payments-v1");

    let store = PgStore::connect(&database_url).await?;
    store.migrate().await?;
    OutboxWriter::default().migrate(store.pool()).await?;
    for ddl in [
        "CREATE TABLE IF NOT EXISTS accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
        "CREATE TABLE IF NOT EXISTS payment_notices (seq bigserial PRIMARY KEY, \
         payment_id text NOT NULL, account_id text NOT NULL, amount_cents bigint NOT NULL)",
    ] {
        sqlx::query(ddl).execute(store.pool()).await?;
    }
    let outbox = store.outbox_reader();

    let delivery_timeout =
        Duration::from_millis(env_or("RELAY_DELIVERY_TIMEOUT_MS", "30000").parse()?);
    let relay = Relay::builder(outbox.clone())
        .set_from_env("KAFKA_CFG_")
        .brokers(&brokers)
        .poll_interval(Duration::from_millis(500))
        .delivery_timeout(delivery_timeout)
        .build()?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let mut built = Vec::new();
    if !args.relay_only {
        let mut payments = Consumer::builder(store.clone())
            .set_from_env("KAFKA_CFG_")
            .brokers(&brokers)
            .group_id(&group)
            .handle(env_or("TOPIC", "payments"), record_payment);
        // DEDUP_RETRY_TIERS, as the payments example takes it.
        if let Some(tiers) = dedup_examples::retry_tiers()? {
            payments = payments.retry_tiers_with(tiers);
        }
        let payments = payments.build()?;
        let notices = Consumer::builder(store.clone())
            .set_from_env("KAFKA_CFG_")
            .brokers(&brokers)
            .group_id(format!("{group}-notices"))
            .handle(RECORDED_TOPIC.as_str(), record_notice)
            .build()?;
        built = vec![payments, notices];
    }
    // With METRICS_ADDR set: /metrics, and health probes that report on the
    // relay and both consumers, on one address. The recorder is installed
    // before they run: they register their metrics as they start.
    let _server = match dedup_examples::metrics_addr() {
        Some(addr) => {
            let mut endpoints = HttpEndpoints::bind(&addr)?.relay("relay", relay.stats());
            for (name, consumer) in ["payments", "notices"].iter().zip(&built) {
                endpoints = endpoints.consumer(*name, consumer.stats());
            }
            Some(endpoints.spawn())
        }
        None => None,
    };
    let relay_task = tokio::spawn(relay.run_until(stopped(stop_rx.clone())));
    let mut consumers = Vec::new();
    for consumer in built {
        let stats = consumer.stats();
        let task = tokio::spawn(consumer.run_until(stopped(stop_rx.clone())));
        consumers.push((stats, task));
    }
    let all_stats: Vec<_> = consumers.iter().map(|(s, _)| s.clone()).collect();
    match args.idle {
        Some(limit) => tokio::select! {
            () = idle(&outbox, limit.as_duration(), |limit| {
                all_stats.iter().all(|s| s.idle_for() >= limit)
            }) => {}
            () = dedup_kafka::shutdown_signal() => {}
        },
        None => dedup_kafka::shutdown_signal().await,
    }
    let _ = stop_tx.send(true);
    let mut summaries: Vec<StatsSnapshot> = Vec::new();
    for (_, task) in consumers {
        summaries.push(task.await??);
    }
    let relay_summary = relay_task.await??;
    match summaries.as_slice() {
        [payments, notices] => {
            println!("payments: {payments} | relay: {relay_summary} | notices: {notices}");
        }
        _ => println!("relay: {relay_summary}"),
    }
    Ok(())
}
