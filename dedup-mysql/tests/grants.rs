//! Least privilege: what a service's user may not do, and what it is told
//! when it tries to migrate. (That the grants are enough is the conformance
//! suites' part: they run as that user.)

mod common;

use common::{as_service, fresh_database};
use dedup_mysql::{Error, MySqlStore};
use sqlx::mysql::MySqlPoolOptions;

/// A user that may not create tables, migrating a table nobody has migrated
/// yet (a release that adds the outbox, deployed before its migration ran),
/// is refused with an error naming the way out (the owner migrates), not
/// retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_without_the_owners_rights_says_who_migrates() {
    let service = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(as_service(fresh_database().await, false).await)
        .await
        .expect("the service's user connects");
    MySqlStore::from_pool(service.clone())
        .migrate()
        .await
        .expect("the claims table is current");
    let err = dedup_mysql::OutboxWriter::default()
        .migrate(&service)
        .await
        .expect_err("dedup_app may not create tables");
    assert!(matches!(err, Error::MigrateDenied { .. }), "{err:?}");
    assert!(!err.is_retryable());
    let message = err.to_string();
    assert!(
        message.contains("dedup migrate") && message.contains("owner"),
        "{message}"
    );
}

/// The grants hold rows, not the schema: the service's user can neither
/// drop, alter nor empty dedup's tables wholesale, nor create its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_user_cannot_change_the_schema() {
    let service = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(as_service(fresh_database().await, true).await)
        .await
        .expect("the service's user connects");
    for statement in [
        "DROP TABLE dedup_claims",
        "ALTER TABLE dedup_claims ADD COLUMN x int",
        "TRUNCATE dedup_outbox",
        "CREATE TABLE mine (x int)",
        "DELETE FROM dedup_claims_migrations",
    ] {
        let err = sqlx::query(statement)
            .execute(&service)
            .await
            .expect_err(statement);
        let number = err
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .map(|e| e.number());
        assert_eq!(number, Some(1142), "{statement}: {err}");
    }
}

/// A user or host that is not a plain name never reaches a statement.
#[test]
fn grants_refuse_an_account_that_is_not_a_name() {
    for user in ["app'@'%", "app@ho st", "app;", "", "1app"] {
        let err = dedup_mysql::grant_statements(user, "dedup_claims", None).expect_err(user);
        assert!(matches!(err, Error::InvalidRole(_)), "{user}: {err:?}");
    }
}
