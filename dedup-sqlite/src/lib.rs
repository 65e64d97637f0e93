#![doc = include_str!("../README.md")]

use std::error::Error as StdError;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dedup_core::{
    Acquire, Claim, Classification, DedupKey, DedupStore, Fingerprint, LeaseStore, PurgeConfig,
    PurgeExpired, Purger, StoreError, Token, Ttl,
};
use dedup_sql::{
    BatchClaims, ClaimStatements, Dialect, LeaseRow, SqlConfig, StoreHandle, TableName, Taken,
    age_from_micros, fingerprint_from, held_or_done, live_claim, sql, time_from_unix_micros,
    ttl_seconds,
};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};

pub use dedup_sql::{Error, InvalidTableName, OutboxConfig, SqlLease};

pub mod admin;
mod outbox;
pub use dedup_core::outbox::Retention;
pub use outbox::{OutboxReader, OutboxWriter, enqueue};

/// The sqlx this backend is built on, so handlers can use the same version.
pub use sqlx;

/// The transaction a handler body writes its effect through:
/// `sqlx::query(...).execute(&mut **tx)`.
pub type SqliteTx = sqlx::Transaction<'static, sqlx::Sqlite>;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// SQLite as the shared SQL layer sees it: which result codes a retry can
/// get past.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sqlite;

impl Dialect for Sqlite {
    const NAME: &'static str = "sqlite";
    const DEFAULT_MAX_CONNECTIONS: u32 = 4;

    /// By primary result code (extended codes included). The event's data
    /// (permanent): `SQLITE_TOOBIG` (18), `SQLITE_CONSTRAINT` (19),
    /// `SQLITE_MISMATCH` (20), `SQLITE_RANGE` (25). The environment's,
    /// waited out: `SQLITE_PERM` (3), `SQLITE_NOMEM` (7), `SQLITE_READONLY`
    /// (8), `SQLITE_IOERR` (10), `SQLITE_CORRUPT` (11), `SQLITE_FULL` (13),
    /// `SQLITE_CANTOPEN` (14), `SQLITE_AUTH` (23), `SQLITE_NOTADB` (26).
    /// Contention, retried as long as it lasts: `SQLITE_BUSY` (5, the write
    /// lock held past the busy timeout), `SQLITE_LOCKED` (6).
    /// Everything else, the generic `SQLITE_ERROR` (1: a missing table, but
    /// also malformed JSON in the event) included, is transient: retried a
    /// bounded number of times, then dead-lettered.
    fn classify_code(code: &str) -> Classification {
        match code.parse::<i32>().map(|code| code & 0xff) {
            Ok(18 | 19 | 20 | 25) => Classification::Permanent,
            Ok(5 | 6) => Classification::Contention,
            Ok(3 | 7 | 8 | 10 | 11 | 13 | 14 | 23 | 26) => Classification::Environment,
            _ => Classification::Transient,
        }
    }

    fn code_label(code: &str) -> String {
        format!("SQLITE_{code}")
    }
}

/// Settings of a [`SqliteStore`]: the table (default `dedup_claims`), the
/// lock timeout (5 s: how long a transaction waits for the database's write
/// lock, SQLite's busy timeout), the pool size (4; writers still take turns).
pub type SqliteConfig = SqlConfig<Sqlite>;

/// SQLite's clock, in microseconds since the Unix epoch (millisecond
/// resolution). `'now'` is fixed for the duration of one statement.
pub(crate) const NOW_US: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";

struct Statements {
    table: TableName,
    claim: Arc<str>,
    claim_many: Arc<str>,
    expiry: Arc<str>,
    expiry_many: Arc<str>,
    refresh: Arc<str>,
    live_ids: Arc<str>,
    purge: Arc<str>,
    lease: LeaseStatements,
}

/// Lease mode's statements.
struct LeaseStatements {
    next_token: Arc<str>,
    acquire: Arc<str>,
    state: Arc<str>,
    extend: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
}

impl ClaimStatements for Statements {
    type Dialect = Sqlite;

    fn table(&self) -> &TableName {
        &self.table
    }

    fn new(config: &SqliteConfig) -> Result<Self, InvalidTableName> {
        let table = TableName::parse_unqualified(&config.table)?;
        let t = table.quoted();
        let tokens = table.quoted_with_suffix("_tokens");
        let upsert = format!(
            "ON CONFLICT (scope, key) DO UPDATE SET claimed_at = excluded.claimed_at, \
             expires_at = excluded.expires_at, fingerprint = excluded.fingerprint, \
             token = NULL, in_progress = 0, claims = c.claims + 1 \
             WHERE c.expires_at <= {NOW_US}"
        );
        // The claim: create if absent, take over if expired, else no row.
        let claim = format!(
            "INSERT INTO {t} AS c (scope, key, claimed_at, expires_at, fingerprint) \
             VALUES (?1, ?2, {NOW_US}, {NOW_US} + ?3 * 1000000, ?4) {upsert} \
             RETURNING claims"
        );
        // All keys of a batch in one statement, from a JSON array of
        // [scope, key, fingerprint as hex or null] (`WHERE true` resolves
        // SQLite's upsert parsing ambiguity after a SELECT).
        let claim_many = format!(
            "INSERT INTO {t} AS c (scope, key, claimed_at, expires_at, fingerprint) \
             SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), {NOW_US}, {NOW_US} + ?2 * 1000000, \
                 unhex(json_extract(value, '$[2]')) \
             FROM json_each(?1) WHERE true {upsert} \
             RETURNING scope, key, claims, expires_at"
        );
        let expiry = format!(
            "SELECT expires_at, {NOW_US} - claimed_at, fingerprint FROM {t} WHERE scope = ?1 AND key = ?2"
        );
        let expiry_many = format!(
            "SELECT scope, key, expires_at, {NOW_US} - claimed_at, fingerprint FROM {t} \
             WHERE (scope, key) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?1))"
        );
        let refresh = format!(
            "UPDATE {t} SET expires_at = {NOW_US} + ?2 * 1000000 \
             WHERE (scope, key) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?1))"
        );
        let live_ids = format!(
            "SELECT key FROM {t} WHERE scope = ?1 AND key >= ?2 AND expires_at > {NOW_US} ORDER BY key"
        );
        let purge = format!(
            "DELETE FROM {t} WHERE rowid IN \
             (SELECT rowid FROM {t} WHERE expires_at <= {NOW_US} AND in_progress = 0 \
                 ORDER BY expires_at LIMIT ?1)"
        );
        Ok(Statements {
            table,
            claim: claim.into(),
            claim_many: claim_many.into(),
            expiry: expiry.into(),
            expiry_many: expiry_many.into(),
            refresh: refresh.into(),
            live_ids: live_ids.into(),
            purge: purge.into(),
            lease: LeaseStatements::new(&t, &tokens),
        })
    }
}

impl LeaseStatements {
    fn new(t: &str, tokens: &str) -> Self {
        let acquire = format!(
            "INSERT INTO {t} AS c \
                 (scope, key, claimed_at, expires_at, fingerprint, token, in_progress) \
             VALUES (?1, ?2, {NOW_US}, {NOW_US} + ?3 * 1000000, ?4, ?5, 1) \
             ON CONFLICT (scope, key) DO UPDATE SET claimed_at = excluded.claimed_at, \
                 expires_at = excluded.expires_at, fingerprint = excluded.fingerprint, \
                 token = excluded.token, in_progress = 1, claims = c.claims + 1 \
             WHERE c.expires_at <= {NOW_US} \
             RETURNING claims"
        );
        let held = "WHERE scope = ?1 AND key = ?2 AND token = ?3 AND in_progress = 1";
        LeaseStatements {
            next_token: format!("UPDATE {tokens} SET last = last + 1 RETURNING last").into(),
            acquire: acquire.into(),
            state: format!(
                "SELECT in_progress, coalesce(token, 0), expires_at, {NOW_US} - claimed_at, \
                     fingerprint FROM {t} WHERE scope = ?1 AND key = ?2"
            )
            .into(),
            extend: format!(
                "UPDATE {t} SET expires_at = {NOW_US} + ?4 * 1000000 {held} RETURNING expires_at"
            )
            .into(),
            complete: format!(
                "UPDATE {t} SET expires_at = {NOW_US} + ?4 * 1000000, in_progress = 0 {held}"
            )
            .into(),
            release: format!("DELETE FROM {t} {held}").into(),
        }
    }
}

/// A [`DedupStore`] on an SQLite database file.
///
/// Claims use the same one-statement upsert as PostgreSQL, on SQLite's
/// clock. Transactions begin with `BEGIN IMMEDIATE`: they take the write lock
/// up front, so a second claimer waits for the first (up to the lock
/// timeout, then a retryable error) exactly as the claim contract asks.
#[derive(Clone)]
pub struct SqliteStore {
    handle: StoreHandle<sqlx::Sqlite, Statements>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.handle.statements().table.to_string())
            .field("pool_size", &self.handle.pool().size())
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path`.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::open_with(path, SqliteConfig::default()).await
    }

    /// Opens the database file at `path` with `config`: WAL journal, the
    /// lock timeout as SQLite's busy timeout.
    pub async fn open_with(path: impl AsRef<Path>, config: SqliteConfig) -> Result<Self, Error> {
        // A bad table name is refused before the file system is touched.
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_millis(config.lock_timeout_ms().into()));
        let handle = StoreHandle::connect_with(options, &config).await?;
        Ok(SqliteStore { handle })
    }

    /// Uses an existing pool with `config`.
    pub fn from_pool_with(pool: SqlitePool, config: SqliteConfig) -> Result<Self, Error> {
        let handle = StoreHandle::from_pool(pool, &config)?;
        Ok(SqliteStore { handle })
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        self.handle.pool()
    }

    /// The outbox with default settings (table `dedup_outbox`) over this
    /// store's pool: the relay's [`OutboxSource`](dedup_core::outbox::OutboxSource).
    pub fn outbox_reader(&self) -> OutboxReader {
        outbox::DEFAULT_OUTBOX.reader(self.pool().clone())
    }

    /// Creates or upgrades the dedup table (tracked in
    /// `<table>_migrations`); safe to call at every start.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.handle.migrate(&MIGRATOR).await
    }

    /// Starts deleting expired claims in the background.
    pub fn spawn_purger(&self, config: PurgeConfig) -> Purger {
        Purger::spawn(self.clone(), config)
    }
}

fn store_error(e: sqlx::Error) -> StoreError {
    dedup_sql::store_error::<Sqlite>(e)
}

/// `[[scope, key], ...]` as a JSON text parameter.
fn json_pairs<'a>(keys: impl Iterator<Item = &'a DedupKey>) -> String {
    serde_json::Value::Array(
        keys.map(|k| serde_json::json!([k.scope(), k.id()]))
            .collect(),
    )
    .to_string()
}

/// A batch's distinct keys as `[scope, key, fingerprint as hex or null]`.
fn json_claims(batch: &BatchClaims<'_>) -> String {
    serde_json::Value::Array(
        batch
            .distinct()
            .iter()
            .map(|k| {
                let fingerprint = batch.fingerprint(k).map(|f| f.to_string());
                serde_json::json!([k.scope(), k.id(), fingerprint])
            })
            .collect(),
    )
    .to_string()
}

impl DedupStore for SqliteStore {
    type Tx = SqliteTx;

    async fn begin(&self) -> Result<SqliteTx, StoreError> {
        // The write lock up front: claimers queue here, in order.
        self.handle
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(store_error)
    }

    async fn claim(
        &self,
        tx: &mut SqliteTx,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        ttl: Ttl,
    ) -> Result<Claim, StoreError> {
        let claims: Option<i64> = sqlx::query_scalar(sql(&self.handle.statements().claim))
            .bind(key.scope())
            .bind(key.id())
            .bind(ttl_seconds(ttl))
            .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        match claims {
            Some(1) => Ok(Claim::Fresh),
            Some(_) => Ok(Claim::Reclaimed),
            None => {
                let row: Option<(i64, i64, Option<Vec<u8>>)> =
                    sqlx::query_as(sql(&self.handle.statements().expiry))
                        .bind(key.scope())
                        .bind(key.id())
                        .fetch_optional(&mut **tx)
                        .await
                        .map_err(store_error)?;
                Ok(live_claim(row))
            }
        }
    }

    async fn claim_many(
        &self,
        tx: &mut SqliteTx,
        keys: &[DedupKey],
        fingerprints: &[Option<Fingerprint>],
        ttl: Ttl,
    ) -> Result<Vec<Claim>, StoreError> {
        let mut batch = BatchClaims::new(keys, fingerprints);
        if batch.distinct().is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(sql(&self.handle.statements().claim_many))
            .bind(json_claims(&batch))
            .bind(ttl_seconds(ttl))
            .fetch_all(&mut **tx)
            .await
            .map_err(store_error)?;
        for row in rows {
            let (scope, id, claims, expires_us): (String, String, i64, i64) =
                sqlx::FromRow::from_row(&row).map_err(store_error)?;
            let taken = if claims == 1 {
                Taken::Fresh
            } else {
                Taken::Reclaimed
            };
            batch.claimed(&scope, &id, taken, time_from_unix_micros(expires_us));
        }
        let unclaimed = batch.unclaimed();
        if !unclaimed.is_empty() {
            let rows = sqlx::query(sql(&self.handle.statements().expiry_many))
                .bind(json_pairs(unclaimed.into_iter()))
                .fetch_all(&mut **tx)
                .await
                .map_err(store_error)?;
            for row in rows {
                let (scope, id, expires_us, age_us, kept): (
                    String,
                    String,
                    i64,
                    i64,
                    Option<Vec<u8>>,
                ) = sqlx::FromRow::from_row(&row).map_err(store_error)?;
                batch.live(
                    &scope,
                    &id,
                    time_from_unix_micros(expires_us),
                    age_from_micros(age_us),
                    fingerprint_from(kept),
                );
            }
        }
        Ok(batch.finish())
    }

    async fn refresh_claims(
        &self,
        tx: &mut SqliteTx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        sqlx::query(sql(&self.handle.statements().refresh))
            .bind(json_pairs(keys.iter()))
            .bind(ttl_seconds(ttl))
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(sql(&self.handle.statements().live_ids))
            .bind(from.scope())
            .bind(from.id())
            .fetch_all(self.handle.pool())
            .await
            .map_err(store_error)
    }

    fn connections(&self) -> Option<usize> {
        Some(self.handle.pool().options().get_max_connections() as usize)
    }

    async fn commit(&self, tx: SqliteTx) -> Result<(), StoreError> {
        tx.commit().await.map_err(store_error)
    }

    async fn rollback(&self, tx: SqliteTx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(store_error)
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Classification {
        dedup_sql::classify::<Sqlite>(error)
    }

    fn error_code(&self, error: &(dyn StdError + 'static)) -> Option<String> {
        dedup_sql::error_code::<Sqlite>(error)
    }
}

/// A token as SQLite's INTEGER holds it (the counter starts at 1).
fn token_param(token: Token) -> i64 {
    i64::try_from(token).unwrap_or(i64::MAX)
}

impl LeaseStore for SqliteStore {
    async fn acquire(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        lease: Ttl,
    ) -> Result<Acquire, StoreError> {
        let statements = &self.handle.statements().lease;
        // One write transaction: the counter moves only with a lease taken.
        let mut tx = self.begin().await?;
        let token: i64 = sqlx::query_scalar(sql(&statements.next_token))
            .fetch_one(&mut *tx)
            .await
            .map_err(store_error)?;
        let taken: Option<i64> = sqlx::query_scalar(sql(&statements.acquire))
            .bind(key.scope())
            .bind(key.id())
            .bind(ttl_seconds(lease))
            .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(token)
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
        if let Some(claims) = taken {
            tx.commit().await.map_err(store_error)?;
            return Ok(Acquire::Acquired {
                token: token.unsigned_abs(),
                reclaimed: claims > 1,
            });
        }
        let row: LeaseRow = sqlx::query_as(sql(&statements.state))
            .bind(key.scope())
            .bind(key.id())
            .fetch_one(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.rollback().await.map_err(store_error)?;
        Ok(held_or_done(row))
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: Token,
        lease: Ttl,
    ) -> Result<Option<SystemTime>, StoreError> {
        let expires: Option<i64> = sqlx::query_scalar(sql(&self.handle.statements().lease.extend))
            .bind(key.scope())
            .bind(key.id())
            .bind(token_param(token))
            .bind(ttl_seconds(lease))
            .fetch_optional(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(expires.map(time_from_unix_micros))
    }

    async fn complete(&self, key: &DedupKey, token: Token, ttl: Ttl) -> Result<bool, StoreError> {
        let done = sqlx::query(sql(&self.handle.statements().lease.complete))
            .bind(key.scope())
            .bind(key.id())
            .bind(token_param(token))
            .bind(ttl_seconds(ttl))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &DedupKey, token: Token) -> Result<bool, StoreError> {
        let released = sqlx::query(sql(&self.handle.statements().lease.release))
            .bind(key.scope())
            .bind(key.id())
            .bind(token_param(token))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(released.rows_affected() == 1)
    }
}

impl PurgeExpired for SqliteStore {
    async fn purge_expired(&self, limit: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(sql(&self.handle.statements().purge))
            .bind(i64::from(limit))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }
}
