//! The backends' error type, and how sqlx errors become the core's
//! [`StoreError`]s and [`Classification`]s: by code, never by message text.

use std::error::Error as StdError;

use dedup_core::{Classification, StoreError};
use sqlx::migrate::MigrateError;

use crate::{Dialect, InvalidRole, InvalidTableName};

/// Errors of setting up a store: connecting, migrating, configuring. (Errors
/// while claiming are [`StoreError`]s, classified by the database's codes.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configured table name is not a valid identifier.
    #[error(transparent)]
    InvalidTableName(#[from] InvalidTableName),
    /// A role or user to grant rights to is not a valid name.
    #[error(transparent)]
    InvalidRole(#[from] InvalidRole),
    /// Connecting or running a statement failed.
    #[error("{database}: {source}")]
    Database {
        /// Which database (`postgres`, `sqlite`).
        database: &'static str,
        /// Whether a retry may get past it.
        retryable: bool,
        /// What sqlx reported.
        source: sqlx::Error,
    },
    /// The table an operator named does not exist in the database.
    #[error(
        "there is no {what} table {table:?} in this database: check the table name (and the \
         database in the URL); the service creates it when it first migrates"
    )]
    NoSuchTable {
        /// Whose table (`claims`, `outbox`).
        what: &'static str,
        /// The name as given.
        table: String,
    },
    /// A TLS setting is wrong: a file that cannot be read or does not hold
    /// what it is for.
    #[error("TLS: {message}")]
    Tls {
        /// What is wrong, naming the file (never a key's contents).
        message: String,
    },
    /// The role may not create or alter dedup's tables: migrating needs
    /// their owner.
    #[error(
        "migrating: {source}: this role may not create or alter dedup's tables. Run the \
         migrations once as their owner (`dedup migrate`, which can also grant a service's \
         role what it needs) and give the service's role only the rights the book's Security \
         chapter lists; once migrated, its `migrate()` only reads"
    )]
    MigrateDenied {
        /// What sqlx reported.
        source: MigrateError,
    },
    /// A role was not given rights it should have been: whoever granted
    /// them may not (PostgreSQL grants nothing then, with a warning).
    #[error(
        "{role} still lacks {rights} on {object} after the grant: grant as the tables' owner (or \
         a role holding the rights WITH GRANT OPTION); tables a service created itself belong \
         to the service's role until `ALTER ... OWNER TO` gives them to the owner"
    )]
    NotGranted {
        /// The grantee.
        role: String,
        /// The table or sequence.
        object: String,
        /// The rights missing.
        rights: String,
    },
    /// Applying the migrations failed.
    #[error("migrating: {source}")]
    Migrate {
        /// Whether a retry may get past it.
        retryable: bool,
        /// What sqlx reported.
        source: MigrateError,
    },
}

impl Error {
    /// A failed connection or statement of database `D`.
    pub fn database<D: Dialect>(source: sqlx::Error) -> Self {
        Error::Database {
            database: D::NAME,
            retryable: classify_sqlx::<D>(&source).is_retryable(),
            source,
        }
    }

    /// A failed migration on database `D`: retryable when the statement that
    /// failed was (a lock timeout, a lost connection).
    pub fn migrate<D: Dialect>(source: MigrateError) -> Self {
        let failed = match &source {
            MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _) => Some(e),
            _ => None,
        };
        let denied = failed.is_some_and(|e| match e {
            sqlx::Error::Database(db) => {
                D::database_code(db.as_ref()).is_some_and(|c| D::is_denied(&c))
            }
            _ => false,
        });
        if denied {
            return Error::MigrateDenied { source };
        }
        let retryable = failed.is_some_and(|e| classify_sqlx::<D>(e).is_retryable());
        Error::Migrate { retryable, source }
    }

    /// Whether retrying may help (a lost connection, the server starting).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::InvalidTableName(_)
            | Error::InvalidRole(_)
            | Error::NoSuchTable { .. }
            | Error::Tls { .. }
            | Error::MigrateDenied { .. }
            | Error::NotGranted { .. } => false,
            Error::Database { retryable, .. } | Error::Migrate { retryable, .. } => *retryable,
        }
    }
}

/// Whose fault `e` is: a database error by `D`'s code rule; a broken or
/// refused connection, none to be had in time, a closing pool, a column or
/// type the schema no longer has: the environment's, however long it lasts
/// (the pool closing means the process is shutting down, not that the event
/// is bad); a protocol error (a connection gone wrong, or a statement with
/// too many parameters for one event): transient, bounded; anything else (a
/// value that does not decode or encode, a missing row): permanent.
pub fn classify_sqlx<D: Dialect>(e: &sqlx::Error) -> Classification {
    match e {
        sqlx::Error::Database(db) => match D::database_code(db.as_ref()) {
            Some(code) => D::classify_code(&code),
            // A database error without a code says nothing about the event.
            None => Classification::Environment,
        },
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Configuration(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::TypeNotFound { .. } => Classification::Environment,
        sqlx::Error::Protocol(_) => Classification::Transient,
        _ => Classification::Permanent,
    }
}

/// A sqlx error as the core's [`StoreError`], classified and carrying the
/// database's code.
pub fn store_error<D: Dialect>(e: sqlx::Error) -> StoreError {
    let code = code_of::<D>(&e);
    let err = StoreError::classified(classify_sqlx::<D>(&e), e);
    match code {
        Some(code) => err.with_code(code),
        None => err,
    }
}

/// [`DedupStore::classify`](dedup_core::DedupStore::classify) for SQL
/// backends: the first sqlx error in `error`'s source chain decides;
/// without one it is not the store's error.
pub fn classify<D: Dialect>(error: &(dyn StdError + 'static)) -> Classification {
    sqlx_errors(error)
        .next()
        .map_or(Classification::Unknown, classify_sqlx::<D>)
}

/// [`DedupStore::error_code`](dedup_core::DedupStore::error_code) for SQL
/// backends: the code of the first database error in `error`'s source
/// chain, as `D` labels it.
pub fn error_code<D: Dialect>(error: &(dyn StdError + 'static)) -> Option<String> {
    sqlx_errors(error).find_map(code_of::<D>)
}

/// The sqlx errors in `error`'s source chain, itself first.
fn sqlx_errors<'a>(error: &'a (dyn StdError + 'static)) -> impl Iterator<Item = &'a sqlx::Error> {
    std::iter::successors(Some(error), |&e| e.source())
        .filter_map(|e| e.downcast_ref::<sqlx::Error>())
}

/// A database error's code, as `D` labels it.
fn code_of<D: Dialect>(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => D::database_code(db.as_ref()).map(|c| D::code_label(&c)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::TestDialect as Test;

    #[test]
    fn lost_connections_are_the_environments_and_bad_values_the_events() {
        let environment = Classification::Environment;
        assert_eq!(
            classify_sqlx::<Test>(&sqlx::Error::PoolTimedOut),
            environment
        );
        let reset = sqlx::Error::Io(std::io::Error::other("reset"));
        assert_eq!(classify_sqlx::<Test>(&reset), environment);
        assert_eq!(
            classify_sqlx::<Test>(&sqlx::Error::RowNotFound),
            Classification::Permanent
        );
        let store = store_error::<Test>(sqlx::Error::PoolTimedOut);
        assert_eq!(store.classification(), environment);
        assert!(!Error::database::<Test>(sqlx::Error::RowNotFound).is_retryable());
    }

    #[test]
    fn a_failed_migration_statement_is_judged_by_its_error() {
        let execute = |e| MigrateError::ExecuteMigration(e, 1);
        assert!(Error::migrate::<Test>(execute(sqlx::Error::PoolTimedOut)).is_retryable());
        assert!(!Error::migrate::<Test>(execute(sqlx::Error::RowNotFound)).is_retryable());
        assert!(!Error::migrate::<Test>(MigrateError::VersionMissing(3)).is_retryable());
    }

    #[test]
    fn classify_finds_the_sqlx_error_in_the_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("wrapped")]
        struct Wrapped(#[source] sqlx::Error);
        let wrapped = Wrapped(sqlx::Error::PoolTimedOut);
        assert_eq!(classify::<Test>(&wrapped), Classification::Environment);
        let other = std::io::Error::other("not sqlx");
        assert_eq!(classify::<Test>(&other), Classification::Unknown);
        let permanent = Wrapped(sqlx::Error::RowNotFound);
        assert_eq!(classify::<Test>(&permanent), Classification::Permanent);
    }
}
