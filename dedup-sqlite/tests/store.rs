//! SQLite-specific behaviour: a non-idempotent effect applied once within
//! the TTL, the write lock as a retryable error, table-name validation.

use std::time::Duration;

use dedup_core::{DedupStore, Error, HandlerError, HandlerExt, Outcome, idempotent};
use dedup_sqlite::{SqliteConfig, SqliteStore, SqliteTx};

async fn store_with(config: SqliteConfig) -> SqliteStore {
    let path = std::env::temp_dir().join(format!("dedup-sqlite-{}.db", uuid::Uuid::new_v4()));
    let store = SqliteStore::open_with(&path, config).await.expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("accounts");
    store
}

#[derive(serde::Deserialize)]
struct Payment {
    event_id: String,
    account_id: String,
    amount_cents: i64,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut SqliteTx, ev: Payment) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
         ON CONFLICT (id) DO UPDATE SET balance = balance + excluded.balance",
    )
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn balance(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT coalesce(sum(balance), 0) FROM accounts")
        .fetch_one(store.pool())
        .await
        .expect("balance")
}

#[tokio::test]
async fn the_three_ttl_cases_with_a_non_idempotent_effect() {
    let store = store_with(SqliteConfig::default()).await;
    let msg = br#"{"event_id": "e-1", "account_id": "a", "amount_cents": 30}"#;
    assert!(matches!(
        record_payment.apply(&store, msg, &()).await,
        Outcome::Applied { reclaimed: false }
    ));
    assert!(matches!(
        record_payment.apply(&store, msg, &()).await,
        Outcome::Skipped { .. }
    ));
    assert_eq!(
        balance(&store).await,
        30,
        "a duplicate within the TTL is skipped"
    );
    // The TTL runs out without the test waiting 4 h: a short real TTL would
    // make "skipped within it" a race on a slow machine. Real-time expiry is
    // the conformance suite's `reclaim_after_expiry`.
    sqlx::query("UPDATE dedup_claims SET expires_at = claimed_at - 1")
        .execute(store.pool())
        .await
        .expect("expire");
    assert!(matches!(
        record_payment.apply(&store, msg, &()).await,
        Outcome::Applied { reclaimed: true }
    ));
    assert_eq!(
        balance(&store).await,
        60,
        "after the TTL the event is new again"
    );
}

#[tokio::test]
async fn a_held_write_lock_becomes_a_retryable_error() {
    let store =
        store_with(SqliteConfig::default().with_lock_timeout(Duration::from_millis(100))).await;
    let held = store.begin().await.expect("first writer");
    let out = record_payment
        .apply(
            &store,
            br#"{"event_id": "e-2", "account_id": "a", "amount_cents": 1}"#,
            &(),
        )
        .await;
    let Outcome::Failed(Error::Store(e)) = out else {
        panic!("{out:?}")
    };
    assert_eq!(
        e.classification(),
        dedup_core::Classification::Contention,
        "waited out, never dead-lettered: {e}"
    );
    assert_eq!(e.code(), Some("SQLITE_5"), "SQLITE_BUSY");
    store.rollback(held).await.expect("rollback");
}

#[tokio::test]
async fn invalid_table_names_are_refused() {
    let path = std::env::temp_dir().join(format!("dedup-sqlite-{}.db", uuid::Uuid::new_v4()));
    let err = SqliteStore::open_with(
        &path,
        SqliteConfig::default().with_table("x\"; DROP TABLE y"),
    )
    .await
    .expect_err("refused");
    assert!(err.to_string().contains("invalid table name"), "{err}");
}

#[tokio::test]
async fn a_pool_size_of_zero_counts_as_one() {
    let mut config = SqliteConfig::default();
    config.max_connections = 0;
    let store = store_with(config).await;
    let msg = br#"{"event_id": "e-3", "account_id": "a", "amount_cents": 5}"#;
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        record_payment.apply(&store, msg, &()),
    )
    .await
    .expect("a pool of 0 connections never hands one out");
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    assert_eq!(balance(&store).await, 5);
}

#[tokio::test]
async fn a_lock_timeout_of_a_month_is_accepted() {
    let store =
        store_with(SqliteConfig::default().with_lock_timeout(Duration::from_secs(30 * 86_400)))
            .await;
    let msg = br#"{"event_id": "e-4", "account_id": "a", "amount_cents": 2}"#;
    let out = record_payment.apply(&store, msg, &()).await;
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
}

/// SQLite's `CREATE INDEX` cannot name a schema, so a qualified name would
/// only fail later, in the migration: it is refused up front, saying why.
#[tokio::test]
async fn schema_qualified_table_names_are_refused() {
    let path = std::env::temp_dir().join(format!("dedup-sqlite-{}.db", uuid::Uuid::new_v4()));
    let err = SqliteStore::open_with(&path, SqliteConfig::default().with_table("main.claims"))
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("without a schema"), "{err}");
}

/// A table of the first version, filled, gains the fingerprint column; its
/// claims (kept without one) answer as duplicates of any content, and new
/// claims keep theirs.
#[tokio::test]
async fn a_filled_v1_table_gains_fingerprints() {
    use dedup_core::{Claim, DedupKey, Fingerprint, Ttl};
    use dedup_sql::{TableName, run_migrations};

    let path = std::env::temp_dir().join(format!("dedup-sqlite-{}.db", uuid::Uuid::new_v4()));
    let store = SqliteStore::open(&path).await.expect("open");
    let all = sqlx::migrate!("./migrations");
    let v1 = sqlx::migrate::Migrator::with_migrations(
        all.iter().filter(|m| m.version == 1).cloned().collect(),
    );
    let table = TableName::parse_unqualified("dedup_claims").expect("name");
    run_migrations(store.pool(), &v1, &table).await.expect("v1");
    sqlx::query(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 10000) \
         INSERT INTO dedup_claims (scope, key, claimed_at, expires_at) \
         SELECT 'payments', 'evt-' || n, 0, 9000000000000000 FROM g",
    )
    .execute(store.pool())
    .await
    .expect("fill v1");
    store.migrate().await.expect("upgrade");
    store.migrate().await.expect("migrating again does nothing");

    let ttl = Ttl::from_secs(3600).expect("ttl");
    let given = Some(Fingerprint::of_payload(b"content"));
    let old = DedupKey::new("payments", "evt-10000").expect("key");
    let new = DedupKey::new("payments", "evt-new").expect("key");
    let mut tx = store.begin().await.expect("begin");
    let claim = store.claim(&mut tx, &old, given, ttl).await.expect("claim");
    assert!(
        matches!(
            claim,
            Claim::Duplicate {
                fingerprint: None,
                ..
            }
        ),
        "{claim:?}"
    );
    assert_eq!(
        store.claim(&mut tx, &new, given, ttl).await.expect("claim"),
        Claim::Fresh
    );
    store.commit(tx).await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    let claim = store.claim(&mut tx, &new, None, ttl).await.expect("claim");
    store.rollback(tx).await.expect("rollback");
    assert!(
        matches!(claim, Claim::Duplicate { fingerprint, .. } if fingerprint == given),
        "{claim:?}"
    );
}
