//! What every SQL store holds, written once: a pool and the statements
//! built from its settings, with the ways to make one (connect, or take a
//! pool) and to migrate its table.

use std::sync::Arc;

use sqlx::migrate::{Migrate, Migrator};
use sqlx::pool::PoolOptions;
use sqlx::{Connection, Database, Pool};

use crate::{Dialect, Error, InvalidTableName, SqlConfig, TableName, run_migrations};

/// A store's statements, built once from its settings (a table name that is
/// not a valid identifier is refused here, before any connection).
pub trait ClaimStatements: Send + Sync + Sized + 'static {
    /// The database they are written for.
    type Dialect: Dialect;

    /// The statements for `config`'s table and timeouts.
    fn new(config: &SqlConfig<Self::Dialect>) -> Result<Self, InvalidTableName>;

    /// The table they work on, validated and quoted.
    fn table(&self) -> &TableName;
}

/// A store's pool and statements. Cloning is cheap and shares both.
pub struct StoreHandle<DB: Database, S> {
    pool: Pool<DB>,
    statements: Arc<S>,
}

impl<DB: Database, S> Clone for StoreHandle<DB, S> {
    fn clone(&self) -> Self {
        StoreHandle {
            pool: self.pool.clone(),
            statements: self.statements.clone(),
        }
    }
}

impl<DB: Database, S: ClaimStatements> StoreHandle<DB, S> {
    /// Connects with `options` and `config` (its table checked first).
    pub async fn connect_with(
        options: <DB::Connection as Connection>::Options,
        config: &SqlConfig<S::Dialect>,
    ) -> Result<Self, Error> {
        let statements = S::new(config)?;
        Self::open(options, config, statements).await
    }

    async fn open(
        options: <DB::Connection as Connection>::Options,
        config: &SqlConfig<S::Dialect>,
        statements: S,
    ) -> Result<Self, Error> {
        let pool = PoolOptions::<DB>::new()
            .max_connections(config.pool_size())
            .connect_with(options)
            .await
            .map_err(Error::database::<S::Dialect>)?;
        Ok(StoreHandle {
            pool,
            statements: Arc::new(statements),
        })
    }

    /// Uses an existing `pool` with `config`.
    pub fn from_pool(pool: Pool<DB>, config: &SqlConfig<S::Dialect>) -> Result<Self, Error> {
        Ok(StoreHandle {
            pool,
            statements: Arc::new(S::new(config)?),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The statements.
    pub fn statements(&self) -> &S {
        &self.statements
    }

    /// Creates or upgrades the table with `migrator`'s templates
    /// ([`run_migrations`]).
    pub async fn migrate(&self, migrator: &Migrator) -> Result<(), Error>
    where
        DB::Connection: Migrate,
    {
        run_migrations(&self.pool, migrator, self.statements.table())
            .await
            .map_err(Error::migrate::<S::Dialect>)
    }
}
