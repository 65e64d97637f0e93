//! The transactional outbox on SQLite: [`enqueue`] inside the caller's
//! transaction, [`OutboxReader`] for the relay.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{
    OutboxMessage, OutboxRecord, OutboxSource, PublishFailure, Retention, poll_for_events,
};
use dedup_sql::{
    OutboxConfig, OutboxRow, SqlLease, TableName, encode_headers, json_seqs, millis, outbox_record,
    run_migrations, sql,
};
use sqlx::{SqliteConnection, SqlitePool};

use crate::{Error, InvalidTableName, NOW_US, Sqlite, store_error};

/// The outbox migrations, rendered with the configured table name.
static OUTBOX_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./outbox-migrations");

/// The statements of one outbox, built once from its validated name.
struct Statements {
    table: TableName,
    retention: Retention,
    enqueue: Arc<str>,
    last_seq: Arc<str>,
    lease: Arc<str>,
    mark_sent: Arc<str>,
    record_failure: Arc<str>,
    release: Arc<str>,
    purge_sent: Arc<str>,
    backlog: Arc<str>,
}

impl Statements {
    fn new(config: &OutboxConfig) -> Result<Self, InvalidTableName> {
        let table = TableName::parse_unqualified(&config.table)?;
        let t = table.quoted();
        let enqueue = format!(
            "INSERT INTO {t} (event_id, topic, key, payload, headers, enqueued_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, {NOW_US})"
        );
        // Lease the oldest pending rows that are neither backing off nor
        // leased elsewhere, leaving out every row with an earlier pending
        // row of its topic and key that is (publishing past it would
        // overtake it). One writer at a time (the transaction begins
        // IMMEDIATE), so the statement sees every other relay's lease.
        let lease = format!(
            "UPDATE {t} SET lease_id = ?1, leased_until = {NOW_US} + ?2 * 1000 \
             WHERE seq IN ( \
                 SELECT o.seq FROM {t} o \
                 WHERE o.sent_at IS NULL \
                   AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= {NOW_US}) \
                   AND (o.leased_until IS NULL OR o.leased_until <= {NOW_US}) \
                   AND (o.key IS NULL OR NOT EXISTS ( \
                       SELECT 1 FROM {t} f \
                       WHERE f.sent_at IS NULL AND f.topic = o.topic AND f.key = o.key \
                         AND f.seq < o.seq \
                         AND (f.next_attempt_at > {NOW_US} OR f.leased_until > {NOW_US}))) \
                 ORDER BY o.seq LIMIT ?3) \
             RETURNING seq, event_id, topic, key, payload, headers, attempts"
        );
        let seqs = "SELECT value FROM json_each(?1)";
        let mark_sent = match config.retention {
            Retention::Delete => format!("DELETE FROM {t} WHERE seq IN ({seqs})"),
            Retention::Keep(_) => format!(
                "UPDATE {t} SET sent_at = {NOW_US}, lease_id = NULL, leased_until = NULL \
                 WHERE seq IN ({seqs}) AND sent_at IS NULL"
            ),
        };
        let record_failure = format!(
            "UPDATE {t} SET attempts = attempts + 1, last_error = ?1, \
                 next_attempt_at = {NOW_US} + ?2 * 1000, lease_id = NULL, leased_until = NULL \
             WHERE seq = ?3 AND lease_id = ?4"
        );
        let release = format!(
            "UPDATE {t} SET lease_id = NULL, leased_until = NULL \
             WHERE seq IN ({seqs}) AND lease_id = ?2"
        );
        let purge_sent = format!(
            "DELETE FROM {t} WHERE seq IN ( \
                 SELECT seq FROM {t} WHERE sent_at IS NOT NULL AND sent_at < {NOW_US} - ?1 * 1000 \
                 ORDER BY sent_at LIMIT ?2)"
        );
        let backlog = format!(
            "SELECT count(*), coalesce({NOW_US} - min(enqueued_at), 0) FROM {t} \
             WHERE sent_at IS NULL"
        );
        Ok(Statements {
            last_seq: format!("SELECT coalesce(max(seq), 0) FROM {t}").into(),
            table,
            retention: config.retention,
            enqueue: enqueue.into(),
            lease: lease.into(),
            mark_sent: mark_sent.into(),
            record_failure: record_failure.into(),
            release: release.into(),
            purge_sent: purge_sent.into(),
            backlog: backlog.into(),
        })
    }
}

/// An outbox table in an SQLite database: [`enqueue`](OutboxWriter::enqueue)
/// events inside your transaction, [`migrate`](OutboxWriter::migrate) it at
/// start-up, and hand [`reader`](OutboxWriter::reader) to a relay. Cloning
/// is cheap.
///
/// ```no_run
/// # async fn example(store: dedup_sqlite::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
/// use dedup_core::OutboxMessage;
/// use dedup_sqlite::OutboxWriter;
///
/// let outbox = OutboxWriter::default();
/// outbox.migrate(store.pool()).await?;
/// let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await?;
/// sqlx::query("UPDATE accounts SET balance = balance + 500 WHERE id = 'a'")
///     .execute(&mut *tx)
///     .await?;
/// outbox
///     .enqueue(&mut tx, OutboxMessage::json("payment-recorded", &"a")?.with_key("a"))
///     .await?;
/// tx.commit().await?; // the event exists if and only if the change does
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct OutboxWriter {
    statements: Arc<Statements>,
}

impl fmt::Debug for OutboxWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxWriter")
            .field("table", &self.statements.table.to_string())
            .field("retention", &self.statements.retention)
            .finish()
    }
}

impl Default for OutboxWriter {
    /// The table `dedup_outbox`, rows kept an hour after publishing.
    fn default() -> Self {
        OutboxWriter::new(OutboxConfig::default()).expect("the default outbox table name is valid")
    }
}

/// The default outbox, for [`enqueue`].
static DEFAULT_OUTBOX: LazyLock<OutboxWriter> = LazyLock::new(OutboxWriter::default);

/// Enqueues `message` in the default outbox (`dedup_outbox`) inside the
/// transaction `conn` belongs to; returns its event id. In a handler:
/// `dedup_sqlite::enqueue(tx, message).await?`.
pub async fn enqueue(conn: &mut SqliteConnection, message: OutboxMessage) -> Result<String, Error> {
    DEFAULT_OUTBOX.enqueue(conn, message).await
}

impl crate::SqliteStore {
    /// The outbox with default settings (table `dedup_outbox`) over this
    /// store's pool: the relay's [`OutboxSource`].
    pub fn outbox_reader(&self) -> OutboxReader {
        DEFAULT_OUTBOX.reader(self.pool().clone())
    }
}

impl OutboxWriter {
    /// An outbox with `config`.
    pub fn new(config: OutboxConfig) -> Result<Self, Error> {
        Ok(OutboxWriter {
            statements: Arc::new(Statements::new(&config)?),
        })
    }

    /// Creates or upgrades the outbox table; safe to call at every start
    /// (tracked in `<table>_migrations`).
    pub async fn migrate(&self, pool: &SqlitePool) -> Result<(), Error> {
        run_migrations(pool, &OUTBOX_MIGRATOR, &self.statements.table)
            .await
            .map_err(Error::migrate::<Sqlite>)
    }

    /// Writes `message` into the outbox inside the transaction `conn`
    /// belongs to, and returns its event id: the one set on the message, or
    /// a new random UUID. The event is published only if that transaction
    /// commits.
    pub async fn enqueue(
        &self,
        conn: &mut SqliteConnection,
        message: OutboxMessage,
    ) -> Result<String, Error> {
        let event_id = message
            .event_id
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        sqlx::query(sql(&self.statements.enqueue))
            .bind(&event_id)
            .bind(message.topic)
            .bind(message.key)
            .bind(message.payload)
            .bind(encode_headers(&message.headers))
            .execute(conn)
            .await
            .map_err(Error::database::<Sqlite>)?;
        Ok(event_id)
    }

    /// The relay's view of this outbox over `pool`.
    pub fn reader(&self, pool: SqlitePool) -> OutboxReader {
        OutboxReader {
            pool,
            statements: self.statements.clone(),
            seen: Arc::default(),
        }
    }
}

/// An outbox as a relay reads it: an [`OutboxSource`] over a pool. A
/// batch is leased with one short write transaction (a lease id and an
/// expiry on SQLite's clock), published with no transaction open, and
/// marked in another. SQLite cannot notify: a waiting relay polls
/// ([`poll_for_events`]), so an event committed while it waits is
/// published within about 250 ms (events that become available otherwise,
/// within the relay's `poll_interval`).
#[derive(Clone)]
pub struct OutboxReader {
    pool: SqlitePool,
    statements: Arc<Statements>,
    /// The newest sequence number when this reader last leased: a wait
    /// ends once the outbox has another.
    seen: Arc<AtomicI64>,
}

impl fmt::Debug for OutboxReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxReader")
            .field("table", &self.statements.table.to_string())
            .field("retention", &self.statements.retention)
            .finish_non_exhaustive()
    }
}

impl OutboxSource for OutboxReader {
    type Lease = SqlLease;

    async fn lease_pending(
        &self,
        limit: usize,
        lease_for: Duration,
    ) -> Result<(SqlLease, Vec<OutboxRecord>), StoreError> {
        let id = SqlLease::new_id();
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(store_error)?;
        let last: i64 = sqlx::query_scalar(sql(&self.statements.last_seq))
            .fetch_one(&mut *tx)
            .await
            .map_err(store_error)?;
        let mut rows: Vec<OutboxRow> = sqlx::query_as(sql(&self.statements.lease))
            .bind(id)
            .bind(millis(lease_for))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        self.seen.store(last, Ordering::Release);
        // RETURNING keeps no order.
        rows.sort_unstable_by_key(|row| row.0);
        let lease = SqlLease::new(id, rows.iter().map(|row| row.0).collect());
        Ok((lease, rows.into_iter().map(outbox_record).collect()))
    }

    async fn finish(
        &self,
        lease: &SqlLease,
        published: &[i64],
        failed: &[PublishFailure],
    ) -> Result<(), StoreError> {
        if lease.seqs().is_empty() && published.is_empty() {
            return Ok(());
        }
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(store_error)?;
        if !published.is_empty() {
            sqlx::query(sql(&self.statements.mark_sent))
                .bind(json_seqs(published))
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        for failure in failed {
            sqlx::query(sql(&self.statements.record_failure))
                .bind(&failure.reason)
                .bind(millis(failure.retry_after))
                .bind(failure.seq)
                .bind(lease.id())
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        let held = dedup_sql::unsettled(lease.seqs(), published, failed);
        if !held.is_empty() {
            sqlx::query(sql(&self.statements.release))
                .bind(json_seqs(&held))
                .bind(lease.id())
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)
    }

    async fn wait_for_events(&self, timeout: Duration) {
        let seen = self.seen.load(Ordering::Acquire);
        poll_for_events(timeout, || async {
            let last: i64 = sqlx::query_scalar(sql(&self.statements.last_seq))
                .fetch_one(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(last != seen)
        })
        .await;
    }

    async fn purge_sent(&self, limit: u32) -> Result<u64, StoreError> {
        let Retention::Keep(keep) = self.statements.retention else {
            return Ok(0);
        };
        let done = sqlx::query(sql(&self.statements.purge_sent))
            .bind(millis(keep))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn backlog(&self) -> Result<Option<(u64, Duration)>, StoreError> {
        let (pending, oldest_us): (i64, i64) = sqlx::query_as(sql(&self.statements.backlog))
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(Some((
            u64::try_from(pending).unwrap_or(0),
            Duration::from_micros(u64::try_from(oldest_us).unwrap_or(0)),
        )))
    }
}
