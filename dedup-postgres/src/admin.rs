//! What an operator asks of PostgreSQL's tables (the operator tool and the
//! console call these; no SQL lives outside this crate): one claim, the
//! claims per scope, releasing and purging, the outbox's backlog.

use dedup_core::admin::{ClaimRecord, ScopeSummary, TableSize};
use dedup_core::{DedupKey, StoreError};
use dedup_sql::admin::{
    AdminStore, ClaimRow, ClaimsStatements, ScopeRow, claim_record, count, scope_summary,
};
use dedup_sql::{TableName, sql};
use sqlx::PgPool;

use crate::{Error, InvalidTableName, Pg, PgConfig, PgStore, claim_id, store_error};

/// A claims table (`schema.name` or `name`), for an operator.
pub type ClaimsTable = dedup_sql::admin::ClaimsTable<Pg>;

/// An outbox table (`schema.name` or `name`), for an operator.
pub type OutboxTable = dedup_sql::admin::OutboxTable<Pg>;

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

impl AdminStore for Pg {
    type Db = sqlx::Postgres;
    type Store = PgStore;

    fn statement_error(e: sqlx::Error) -> StoreError {
        store_error(e)
    }

    fn table(name: &str) -> Result<TableName, InvalidTableName> {
        TableName::parse(name)
    }

    async fn exists(pool: &PgPool, name: &TableName, _raw: &str) -> Result<bool, sqlx::Error> {
        // The quoted name, parsed by the server as a relation name: a value,
        // never spliced into SQL.
        let found: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
            .bind(name.quoted())
            .fetch_one(pool)
            .await?;
        Ok(found.is_some())
    }

    fn store(pool: PgPool, raw: &str) -> Result<PgStore, Error> {
        PgStore::from_pool_with(pool, PgConfig::default().with_table(raw))
    }

    fn pool(store: &PgStore) -> &PgPool {
        store.pool()
    }

    fn claims_statements(table: &TableName) -> ClaimsStatements {
        let t = table.quoted();
        ClaimsStatements {
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
        }
    }

    async fn claim(table: &ClaimsTable, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        let row: Option<ClaimRow> = sqlx::query_as(sql(&table.statements().claim))
            .bind(claim_id(key))
            .fetch_optional(table.pool())
            .await
            .map_err(store_error)?;
        Ok(row.map(claim_record))
    }

    async fn release(
        table: &ClaimsTable,
        key: &DedupKey,
    ) -> Result<Option<ClaimRecord>, StoreError> {
        let mut tx = table.pool().begin().await.map_err(store_error)?;
        // A claim held by a running transaction is waited for, not forever.
        sqlx::query("SET LOCAL lock_timeout = '5s'")
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        let row: Option<ClaimRow> = sqlx::query_as(sql(&table.statements().release))
            .bind(claim_id(key))
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(row.map(claim_record))
    }

    async fn scopes(table: &ClaimsTable) -> Result<Vec<ScopeSummary>, StoreError> {
        let rows: Vec<ScopeRow> = sqlx::query_as(sql(&table.statements().scopes))
            .fetch_all(table.pool())
            .await
            .map_err(store_error)?;
        Ok(rows.into_iter().map(scope_summary).collect())
    }

    async fn size(table: &ClaimsTable) -> Result<Option<TableSize>, StoreError> {
        let (data, index, total): (i64, i64, i64) = sqlx::query_as(
            "SELECT pg_relation_size($1::regclass), pg_indexes_size($1::regclass), \
             pg_total_relation_size($1::regclass)",
        )
        .bind(table.table().quoted())
        .fetch_one(table.pool())
        .await
        .map_err(store_error)?;
        Ok(Some(TableSize::new(
            count(data),
            count(index),
            count(total),
        )))
    }

    fn backlog_statement(name: &TableName) -> String {
        // A pending event is leased while a live lease holds it, and in an
        // expired lease when only leases past their time do (its relay
        // died; the next relay to lease takes it over).
        format!(
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
        )
    }
}
