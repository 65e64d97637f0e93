//! Avro payments through a schema registry: `PaymentRecorded` in
//! Confluent's wire format, its schema registered in two versions (the
//! second adds `currency` with a default), read by one handler through
//! dedup-registry's `AvroHandler`.
//!
//! It registers both versions under `TOPIC-value`, produces five payments
//! of each version (each twice, as a producer retry would), plus a payload
//! that is not Avro and one framed under a schema id the registry never
//! gave; consumes until idle; and checks that each payment was credited
//! once, in its currency (version 1 records read as `EUR`, the default),
//! and that the two bad payloads went to the dead-letter topic with kind
//! `decode`. It exits non-zero if not.
//!
//! Environment: `DATABASE_URL` (required), `DEDUP_REGISTRY_URL` (required:
//! Confluent's REST API; Apicurio's `.../apis/ccompat/v6`),
//! `DEDUP_REGISTRY_USERNAME` and `DEDUP_REGISTRY_PASSWORD` (HTTP basic
//! auth, if set), `DEDUP_REGISTRY_CA` (a private CA, if set),
//! `KAFKA_BROKERS` (default `localhost:9092`), `TOPIC` (default
//! `payments-avro`), `GROUP_ID` (default `payments-avro-v1`). Its last line
//! is `applied=N skipped=N dead_lettered=N`.
//!
//! `eval "$(scripts/registry.sh env | sed 's/^/export /')"`, then
//! `DATABASE_URL=... cargo run -p dedup-examples --example payments_avro`

#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;

use dedup_core::{HandlerError, idempotent};
use dedup_examples::{env_or, send};
use dedup_kafka::Consumer;
use dedup_postgres::{PgStore, PgTx};
// The derive writes paths from `apache_avro::`.
use dedup_registry::apache_avro;
use dedup_registry::avro::{AvroEncoder, AvroSchema};
use dedup_registry::{AvroHandler, Registry};
use rdkafka::ClientConfig;
use rdkafka::producer::FutureProducer;

/// What the handler reads: the schema's second version.
#[derive(Debug, serde::Serialize, serde::Deserialize, AvroSchema)]
#[avro(namespace = "payments")]
struct PaymentRecorded {
    event_id: String,
    account_id: String,
    amount_cents: i64,
    /// Added in version 2: version 1 records read as "EUR".
    #[avro(default = r#""EUR""#)]
    #[serde(default)]
    currency: String,
}

/// The first version, as older producers still write it.
#[derive(Debug, serde::Serialize, AvroSchema)]
#[avro(namespace = "payments", name = "PaymentRecorded")]
struct PaymentRecordedV1 {
    event_id: String,
    account_id: String,
    amount_cents: i64,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: PaymentRecorded) -> Result<(), HandlerError> {
    // Not idempotent by itself: a payment applied twice would show.
    sqlx::query(
        "INSERT INTO avro_balances (account_id, currency, cents) VALUES ($1, $2, $3) \
         ON CONFLICT (account_id, currency) DO UPDATE SET cents = avro_balances.cents + EXCLUDED.cents",
    )
    .bind(&ev.account_id)
    .bind(&ev.currency)
    .bind(ev.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    let registry_url =
        std::env::var("DEDUP_REGISTRY_URL").map_err(|_| "DEDUP_REGISTRY_URL must be set")?;
    let brokers = env_or("KAFKA_BROKERS", "localhost:9092");
    let topic = env_or("TOPIC", "payments-avro");

    let mut registry = Registry::builder(registry_url);
    if let Ok(user) = std::env::var("DEDUP_REGISTRY_USERNAME") {
        registry = registry.basic_auth(user, std::env::var("DEDUP_REGISTRY_PASSWORD")?);
    }
    if let Ok(ca) = std::env::var("DEDUP_REGISTRY_CA") {
        registry = registry.ca_file(ca);
    }
    let registry = registry.build()?;

    let store = PgStore::connect(&database_url).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS avro_balances (account_id text, currency text, \
         cents bigint NOT NULL, PRIMARY KEY (account_id, currency))",
    )
    .execute(store.pool())
    .await?;

    // Both versions registered, as the producers' deploys would.
    let subject = format!("{topic}-value");
    let v1 = AvroEncoder::<PaymentRecordedV1>::register(&registry, &subject).await?;
    let v2 = AvroEncoder::<PaymentRecorded>::register(&registry, &subject).await?;

    // Five payments of each version, each sent twice, to accounts of this
    // run's own.
    let run = uuid::Uuid::new_v4().simple().to_string();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let mut expected: BTreeMap<(String, String), i64> = BTreeMap::new();
    for i in 0..10_i64 {
        let (event_id, account_id) = (format!("{run}-{i}"), format!("{run}-{}", i % 2));
        let amount_cents = 100 + i;
        let (payload, currency) = if i < 5 {
            let old = PaymentRecordedV1 {
                event_id,
                account_id: account_id.clone(),
                amount_cents,
            };
            (v1.encode(&old)?, "EUR")
        } else {
            let new = PaymentRecorded {
                event_id,
                account_id: account_id.clone(),
                amount_cents,
                currency: "USD".to_owned(),
            };
            (v2.encode(&new)?, "USD")
        };
        *expected
            .entry((account_id, currency.to_owned()))
            .or_default() += amount_cents;
        for _ in 0..2 {
            send(&producer, &topic, &payload).await?;
        }
    }
    // Not Avro in the wire format, and a record of a schema id the
    // registry never gave.
    send(&producer, &topic, br#"{"event_id": "json"}"#).await?;
    let mut unknown = v2.encode(&PaymentRecorded {
        event_id: format!("{run}-unknown"),
        account_id: format!("{run}-0"),
        amount_cents: 1,
        currency: "EUR".to_owned(),
    })?;
    unknown[1..5].copy_from_slice(&u32::MAX.to_be_bytes());
    send(&producer, &topic, &unknown).await?;

    let consumer = Consumer::builder(store.clone())
        .set_from_env("KAFKA_CFG_")
        .brokers(&brokers)
        .group_id(env_or("GROUP_ID", "payments-avro-v1"))
        .handle(&topic, AvroHandler::new(record_payment, registry))
        .build()?;
    let stats = consumer.stats();
    let summary = consumer
        .run_until(dedup_examples::until_idle(
            stats,
            Some("5s".parse()?),
            dedup_kafka::shutdown_signal(),
        ))
        .await?;

    let mut balances = Vec::new();
    for ((account, currency), cents) in &expected {
        let balance: Option<i64> = sqlx::query_scalar(
            "SELECT cents FROM avro_balances WHERE account_id = $1 AND currency = $2",
        )
        .bind(account)
        .bind(currency)
        .fetch_optional(store.pool())
        .await?;
        balances.push((format!("{account} {currency}"), balance, *cents));
    }
    dedup_examples::check_run(&summary, &balances)
}
