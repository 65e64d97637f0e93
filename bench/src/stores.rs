//! `--stores`: the claim path of each SQL store, without Kafka. Per store,
//! the same events in transactions of 500 (`--per-tx` to change it; the
//! database runtime's batches are hundreds): `claims` takes the batch's
//! claims with `claim_many` and writes, with a plain insert, an effect row
//! for each event it claimed (a duplicate let through fails the run);
//! `effects` writes every event's effect row, a duplicate's ignored by the
//! effect table's key, as a consumer without dedup would rely on. Each run
//! starts on a new, empty database (a file for SQLite); the rounds
//! alternate store and mode. Printed per store: events/s (median,
//! min-max), the claims/effects ratio round by round, and what each run
//! wrote to its log per event: PostgreSQL's WAL (the insert position) and
//! InnoDB's redo log (`Innodb_os_log_written`), both server-wide, so
//! anything else the server runs meanwhile counts too; for SQLite, which
//! runs in this process, the bytes this process wrote (its WAL and the
//! checkpoints into the database file).

use std::collections::HashSet;
use std::future::Future;
use std::time::Instant;

use dedup_core::{Claim, DedupKey, DedupStore, Ttl};
use dedup_mysql::{MySqlStore, MySqlTx};
use dedup_postgres::{PgStore, PgTx};
use dedup_sqlite::{SqliteStore, SqliteTx};

use crate::{Args, BoxError, median};

const SCOPE: &str = "bench::stores";
const STORES: [&str; 3] = ["postgres", "mysql", "sqlite"];
const MODES: [&str; 2] = ["claims", "effects"];

/// A store as this benchmark drives it: its effect statement and its log.
trait Measured: DedupStore {
    /// Writes one effect row per id: a plain insert, which a second row
    /// of an id fails (a claim that let a duplicate through), or with
    /// `ignore` one that skips ids already written (the consumer without
    /// dedup, relying on the effect's key). Nothing for no ids.
    fn effects<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        ids: &'a [&'a str],
        ignore: bool,
    ) -> impl Future<Output = Result<(), BoxError>> + Send + 'a;

    /// Bytes written to the store's log so far.
    fn logged(&self) -> impl Future<Output = Result<u64, BoxError>> + Send;

    /// The claims table (migrated) and the effect table, on a new database.
    fn prepare(&self) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// The effect rows.
    fn rows(&self) -> impl Future<Output = Result<i64, BoxError>> + Send;

    /// Closes the store's pool.
    fn close(&self) -> impl Future<Output = ()> + Send;
}

/// `prepare`, `rows` and `close` of a store with `migrate()` and `pool()`,
/// its effect table made by `$create`.
macro_rules! tables {
    ($create:literal) => {
        async fn prepare(&self) -> Result<(), BoxError> {
            self.migrate().await?;
            sqlx::query($create).execute(self.pool()).await?;
            Ok(())
        }

        async fn rows(&self) -> Result<i64, BoxError> {
            Ok(sqlx::query_scalar("SELECT count(*) FROM bench_effects")
                .fetch_one(self.pool())
                .await?)
        }

        async fn close(&self) {
            self.pool().close().await;
        }
    };
}

impl Measured for PgStore {
    tables!("CREATE TABLE bench_effects (event_id text PRIMARY KEY, amount int8)");

    async fn effects(&self, tx: &mut PgTx, ids: &[&str], ignore: bool) -> Result<(), BoxError> {
        const PLAIN: &str = "INSERT INTO bench_effects (event_id, amount) \
             SELECT id, 100 FROM unnest($1::text[]) AS u(id)";
        const IGNORING: &str = "INSERT INTO bench_effects (event_id, amount) \
             SELECT id, 100 FROM unnest($1::text[]) AS u(id) ON CONFLICT DO NOTHING";
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(if ignore { IGNORING } else { PLAIN })
            .bind(ids)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn logged(&self) -> Result<u64, BoxError> {
        let lsn: i64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::int8")
                .fetch_one(self.pool())
                .await?;
        Ok(u64::try_from(lsn)?)
    }
}

/// `effects` for a store that takes a batch's rows as one
/// `INSERT [<ignore>] ... VALUES (?, 100), ...` (each id a bind parameter).
macro_rules! bound_effects {
    ($tx:ty, $ignore:literal) => {
        async fn effects(&self, tx: &mut $tx, ids: &[&str], ignore: bool) -> Result<(), BoxError> {
            if ids.is_empty() {
                return Ok(());
            }
            let rows = vec!["(?, 100)"; ids.len()].join(", ");
            let verb = if ignore { $ignore } else { "" };
            let statement =
                format!("INSERT {verb} INTO bench_effects (event_id, amount) VALUES {rows}");
            let mut query = sqlx::query(sqlx::AssertSqlSafe(statement));
            for id in ids {
                query = query.bind(*id);
            }
            query.execute(&mut **tx).await?;
            Ok(())
        }
    };
}

impl Measured for MySqlStore {
    tables!("CREATE TABLE bench_effects (event_id varchar(64) PRIMARY KEY, amount bigint)");
    bound_effects!(MySqlTx, "IGNORE");

    async fn logged(&self) -> Result<u64, BoxError> {
        let (_, written): (String, String) =
            sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_os_log_written'")
                .fetch_one(self.pool())
                .await?;
        Ok(written.parse()?)
    }
}

impl Measured for SqliteStore {
    tables!("CREATE TABLE bench_effects (event_id text PRIMARY KEY, amount integer)");
    bound_effects!(SqliteTx, "OR IGNORE");

    /// This process's `wchar` (`/proc/self/io`): SQLite writes from here.
    /// The WAL is checkpointed first, so a run counts its own checkpoints
    /// whole, not the ones the pool's close would do.
    async fn logged(&self) -> Result<u64, BoxError> {
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(self.pool())
            .await?;
        let io = std::fs::read_to_string("/proc/self/io")?;
        io.lines()
            .find_map(|line| line.strip_prefix("wchar: "))
            .ok_or("no wchar in /proc/self/io")?
            .trim()
            .parse()
            .map_err(Into::into)
    }
}

/// The events: `evt-<n>`, every `1/duplicates`-th of them (from the
/// fourth batch on) instead a repeat of an event two batches back that
/// was not itself a repeat: committed before it comes again, never twice
/// in one transaction.
fn events(n: usize, duplicates: f64, per_tx: usize) -> Vec<String> {
    let every = if duplicates > 0.0 {
        ((1.0 / duplicates).round() as usize).max(2)
    } else {
        usize::MAX
    };
    let repeats = |i: usize| i % every == every - 1 && i >= 3 * per_tx;
    (0..n)
        .map(|i| {
            if repeats(i) {
                // The nearest original at or before two batches back.
                let back = (0..=i - 2 * per_tx)
                    .rev()
                    .find(|&j| !repeats(j))
                    .unwrap_or(0);
                format!("evt-{back}")
            } else {
                format!("evt-{i}")
            }
        })
        .collect()
}

/// The events of every run, with what each run checks against.
struct Workload {
    events: Vec<String>,
    keys: Vec<DedupKey>,
    /// Distinct events: the effect rows each run must end with.
    distinct: usize,
    per_tx: usize,
}

impl Workload {
    fn new(n: usize, duplicates: f64, per_tx: usize) -> Result<Self, BoxError> {
        let events = events(n, duplicates, per_tx);
        let keys = events
            .iter()
            .map(|id| DedupKey::new(SCOPE, id))
            .collect::<Result<_, _>>()?;
        let distinct = events.iter().collect::<HashSet<_>>().len();
        Ok(Workload {
            events,
            keys,
            distinct,
            per_tx,
        })
    }
}

/// One run's figures.
struct Run {
    store: &'static str,
    mode: &'static str,
    events_per_s: f64,
    logged_per_event: f64,
}

/// Runs `mode` over the workload on `store` (new and empty: prepared
/// here, closed after) and checks that each distinct event has its effect
/// row once.
async fn measure<S: Measured>(
    store: &S,
    name: &'static str,
    mode: &'static str,
    work: &Workload,
) -> Result<Run, BoxError> {
    store.prepare().await?;
    let run = run(store, name, mode, work).await;
    store.close().await;
    run
}

async fn run<S: Measured>(
    store: &S,
    name: &'static str,
    mode: &'static str,
    work: &Workload,
) -> Result<Run, BoxError> {
    let ttl = Ttl::from_secs(4 * 3600).ok_or("ttl")?;
    let Workload {
        events,
        keys,
        distinct,
        per_tx,
    } = work;
    let (distinct, per_tx) = (*distinct, *per_tx);
    let before = store.logged().await?;
    let started = Instant::now();
    let mut claimed = 0;
    for (chunk, ids) in keys.chunks(per_tx).zip(events.chunks(per_tx)) {
        let mut tx = store.begin().await?;
        if mode == "claims" {
            let claims = store.claim_many(&mut tx, chunk, &[], ttl).await?;
            let applied: Vec<&str> = claims
                .iter()
                .zip(ids)
                .filter(|(claim, _)| matches!(claim, Claim::Fresh | Claim::Reclaimed))
                .map(|(_, id)| id.as_str())
                .collect();
            claimed += applied.len();
            store.effects(&mut tx, &applied, false).await?;
        } else {
            let all: Vec<&str> = ids.iter().map(String::as_str).collect();
            store.effects(&mut tx, &all, true).await?;
        }
        store.commit(tx).await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let logged = store.logged().await? - before;
    let rows = store.rows().await?;
    if rows != i64::try_from(distinct)? || (mode == "claims" && claimed != distinct) {
        return Err(format!(
            "{name} {mode}: {rows} effect rows and {claimed} claims for {distinct} events"
        )
        .into());
    }
    Ok(Run {
        store: name,
        mode,
        events_per_s: events.len() as f64 / seconds,
        logged_per_event: logged as f64 / events.len() as f64,
    })
}

/// `url` with its database (the path) replaced by `database`; `url` must
/// name one (`scheme://host/db`).
fn with_database(url: &str, database: &str) -> Result<String, BoxError> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let (_, rest) = base.split_once("://").ok_or("a URL: scheme://host/db")?;
    let (host, _) = rest.split_once('/').ok_or("a URL that names a database")?;
    let scheme = &base[..base.len() - rest.len()];
    Ok(format!("{scheme}{host}/{database}{query}"))
}

/// A new database on the server of `url` (PostgreSQL or MySQL), dropped
/// first if a run before left it.
async fn fresh_database(store: &str, url: &str, name: &'static str) -> Result<String, BoxError> {
    if store == "postgres" {
        let admin = sqlx::PgPool::connect(url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&admin)
        .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await?;
        admin.close().await;
    } else {
        let admin = sqlx::MySqlPool::connect(url).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name}; CREATE DATABASE {name}"
        )))
        .execute(&admin)
        .await?;
        admin.close().await;
    }
    with_database(url, name)
}

/// One run of `mode` on a new database of `store`.
async fn one(store: &'static str, mode: &'static str, work: &Workload) -> Result<Run, BoxError> {
    let name = "dedup_bench_stores";
    match store {
        "postgres" => {
            let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL must be set")?;
            let url = fresh_database(store, &url, name).await?;
            measure(&PgStore::connect(&url).await?, store, mode, work).await
        }
        "mysql" => {
            let url = std::env::var("MYSQL_URL").map_err(|_| "MYSQL_URL must be set")?;
            let url = fresh_database(store, &url, name).await?;
            measure(&MySqlStore::connect(&url).await?, store, mode, work).await
        }
        _ => {
            let dir = std::env::temp_dir().join("dedup-bench-stores");
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            let s = SqliteStore::open(dir.join("claims.db")).await?;
            let run = measure(&s, store, mode, work).await;
            let _ = std::fs::remove_dir_all(&dir);
            run
        }
    }
}

/// `dedup-bench --stores`: see the module's doc.
pub(crate) async fn run_all(args: &Args) -> Result<(), BoxError> {
    // The outbox modes' default of 10 events a transaction is a service's
    // request; the database runtime claims batches of hundreds.
    let per_tx = if args.per_tx_given { args.per_tx } else { 500 };
    let n = if args.quick { 200_000 } else { args.events };
    let work = Workload::new(n, args.duplicates, per_tx)?;
    let distinct = work.distinct;
    let stores: Vec<&'static str> = match &args.modes {
        Some(modes) => {
            if let Some(unknown) = modes.iter().find(|m| !STORES.contains(&m.as_str())) {
                return Err(format!("--stores --modes: {unknown} is none of {STORES:?}").into());
            }
            STORES
                .into_iter()
                .filter(|s| modes.iter().any(|m| m == s))
                .collect()
        }
        None => STORES.to_vec(),
    };
    println!(
        "dedup-bench --stores: {n} events ({:.1}% duplicates) in transactions of {per_tx}; \
         {} interleaved round(s) of {}, the modes' order alternating",
        100.0 * (n - distinct) as f64 / n as f64,
        args.repeats,
        stores.join(", ")
    );
    let mut runs = Vec::new();
    for round in 1..=args.repeats.max(1) {
        for &store in &stores {
            let mut modes = MODES;
            if round % 2 == 0 {
                modes.reverse();
            }
            for mode in modes {
                let run = one(store, mode, &work).await?;
                eprintln!(
                    "  round {round}: {store} {mode}: {:.0} events/s, {:.0} log bytes an event",
                    run.events_per_s, run.logged_per_event
                );
                runs.push(run);
            }
        }
    }
    println!("store      mode      events/s (median)   min-max           log bytes/event");
    for &store in &stores {
        for mode in MODES {
            let of: Vec<&Run> = runs
                .iter()
                .filter(|r| r.store == store && r.mode == mode)
                .collect();
            let rates: Vec<f64> = of.iter().map(|r| r.events_per_s).collect();
            let (lo, hi) = rates
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
            println!(
                "{store:<10} {mode:<9} {:>17.0}   {lo:>7.0}-{hi:<7.0}   {:>8.0}",
                median(rates.clone()),
                median(of.iter().map(|r| r.logged_per_event).collect())
            );
        }
        let pairs: Vec<(f64, f64)> = runs
            .iter()
            .filter(|r| r.store == store && r.mode == "claims")
            .zip(
                runs.iter()
                    .filter(|r| r.store == store && r.mode == "effects"),
            )
            .map(|(c, e)| {
                (
                    c.events_per_s / e.events_per_s,
                    c.logged_per_event / e.logged_per_event,
                )
            })
            .collect();
        let rate: Vec<f64> = pairs.iter().map(|p| p.0).collect();
        let (lo, hi) = rate
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        println!(
            "  {store}: claims/effects {:.2}x (min-max {lo:.2}-{hi:.2}, {} rounds); \
             log bytes {:.2}x",
            median(rate),
            pairs.len(),
            median(pairs.iter().map(|p| p.1).collect())
        );
    }
    Ok(())
}
