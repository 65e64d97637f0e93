//! What an operator asks of SQLite's tables (the operator tool and the
//! console call these; no SQL lives outside this crate): one claim, the
//! claims per scope, releasing and purging, the outbox's backlog.

use dedup_core::admin::{ClaimRecord, ScopeSummary, TableSize};
use dedup_core::{DedupKey, DedupStore, StoreError};
use dedup_sql::admin::{
    AdminStore, ClaimRow, ClaimsStatements, ScopeRow, claim_record, scope_summary,
};
use dedup_sql::{TableName, sql};
use sqlx::SqlitePool;

use crate::{Error, InvalidTableName, NOW_US, Sqlite, SqliteConfig, SqliteStore, store_error};

/// A claims table, for an operator.
pub type ClaimsTable = dedup_sql::admin::ClaimsTable<Sqlite>;

/// An outbox table, for an operator.
pub type OutboxTable = dedup_sql::admin::OutboxTable<Sqlite>;

impl AdminStore for Sqlite {
    type Db = sqlx::Sqlite;
    type Store = SqliteStore;

    fn table(name: &str) -> Result<TableName, InvalidTableName> {
        TableName::parse_unqualified(name)
    }

    async fn exists(pool: &SqlitePool, _name: &TableName, raw: &str) -> Result<bool, sqlx::Error> {
        let found: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
        )
        .bind(raw)
        .fetch_one(pool)
        .await?;
        Ok(found > 0)
    }

    fn store(pool: SqlitePool, raw: &str) -> Result<SqliteStore, Error> {
        SqliteStore::from_pool_with(pool, SqliteConfig::default().with_table(raw))
    }

    fn pool(store: &SqliteStore) -> &SqlitePool {
        store.pool()
    }

    fn claims_statements(table: &TableName) -> ClaimsStatements {
        let t = table.quoted();
        // On SQLite's clock.
        let columns = format!("claimed_at, expires_at, {NOW_US}, fingerprint, in_progress");
        ClaimsStatements {
            claim: format!("SELECT {columns} FROM {t} WHERE scope = ?1 AND key = ?2").into(),
            release: format!("DELETE FROM {t} WHERE scope = ?1 AND key = ?2 RETURNING {columns}")
                .into(),
            scopes: format!(
                "SELECT scope, count(*), coalesce(sum(expires_at > {NOW_US}), 0), \
                 min(expires_at), max(expires_at) FROM {t} GROUP BY scope ORDER BY scope"
            )
            .into(),
            expired: format!("SELECT count(*) FROM {t} WHERE expires_at <= {NOW_US}").into(),
        }
    }

    async fn claim(table: &ClaimsTable, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        let row: Option<ClaimRow> = sqlx::query_as(sql(&table.statements().claim))
            .bind(key.scope())
            .bind(key.id())
            .fetch_optional(table.pool())
            .await
            .map_err(store_error)?;
        Ok(row.map(claim_record))
    }

    async fn release(
        table: &ClaimsTable,
        key: &DedupKey,
    ) -> Result<Option<ClaimRecord>, StoreError> {
        // The store's write transaction: waits for the write lock up to the
        // lock timeout (5 s), not forever.
        let mut tx = table.store().begin().await?;
        let row: Option<ClaimRow> = sqlx::query_as(sql(&table.statements().release))
            .bind(key.scope())
            .bind(key.id())
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
        table.store().commit(tx).await?;
        Ok(row.map(claim_record))
    }

    async fn scopes(table: &ClaimsTable) -> Result<Vec<ScopeSummary>, StoreError> {
        let rows: Vec<ScopeRow> = sqlx::query_as(sql(&table.statements().scopes))
            .fetch_all(table.pool())
            .await
            .map_err(store_error)?;
        Ok(rows.into_iter().map(scope_summary).collect())
    }

    /// SQLite keeps no per-table sizes without the `dbstat` table: none.
    async fn size(_table: &ClaimsTable) -> Result<Option<TableSize>, StoreError> {
        Ok(None)
    }

    fn backlog_statement(table: &TableName) -> String {
        let t = table.quoted();
        format!(
            "SELECT o.topic, count(*), {NOW_US} - min(o.enqueued_at), \
             coalesce(sum(o.attempts > 0), 0), \
             coalesce(sum(o.leased_until > {NOW_US}), 0), \
             coalesce(sum(o.leased_until <= {NOW_US}), 0), \
             (SELECT l.last_error FROM {t} l WHERE l.topic = o.topic AND l.sent_at IS NULL \
                 AND l.last_error IS NOT NULL ORDER BY l.seq DESC LIMIT 1) \
             FROM {t} o WHERE o.sent_at IS NULL GROUP BY o.topic ORDER BY o.topic"
        )
    }
}
