//! `--keyed`: key-ordered concurrency (`key_concurrency(N)`) on ONE
//! partition holding `--events` events of 1,000 keys (round robin), each
//! configuration read by a fresh group from the start, its claims table
//! emptied first:
//!
//! - `lease, 50 ms call`: a lease handler whose outside call sleeps 50 ms,
//!   N = 1, 16, 100, 500;
//! - `database, 10 ms statement`: a handler whose transaction runs
//!   `pg_sleep(0.01)` and one insert, N = 1, 8, 32, 64 (transactions
//!   sharing the events free to start, at most 200 each), and N = 32 with
//!   a transaction per event (`batch_size(1)`);
//! - `database, fast`: the insert alone, N = 1 and 32, shared and one per
//!   event: what sharing transactions is worth when statements are fast.
//!
//! Each is measured for `MEASURED` from its first applied event (or until
//! every event is applied), so the group's join is not counted; the ratio
//! is to N = 1 of the same handler, in this run. The database handler's
//! pool is sized to N (plus two), as `key_concurrency` asks; the lease
//! handler's has 20 connections (PostgreSQL's default limit is 100).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dedup_core::{HandlerError, Lease, idempotent};
use dedup_postgres::{PgConfig, PgStore, PgTx};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::{Args, BoxError, ConsumerRun, configure, env_or, new_topic};

/// How long each configuration is measured.
const MEASURED: Duration = Duration::from_secs(10);
/// Distinct ordering keys in the partition.
const KEYS: usize = 1_000;

#[derive(serde::Deserialize)]
struct Event {
    event_id: uuid::Uuid,
}

#[idempotent(
    key = "event_id",
    ttl = "4h",
    lease = "30s",
    scope = "bench::keyed-lease"
)]
async fn call_out(_lease: &Lease, _ev: Event) -> Result<(), HandlerError> {
    // The payment provider's answer.
    tokio::time::sleep(Duration::from_millis(50)).await;
    Ok(())
}

/// Whether the database handler's transaction runs its 10 ms statement.
static SLOW: AtomicBool = AtomicBool::new(true);

#[idempotent(key = "event_id", ttl = "4h", scope = "bench::keyed-db")]
async fn write(tx: &mut PgTx, ev: Event) -> Result<(), HandlerError> {
    if SLOW.load(Ordering::Relaxed) {
        sqlx::query("SELECT pg_sleep(0.01)")
            .execute(&mut **tx)
            .await?;
    }
    sqlx::query("INSERT INTO bench_keyed (event_id) VALUES ($1)")
        .bind(ev.event_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// One measured configuration.
struct Row {
    handler: &'static str,
    n: usize,
    batch: usize,
    per_s: f64,
}

/// Runs every configuration and prints the table.
pub(crate) async fn run(args: &Args) -> Result<(), BoxError> {
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let topic = new_topic(&brokers, "keyed", 1).await?;
    produce(&brokers, &topic, args.events).await?;
    eprintln!(
        "dedup-bench --keyed: {} events of {KEYS} keys in one partition, each configuration \
         measured {} s",
        args.events,
        MEASURED.as_secs()
    );
    let admin = sqlx::PgPool::connect(&url).await?;
    PgStore::from_pool(admin.clone()).migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS bench_keyed (event_id uuid NOT NULL)")
        .execute(&admin)
        .await?;

    let mut rows = Vec::new();
    let lease = [1, 16, 100, 500].map(|n| ("lease, 50 ms call", n, 1));
    let slow = [(1, 200), (8, 200), (32, 200), (64, 200), (32, 1)]
        .map(|(n, batch)| ("database, 10 ms statement", n, batch));
    let fast = [(1, 200), (32, 200), (32, 1)].map(|(n, batch)| ("database, fast", n, batch));
    for (handler, n, batch) in lease.into_iter().chain(slow).chain(fast) {
        SLOW.store(handler.contains("10 ms"), Ordering::Relaxed);
        sqlx::query("TRUNCATE dedup_claims, bench_keyed")
            .execute(&admin)
            .await?;
        // A transaction holds a connection while it runs; a lease call
        // holds one only for its two short statements.
        let connections = match handler.starts_with("lease") {
            true => 20,
            false => n as u32 + 2,
        };
        let config = PgConfig::default().with_max_connections(connections);
        let store = PgStore::connect_with(&url, config).await?;
        // Closed after the run, so the next run's connections fit under
        // the server's limit.
        let pool = store.pool().clone();
        let group = format!("bench-keyed-{}", uuid::Uuid::new_v4().simple());
        let builder = configure(store, args, &brokers, &group, batch).key_concurrency(n);
        let builder = match handler.starts_with("lease") {
            true => builder.handle_leased(&topic, call_out),
            false => builder.handle(&topic, write),
        };
        let (per_s, stats) = measure(ConsumerRun::spawn(builder), args.events as u64).await?;
        pool.close().await;
        eprintln!(
            "  {handler}, N = {n}, batch {batch}: {per_s:.0} events/s (retries {}, outages {}, \
             batches {})",
            stats.retries, stats.outages, stats.batches
        );
        rows.push(Row {
            handler,
            n,
            batch,
            per_s,
        });
    }
    print(&rows);
    Ok(())
}

/// Events applied per second from the first applied event, over
/// `MEASURED` or until all `total` are applied.
async fn measure(
    run: ConsumerRun,
    total: u64,
) -> Result<(f64, dedup_kafka::StatsSnapshot), BoxError> {
    let joined = Instant::now();
    while run.stats.snapshot().applied == 0 {
        if joined.elapsed() > Duration::from_secs(60) {
            run.stop().await;
            return Err("no event applied within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (started, first) = (Instant::now(), run.stats.snapshot().applied);
    let mut applied = first;
    while started.elapsed() < MEASURED && applied < total {
        tokio::time::sleep(Duration::from_millis(50)).await;
        applied = run.stats.snapshot().applied;
    }
    let per_s = (applied - first) as f64 / started.elapsed().as_secs_f64();
    let stats = run.stats.snapshot();
    run.stop().await;
    Ok((per_s, stats))
}

/// `events` events to partition 0, keyed round robin over `KEYS` keys.
async fn produce(brokers: &str, topic: &str, events: usize) -> Result<(), BoxError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()?;
    let mut acks = Vec::with_capacity(events);
    for i in 0..events {
        let key = format!("k{}", i % KEYS);
        let body = format!(r#"{{"event_id":"{}"}}"#, uuid::Uuid::new_v4());
        let record = FutureRecord::to(topic)
            .partition(0)
            .key(&key)
            .payload(&body);
        acks.push(producer.send_result(record).map_err(|(e, _)| e)?);
    }
    for ack in acks {
        ack.await?.map_err(|(e, _)| e)?;
    }
    Ok(())
}

fn print(rows: &[Row]) {
    println!("| handler | N | events per transaction | events/s | vs N = 1 |");
    println!("|---|---:|---|---:|---:|");
    for row in rows {
        let base = rows
            .iter()
            .find(|r| r.handler == row.handler && r.n == 1)
            .map_or(f64::NAN, |r| r.per_s);
        let per_tx = match (row.handler.starts_with("lease"), row.batch) {
            (true, _) => "one (lease)".to_owned(),
            (false, 1) => "one".to_owned(),
            (false, b) => format!("shared, up to {b}"),
        };
        println!(
            "| {} | {} | {per_tx} | {:.0} | {:.1}x |",
            row.handler,
            row.n,
            row.per_s,
            row.per_s / base
        );
    }
}
