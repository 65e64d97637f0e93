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

/// A migrated store on a database of its own.
#[allow(dead_code)] // not every test binary uses it
pub(crate) async fn fresh_store(isolation: Isolation) -> MySqlStore {
    let options = fresh_database().await;
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
    store.migrate().await.expect("migrate");
    store
}
