//! The dedup benchmark: the same workload through several pipelines, measured
//! in one run on the machine's real Kafka and PostgreSQL.
//!
//! `cargo run --release -p dedup-bench -- [--events 200000] [--duplicates 0.1] [--partitions 6] [--json]`
//!
//! Modes (each in its own process, so its peak RSS is its own):
//! - `batched`: the default runtime (batches of 200 per partition, the
//!   handler writing each batch's rows with one multi-row statement);
//! - `batched-metrics`: the same with a Prometheus recorder installed and
//!   rendered every second (what recording metrics costs);
//! - `per-message`: the same with batch size 1;
//! - `per-event-body`: batches of 200 as `batched`, but the handler is a
//!   per-event body (`#[idempotent]` without `batch`, like
//!   examples/payments) writing its event's row with one statement each,
//!   all in the batch's transaction;
//! - `no-dedup`: the same pipeline and domain write, claims skipped (what
//!   dedup costs);
//! - `limit`: the same rows the batched mode ends with (each distinct
//!   event's claim and effect) written straight into PostgreSQL with
//!   multi-row inserts, 1,000 per transaction, no Kafka (the storage limit
//!   of this machine);
//! - `limit-effects`: the same without the claims (the domain write alone).
//!
//! For each Kafka mode the events are first produced into a fresh topic; the
//! clock then runs from the consumer's start until every offset is
//! committed. Latency is from the event's produce acknowledgement to its
//! offset being committed (committed offsets are polled every 20 ms), so it
//! includes the wait in the backlog. Each
//! mode ends with a check of the end state (applied effects equal the
//! distinct events, or every delivery for `no-dedup`); a wrong count fails
//! the run.
//!
//! - `steady`: events produced at a fixed rate (`--rate`, default half of
//!   what `batched` reached in the same run) for `--seconds` (60) into a
//!   consumer with default settings; latency from the produce
//!   acknowledgement to the effect's commit (when the runtime sees its
//!   transaction's `COMMIT` return), p50/p99/p99.9 after 2 s of warm-up;
//! - `steady-purge`: the same with a 10 s TTL and the purger running every
//!   second; the claims table is counted every 500 ms once the first
//!   claims could expire, and must stay within 1.1 x rate x (TTL + purge
//!   interval) (past it the run fails, as a wrong end state does).
//!
//! The workload is produced by a child process (this program with
//! `--produce-to`), so the peak RSS of a mode is its consumer's.
//!
//! With `--purge`, a further mode `batched-purge` runs `batched` while the
//! purger deletes a backlog of 500,000 expired claims beside it (in batches
//! of 1,000 every 200 ms), to show purging does not stall the consumer.
//!
//! With `--outbox`, the transactional outbox instead (`--per-tx K`, default
//! 10): the events are enqueued by 4 writers in transactions of K and
//! published by the relay; the clock runs from the first enqueue until the
//! last event is marked sent (latency: enqueue to mark, on the database
//! clock). Modes `outbox-1-relay` and `outbox-2-relays`, beside
//! `outbox-direct`: the same records sent straight with an idempotent
//! producer (the limit). Each ends with a check that the topic holds every
//! event exactly once, and reports the outbox table's size (sent rows are
//! kept an hour, the default retention).
//!
//! With `--kafka-only`, Kafka-to-Kafka pipelines beside `batched`:
//! `kafka-transactional` (the `TransactionalConsumer`: each distinct event's
//! output, its claim and its offset in one Kafka transaction),
//! `kafka-plain` (consume, transform, produce, at least once, no dedup),
//! and `kafka-restore` (the claims of `--events` events written, then the
//! time a new owner takes to restore them and apply its first events,
//! beside the same with no claims). See kafka_only.rs.
//!
//! With `--keyed`, key-ordered concurrency on one partition: a lease
//! handler whose call takes 50 ms and a database handler whose statement
//! takes 10 ms, at several `key_concurrency` values. See keyed.rs.
//!
//! With `--tiers`, how long the other keys wait while one key fails
//! transiently for 60 s, with and without retry tiers. See tiers.rs.
//!
//! Environment: `KAFKA_BROKERS` (default `127.0.0.1:9092`), `DATABASE_URL`.

#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::error::Error as StdError;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedup_core::{
    Claim, DedupKey, DedupStore, Fingerprint, HandlerError, StoreError, Ttl, idempotent,
};
use dedup_kafka::Consumer;
use dedup_postgres::{PgStore, PgTx};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::{Offset, TopicPartitionList};

mod kafka_only;
mod keyed;
mod outbox;
mod produce;
mod steady;
mod tiers;
mod workload;

use produce::{Producer, unix_micros};
use workload::Workload;

type BoxError = Box<dyn StdError + Send + Sync>;

const OUTBOX_MODES: [&str; 5] = [
    "outbox-direct",
    "outbox-1-relay",
    "outbox-2-relays",
    "outbox-1-relay-drain",
    "outbox-2-relays-drain",
];

const MODES: [&str; 9] = [
    "batched",
    "batched-metrics",
    "per-event-body",
    "per-message",
    "no-dedup",
    "limit",
    "limit-effects",
    "steady",
    "steady-purge",
];

#[derive(serde::Deserialize)]
struct Payment {
    event_id: String,
    account_id: String,
    amount_cents: i64,
    /// The workload's number for this event (see `Workload`).
    #[serde(default)]
    source: u32,
}

/// The domain write: one row per applied event, all of a batch in one
/// multi-row statement. A serial key makes it NOT idempotent, so the end
/// state shows every double apply.
const EFFECT_SQL: &str = "INSERT INTO bench_effects (event_id, account_id, amount_cents) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])";

/// The scope of the benchmark's claims (the `limit` mode writes them too).
const SCOPE: &str = "bench::record_payments";

#[idempotent(key = "event_id", ttl = "4h", scope = "bench::record_payments", batch)]
async fn record_payments(tx: &mut PgTx, events: Vec<Payment>) -> Result<(), HandlerError> {
    insert_effects(&mut **tx, &events).await?;
    Ok(())
}

/// The same effect written by a per-event body: one statement per event.
#[idempotent(key = "event_id", ttl = "4h", scope = "bench::record_payments")]
async fn record_payment(tx: &mut PgTx, event: Payment) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO bench_effects (event_id, account_id, amount_cents) VALUES ($1, $2, $3)",
    )
    .bind(&event.event_id)
    .bind(&event.account_id)
    .bind(event.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn insert_effects<'c>(
    db: impl sqlx::PgExecutor<'c>,
    events: &[Payment],
) -> Result<(), sqlx::Error> {
    let ids: Vec<&str> = events.iter().map(|p| p.event_id.as_str()).collect();
    let accounts: Vec<&str> = events.iter().map(|p| p.account_id.as_str()).collect();
    let amounts: Vec<i64> = events.iter().map(|p| p.amount_cents).collect();
    sqlx::query(EFFECT_SQL)
        .bind(&ids)
        .bind(&accounts)
        .bind(&amounts)
        .execute(db)
        .await?;
    Ok(())
}

/// The same pipeline without deduplication: every claim is granted without
/// touching the database. What remains is what dedup does not cost.
#[derive(Clone)]
struct NoDedup(PgStore);

impl DedupStore for NoDedup {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, StoreError> {
        self.0.begin().await
    }

    async fn claim(
        &self,
        _: &mut PgTx,
        _: &DedupKey,
        _: Option<Fingerprint>,
        _: Ttl,
    ) -> Result<Claim, StoreError> {
        Ok(Claim::Fresh)
    }

    async fn claim_many(
        &self,
        _: &mut PgTx,
        keys: &[DedupKey],
        _: &[Option<Fingerprint>],
        _: Ttl,
    ) -> Result<Vec<Claim>, StoreError> {
        Ok(vec![Claim::Fresh; keys.len()])
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        self.0.live_ids_from(from).await
    }

    fn connections(&self) -> Option<usize> {
        self.0.connections()
    }

    async fn commit(&self, tx: PgTx) -> Result<(), StoreError> {
        self.0.commit(tx).await
    }

    async fn rollback(&self, tx: PgTx) -> Result<(), StoreError> {
        self.0.rollback(tx).await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> dedup_core::Classification {
        self.0.classify(error)
    }

    fn error_code(&self, error: &(dyn StdError + 'static)) -> Option<String> {
        self.0.error_code(error)
    }
}

struct Args {
    events: usize,
    duplicates: f64,
    partitions: i32,
    json: bool,
    purge: bool,
    outbox: bool,
    kafka_only: bool,
    keyed: bool,
    tiers: bool,
    per_tx: usize,
    relay_batch: usize,
    mode: Option<String>,
    /// `steady`: the produce rate (events/s; default half of `batched`'s).
    rate: Option<f64>,
    /// `steady`: how long to produce.
    seconds: f64,
    /// Duplicates copy one of this many messages before them (0: any).
    window: usize,
    /// Consumer client settings (`--set key=value`), for every Kafka mode.
    settings: Vec<(String, String)>,
    /// `--max-buffered n`: the consumer's `max_buffered_per_partition`.
    max_buffered: Option<usize>,
    /// `--linger ms`: the consumer's `batch_linger`.
    linger: Option<u64>,
    /// `steady` modes: write each event's (ack, commit) times here.
    dump: Option<String>,
    /// Internal: produce the workload to this topic and report the acks.
    produce_to: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        events: 200_000,
        duplicates: 0.1,
        partitions: 6,
        json: false,
        purge: false,
        outbox: false,
        kafka_only: false,
        keyed: false,
        tiers: false,
        per_tx: 10,
        relay_batch: 500,
        mode: None,
        rate: None,
        seconds: 60.0,
        window: 0,
        settings: Vec::new(),
        max_buffered: None,
        linger: None,
        produce_to: None,
        dump: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--events" => a.events = value()?.parse().map_err(|e| format!("--events: {e}"))?,
            "--duplicates" => {
                a.duplicates = value()?.parse().map_err(|e| format!("--duplicates: {e}"))?
            }
            "--partitions" => {
                a.partitions = value()?.parse().map_err(|e| format!("--partitions: {e}"))?
            }
            "--mode" => a.mode = Some(value()?),
            "--json" => a.json = true,
            "--purge" => a.purge = true,
            "--outbox" => a.outbox = true,
            "--kafka-only" => a.kafka_only = true,
            "--keyed" => a.keyed = true,
            "--tiers" => a.tiers = true,
            "--relay-batch" => {
                a.relay_batch = value()?
                    .parse()
                    .map_err(|e| format!("--relay-batch: {e}"))?
            }
            "--per-tx" => {
                a.per_tx = value()?
                    .parse::<usize>()
                    .map_err(|e| format!("--per-tx: {e}"))?
                    .max(1)
            }
            "--rate" => a.rate = Some(value()?.parse().map_err(|e| format!("--rate: {e}"))?),
            "--seconds" => a.seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--window" => a.window = value()?.parse().map_err(|e| format!("--window: {e}"))?,
            "--set" => {
                let kv = value()?;
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| format!("--set {kv}: expected key=value"))?;
                a.settings.push((k.to_owned(), v.to_owned()));
            }
            "--linger" => a.linger = Some(value()?.parse().map_err(|e| format!("--linger: {e}"))?),
            "--max-buffered" => {
                a.max_buffered = Some(
                    value()?
                        .parse()
                        .map_err(|e| format!("--max-buffered: {e}"))?,
                )
            }
            "--produce-to" => a.produce_to = Some(value()?),
            "--dump" => a.dump = Some(value()?),
            other => {
                return Err(format!(
                    "unknown flag {other}; flags: --events --duplicates --partitions --json --purge \
                     --outbox --kafka-only --keyed --tiers --per-tx --relay-batch --mode --rate --seconds --set key=value \
                     --max-buffered --linger ms --dump file (with --mode steady or steady-purge)"
                ));
            }
        }
    }
    Ok(a)
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Peak resident set of this process, in MiB.
fn peak_rss_mib() -> f64 {
    rss_mib("VmHWM:")
}

/// A `/proc/self/status` memory line (`VmRSS:`, `VmHWM:`), in MiB.
fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<f64>().ok())
            })
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Report {
    mode: String,
    events: usize,
    seconds: f64,
    events_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    #[serde(default)]
    p999_ms: f64,
    peak_rss_mib: f64,
    applied_rows: i64,
    expected_rows: i64,
    /// Transactions that committed a batch (0 for per-message and limit).
    batches: u64,
    /// The outbox table's size at the end, in MiB (outbox modes).
    #[serde(default)]
    table_mib: Option<f64>,
    /// `steady`: the most claims rows seen after warm-up, and the bound.
    #[serde(default)]
    claims_max: Option<i64>,
    #[serde(default)]
    claims_bound: Option<f64>,
}

impl Report {
    /// Whether the claims table grew past its bound (`steady-purge`).
    fn exceeds_claims_bound(&self) -> bool {
        matches!((self.claims_max, self.claims_bound), (Some(m), Some(b)) if m as f64 > b)
    }

    /// A mode's figures; `rows` is (effect rows found, rows expected).
    fn new(
        mode: &str,
        events: usize,
        seconds: f64,
        mut latencies: Vec<f64>,
        rows: (i64, i64),
        batches: u64,
    ) -> Self {
        latencies.sort_by(f64::total_cmp);
        Report {
            mode: mode.into(),
            events,
            seconds,
            events_per_s: events as f64 / seconds,
            p50_ms: percentile(&latencies, 0.5),
            p99_ms: percentile(&latencies, 0.99),
            p999_ms: percentile(&latencies, 0.999),
            peak_rss_mib: peak_rss_mib(),
            applied_rows: rows.0,
            expected_rows: rows.1,
            batches,
            table_mib: None,
            claims_max: None,
            claims_bound: None,
        }
    }
}

async fn reset_table(pool: &sqlx::PgPool) -> Result<(), BoxError> {
    sqlx::query("DROP TABLE IF EXISTS bench_effects")
        .execute(pool)
        .await?;
    sqlx::query(
        "CREATE TABLE bench_effects (seq bigserial PRIMARY KEY, event_id text NOT NULL, \
         account_id text NOT NULL, amount_cents bigint NOT NULL)",
    )
    .execute(pool)
    .await?;
    sqlx::query("TRUNCATE dedup_claims").execute(pool).await?;
    Ok(())
}

async fn rows(pool: &sqlx::PgPool) -> Result<i64, BoxError> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM bench_effects")
        .fetch_one(pool)
        .await?)
}

/// Installs a Prometheus recorder in this process and renders it every
/// second, as a scrape would: what `batched-metrics` pays for its metrics.
fn install_prometheus() -> Result<(), BoxError> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &[0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0, 10_000.0],
        )?
        .install_recorder()?;
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(1));
            handle.run_upkeep();
            std::hint::black_box(handle.render());
        }
    });
    Ok(())
}

/// Runs one mode in this process.
async fn run_mode(mode: &str, args: &Args) -> Result<Report, BoxError> {
    if mode.starts_with("outbox") {
        return outbox::run_outbox(mode, args).await;
    }
    if mode.starts_with("steady") {
        return steady::run_steady(args, mode == "steady-purge").await;
    }
    if mode.starts_with("kafka-") {
        return kafka_only::run(mode, args).await;
    }
    if mode == "batched-metrics" {
        install_prometheus()?;
    }
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let store = PgStore::connect_with(
        &std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?,
        dedup_postgres::PgConfig::default().with_max_connections(20),
    )
    .await?;
    store.migrate().await?;
    reset_table(store.pool()).await?;
    // batched-purge: a backlog of expired claims for the purger to delete
    // while the consumer runs at full speed.
    let expired_backlog: i64 = if mode == "batched-purge" { 500_000 } else { 0 };
    if expired_backlog > 0 {
        sqlx::query(
            "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
             SELECT dedup_claims_claim_id('bench::expired', g::text), 'bench::expired', g::text, \
                 now() - interval '2 hours', now() - interval '1 hour' \
             FROM generate_series(1, $1) g",
        )
        .bind(expired_backlog)
        .execute(store.pool())
        .await?;
    }
    let work = Workload::new(args.events, args.duplicates, 0);
    let events = work.len();
    let expected = if mode == "no-dedup" {
        events
    } else {
        work.distinct
    } as i64;

    if mode.starts_with("limit") {
        // The same rows the batched mode ends with, each distinct event once:
        // its claim and its effect (`limit`), or the effect alone
        // (`limit-effects`), in transactions of 1,000 multi-row inserts.
        let with_claims = mode == "limit";
        let started = Instant::now();
        let mut latencies = Vec::with_capacity(events);
        let mut seen = std::collections::HashSet::new();
        let mut distinct_rows = Vec::with_capacity(work.distinct);
        for i in 0..events {
            let p: Payment = serde_json::from_str(&work.message(i).1)?;
            if seen.insert(p.event_id.clone()) {
                distinct_rows.push(p);
            }
        }
        for chunk in distinct_rows.chunks(1000) {
            let t = Instant::now();
            let mut tx = store.pool().begin().await?;
            if with_claims {
                let keys: Vec<&str> = chunk.iter().map(|p| p.event_id.as_str()).collect();
                let ids = keys
                    .iter()
                    .map(|k| Ok(dedup_postgres::claim_id(&DedupKey::new(SCOPE, *k)?)))
                    .collect::<Result<Vec<_>, dedup_core::KeyError>>()?;
                sqlx::query(
                    "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
                     SELECT u.id, $3, u.key, now(), now() + interval '4 hours' \
                     FROM unnest($1::uuid[], $2::text[]) AS u(id, key)",
                )
                .bind(&ids)
                .bind(&keys)
                .bind(SCOPE)
                .execute(&mut *tx)
                .await?;
            }
            insert_effects(&mut *tx, chunk).await?;
            tx.commit().await?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            latencies.extend(std::iter::repeat_n(ms, chunk.len()));
        }
        let seconds = started.elapsed().as_secs_f64();
        let applied = rows(store.pool()).await?;
        return Ok(Report::new(
            mode,
            events,
            seconds,
            latencies,
            (applied, expected),
            work.distinct.div_ceil(1000) as u64,
        ));
    }

    let topic = new_topic(&brokers, mode, args.partitions).await?;
    let group = format!("{topic}-g");

    let total = events as u64;

    // Produce the whole workload first, in a child process (not timed:
    // this machine's producer would otherwise bound every mode; and not in
    // this process, whose peak RSS is the consumer's).
    let acks = Producer::spawn(&topic, args.events, args.duplicates, 0, None)?.finish()?;

    eprintln!(
        "  {mode}: RSS before the consumer {:.1} MiB",
        rss_mib("VmRSS:")
    );
    let started = Instant::now();
    let batch_size = if mode == "per-message" { 1 } else { 200 };
    let purger = (expired_backlog > 0).then(|| {
        store.spawn_purger(
            dedup_core::PurgeConfig::default()
                .with_interval(Duration::from_millis(200))
                .with_batch_size(1000),
        )
    });
    let consumer = match mode {
        "no-dedup" => ConsumerRun::spawn(
            configure(NoDedup(store.clone()), args, &brokers, &group, batch_size)
                .handle(&topic, record_payments),
        ),
        "per-event-body" => ConsumerRun::spawn(
            configure(store.clone(), args, &brokers, &group, batch_size)
                .handle(&topic, record_payment),
        ),
        _ => ConsumerRun::spawn(
            configure(store.clone(), args, &brokers, &group, batch_size)
                .handle(&topic, record_payments),
        ),
    };
    let latencies = watch_commits(
        &brokers,
        &topic,
        &group,
        args.partitions,
        total,
        &acks,
        started,
    )
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    let stats = consumer.stats.snapshot();
    consumer.stop().await;
    if let Some(purger) = purger {
        purger.stop().await;
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM dedup_claims WHERE scope = 'bench::expired'")
                .fetch_one(store.pool())
                .await?;
        eprintln!(
            "  batched-purge: the purger deleted {} of {expired_backlog} expired claims while the consumer ran",
            expired_backlog - left
        );
    }
    let applied = rows(store.pool()).await?;
    Ok(Report::new(
        mode,
        events,
        seconds,
        latencies,
        (applied, expected),
        stats.batches,
    ))
}

/// Polls `group`'s committed offsets of `topic` every 20 ms until `total`
/// messages are behind them, and returns each message's latency (ms): from
/// its produce acknowledgement to an offset past it being committed.
async fn watch_commits(
    brokers: &str,
    topic: &str,
    group: &str,
    partitions: i32,
    total: u64,
    acks: &produce::Acks,
    started: Instant,
) -> Result<Vec<f64>, BoxError> {
    let watcher: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        // Not waiting for offsets a transaction has yet to commit
        // (read_committed asks for stable offsets, and a transactional
        // consumer nearly always has some in flight).
        .set("isolation.level", "read_uncommitted")
        .create()?;
    let mut committed_at: HashMap<i32, i64> = HashMap::new();
    let mut latencies = Vec::with_capacity(total as usize);
    let mut done = 0u64;
    while done < total {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(topic, p);
        }
        let watcher_tpl =
            tokio::task::block_in_place(|| watcher.committed_offsets(tpl, Duration::from_secs(5)))?;
        let now = unix_micros();
        for elem in watcher_tpl.elements() {
            let Offset::Offset(next) = elem.offset() else {
                continue;
            };
            let from = committed_at.insert(elem.partition(), next).unwrap_or(0);
            for offset in from..next {
                if let Some(t) = acks.at(elem.partition(), offset) {
                    latencies.push(now.saturating_sub(t) as f64 / 1000.0);
                }
                done += 1;
            }
        }
        if started.elapsed() > Duration::from_secs(3600) {
            return Err("gave up after an hour".into());
        }
    }
    Ok(latencies)
}

/// A fresh topic for `mode`.
async fn new_topic(brokers: &str, mode: &str, partitions: i32) -> Result<String, BoxError> {
    let topic = format!("bench-{mode}-{}", uuid::Uuid::new_v4().simple());
    create_topic(brokers, &topic, partitions).await?;
    Ok(topic)
}

/// Creates topic `topic` of `partitions` partitions.
async fn create_topic(brokers: &str, topic: &str, partitions: i32) -> Result<(), BoxError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    for r in admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await?
    {
        r.map_err(|(t, e)| format!("create {t}: {e}"))?;
    }
    Ok(())
}

/// Records in `topic`, all partitions.
fn records_in(brokers: &str, topic: &str, partitions: i32) -> Result<i64, BoxError> {
    let watcher: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let mut total = 0;
    for p in 0..partitions {
        let (low, high) = watcher.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        total += high - low;
    }
    Ok(total)
}

/// The consumer settings every Kafka mode shares, with `--set` and
/// `--max-buffered` applied.
fn configure<S: DedupStore>(
    store: S,
    args: &Args,
    brokers: &str,
    group: &str,
    batch_size: usize,
) -> dedup_kafka::ConsumerBuilder<S> {
    let mut builder = Consumer::builder(store)
        .brokers(brokers)
        .group_id(group)
        .batch_size(batch_size)
        .commit_interval(Duration::from_millis(100));
    for (k, v) in &args.settings {
        builder = builder.set(k, v);
    }
    if let Some(ms) = args.linger {
        builder = builder.batch_linger(Duration::from_millis(ms));
    }
    if let Some(n) = args.max_buffered {
        builder = builder.max_buffered_per_partition(n);
    }
    builder
}

/// A consumer running in the background until stopped.
struct ConsumerRun {
    stats: Arc<dedup_kafka::Stats>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl ConsumerRun {
    fn spawn<S: DedupStore>(builder: dedup_kafka::ConsumerBuilder<S>) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = builder.build().expect("consumer settings");
        let stats = consumer.stats();
        let task = tokio::spawn(async move {
            let result = consumer
                .run_until(async {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = result {
                eprintln!("consumer failed: {e}");
            }
        });
        ConsumerRun { stats, stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = args()?;
    if let Some(topic) = &args.produce_to {
        let work = Workload::new(args.events, args.duplicates, args.window);
        let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
        return produce::produce(&brokers, topic, &work, args.rate);
    }
    if args.keyed {
        return keyed::run(&args).await;
    }
    if args.tiers {
        return tiers::run(&args).await;
    }
    if let Some(mode) = &args.mode {
        let report = run_mode(mode, &args).await?;
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }

    if args.outbox {
        eprintln!(
            "dedup-bench: {} outbox events into {} partitions, modes run one after another",
            args.events, args.partitions
        );
    } else {
        eprintln!(
            "dedup-bench: {} events ({}% duplicates) into {} partitions, modes run one after another",
            args.events,
            args.duplicates * 100.0,
            args.partitions
        );
    }
    let mut reports = Vec::new();
    let modes: Vec<&str> = if args.outbox {
        OUTBOX_MODES.to_vec()
    } else if args.kafka_only {
        kafka_only::KAFKA_MODES.to_vec()
    } else {
        MODES
            .iter()
            .copied()
            .chain(args.purge.then_some("batched-purge"))
            .collect()
    };
    for mode in modes {
        eprintln!("  running {mode} ...");
        let mut command = Command::new(std::env::current_exe()?);
        command
            .args(["--mode", mode, "--events", &args.events.to_string()])
            .args(["--duplicates", &args.duplicates.to_string()])
            .args(["--partitions", &args.partitions.to_string()])
            .args(["--per-tx", &args.per_tx.to_string()])
            .args(["--relay-batch", &args.relay_batch.to_string()])
            .args(["--seconds", &args.seconds.to_string()]);
        for (k, v) in &args.settings {
            command.args(["--set", &format!("{k}={v}")]);
        }
        if let Some(ms) = args.linger {
            command.args(["--linger", &ms.to_string()]);
        }
        if let Some(n) = args.max_buffered {
            command.args(["--max-buffered", &n.to_string()]);
        }
        if mode.starts_with("steady") {
            // Half of what batched reached in this run, unless given.
            let batched = reports
                .iter()
                .find(|r: &&Report| r.mode == "batched")
                .map(|r| r.events_per_s / 2.0);
            let rate = args
                .rate
                .or(batched)
                .ok_or("steady needs --rate or batched")?;
            command.args(["--rate", &format!("{rate:.0}")]);
        }
        let out = command.stderr(std::process::Stdio::inherit()).output()?;
        if !out.status.success() {
            return Err(format!("mode {mode} failed").into());
        }
        let line = String::from_utf8_lossy(&out.stdout);
        let report: Report = serde_json::from_str(line.trim().lines().last().unwrap_or_default())?;
        reports.push(report);
    }

    if args.json {
        for r in &reports {
            println!("{}", serde_json::to_string(r)?);
        }
    }
    println!(
        "{:<15} {:>9} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "mode",
        "events",
        "seconds",
        "events/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "RSS MiB",
        "batches"
    );
    for r in &reports {
        println!(
            "{:<15} {:>9} {:>9.2} {:>12.0} {:>9.1} {:>9.1} {:>9.1} {:>9} {:>9}",
            r.mode,
            r.events,
            r.seconds,
            r.events_per_s,
            r.p50_ms,
            r.p99_ms,
            r.p999_ms,
            // A steady mode's RSS is mostly the benchmark's own per-event
            // bookkeeping, not the consumer's.
            if r.mode.starts_with("steady") {
                "-".to_owned()
            } else {
                format!("{:.1}", r.peak_rss_mib)
            },
            r.batches
        );
    }
    let rate = |m: &str| {
        reports
            .iter()
            .find(|r| r.mode == m)
            .map_or(0.0, |r| r.events_per_s)
    };
    if args.kafka_only {
        println!(
            "ratios: kafka-transactional/kafka-plain {:.2}x (exactly once with claims vs at least once without), kafka-transactional/batched {:.2}x (the PostgreSQL path)",
            rate("kafka-transactional") / rate("kafka-plain"),
            rate("kafka-transactional") / rate("batched"),
        );
        if let Some(r) = reports.iter().find(|r| r.mode == "kafka-restore") {
            println!(
                "kafka-restore: a new owner of {} claims applied its first events {:.2} s after its start (see above for the part that is restoring)",
                r.events, r.seconds
            );
        }
    } else if args.outbox {
        for r in &reports {
            if let Some(mib) = r.table_mib {
                println!("{}: outbox table {mib:.1} MiB at the end", r.mode);
            }
        }
        println!(
            "ratios (end to end, {} events per transaction, 4 writers): outbox-1-relay/outbox-direct {:.2}x (target >= 0.5), outbox-2-relays/outbox-direct {:.2}x",
            args.per_tx,
            rate("outbox-1-relay") / rate("outbox-direct"),
            rate("outbox-2-relays") / rate("outbox-direct"),
        );
        println!(
            "       (a backlog drained): outbox-1-relay-drain/outbox-direct {:.2}x, outbox-2-relays-drain/outbox-direct {:.2}x",
            rate("outbox-1-relay-drain") / rate("outbox-direct"),
            rate("outbox-2-relays-drain") / rate("outbox-direct"),
        );
    } else {
        println!(
            "ratios: batched/per-message {:.1}x (target >= 10), batched/no-dedup {:.2}x (target >= 0.92), batched/limit {:.2}x (target >= 0.5)",
            rate("batched") / rate("per-message"),
            rate("batched") / rate("no-dedup"),
            rate("batched") / rate("limit"),
        );
        println!(
            "        per-event-body/batched {:.2}x (a per-event handler body, one statement per event, in the batch transaction)",
            rate("per-event-body") / rate("batched"),
        );
        println!(
            "        batched/limit-effects {:.2}x (the effect rows alone, without the claims dedup must write)",
            rate("batched") / rate("limit-effects"),
        );
        println!(
            "        batched-metrics/batched {:.3}x (a Prometheus recorder installed and scraped every second; target >= 0.97)",
            rate("batched-metrics") / rate("batched"),
        );
        for b in reports.iter().filter(|r| r.mode.starts_with("steady")) {
            println!(
                "{} ({:.0} events/s produced, {}): produce ack -> effect committed p50 {:.1} ms, p99 {:.1} ms (target <= 50), p99.9 {:.1} ms",
                b.mode,
                b.events as f64 / args.seconds,
                if b.mode == "steady" {
                    "default settings"
                } else {
                    "TTL 10 s, purge every 1 s"
                },
                b.p50_ms,
                b.p99_ms,
                b.p999_ms
            );
            if let (Some(max), Some(bound)) = (b.claims_max, b.claims_bound) {
                println!(
                    "        claims table after warm-up: at most {max} rows, bound 1.1 x rate x (TTL + interval) = {bound:.0}{}",
                    if b.exceeds_claims_bound() {
                        " EXCEEDED"
                    } else {
                        ""
                    }
                );
            }
        }
    }
    let wrong: Vec<_> = reports
        .iter()
        .filter(|r| r.applied_rows != r.expected_rows)
        .collect();
    let unbounded: Vec<_> = reports
        .iter()
        .filter(|r| r.exceeds_claims_bound())
        .collect();
    for r in &unbounded {
        println!(
            "UNBOUNDED CLAIMS TABLE in {}: {:?} rows, bound {:?}",
            r.mode, r.claims_max, r.claims_bound
        );
    }
    for r in &wrong {
        println!(
            "WRONG END STATE in {}: {} effect rows (records in the topic for outbox modes), expected {}",
            r.mode, r.applied_rows, r.expected_rows
        );
    }
    if !wrong.is_empty() || !unbounded.is_empty() {
        std::process::exit(1);
    }
    println!("end state checked: every mode applied exactly the effects it should");
    Ok(())
}
