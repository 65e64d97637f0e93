//! The test kit (`dedup_core::testing`) on a real PostgreSQL, each test in
//! its own database: the payments handler passes every delivery pattern,
//! and one that writes through a second connection is caught.

use std::collections::BTreeMap;

use dedup_core::testing::{Delivery, Failure, Pattern, assert_idempotent, check_idempotent};
use dedup_core::{HandlerError, idempotent};
use dedup_postgres::{PgStore, PgTx};
use sqlx::PgPool;

#[derive(serde::Deserialize)]
struct Paid {
    event_id: String,
    account: String,
    cents: i64,
}

async fn store(pool: PgPool) -> PgStore {
    let store = PgStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE balances (account text PRIMARY KEY, cents bigint NOT NULL)")
        .execute(store.pool())
        .await
        .expect("balances");
    store
}

fn payments() -> Vec<Delivery> {
    (0..6)
        .map(|i| {
            Delivery::json(&serde_json::json!({
                "event_id": format!("e{i}"),
                "account": if i % 2 == 0 { "a" } else { "b" },
                "cents": 100 + i,
            }))
        })
        .collect()
}

const CREDIT: &str = "INSERT INTO balances (account, cents) VALUES ($1, $2) \
     ON CONFLICT (account) DO UPDATE SET cents = balances.cents + EXCLUDED.cents";

#[idempotent(key = "event_id", ttl = "4h")]
async fn credit(tx: &mut PgTx, ev: Paid) -> Result<(), HandlerError> {
    sqlx::query(CREDIT)
        .bind(&ev.account)
        .bind(ev.cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn reset(store: &PgStore) {
    sqlx::query("TRUNCATE balances")
        .execute(store.pool())
        .await
        .expect("truncate");
}

async fn balances(store: &PgStore) -> BTreeMap<String, i64> {
    sqlx::query_as("SELECT account, cents FROM balances")
        .fetch_all(store.pool())
        .await
        .expect("balances")
        .into_iter()
        .collect()
}

#[sqlx::test(migrations = false)]
async fn the_payments_handler_is_idempotent_under_every_pattern(pool: PgPool) {
    let store = store(pool).await;
    let report = assert_idempotent(&credit, &store, &payments(), reset, balances).await;
    assert_eq!(report.once["a"], 100 + 102 + 104);
    assert_eq!(
        report.after_ttl["a"],
        2 * (100 + 102 + 104),
        "the TTL's trade-off"
    );
    // Every pattern claimed in its own scope of the same table.
    let scopes: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT scope) FROM dedup_claims WHERE scope LIKE '%#test/%'",
    )
    .fetch_one(store.pool())
    .await
    .expect("scopes");
    assert_eq!(scopes, 8, "once, six redelivery patterns, after_ttl");
}

/// A second connection: what a handler that writes "somewhere else" (an
/// audit table through another pool, a service) does.
static ELSEWHERE: std::sync::OnceLock<PgPool> = std::sync::OnceLock::new();

#[idempotent(key = "event_id", ttl = "4h")]
async fn credit_elsewhere(_tx: &mut PgTx, ev: Paid) -> Result<(), HandlerError> {
    let pool = ELSEWHERE.get().expect("set by the test");
    sqlx::query(CREDIT)
        .bind(&ev.account)
        .bind(ev.cents)
        .execute(pool)
        .await?;
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn a_write_through_another_connection_is_caught(pool: PgPool) {
    let store = store(pool.clone()).await;
    ELSEWHERE.set(pool).expect("one test sets it");
    let failure = check_idempotent(&credit_elsewhere, &store, &payments(), reset, balances)
        .await
        .expect_err("its effect escapes the rollback");
    let Failure::Differs { pattern, once, got } = failure else {
        panic!("{failure}")
    };
    assert_eq!(pattern, Pattern::CrashBeforeCommit);
    assert_eq!(got["a"], 2 * once["a"]);
}

#[derive(serde::Deserialize)]
struct StatusChanged {
    event_id: String,
    status: String,
    version: i64,
}

/// The orders example's guarded upsert: writes only over an older version.
#[idempotent(key = "event_id", ttl = "4h")]
async fn set_status(tx: &mut PgTx, ev: StatusChanged) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO orders (id, status, version, updates) VALUES ('o-1', $1, $2, 1) \
         ON CONFLICT (id) DO UPDATE \
         SET status = EXCLUDED.status, version = EXCLUDED.version, updates = orders.updates + 1 \
         WHERE orders.version < EXCLUDED.version",
    )
    .bind(&ev.status)
    .bind(ev.version)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// With a version guard, a redelivery after the TTL changes nothing: the
/// kit's `after_ttl` equals `once`.
#[sqlx::test(migrations = false)]
async fn a_version_guarded_effect_survives_a_redelivery_after_the_ttl(pool: PgPool) {
    let store = PgStore::from_pool(pool);
    store.migrate().await.expect("migrate");
    sqlx::query(
        "CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL, \
         version bigint NOT NULL, updates int NOT NULL)",
    )
    .execute(store.pool())
    .await
    .expect("orders");
    let events: Vec<Delivery> = ["created", "paid", "shipped", "delivered"]
        .iter()
        .zip(1..)
        .map(|(status, version)| {
            Delivery::json(&serde_json::json!({ "event_id": format!("s{version}"), "status": status, "version": version }))
        })
        .collect();
    let report = assert_idempotent(
        &set_status,
        &store,
        &events,
        async |store| {
            sqlx::query("TRUNCATE orders")
                .execute(store.pool())
                .await
                .expect("truncate");
        },
        async |store| -> (String, i64, i32) {
            sqlx::query_as("SELECT status, version, updates FROM orders")
                .fetch_one(store.pool())
                .await
                .expect("the order")
        },
    )
    .await;
    assert_eq!(report.once, ("delivered".into(), 4, 4));
    assert!(!report.applied_again_after_ttl(), "{report:?}");
}
