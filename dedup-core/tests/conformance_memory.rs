//! The conformance suite on the reference store.

use dedup_core::{MemoryStore, conformance};

macro_rules! suite {
    ($($case:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            conformance::$case(MemoryStore::new()).await;
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

#[tokio::test]
async fn a_stuck_claim_times_out_as_a_retryable_error() {
    use dedup_core::{DedupKey, DedupStore, Ttl};
    use std::time::Duration;

    let store = MemoryStore::new().with_lock_timeout(Duration::from_millis(100));
    let key = DedupKey::new("s", "k").unwrap();
    let ttl = Ttl::parse("1h").unwrap();
    let mut stuck = store.begin().await.unwrap();
    store.claim(&mut stuck, &key, ttl).await.unwrap();

    let mut tx = store.begin().await.unwrap();
    let err = store.claim(&mut tx, &key, ttl).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
}
