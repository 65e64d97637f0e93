//! What an operator asks of SQLite's tables (the operator tool and the
//! console call these; no SQL lives outside this crate): one claim, the
//! claims per scope, releasing and purging, the outbox's backlog.

use std::sync::Arc;
use std::time::Duration;

use dedup_core::admin::{
    ClaimRecord, ClaimsAdmin, OutboxAdmin, ScopeSummary, TableSize, TopicBacklog,
};
use dedup_core::{DedupKey, DedupStore, PurgeExpired, StoreError};
use dedup_sql::{TableName, fingerprint_from, sql, time_from_unix_micros};
use sqlx::SqlitePool;

use crate::{Error, NOW_US, Sqlite, SqliteConfig, SqliteStore, store_error};

/// A claim's columns as [`ClaimRow`] reads them, on SQLite's clock.
fn claim_columns() -> String {
    format!("claimed_at, expires_at, {NOW_US}, fingerprint, in_progress")
}

/// A claim as [`claim_columns`] lists it.
type ClaimRow = (i64, i64, i64, Option<Vec<u8>>, bool);

fn record((claimed, expires, now, fingerprint, in_progress): ClaimRow) -> ClaimRecord {
    ClaimRecord::new(
        time_from_unix_micros(claimed),
        time_from_unix_micros(expires),
        time_from_unix_micros(now),
    )
    .with_fingerprint(fingerprint_from(fingerprint))
    .with_in_progress(in_progress)
}

/// Checks that `table` names an existing table; `what` says whose.
async fn existing(pool: &SqlitePool, table: &str, what: &'static str) -> Result<TableName, Error> {
    let name = TableName::parse_unqualified(table)?;
    let found: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1")
            .bind(table)
            .fetch_one(pool)
            .await
            .map_err(Error::database::<Sqlite>)?;
    match found {
        0 => Err(Error::NoSuchTable {
            what,
            table: table.to_owned(),
        }),
        _ => Ok(name),
    }
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A claims table, for an operator.
#[derive(Clone)]
pub struct ClaimsTable {
    store: SqliteStore,
    statements: Arc<Statements>,
}

impl std::fmt::Debug for ClaimsTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimsTable")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

struct Statements {
    claim: Arc<str>,
    release: Arc<str>,
    scopes: Arc<str>,
    expired: Arc<str>,
}

impl ClaimsTable {
    /// The claims table `table` over `pool`; an error if the name is
    /// invalid or no such table exists.
    pub async fn open(pool: SqlitePool, table: &str) -> Result<Self, Error> {
        let t = existing(&pool, table, "claims").await?.quoted();
        let columns = claim_columns();
        let statements = Statements {
            claim: format!("SELECT {columns} FROM {t} WHERE scope = ?1 AND key = ?2").into(),
            release: format!("DELETE FROM {t} WHERE scope = ?1 AND key = ?2 RETURNING {columns}")
                .into(),
            scopes: format!(
                "SELECT scope, count(*), coalesce(sum(expires_at > {NOW_US}), 0), \
                 min(expires_at), max(expires_at) FROM {t} GROUP BY scope ORDER BY scope"
            )
            .into(),
            expired: format!("SELECT count(*) FROM {t} WHERE expires_at <= {NOW_US}").into(),
        };
        let store = SqliteStore::from_pool_with(pool, SqliteConfig::default().with_table(table))?;
        Ok(ClaimsTable {
            store,
            statements: Arc::new(statements),
        })
    }

    fn pool(&self) -> &SqlitePool {
        self.store.pool()
    }
}

impl ClaimsAdmin for ClaimsTable {
    async fn claim(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        let row: Option<ClaimRow> = sqlx::query_as(sql(&self.statements.claim))
            .bind(key.scope())
            .bind(key.id())
            .fetch_optional(self.pool())
            .await
            .map_err(store_error)?;
        Ok(row.map(record))
    }

    async fn release(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        // The store's write transaction: waits for the write lock up to the
        // lock timeout (5 s), not forever.
        let mut tx = self.store.begin().await?;
        let row: Option<ClaimRow> = sqlx::query_as(sql(&self.statements.release))
            .bind(key.scope())
            .bind(key.id())
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
        self.store.commit(tx).await?;
        Ok(row.map(record))
    }

    async fn scopes(&self) -> Result<Vec<ScopeSummary>, StoreError> {
        let rows: Vec<(String, i64, i64, i64, i64)> = sqlx::query_as(sql(&self.statements.scopes))
            .fetch_all(self.pool())
            .await
            .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(|(scope, rows, live, oldest, newest)| {
                ScopeSummary::new(
                    scope,
                    count(rows),
                    count(live),
                    time_from_unix_micros(oldest),
                    time_from_unix_micros(newest),
                )
            })
            .collect())
    }

    /// SQLite keeps no per-table sizes without the `dbstat` table: none.
    async fn size(&self) -> Result<Option<TableSize>, StoreError> {
        Ok(None)
    }

    async fn expired(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(sql(&self.statements.expired))
            .fetch_one(self.pool())
            .await
            .map_err(store_error)?;
        Ok(count(n))
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        self.store.purge_expired(limit).await
    }
}

/// An outbox table, for an operator.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    pool: SqlitePool,
    backlog: Arc<str>,
}

impl OutboxTable {
    /// The outbox table `table` over `pool`; an error if the name is
    /// invalid or no such table exists.
    pub async fn open(pool: SqlitePool, table: &str) -> Result<Self, Error> {
        let t = existing(&pool, table, "outbox").await?.quoted();
        let backlog = format!(
            "SELECT o.topic, count(*), {NOW_US} - min(o.enqueued_at), \
             coalesce(sum(o.attempts > 0), 0), \
             coalesce(sum(o.leased_until > {NOW_US}), 0), \
             coalesce(sum(o.leased_until <= {NOW_US}), 0), \
             (SELECT l.last_error FROM {t} l WHERE l.topic = o.topic AND l.sent_at IS NULL \
                 AND l.last_error IS NOT NULL ORDER BY l.seq DESC LIMIT 1) \
             FROM {t} o WHERE o.sent_at IS NULL GROUP BY o.topic ORDER BY o.topic"
        );
        Ok(OutboxTable {
            pool,
            backlog: backlog.into(),
        })
    }
}

impl OutboxAdmin for OutboxTable {
    async fn backlog_by_topic(&self) -> Result<Vec<TopicBacklog>, StoreError> {
        type Row = (String, i64, i64, i64, i64, i64, Option<String>);
        let rows: Vec<Row> = sqlx::query_as(sql(&self.backlog))
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(topic, pending, age_us, failing, leased, expired, error)| {
                    TopicBacklog::new(topic, count(pending), Duration::from_micros(count(age_us)))
                        .with_failing(count(failing), error)
                        .with_leases(count(leased), count(expired))
                },
            )
            .collect())
    }
}
