//! Least privilege: the role a service runs as. scripts/postgres.sh makes
//! `dedup_app`, a role with no right of its own; here the owner of a test's
//! database migrates dedup's tables and grants `dedup_app` only what
//! `dedup_postgres::grant_statements` lists, and the test goes on as
//! `dedup_app`.

use dedup_postgres::{OutboxWriter, PgStore};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The service's role.
pub(crate) const ROLE: &str = "dedup_app";

/// `owner`'s database as the service's role.
pub(crate) fn as_service(owner: &PgPool) -> PgConnectOptions {
    (*owner.connect_options())
        .clone()
        .username(ROLE)
        .password("dedup")
}

/// Migrates the claims table (and the outbox, if `outbox`) as `owner`,
/// grants the service's role what the library lists, and returns a pool of
/// `connections` as that role.
pub(crate) async fn service_pool(owner: &PgPool, outbox: bool, connections: u32) -> PgPool {
    PgStore::from_pool(owner.clone())
        .migrate()
        .await
        .expect("the owner migrates the claims");
    if outbox {
        OutboxWriter::default()
            .migrate(owner)
            .await
            .expect("the owner migrates the outbox");
    }
    dedup_postgres::grant(
        owner,
        ROLE,
        "dedup_claims",
        outbox.then_some("dedup_outbox"),
    )
    .await
    .expect("the owner grants the service's role");
    PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(as_service(owner))
        .await
        .expect("the service's role connects")
}
