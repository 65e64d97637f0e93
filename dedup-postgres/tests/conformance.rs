//! The dedup-core conformance suite against a real PostgreSQL, each case in
//! its own database (`#[sqlx::test]`), so the cases run in parallel.

use dedup_postgres::PgStore;
use sqlx::PgPool;

dedup_core::conformance_tests!(
    #[sqlx::test(migrations = false)]
    |pool: PgPool| {
        let store = PgStore::from_pool(pool);
        store.migrate().await.expect("migrate");
        store
    }
);
