//! The transactional outbox on MySQL and MariaDB: [`enqueue`] inside the caller's
//! transaction, [`OutboxReader`] for the relay.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{OutboxMessage, OutboxRecord, PublishFailure, Retention};
use dedup_sql::polled::{self, LastSeq, PolledStatements};
use dedup_sql::{
    Outbox, OutboxRow, OutboxStore, SqlLease, TableName, json_seqs, millis, outbox_record, sql,
};
use sqlx::MySqlConnection;

use crate::{Error, InvalidTableName, MySql, NOW_US, store_error};

/// An outbox table in a MySQL or MariaDB database: [`enqueue`](OutboxWriter::enqueue)
/// events inside your transaction, [`migrate`](OutboxWriter::migrate) it at
/// start-up, and hand [`reader`](OutboxWriter::reader) to a relay. Cloning
/// is cheap.
///
/// ```no_run
/// # async fn example(store: dedup_mysql::MySqlStore) -> Result<(), Box<dyn std::error::Error>> {
/// use dedup_core::OutboxMessage;
/// use dedup_mysql::OutboxWriter;
///
/// let outbox = OutboxWriter::default();
/// outbox.migrate(store.pool()).await?;
/// let mut tx = store.pool().begin().await?;
/// sqlx::query("UPDATE accounts SET balance = balance + 500 WHERE id = 'a'")
///     .execute(&mut *tx)
///     .await?;
/// outbox
///     .enqueue(&mut tx, OutboxMessage::json("payment-recorded", &"a")?.with_key("a"))
///     .await?;
/// tx.commit().await?; // the event exists if and only if the change does
/// # Ok(()) }
/// ```
pub type OutboxWriter = dedup_sql::OutboxWriter<MySql>;

/// An outbox as a relay reads it: an [`OutboxSource`](dedup_core::outbox::OutboxSource)
/// over a pool. A batch is leased with one short transaction (a lease id
/// and an expiry on the server's clock, rows taken `FOR UPDATE SKIP
/// LOCKED`), published with no transaction open, and marked in another.
/// MySQL cannot notify: a waiting relay polls, so an event committed while
/// it waits is published within about 250 ms (events that become available
/// otherwise, within the relay's `poll_interval`).
pub type OutboxReader = dedup_sql::OutboxReader<MySql>;

/// The outbox migrations, rendered with the configured table name.
static OUTBOX_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./outbox-migrations");

/// The statements of one outbox, built once from its validated name.
pub struct Statements {
    enqueue: Arc<str>,
    candidates: Arc<str>,
    earliest: Arc<str>,
    lease: Arc<str>,
    leased: Arc<str>,
    purge_take: Arc<str>,
    purge_delete: Arc<str>,
    polled: PolledStatements,
}

/// A JSON array of sequence numbers as rows `js.s`.
const JSON_SEQS: &str = "JSON_TABLE(?, '$[*]' COLUMNS (s BIGINT PATH '$')) AS js";

/// A transaction at READ COMMITTED: InnoDB locks only the rows it takes,
/// not the gaps around them, and plain reads see the newest commits.
pub(crate) const BEGIN_READ_COMMITTED: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

impl OutboxStore for MySql {
    type Db = sqlx::MySql;
    type Statements = Statements;
    type Watch = LastSeq;
    type Lease = SqlLease;

    fn migrator() -> &'static sqlx::migrate::Migrator {
        &OUTBOX_MIGRATOR
    }

    fn table(name: &str) -> Result<TableName, InvalidTableName> {
        Ok(TableName::parse_unqualified(name)?.with_backticks())
    }

    fn statements(table: &TableName, retention: Retention) -> Statements {
        let t = table.quoted();
        let enqueue = format!(
            "INSERT INTO {t} (event_id, topic, msg_key, payload, headers, enqueued_at) \
             VALUES (?, ?, ?, ?, ?, {NOW_US})"
        );
        // The oldest pending rows that are neither backing off nor leased,
        // without a held earlier row of their key, locked; rows another
        // relay is leasing right now are skipped, not waited for.
        let candidates = format!(
            "SELECT o.seq, o.key_hash FROM {t} o \
             WHERE o.sent_at IS NULL \
               AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= {NOW_US}) \
               AND (o.leased_until IS NULL OR o.leased_until <= {NOW_US}) \
               AND (o.key_hash IS NULL OR NOT EXISTS ( \
                   SELECT 1 FROM {t} f \
                   WHERE f.key_hash = o.key_hash AND f.seq < o.seq AND f.sent_at IS NULL \
                     AND (f.next_attempt_at > {NOW_US} OR f.leased_until > {NOW_US}))) \
             ORDER BY o.seq LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        // Of the candidates' keys, the earliest pending row that is not a
        // candidate: one a relay skipped because another is leasing it
        // right now (uncommitted, so the check above could not see it).
        // A candidate after it would overtake it.
        let earliest = format!(
            "SELECT o.key_hash, MIN(o.seq) FROM {t} o \
             WHERE o.sent_at IS NULL \
               AND o.key_hash IN (SELECT UNHEX(jh.h) FROM \
                   JSON_TABLE(?, '$[*]' COLUMNS (h VARCHAR(64) PATH '$')) AS jh) \
               AND o.seq NOT IN (SELECT js.s FROM {JSON_SEQS}) \
             GROUP BY o.key_hash"
        );
        let lease = format!(
            "UPDATE {t} o JOIN {JSON_SEQS} ON o.seq = js.s \
             SET o.lease_id = ?, o.leased_until = {NOW_US} + ? * 1000"
        );
        let leased = format!(
            "SELECT o.seq, o.event_id, o.topic, o.msg_key, o.payload, o.headers, \
                 CAST(o.attempts AS SIGNED) \
             FROM {t} o JOIN {JSON_SEQS} ON o.seq = js.s ORDER BY o.seq"
        );
        let mark_sent = match retention {
            Retention::Delete => format!("DELETE o FROM {t} o JOIN {JSON_SEQS} ON o.seq = js.s"),
            Retention::Keep(_) => format!(
                "UPDATE {t} o JOIN {JSON_SEQS} ON o.seq = js.s \
                 SET o.sent_at = {NOW_US}, o.lease_id = NULL, o.leased_until = NULL \
                 WHERE o.sent_at IS NULL"
            ),
        };
        let record_failure = format!(
            "UPDATE {t} SET attempts = attempts + 1, last_error = ?, \
                 next_attempt_at = {NOW_US} + ? * 1000, lease_id = NULL, leased_until = NULL \
             WHERE seq = ? AND lease_id = ?"
        );
        let release = format!(
            "UPDATE {t} o JOIN {JSON_SEQS} ON o.seq = js.s \
             SET o.lease_id = NULL, o.leased_until = NULL WHERE o.lease_id = ?"
        );
        let purge_take = format!(
            "SELECT seq FROM {t} WHERE sent_at IS NOT NULL AND sent_at < {NOW_US} - ? * 1000 \
             ORDER BY sent_at LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        let backlog = format!(
            "SELECT COUNT(*), CAST(COALESCE({NOW_US} - MIN(enqueued_at), 0) AS SIGNED) FROM {t} \
             WHERE sent_at IS NULL"
        );
        Statements {
            enqueue: enqueue.into(),
            candidates: candidates.into(),
            earliest: earliest.into(),
            lease: lease.into(),
            leased: leased.into(),
            purge_take: purge_take.into(),
            purge_delete: format!("DELETE o FROM {t} o JOIN {JSON_SEQS} ON o.seq = js.s").into(),
            polled: PolledStatements {
                last_seq: format!("SELECT CAST(COALESCE(MAX(seq), 0) AS SIGNED) FROM {t}").into(),
                mark_sent: mark_sent.into(),
                record_failure: record_failure.into(),
                release: release.into(),
                backlog: backlog.into(),
            },
        }
    }

    fn enqueue<'a>(
        outbox: &'a Outbox<MySql>,
        conn: &'a mut MySqlConnection,
        message: OutboxMessage,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send + 'a {
        polled::enqueue::<sqlx::MySql>(conn, &outbox.statements().enqueue, message)
    }

    async fn lease(
        reader: &OutboxReader,
        limit: usize,
        lease_for: Duration,
        _before: Option<&SqlLease>,
    ) -> Result<(SqlLease, Vec<OutboxRecord>), StoreError> {
        again_after_deadlock(|| lease_once(reader, limit, lease_for)).await
    }

    async fn finish(
        reader: &OutboxReader,
        lease: &SqlLease,
        published: &[i64],
        failed: &[PublishFailure],
    ) -> Result<(), StoreError> {
        let (pool, statements) = (reader.pool(), &reader.outbox().statements().polled);
        again_after_deadlock(|| {
            polled::finish::<MySql, _>(
                pool,
                BEGIN_READ_COMMITTED,
                statements,
                lease,
                published,
                failed,
            )
        })
        .await
    }

    fn wait_for_events(
        reader: &OutboxReader,
        timeout: Duration,
    ) -> impl Future<Output = ()> + Send + '_ {
        let statements = &reader.outbox().statements().polled;
        polled::poll_newer::<MySql, _>(reader.pool(), statements, reader.watch(), timeout)
    }

    async fn purge_sent(
        reader: &OutboxReader,
        keep: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let statements = reader.outbox().statements();
        let mut tx = reader
            .pool()
            .begin_with(BEGIN_READ_COMMITTED)
            .await
            .map_err(store_error)?;
        let seqs: Vec<i64> = sqlx::query_scalar(sql(&statements.purge_take))
            .bind(millis(keep))
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        if seqs.is_empty() {
            tx.rollback().await.map_err(store_error)?;
            return Ok(0);
        }
        let done = sqlx::query(sql(&statements.purge_delete))
            .bind(json_seqs(&seqs))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(done.rows_affected())
    }

    fn backlog(
        reader: &OutboxReader,
    ) -> impl Future<Output = Result<(u64, Duration), StoreError>> + Send + '_ {
        polled::backlog::<MySql, _>(reader.pool(), &reader.outbox().statements().polled)
    }
}

/// The default outbox, for [`enqueue`].
pub(crate) static DEFAULT_OUTBOX: LazyLock<OutboxWriter> = LazyLock::new(OutboxWriter::default);

/// Enqueues `message` in the default outbox (`dedup_outbox`) inside the
/// transaction `conn` belongs to; returns its event id. In a handler:
/// `dedup_mysql::enqueue(tx, message).await?`.
pub async fn enqueue(conn: &mut MySqlConnection, message: OutboxMessage) -> Result<String, Error> {
    DEFAULT_OUTBOX.enqueue(conn, message).await
}

/// One lease, in one transaction.
async fn lease_once(
    reader: &OutboxReader,
    limit: usize,
    lease_for: Duration,
) -> Result<(SqlLease, Vec<OutboxRecord>), StoreError> {
    let statements = reader.outbox().statements();
    let id = SqlLease::new_id();
    let mut tx = reader
        .pool()
        .begin_with(BEGIN_READ_COMMITTED)
        .await
        .map_err(store_error)?;
    let last: i64 = sqlx::query_scalar(sql(&statements.polled.last_seq))
        .fetch_one(&mut *tx)
        .await
        .map_err(store_error)?;
    let candidates: Vec<(i64, Option<Vec<u8>>)> = sqlx::query_as(sql(&statements.candidates))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?;
    let mut taken: Vec<i64> = candidates.iter().map(|(seq, _)| *seq).collect();
    let keys: HashSet<&[u8]> = candidates
        .iter()
        .filter_map(|(_, k)| k.as_deref())
        .collect();
    if !keys.is_empty() {
        let hex: Vec<String> = keys.iter().map(|k| to_hex(k)).collect();
        let earliest: Vec<(Vec<u8>, i64)> = sqlx::query_as(sql(&statements.earliest))
            .bind(serde_json::Value::from(hex).to_string())
            .bind(json_seqs(&taken))
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        let earliest: HashMap<Vec<u8>, i64> = earliest.into_iter().collect();
        taken = candidates
            .iter()
            .filter(|(seq, key)| {
                key.as_ref()
                    .and_then(|k| earliest.get(k))
                    .is_none_or(|first| seq < first)
            })
            .map(|(seq, _)| *seq)
            .collect();
    }
    let rows: Vec<OutboxRow> = if taken.is_empty() {
        Vec::new()
    } else {
        let seqs = json_seqs(&taken);
        sqlx::query(sql(&statements.lease))
            .bind(&seqs)
            .bind(id)
            .bind(millis(lease_for))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        sqlx::query_as(sql(&statements.leased))
            .bind(&seqs)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?
    };
    tx.commit().await.map_err(store_error)?;
    reader.watch().saw(last);
    let lease = SqlLease::new(id, rows.iter().map(|row| row.0).collect());
    Ok((lease, rows.into_iter().map(outbox_record).collect()))
}

/// How many times a transaction InnoDB chose as a deadlock's victim is run.
const DEADLOCK_ATTEMPTS: u32 = 5;

/// Runs `attempt` again when InnoDB rolled it back as a deadlock's victim
/// (1213: concurrent relays' leases and markings lock the same rows
/// through different indexes, in different orders), as MySQL's manual
/// says to: the whole transaction was undone, so running it again takes
/// nothing twice. Any other error, or a deadlock on the last attempt, is
/// returned.
async fn again_after_deadlock<T, F, Fut>(mut attempt: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut tries = 1;
    loop {
        match attempt().await {
            Err(e) if tries < DEADLOCK_ATTEMPTS && is_deadlock(&e) => tries += 1,
            done => return done,
        }
    }
}

/// Whether InnoDB rolled the transaction back as a deadlock's victim.
fn is_deadlock(e: &StoreError) -> bool {
    e.code()
        .is_some_and(|code| code.split('/').next() == Some("1213"))
}

/// `bytes` as lowercase hexadecimal, for `UNHEX`.
fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failing(code: &str) -> StoreError {
        StoreError::contention("refused").with_code(code)
    }

    #[tokio::test]
    async fn a_deadlock_victim_runs_again_and_nothing_else_does() {
        // Two deadlocks, then through: three runs, the result of the third.
        let mut runs = 0;
        let out = again_after_deadlock(|| {
            runs += 1;
            let n = runs;
            async move {
                if n < 3 {
                    Err(failing("1213/40001"))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(out.expect("through on the third run"), 3);

        // A lock wait timeout rolls back one statement, not the
        // transaction: returned at once.
        let mut runs = 0;
        let out = again_after_deadlock(|| {
            runs += 1;
            async { Err::<(), _>(failing("1205/HY000")) }
        })
        .await;
        assert_eq!(out.expect_err("returned").code(), Some("1205/HY000"));
        assert_eq!(runs, 1);

        // Deadlocked every time: given up after DEADLOCK_ATTEMPTS runs.
        let mut runs = 0;
        let out = again_after_deadlock(|| {
            runs += 1;
            async { Err::<(), _>(failing("1213/40001")) }
        })
        .await;
        assert!(is_deadlock(&out.expect_err("given up")));
        assert_eq!(runs, DEADLOCK_ATTEMPTS);
    }
}
