//! A database of its own for each test, on the server `MYSQL_URL` names
//! (scripts/mariadb.sh starts one; its `start` drops the `dedup_test_`
//! databases a previous run left).

use dedup_mysql::MySqlStore;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, Executor};

/// The server the tests use.
pub(crate) fn server_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://dedup:dedup@127.0.0.1:3307/dedup".into())
}

/// The isolation level a test's connections run at.
#[derive(Clone, Copy)]
#[allow(dead_code)]
pub(crate) enum Isolation {
    /// InnoDB's default.
    RepeatableRead,
    /// What many services set.
    ReadCommitted,
}

/// Options for a new, empty database.
pub(crate) async fn fresh_database() -> MySqlConnectOptions {
    let options: MySqlConnectOptions = server_url().parse().expect("MYSQL_URL");
    let name = format!("dedup_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = options.connect().await.expect("connect to MYSQL_URL");
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
        .await
        .expect("create the test database");
    options.database(&name)
}

/// The user a service runs as: scripts/mariadb.sh makes `dedup_app`, with
/// no right of its own.
#[allow(dead_code)] // not every test binary uses it
pub(crate) const SERVICE: &str = "dedup_app";

/// Migrates the claims table (and the outbox, if `outbox`) of the database
/// `owner` reaches, as its owner, grants the service's user only what
/// `dedup_mysql::grant_statements` lists, and returns the options of that
/// database as the service's user.
#[allow(dead_code)] // not every test binary uses it
pub(crate) async fn as_service(owner: MySqlConnectOptions, outbox: bool) -> MySqlConnectOptions {
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(owner.clone())
        .await
        .expect("the owner connects");
    MySqlStore::from_pool(pool.clone())
        .migrate()
        .await
        .expect("the owner migrates the claims");
    if outbox {
        dedup_mysql::OutboxWriter::default()
            .migrate(&pool)
            .await
            .expect("the owner migrates the outbox");
    }
    let host = owner.get_host().to_owned();
    dedup_mysql::grant(
        &pool,
        &format!("{SERVICE}@{host}"),
        "dedup_claims",
        outbox.then_some("dedup_outbox"),
    )
    .await
    .expect("the owner grants the service's user");
    pool.close().await;
    owner.username(SERVICE).password("dedup")
}

/// A migrated store on a database of its own.
#[allow(dead_code)] // not every test binary uses it
pub(crate) async fn fresh_store(isolation: Isolation) -> MySqlStore {
    store_at(fresh_database().await, isolation).await
}

/// A store on a database of its own, as a service's user holding only the
/// grants (the owner migrated; its own migrate() finds the table current).
#[allow(dead_code)] // not every test binary uses it
pub(crate) async fn fresh_service_store(isolation: Isolation) -> MySqlStore {
    store_at(as_service(fresh_database().await, false).await, isolation).await
}

/// A store at `options`, migrated.
async fn store_at(options: MySqlConnectOptions, isolation: Isolation) -> MySqlStore {
    let pool = MySqlPoolOptions::new()
        .max_connections(20)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                if let Isolation::ReadCommitted = isolation {
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                }
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .expect("connect to the test database");
    let store = MySqlStore::from_pool(pool);
    store
        .migrate()
        .await
        .expect("migrate (a no-op when current)");
    store
}
