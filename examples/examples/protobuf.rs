//! Protobuf events through Kafka: `PaymentRecorded` (`proto/payments.proto`,
//! compiled by prost-build at build time) decoded two ways.
//!
//! - `record_payment` reads plain Protobuf: `#[idempotent(format = "protobuf")]`.
//! - `record_registered` reads Confluent's schema-registry wire format
//!   (magic byte, schema id, message indexes, record) through a function of
//!   ours: `#[idempotent(decode = from_registry)]`. It accepts the one schema
//!   id it was written for; a service that follows schema evolution fetches
//!   the ids it accepts from its registry at start-up, never inside `decode`.
//!
//! It produces its own events, each twice, to `TOPIC` (plain) and
//! `TOPIC-registry` (framed), plus a payload that is not Protobuf and a framed
//! record of an unknown schema; consumes both topics until idle; and checks
//! that each payment was credited once and the two bad payloads went to the
//! dead-letter topics with kind `decode`. It exits non-zero if not.
//!
//! Environment: `DATABASE_URL` (required), `KAFKA_BROKERS` (default
//! `localhost:9092`), `TOPIC` (default `payments-proto`), `GROUP_ID`
//! (default `protobuf-v1`). Its last line is
//! `applied=N skipped=N dead_lettered=N`.
//!
//! `DATABASE_URL=... cargo run -p dedup-examples --example protobuf`

#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;

use dedup_core::decode::ConfluentFrame;
use dedup_core::{Error, HandlerError, idempotent};
use dedup_examples::proto::PaymentRecorded;
use dedup_examples::{env_or, send};
use dedup_kafka::Consumer;
use dedup_postgres::{PgStore, PgTx};
use prost::Message as _;
use rdkafka::ClientConfig;
use rdkafka::producer::FutureProducer;

/// The id the schema registry gave `payments.proto` in this example.
const SCHEMA_ID: u32 = 42;

#[idempotent(key = "event_id", ttl = "4h", format = "protobuf")]
async fn record_payment(tx: &mut PgTx, ev: PaymentRecorded) -> Result<(), HandlerError> {
    credit(tx, &ev).await
}

#[idempotent(key = "event_id", ttl = "4h", decode = from_registry)]
async fn record_registered(tx: &mut PgTx, ev: PaymentRecorded) -> Result<(), HandlerError> {
    credit(tx, &ev).await
}

/// Confluent's wire format around a `PaymentRecorded`: anything else (no
/// frame, another schema, another message of the schema) is a decode error,
/// so the record is dead-lettered and the partition moves on.
fn from_registry(payload: &[u8]) -> Result<PaymentRecorded, Error> {
    let frame = ConfluentFrame::parse_protobuf(payload)?;
    if frame.schema_id != SCHEMA_ID || frame.message_indexes != [0] {
        return Err(Error::Decode(
            format!(
                "schema id {} (message {:?}) is not PaymentRecorded (schema id {SCHEMA_ID})",
                frame.schema_id, frame.message_indexes
            )
            .into(),
        ));
    }
    dedup_core::decode::protobuf(frame.body)
}

/// Adds the amount to the account's balance: not idempotent by itself, so a
/// payment applied twice would show.
async fn credit(tx: &mut PgTx, ev: &PaymentRecorded) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO proto_balances (account_id, cents) VALUES ($1, $2) \
         ON CONFLICT (account_id) DO UPDATE SET cents = proto_balances.cents + EXCLUDED.cents",
    )
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The schema-registry frame of the schema's first message: magic byte 0,
/// the schema id big-endian, `0` for message indexes `[0]`.
fn framed(schema_id: u32, record: &[u8]) -> Vec<u8> {
    let mut payload = vec![0];
    payload.extend_from_slice(&schema_id.to_be_bytes());
    payload.push(0);
    payload.extend_from_slice(record);
    payload
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    dedup_examples::init_logging();
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    let brokers = env_or("KAFKA_BROKERS", "localhost:9092");
    let topic = env_or("TOPIC", "payments-proto");
    let registry_topic = format!("{topic}-registry");

    let store = PgStore::connect(&database_url).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS proto_balances (account_id text PRIMARY KEY, cents bigint NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    // Five payments per topic, each sent twice (a producer retry), to
    // accounts of this run's own.
    let run = uuid::Uuid::new_v4().simple().to_string();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for (topic, registered) in [(&topic, false), (&registry_topic, true)] {
        for i in 0..5 {
            let ev = PaymentRecorded {
                event_id: format!("{run}-{registered}-{i}"),
                account_id: format!("{run}-{}", i % 2),
                amount_cents: 100 + i,
            };
            *expected.entry(ev.account_id.clone()).or_default() += ev.amount_cents;
            let record = ev.encode_to_vec();
            let payload = if registered {
                framed(SCHEMA_ID, &record)
            } else {
                record
            };
            for _ in 0..2 {
                send(&producer, topic, &payload).await?;
            }
        }
    }
    // Not Protobuf (a field tag of 0 is invalid), and a record framed
    // under a schema id this service does not know.
    send(&producer, &topic, &[0x00, 0x01]).await?;
    let other = PaymentRecorded {
        event_id: format!("{run}-other-schema"),
        account_id: format!("{run}-0"),
        amount_cents: 1,
    };
    send(
        &producer,
        &registry_topic,
        &framed(7, &other.encode_to_vec()),
    )
    .await?;

    let consumer = Consumer::builder(store.clone())
        .set_from_env("KAFKA_CFG_")
        .brokers(&brokers)
        .group_id(env_or("GROUP_ID", "protobuf-v1"))
        .handle(&topic, record_payment)
        .handle(&registry_topic, record_registered)
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
    for (account, cents) in &expected {
        let balance: Option<i64> =
            sqlx::query_scalar("SELECT cents FROM proto_balances WHERE account_id = $1")
                .bind(account)
                .fetch_optional(store.pool())
                .await?;
        balances.push((account.clone(), balance, *cents));
    }
    dedup_examples::check_run(&summary, &balances)
}
