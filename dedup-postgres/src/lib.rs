#![doc = include_str!("../README.md")]

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dedup_core::{
    Claim, Classification, DedupKey, DedupStore, PurgeConfig, PurgeExpired, Purger, StoreError, Ttl,
};
use dedup_sql::{
    BatchClaims, Dialect, SqlConfig, TableName, age_from_micros, run_migrations, sql,
    time_from_unix_micros, ttl_seconds,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};

pub use dedup_sql::{Error, InvalidTableName};

mod outbox;
pub use outbox::{OutboxConfig, OutboxReader, OutboxWriter, PgLease, Retention, enqueue};

/// The sqlx this backend is built on, so handlers can use the same version.
pub use sqlx;

/// The transaction a handler body writes its effect through:
/// `sqlx::query(...).execute(&mut **tx)`.
pub type PgTx = sqlx::Transaction<'static, sqlx::Postgres>;

/// The migrations, embedded at build time. Their SQL names the table through
/// placeholders that [`PgStore::migrate`] fills with the configured name.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// PostgreSQL as the shared SQL layer sees it: whose fault each SQLSTATE is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pg;

impl Dialect for Pg {
    const NAME: &'static str = "postgres";
    const DEFAULT_MAX_CONNECTIONS: u32 = 10;

    /// The event's data (permanent): a data exception (class `22`, such as
    /// `22P02` invalid text) or an integrity violation (class `23`, such as
    /// a unique violation) raised by the handler's statements.
    ///
    /// The environment's, waited out however long it lasts (an allow-list:
    /// a code here must be one no event can cause): a connection exception
    /// (`08`), a read-only standby (`25006`), an authorization failure such
    /// as a rotated password (`28`), a missing database (`3D000`), a dropped
    /// table (`42P01`) or revoked grant (`42501`), insufficient resources
    /// such as a full disk or memory (`53`), operator intervention such as a
    /// statement timeout or a shutdown (`57`), a system or I/O error (`58`),
    /// an internal error (`XX`).
    ///
    /// Everything else (contention: serialization failure and deadlock in
    /// class `40`, a lock timeout `55P03`; and any code not listed, such as
    /// a trigger's `RAISE EXCEPTION`) is transient: retried a bounded number
    /// of times, then dead-lettered, so that no event stalls its partition
    /// for good.
    fn classify_code(code: &str) -> Classification {
        match code.get(..2) {
            Some("22" | "23") => Classification::Permanent,
            Some("08" | "28" | "53" | "57" | "58" | "XX") => Classification::Environment,
            _ if matches!(code, "25006" | "3D000" | "42P01" | "42501") => {
                Classification::Environment
            }
            _ => Classification::Transient,
        }
    }
}

/// Settings of a [`PgStore`]: the table (default `dedup_claims`), the lock
/// timeout (5 s, applied as `SET LOCAL lock_timeout` in every transaction),
/// the pool size (10).
pub type PgConfig = SqlConfig<Pg>;

/// The statements of one store, built once from its table name.
struct Statements {
    table: TableName,
    lock_timeout: Duration,
    begin: Arc<str>,
    claim: Arc<str>,
    claim_many: Arc<str>,
    expiry: Arc<str>,
    expiry_many: Arc<str>,
    refresh: Arc<str>,
    live_ids: Arc<str>,
    purge: Arc<str>,
}

/// Expiry as microseconds since the Unix epoch, so no date-time crate is
/// needed to read it.
const EXPIRES_MICROS: &str = "(extract(epoch FROM expires_at) * 1000000)::int8";

/// A claim's age (since it was taken or refreshed) in microseconds, on the
/// database clock.
const AGE_MICROS: &str = "(extract(epoch FROM now() - claimed_at) * 1000000)::int8";

impl Statements {
    fn new(config: &PgConfig) -> Result<Self, InvalidTableName> {
        let table = TableName::parse(&config.table)?;
        let t = table.quoted();
        let lock_ms = config.lock_timeout_ms();
        // One simple-protocol message: BEGIN and the lock bound in one round trip.
        let begin = format!("BEGIN; SET LOCAL lock_timeout = {lock_ms}");
        // The claim: create if absent, take over if expired, else no row.
        // `xmax = 0` is true only for a freshly inserted row version.
        let upsert = "ON CONFLICT (scope, key) DO UPDATE \
             SET claimed_at = EXCLUDED.claimed_at, expires_at = EXCLUDED.expires_at \
             WHERE c.expires_at <= now()";
        let claim = format!(
            "INSERT INTO {t} AS c (scope, key, claimed_at, expires_at) \
             VALUES ($1, $2, now(), now() + $3 * interval '1 second') {upsert} \
             RETURNING (c.xmax = 0) AS fresh"
        );
        // Sorted so that concurrent batches lock rows in one order and cannot
        // deadlock each other.
        let claim_many = format!(
            "INSERT INTO {t} AS c (scope, key, claimed_at, expires_at) \
             SELECT u.scope, u.key, now(), now() + $3 * interval '1 second' \
             FROM unnest($1::text[], $2::text[]) AS u(scope, key) \
             ORDER BY u.scope, u.key {upsert} \
             RETURNING c.scope, c.key, (c.xmax = 0) AS fresh, {EXPIRES_MICROS} AS expires_us"
        );
        let expiry =
            format!("SELECT {EXPIRES_MICROS}, {AGE_MICROS} FROM {t} WHERE scope = $1 AND key = $2");
        let expiry_many = format!(
            "SELECT scope, key, {EXPIRES_MICROS} AS expires_us, {AGE_MICROS} AS age_us FROM {t} \
             WHERE (scope, key) IN (SELECT * FROM unnest($1::text[], $2::text[]))"
        );
        // clock_timestamp(), not now(): now() is the transaction's start,
        // which is what a long transaction must not count from.
        let refresh = format!(
            "UPDATE {t} SET expires_at = clock_timestamp() + $3 * interval '1 second' \
             WHERE (scope, key) IN (SELECT * FROM unnest($1::text[], $2::text[]))"
        );
        let live_ids = format!(
            "SELECT key FROM {t} WHERE scope = $1 AND key >= $2 AND expires_at > now() ORDER BY key"
        );
        // Bounded, oldest first, skipping rows a running claim holds. The
        // batch is locked and deleted by the rows' addresses (`ctid`: a
        // locked version cannot be updated, pruned or moved). What is
        // deleted is a version this statement both sees and locked, which
        // passed `expires_at <= now()`: a claim taken over or refreshed
        // since the statement began is a newer version, which the lock's
        // re-check skips (its expiry lies ahead) or the delete cannot see.
        // No other condition is left for the planner to prefer to the
        // addresses: a join back on (scope, key) was a hash join over the
        // whole table under a generic plan, and a re-check of the expiry
        // here was planned, from statistics that thought nothing expired,
        // as a walk of the expiry index over every expired claim per batch
        // (tests/purge.rs).
        let purge = format!(
            "DELETE FROM {t} WHERE ctid = ANY(ARRAY( \
                 SELECT ctid FROM {t} WHERE expires_at <= now() \
                 ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))"
        );
        Ok(Statements {
            table,
            lock_timeout: config.lock_timeout,
            begin: begin.into(),
            claim: claim.into(),
            claim_many: claim_many.into(),
            expiry: expiry.into(),
            expiry_many: expiry_many.into(),
            refresh: refresh.into(),
            live_ids: live_ids.into(),
            purge: purge.into(),
        })
    }
}

/// A [`DedupStore`] on PostgreSQL.
///
/// Claims are one `INSERT ... ON CONFLICT ... DO UPDATE ... WHERE expired
/// RETURNING` statement inside the handler's transaction, timed by the
/// database's `now()`. Cloning is cheap and shares the pool.
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    statements: Arc<Statements>,
}

impl fmt::Debug for PgStore {
    // The pool's options hold the password; show only what is safe.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.statements.table.to_string())
            .field("lock_timeout", &self.statements.lock_timeout)
            .field("pool_size", &self.pool.size())
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// Connects with default settings (`dedup_claims`, 5 s lock timeout,
    /// up to 10 connections).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::connect_with(url, PgConfig::default()).await
    }

    /// Connects with `config`.
    pub async fn connect_with(url: &str, config: PgConfig) -> Result<Self, Error> {
        let statements = Statements::new(&config)?;
        let options: PgConnectOptions = url.parse().map_err(Error::database::<Pg>)?;
        let pool = PgPoolOptions::new()
            .max_connections(config.pool_size())
            .connect_with(options)
            .await
            .map_err(Error::database::<Pg>)?;
        Ok(PgStore {
            pool,
            statements: Arc::new(statements),
        })
    }

    /// Uses an existing pool with default settings.
    pub fn from_pool(pool: PgPool) -> Self {
        Self::from_pool_with(pool, PgConfig::default()).expect("the default table name is valid")
    }

    /// Uses an existing pool with `config`.
    pub fn from_pool_with(pool: PgPool, config: PgConfig) -> Result<Self, Error> {
        Ok(PgStore {
            pool,
            statements: Arc::new(Statements::new(&config)?),
        })
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates or upgrades the dedup table. Safe to call from every instance
    /// at start-up: runs under an advisory lock, in a transaction, and does
    /// nothing when up to date. Applied versions are tracked in
    /// `<table>_migrations`, so stores with different tables in one database
    /// migrate independently.
    pub async fn migrate(&self) -> Result<(), Error> {
        run_migrations(&self.pool, &MIGRATOR, &self.statements.table)
            .await
            .map_err(Error::migrate::<Pg>)
    }

    /// Starts deleting expired claims in the background (see
    /// [`PurgeConfig`]); stop it with [`Purger::stop`].
    pub fn spawn_purger(&self, config: PurgeConfig) -> Purger {
        Purger::spawn(self.clone(), config)
    }
}

fn store_error(e: sqlx::Error) -> StoreError {
    dedup_sql::store_error::<Pg>(e)
}

impl DedupStore for PgStore {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, StoreError> {
        self.pool
            .begin_with(sql(&self.statements.begin))
            .await
            .map_err(store_error)
    }

    async fn claim(&self, tx: &mut PgTx, key: &DedupKey, ttl: Ttl) -> Result<Claim, StoreError> {
        let row = sqlx::query(sql(&self.statements.claim))
            .bind(key.scope())
            .bind(key.id())
            .bind(ttl_seconds(ttl))
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        if let Some(row) = row {
            let fresh: bool = row.try_get(0).map_err(store_error)?;
            return Ok(if fresh {
                Claim::Fresh
            } else {
                Claim::Reclaimed
            });
        }
        // A live claim exists. Read its expiry in a new statement: in READ
        // COMMITTED it sees a claim that committed while the INSERT waited.
        let row: Option<(i64, i64)> = sqlx::query_as(sql(&self.statements.expiry))
            .bind(key.scope())
            .bind(key.id())
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        // No row: it vanished in between (purged at its expiry).
        let (expires_us, age_us) = row.unwrap_or_default();
        Ok(Claim::Duplicate {
            expires_at: row.map_or_else(SystemTime::now, |_| time_from_unix_micros(expires_us)),
            age: age_from_micros(age_us),
        })
    }

    async fn claim_many(
        &self,
        tx: &mut PgTx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<Vec<Claim>, StoreError> {
        let mut batch = BatchClaims::new(keys);
        if batch.distinct().is_empty() {
            return Ok(Vec::new());
        }
        let (scopes, ids): (Vec<&str>, Vec<&str>) =
            batch.distinct().iter().map(|k| (k.scope(), k.id())).unzip();
        let rows = sqlx::query(sql(&self.statements.claim_many))
            .bind(&scopes)
            .bind(&ids)
            .bind(ttl_seconds(ttl))
            .fetch_all(&mut **tx)
            .await
            .map_err(store_error)?;
        for row in rows {
            let (scope, id, fresh, expires_us): (String, String, bool, i64) =
                sqlx::FromRow::from_row(&row).map_err(store_error)?;
            batch.claimed(&scope, &id, fresh, time_from_unix_micros(expires_us));
        }
        // Keys with no row returned hold live claims: read their expiry in a
        // new statement, which sees claims that committed while we waited.
        let unclaimed = batch.unclaimed();
        if !unclaimed.is_empty() {
            let (scopes, ids): (Vec<&str>, Vec<&str>) =
                unclaimed.iter().map(|k| (k.scope(), k.id())).unzip();
            let rows = sqlx::query(sql(&self.statements.expiry_many))
                .bind(&scopes)
                .bind(&ids)
                .fetch_all(&mut **tx)
                .await
                .map_err(store_error)?;
            for row in rows {
                let (scope, id, expires_us, age_us): (String, String, i64, i64) =
                    sqlx::FromRow::from_row(&row).map_err(store_error)?;
                batch.live(
                    &scope,
                    &id,
                    time_from_unix_micros(expires_us),
                    age_from_micros(age_us),
                );
            }
        }
        Ok(batch.finish())
    }

    async fn refresh_claims(
        &self,
        tx: &mut PgTx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        let (scopes, ids): (Vec<&str>, Vec<&str>) =
            keys.iter().map(|k| (k.scope(), k.id())).unzip();
        sqlx::query(sql(&self.statements.refresh))
            .bind(&scopes)
            .bind(&ids)
            .bind(ttl_seconds(ttl))
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(sql(&self.statements.live_ids))
            .bind(from.scope())
            .bind(from.id())
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)
    }

    fn connections(&self) -> Option<usize> {
        Some(self.pool.options().get_max_connections() as usize)
    }

    async fn commit(&self, tx: PgTx) -> Result<(), StoreError> {
        tx.commit().await.map_err(store_error)
    }

    async fn rollback(&self, tx: PgTx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(store_error)
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Classification {
        dedup_sql::classify::<Pg>(error)
    }

    fn error_code(&self, error: &(dyn StdError + 'static)) -> Option<String> {
        dedup_sql::error_code::<Pg>(error)
    }
}

impl PurgeExpired for PgStore {
    async fn purge_expired(&self, limit: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(sql(&self.statements.purge))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }
}
