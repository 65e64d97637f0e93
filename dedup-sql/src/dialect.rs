//! What tells one SQL database from another where the shared code needs it.

use dedup_core::Classification;

/// A database as the shared SQL layer sees it: its name for messages, its
/// default pool size, and its rule for whose fault an error code is. Each
/// backend defines one unit type implementing it.
pub trait Dialect: Send + Sync + 'static {
    /// A short name for error messages (`postgres`, `sqlite`).
    const NAME: &'static str;
    /// The default pool size of the backend's config.
    const DEFAULT_MAX_CONNECTIONS: u32;

    /// Whose fault an error with this database error `code` is: the
    /// event's data ([`Permanent`](Classification::Permanent)), contention
    /// ([`Contention`](Classification::Contention)), an unknown failure a
    /// retry may get past ([`Transient`](Classification::Transient)) or the environment
    /// ([`Environment`](Classification::Environment)). Decided from codes,
    /// never from message text.
    fn classify_code(code: &str) -> Classification;

    /// The code of a database error that [`classify_code`](Dialect::classify_code)
    /// reads: its SQLSTATE by default (MySQL overrides it: its SQLSTATE
    /// `HY000` covers most errors, its error number tells them apart).
    fn database_code(error: &dyn sqlx::error::DatabaseError) -> Option<String> {
        error.code().map(Into::into)
    }

    /// Whether an error with this code (as [`database_code`](Dialect::database_code)
    /// gives it) says the role lacks a right on an object: then migrating
    /// needs the owner, and the error says so.
    fn is_denied(code: &str) -> bool {
        let _ = code;
        false
    }

    /// The code as reported in [`dedup_core::StoreError::code`] (SQLite
    /// prefixes its numeric codes, say).
    fn code_label(code: &str) -> String {
        code.to_owned()
    }
}

/// A dialect for unit tests: code `T` is transient, `P` permanent, the rest
/// the environment's; pools default to 3.
#[cfg(test)]
pub(crate) struct TestDialect;

#[cfg(test)]
impl Dialect for TestDialect {
    const NAME: &'static str = "test";
    const DEFAULT_MAX_CONNECTIONS: u32 = 3;
    fn classify_code(code: &str) -> Classification {
        match code {
            "T" => Classification::Transient,
            "P" => Classification::Permanent,
            _ => Classification::Environment,
        }
    }
}
