//! The transactional outbox on PostgreSQL: [`enqueue`] inside the caller's
//! transaction, [`OutboxReader`] for the relay.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{OutboxMessage, OutboxRecord, PublishFailure};
use dedup_sql::{Outbox, OutboxStore, TableName, sql};
use sqlx::PgConnection;
use sqlx::postgres::PgListener;

use crate::{Error, InvalidTableName, Pg, store_error};

/// An outbox table: [`enqueue`](OutboxWriter::enqueue) events inside your
/// transaction, [`migrate`](OutboxWriter::migrate) it at start-up, and hand
/// [`reader`](OutboxWriter::reader) to a relay. Cloning is cheap.
///
/// ```no_run
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use dedup_core::OutboxMessage;
/// use dedup_postgres::OutboxWriter;
///
/// let outbox = OutboxWriter::default();
/// outbox.migrate(&pool).await?;
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE accounts SET balance = balance + 500 WHERE id = 'a'")
///     .execute(&mut *tx)
///     .await?;
/// let event_id = outbox
///     .enqueue(
///         &mut tx,
///         OutboxMessage::json("payment-recorded", &serde_json::json!({"account": "a"}))?
///             .with_key("a"),
///     )
///     .await?;
/// tx.commit().await?; // the event exists if and only if the change does
/// # let _ = event_id; Ok(()) }
/// ```
pub type OutboxWriter = dedup_sql::OutboxWriter<Pg>;

/// An outbox as a relay reads it: an [`OutboxSource`](dedup_core::outbox::OutboxSource)
/// over a pool. A
/// batch is leased in one short transaction (one row in `<table>_leases`
/// holding its events, with an expiry on the database clock; relays lease
/// one at a time), published with no transaction open, and marked in
/// another short transaction that deletes the lease. Relays wake on
/// `LISTEN`/`NOTIFY` and poll as a fallback.
pub type OutboxReader = dedup_sql::OutboxReader<Pg>;

/// The outbox migrations, rendered with the configured table name.
static OUTBOX_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./outbox-migrations");

/// What happens to an event once the broker acknowledged it (shared by
/// every store's outbox).
pub use dedup_core::outbox::Retention;

/// Settings of an [`OutboxWriter`] (shared by every SQL store's outbox).
pub use dedup_sql::OutboxConfig;

/// The statements of one outbox, built once from its validated name.
pub struct Statements {
    enqueue: Arc<str>,
    lease_lock: Arc<str>,
    lease_pending: Arc<str>,
    mark_sent: Arc<str>,
    record_failures: Arc<str>,
    release: Arc<str>,
    purge_sent: Arc<str>,
    backlog: Arc<str>,
}

impl OutboxStore for Pg {
    type Db = sqlx::Postgres;
    type Statements = Statements;
    type Watch = Wakeups;
    type Lease = PgLease;
    const LEASES_AHEAD: bool = true;

    fn migrator() -> &'static sqlx::migrate::Migrator {
        &OUTBOX_MIGRATOR
    }

    fn table(name: &str) -> Result<TableName, InvalidTableName> {
        TableName::parse(name)
    }

    fn statements(table: &TableName, retention: Retention) -> Statements {
        let t = table.quoted();
        let enqueue = format!(
            "INSERT INTO {t} (event_id, topic, key, payload, header_names, header_values) \
             VALUES (COALESCE($1, gen_random_uuid()::text), $2, $3, $4, $5, $6) \
             RETURNING event_id"
        );
        let leases = table.quoted_with_suffix("_leases");
        // Leasing is one at a time per outbox (a transaction-scoped
        // advisory lock, taken by a statement of its own in a READ
        // COMMITTED transaction, so the lease's statement sees every lease
        // committed before it): no two relays can take the same rows, and
        // no row is locked or written.
        let lease_lock = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))".to_owned();
        // Lease the oldest pending rows no live lease holds, leaving out
        // events backing off after a failure and every later event of
        // their key (so one poison event holds back its key, not the
        // outbox). Of those, keep the rows whose key no live lease holds:
        // taking a later event of a key another relay is publishing would
        // overtake it; the relay's own batch in flight ($3, if any) does
        // not hold its keys back (the relay sends after it and marks
        // nothing past a failure of it). (The filter comes after the
        // LIMIT, so the scan stays as short as the batch even when most
        // keys are held.) Expired leases are removed; the batch's lease is
        // one row.
        let lease_pending = format!(
            "WITH expired AS (DELETE FROM {leases} WHERE until <= now()), \
             held AS MATERIALIZED ( \
                 SELECT id, unnest(seqs) AS seq FROM {leases} WHERE until > now()), \
             held_keys AS MATERIALIZED ( \
                 SELECT DISTINCT o.topic, o.key FROM {t} o \
                 WHERE o.seq = ANY(ARRAY( \
                     SELECT seq FROM held WHERE id IS DISTINCT FROM $3::uuid)) \
                   AND o.sent_at IS NULL AND o.key IS NOT NULL), \
             candidates AS MATERIALIZED ( \
                 SELECT o.seq, o.event_id, o.topic, o.key, o.payload, o.header_names, \
                     o.header_values, o.attempts \
                 FROM {t} o \
                 WHERE o.sent_at IS NULL \
                   AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
                   AND o.seq NOT IN (SELECT seq FROM held) \
                   AND (o.key IS NULL OR NOT EXISTS ( \
                       SELECT 1 FROM {t} f \
                       WHERE f.sent_at IS NULL AND f.next_attempt_at > now() \
                         AND f.topic = o.topic AND f.key = o.key AND f.seq < o.seq)) \
                 ORDER BY o.seq LIMIT $1), \
             taken AS MATERIALIZED ( \
                 SELECT c.* FROM candidates c \
                 WHERE c.key IS NULL OR NOT EXISTS ( \
                     SELECT 1 FROM held_keys k WHERE k.topic = c.topic AND k.key = c.key)), \
             lease AS ( \
                 INSERT INTO {leases} (id, until, seqs) \
                 SELECT gen_random_uuid(), now() + $2 * interval '1 millisecond', array_agg(seq) \
                 FROM taken HAVING count(*) > 0 \
                 RETURNING id) \
             SELECT t.*, (SELECT id FROM lease)::text AS lease_id FROM taken t"
        );
        // Marking is right whoever holds the lease now (the broker
        // acknowledged the event); a row another relay marked first keeps
        // its time.
        let mark_sent = match retention {
            Retention::Delete => format!("DELETE FROM {t} WHERE seq = ANY($1)"),
            Retention::Keep(_) => {
                format!("UPDATE {t} SET sent_at = now() WHERE seq = ANY($1) AND sent_at IS NULL")
            }
        };
        let record_failures = format!(
            "UPDATE {t} AS o SET attempts = o.attempts + 1, last_error = f.error, \
                 next_attempt_at = now() + f.delay_ms * interval '1 millisecond' \
             FROM unnest($1::int8[], $2::text[], $3::int8[]) AS f(seq, error, delay_ms) \
             WHERE o.seq = f.seq AND EXISTS (SELECT 1 FROM {leases} WHERE id = $4::uuid)"
        );
        // What the batch neither published nor failed is offered again at
        // once. A lease that expired was removed by the relay that took its
        // rows over: then its failures are not recorded either (those rows
        // are the other relay's now).
        let release = format!("DELETE FROM {leases} WHERE id = $1::uuid");
        // `= ANY(ARRAY(..))`, not `IN (..)`: the generic plan PostgreSQL
        // caches after five runs made `IN` a hash join over the whole table
        // per batch (tests/purge.rs).
        let purge_sent = format!(
            "DELETE FROM {t} WHERE seq = ANY(ARRAY( \
                 SELECT seq FROM {t} \
                 WHERE sent_at IS NOT NULL AND sent_at < now() - $1 * interval '1 second' \
                 ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED))"
        );
        // Seconds on the database clock, so no date-time crate is needed.
        let backlog = format!(
            "SELECT count(*), \
                 coalesce(extract(epoch FROM now() - min(enqueued_at))::float8, 0) \
             FROM {t} WHERE sent_at IS NULL"
        );
        Statements {
            enqueue: enqueue.into(),
            lease_lock: lease_lock.into(),
            lease_pending: lease_pending.into(),
            mark_sent: mark_sent.into(),
            record_failures: record_failures.into(),
            release: release.into(),
            purge_sent: purge_sent.into(),
            backlog: backlog.into(),
        }
    }

    async fn enqueue(
        outbox: &Outbox<Pg>,
        conn: &mut PgConnection,
        message: OutboxMessage,
    ) -> Result<String, sqlx::Error> {
        let (names, values): (Vec<String>, Vec<Vec<u8>>) = message.headers.into_iter().unzip();
        sqlx::query_scalar(sql(&outbox.statements().enqueue))
            .bind(message.event_id)
            .bind(message.topic)
            .bind(message.key)
            .bind(message.payload)
            .bind(names)
            .bind(values)
            .fetch_one(conn)
            .await
    }

    /// One lease: the advisory lock, then the lease's statement, in one
    /// short transaction. `before`: the caller's batch in flight, whose
    /// keys do not hold this one back.
    async fn lease(
        reader: &OutboxReader,
        limit: usize,
        lease_for: Duration,
        before: Option<&PgLease>,
    ) -> Result<(PgLease, Vec<OutboxRecord>), StoreError> {
        let statements = reader.outbox().statements();
        // Listen before looking, so an event enqueued right after an empty
        // look still wakes the relay.
        ensure_listening(reader).await;
        let mut tx = reader.pool().begin().await.map_err(store_error)?;
        // Whatever the server's default: under REPEATABLE READ the snapshot
        // would be taken before the lock was, and a lease committed while
        // this one waited for it would go unseen (its rows leased twice).
        sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        sqlx::query(sql(&statements.lease_lock))
            .bind(format!("dedup outbox lease {}", reader.outbox().table()))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        let mut rows: Vec<PendingRow> = sqlx::query_as(sql(&statements.lease_pending))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(i64::try_from(lease_for.as_millis()).unwrap_or(i64::MAX))
            .bind(before.and_then(|lease| lease.id.as_deref()))
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        // RETURNING keeps no order.
        rows.sort_unstable_by_key(|row| row.seq);
        let lease = PgLease {
            id: rows.first().map(|row| row.lease_id.clone()),
            seqs: rows.iter().map(|row| row.seq).collect(),
        };
        Ok((lease, rows.into_iter().map(OutboxRecord::from).collect()))
    }

    async fn finish(
        reader: &OutboxReader,
        lease: &PgLease,
        published: &[i64],
        failed: &[PublishFailure],
    ) -> Result<(), StoreError> {
        let Some(lease_id) = &lease.id else {
            return Ok(()); // an empty batch holds nothing
        };
        let statements = reader.outbox().statements();
        let mut tx = reader.pool().begin().await.map_err(store_error)?;
        if !published.is_empty() {
            sqlx::query(sql(&statements.mark_sent))
                .bind(published)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        if !failed.is_empty() {
            let seqs: Vec<i64> = failed.iter().map(|f| f.seq).collect();
            let reasons: Vec<&str> = failed.iter().map(|f| f.reason.as_str()).collect();
            let delays: Vec<i64> = failed
                .iter()
                .map(|f| i64::try_from(f.retry_after.as_millis()).unwrap_or(i64::MAX))
                .collect();
            sqlx::query(sql(&statements.record_failures))
                .bind(seqs)
                .bind(reasons)
                .bind(delays)
                .bind(lease_id)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        // Whatever the batch neither published nor failed goes back with
        // the lease.
        sqlx::query(sql(&statements.release))
            .bind(lease_id)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        let held = dedup_sql::unsettled(&lease.seqs, published, failed);
        if !published.is_empty() || !held.is_empty() {
            // Delivered at commit: another relay whose batch came back short
            // because this one held some of its keys looks again now.
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(reader.outbox().table().to_string())
                .bind(&*reader.watch().own)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)
    }

    async fn wait_for_events(reader: &OutboxReader, timeout: Duration) {
        ensure_listening(reader).await;
        let _ = tokio::time::timeout(timeout, reader.watch().notified.notified()).await;
    }

    async fn purge_sent(
        reader: &OutboxReader,
        keep: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(sql(&reader.outbox().statements().purge_sent))
            .bind(i64::try_from(keep.as_secs()).unwrap_or(i64::MAX))
            .bind(i64::from(limit))
            .execute(reader.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn backlog(reader: &OutboxReader) -> Result<(u64, Duration), StoreError> {
        let (pending, oldest): (i64, f64) =
            sqlx::query_as(sql(&reader.outbox().statements().backlog))
                .fetch_one(reader.pool())
                .await
                .map_err(store_error)?;
        Ok((
            u64::try_from(pending).unwrap_or(0),
            Duration::from_secs_f64(oldest.max(0.0)),
        ))
    }
}

/// The default outbox, for [`enqueue`].
pub(crate) static DEFAULT_OUTBOX: LazyLock<OutboxWriter> = LazyLock::new(OutboxWriter::default);

/// Enqueues `message` in the default outbox (`dedup_outbox`) inside the
/// transaction `conn` belongs to; returns its event id. In a handler:
/// `dedup_postgres::enqueue(tx, message).await?`.
pub async fn enqueue(conn: &mut PgConnection, message: OutboxMessage) -> Result<String, Error> {
    DEFAULT_OUTBOX.enqueue(conn, message).await
}

/// The outbox's notifications, read as they come by a task of their own
/// (while the relay publishes or backs off too): PostgreSQL's shared
/// notification queue is never held back by this listener, and however
/// many arrive between two waits, they wake the relay once.
pub struct Wakeups {
    notified: Arc<tokio::sync::Notify>,
    listening: tokio::sync::Mutex<Listening>,
    /// The payload of this reader's own notifications (a finished batch
    /// wakes the other relays, whose batches may have waited on its keys),
    /// which do not wake it.
    own: Arc<str>,
}

impl Default for Wakeups {
    fn default() -> Self {
        static READERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let n = READERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Wakeups {
            notified: Arc::default(),
            listening: tokio::sync::Mutex::default(),
            own: format!("relay-{}-{now}-{n}", std::process::id()).into(),
        }
    }
}

/// The listener's state.
#[derive(Default)]
struct Listening {
    /// The task reading the listening connection, while it runs.
    task: Option<tokio::task::JoinHandle<()>>,
    /// After a failed try: not before this.
    next_try: Option<tokio::time::Instant>,
}

/// The longest a try to start listening may take, and the pause after one
/// that failed.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(5);

impl Drop for Wakeups {
    // The last reader is gone: stop listening (the connection goes back to
    // the pool).
    fn drop(&mut self) {
        if let Some(task) = self.listening.get_mut().task.take() {
            task.abort();
        }
    }
}

/// Reads notifications until the listener fails; each one but the reader's
/// own, and each reconnection (notifications may have been missed), wakes
/// the relay.
async fn read_notifications(
    mut listener: PgListener,
    notified: Arc<tokio::sync::Notify>,
    own: Arc<str>,
) {
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) if notification.payload() == &*own => {}
            Ok(_) => notified.notify_one(),
            Err(e) => {
                tracing::warn!(error = %e, "outbox: listening failed; polling until it is back");
                notified.notify_one();
                return;
            }
        }
    }
}

/// Starts reading the outbox's channel if no task does. A failure
/// only means the relay polls until the next try.
async fn ensure_listening(reader: &OutboxReader) {
    let mut listening = reader.watch().listening.lock().await;
    if listening
        .task
        .as_ref()
        .is_some_and(|task| !task.is_finished())
    {
        return;
    }
    // After a failure, not on every look: each try may wait for a
    // connection of a busy pool.
    if listening
        .next_try
        .is_some_and(|at| tokio::time::Instant::now() < at)
    {
        return;
    }
    let channel = reader.outbox().table().to_string();
    let connect = async {
        let mut listener = PgListener::connect_with(reader.pool()).await?;
        listener.listen(&channel).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    match tokio::time::timeout(LISTEN_TIMEOUT, connect).await {
        Ok(Ok(listener)) => {
            let notified = reader.watch().notified.clone();
            let own = reader.watch().own.clone();
            listening.task = Some(tokio::spawn(read_notifications(listener, notified, own)));
            listening.next_try = None;
            return;
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "outbox: cannot LISTEN; polling"),
        Err(_) => tracing::warn!("outbox: LISTEN timed out; polling"),
    }
    listening.next_try = Some(tokio::time::Instant::now() + LISTEN_TIMEOUT);
}

/// A batch leased by [`OutboxReader`]: its id and rows.
#[derive(Debug)]
pub struct PgLease {
    id: Option<String>,
    seqs: Vec<i64>,
}

/// A pending row as `lease_pending` returns it, read by column name.
#[derive(sqlx::FromRow)]
struct PendingRow {
    seq: i64,
    event_id: String,
    topic: String,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    header_names: Vec<String>,
    header_values: Vec<Vec<u8>>,
    attempts: i32,
    lease_id: String,
}

impl From<PendingRow> for OutboxRecord {
    fn from(row: PendingRow) -> Self {
        OutboxRecord::new(row.seq, row.event_id, row.topic, row.payload)
            .with_key(row.key)
            .with_headers(
                row.header_names
                    .into_iter()
                    .zip(row.header_values)
                    .collect(),
            )
            .with_attempts(u32::try_from(row.attempts).unwrap_or(0))
    }
}
