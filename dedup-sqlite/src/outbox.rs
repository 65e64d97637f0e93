//! The transactional outbox on SQLite: [`enqueue`] inside the caller's
//! transaction, [`OutboxReader`] for the relay.

use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{OutboxMessage, OutboxRecord, PublishFailure, Retention};
use dedup_sql::polled::{self, LastSeq, PolledStatements};
use dedup_sql::{Outbox, OutboxRow, OutboxStore, SqlLease, TableName, millis, outbox_record, sql};
use sqlx::SqliteConnection;

use crate::{Error, InvalidTableName, NOW_US, Sqlite, store_error};

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
pub type OutboxWriter = dedup_sql::OutboxWriter<Sqlite>;

/// An outbox as a relay reads it: an [`OutboxSource`](dedup_core::outbox::OutboxSource)
/// over a pool. A batch is leased with one short write transaction (a
/// lease id and an expiry on SQLite's clock), published with no transaction
/// open, and marked in another. SQLite cannot notify: a waiting relay
/// polls, so an event committed while it waits is published within about
/// 250 ms (events that become available otherwise, within the relay's
/// `poll_interval`).
pub type OutboxReader = dedup_sql::OutboxReader<Sqlite>;

/// The outbox migrations, rendered with the configured table name.
static OUTBOX_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./outbox-migrations");

/// The statements of one outbox, built once from its validated name.
pub struct Statements {
    enqueue: Arc<str>,
    lease: Arc<str>,
    purge_sent: Arc<str>,
    polled: PolledStatements,
}

/// Transactions that write to the outbox begin IMMEDIATE: they take the
/// write lock at once instead of failing to upgrade a read lock.
const BEGIN_IMMEDIATE: &str = "BEGIN IMMEDIATE";

impl OutboxStore for Sqlite {
    type Db = sqlx::Sqlite;
    type Statements = Statements;
    type Watch = LastSeq;
    type Lease = SqlLease;

    fn migrator() -> &'static sqlx::migrate::Migrator {
        &OUTBOX_MIGRATOR
    }

    fn table(name: &str) -> Result<TableName, InvalidTableName> {
        TableName::parse_unqualified(name)
    }

    fn statements(table: &TableName, retention: Retention) -> Statements {
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
        let mark_sent = match retention {
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
        Statements {
            enqueue: enqueue.into(),
            lease: lease.into(),
            purge_sent: purge_sent.into(),
            polled: PolledStatements {
                last_seq: format!("SELECT coalesce(max(seq), 0) FROM {t}").into(),
                mark_sent: mark_sent.into(),
                record_failure: record_failure.into(),
                release: release.into(),
                backlog: backlog.into(),
            },
        }
    }

    fn enqueue<'a>(
        outbox: &'a Outbox<Sqlite>,
        conn: &'a mut SqliteConnection,
        message: OutboxMessage,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send + 'a {
        polled::enqueue::<sqlx::Sqlite>(conn, &outbox.statements().enqueue, message)
    }

    async fn lease(
        reader: &OutboxReader,
        limit: usize,
        lease_for: Duration,
        _before: Option<&SqlLease>,
    ) -> Result<(SqlLease, Vec<OutboxRecord>), StoreError> {
        let statements = reader.outbox().statements();
        let id = SqlLease::new_id();
        let mut tx = reader
            .pool()
            .begin_with(BEGIN_IMMEDIATE)
            .await
            .map_err(store_error)?;
        let last: i64 = sqlx::query_scalar(sql(&statements.polled.last_seq))
            .fetch_one(&mut *tx)
            .await
            .map_err(store_error)?;
        let mut rows: Vec<OutboxRow> = sqlx::query_as(sql(&statements.lease))
            .bind(id)
            .bind(millis(lease_for))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        reader.watch().saw(last);
        // RETURNING keeps no order.
        rows.sort_unstable_by_key(|row| row.0);
        let lease = SqlLease::new(id, rows.iter().map(|row| row.0).collect());
        Ok((lease, rows.into_iter().map(outbox_record).collect()))
    }

    fn finish<'a>(
        reader: &'a OutboxReader,
        lease: &'a SqlLease,
        published: &'a [i64],
        failed: &'a [PublishFailure],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let statements = &reader.outbox().statements().polled;
        polled::finish::<Sqlite, _>(
            reader.pool(),
            BEGIN_IMMEDIATE,
            statements,
            lease,
            published,
            failed,
        )
    }

    fn wait_for_events(
        reader: &OutboxReader,
        timeout: Duration,
    ) -> impl Future<Output = ()> + Send + '_ {
        let statements = &reader.outbox().statements().polled;
        polled::poll_newer::<Sqlite, _>(reader.pool(), statements, reader.watch(), timeout)
    }

    async fn purge_sent(
        reader: &OutboxReader,
        keep: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(sql(&reader.outbox().statements().purge_sent))
            .bind(millis(keep))
            .bind(i64::from(limit))
            .execute(reader.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    fn backlog(
        reader: &OutboxReader,
    ) -> impl Future<Output = Result<(u64, Duration), StoreError>> + Send + '_ {
        polled::backlog::<Sqlite, _>(reader.pool(), &reader.outbox().statements().polled)
    }
}

/// The default outbox, for [`enqueue`].
pub(crate) static DEFAULT_OUTBOX: LazyLock<OutboxWriter> = LazyLock::new(OutboxWriter::default);

/// Enqueues `message` in the default outbox (`dedup_outbox`) inside the
/// transaction `conn` belongs to; returns its event id. In a handler:
/// `dedup_sqlite::enqueue(tx, message).await?`.
pub async fn enqueue(conn: &mut SqliteConnection, message: OutboxMessage) -> Result<String, Error> {
    DEFAULT_OUTBOX.enqueue(conn, message).await
}
