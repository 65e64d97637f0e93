//! The settings every SQL store takes.

use std::fmt;
use std::marker::PhantomData;
use std::path::PathBuf;
use std::time::Duration;

use crate::{Dialect, TlsFiles};

/// Settings of a SQL store; each backend names its own
/// (`PgConfig = SqlConfig<Pg>`, `SqliteConfig = SqlConfig<Sqlite>`).
#[non_exhaustive]
pub struct SqlConfig<D> {
    /// The dedup table, optionally schema-qualified (default
    /// `dedup_claims`). Validated as an identifier and always quoted.
    pub table: String,
    /// How long a claim waits for another transaction's uncommitted claim of
    /// the same key (PostgreSQL: `SET LOCAL lock_timeout` in every
    /// transaction; SQLite: the busy timeout on the write lock) before
    /// failing with a retryable error (default 5 s).
    pub lock_timeout: Duration,
    /// Largest connection pool the store opens (PostgreSQL 10, SQLite 4; at
    /// least 1: 0 counts as 1).
    pub max_connections: u32,
    /// TLS files beyond the URL's parameters (default none): with a CA
    /// file, TLS is required and the server verified against it.
    pub tls: TlsFiles,
    dialect: PhantomData<fn() -> D>,
}

impl<D: Dialect> Default for SqlConfig<D> {
    fn default() -> Self {
        SqlConfig {
            table: "dedup_claims".to_owned(),
            lock_timeout: Duration::from_secs(5),
            max_connections: D::DEFAULT_MAX_CONNECTIONS,
            tls: TlsFiles::default(),
            dialect: PhantomData,
        }
    }
}

impl<D> SqlConfig<D> {
    /// Sets the dedup table name.
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets the lock timeout (rounded to whole milliseconds, at least 1).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// Sets the pool size.
    pub fn with_max_connections(mut self, max: u32) -> Self {
        self.max_connections = max;
        self
    }

    /// Requires TLS, and trusts only a server whose certificate the CAs in
    /// `ca_file` (PEM) signed for the host connected to (PostgreSQL
    /// `sslmode=verify-full`, MySQL `ssl-mode=VERIFY_IDENTITY`). Applied
    /// where the store connects (`connect_with`, the backends'
    /// `connect_options`); a pool given to `from_pool_with` is used as it is.
    pub fn with_ca_file(mut self, ca_file: impl Into<PathBuf>) -> Self {
        self.tls.ca_file = Some(ca_file.into());
        self
    }

    /// Presents the client certificate `cert` with its private key `key`
    /// (both PEM) to a server that asks for one.
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls.client = Some((cert.into(), key.into()));
        self
    }

    /// The pool size to open: the field is public, so its clamp is applied
    /// here, where it is used (a pool of 0 never hands out a connection).
    pub fn pool_size(&self) -> u32 {
        self.max_connections.max(1)
    }

    /// The lock timeout in whole milliseconds, from 1 (0 would mean "wait
    /// for ever" to PostgreSQL and "never wait" to SQLite) to `i32::MAX`
    /// (about 24.8 days: PostgreSQL refuses more, with an error that would
    /// fail every transaction, and sqlx's SQLite panics on more).
    pub fn lock_timeout_ms(&self) -> u32 {
        const MAX: u128 = i32::MAX as u128;
        let ms = self.lock_timeout.as_millis().clamp(1, MAX);
        u32::try_from(ms).expect("clamped to i32::MAX")
    }
}

// By hand: derives would require the marker type `D` itself to be Debug,
// Clone and so on.
impl<D> Clone for SqlConfig<D> {
    fn clone(&self) -> Self {
        SqlConfig {
            table: self.table.clone(),
            lock_timeout: self.lock_timeout,
            max_connections: self.max_connections,
            tls: self.tls.clone(),
            dialect: PhantomData,
        }
    }
}

impl<D> PartialEq for SqlConfig<D> {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.table,
            self.lock_timeout,
            self.max_connections,
            &self.tls,
        ) == (
            &other.table,
            other.lock_timeout,
            other.max_connections,
            &other.tls,
        )
    }
}

impl<D> Eq for SqlConfig<D> {}

impl<D> fmt::Debug for SqlConfig<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlConfig")
            .field("table", &self.table)
            .field("lock_timeout", &self.lock_timeout)
            .field("max_connections", &self.max_connections)
            .field("tls", &self.tls)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::TestDialect as Small;

    #[test]
    fn zeros_set_on_the_public_fields_are_clamped_where_used() {
        let mut config = SqlConfig::<Small>::default();
        assert_eq!(config.pool_size(), 3);
        config.max_connections = 0;
        config.lock_timeout = Duration::ZERO;
        assert_eq!(config.pool_size(), 1);
        assert_eq!(config.lock_timeout_ms(), 1);
        config.lock_timeout = Duration::from_secs(u64::MAX);
        assert_eq!(config.lock_timeout_ms(), i32::MAX as u32);
    }
}
