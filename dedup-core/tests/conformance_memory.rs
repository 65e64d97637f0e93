//! The conformance suite on the reference store.

use dedup_core::MemoryStore;

dedup_core::conformance_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    || MemoryStore::new()
);

#[tokio::test]
async fn a_stuck_claim_times_out_as_a_retryable_error() {
    use dedup_core::{DedupKey, DedupStore, Ttl};
    use std::time::Duration;

    let store = MemoryStore::new().with_lock_timeout(Duration::from_millis(100));
    let key = DedupKey::new("s", "k").unwrap();
    let ttl = Ttl::parse("1h").unwrap();
    let mut stuck = store.begin().await.unwrap();
    store.claim(&mut stuck, &key, None, ttl).await.unwrap();

    let mut tx = store.begin().await.unwrap();
    let err = store.claim(&mut tx, &key, None, ttl).await.unwrap_err();
    assert_eq!(
        err.classification(),
        dedup_core::Classification::Contention,
        "{err}"
    );
}
