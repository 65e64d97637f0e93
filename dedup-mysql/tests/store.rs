//! MySQL-specific behaviour: a non-idempotent effect applied once within
//! the TTL, keys compared byte for byte, a held claim and a deadlock as
//! contention, whose fault each server error is, table-name validation.

mod common;

use std::time::Duration;

use common::{Isolation, fresh_database, fresh_store};
use dedup_core::{
    Claim, Classification, DedupKey, DedupStore, HandlerError, HandlerExt, Outcome, Ttl, idempotent,
};
use dedup_mysql::{MySqlConfig, MySqlStore, MySqlTx};

async fn with_accounts(store: MySqlStore) -> MySqlStore {
    sqlx::query("CREATE TABLE accounts (id VARCHAR(64) PRIMARY KEY, balance BIGINT NOT NULL)")
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
async fn record_payment(tx: &mut MySqlTx, ev: Payment) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES (?, ?) \
         ON DUPLICATE KEY UPDATE balance = balance + VALUES(balance)",
    )
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn balance(store: &MySqlStore) -> i64 {
    sqlx::query_scalar("SELECT CAST(COALESCE(SUM(balance), 0) AS SIGNED) FROM accounts")
        .fetch_one(store.pool())
        .await
        .expect("balance")
}

fn key(id: &str) -> DedupKey {
    DedupKey::new("s", id).expect("key")
}

fn hour() -> Ttl {
    Ttl::parse("1h").expect("ttl")
}

#[tokio::test]
async fn the_three_ttl_cases_with_a_non_idempotent_effect() {
    let store = with_accounts(fresh_store(Isolation::RepeatableRead).await).await;
    let msg = br#"{"event_id": "e-1", "account_id": "a", "amount_cents": 30}"#;
    let out = record_payment.apply(&store, msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: false }),
        "{out:?}"
    );
    let out = record_payment.apply(&store, msg, &()).await;
    assert!(matches!(out, Outcome::Skipped { .. }), "{out:?}");
    assert_eq!(
        balance(&store).await,
        30,
        "a duplicate within the TTL is skipped"
    );
    // The TTL runs out without the test waiting 4 h (real-time expiry is
    // the conformance suite's `reclaim_after_expiry`).
    sqlx::query("UPDATE dedup_claims SET expires_at = claimed_at - 1")
        .execute(store.pool())
        .await
        .expect("expire");
    let out = record_payment.apply(&store, msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: true }),
        "{out:?}"
    );
    assert_eq!(
        balance(&store).await,
        60,
        "after the TTL the event is new again"
    );
}

/// Under utf8mb4_bin (PAD SPACE) `x` and `x ` are equal and under the
/// default collations `X` and `x` are too: the key columns are byte
/// strings, so each of these ids is a claim of its own.
#[tokio::test]
async fn ids_are_compared_byte_for_byte() {
    let store = fresh_store(Isolation::RepeatableRead).await;
    let ids = ["x", "x ", "X", "é", "e\u{301}"];
    let mut tx = store.begin().await.expect("begin");
    for id in ids {
        let claim = store
            .claim(&mut tx, &key(id), None, hour())
            .await
            .expect("claim");
        assert_eq!(claim, Claim::Fresh, "{id:?} is a claim of its own");
    }
    store.commit(tx).await.expect("commit");
    let mut listed = store.live_ids_from(&key("!")).await.expect("live ids");
    assert_eq!(listed.len(), ids.len(), "{listed:?}");
    // In byte order, as the runtime reads its dead-letter records.
    let mut sorted = listed.clone();
    sorted.sort_unstable();
    assert_eq!(listed, sorted);
    listed.retain(|id| id.starts_with('x'));
    assert_eq!(listed, ["x", "x "]);
}

#[tokio::test]
async fn a_claim_held_by_another_transaction_times_out_as_contention() {
    let held = fresh_store(Isolation::RepeatableRead).await;
    let store = MySqlStore::from_pool_with(
        held.pool().clone(),
        MySqlConfig::default().with_lock_timeout(Duration::from_millis(1)),
    )
    .expect("store");
    let mut first = held.begin().await.expect("begin");
    held.claim(&mut first, &key("k"), None, hour())
        .await
        .expect("claim");
    let started = std::time::Instant::now();
    let mut second = store.begin().await.expect("begin");
    let err = store
        .claim(&mut second, &key("k"), None, hour())
        .await
        .unwrap_err();
    assert_eq!(err.classification(), Classification::Contention, "{err}");
    assert_eq!(err.code(), Some("1205/HY000"), "lock wait timeout");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the lock timeout (1 s) applied"
    );
    drop(second);
    held.rollback(first).await.expect("rollback");
    let mut third = store.begin().await.expect("begin");
    assert_eq!(
        store
            .claim(&mut third, &key("k"), None, hour())
            .await
            .expect("claim"),
        Claim::Fresh,
        "the first claim rolled back"
    );
}

#[tokio::test]
async fn a_deadlock_is_contention() {
    let store = with_accounts(fresh_store(Isolation::RepeatableRead).await).await;
    sqlx::query("INSERT INTO accounts VALUES ('a', 0), ('b', 0)")
        .execute(store.pool())
        .await
        .expect("accounts");
    let lock = "SELECT balance FROM accounts WHERE id = ? FOR UPDATE";
    let mut one = store.begin().await.expect("begin");
    let mut two = store.begin().await.expect("begin");
    sqlx::query(lock)
        .bind("a")
        .execute(&mut *one)
        .await
        .expect("a");
    sqlx::query(lock)
        .bind("b")
        .execute(&mut *two)
        .await
        .expect("b");
    // One waits for the other, which then closes the cycle: InnoDB rolls
    // one of them back.
    let waiting = tokio::spawn(async move {
        let result = sqlx::query(lock).bind("b").execute(&mut *one).await;
        (result, one)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = sqlx::query(lock).bind("a").execute(&mut *two).await;
    let (first, _one) = waiting.await.expect("task");
    let err = first
        .err()
        .or(second.err())
        .expect("one of them deadlocked");
    assert_eq!(store.classify(&err), Classification::Contention, "{err}");
    assert_eq!(store.error_code(&err).as_deref(), Some("1213/40001"));
}

#[tokio::test]
async fn server_errors_are_classified_by_number() {
    let store = with_accounts(fresh_store(Isolation::RepeatableRead).await).await;
    let pool = store.pool();
    let failed = |q: &'static str| async move { sqlx::query(q).execute(pool).await.unwrap_err() };
    sqlx::query("INSERT INTO accounts VALUES ('a', 0)")
        .execute(pool)
        .await
        .expect("account");
    for (statement, code, expected) in [
        (
            "INSERT INTO accounts VALUES ('a', 1)",
            "1062/23000",
            Classification::Permanent,
        ),
        (
            "INSERT INTO accounts VALUES (REPEAT('x', 65), 1)",
            "1406/22001",
            Classification::Permanent,
        ),
        (
            "INSERT INTO accounts VALUES (NULL, 1)",
            "1048/23000",
            Classification::Permanent,
        ),
        (
            "SELECT * FROM no_such_table",
            "1146/42S02",
            Classification::Environment,
        ),
        ("SELEKT 1", "1064/42000", Classification::Transient),
    ] {
        let err = failed(statement).await;
        assert_eq!(
            store.error_code(&err).as_deref(),
            Some(code),
            "{statement}: {err}"
        );
        assert_eq!(store.classify(&err), expected, "{statement}: {err}");
    }
    // A read-only transaction (as on a replica or a server set read-only):
    // the environment's, waited out.
    let mut tx = pool
        .begin_with("START TRANSACTION READ ONLY")
        .await
        .expect("begin");
    let err = sqlx::query("UPDATE accounts SET balance = 1")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert_eq!(
        store.error_code(&err).as_deref(),
        Some("1792/25006"),
        "{err}"
    );
    assert_eq!(store.classify(&err), Classification::Environment, "{err}");
}

#[tokio::test]
async fn invalid_and_qualified_table_names_are_refused() {
    let pool = sqlx::mysql::MySqlPoolOptions::new().connect_lazy_with(fresh_database().await);
    for bad in [
        "claims`; DROP TABLE accounts; --",
        "1claims",
        "other_db.claims",
    ] {
        let err = MySqlStore::from_pool_with(pool.clone(), MySqlConfig::default().with_table(bad))
            .unwrap_err();
        assert!(!err.is_retryable(), "{bad}: {err}");
        assert!(
            err.to_string().contains("invalid table name"),
            "{bad}: {err}"
        );
    }
    let store = MySqlStore::from_pool_with(pool, MySqlConfig::default().with_table("Claims_2"))
        .expect("ok");
    store.migrate().await.expect("migrate");
    store.migrate().await.expect("migrating again is a no-op");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        store
            .claim(&mut tx, &key("k"), None, hour())
            .await
            .expect("claim"),
        Claim::Fresh
    );
}

/// What the store's Debug shows: never the URL's password.
#[tokio::test]
async fn debug_output_hides_the_password() {
    let store = MySqlStore::connect(&common::server_url())
        .await
        .expect("connect");
    let shown = format!("{store:?}");
    assert!(
        !shown.contains("dedup@") && !shown.contains(":dedup"),
        "{shown}"
    );
    assert!(shown.contains("dedup_claims"), "{shown}");
}
