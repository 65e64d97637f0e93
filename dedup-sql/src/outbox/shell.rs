//! The outbox's writer and reader, written once: the three SQL stores
//! differ in their statements and in how they lease, wait and settle, and
//! say so through [`OutboxStore`]; the handles, their settings and the
//! [`OutboxSource`] a relay sees are these.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{OutboxMessage, OutboxRecord, OutboxSource, PublishFailure, Retention};
use sqlx::migrate::{Migrate, Migrator};
use sqlx::{Database, Pool};

use crate::{Dialect, Error, InvalidTableName, OutboxConfig, TableName, run_migrations};

/// One SQL store's outbox: its table, statements and SQL. Implemented by
/// each backend's dialect type; users meet it only as the backend's
/// `OutboxWriter` and `OutboxReader`.
pub trait OutboxStore: Dialect + Sized {
    /// The sqlx database.
    type Db: Database;
    /// The statements of one outbox, built once from its validated name.
    type Statements: Send + Sync + 'static;
    /// What a reader keeps between waits to know that events came (the
    /// newest sequence number it saw, or a notification listener).
    type Watch: Default + Send + Sync + 'static;
    /// A leased batch.
    type Lease: Send + Sync;
    /// Whether [`lease`](OutboxStore::lease) can take a batch while an
    /// earlier one is still being published
    /// ([`OutboxSource::lease_pending_after`]).
    const LEASES_AHEAD: bool = false;

    /// The outbox migrations, rendered with the configured table name.
    fn migrator() -> &'static Migrator;

    /// The configured table name, validated (and quoted as the database
    /// quotes identifiers).
    fn table(name: &str) -> Result<TableName, InvalidTableName>;

    /// The statements of the outbox `table` with `retention`.
    fn statements(table: &TableName, retention: Retention) -> Self::Statements;

    /// Writes `message` inside the transaction `conn` belongs to; returns
    /// its event id (the message's, or a new random UUID).
    fn enqueue<'a>(
        outbox: &'a Outbox<Self>,
        conn: &'a mut <Self::Db as Database>::Connection,
        message: OutboxMessage,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send + 'a;

    /// Leases up to `limit` pending events for `lease_for`; `before`, the
    /// caller's batch in flight, does not hold back its keys' later events
    /// (only asked for when [`LEASES_AHEAD`](OutboxStore::LEASES_AHEAD)).
    fn lease<'a>(
        reader: &'a OutboxReader<Self>,
        limit: usize,
        lease_for: Duration,
        before: Option<&'a Self::Lease>,
    ) -> impl Future<Output = Result<(Self::Lease, Vec<OutboxRecord>), StoreError>> + Send + 'a;

    /// [`OutboxSource::finish`].
    fn finish<'a>(
        reader: &'a OutboxReader<Self>,
        lease: &'a Self::Lease,
        published: &'a [i64],
        failed: &'a [PublishFailure],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// [`OutboxSource::wait_for_events`].
    fn wait_for_events(
        reader: &OutboxReader<Self>,
        timeout: Duration,
    ) -> impl Future<Output = ()> + Send + '_;

    /// Deletes at most `limit` events sent longer than `keep` ago.
    fn purge_sent(
        reader: &OutboxReader<Self>,
        keep: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + '_;

    /// How many events wait and how long the oldest has (zero when none).
    fn backlog(
        reader: &OutboxReader<Self>,
    ) -> impl Future<Output = Result<(u64, Duration), StoreError>> + Send + '_;
}

/// One configured outbox: its table, retention and statements.
pub struct Outbox<D: OutboxStore> {
    table: TableName,
    retention: Retention,
    statements: D::Statements,
}

impl<D: OutboxStore> Outbox<D> {
    /// The table, validated and quoted.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// What happens to published rows.
    pub fn retention(&self) -> Retention {
        self.retention
    }

    /// The store's statements.
    pub fn statements(&self) -> &D::Statements {
        &self.statements
    }
}

/// An outbox table: [`enqueue`](OutboxWriter::enqueue) events inside your
/// transaction, [`migrate`](OutboxWriter::migrate) it at start-up, and hand
/// [`reader`](OutboxWriter::reader) to a relay. Cloning is cheap.
pub struct OutboxWriter<D: OutboxStore> {
    outbox: Arc<Outbox<D>>,
}

impl<D: OutboxStore> Clone for OutboxWriter<D> {
    fn clone(&self) -> Self {
        OutboxWriter {
            outbox: self.outbox.clone(),
        }
    }
}

impl<D: OutboxStore> fmt::Debug for OutboxWriter<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxWriter")
            .field("table", &self.outbox.table.to_string())
            .field("retention", &self.outbox.retention)
            .finish()
    }
}

impl<D: OutboxStore> Default for OutboxWriter<D> {
    /// The table `dedup_outbox`, rows kept an hour after publishing.
    fn default() -> Self {
        OutboxWriter::new(OutboxConfig::default()).expect("the default outbox table name is valid")
    }
}

impl<D: OutboxStore> OutboxWriter<D> {
    /// An outbox with `config`; an error if its table name is not a valid
    /// identifier.
    pub fn new(config: OutboxConfig) -> Result<Self, Error> {
        let table = D::table(&config.table)?;
        let statements = D::statements(&table, config.retention);
        Ok(OutboxWriter {
            outbox: Arc::new(Outbox {
                table,
                retention: config.retention,
                statements,
            }),
        })
    }

    /// Creates or upgrades the outbox table; safe to call from every
    /// instance at every start (tracked in `<table>_migrations`).
    pub async fn migrate(&self, pool: &Pool<D::Db>) -> Result<(), Error>
    where
        <D::Db as Database>::Connection: Migrate,
    {
        run_migrations(pool, D::migrator(), &self.outbox.table)
            .await
            .map_err(Error::migrate::<D>)
    }

    /// Writes `message` into the outbox inside the transaction `conn`
    /// belongs to (pass `&mut tx` or, from a handler, `tx`), and returns
    /// its event id: the one set on the message, or a new random UUID. The
    /// event is published only if that transaction commits.
    pub async fn enqueue(
        &self,
        conn: &mut <D::Db as Database>::Connection,
        message: OutboxMessage,
    ) -> Result<String, Error> {
        D::enqueue(&self.outbox, conn, message)
            .await
            .map_err(Error::database::<D>)
    }

    /// The relay's view of this outbox over `pool`.
    pub fn reader(&self, pool: Pool<D::Db>) -> OutboxReader<D> {
        OutboxReader {
            pool,
            outbox: self.outbox.clone(),
            watch: Arc::default(),
        }
    }
}

/// An outbox as a relay reads it: an [`OutboxSource`] over a pool, from
/// [`OutboxWriter::reader`]. Cloning is cheap; clones share the watch for
/// new events.
pub struct OutboxReader<D: OutboxStore> {
    pool: Pool<D::Db>,
    outbox: Arc<Outbox<D>>,
    watch: Arc<D::Watch>,
}

impl<D: OutboxStore> Clone for OutboxReader<D> {
    fn clone(&self) -> Self {
        OutboxReader {
            pool: self.pool.clone(),
            outbox: self.outbox.clone(),
            watch: self.watch.clone(),
        }
    }
}

impl<D: OutboxStore> fmt::Debug for OutboxReader<D> {
    // The pool's options hold the password; show only what is safe.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxReader")
            .field("table", &self.outbox.table.to_string())
            .field("retention", &self.outbox.retention)
            .finish_non_exhaustive()
    }
}

impl<D: OutboxStore> OutboxReader<D> {
    /// The pool it reads through.
    pub fn pool(&self) -> &Pool<D::Db> {
        &self.pool
    }

    /// The outbox it reads.
    pub fn outbox(&self) -> &Outbox<D> {
        &self.outbox
    }

    /// What it keeps to know that events came.
    pub fn watch(&self) -> &D::Watch {
        &self.watch
    }

    /// How many events wait to be published: the relay's backlog.
    pub async fn pending(&self) -> Result<u64, StoreError> {
        Ok(D::backlog(self).await?.0)
    }

    /// How long the oldest pending event has waited, on the database
    /// clock (`None` when nothing waits): the relay's lag.
    pub async fn oldest_pending_age(&self) -> Result<Option<Duration>, StoreError> {
        let (pending, oldest) = D::backlog(self).await?;
        Ok((pending > 0).then_some(oldest))
    }
}

impl<D: OutboxStore> OutboxSource for OutboxReader<D>
where
    Pool<D::Db>: Send + Sync,
{
    type Lease = D::Lease;

    async fn lease_pending(
        &self,
        limit: usize,
        lease_for: Duration,
    ) -> Result<(D::Lease, Vec<OutboxRecord>), StoreError> {
        D::lease(self, limit, lease_for, None).await
    }

    async fn lease_pending_after(
        &self,
        limit: usize,
        lease_for: Duration,
        before: &D::Lease,
    ) -> Result<Option<(D::Lease, Vec<OutboxRecord>)>, StoreError> {
        if !D::LEASES_AHEAD {
            return Ok(None);
        }
        D::lease(self, limit, lease_for, Some(before))
            .await
            .map(Some)
    }

    async fn finish(
        &self,
        lease: &D::Lease,
        published: &[i64],
        failed: &[PublishFailure],
    ) -> Result<(), StoreError> {
        D::finish(self, lease, published, failed).await
    }

    async fn wait_for_events(&self, timeout: Duration) {
        D::wait_for_events(self, timeout).await;
    }

    async fn purge_sent(&self, limit: u32) -> Result<u64, StoreError> {
        match self.outbox.retention {
            Retention::Delete => Ok(0),
            Retention::Keep(keep) => D::purge_sent(self, keep, limit).await,
        }
    }

    async fn backlog(&self) -> Result<Option<(u64, Duration)>, StoreError> {
        D::backlog(self).await.map(Some)
    }
}
