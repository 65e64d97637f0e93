//! The test kit (`dedup_core::testing`) on SQLite: its one writer at a time
//! makes the concurrent pattern wait, not fail, and the handler passes.

use dedup_core::testing::{Delivery, assert_idempotent};
use dedup_core::{HandlerError, idempotent};
use dedup_sqlite::{SqliteStore, SqliteTx};

#[derive(serde::Deserialize)]
struct Paid {
    event_id: String,
    account: String,
    cents: i64,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn credit(tx: &mut SqliteTx, ev: Paid) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO balances (account, cents) VALUES (?1, ?2) \
         ON CONFLICT (account) DO UPDATE SET cents = cents + excluded.cents",
    )
    .bind(&ev.account)
    .bind(ev.cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_sqlite_handler_is_idempotent_under_every_pattern() {
    let path = std::env::temp_dir().join(format!("dedup-kit-{}.db", uuid::Uuid::new_v4()));
    let store = SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE balances (account TEXT PRIMARY KEY, cents INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("balances");
    let events: Vec<Delivery> = (0..5)
        .map(|i| {
            Delivery::json(
                &serde_json::json!({ "event_id": format!("e{i}"), "account": "a", "cents": 7 }),
            )
        })
        .collect();
    let report = assert_idempotent(
        &credit,
        &store,
        &events,
        async |store| {
            sqlx::query("DELETE FROM balances")
                .execute(store.pool())
                .await
                .expect("reset");
        },
        async |store| -> i64 {
            sqlx::query_scalar("SELECT coalesce(sum(cents), 0) FROM balances")
                .fetch_one(store.pool())
                .await
                .expect("sum")
        },
    )
    .await;
    assert_eq!((report.once, report.after_ttl), (35, 70));
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}
