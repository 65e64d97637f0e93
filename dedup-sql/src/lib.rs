#![doc = include_str!("../README.md")]

pub mod admin;
mod batch;
mod config;
mod dialect;
mod error;
mod grants;
mod handle;
mod migrate;
mod outbox;
mod table;
mod tls;

use std::sync::Arc;

pub use batch::{
    BatchClaims, LeaseRow, Taken, age_from_micros, fingerprint_from, held_or_done, live_claim,
    time_from_unix_micros, ttl_seconds,
};
pub use config::SqlConfig;
pub use dialect::Dialect;
pub use error::{Error, classify, classify_sqlx, error_code, store_error};
pub use grants::{InvalidRole, Role};
pub use handle::{ClaimStatements, StoreHandle};
pub use migrate::run_migrations;
pub use outbox::{Outbox, OutboxReader, OutboxStore, OutboxWriter};
pub use outbox::{
    OutboxConfig, OutboxRow, SqlLease, decode_headers, encode_headers, json_seqs, millis,
    outbox_record, polled, unsettled,
};
pub use table::{InvalidTableName, MAX_TABLE_LEN, TableName};
pub use tls::{TlsFiles, warn_unverified};

/// A statement the store built once from constants and a validated, quoted
/// identifier (every value is a bind parameter), as sqlx takes it.
pub fn sql(statement: &Arc<str>) -> sqlx::AssertSqlSafe<Arc<str>> {
    sqlx::AssertSqlSafe(statement.clone())
}
