//! The steady modes: events produced at a fixed rate while the consumer
//! keeps up. They measure what a service at steady load sees: the latency
//! from an event's produce acknowledgement to its effect's commit.
//! `steady` runs the default settings (TTL 4 h: nothing expires during the
//! run); `steady-purge` a 10 s TTL with the purger deleting every second,
//! and reports the claims table's size against its bound;
//! `steady-purge-full` the same in a claims table that also holds
//! `--claims` live claims (10,000,000: `batched-full`'s table, see
//! growth.rs), to show the purge keeps up however full the table is.
//!
//! A batch's events are timed when the runtime sees their transaction's
//! commit return: the moment the effect is committed, not the later offset
//! commit.

use std::time::{Duration, Instant};

use std::error::Error as StdError;
use std::sync::{Arc, Mutex};

use dedup_core::{
    Claim, Classification, DedupKey, DedupStore, Fingerprint, HandlerError, HandlerExt,
    PurgeConfig, StoreError, Ttl, idempotent,
};
use dedup_postgres::{PgStore, PgTx};

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
/// A transaction of [`Timed`]: the batch's workload numbers travel with it
/// to its commit.
pub(crate) struct TimedTx {
    tx: PgTx,
    sources: Vec<u32>,
}

/// The PostgreSQL store, timing each transaction's commit as the runtime
/// sees it return (the WAL flush and the reply included) for the events
/// its handler wrote. Nothing is added to the transactions measured: a
/// `pg_notify` in each batch, as this once used, serializes every
/// notifying commit, WAL flushes included, behind one lock (a quarter of
/// the active backends waited on it).
#[derive(Clone)]
struct Timed {
    store: PgStore,
    committed: Arc<Mutex<Committed>>,
}

/// When each event (by source number) was seen committed.
#[derive(Default)]
struct Committed {
    /// µs since the epoch; 0 = not yet.
    at: Vec<u64>,
    /// Commits of an event already committed (a double apply).
    repeats: u64,
}

impl DedupStore for Timed {
    type Tx = TimedTx;

    async fn begin(&self) -> Result<TimedTx, StoreError> {
        Ok(TimedTx {
            tx: self.store.begin().await?,
            sources: Vec::new(),
        })
    }

    async fn claim(
        &self,
        tx: &mut TimedTx,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        ttl: Ttl,
    ) -> Result<Claim, StoreError> {
        self.store.claim(&mut tx.tx, key, fingerprint, ttl).await
    }

    async fn claim_many(
        &self,
        tx: &mut TimedTx,
        keys: &[DedupKey],
        fingerprints: &[Option<Fingerprint>],
        ttl: Ttl,
    ) -> Result<Vec<Claim>, StoreError> {
        self.store
            .claim_many(&mut tx.tx, keys, fingerprints, ttl)
            .await
    }

    async fn refresh_claims(
        &self,
        tx: &mut TimedTx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        self.store.refresh_claims(&mut tx.tx, keys, ttl).await
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        self.store.live_ids_from(from).await
    }

    fn connections(&self) -> Option<usize> {
        self.store.connections()
    }

    async fn commit(&self, tx: TimedTx) -> Result<(), StoreError> {
        self.store.commit(tx.tx).await?;
        let at = unix_micros();
        let mut committed = self.committed.lock().expect("lock");
        for source in tx.sources {
            match committed.at.get_mut(source as usize) {
                Some(slot @ 0) => *slot = at,
                // Applied before, or not an event of this workload.
                _ => committed.repeats += 1,
            }
        }
        Ok(())
    }

    async fn rollback(&self, tx: TimedTx) -> Result<(), StoreError> {
        self.store.rollback(tx.tx).await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Classification {
        self.store.classify(error)
    }

    fn error_code(&self, error: &(dyn StdError + 'static)) -> Option<String> {
        self.store.error_code(error)
    }
}

#[idempotent(key = "event_id", ttl = "4h", scope = "bench::steady", batch)]
async fn record_payments_timed(tx: &mut TimedTx, events: Vec<Payment>) -> Result<(), HandlerError> {
    insert_effects(&mut *tx.tx, &events).await?;
    tx.sources.extend(events.iter().map(|p| p.source));
    Ok(())
}

/// One steady run: `purge` for `steady-purge` (else the defaults, and no
/// claims bound: the report's `claims_max` is the most claims rows counted
/// after warm-up, `claims_bound` 1.1 x rate x (TTL + purge interval)).
pub(crate) async fn run_steady(args: &Args, mode: &str) -> Result<Report, BoxError> {
    let purge = mode.starts_with("steady-purge");
    let full = mode == "steady-purge-full";
    let rate = args
        .rate
        .ok_or("steady needs --rate (the full run passes half of batched's)")?;
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
    // Default settings: the pool, the batch size, the linger (and the
    // full table for steady-purge-full).
    let store = if full {
        PgStore::connect_with(&url, crate::growth::config("batched-full")).await?
    } else {
        PgStore::connect(&url).await?
    };
    store.migrate().await?;
    reset_table(store.pool()).await?;
    if full {
        let (heap, indexes) = crate::growth::prepare(&store, args.claims).await?;
        eprintln!(
            "  {mode}: {} live claims in {} ({:.0} MiB heap, {:.0} MiB indexes)",
            args.claims,
            crate::growth::FULL_TABLE,
            heap as f64 / 1048576.0,
            indexes as f64 / 1048576.0
        );
    }
    // The claims this run takes and the purge deletes: the filler's all
    // expire at least an hour from now (growth::prepare), so this counts
    // through the expiry index and never reads the filler's rows.
    let count_sql = if full {
        "SELECT count(*) FROM bench_full_claims WHERE expires_at < now() + interval '30 minutes'"
    } else {
        "SELECT count(*) FROM dedup_claims WHERE expires_at < now() + interval '30 minutes'"
    };
    let events = (rate * args.seconds).round() as usize;
    // Duplicates within the last 2 s of traffic: a retrying producer, well
    // inside the TTL (an older copy would be applied again, by design).
    let window = ((rate * 2.0) as usize).max(1);
    let work = Workload::new(events, args.duplicates, window);
    let topic = new_topic(&brokers, "steady", args.partitions).await?;
    let group = format!("{topic}-g");

    let committed = Arc::new(Mutex::new(Committed {
        at: vec![0; work.distinct],
        repeats: 0,
    }));
    let timed = Timed {
        store: store.clone(),
        committed: committed.clone(),
    };
    let builder = configure(timed, args, &brokers, &group, 200);
    let consumer = ConsumerRun::spawn(if purge {
        let ttl = Ttl::from_secs(TTL_SECONDS).ok_or("ttl")?;
        builder.handle(&topic, record_payments_timed.with_ttl(ttl))
    } else {
        builder.handle(&topic, record_payments_timed)
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

    crate::settle_disk();
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
            let n: i64 = sqlx::query_scalar(count_sql)
                .fetch_one(store.pool())
                .await?;
            max_rows = max_rows.max(n);
        }
        producing = producing && producer.running()?;
        // Every delivery (the duplicates queued
        // behind the last new event too) finished by the consumer.
        let s = consumer.stats.snapshot();
        let finished = s.applied + s.skipped + s.dead_lettered;
        if !producing && finished >= events as u64 {
            break;
        }
        if started.elapsed() > Duration::from_secs_f64(args.seconds) + Duration::from_secs(120) {
            return Err(format!(
                "{mode}: {finished} of {events} deliveries finished 2 min after producing \
                 ended"
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
    let acks = producer.finish()?;
    let committed = std::mem::take(&mut *committed.lock().expect("lock"));
    if committed.repeats > 0 {
        return Err(format!("{mode}: {} events were applied twice", committed.repeats).into());
    }
    let committed = committed.at;
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
    let mut latencies = Vec::with_capacity(committed.len());
    let mut dump = String::new();
    for (source, &at) in committed.iter().enumerate() {
        let acked = acks.by_source.get(source).copied().unwrap_or(0);
        if at == 0 {
            return Err(format!("{mode}: event {source} was never seen committed").into());
        }
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
