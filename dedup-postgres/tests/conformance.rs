//! The dedup-core conformance suite against a real PostgreSQL, each case in
//! its own database (`#[sqlx::test]`), so the cases run in parallel, as a
//! service's role holding only the grants dedup lists.

mod service;

use dedup_postgres::PgStore;
use sqlx::PgPool;

dedup_core::conformance_tests!(
    #[sqlx::test(migrations = false)]
    |pool: PgPool| {
        // As a service runs: its role holds only the grants (the owner
        // migrated); its own migrate() finds the table current.
        let store = PgStore::from_pool(service::service_pool(&pool, false, 20).await);
        store
            .migrate()
            .await
            .expect("migrate finds the table current");
        store
    }
);
