//! Fixtures shared by the end-to-end tests: a payment event whose effect is
//! NOT idempotent (`balance = balance + amount`), so any double apply shows
//! in the balance. [`common`] holds the helpers every test binary shares
//! (compiled once, here, rather than into each binary).

pub mod common;
pub mod oidc;
pub mod registry;

use dedup_postgres::{PgConfig, PgStore, PgTx};
use sqlx::PgPool;

/// A payment as producers publish it.
#[derive(Debug, serde::Deserialize)]
pub struct PaymentReceived {
    /// The stable event id, made when the payment was.
    pub event_id: String,
    /// The account credited.
    pub account_id: String,
    /// The amount added to the balance.
    pub amount_cents: i64,
}

/// The JSON payload of a payment.
pub fn payment(id: uuid::Uuid, account: &str, cents: i64) -> Vec<u8> {
    serde_json::json!({ "event_id": id, "account_id": account, "amount_cents": cents })
        .to_string()
        .into_bytes()
}

/// The effect: adds the amount to the account's balance.
pub async fn credit(tx: &mut PgTx, ev: &PaymentReceived) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
    )
    .bind(&ev.account_id)
    .bind(ev.amount_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Creates the accounts table and a migrated store with `config`.
pub async fn store_with(pool: &PgPool, config: PgConfig) -> PgStore {
    sqlx::query("CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL)")
        .execute(pool)
        .await
        .expect("create accounts");
    let store = PgStore::from_pool_with(pool.clone(), config).expect("valid config");
    store.migrate().await.expect("migrate");
    store
}

/// [`store_with`] the default configuration.
pub async fn store(pool: &PgPool) -> PgStore {
    store_with(pool, PgConfig::default()).await
}

/// The balance of one account (0 if it has none).
pub async fn balance(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT coalesce((SELECT balance FROM accounts WHERE id = $1), 0)")
        .bind(account)
        .fetch_one(pool)
        .await
        .expect("balance")
}

/// The sum of all balances.
pub async fn total_balance(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT coalesce(sum(balance), 0)::int8 FROM accounts")
        .fetch_one(pool)
        .await
        .expect("total balance")
}

/// Payments an operator can block, for the tests of the operator tool and
/// the console: a payment to a blocked account is the event's fault
/// (dead-lettered at once); the fix an operator deploys is unblocking it.
pub mod blockable {
    use dedup_core::{HandlerError, idempotent};
    use dedup_postgres::{PgStore, PgTx};
    use sqlx::PgPool;

    use crate::{PaymentReceived, credit, store};

    /// The handler's scope.
    pub const SCOPE: &str = "blockable::record_payment";

    /// Credits the payment unless its account is blocked.
    #[idempotent(key = "event_id", ttl = "4h", scope = "blockable::record_payment")]
    pub async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), HandlerError> {
        let blocked: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM blocked WHERE account = $1)")
                .bind(&ev.account_id)
                .fetch_one(&mut **tx)
                .await?;
        if blocked {
            return Err(HandlerError::permanent(format!(
                "account {} is blocked",
                ev.account_id
            )));
        }
        credit(tx, &ev).await?;
        Ok(())
    }

    /// Runs a consumer of `topic` in `group` with [`record_payment`] until
    /// it is idle.
    pub async fn consume(store: &PgStore, topic: &str, group: &str) -> dedup_kafka::StatsSnapshot {
        crate::common::drain(
            dedup_kafka::Consumer::builder(store.clone())
                .brokers(crate::common::brokers())
                .group_id(group)
                .commit_interval(std::time::Duration::from_millis(200))
                .handle(topic, record_payment),
            std::time::Duration::from_secs(3),
        )
        .await
    }

    /// The store, the accounts and the (empty) list of blocked accounts.
    pub async fn migrated(pool: &PgPool) -> PgStore {
        let store = store(pool).await;
        sqlx::query("CREATE TABLE blocked (account text PRIMARY KEY)")
            .execute(pool)
            .await
            .expect("create blocked");
        store
    }

    /// Blocks `account`.
    pub async fn block(pool: &PgPool, account: &str) {
        sqlx::query("INSERT INTO blocked VALUES ($1)")
            .bind(account)
            .execute(pool)
            .await
            .expect("block");
    }

    /// The fix an operator deploys.
    pub async fn unblock_all(pool: &PgPool) {
        sqlx::query("DELETE FROM blocked")
            .execute(pool)
            .await
            .expect("unblock");
    }
}
