//! What an operator asks of MySQL's tables (the operator tool and the
//! console call these; no SQL lives outside this crate): one claim, the
//! claims per scope, releasing and purging, the outbox's backlog.

use std::sync::Arc;
use std::time::Duration;

use dedup_core::admin::{
    ClaimRecord, ClaimsAdmin, OutboxAdmin, ScopeSummary, TableSize, TopicBacklog,
};
use dedup_core::{DedupKey, DedupStore, PurgeExpired, StoreError};
use dedup_sql::{TableName, fingerprint_from, sql, time_from_unix_micros};
use sqlx::MySqlPool;

use crate::{Error, MySql, MySqlConfig, MySqlStore, NOW_US, store_error};

/// A claim's columns as [`ClaimRow`] reads them, on the server's clock.
fn claim_columns() -> String {
    format!("claimed_at, expires_at, {NOW_US}, fingerprint, in_progress")
}

/// A claim as [`claim_columns`] lists it.
type ClaimRow = (i64, i64, i64, Option<Vec<u8>>, i8);

fn record((claimed, expires, now, fingerprint, in_progress): ClaimRow) -> ClaimRecord {
    ClaimRecord::new(
        time_from_unix_micros(claimed),
        time_from_unix_micros(expires),
        time_from_unix_micros(now),
    )
    .with_fingerprint(fingerprint_from(fingerprint))
    .with_in_progress(in_progress != 0)
}

/// Checks that `table` names an existing table of the connection's
/// database; `what` says whose.
async fn existing(pool: &MySqlPool, table: &str, what: &'static str) -> Result<TableName, Error> {
    let name = TableName::parse_unqualified(table)?.with_backticks();
    let found: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES \
         WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .map_err(Error::database::<MySql>)?;
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
    store: MySqlStore,
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
    raw: String,
    claim: Arc<str>,
    locked: Arc<str>,
    release: Arc<str>,
    scopes: Arc<str>,
    expired: Arc<str>,
}

impl ClaimsTable {
    /// The claims table `table` (in the connection's database) over
    /// `pool`; an error if the name is invalid or no such table exists.
    pub async fn open(pool: MySqlPool, table: &str) -> Result<Self, Error> {
        let name = existing(&pool, table, "claims").await?;
        let t = name.quoted();
        let columns = claim_columns();
        let statements = Statements {
            raw: table.to_owned(),
            claim: format!("SELECT {columns} FROM {t} WHERE scope = ? AND id = ?").into(),
            locked: format!("SELECT {columns} FROM {t} WHERE scope = ? AND id = ? FOR UPDATE")
                .into(),
            release: format!("DELETE FROM {t} WHERE scope = ? AND id = ?").into(),
            scopes: format!(
                "SELECT scope, COUNT(*), CAST(COALESCE(SUM(expires_at > {NOW_US}), 0) AS SIGNED), \
                 MIN(expires_at), MAX(expires_at) FROM {t} GROUP BY scope ORDER BY scope"
            )
            .into(),
            expired: format!("SELECT COUNT(*) FROM {t} WHERE expires_at <= {NOW_US}").into(),
        };
        let store = MySqlStore::from_pool_with(pool, MySqlConfig::default().with_table(table))?;
        Ok(ClaimsTable {
            store,
            statements: Arc::new(statements),
        })
    }

    fn pool(&self) -> &MySqlPool {
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
        // The store's transaction: a claim an open transaction holds is
        // waited for up to the lock timeout (5 s), not forever.
        let mut tx = self.store.begin().await?;
        let row: Option<ClaimRow> = sqlx::query_as(sql(&self.statements.locked))
            .bind(key.scope())
            .bind(key.id())
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
        if row.is_some() {
            sqlx::query(sql(&self.statements.release))
                .bind(key.scope())
                .bind(key.id())
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        self.store.commit(tx).await?;
        Ok(row.map(record))
    }

    async fn scopes(&self) -> Result<Vec<ScopeSummary>, StoreError> {
        let rows: Vec<(Vec<u8>, i64, i64, i64, i64)> = sqlx::query_as(sql(&self.statements.scopes))
            .fetch_all(self.pool())
            .await
            .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(|(scope, rows, live, oldest, newest)| {
                ScopeSummary::new(
                    String::from_utf8_lossy(&scope).into_owned(),
                    count(rows),
                    count(live),
                    time_from_unix_micros(oldest),
                    time_from_unix_micros(newest),
                )
            })
            .collect())
    }

    async fn size(&self) -> Result<Option<TableSize>, StoreError> {
        // InnoDB's estimates, refreshed with its statistics.
        let (table, index): (i64, i64) = sqlx::query_as(
            "SELECT CAST(data_length AS SIGNED), CAST(index_length AS SIGNED) \
             FROM information_schema.TABLES WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(&self.statements.raw)
        .fetch_one(self.pool())
        .await
        .map_err(store_error)?;
        Ok(Some(TableSize::new(
            count(table),
            count(index),
            count(table + index),
        )))
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
    pool: MySqlPool,
    backlog: Arc<str>,
}

impl OutboxTable {
    /// The outbox table `table` over `pool`; an error if the name is
    /// invalid or no such table exists.
    pub async fn open(pool: MySqlPool, table: &str) -> Result<Self, Error> {
        let t = existing(&pool, table, "outbox").await?.quoted();
        let backlog = format!(
            "SELECT o.topic, COUNT(*), CAST({NOW_US} - MIN(o.enqueued_at) AS SIGNED), \
             CAST(COALESCE(SUM(o.attempts > 0), 0) AS SIGNED), \
             CAST(COALESCE(SUM(o.leased_until > {NOW_US}), 0) AS SIGNED), \
             CAST(COALESCE(SUM(o.leased_until <= {NOW_US}), 0) AS SIGNED), \
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
