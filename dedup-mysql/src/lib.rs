#![doc = include_str!("../README.md")]

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use dedup_core::{
    Claim, Classification, DedupKey, DedupStore, Fingerprint, PurgeConfig, PurgeExpired, Purger,
    StoreError, Ttl,
};
use dedup_sql::{
    BatchClaims, ClaimStatements, Dialect, SqlConfig, StoreHandle, TableName, Taken,
    age_from_micros, fingerprint_from, live_claim, sql, time_from_unix_micros, ttl_seconds,
};
use sqlx::MySqlPool;
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlSslMode};

pub use dedup_sql::{Error, InvalidRole, InvalidTableName, OutboxConfig, SqlLease};
pub use grants::{grant, grant_statements};

pub mod admin;
mod grants;
mod lease;
mod outbox;
pub use dedup_core::outbox::Retention;
pub use outbox::{OutboxReader, OutboxWriter, enqueue};

/// The sqlx this backend is built on, so handlers can use the same version.
pub use sqlx;

/// The transaction a handler body writes its effect through:
/// `sqlx::query(...).execute(&mut **tx)`.
pub type MySqlTx = sqlx::Transaction<'static, sqlx::MySql>;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// MySQL and MariaDB as the shared SQL layer sees them: whose fault each
/// error number is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MySql;

impl Dialect for MySql {
    const NAME: &'static str = "mysql";
    const DEFAULT_MAX_CONNECTIONS: u32 = 10;

    /// By error number (the code is `number/SQLSTATE`, say `1205/HY000`:
    /// most server errors share SQLSTATE `HY000`, the number tells them
    /// apart; MySQL 8 and MariaDB agree on every number below).
    ///
    /// Contention, retried as long as it lasts (the holder will commit or
    /// roll back): a lock wait timeout (`1205`), a deadlock (`1213`, which
    /// rolled the whole transaction back), `NOWAIT` finding a row locked
    /// (`3572`), a row changed since the transaction's snapshot (`1020`,
    /// MariaDB 11.6+'s `innodb_snapshot_isolation`).
    ///
    /// The environment's, waited out however long it lasts (each a number
    /// no event can cause): a read-only server or transaction (`1290`
    /// `--read-only`/`--super-read-only`, `1792`, `1036` a read-only table),
    /// a full disk or table (`1021`, `1114`, `1030` an engine error such as
    /// `ENOSPC`), memory or threads (`1037`, `1038`, `1041`, `1135`), too
    /// many connections (`1040`, `1203`, `1226`), denied access (`1044`,
    /// `1045`, `1142`, `1143`, `1227`), a missing database, table or column
    /// (`1049`, `1146`, `1054`: a schema of another version), a server
    /// shutting down or a killed query or connection (`1053`, `1077`,
    /// `1317`, `1927`), a statement time limit (`3024` MySQL, `1969`
    /// MariaDB), network errors (`1152`, `1154` to `1161`), a crashed table
    /// (`1194`, `1195`), too many transactions (`1637`), write failures
    /// (`1878`, `3`, `1015`, `1016`, `1017`, `1034`).
    ///
    /// The event's data (dead-lettered): SQLSTATE class `22` (a data
    /// exception: a value too long `1406`, out of range `1264`, an
    /// incorrect value `1292`, invalid JSON `3140`) and class `23` (an
    /// integrity violation: a duplicate entry `1062`, a NULL in a NOT NULL
    /// column `1048`, a foreign key `1451`/`1452`, MariaDB's check
    /// constraint `4025`), raised by the handler's statements, and by
    /// number those MySQL files under `HY000` or `01000`: an incorrect
    /// value (`1366`, `1411`), a value cut in strict mode (`1265`), MySQL's
    /// check constraint (`3819`), a statement over `max_allowed_packet`
    /// (`1153`: a payload too large never goes through).
    ///
    /// Everything else (a syntax error, a trigger's `SIGNAL`, a number not
    /// listed) is transient: retried a bounded number of times, then
    /// dead-lettered, so that no event stalls its partition for good.
    fn classify_code(code: &str) -> Classification {
        let (number, state) = code.split_once('/').unwrap_or((code, ""));
        match number.parse::<u32>() {
            Ok(1020 | 1205 | 1213 | 3572) => Classification::Contention,
            // The event's data, under SQLSTATE HY000 or 01000: an incorrect
            // value (1366, 1411), a value cut in strict mode (1265), a check
            // constraint (3819), a statement larger than max_allowed_packet
            // (1153: a payload too large; never goes through).
            Ok(1153 | 1265 | 1366 | 1411 | 3819) => Classification::Permanent,
            Ok(
                3 | 1015 | 1016 | 1017 | 1021 | 1030 | 1034 | 1036 | 1037 | 1038 | 1040 | 1041
                | 1044 | 1045 | 1049 | 1053 | 1054 | 1077 | 1114 | 1135 | 1142 | 1143 | 1146 | 1152
                | 1154 | 1155 | 1156 | 1157 | 1158 | 1159 | 1160 | 1161 | 1194 | 1195 | 1203 | 1226
                | 1227 | 1290 | 1317 | 1637 | 1792 | 1878 | 1927 | 1969 | 3024,
            ) => Classification::Environment,
            _ if state.starts_with("22") || state.starts_with("23") => Classification::Permanent,
            _ => Classification::Transient,
        }
    }

    fn database_code(error: &dyn sqlx::error::DatabaseError) -> Option<String> {
        match error.try_downcast_ref::<MySqlDatabaseError>() {
            Some(e) => Some(match e.code() {
                Some(state) => format!("{}/{state}", e.number()),
                None => e.number().to_string(),
            }),
            None => error.code().map(Into::into),
        }
    }

    /// Access denied to a database (`1044`), for a command on a table
    /// (`1142`) or a column (`1143`), or needing a privilege the user
    /// lacks (`1227`).
    fn is_denied(code: &str) -> bool {
        let number = code.split_once('/').map_or(code, |(n, _)| n);
        matches!(number, "1044" | "1142" | "1143" | "1227")
    }
}

/// Settings of a [`MySqlStore`]: the table (default `dedup_claims`, in the
/// connection's database), the lock timeout (5 s, InnoDB's
/// `innodb_lock_wait_timeout`, whole seconds, set for each transaction),
/// the pool size (10).
pub type MySqlConfig = SqlConfig<MySql>;

/// The server's clock, in microseconds since the Unix epoch:
/// `UTC_TIMESTAMP(6)` is fixed for the duration of one statement and does
/// not depend on the session's `time_zone` (a zone with daylight saving
/// would make `UNIX_TIMESTAMP(NOW())` repeat an hour).
pub(crate) const NOW_US: &str =
    "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// A batch's keys as rows, from a JSON array of `[scope, id, fingerprint as
/// hex or null]` (MySQL 8.0.4+, MariaDB 10.6+).
const JSON_KEYS: &str = "JSON_TABLE(?, '$[*]' COLUMNS (\
     j_scope VARCHAR(255) CHARACTER SET utf8mb4 PATH '$[0]', \
     j_id VARCHAR(255) CHARACTER SET utf8mb4 PATH '$[1]', \
     j_fingerprint VARCHAR(32) CHARACTER SET utf8mb4 PATH '$[2]')) AS j";

struct Statements {
    table: TableName,
    begin: Arc<str>,
    claim: Arc<str>,
    claim_many: Arc<str>,
    claimed: Arc<str>,
    claimed_many: Arc<str>,
    refresh: Arc<str>,
    live_ids: Arc<str>,
    purge_take: Arc<str>,
    purge_delete: Arc<str>,
    lease: lease::LeaseStatements,
}

/// The `ON DUPLICATE KEY UPDATE` clause that takes a row over only if its
/// claim has expired: every column keeps its value unless `expires_at <=
/// now`. MySQL assigns left to right, each later expression seeing the
/// earlier ones' new values, so `expires_at` (which every condition
/// reads) goes last.
pub(crate) fn take_over_if_expired(extra: &[(&str, &str)]) -> String {
    let expired = format!("expires_at <= {NOW_US}");
    let mut set = vec![
        ("claims", "claims + 1".to_owned()),
        ("claimed_at", "VALUES(claimed_at)".to_owned()),
        ("fingerprint", "VALUES(fingerprint)".to_owned()),
        ("tag", "VALUES(tag)".to_owned()),
    ];
    set.extend(extra.iter().map(|(c, v)| (*c, (*v).to_owned())));
    set.push(("expires_at", "VALUES(expires_at)".to_owned()));
    let set: Vec<String> = set
        .into_iter()
        .map(|(column, value)| format!("{column} = IF({expired}, {value}, {column})"))
        .collect();
    format!("ON DUPLICATE KEY UPDATE {}", set.join(", "))
}

impl ClaimStatements for Statements {
    type Dialect = MySql;

    fn table(&self) -> &TableName {
        &self.table
    }

    fn new(config: &MySqlConfig) -> Result<Self, InvalidTableName> {
        let table = TableName::parse_unqualified(&config.table)?.with_backticks();
        let t = table.quoted();
        let tokens = table.quoted_with_suffix("_tokens");
        // Whole seconds, at least one: InnoDB's unit.
        let lock_seconds = config.lock_timeout_ms().div_ceil(1000).max(1);
        let begin =
            format!("SET SESSION innodb_lock_wait_timeout = {lock_seconds}; START TRANSACTION");
        let claim_update = take_over_if_expired(&[("token", "NULL"), ("in_progress", "0")]);
        // The claim: create if absent, take over if expired, else leave the
        // row as it is. Either way InnoDB holds the row's exclusive lock
        // from here to the end of the transaction.
        let claim = format!(
            "INSERT INTO {t} (scope, id, claimed_at, expires_at, fingerprint, tag) \
             VALUES (?, ?, {NOW_US}, {NOW_US} + ? * 1000000, ?, ?) {claim_update}"
        );
        let claim_many = format!(
            "INSERT INTO {t} (scope, id, claimed_at, expires_at, fingerprint, tag) \
             SELECT j.j_scope, j.j_id, {NOW_US}, {NOW_US} + ? * 1000000, UNHEX(j.j_fingerprint), ? \
             FROM {JSON_KEYS} {claim_update}"
        );
        // What the claim did, read back under the row lock it holds (a
        // locking read sees the newest committed row, not the transaction's
        // snapshot): the tag says whether this statement took the row.
        let row = format!(
            "c.tag, c.claims, c.expires_at, {NOW_US} - c.claimed_at, c.fingerprint, \
             c.in_progress, COALESCE(c.token, 0)"
        );
        let claimed =
            format!("SELECT {row} FROM {t} AS c WHERE c.scope = ? AND c.id = ? FOR UPDATE");
        let claimed_many = format!(
            "SELECT c.scope, c.id, {row} FROM {JSON_KEYS} \
             JOIN {t} AS c ON c.scope = j.j_scope AND c.id = j.j_id FOR UPDATE"
        );
        let refresh = format!(
            "UPDATE {t} AS c JOIN {JSON_KEYS} ON c.scope = j.j_scope AND c.id = j.j_id \
             SET c.expires_at = {NOW_US} + ? * 1000000"
        );
        let live_ids = format!(
            "SELECT id FROM {t} WHERE scope = ? AND id >= ? AND expires_at > {NOW_US} ORDER BY id"
        );
        // Expired claims no transaction holds, oldest first; rows another
        // transaction has locked (a claimer taking one over) are skipped,
        // not waited for (MySQL 8.0.1+, MariaDB 10.6+).
        let purge_take = format!(
            "SELECT scope, id FROM {t} WHERE expires_at <= {NOW_US} AND in_progress = 0 \
             ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        let purge_delete = format!(
            "DELETE c FROM {t} AS c JOIN {JSON_KEYS} ON c.scope = j.j_scope AND c.id = j.j_id"
        );
        Ok(Statements {
            table,
            begin: begin.into(),
            claim: claim.into(),
            claim_many: claim_many.into(),
            claimed: claimed.into(),
            claimed_many: claimed_many.into(),
            refresh: refresh.into(),
            live_ids: live_ids.into(),
            purge_take: purge_take.into(),
            purge_delete: purge_delete.into(),
            lease: lease::LeaseStatements::new(&t, &tokens),
        })
    }
}

/// A [`DedupStore`] on MySQL 8 or MariaDB 10.6+ (InnoDB).
///
/// A claim is an `INSERT ... ON DUPLICATE KEY UPDATE` that takes the row
/// over only if its claim expired, on the server's clock, inside the
/// handler's transaction; a locking read of the row then tells what it did.
/// Cloning is cheap and shares the pool.
#[derive(Clone)]
pub struct MySqlStore {
    handle: StoreHandle<sqlx::MySql, Statements>,
}

impl fmt::Debug for MySqlStore {
    // The pool's options hold the password; show only what is safe.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.handle.statements().table.to_string())
            .field("pool_size", &self.handle.pool().size())
            .finish_non_exhaustive()
    }
}

impl MySqlStore {
    /// Connects with default settings (`dedup_claims`, 5 s lock timeout,
    /// up to 10 connections).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::connect_with(url, MySqlConfig::default()).await
    }

    /// Connects with `config`.
    pub async fn connect_with(url: &str, config: MySqlConfig) -> Result<Self, Error> {
        let options = connect_options(url, &config)?;
        let handle = StoreHandle::connect_with(options, &config).await?;
        Ok(MySqlStore { handle })
    }

    /// Uses an existing pool with default settings.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self::from_pool_with(pool, MySqlConfig::default()).expect("the default table name is valid")
    }

    /// Uses an existing pool with `config`.
    pub fn from_pool_with(pool: MySqlPool, config: MySqlConfig) -> Result<Self, Error> {
        let handle = StoreHandle::from_pool(pool, &config)?;
        Ok(MySqlStore { handle })
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &MySqlPool {
        self.handle.pool()
    }

    /// The outbox with default settings (table `dedup_outbox`) over this
    /// store's pool: the relay's [`OutboxSource`](dedup_core::outbox::OutboxSource).
    pub fn outbox_reader(&self) -> OutboxReader {
        outbox::DEFAULT_OUTBOX.reader(self.pool().clone())
    }

    /// Creates or upgrades the dedup table (tracked in
    /// `<table>_migrations`, under a named lock); safe to call from every
    /// instance at start-up.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.handle.migrate(&MIGRATOR).await
    }

    /// Starts deleting expired claims in the background (see
    /// [`PurgeConfig`]); stop it with [`Purger::stop`].
    pub fn spawn_purger(&self, config: PurgeConfig) -> Purger {
        Purger::spawn(self.clone(), config)
    }

    /// Begins a transaction with this store's lock timeout.
    async fn begin_tx(&self) -> Result<MySqlTx, StoreError> {
        self.handle
            .pool()
            .begin_with(sql(&self.handle.statements().begin))
            .await
            .map_err(store_error)
    }
}

/// The connection options of `url` with `config`'s TLS files: with a CA
/// file, `ssl-mode=VERIFY_IDENTITY` against it; with a client certificate,
/// that certificate and key. The files are checked first, and a connection
/// that leaves this host without verifying the server is warned of (once,
/// here). For a pool of your own: `MySqlPool::connect_with(connect_options(url,
/// &config)?)`.
pub fn connect_options(url: &str, config: &MySqlConfig) -> Result<MySqlConnectOptions, Error> {
    config.tls.check()?;
    let mut options: MySqlConnectOptions = url.parse().map_err(Error::database::<MySql>)?;
    if let Some(ca) = &config.tls.ca_file {
        options = options.ssl_mode(MySqlSslMode::VerifyIdentity).ssl_ca(ca);
    }
    if let Some((cert, key)) = &config.tls.client {
        options = options.ssl_client_cert(cert).ssl_client_key(key);
    }
    let verified = matches!(
        options.get_ssl_mode(),
        MySqlSslMode::VerifyIdentity | MySqlSslMode::VerifyCa
    );
    let host = match options.get_socket() {
        Some(_) => "",
        None => options.get_host(),
    };
    dedup_sql::warn_unverified(
        MySql::NAME,
        host,
        verified,
        "add ssl-mode=VERIFY_IDENTITY&ssl-ca=<CA file> to the URL, or MySqlConfig::with_ca_file",
    );
    Ok(options)
}

/// An error of the store's own statements. Their text is fixed, so a
/// missing column (`1054`) says the table is of another version than this
/// code: the environment's, as [`MySql::classify_code`] says of it anyway.
pub(crate) fn store_error(e: sqlx::Error) -> StoreError {
    dedup_sql::store_error::<MySql>(e)
}

/// A random tag for the rows one claim statement takes.
pub(crate) fn new_tag() -> i64 {
    let (high, _) = uuid::Uuid::new_v4().as_u64_pair();
    i64::from_ne_bytes(high.to_ne_bytes())
}

/// A claim row read back: its tag, claim count, expiry, age (µs),
/// fingerprint, whether a lease is in progress, and the lease's token.
pub(crate) type ClaimRow = (i64, i64, i64, i64, Option<Vec<u8>>, i8, i64);

/// A claim row of a batch read back: its scope and id, then a [`ClaimRow`].
type BatchRow = (
    Vec<u8>,
    Vec<u8>,
    i64,
    i64,
    i64,
    i64,
    Option<Vec<u8>>,
    i8,
    i64,
);

/// `[[scope, id, fingerprint as hex or null], ...]`, sorted by key so that
/// concurrent batches lock shared keys in one order (no deadlock between
/// them).
fn json_keys<'a>(keys: impl Iterator<Item = (&'a DedupKey, Option<Fingerprint>)>) -> String {
    let mut keys: Vec<_> = keys.collect();
    keys.sort_unstable_by(|(a, _), (b, _)| (a.scope(), a.id()).cmp(&(b.scope(), b.id())));
    serde_json::Value::Array(
        keys.into_iter()
            .map(|(k, fingerprint)| {
                serde_json::json!([k.scope(), k.id(), fingerprint.map(|f| f.to_string())])
            })
            .collect(),
    )
    .to_string()
}

/// A byte-string column read back as the text it was written from.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl DedupStore for MySqlStore {
    type Tx = MySqlTx;

    async fn begin(&self) -> Result<MySqlTx, StoreError> {
        self.begin_tx().await
    }

    async fn claim(
        &self,
        tx: &mut MySqlTx,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        ttl: Ttl,
    ) -> Result<Claim, StoreError> {
        let tag = new_tag();
        sqlx::query(sql(&self.handle.statements().claim))
            .bind(key.scope())
            .bind(key.id())
            .bind(ttl_seconds(ttl))
            .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(tag)
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        let (taken, claims, expires_us, age_us, kept, _, _): ClaimRow =
            sqlx::query_as(sql(&self.handle.statements().claimed))
                .bind(key.scope())
                .bind(key.id())
                .fetch_one(&mut **tx)
                .await
                .map_err(store_error)?;
        Ok(match (taken == tag, claims) {
            (true, 1) => Claim::Fresh,
            (true, _) => Claim::Reclaimed,
            (false, _) => live_claim(Some((expires_us, age_us, kept))),
        })
    }

    async fn claim_many(
        &self,
        tx: &mut MySqlTx,
        keys: &[DedupKey],
        fingerprints: &[Option<Fingerprint>],
        ttl: Ttl,
    ) -> Result<Vec<Claim>, StoreError> {
        let mut batch = BatchClaims::new(keys, fingerprints);
        if batch.distinct().is_empty() {
            return Ok(Vec::new());
        }
        let tag = new_tag();
        let json = json_keys(batch.distinct().iter().map(|&k| (k, batch.fingerprint(k))));
        sqlx::query(sql(&self.handle.statements().claim_many))
            .bind(ttl_seconds(ttl))
            .bind(tag)
            .bind(&json)
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        let rows = sqlx::query(sql(&self.handle.statements().claimed_many))
            .bind(&json)
            .fetch_all(&mut **tx)
            .await
            .map_err(store_error)?;
        for row in rows {
            let (scope, id, taken, claims, expires_us, age_us, kept, _, _): BatchRow =
                sqlx::FromRow::from_row(&row).map_err(store_error)?;
            let (scope, id) = (text(scope), text(id));
            if taken == tag {
                let taken = if claims == 1 {
                    Taken::Fresh
                } else {
                    Taken::Reclaimed
                };
                batch.claimed(&scope, &id, taken, time_from_unix_micros(expires_us));
            } else {
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
        tx: &mut MySqlTx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        sqlx::query(sql(&self.handle.statements().refresh))
            .bind(json_keys(keys.iter().map(|k| (k, None))))
            .bind(ttl_seconds(ttl))
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        let ids: Vec<Vec<u8>> = sqlx::query_scalar(sql(&self.handle.statements().live_ids))
            .bind(from.scope())
            .bind(from.id())
            .fetch_all(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(ids.into_iter().map(text).collect())
    }

    fn connections(&self) -> Option<usize> {
        Some(self.handle.pool().options().get_max_connections() as usize)
    }

    async fn commit(&self, tx: MySqlTx) -> Result<(), StoreError> {
        tx.commit().await.map_err(store_error)
    }

    async fn rollback(&self, tx: MySqlTx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(store_error)
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Classification {
        dedup_sql::classify::<MySql>(error)
    }

    fn error_code(&self, error: &(dyn StdError + 'static)) -> Option<String> {
        dedup_sql::error_code::<MySql>(error)
    }
}

impl PurgeExpired for MySqlStore {
    async fn purge_expired(&self, limit: u32) -> Result<u64, StoreError> {
        // Under READ COMMITTED for this one transaction: InnoDB then locks
        // only the rows it takes, not the gaps of the expiry index around
        // them, so claimers inserting beside them never wait for the purge.
        let mut tx = self
            .handle
            .pool()
            .begin_with(outbox::BEGIN_READ_COMMITTED)
            .await
            .map_err(store_error)?;
        let rows: Vec<(Vec<u8>, Vec<u8>)> =
            sqlx::query_as(sql(&self.handle.statements().purge_take))
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await
                .map_err(store_error)?;
        if rows.is_empty() {
            tx.rollback().await.map_err(store_error)?;
            return Ok(0);
        }
        let json = serde_json::Value::Array(
            rows.into_iter()
                .map(|(scope, id)| serde_json::json!([text(scope), text(id), null]))
                .collect(),
        )
        .to_string();
        let done = sqlx::query(sql(&self.handle.statements().purge_delete))
            .bind(json)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes as MySQL 8 reports them (MariaDB files several of these
    /// under a data-exception SQLSTATE; MySQL under `HY000`), which a real
    /// MariaDB cannot produce for the tests in `tests/store.rs`.
    #[test]
    fn mysql_8s_codes_are_classified_by_number() {
        for (code, expected) in [
            ("1366/HY000", Classification::Permanent),
            ("1411/HY000", Classification::Permanent),
            ("1265/01000", Classification::Permanent),
            ("3819/HY000", Classification::Permanent),
            ("1153/08S01", Classification::Permanent),
            ("1020/HY000", Classification::Contention),
            ("1213/40001", Classification::Contention),
            ("3024/HY000", Classification::Environment),
            ("1290/HY000", Classification::Environment),
            ("1644/45000", Classification::Transient),
        ] {
            assert_eq!(MySql::classify_code(code), expected, "{code}");
        }
    }
}
