//! `dedup claims`: one claim, all of them, purging the expired.

use std::time::Duration;

use dedup_core::{DedupKey, PurgeExpired};
use dedup_postgres::{PgConfig, PgStore};
use dedup_sql::TableName;
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::time::human_seconds;
use crate::{Database, Failure, Report};

/// A timestamp column as RFC 3339 text in UTC, on the database's clock.
macro_rules! utc {
    ($column:literal) => {
        concat!(
            "to_char(",
            $column,
            " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
        )
    };
}

/// Connects to PostgreSQL with `url`; the URL (it holds the password) is
/// never part of the message.
pub(crate) async fn connect(url: &str) -> Result<PgPool, Failure> {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(15))
        .connect(url)
        .await
        .map_err(|e| {
            Failure::new(format!(
                "cannot connect to PostgreSQL ({e}): check --database-url / DATABASE_URL"
            ))
        })
}

/// Checks that `table` names an existing table; `what` says whose.
pub(crate) async fn existing(pool: &PgPool, table: &str, what: &str) -> Result<TableName, Failure> {
    let name = TableName::parse(table)
        .map_err(|e| Failure::new(format!("--table {table:?} is not a valid table name: {e}")))?;
    // The quoted name, parsed by the server as a relation name: a value,
    // never spliced into SQL.
    let found: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(name.quoted())
        .fetch_one(pool)
        .await
        .map_err(|e| Failure::new(format!("looking up {table:?}: {e}")))?;
    if found.is_none() {
        return Err(Failure::new(format!(
            "there is no {what} table {table:?} in this database: check --table (and the \
             database in --database-url); the consumer creates it when it first migrates"
        )));
    }
    Ok(name)
}

/// The claims table of one database.
pub(crate) struct Claims {
    pool: PgPool,
    table: TableName,
    raw_table: String,
}

/// One claim as stored.
#[derive(Debug, sqlx::FromRow)]
struct Row {
    claimed_at: String,
    expires_at: String,
    live: bool,
    /// Seconds until expiry (negative: since).
    expires_in: f64,
}

impl Claims {
    pub(crate) async fn connect(db: &Database) -> Result<Self, Failure> {
        let pool = connect(&db.database_url).await?;
        let table = existing(&pool, &db.table, "claims").await?;
        Ok(Claims {
            pool,
            table,
            raw_table: db.table.clone(),
        })
    }

    /// The key as the store keeps it (long ids digested).
    pub(crate) fn key(scope: &str, id: &str) -> Result<DedupKey, Failure> {
        DedupKey::new(scope, id).map_err(|e| Failure::new(format!("--scope/--key: {e}")))
    }

    fn select(&self) -> String {
        format!(
            "SELECT {} AS claimed_at, {} AS expires_at, expires_at > now() AS live, \
             extract(epoch FROM expires_at - now())::float8 AS expires_in \
             FROM {} WHERE id = $1",
            utc!("claimed_at"),
            utc!("expires_at"),
            self.table.quoted()
        )
    }

    /// Whether `key` holds a live claim now.
    pub(crate) async fn is_live(&self, key: &DedupKey) -> Result<bool, Failure> {
        let row = self.fetch(key).await?;
        Ok(row.is_some_and(|r| r.live))
    }

    async fn fetch(&self, key: &DedupKey) -> Result<Option<Row>, Failure> {
        sqlx::query_as::<_, Row>(sqlx::AssertSqlSafe(self.select()))
            .bind(dedup_postgres::claim_id(key))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| Failure::new(format!("reading the claim: {e}")))
    }

    pub(crate) async fn get(&self, scope: &str, id: &str) -> Result<ClaimReport, Failure> {
        let key = Self::key(scope, id)?;
        let row = self.fetch(&key).await?;
        Ok(ClaimReport {
            key,
            given: id.to_owned(),
            row,
            released: false,
        })
    }

    pub(crate) async fn release(&self, scope: &str, id: &str) -> Result<ClaimReport, Failure> {
        let key = Self::key(scope, id)?;
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(|e| Failure::new(e.to_string()))?;
        // A claim held by a running transaction is waited for, not forever.
        sqlx::query("SET LOCAL lock_timeout = '5s'")
            .execute(&mut *tx)
            .await
            .map_err(|e| Failure::new(e.to_string()))?;
        let delete = format!(
            "DELETE FROM {} WHERE id = $1 RETURNING {} AS claimed_at, \
             {} AS expires_at, expires_at > now() AS live, \
             extract(epoch FROM expires_at - now())::float8 AS expires_in",
            self.table.quoted(),
            utc!("claimed_at"),
            utc!("expires_at"),
        );
        let row = sqlx::query_as::<_, Row>(sqlx::AssertSqlSafe(delete))
            .bind(dedup_postgres::claim_id(&key))
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| {
                Failure::new(format!(
                    "deleting the claim: {e} (a transaction still holding it? try again)"
                ))
            })?;
        let Some(row) = row else {
            return Err(Failure::new(format!(
                "no claim for scope {scope:?} and key {id:?} in {:?}: nothing released (check \
                 the scope, which defaults to the handler's module::path::function)",
                self.raw_table
            )));
        };
        tx.commit()
            .await
            .map_err(|e| Failure::new(format!("committing the release: {e}")))?;
        Ok(ClaimReport {
            key,
            given: id.to_owned(),
            row: Some(row),
            released: true,
        })
    }

    pub(crate) async fn stats(&self) -> Result<StatsReport, Failure> {
        let per_scope = format!(
            "SELECT scope, count(*)::int8 AS rows, \
             count(*) FILTER (WHERE expires_at > now())::int8 AS live, \
             {} AS oldest_expiry, {} AS newest_expiry \
             FROM {} GROUP BY scope ORDER BY scope",
            utc!("min(expires_at)"),
            utc!("max(expires_at)"),
            self.table.quoted()
        );
        let scopes = sqlx::query_as::<_, ScopeStats>(sqlx::AssertSqlSafe(per_scope))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Failure::new(format!("counting claims: {e}")))?;
        let (table_bytes, index_bytes, total_bytes): (i64, i64, i64) = sqlx::query_as(
            "SELECT pg_relation_size($1::regclass), pg_indexes_size($1::regclass), \
             pg_total_relation_size($1::regclass)",
        )
        .bind(self.table.quoted())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| Failure::new(format!("reading the table's size: {e}")))?;
        Ok(StatsReport {
            table: self.raw_table.clone(),
            scopes,
            table_bytes,
            index_bytes,
            total_bytes,
        })
    }

    pub(crate) async fn purge(&self, batch_size: u32) -> Result<PurgeReport, Failure> {
        let expired: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE expires_at <= now()",
            self.table.quoted()
        )))
        .fetch_one(&self.pool)
        .await
        .map_err(|e| Failure::new(format!("counting expired claims: {e}")))?;
        let store = PgStore::from_pool_with(
            self.pool.clone(),
            PgConfig::default().with_table(self.raw_table.clone()),
        )
        .map_err(|e| Failure::new(e.to_string()))?;
        let bar = indicatif::ProgressBar::new(u64::try_from(expired).unwrap_or(0));
        let started = std::time::Instant::now();
        let (mut deleted, mut batches) = (0u64, 0u64);
        loop {
            let n = store
                .purge_expired(batch_size)
                .await
                .map_err(|e| Failure::new(format!("purging: {e} ({deleted} deleted so far)")))?;
            deleted += n;
            batches += 1;
            bar.inc(n);
            if n < u64::from(batch_size) {
                break;
            }
        }
        bar.finish_and_clear();
        Ok(PurgeReport {
            deleted,
            batches,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// `claims get` and `claims release`.
pub(crate) struct ClaimReport {
    key: DedupKey,
    given: String,
    row: Option<Row>,
    released: bool,
}

impl Report for ClaimReport {
    fn text(&self) -> String {
        let mut out = String::new();
        let Some(row) = &self.row else {
            return format!("no claim for {}\n", self.key);
        };
        let verb = if self.released { "released " } else { "" };
        out.push_str(&format!("{verb}claim {}\n", self.key));
        if self.key.id() != self.given {
            out.push_str("  (the id is stored as its digest: it is long or looks like one)\n");
        }
        out.push_str(&format!(
            "  claimed at  {} (database clock)\n",
            row.claimed_at
        ));
        out.push_str(&format!("  expires at  {}\n", row.expires_at));
        let state = if row.live {
            format!("live, expires in {}", human_seconds(row.expires_in))
        } else {
            format!(
                "expired {} ago (a redelivery would apply the event again)",
                human_seconds(-row.expires_in)
            )
        };
        out.push_str(&format!("  state       {state}\n"));
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "scope": self.key.scope(),
            "key": self.key.id(),
            "found": self.row.is_some(),
            "released": self.released,
            "claimed_at": self.row.as_ref().map(|r| &r.claimed_at),
            "expires_at": self.row.as_ref().map(|r| &r.expires_at),
            "live": self.row.as_ref().map(|r| r.live),
            "expires_in_seconds": self.row.as_ref().map(|r| r.expires_in),
        })
    }
}

#[derive(Debug, sqlx::FromRow)]
struct ScopeStats {
    scope: String,
    rows: i64,
    live: i64,
    oldest_expiry: String,
    newest_expiry: String,
}

/// `claims stats`.
pub(crate) struct StatsReport {
    table: String,
    scopes: Vec<ScopeStats>,
    table_bytes: i64,
    index_bytes: i64,
    total_bytes: i64,
}

impl StatsReport {
    fn totals(&self) -> (i64, i64) {
        self.scopes
            .iter()
            .fold((0, 0), |(rows, live), s| (rows + s.rows, live + s.live))
    }
}

fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl Report for StatsReport {
    fn text(&self) -> String {
        let (rows, live) = self.totals();
        let mut out = format!(
            "{}: {rows} claims, {live} live, {} expired (waiting for purge); table {}, \
             indexes {}, total {}\n",
            self.table,
            rows - live,
            mib(self.table_bytes),
            mib(self.index_bytes),
            mib(self.total_bytes)
        );
        for s in &self.scopes {
            out.push_str(&format!(
                "  {}: {} claims, {} live, {} expired; expiries {} .. {}\n",
                s.scope,
                s.rows,
                s.live,
                s.rows - s.live,
                s.oldest_expiry,
                s.newest_expiry
            ));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        let (rows, live) = self.totals();
        json!({
            "table": self.table,
            "rows": rows,
            "live": live,
            "expired": rows - live,
            "oldest_expiry": self.scopes.iter().map(|s| &s.oldest_expiry).min(),
            "newest_expiry": self.scopes.iter().map(|s| &s.newest_expiry).max(),
            "table_bytes": self.table_bytes,
            "index_bytes": self.index_bytes,
            "total_bytes": self.total_bytes,
            "scopes": self.scopes.iter().map(|s| json!({
                "scope": s.scope,
                "rows": s.rows,
                "live": s.live,
                "expired": s.rows - s.live,
                "oldest_expiry": s.oldest_expiry,
                "newest_expiry": s.newest_expiry,
            })).collect::<Vec<_>>(),
        })
    }
}

/// `claims purge`.
pub(crate) struct PurgeReport {
    deleted: u64,
    batches: u64,
    seconds: f64,
}

impl Report for PurgeReport {
    fn text(&self) -> String {
        format!(
            "purged {} expired claims in {} batches ({:.1} s)\n",
            self.deleted, self.batches, self.seconds
        )
    }

    fn json(&self) -> serde_json::Value {
        json!({ "deleted": self.deleted, "batches": self.batches, "seconds": self.seconds })
    }
}
