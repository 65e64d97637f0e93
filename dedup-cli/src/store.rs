//! The database a command works on, chosen by its URL's scheme: the tables
//! through the admin functions of the backend that owns them (no SQL here).

use std::time::Duration;

use dedup_core::admin::{
    ClaimRecord, ClaimsAdmin, OutboxAdmin, ScopeSummary, TableSize, TopicBacklog,
};
use dedup_core::{DedupKey, StoreError};

use crate::Failure;

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Postgres,
    MySql,
    Sqlite,
}

impl Backend {
    fn of(url: &str) -> Result<Self, Failure> {
        let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
        match scheme {
            "postgres" | "postgresql" => Ok(Backend::Postgres),
            "mysql" | "mariadb" => Ok(Backend::MySql),
            "sqlite" => Ok(Backend::Sqlite),
            _ => Err(Failure::new(
                "--database-url / DATABASE_URL: use a postgres://, mysql:// (MariaDB too) or \
                 sqlite:// URL",
            )),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "PostgreSQL",
            Backend::MySql => "MySQL",
            Backend::Sqlite => "SQLite",
        }
    }
}

/// Applies `$body` to whichever backend's table `$table` holds.
macro_rules! each {
    ($value:expr, $enum:ident, $table:ident => $body:expr) => {
        match $value {
            $enum::Postgres($table) => $body,
            $enum::MySql($table) => $body,
            $enum::Sqlite($table) => $body,
        }
    };
}

/// The connection failed; the URL (it holds the password) is never part of
/// the message.
fn cannot_connect(backend: Backend, e: impl std::fmt::Display) -> Failure {
    Failure::new(format!(
        "cannot connect to {} ({e}): check --database-url / DATABASE_URL",
        backend.name()
    ))
}

/// Opening a table failed: an invalid name, no such table, or the database.
fn cannot_open(flag: &str, table: &str, e: dedup_sql::Error) -> Failure {
    match e {
        dedup_sql::Error::InvalidTableName(e) => {
            Failure::new(format!("{flag} {table:?} is not a valid table name: {e}"))
        }
        e @ dedup_sql::Error::NoSuchTable { .. } => Failure::new(format!("{e} ({flag})")),
        e => Failure::new(format!("looking up {table:?}: {e}")),
    }
}

/// A pool of two connections that waits 15 s for one at most.
macro_rules! pool {
    ($pool:ty, $options:expr, $backend:expr) => {
        <$pool>::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(15))
            .connect_with($options)
            .await
            .map_err(|e| cannot_connect($backend, e))?
    };
}

/// A pool of whichever database a URL names.
enum Pool {
    Postgres(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
    Sqlite(sqlx::SqlitePool),
}

impl Pool {
    /// A pool of the database at `url`, with the TLS its parameters ask
    /// for (the stores' own reading: a server that is neither on this host
    /// nor verified is warned of).
    async fn connect(url: &str) -> Result<Self, Failure> {
        let backend = Backend::of(url)?;
        let fail = |e| cannot_connect(backend, e);
        Ok(match backend {
            Backend::Postgres => {
                let options = dedup_postgres::connect_options(url, &Default::default());
                Pool::Postgres(pool!(
                    sqlx::postgres::PgPoolOptions,
                    options.map_err(fail)?,
                    backend
                ))
            }
            Backend::MySql => {
                let options = dedup_mysql::connect_options(url, &Default::default());
                Pool::MySql(pool!(
                    sqlx::mysql::MySqlPoolOptions,
                    options.map_err(fail)?,
                    backend
                ))
            }
            Backend::Sqlite => {
                let options: sqlx::sqlite::SqliteConnectOptions =
                    url.parse().map_err(|e| cannot_connect(backend, e))?;
                Pool::Sqlite(pool!(sqlx::sqlite::SqlitePoolOptions, options, backend))
            }
        })
    }
}

/// What `dedup migrate` did.
pub(crate) struct Migrated {
    /// The database's kind.
    pub(crate) database: &'static str,
    /// The tables created or found current.
    pub(crate) tables: Vec<String>,
    /// The statements run to grant a role its rights, if asked.
    pub(crate) grants: Vec<String>,
}

/// Creates or upgrades the claims table `claims` (and the outbox `outbox`,
/// if given) of the database at `url`, as whoever the URL names (their
/// owner); then, if `grant_to` is given, grants that role what a service
/// needs on them and nothing more. Every step is the backend's own.
pub(crate) async fn migrate(
    url: &str,
    claims: &str,
    outbox: Option<&str>,
    grant_to: Option<&str>,
) -> Result<Migrated, Failure> {
    let backend = Backend::of(url)?;
    let fail = |e: dedup_sql::Error| match e {
        dedup_sql::Error::InvalidTableName(e) => Failure::new(format!("--table / --outbox: {e}")),
        dedup_sql::Error::InvalidRole(e) => Failure::new(format!("--grant-to: {e}")),
        e => Failure::new(format!("{}: {e}", backend.name())),
    };
    // The backend's store and outbox, migrated on `pool`.
    macro_rules! migrate {
        ($backend:ident, $config:ident, $store:ident, $pool:expr) => {{
            let config = $backend::$config::default().with_table(claims);
            let store = $backend::$store::from_pool_with($pool.clone(), config).map_err(fail)?;
            store.migrate().await.map_err(fail)?;
            if let Some(outbox) = outbox {
                let config = $backend::OutboxConfig::default().with_table(outbox);
                let writer = $backend::OutboxWriter::new(config).map_err(fail)?;
                writer.migrate(&$pool).await.map_err(fail)?;
            }
        }};
    }
    let mut grants = Vec::new();
    match Pool::connect(url).await? {
        Pool::Postgres(pool) => {
            migrate!(dedup_postgres, PgConfig, PgStore, pool);
            if let Some(role) = grant_to {
                grants = dedup_postgres::grant_statements(role, claims, outbox).map_err(fail)?;
                dedup_postgres::grant(&pool, role, claims, outbox)
                    .await
                    .map_err(fail)?;
            }
        }
        Pool::MySql(pool) => {
            migrate!(dedup_mysql, MySqlConfig, MySqlStore, pool);
            if let Some(user) = grant_to {
                grants = dedup_mysql::grant_statements(user, claims, outbox).map_err(fail)?;
                dedup_mysql::grant(&pool, user, claims, outbox)
                    .await
                    .map_err(fail)?;
            }
        }
        Pool::Sqlite(pool) => {
            if grant_to.is_some() {
                return Err(Failure::new(
                    "--grant-to: SQLite has no roles (whoever may write the file may do anything)",
                ));
            }
            migrate!(dedup_sqlite, SqliteConfig, SqliteStore, pool);
        }
    }
    Ok(Migrated {
        database: backend.name(),
        tables: std::iter::once(claims)
            .chain(outbox)
            .map(str::to_owned)
            .collect(),
        grants,
    })
}

impl crate::Report for Migrated {
    fn text(&self) -> String {
        let mut out = format!("{}: {} current\n", self.database, self.tables.join(", "));
        for statement in &self.grants {
            out.push_str(&format!("{statement};\n"));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "database": self.database,
            "tables": self.tables,
            "grants": self.grants,
        })
    }
}

/// A claims table of any backend.
pub(crate) enum Claims {
    Postgres(dedup_postgres::admin::ClaimsTable),
    MySql(dedup_mysql::admin::ClaimsTable),
    Sqlite(dedup_sqlite::admin::ClaimsTable),
}

impl Claims {
    /// The claims table `table` of the database at `url`.
    pub(crate) async fn open(url: &str, table: &str) -> Result<Self, Failure> {
        use dedup_sql::admin::ClaimsTable;
        let fail = |e| cannot_open("--table", table, e);
        Ok(match Pool::connect(url).await? {
            Pool::Postgres(pool) => {
                Claims::Postgres(ClaimsTable::open(pool, table).await.map_err(fail)?)
            }
            Pool::MySql(pool) => Claims::MySql(ClaimsTable::open(pool, table).await.map_err(fail)?),
            Pool::Sqlite(pool) => {
                Claims::Sqlite(ClaimsTable::open(pool, table).await.map_err(fail)?)
            }
        })
    }

    pub(crate) async fn claim(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        each!(self, Claims, t => t.claim(key).await)
    }

    pub(crate) async fn release(&self, key: &DedupKey) -> Result<Option<ClaimRecord>, StoreError> {
        each!(self, Claims, t => t.release(key).await)
    }

    pub(crate) async fn scopes(&self) -> Result<Vec<ScopeSummary>, StoreError> {
        each!(self, Claims, t => t.scopes().await)
    }

    pub(crate) async fn size(&self) -> Result<Option<TableSize>, StoreError> {
        each!(self, Claims, t => t.size().await)
    }

    pub(crate) async fn expired(&self) -> Result<u64, StoreError> {
        each!(self, Claims, t => t.expired().await)
    }

    pub(crate) async fn purge(&self, limit: u32) -> Result<u64, StoreError> {
        each!(self, Claims, t => t.purge(limit).await)
    }
}

/// An outbox table of any backend.
pub(crate) enum Outbox {
    Postgres(dedup_postgres::admin::OutboxTable),
    MySql(dedup_mysql::admin::OutboxTable),
    Sqlite(dedup_sqlite::admin::OutboxTable),
}

impl Outbox {
    /// The outbox table `table` of the database at `url`.
    pub(crate) async fn open(url: &str, table: &str) -> Result<Self, Failure> {
        use dedup_sql::admin::OutboxTable;
        let fail = |e| cannot_open("--table", table, e);
        Ok(match Pool::connect(url).await? {
            Pool::Postgres(pool) => {
                Outbox::Postgres(OutboxTable::open(pool, table).await.map_err(fail)?)
            }
            Pool::MySql(pool) => Outbox::MySql(OutboxTable::open(pool, table).await.map_err(fail)?),
            Pool::Sqlite(pool) => {
                Outbox::Sqlite(OutboxTable::open(pool, table).await.map_err(fail)?)
            }
        })
    }

    pub(crate) async fn backlog_by_topic(&self) -> Result<Vec<TopicBacklog>, StoreError> {
        each!(self, Outbox, t => t.backlog_by_topic().await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_picks_the_backend() {
        for (url, backend) in [
            ("postgres://u:p@h/db", Backend::Postgres),
            ("postgresql://h/db", Backend::Postgres),
            ("mysql://u:p@h:3306/db", Backend::MySql),
            ("mariadb://h/db", Backend::MySql),
            ("sqlite:///var/lib/app/dedup.db", Backend::Sqlite),
            ("sqlite:dedup.db", Backend::Sqlite),
        ] {
            assert_eq!(Backend::of(url).expect(url), backend, "{url}");
        }
        let err = Backend::of("redis://secret@h").unwrap_err();
        assert!(!err.0.contains("secret"), "{err}");
        assert!(err.0.contains("postgres://"), "{err}");
    }
}
