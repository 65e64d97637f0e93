//! The dedup-core conformance suite against a real PostgreSQL, each case in
//! its own database (`#[sqlx::test]`), so the cases run in parallel.

use dedup_core::conformance;
use dedup_postgres::PgStore;
use sqlx::PgPool;

async fn store(pool: PgPool) -> PgStore {
    let store = PgStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    store
}

macro_rules! suite {
    ($($case:ident),* $(,)?) => {$(
        #[sqlx::test(migrations = false)]
        async fn $case(pool: PgPool) {
            conformance::$case(store(pool).await).await;
        }
    )*};
}

suite!(
    exclusive_under_concurrency,
    duplicate_within_ttl,
    reclaim_after_expiry,
    scope_isolation,
    rollback_releases_the_claim,
    second_claimer_waits_for_the_first,
    batch_claims,
    batch_rollback_releases_every_claim,
    long_keys_are_digested,
    purge_removes_only_expired,
);
