//! What the outboxes without notifications share (SQLite's and MySQL's):
//! writing an event with its headers in one column, a wait that polls for
//! a newer sequence number, and settling a batch whose lease is the list
//! of its sequence numbers.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{OutboxMessage, PublishFailure, poll_for_events};
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Pool, Type};

use crate::{Dialect, SqlLease, encode_headers, json_seqs, millis, sql, store_error, unsettled};

/// The newest sequence number a reader saw when it last leased: a wait
/// ends once the outbox has another.
#[derive(Debug, Default)]
pub struct LastSeq(AtomicI64);

impl LastSeq {
    /// Notes `seq`, read in a lease that then committed.
    pub fn saw(&self, seq: i64) {
        self.0.store(seq, Ordering::Release);
    }
}

/// The statements a polled outbox settles and watches with, each binding
/// what its comment says.
#[derive(Debug)]
pub struct PolledStatements {
    /// The newest sequence number (0 for none).
    pub last_seq: Arc<str>,
    /// Marks sent (or deletes) the events of a JSON array of sequence
    /// numbers.
    pub mark_sent: Arc<str>,
    /// Records a failed attempt: reason, back-off in ms, sequence number,
    /// lease id.
    pub record_failure: Arc<str>,
    /// Releases the events of a JSON array of sequence numbers held by a
    /// lease id.
    pub release: Arc<str>,
    /// How many events wait and for how many microseconds the oldest has.
    pub backlog: Arc<str>,
}

/// Writes `message` with `enqueue` (binding event id, topic, key, payload
/// and the headers as [`encode_headers`] writes them) inside the
/// transaction `conn` belongs to; returns its event id (the message's, or
/// a new random UUID).
pub async fn enqueue<DB>(
    conn: &mut DB::Connection,
    enqueue: &Arc<str>,
    message: OutboxMessage,
) -> Result<String, sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<Vec<u8>>: Encode<'q, DB> + Type<DB>,
{
    let event_id = message
        .event_id
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    sqlx::query(sql(enqueue))
        .bind(event_id.clone())
        .bind(message.topic)
        .bind(message.key)
        .bind(message.payload)
        .bind(encode_headers(&message.headers))
        .execute(conn)
        .await?;
    Ok(event_id)
}

/// Settles a batch inside the caller's transaction `conn`: marks
/// `published`, records `failed`, releases the rest of `lease`.
pub async fn settle<DB>(
    conn: &mut DB::Connection,
    statements: &PolledStatements,
    lease: &SqlLease,
    published: &[i64],
    failed: &[PublishFailure],
) -> Result<(), sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    if !published.is_empty() {
        sqlx::query(sql(&statements.mark_sent))
            .bind(json_seqs(published))
            .execute(&mut *conn)
            .await?;
    }
    for failure in failed {
        sqlx::query(sql(&statements.record_failure))
            .bind(failure.reason.as_str())
            .bind(millis(failure.retry_after))
            .bind(failure.seq)
            .bind(lease.id())
            .execute(&mut *conn)
            .await?;
    }
    let held = unsettled(lease.seqs(), published, failed);
    if !held.is_empty() {
        sqlx::query(sql(&statements.release))
            .bind(json_seqs(&held))
            .bind(lease.id())
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// Settles a batch in a transaction of its own, begun with `begin`
/// ([`settle`]); nothing to do for an empty lease with nothing published.
pub async fn finish<D, DB>(
    pool: &Pool<DB>,
    begin: &'static str,
    statements: &PolledStatements,
    lease: &SqlLease,
    published: &[i64],
    failed: &[PublishFailure],
) -> Result<(), StoreError>
where
    D: Dialect,
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    if lease.seqs().is_empty() && published.is_empty() {
        return Ok(());
    }
    let mut tx = pool.begin_with(begin).await.map_err(store_error::<D>)?;
    settle::<DB>(&mut tx, statements, lease, published, failed)
        .await
        .map_err(store_error::<D>)?;
    tx.commit().await.map_err(store_error::<D>)
}

/// Waits at most `timeout` for a sequence number newer than the last one
/// `seen` noted, looking every 250 ms.
pub async fn poll_newer<D, DB>(
    pool: &Pool<DB>,
    statements: &PolledStatements,
    seen: &LastSeq,
    timeout: Duration,
) where
    D: Dialect,
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    (i64,): for<'r> FromRow<'r, DB::Row>,
{
    let seen = seen.0.load(Ordering::Acquire);
    poll_for_events(timeout, || async {
        let last: i64 = sqlx::query_scalar(sql(&statements.last_seq))
            .fetch_one(pool)
            .await
            .map_err(store_error::<D>)?;
        Ok(last != seen)
    })
    .await;
}

/// How many events wait and how long the oldest has.
pub async fn backlog<D, DB>(
    pool: &Pool<DB>,
    statements: &PolledStatements,
) -> Result<(u64, Duration), StoreError>
where
    D: Dialect,
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    (i64, i64): for<'r> FromRow<'r, DB::Row>,
{
    let (pending, oldest_us): (i64, i64) = sqlx::query_as(sql(&statements.backlog))
        .fetch_one(pool)
        .await
        .map_err(store_error::<D>)?;
    Ok((
        u64::try_from(pending).unwrap_or(0),
        Duration::from_micros(u64::try_from(oldest_us).unwrap_or(0)),
    ))
}
