//! The dedup-core conformance suite against SQLite, each case on its own
//! database file.

use dedup_sqlite::SqliteStore;

async fn fresh_store() -> SqliteStore {
    let path = std::env::temp_dir().join(format!("dedup-sqlite-{}.db", uuid::Uuid::new_v4()));
    let store = SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    store
}

dedup_core::conformance_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    || fresh_store().await
);
