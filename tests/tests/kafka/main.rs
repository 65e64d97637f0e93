//! End to end through a real Apache Kafka broker (started by
//! scripts/kafka.sh on 127.0.0.1:9092) and a real PostgreSQL, one database
//! per test, random topic and group names per test.
//!
//! The handlers add to a balance (NON-idempotent), so a double apply shows.
//! The tests are grouped by theme, one module each; what several share is
//! here.

use dedup_tests::common;

use std::process::Command;
use std::time::{Duration, Instant};

use dedup_core::{Describe as _, HandlerExt, Ttl, idempotent};
use dedup_kafka::{Consumer, ConsumerBuilder, RetryPolicy};
use dedup_postgres::{PgStore, PgTx};
use dedup_tests::{PaymentReceived, credit, payment, store, total_balance as balance};
use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;

use common::{
    KillOnDrop, brokers, create_topic, database_url, drain, example, header, last_line, producer,
    read_exactly, start, unique,
};

mod batches;
mod claims;
mod environment;
mod group;
mod keyed;
mod poison;
mod records;
mod secured;
mod tiers;

async fn produce(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &[u8],
    headers: Option<OwnedHeaders>,
) {
    let mut record = FutureRecord::to(topic).key(key).payload(payload);
    if let Some(headers) = headers {
        record = record.headers(headers);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
}

/// Produces every `(key, payload)` without waiting for each in turn, then
/// waits until all are acknowledged.
async fn produce_all(
    producer: &FutureProducer,
    topic: &str,
    records: impl IntoIterator<Item = (String, Vec<u8>)>,
) {
    let mut deliveries = Vec::new();
    for (key, payload) in records {
        let record = FutureRecord::<str, [u8]>::to(topic)
            .key(&key)
            .payload(&payload);
        let delivery = producer
            .send_result(record)
            .map_err(|(e, _)| e)
            .expect("queued");
        deliveries.push(delivery);
    }
    for delivery in deliveries {
        delivery
            .await
            .expect("delivered")
            .map_err(|(e, _)| e)
            .expect("produced");
    }
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

/// Slow enough that a rebalance or a shutdown lands mid-stream.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_slowly(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    tokio::time::sleep(Duration::from_millis(15)).await;
    credit(tx, &ev).await
}

fn consumer(store: &PgStore, group: &str) -> ConsumerBuilder<PgStore> {
    Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(group)
        .commit_interval(Duration::from_millis(200))
        .retry(
            RetryPolicy::default()
                .with_backoff(Duration::from_millis(20), Duration::from_millis(200)),
        )
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
}

/// Runs the payments example until idle, killed at `failpoint` if given.
/// The crashed member holds its partition until its session times out;
/// kept short so that a restart gets it soon.
fn run_payments(
    pool: &PgPool,
    topic: &str,
    group: &str,
    failpoint: Option<&str>,
) -> std::process::Output {
    let mut cmd = common::payments(pool, topic, group);
    cmd.args(["--exit-when-idle", "3s"])
        .env("KAFKA_SESSION_TIMEOUT_MS", "6000");
    if let Some(f) = failpoint {
        cmd.env("DEDUP_FAILPOINT", f);
    }
    cmd.output().expect("run the payments example")
}
