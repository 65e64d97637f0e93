//! The steady modes: events produced at a fixed rate while the consumer
//! keeps up. They measure what a service at steady load sees: the latency
//! from an event's produce acknowledgement to its effect's commit.
//! `steady` runs the default settings (TTL 4 h: nothing expires during the
//! run); `steady-purge` a 10 s TTL with the purger deleting every second,
//! and reports the claims table's size against its bound.
//!
//! The handler announces each batch it applied with `pg_notify` in the
//! batch's transaction, which PostgreSQL delivers only when that
//! transaction commits: the moment the effect is committed, not the later
//! offset commit.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedup_core::{HandlerError, HandlerExt, PurgeConfig, Ttl, idempotent};
use dedup_postgres::{PgStore, PgTx};
use sqlx::postgres::PgListener;

use crate::produce::{Producer, unix_micros};
use crate::workload::Workload;
use crate::{
    Args, BoxError, ConsumerRun, Payment, Report, configure, env_or, insert_effects, new_topic,
    reset_table, rows,
};

/// The claims' TTL in `steady-purge`: short, so the table's bound is
/// reached (and held) within seconds.
const TTL_SECONDS: u64 = 10;
/// The purger's interval in `steady-purge`.
const PURGE_INTERVAL: Duration = Duration::from_secs(1);
/// Events acknowledged this long after the first are the steady ones.
const WARM_UP_LATENCY: Duration = Duration::from_secs(2);
/// Where the handler announces what it applied.
const CHANNEL: &str = "dedup_bench_applied";

#[idempotent(key = "event_id", ttl = "4h", scope = "bench::steady", batch)]
async fn record_payments_announced(
    tx: &mut PgTx,
    events: Vec<Payment>,
) -> Result<(), HandlerError> {
    insert_effects(&mut **tx, &events).await?;
    let sources: Vec<String> = events.iter().map(|p| p.source.to_string()).collect();
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(sources.join(","))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// When each event (by source number) was seen committed.
#[derive(Default)]
struct Applied {
    /// µs since the epoch; 0 = not yet.
    at: Vec<u64>,
    /// Events seen committed at least once.
    distinct: usize,
    /// Commits of an event already seen committed (a double apply).
    repeats: u64,
}

impl Applied {
    fn new(events: usize) -> Self {
        Applied {
            at: vec![0; events],
            ..Applied::default()
        }
    }

    fn record(&mut self, source: usize, at: u64) {
        match self.at.get_mut(source) {
            Some(slot @ 0) => {
                *slot = at;
                self.distinct += 1;
            }
            Some(_) => self.repeats += 1,
            // Not an event of this workload: count it as wrong.
            None => self.repeats += 1,
        }
    }
}

/// The LISTEN connection, on a thread and runtime of its own: a commit is
/// timed when its notification arrives, not when the benchmark's busy
/// runtime gets to it.
struct Listening {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Listening {
    /// Listens on [`CHANNEL`]; returns once LISTEN is in place.
    async fn start(url: &str, applied: Arc<Mutex<Applied>>) -> Result<Self, BoxError> {
        let (ready, listening) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let url = url.to_owned();
        let thread = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready.send(Err(e.to_string()));
                    return;
                }
            };
            runtime.block_on(async move {
                let mut listener = match PgListener::connect(&url).await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready.send(Err(e.to_string()));
                        return;
                    }
                };
                if let Err(e) = listener.listen(CHANNEL).await {
                    let _ = ready.send(Err(e.to_string()));
                    return;
                }
                let _ = ready.send(Ok(()));
                tokio::pin!(stopped);
                loop {
                    tokio::select! {
                        _ = &mut stopped => return,
                        n = listener.recv() => {
                            let Ok(n) = n else { return };
                            let at = unix_micros();
                            let mut applied = applied.lock().expect("lock");
                            for s in n.payload().split(',').filter_map(|s| s.parse().ok()) {
                                applied.record(s, at);
                            }
                        }
                    }
                }
            });
        });
        listening.await.map_err(|_| "the listener thread ended")??;
        Ok(Listening { stop, thread })
    }

    /// Stops listening, after a moment for notifications in flight.
    fn stop(self) {
        std::thread::sleep(Duration::from_millis(200));
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

/// One steady run: `purge` for `steady-purge` (else the defaults, and no
/// claims bound: the report's `claims_max` is the most claims rows counted
/// after warm-up, `claims_bound` 1.1 x rate x (TTL + purge interval)).
pub(crate) async fn run_steady(args: &Args, purge: bool) -> Result<Report, BoxError> {
    let mode = if purge { "steady-purge" } else { "steady" };
    let rate = args
        .rate
        .ok_or("steady needs --rate (the full run passes half of batched's)")?;
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    // Default settings: the pool, the batch size, the linger.
    let store = PgStore::connect(&url).await?;
    store.migrate().await?;
    reset_table(store.pool()).await?;
    let events = (rate * args.seconds).round() as usize;
    // Duplicates within the last 2 s of traffic: a retrying producer, well
    // inside the TTL (an older copy would be applied again, by design).
    let window = ((rate * 2.0) as usize).max(1);
    let work = Workload::new(events, args.duplicates, window);
    let topic = new_topic(&brokers, "steady", args.partitions).await?;
    let group = format!("{topic}-g");

    // When each event's batch was seen committed.
    let applied = Arc::new(Mutex::new(Applied::new(work.distinct)));
    let listening = Listening::start(&url, applied.clone()).await?;

    let builder = configure(store.clone(), args, &brokers, &group, 200);
    let consumer = ConsumerRun::spawn(if purge {
        let ttl = Ttl::from_secs(TTL_SECONDS).ok_or("ttl")?;
        builder.handle(&topic, record_payments_announced.with_ttl(ttl))
    } else {
        builder.handle(&topic, record_payments_announced)
    });
    let purger =
        purge.then(|| store.spawn_purger(PurgeConfig::default().with_interval(PURGE_INTERVAL)));
    let joined = Instant::now();
    while consumer.stats.health().assigned_partitions < args.partitions as u64 {
        if joined.elapsed() > Duration::from_secs(60) {
            return Err("the consumer was not assigned its partitions within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    eprintln!("  {mode}: {rate:.0} events/s for {:.0} s", args.seconds);
    let mut producer = Producer::spawn(&topic, events, args.duplicates, window, Some(rate))?;
    let started = Instant::now();
    // The table is full once the first claims can expire and be purged.
    let warm_up = Duration::from_secs(TTL_SECONDS) + PURGE_INTERVAL + Duration::from_secs(1);
    let mut max_rows = 0i64;
    let mut producing = true;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if purge && producing && started.elapsed() >= warm_up {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_claims")
                .fetch_one(store.pool())
                .await?;
            max_rows = max_rows.max(n);
        }
        producing = producing && producer.running()?;
        let done = applied.lock().expect("lock").distinct;
        // Every event applied, and every delivery (the duplicates queued
        // behind the last new event too) finished by the consumer.
        let s = consumer.stats.snapshot();
        let finished = s.applied + s.skipped + s.dead_lettered;
        if !producing && done >= work.distinct && finished >= events as u64 {
            break;
        }
        if started.elapsed() > Duration::from_secs_f64(args.seconds) + Duration::from_secs(120) {
            return Err(format!(
                "{mode}: {done} of {} events applied 2 min after producing ended",
                work.distinct
            )
            .into());
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let stats = consumer.stats.snapshot();
    consumer.stop().await;
    if let Some(purger) = purger {
        purger.stop().await;
    }
    listening.stop();
    let acks = producer.finish()?;
    let applied = std::mem::take(&mut *applied.lock().expect("lock"));
    if applied.repeats > 0 {
        return Err(format!("{mode}: {} events were applied twice", applied.repeats).into());
    }
    // Latency at steady load: events acknowledged in the first seconds
    // (the pool opening its connections, the first fetches) are left out;
    // with the purger, everything before it has claims to delete.
    let first_ack = acks
        .by_source
        .iter()
        .copied()
        .filter(|&t| t > 0)
        .min()
        .unwrap_or(0);
    let steady_from = first_ack
        + if purge {
            warm_up.as_micros() as u64
        } else {
            WARM_UP_LATENCY.as_micros() as u64
        };
    let mut latencies = Vec::with_capacity(applied.at.len());
    let mut dump = String::new();
    for (source, &at) in applied.at.iter().enumerate() {
        let acked = acks.by_source.get(source).copied().unwrap_or(0);
        if acked == 0 {
            return Err(format!("event {source} was applied but never acknowledged").into());
        }
        if acked >= steady_from {
            latencies.push(at.saturating_sub(acked) as f64 / 1000.0);
        }
        if args.dump.is_some() {
            dump.push_str(&format!("{acked} {at}\n"));
        }
    }
    if let Some(path) = &args.dump {
        // One line per applied event: acknowledged, committed (µs since the
        // epoch), for a look at the latency over time.
        std::fs::write(path, dump)?;
    }
    let rows = rows(store.pool()).await?;
    let mut report = Report::new(
        mode,
        events,
        seconds,
        latencies,
        (rows, work.distinct as i64),
        stats.batches,
    );
    if purge {
        report.claims_max = Some(max_rows);
        report.claims_bound =
            Some(1.1 * rate * (TTL_SECONDS as f64 + PURGE_INTERVAL.as_secs_f64()));
    }
    Ok(report)
}
