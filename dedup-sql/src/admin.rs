//! What an operator asks of a store's tables, written once: the three SQL
//! stores differ in how they find a table, key a claim, release it and
//! size a table, and say so through [`AdminStore`]; the handles the
//! operator tool and the console hold are these.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::admin::{
    ClaimRecord, ClaimsAdmin, OutboxAdmin, ScopeSummary, TableSize, TopicBacklog,
};
use dedup_core::{DedupKey, PurgeExpired, StoreError};
use sqlx::{Database, Executor, FromRow, IntoArguments, Pool};

use crate::{
    Dialect, Error, InvalidTableName, TableName, fingerprint_from, sql, store_error,
    time_from_unix_micros,
};

/// One SQL store's answers to an operator. Implemented by each backend's
/// dialect type; users meet it only as the backend's `admin::ClaimsTable`
/// and `admin::OutboxTable`.
pub trait AdminStore: Dialect + Sized {
    /// The sqlx database.
    type Db: Database;
    /// The store that purges the claims table.
    type Store: PurgeExpired + fmt::Debug + Clone + Send + Sync + 'static;

    /// The table name as given, validated and quoted.
    fn table(name: &str) -> Result<TableName, InvalidTableName>;

    /// Whether the table `name` (`raw` as given) exists.
    fn exists<'a>(
        pool: &'a Pool<Self::Db>,
        name: &'a TableName,
        raw: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The store over the claims table `raw`.
    fn store(pool: Pool<Self::Db>, raw: &str) -> Result<Self::Store, Error>;

    /// The store's pool.
    fn pool(store: &Self::Store) -> &Pool<Self::Db>;

    /// The claims table's statements: one claim's [`ClaimRow`] (bound
    /// the way [`claim`](AdminStore::claim) binds a key), the scopes'
    /// [`ScopeRow`]s, the count of expired claims.
    fn claims_statements(table: &TableName) -> ClaimsStatements;

    /// The claim of `key`, with the [`ClaimsStatements::claim`] statement.
    fn claim<'a>(
        table: &'a ClaimsTable<Self>,
        key: &'a DedupKey,
    ) -> impl Future<Output = Result<Option<ClaimRecord>, StoreError>> + Send + 'a;

    /// Deletes the claim of `key` and returns what it was.
    fn release<'a>(
        table: &'a ClaimsTable<Self>,
        key: &'a DedupKey,
    ) -> impl Future<Output = Result<Option<ClaimRecord>, StoreError>> + Send + 'a;

    /// The claims per scope, as [`ScopeRow`]s.
    fn scopes(
        table: &ClaimsTable<Self>,
    ) -> impl Future<Output = Result<Vec<ScopeSummary>, StoreError>> + Send + '_;

    /// The table's size on disk, when the database says.
    fn size(
        table: &ClaimsTable<Self>,
    ) -> impl Future<Output = Result<Option<TableSize>, StoreError>> + Send + '_;

    /// The statement of the outbox's backlog per topic, as [`BacklogRow`]s.
    fn backlog_statement(table: &TableName) -> String;

    /// An error of the operator statements written here once (the expired
    /// count, the outbox backlog), classified as the store's own
    /// statements' errors are (default: by [`Dialect`] alone).
    fn statement_error(e: sqlx::Error) -> StoreError {
        store_error::<Self>(e)
    }
}

/// The statements of one claims table, built once from its validated name.
#[derive(Debug)]
pub struct ClaimsStatements {
    /// One claim, as a [`ClaimRow`].
    pub claim: Arc<str>,
    /// The claims per scope, as [`ScopeRow`]s.
    pub scopes: Arc<str>,
    /// How many claims have expired.
    pub expired: Arc<str>,
    /// Deleting one claim (returning it, where the database can).
    pub release: Arc<str>,
}

/// A claim: claimed at, expires at, the database's now (microseconds
/// since the Unix epoch), fingerprint, in progress.
pub type ClaimRow = (i64, i64, i64, Option<Vec<u8>>, bool);

/// A [`ClaimRow`] as the operator sees it.
pub fn claim_record((claimed, expires, now, fingerprint, in_progress): ClaimRow) -> ClaimRecord {
    ClaimRecord::new(
        time_from_unix_micros(claimed),
        time_from_unix_micros(expires),
        time_from_unix_micros(now),
    )
    .with_fingerprint(fingerprint_from(fingerprint))
    .with_in_progress(in_progress)
}

/// A scope's claims: scope, rows, live rows, the earliest and the latest
/// expiry (microseconds since the Unix epoch).
pub type ScopeRow = (String, i64, i64, i64, i64);

/// A [`ScopeRow`] as the operator sees it.
pub fn scope_summary((scope, rows, live, oldest, newest): ScopeRow) -> ScopeSummary {
    ScopeSummary::new(
        scope,
        count(rows),
        count(live),
        time_from_unix_micros(oldest),
        time_from_unix_micros(newest),
    )
}

/// A topic's outbox backlog: topic, pending events, the oldest one's age
/// in microseconds, events that failed at least once, events in a live
/// lease, events in an expired lease, the newest failure's reason.
pub type BacklogRow = (String, i64, i64, i64, i64, i64, Option<String>);

/// A count as the database returns it (never negative).
pub fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The table `raw` of store `D`, checked to exist; `what` says whose.
async fn existing<D: AdminStore>(
    pool: &Pool<D::Db>,
    raw: &str,
    what: &'static str,
) -> Result<TableName, Error> {
    let name = D::table(raw)?;
    if D::exists(pool, &name, raw)
        .await
        .map_err(Error::database::<D>)?
    {
        Ok(name)
    } else {
        Err(Error::NoSuchTable {
            what,
            table: raw.to_owned(),
        })
    }
}

/// A claims table, for an operator.
pub struct ClaimsTable<D: AdminStore> {
    store: D::Store,
    table: TableName,
    raw: Arc<str>,
    statements: Arc<ClaimsStatements>,
}

impl<D: AdminStore> Clone for ClaimsTable<D> {
    fn clone(&self) -> Self {
        ClaimsTable {
            store: self.store.clone(),
            table: self.table.clone(),
            raw: self.raw.clone(),
            statements: self.statements.clone(),
        }
    }
}

impl<D: AdminStore> fmt::Debug for ClaimsTable<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimsTable")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl<D: AdminStore> ClaimsTable<D> {
    /// The claims table `table` over `pool`; an error if the name is
    /// invalid or no such table exists.
    pub async fn open(pool: Pool<D::Db>, table: &str) -> Result<Self, Error> {
        let name = existing::<D>(&pool, table, "claims").await?;
        Ok(ClaimsTable {
            store: D::store(pool, table)?,
            statements: Arc::new(D::claims_statements(&name)),
            table: name,
            raw: table.into(),
        })
    }

    /// The store over the table.
    pub fn store(&self) -> &D::Store {
        &self.store
    }

    /// The store's pool.
    pub fn pool(&self) -> &Pool<D::Db> {
        D::pool(&self.store)
    }

    /// The table, validated and quoted.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The table's name as given.
    pub fn raw_name(&self) -> &str {
        &self.raw
    }

    /// Its statements.
    pub fn statements(&self) -> &ClaimsStatements {
        &self.statements
    }
}

impl<D: AdminStore> ClaimsAdmin for ClaimsTable<D>
where
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    (i64,): for<'r> FromRow<'r, <D::Db as Database>::Row>,
{
    async fn claim(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        D::claim(self, key).await
    }

    async fn release(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        D::release(self, key).await
    }

    async fn scopes(&self) -> Result<Vec<ScopeSummary>, StoreError> {
        D::scopes(self).await
    }

    async fn size(&self) -> Result<Option<TableSize>, StoreError> {
        D::size(self).await
    }

    async fn expired(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(sql(&self.statements.expired))
            .fetch_one(self.pool())
            .await
            .map_err(D::statement_error)?;
        Ok(count(n))
    }

    async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        self.store.purge_expired(limit).await
    }
}

/// An outbox table, for an operator.
pub struct OutboxTable<D: AdminStore> {
    pool: Pool<D::Db>,
    backlog: Arc<str>,
}

impl<D: AdminStore> Clone for OutboxTable<D> {
    fn clone(&self) -> Self {
        OutboxTable {
            pool: self.pool.clone(),
            backlog: self.backlog.clone(),
        }
    }
}

impl<D: AdminStore> fmt::Debug for OutboxTable<D> {
    // The pool's options hold the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxTable").finish_non_exhaustive()
    }
}

impl<D: AdminStore> OutboxTable<D> {
    /// The outbox table `table` over `pool`; an error if the name is
    /// invalid or no such table exists.
    pub async fn open(pool: Pool<D::Db>, table: &str) -> Result<Self, Error> {
        let name = existing::<D>(&pool, table, "outbox").await?;
        Ok(OutboxTable {
            backlog: D::backlog_statement(&name).into(),
            pool,
        })
    }
}

impl<D: AdminStore> OutboxAdmin for OutboxTable<D>
where
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    BacklogRow: for<'r> FromRow<'r, <D::Db as Database>::Row>,
{
    async fn backlog_by_topic(&self) -> Result<Vec<TopicBacklog>, StoreError> {
        let rows: Vec<BacklogRow> = sqlx::query_as(sql(&self.backlog))
            .fetch_all(&self.pool)
            .await
            .map_err(D::statement_error)?;
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
