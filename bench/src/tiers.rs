//! `--tiers`: how long the other keys wait while one key's handler fails
//! transiently, with and without retry tiers. One partition; 30 keys
//! stream at 50 events/s for 90 s; the first key's statement fails for the
//! first 60 s (a trigger raises, as a downstream's 503 would surface).
//! Each configuration runs with a fresh topic, group and tables:
//!
//! - `in place`: the default retry policy (8 attempts, 100 ms doubling to
//!   10 s): the failing key's events stall the partition, then go to the
//!   dead-letter topic;
//! - `tiers 5s,1m`: `retry_tiers(["5s", "1m"])`, 4 attempts in place;
//! - `tiers 5s,1m, hold keys`: the same with `hold_keys(true)`;
//! - `kafka-only, in place` and `kafka-only, tiers 5s,1m`: the same stream
//!   through the `TransactionalConsumer`, its handler forwarding each event
//!   to an output topic (and failing for the first key while a flag says
//!   so); delays are an output's timestamp (sent in the transaction that
//!   commits it) minus its event's produce time.
//!
//! Printed per configuration: the longest and the 99th-percentile delay
//! (applied minus produced) of the other keys' events, and what became of
//! the failing key's (applied, dead-lettered) once the stream has drained.

use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};

use dedup_core::{HandlerError, idempotent};
use dedup_kafka::{Outputs, RetryTiers, TransactionalConsumer};
use dedup_postgres::{PgStore, PgTx};
use rdkafka::ClientConfig;
use rdkafka::message::Message as _;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::{Args, BoxError, ConsumerRun, configure, env_or, new_topic};

const KEYS: usize = 30;
const RATE: u64 = 50;
const STREAM: Duration = Duration::from_secs(90);
const FAILING: Duration = Duration::from_secs(60);

#[derive(serde::Deserialize, serde::Serialize)]
struct Event {
    event_id: uuid::Uuid,
    key: String,
    produced_ms: i64,
}

/// The Kafka-only configurations' output topic, and whether the first key
/// fails.
static OUTPUT: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());
static K0_FAILING: AtomicBool = AtomicBool::new(false);

#[idempotent(key = "event_id", ttl = "4h", scope = "bench::tiers-kafka")]
async fn forward(out: &mut Outputs, ev: Event) -> Result<(), HandlerError> {
    if ev.key == "k0" && K0_FAILING.load(Ordering::Relaxed) {
        return Err(HandlerError::transient("the downstream answers 503"));
    }
    let topic = OUTPUT.lock().unwrap_or_else(|p| p.into_inner()).clone();
    out.send(&topic, &ev.key, &ev)
}

#[idempotent(key = "event_id", ttl = "4h", scope = "bench::tiers")]
async fn apply(tx: &mut PgTx, ev: Event) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO bench_tiers (key, produced_ms, applied_ms) \
         VALUES ($1, $2, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)",
    )
    .bind(&ev.key)
    .bind(ev.produced_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Runs the three configurations and prints the table.
pub(crate) async fn run(args: &Args) -> Result<(), BoxError> {
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let admin = sqlx::PgPool::connect(&url).await?;
    PgStore::from_pool(admin.clone()).migrate().await?;
    for statement in [
        "CREATE TABLE IF NOT EXISTS bench_tiers (key text NOT NULL, produced_ms bigint NOT NULL, \
         applied_ms bigint NOT NULL)",
        "CREATE TABLE IF NOT EXISTS bench_tiers_failing (since timestamptz)",
        "CREATE OR REPLACE FUNCTION bench_tiers_fail() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.key = 'k0' AND EXISTS (SELECT 1 FROM bench_tiers_failing) THEN \
         RAISE EXCEPTION 'the downstream answers 503'; END IF; RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS bench_tiers_fail ON bench_tiers",
        "CREATE TRIGGER bench_tiers_fail BEFORE INSERT ON bench_tiers FOR EACH ROW \
         EXECUTE FUNCTION bench_tiers_fail()",
    ] {
        sqlx::query(statement).execute(&admin).await?;
    }
    eprintln!(
        "dedup-bench --tiers: {KEYS} keys at {RATE} events/s for {} s on one partition, key k0 \
         failing for the first {} s",
        STREAM.as_secs(),
        FAILING.as_secs()
    );
    println!(
        "| configuration | other keys: longest delay | p99 delay | failing key: applied | dead-lettered | moved |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, tiers) in [
        ("in place (8 attempts)", None),
        ("tiers 5s,1m", Some(false)),
        ("tiers 5s,1m, hold keys", Some(true)),
    ] {
        sqlx::query("TRUNCATE dedup_claims, bench_tiers, bench_tiers_failing")
            .execute(&admin)
            .await?;
        sqlx::query("INSERT INTO bench_tiers_failing VALUES (now())")
            .execute(&admin)
            .await?;
        let topic = tier_topics(&brokers).await?;
        let store = PgStore::connect(&url).await?;
        let group = format!("bench-tiers-{}", uuid::Uuid::new_v4().simple());
        let mut builder = configure(store, args, &brokers, &group, 200);
        if let Some(hold) = tiers {
            builder = builder.retry_tiers_with(RetryTiers::new(["5s", "1m"])?.hold_keys(hold));
        }
        let run = ConsumerRun::spawn(builder.handle(&topic, apply));
        let ended = stream(&brokers, &topic, Some(&admin)).await?;
        // Drained: the last tier's wait, then a settle.
        let total = (RATE * STREAM.as_secs()) as i64;
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let stats = run.stats.snapshot();
            let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_tiers")
                .fetch_one(&admin)
                .await?;
            if applied + stats.dead_lettered as i64 >= total || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let stats = run.stats.snapshot();
        run.stop().await;
        let (longest, p99): (Option<i64>, Option<f64>) = sqlx::query_as(
            "SELECT max(applied_ms - produced_ms), \
             percentile_cont(0.99) WITHIN GROUP (ORDER BY applied_ms - produced_ms) \
             FROM bench_tiers WHERE key <> 'k0'",
        )
        .fetch_one(&admin)
        .await?;
        let failing_applied: i64 =
            sqlx::query_scalar("SELECT count(*) FROM bench_tiers WHERE key = 'k0'")
                .fetch_one(&admin)
                .await?;
        eprintln!("  {name}: stream ended {ended:?} after its start; {stats}");
        println!(
            "| {name} | {:.1} s | {:.1} s | {failing_applied} of {} | {} | {} |",
            longest.unwrap_or(0) as f64 / 1000.0,
            p99.unwrap_or(0.0) / 1000.0,
            total / KEYS as i64,
            stats.dead_lettered,
            stats.moved,
        );
    }
    for (name, tiers) in [
        ("kafka-only, in place (8 attempts)", false),
        ("kafka-only, tiers 5s,1m", true),
    ] {
        kafka_only(name, tiers, &brokers, args).await?;
    }
    Ok(())
}

/// A fresh one-partition topic and its tiers' topics (`5s`, `1m`).
async fn tier_topics(brokers: &str) -> Result<String, BoxError> {
    let topic = new_topic(brokers, "tiers", 1).await?;
    for tier in ["5s", "1m"] {
        crate::create_topic(brokers, &format!("{topic}.retry-{tier}"), 1).await?;
    }
    Ok(topic)
}

/// One Kafka-only configuration: the stream through a
/// `TransactionalConsumer` (with tiers or not), then its row.
async fn kafka_only(name: &str, tiers: bool, brokers: &str, args: &Args) -> Result<(), BoxError> {
    let topic = tier_topics(brokers).await?;
    let output = new_topic(brokers, "tiers-out", 1).await?;
    *OUTPUT.lock().unwrap_or_else(|p| p.into_inner()) = output.clone();
    K0_FAILING.store(true, Ordering::Relaxed);
    let mut builder = TransactionalConsumer::builder(&topic, forward)
        .brokers(brokers)
        .group_id(format!("bench-tiers-{}", uuid::Uuid::new_v4().simple()));
    for (k, v) in &args.settings {
        builder = builder.set(k, v);
    }
    if tiers {
        builder = builder.retry_tiers(["5s", "1m"]);
    }
    let consumer = builder.build()?;
    let live = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    let ended = stream(brokers, &topic, None).await?;
    let total = RATE * STREAM.as_secs();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let stats = live.snapshot();
        if stats.applied + stats.dead_lettered >= total || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = stop.send(());
    let stats = task.await??;
    let mut delays = Vec::new();
    let mut failing_applied = 0;
    for (key, delay) in output_delays(brokers, &output)? {
        match key.as_str() {
            "k0" => failing_applied += 1,
            _ => delays.push(delay),
        }
    }
    delays.sort_unstable();
    let p99 = delays
        .get((delays.len() * 99 / 100).min(delays.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0);
    eprintln!("  {name}: stream ended {ended:?} after its start; {stats}");
    println!(
        "| {name} | {:.1} s | {:.1} s | {failing_applied} of {} | {} | {} |",
        delays.last().copied().unwrap_or(0) as f64 / 1000.0,
        p99 as f64 / 1000.0,
        total / KEYS as u64,
        stats.dead_lettered,
        stats.moved,
    );
    Ok(())
}

/// Each committed output of `topic` (one partition): its key and its
/// delay, its timestamp minus its event's produce time (ms).
fn output_delays(brokers: &str, topic: &str) -> Result<Vec<(String, i64)>, BoxError> {
    let reader = crate::kafka_only::committed_reader(brokers, topic, 1)?;
    let mut out = Vec::new();
    let started = Instant::now();
    loop {
        match reader.poll(Duration::from_millis(500)) {
            Some(Ok(msg)) => {
                let ev: Event = serde_json::from_slice(msg.payload().unwrap_or_default())?;
                let at = msg.timestamp().to_millis().unwrap_or(ev.produced_ms);
                out.push((ev.key, at - ev.produced_ms));
            }
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) => return Ok(out),
            Some(Err(e)) => return Err(e.into()),
            None if started.elapsed() > Duration::from_secs(60) => {
                return Err(format!("{topic} not read to its end in 60 s").into());
            }
            None => {}
        }
    }
}

/// Produces `RATE` events a second for `STREAM`, round robin over the
/// keys, ending the failure `FAILING` after the start (emptying the
/// failing table through `admin`, or clearing the Kafka-only flag).
async fn stream(
    brokers: &str,
    topic: &str,
    admin: Option<&sqlx::PgPool>,
) -> Result<Duration, BoxError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "5")
        .create()?;
    let started = Instant::now();
    let mut failing = true;
    let total = RATE * STREAM.as_secs();
    let mut acks = Vec::new();
    for i in 0..total {
        let at = started + Duration::from_millis(i * 1000 / RATE);
        tokio::time::sleep_until(at.into()).await;
        if failing && started.elapsed() >= FAILING {
            match admin {
                Some(admin) => {
                    sqlx::query("TRUNCATE bench_tiers_failing")
                        .execute(admin)
                        .await?;
                }
                None => K0_FAILING.store(false, Ordering::Relaxed),
            }
            failing = false;
        }
        let key = format!("k{}", i as usize % KEYS);
        let body = serde_json::json!({
            "event_id": uuid::Uuid::new_v4(),
            "key": key,
            "produced_ms": now_ms(),
        })
        .to_string();
        let record = FutureRecord::to(topic).key(&key).payload(&body);
        acks.push(producer.send_result(record).map_err(|(e, _)| e)?);
    }
    for ack in acks {
        ack.await?.map_err(|(e, _)| e)?;
    }
    Ok(started.elapsed())
}
