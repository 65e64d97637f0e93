//! Least privilege: what a service's role may not do, and what it is told
//! when it tries to migrate. (That the grants are enough is the conformance
//! suites' part: they run as that role.)

mod service;

use dedup_postgres::{Error, PgStore};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// A role that may not create tables, migrating a database nobody has
/// migrated yet, is refused with an error naming the way out (the owner
/// migrates), not retried.
#[sqlx::test(migrations = false)]
async fn migrating_without_the_owners_rights_says_who_migrates(owner: PgPool) {
    let service = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(service::as_service(&owner))
        .await
        .expect("the service's role connects");
    let err = PgStore::from_pool(service)
        .migrate()
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

/// The grants hold rows, not the schema: the service's role can neither
/// drop, alter nor empty dedup's tables wholesale, nor create its own.
#[sqlx::test(migrations = false)]
async fn the_service_role_cannot_change_the_schema(owner: PgPool) {
    let service = service::service_pool(&owner, true, 1).await;
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
        let code = err.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("42501"), "{statement}: {err}");
    }
}

/// A role that is not a plain name never reaches a statement.
#[test]
fn grants_refuse_a_role_that_is_not_a_name() {
    for role in ["app; DROP TABLE x", "app\"", "", "1app"] {
        let err = dedup_postgres::grant_statements(role, "dedup_claims", None).expect_err(role);
        assert!(matches!(err, Error::InvalidRole(_)), "{role}: {err:?}");
    }
    let sql = dedup_postgres::grant_statements("app", "billing.claims", Some("billing.outbox"))
        .expect("valid");
    assert_eq!(sql[0], r#"GRANT USAGE ON SCHEMA "billing" TO "app""#);
    assert_eq!(
        sql.iter()
            .filter(|s| s.starts_with("GRANT USAGE ON SCHEMA"))
            .count(),
        1,
        "one schema, granted once"
    );
}

/// A grant by a role that does not own the tables grants nothing (PostgreSQL
/// only warns): an error naming what the grantee still lacks, not a
/// success.
#[sqlx::test(migrations = false)]
async fn a_grant_that_grants_nothing_is_an_error(owner: PgPool) {
    let service = service::service_pool(&owner, true, 1).await;
    // `dedup_tls` (scripts/postgres.sh's) holds nothing here; `dedup_app`
    // may not pass its rights on.
    let err = dedup_postgres::grant(&service, "dedup_tls", "dedup_claims", Some("dedup_outbox"))
        .await
        .expect_err("dedup_app cannot grant");
    assert!(matches!(err, Error::NotGranted { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("dedup_tls")
            && message.contains("dedup_claims")
            && message.contains("owner"),
        "{message}"
    );
}
