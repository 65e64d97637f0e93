//! What an operator asks of PostgreSQL's tables (the operator tool and the
//! console call these; no SQL lives outside this crate): one claim, the
//! claims per scope, releasing and purging, the outbox's backlog.

use std::sync::Arc;
use std::time::Duration;

use dedup_core::admin::{
    ClaimRecord, ClaimsAdmin, OutboxAdmin, ScopeSummary, TableSize, TopicBacklog,
};
use dedup_core::{DedupKey, PurgeExpired, StoreError};
use dedup_sql::{TableName, fingerprint_from, sql, time_from_unix_micros};
use sqlx::PgPool;

use crate::{Error, Pg, PgConfig, PgStore, claim_id, store_error};

/// `column` as microseconds since the Unix epoch.
macro_rules! micros {
    ($column:literal) => {
        concat!("(extract(epoch FROM ", $column, ") * 1000000)::int8")
    };
}

/// A claim's columns as [`ClaimRow`] reads them, on the database clock.
const CLAIM_COLUMNS: &str = concat!(
    micros!("claimed_at"),
    ", ",
    micros!("expires_at"),
    ", ",
    micros!("now()"),
    ", fingerprint, in_progress"
);

/// A claim as [`CLAIM_COLUMNS`] lists it.
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
async fn existing(pool: &PgPool, table: &str, what: &'static str) -> Result<TableName, Error> {
    let name = TableName::parse(table)?;
    // The quoted name, parsed by the server as a relation name: a value,
    // never spliced into SQL.
    let found: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(name.quoted())
        .fetch_one(pool)
        .await
        .map_err(Error::database::<Pg>)?;
    match found {
        Some(_) => Ok(name),
        None => Err(Error::NoSuchTable {
            what,
            table: table.to_owned(),
        }),
    }
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A claims table, for an operator.
#[derive(Clone)]
pub struct ClaimsTable {
    store: PgStore,
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
    table: TableName,
    claim: Arc<str>,
    release: Arc<str>,
    scopes: Arc<str>,
    expired: Arc<str>,
}

impl ClaimsTable {
    /// The claims table `table` (`schema.name` or `name`) over `pool`; an
    /// error if the name is invalid or no such table exists.
    pub async fn open(pool: PgPool, table: &str) -> Result<Self, Error> {
        let name = existing(&pool, table, "claims").await?;
        let t = name.quoted();
        let statements = Statements {
            claim: format!("SELECT {CLAIM_COLUMNS} FROM {t} WHERE id = $1").into(),
            release: format!("DELETE FROM {t} WHERE id = $1 RETURNING {CLAIM_COLUMNS}").into(),
            scopes: format!(
                "SELECT scope, count(*)::int8, count(*) FILTER (WHERE expires_at > now())::int8, \
                 {}, {} FROM {t} GROUP BY scope ORDER BY scope",
                micros!("min(expires_at)"),
                micros!("max(expires_at)"),
            )
            .into(),
            expired: format!("SELECT count(*) FROM {t} WHERE expires_at <= now()").into(),
            table: name,
        };
        let store = PgStore::from_pool_with(pool, PgConfig::default().with_table(table))?;
        Ok(ClaimsTable {
            store,
            statements: Arc::new(statements),
        })
    }

    fn pool(&self) -> &PgPool {
        self.store.pool()
    }
}

impl ClaimsAdmin for ClaimsTable {
    async fn claim(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        let row: Option<ClaimRow> = sqlx::query_as(sql(&self.statements.claim))
            .bind(claim_id(key))
            .fetch_optional(self.pool())
            .await
            .map_err(store_error)?;
        Ok(row.map(record))
    }

    async fn release(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        let mut tx = self.pool().begin().await.map_err(store_error)?;
        // A claim held by a running transaction is waited for, not forever.
        sqlx::query("SET LOCAL lock_timeout = '5s'")
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        let row: Option<ClaimRow> = sqlx::query_as(sql(&self.statements.release))
            .bind(claim_id(key))
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
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

    async fn size(&self) -> Result<Option<TableSize>, StoreError> {
        let (table, index, total): (i64, i64, i64) = sqlx::query_as(
            "SELECT pg_relation_size($1::regclass), pg_indexes_size($1::regclass), \
             pg_total_relation_size($1::regclass)",
        )
        .bind(self.statements.table.quoted())
        .fetch_one(self.pool())
        .await
        .map_err(store_error)?;
        Ok(Some(TableSize::new(
            count(table),
            count(index),
            count(total),
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
    pool: PgPool,
    backlog: Arc<str>,
}

impl OutboxTable {
    /// The outbox table `table` over `pool`; an error if the name is
    /// invalid or no such table exists.
    pub async fn open(pool: PgPool, table: &str) -> Result<Self, Error> {
        let name = existing(&pool, table, "outbox").await?;
        // A pending event is leased while a live lease holds it, and in an
        // expired lease when only leases past their time do (its relay
        // died; the next relay to lease takes it over).
        let backlog = format!(
            "WITH leased AS ( \
                 SELECT seq, bool_or(until > now()) AS live \
                 FROM (SELECT unnest(seqs) AS seq, until FROM {}) l GROUP BY seq) \
             SELECT topic, count(*)::int8, \
             {}, \
             count(*) FILTER (WHERE attempts > 0)::int8, \
             count(*) FILTER (WHERE leased.live)::int8, \
             count(*) FILTER (WHERE NOT leased.live)::int8, \
             (array_agg(last_error ORDER BY o.seq DESC) \
                 FILTER (WHERE last_error IS NOT NULL))[1] \
             FROM {} o LEFT JOIN leased USING (seq) \
             WHERE sent_at IS NULL GROUP BY topic ORDER BY topic",
            name.quoted_with_suffix("_leases"),
            micros!("now() - min(enqueued_at)"),
            name.quoted()
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
