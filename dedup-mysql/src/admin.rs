//! What an operator asks of MySQL's tables (the operator tool and the
//! console call these; no SQL lives outside this crate): one claim, the
//! claims per scope, releasing and purging, the outbox's backlog.

use dedup_core::admin::{ClaimRecord, ScopeSummary, TableSize};
use dedup_core::{DedupKey, DedupStore, StoreError};
use dedup_sql::admin::{
    AdminStore, ClaimRow, ClaimsStatements, claim_record, count, scope_summary,
};
use dedup_sql::{TableName, sql};
use sqlx::MySqlPool;

use crate::{Error, InvalidTableName, MySql, MySqlConfig, MySqlStore, NOW_US, store_error};

/// A claims table (in the connection's database), for an operator.
pub type ClaimsTable = dedup_sql::admin::ClaimsTable<MySql>;

/// An outbox table (in the connection's database), for an operator.
pub type OutboxTable = dedup_sql::admin::OutboxTable<MySql>;

/// The size of a table of the connection's database, as InnoDB estimates
/// it (refreshed with its statistics).
const TABLE_SIZE: &str = "SELECT CAST(data_length AS SIGNED), CAST(index_length AS SIGNED) \
     FROM information_schema.TABLES WHERE table_schema = DATABASE() AND table_name = ?";

impl AdminStore for MySql {
    type Db = sqlx::MySql;
    type Store = MySqlStore;

    fn table(name: &str) -> Result<TableName, InvalidTableName> {
        Ok(TableName::parse_unqualified(name)?.with_backticks())
    }

    async fn exists(pool: &MySqlPool, _name: &TableName, raw: &str) -> Result<bool, sqlx::Error> {
        let found: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.TABLES \
             WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(raw)
        .fetch_one(pool)
        .await?;
        Ok(found > 0)
    }

    fn store(pool: MySqlPool, raw: &str) -> Result<MySqlStore, Error> {
        MySqlStore::from_pool_with(pool, MySqlConfig::default().with_table(raw))
    }

    fn pool(store: &MySqlStore) -> &MySqlPool {
        store.pool()
    }

    fn claims_statements(table: &TableName) -> ClaimsStatements {
        let t = table.quoted();
        // On the server's clock.
        let columns = format!("claimed_at, expires_at, {NOW_US}, fingerprint, in_progress");
        ClaimsStatements {
            claim: format!("SELECT {columns} FROM {t} WHERE scope = ? AND id = ?").into(),
            release: format!("DELETE FROM {t} WHERE scope = ? AND id = ?").into(),
            scopes: format!(
                "SELECT scope, COUNT(*), CAST(COALESCE(SUM(expires_at > {NOW_US}), 0) AS SIGNED), \
                 MIN(expires_at), MAX(expires_at) FROM {t} GROUP BY scope ORDER BY scope"
            )
            .into(),
            expired: format!("SELECT COUNT(*) FROM {t} WHERE expires_at <= {NOW_US}").into(),
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
        // The store's transaction: a claim an open transaction holds is
        // waited for up to the lock timeout (5 s), not forever. MySQL
        // cannot return what it deleted: the row is read, locked, first.
        let locked = format!("{} FOR UPDATE", table.statements().claim);
        let mut tx = table.store().begin().await?;
        let row: Option<ClaimRow> = sqlx::query_as(sqlx::AssertSqlSafe(locked))
            .bind(key.scope())
            .bind(key.id())
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
        if row.is_some() {
            sqlx::query(sql(&table.statements().release))
                .bind(key.scope())
                .bind(key.id())
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        table.store().commit(tx).await?;
        Ok(row.map(claim_record))
    }

    async fn scopes(table: &ClaimsTable) -> Result<Vec<ScopeSummary>, StoreError> {
        // Scopes are byte strings here.
        let rows: Vec<(Vec<u8>, i64, i64, i64, i64)> =
            sqlx::query_as(sql(&table.statements().scopes))
                .fetch_all(table.pool())
                .await
                .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(|(scope, rows, live, oldest, newest)| {
                let scope = String::from_utf8_lossy(&scope).into_owned();
                scope_summary((scope, rows, live, oldest, newest))
            })
            .collect())
    }

    async fn size(table: &ClaimsTable) -> Result<Option<TableSize>, StoreError> {
        let (data, index): (i64, i64) = sqlx::query_as(TABLE_SIZE)
            .bind(table.raw_name())
            .fetch_one(table.pool())
            .await
            .map_err(store_error)?;
        Ok(Some(TableSize::new(
            count(data),
            count(index),
            count(data + index),
        )))
    }

    fn backlog_statement(table: &TableName) -> String {
        let t = table.quoted();
        format!(
            "SELECT o.topic, COUNT(*), CAST({NOW_US} - MIN(o.enqueued_at) AS SIGNED), \
             CAST(COALESCE(SUM(o.attempts > 0), 0) AS SIGNED), \
             CAST(COALESCE(SUM(o.leased_until > {NOW_US}), 0) AS SIGNED), \
             CAST(COALESCE(SUM(o.leased_until <= {NOW_US}), 0) AS SIGNED), \
             (SELECT l.last_error FROM {t} l WHERE l.topic = o.topic AND l.sent_at IS NULL \
                 AND l.last_error IS NOT NULL ORDER BY l.seq DESC LIMIT 1) \
             FROM {t} o WHERE o.sent_at IS NULL GROUP BY o.topic ORDER BY o.topic"
        )
    }
}
