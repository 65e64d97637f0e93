#![doc = include_str!("../README.md")]

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::{
    Claim, Classification, DedupKey, DedupStore, Fingerprint, ORDERED_SCOPE_PREFIX, PurgeConfig,
    PurgeExpired, Purger, StoreError, Ttl,
};
use dedup_sql::{
    ClaimStatements, Dialect, SqlConfig, StoreHandle, TableName, live_claim, sql, ttl_seconds,
};
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{PgPool, Row};
use uuid::Uuid;

pub use dedup_sql::{Error, InvalidRole, InvalidTableName};
pub use grants::{grant, grant_statements};

pub mod admin;
mod batch;
mod grants;
mod lease;
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
    /// Contention, retried as long as it lasts (the holder will commit or
    /// roll back): a serialization failure (`40001`), a deadlock (`40P01`),
    /// a lock timeout (`55P03`) on a row another transaction holds.
    ///
    /// Everything else (any code not listed, such as a trigger's `RAISE
    /// EXCEPTION`) is transient: retried a bounded number of times, then
    /// dead-lettered, so that no event stalls its partition for good.
    fn classify_code(code: &str) -> Classification {
        match code.get(..2) {
            Some("22" | "23") => Classification::Permanent,
            _ if matches!(code, "40001" | "40P01" | "55P03") => Classification::Contention,
            Some("08" | "28" | "53" | "57" | "58" | "XX") => Classification::Environment,
            _ if matches!(code, "25006" | "3D000" | "42P01" | "42501") => {
                Classification::Environment
            }
            _ => Classification::Transient,
        }
    }

    /// `42501`: insufficient privilege.
    fn is_denied(code: &str) -> bool {
        code == "42501"
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
    insert_many: Arc<str>,
    expiry: Arc<str>,
    expiry_many: Arc<str>,
    refresh: Arc<str>,
    live_ids: Arc<str>,
    live_ids_ordered: Arc<str>,
    purge: Arc<str>,
    lease: lease::LeaseStatements,
}

/// The primary key of `key`'s claim: the first 16 bytes of the SHA-256 of
/// `<scope's length in bytes>:<scope><id>`, as a UUID (PostgreSQL's 16-byte
/// type). The leading length keeps apart pairs whose texts join alike
/// (`("ab", "c")`, `("a", "bc")`). Two distinct keys share an id with odd
/// of about 1 in 2^128 per pair, and finding such a pair on purpose takes
/// breaking SHA-256. The migration defines the same function in SQL,
/// `<table>_claim_id(scope, key)`, for operators' queries.
pub fn claim_id(key: &DedupKey) -> Uuid {
    let scope = key.scope();
    let digest = Sha256::new()
        .chain_update(scope.len().to_string())
        .chain_update(b":")
        .chain_update(scope)
        .chain_update(key.id())
        .finalize();
    let mut id = [0; 16];
    id.copy_from_slice(&digest[..16]);
    Uuid::from_bytes(id)
}

/// Expiry as microseconds since the Unix epoch, so no date-time crate is
/// needed to read it.
const EXPIRES_MICROS: &str = "(extract(epoch FROM expires_at) * 1000000)::int8";

/// A claim's age (since it was taken or refreshed) in microseconds, on the
/// database clock.
const AGE_MICROS: &str = "(extract(epoch FROM now() - claimed_at) * 1000000)::int8";

impl ClaimStatements for Statements {
    type Dialect = Pg;

    fn table(&self) -> &TableName {
        &self.table
    }

    fn new(config: &PgConfig) -> Result<Self, InvalidTableName> {
        let table = TableName::parse(&config.table)?;
        let t = table.quoted();
        let lock_ms = config.lock_timeout_ms();
        // One simple-protocol message: BEGIN and the lock bound in one round trip.
        let begin = format!("BEGIN; SET LOCAL lock_timeout = {lock_ms}");
        // The claim: create if absent, take over if expired, else no row.
        // `xmax = 0` is true only for a freshly inserted row version. Found
        // by `id` ([`claim_id`]); scope and key are kept for reading.
        // A take-over ends a lease that expired there (lease mode's columns
        // back to a transaction's claim).
        let upsert = "ON CONFLICT (id) DO UPDATE \
             SET claimed_at = EXCLUDED.claimed_at, expires_at = EXCLUDED.expires_at, \
                 fingerprint = EXCLUDED.fingerprint, token = NULL, in_progress = false \
             WHERE c.expires_at <= now()";
        let claim = format!(
            "INSERT INTO {t} AS c (id, scope, key, claimed_at, expires_at, fingerprint) \
             VALUES ($1, $2, $3, now(), now() + $4 * interval '1 second', $5) {upsert} \
             RETURNING (c.xmax = 0) AS fresh"
        );
        // A batch's rows, from the arrays batch.rs binds. Sorted so that
        // concurrent statements lock rows in one order. A NULL array of
        // fingerprints (none kept) unnests as NULLs beside the others. Both
        // batch statements return what the batch records of a claim taken
        // (`fresh` is always true for the plain insert).
        let batch_rows = format!(
            "INSERT INTO {t} AS c (id, scope, key, claimed_at, expires_at, fingerprint) \
             SELECT u.id, u.scope, u.key, now(), now() + $4 * interval '1 second', u.fingerprint \
             FROM unnest($1::uuid[], $2::text[], $3::text[], $5::bytea[]) \
                 AS u(id, scope, key, fingerprint)"
        );
        let taken =
            format!("RETURNING c.id, (c.xmax = 0) AS fresh, {EXPIRES_MICROS} AS expires_us");
        // A batch's expired claims, and its ids another transaction inserted
        // since the batch read them.
        let claim_many = format!("{batch_rows} ORDER BY u.id {upsert} {taken}");
        // A batch's claims that no row held when the batch read them,
        // inserted plainly: no speculative insertion, so no confirmation
        // record per row (48 WAL bytes a claim). Run in a savepoint: a claim
        // another transaction took since the read fails it (a unique
        // violation), and the upsert above decides those keys instead.
        // Only where `id` is the table's unique key, checked once per
        // statement from the catalog: a valid, immediate, non-partial
        // unique index keyed by `id` alone. Without it a plain insert would
        // claim twice (or find a race only at COMMIT), so it inserts
        // nothing and the upsert's own error (42P10, or 55000 for a
        // deferrable key) says the table is of another version.
        let keyed = format!(
            "EXISTS (SELECT 1 FROM pg_catalog.pg_index i \
                 JOIN pg_catalog.pg_attribute a \
                     ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
                 WHERE i.indrelid = '{t}'::regclass AND i.indisunique AND i.indisvalid \
                     AND i.indimmediate AND i.indpred IS NULL \
                     AND i.indnkeyatts = 1 AND a.attname = 'id')"
        );
        let insert_many = format!("{batch_rows} WHERE {keyed} ORDER BY u.id {taken}");
        // A single claim's duplicate: its expiry, age and fingerprint, the
        // one extra statement it takes, whether fingerprints are kept or not.
        let expiry =
            format!("SELECT {EXPIRES_MICROS}, {AGE_MICROS}, fingerprint FROM {t} WHERE id = $1");
        // A batch's read of its claims (first, and again for the ids its
        // upserts found live): which exist, and whether each is live on the
        // database clock (`now()`, as the upsert's take-over condition).
        let expiry_many = format!(
            "SELECT id, {EXPIRES_MICROS} AS expires_us, {AGE_MICROS} AS age_us, fingerprint, \
                 expires_at > now() AS live \
             FROM {t} WHERE id = ANY($1::uuid[])"
        );
        // clock_timestamp(), not now(): now() is the transaction's start,
        // which is what a long transaction must not count from.
        let refresh = format!(
            "UPDATE {t} SET expires_at = clock_timestamp() + $2 * interval '1 second' \
             WHERE id = ANY($1::uuid[])"
        );
        let live =
            format!("SELECT key FROM {t} WHERE scope = $1 AND key >= $2 AND expires_at > now()");
        // Any scope: no index keeps its keys in order (a scan).
        let live_ids = format!("{live} ORDER BY key");
        // The runtime's scopes: the predicate of the partial index on
        // (scope, key) is repeated word for word, so the planner proves the
        // index covers the query (migrations/0002_claim_id.sql).
        let live_ids_ordered =
            format!("{live} AND scope LIKE '{ORDERED_SCOPE_PREFIX}%' ORDER BY key");
        // Bounded, oldest first, skipping rows a running claim holds and
        // leases in progress (an expired lease whose holder still runs
        // completes under its token, which needs its row). The
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
                 SELECT ctid FROM {t} WHERE expires_at <= now() AND NOT in_progress \
                 ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))"
        );
        let lease = lease::LeaseStatements::new(&table);
        Ok(Statements {
            table,
            lock_timeout: config.lock_timeout,
            begin: begin.into(),
            claim: claim.into(),
            claim_many: claim_many.into(),
            insert_many: insert_many.into(),
            expiry: expiry.into(),
            expiry_many: expiry_many.into(),
            refresh: refresh.into(),
            live_ids: live_ids.into(),
            live_ids_ordered: live_ids_ordered.into(),
            purge: purge.into(),
            lease,
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
    handle: StoreHandle<sqlx::Postgres, Statements>,
}

impl fmt::Debug for PgStore {
    // The pool's options hold the password; show only what is safe.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.handle.statements().table.to_string())
            .field("lock_timeout", &self.handle.statements().lock_timeout)
            .field("pool_size", &self.handle.pool().size())
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
        let options = connect_options(url, &config)?;
        let handle = StoreHandle::connect_with(options, &config).await?;
        Ok(PgStore { handle })
    }

    /// Uses an existing pool with default settings.
    pub fn from_pool(pool: PgPool) -> Self {
        Self::from_pool_with(pool, PgConfig::default()).expect("the default table name is valid")
    }

    /// Uses an existing pool with `config`.
    pub fn from_pool_with(pool: PgPool, config: PgConfig) -> Result<Self, Error> {
        let handle = StoreHandle::from_pool(pool, &config)?;
        Ok(PgStore { handle })
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        self.handle.pool()
    }

    /// The outbox with default settings (table `dedup_outbox`) over this
    /// store's pool: the relay's [`OutboxSource`](dedup_core::outbox::OutboxSource).
    pub fn outbox_reader(&self) -> OutboxReader {
        outbox::DEFAULT_OUTBOX.reader(self.pool().clone())
    }

    /// Creates or upgrades the dedup table. Safe to call from every instance
    /// at start-up: runs under an advisory lock, in a transaction, and does
    /// nothing when up to date. Applied versions are tracked in
    /// `<table>_migrations`, so stores with different tables in one database
    /// migrate independently.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.handle.migrate(&MIGRATOR).await
    }

    /// Starts deleting expired claims in the background (see
    /// [`PurgeConfig`]); stop it with [`Purger::stop`].
    pub fn spawn_purger(&self, config: PurgeConfig) -> Purger {
        Purger::spawn(self.clone(), config)
    }
}

/// The connection options of `url` with `config`'s TLS files: with a CA
/// file, `sslmode=verify-full` against it; with a client certificate, that
/// certificate and key. The files are checked first, and a connection that
/// leaves this host without verifying the server is warned of (once, here).
/// For a pool of your own: `PgPool::connect_with(connect_options(url,
/// &config)?)`.
pub fn connect_options(url: &str, config: &PgConfig) -> Result<PgConnectOptions, Error> {
    config.tls.check()?;
    let mut options: PgConnectOptions = url.parse().map_err(Error::database::<Pg>)?;
    if let Some(ca) = &config.tls.ca_file {
        options = options.ssl_mode(PgSslMode::VerifyFull).ssl_root_cert(ca);
    }
    if let Some((cert, key)) = &config.tls.client {
        options = options.ssl_client_cert(cert).ssl_client_key(key);
    }
    let verified = matches!(
        options.get_ssl_mode(),
        PgSslMode::VerifyFull | PgSslMode::VerifyCa
    );
    let host = match options.get_socket() {
        Some(_) => "",
        None => options.get_host(),
    };
    dedup_sql::warn_unverified(
        Pg::NAME,
        host,
        verified,
        "add sslmode=verify-full&sslrootcert=<CA file> to the URL, or PgConfig::with_ca_file",
    );
    Ok(options)
}

/// An error of the store's own statements. Their text is fixed, so a
/// missing column (`42703`), no unique key for `ON CONFLICT` (`42P10`) or
/// a deferrable one (`55000`, which `ON CONFLICT` refuses) says the table
/// is of another version than this code (not migrated yet, or migrated by
/// a newer version): the environment's, waited out. (From a handler's
/// statements, which an event can shape, the same codes keep
/// [`Pg::classify_code`]'s rule.)
fn store_error(e: sqlx::Error) -> StoreError {
    let code = e
        .as_database_error()
        .and_then(|db| db.code())
        .filter(|code| matches!(code.as_ref(), "42703" | "42P10" | "55000"))
        .map(|code| code.into_owned());
    match code {
        Some(code) => StoreError::environment(e).with_code(code),
        None => dedup_sql::store_error::<Pg>(e),
    }
}

impl DedupStore for PgStore {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, StoreError> {
        self.handle
            .pool()
            .begin_with(sql(&self.handle.statements().begin))
            .await
            .map_err(store_error)
    }

    async fn claim(
        &self,
        tx: &mut PgTx,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        ttl: Ttl,
    ) -> Result<Claim, StoreError> {
        let id = claim_id(key);
        let row = sqlx::query(sql(&self.handle.statements().claim))
            .bind(id)
            .bind(key.scope())
            .bind(key.id())
            .bind(ttl_seconds(ttl))
            .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
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
        let row: Option<(i64, i64, Option<Vec<u8>>)> =
            sqlx::query_as(sql(&self.handle.statements().expiry))
                .bind(id)
                .fetch_optional(&mut **tx)
                .await
                .map_err(store_error)?;
        Ok(live_claim(row))
    }

    /// A read, a plain insert, and the upsert only for expired keys and
    /// races (`batch.rs`).
    async fn claim_many(
        &self,
        tx: &mut PgTx,
        keys: &[DedupKey],
        fingerprints: &[Option<Fingerprint>],
        ttl: Ttl,
    ) -> Result<Vec<Claim>, StoreError> {
        batch::claim_many(self.handle.statements(), tx, keys, fingerprints, ttl).await
    }

    async fn refresh_claims(
        &self,
        tx: &mut PgTx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        let ids: Vec<Uuid> = keys.iter().map(claim_id).collect();
        sqlx::query(sql(&self.handle.statements().refresh))
            .bind(&ids)
            .bind(ttl_seconds(ttl))
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        let statement = if from.scope().starts_with(ORDERED_SCOPE_PREFIX) {
            &self.handle.statements().live_ids_ordered
        } else {
            &self.handle.statements().live_ids
        };
        sqlx::query_scalar(sql(statement))
            .bind(from.scope())
            .bind(from.id())
            .fetch_all(self.handle.pool())
            .await
            .map_err(store_error)
    }

    fn connections(&self) -> Option<usize> {
        Some(self.handle.pool().options().get_max_connections() as usize)
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
        let done = sqlx::query(sql(&self.handle.statements().purge))
            .bind(i64::from(limit))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids are stored: the digest of a key must never change between
    /// versions, or every claim taken before an upgrade is forgotten.
    #[test]
    fn claim_ids_are_stable() {
        let id = |scope, key| claim_id(&DedupKey::new(scope, key).expect("key")).to_string();
        assert_eq!(id("s", "k"), "1e99d8fb-ccb9-c2d1-af73-b473e3948924");
        assert_eq!(
            id("payments", "evt-1"),
            "6d7f0906-5629-680e-c139-5d137f6decca"
        );
        assert_ne!(id("ab", "c"), id("a", "bc"));
    }

    /// The partial index's predicate (migration 0002) is the one the
    /// ordered read repeats, or the planner cannot use the index.
    #[test]
    fn the_ordered_read_repeats_the_index_predicate() {
        let migration = include_str!("../migrations/0002_claim_id.sql");
        let predicate = format!("scope LIKE '{ORDERED_SCOPE_PREFIX}%'");
        assert!(migration.contains(&predicate), "{predicate}");
        let statements = Statements::new(&PgConfig::default()).expect("statements");
        assert!(statements.live_ids_ordered.contains(&predicate));
    }
}
