//! What tells one SQL database from another where the shared code needs it.

/// A database as the shared SQL layer sees it: its name for messages, its
/// default pool size, and its rule for which error codes a retry can get
/// past. Each backend defines one unit type implementing it.
pub trait Dialect: Send + Sync + 'static {
    /// A short name for error messages (`postgres`, `sqlite`).
    const NAME: &'static str;
    /// The default pool size of the backend's config.
    const DEFAULT_MAX_CONNECTIONS: u32;

    /// Whether an error with this database error `code` may succeed when
    /// retried. Decided from codes, never from message text.
    fn is_transient_code(code: &str) -> bool;

    /// The code as reported in [`dedup_core::StoreError::code`] (SQLite
    /// prefixes its numeric codes, say).
    fn code_label(code: &str) -> String {
        code.to_owned()
    }
}

/// A dialect for unit tests: code `T` is transient, pools default to 3.
#[cfg(test)]
pub(crate) struct TestDialect;

#[cfg(test)]
impl Dialect for TestDialect {
    const NAME: &'static str = "test";
    const DEFAULT_MAX_CONNECTIONS: u32 = 3;
    fn is_transient_code(code: &str) -> bool {
        code == "T"
    }
}
