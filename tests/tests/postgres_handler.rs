//! `#[idempotent]` handlers on a real PostgreSQL, with a NON-idempotent
//! effect (`balance = balance + amount`) so that any double apply shows.

use std::time::Duration;

use dedup_core::{
    Classification, DedupStore, Describe as _, DescribeExt as _, Error, HandlerError, HandlerExt,
    Outcome, idempotent,
};
use dedup_postgres::{PgConfig, PgStore, PgTx};
use dedup_tests::{
    PaymentReceived, balance, credit, payment, store as setup, store_with as setup_with,
};
use sqlx::PgPool;

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

/// Writes its effect, then fails when the amount is negative: the effect and
/// the claim must both roll back.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_then_validate(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), HandlerError> {
    credit(tx, &ev).await?;
    if ev.amount_cents < 0 {
        return Err(HandlerError::permanent("negative amounts are refused"));
    }
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn a_b_first_delivery_applies_and_redelivery_within_ttl_is_skipped(pool: PgPool) {
    let store = setup(&pool).await;
    let msg = payment(uuid::Uuid::new_v4(), "acct-1", 1250);

    let out = record_payment.apply(&store, &msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: false }),
        "(A) {out:?}"
    );
    assert_eq!(balance(&pool, "acct-1").await, 1250);

    for _ in 0..3 {
        let out = record_payment.apply(&store, &msg, &()).await;
        assert!(matches!(out, Outcome::Skipped { .. }), "(B) {out:?}");
    }
    assert_eq!(
        balance(&pool, "acct-1").await,
        1250,
        "(B) a skipped redelivery must not add again"
    );

    let other = payment(uuid::Uuid::new_v4(), "acct-1", 50);
    assert!(matches!(
        record_payment.apply(&store, &other, &()).await,
        Outcome::Applied { .. }
    ));
    assert_eq!(balance(&pool, "acct-1").await, 1300);
}

#[sqlx::test(migrations = false)]
async fn c_redelivery_after_the_ttl_applies_again(pool: PgPool) {
    let store = setup(&pool).await;
    let msg = payment(uuid::Uuid::new_v4(), "acct-c", 700);

    assert!(matches!(
        record_payment.apply(&store, &msg, &()).await,
        Outcome::Applied { .. }
    ));
    assert!(matches!(
        record_payment.apply(&store, &msg, &()).await,
        Outcome::Skipped { .. }
    ));
    // The TTL runs out (on the database clock) without the test waiting 4 h:
    // a short real TTL would make "skipped within it" a race on a slow
    // machine. Real-time expiry is the conformance suite's
    // `reclaim_after_expiry`.
    sqlx::query("UPDATE dedup_claims SET expires_at = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();

    let out = record_payment.apply(&store, &msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: true }),
        "(C) {out:?}"
    );
    assert_eq!(
        balance(&pool, "acct-c").await,
        1400,
        "(C) after the TTL the event is new again, by design"
    );
}

#[sqlx::test(migrations = false)]
async fn a_handler_error_rolls_back_claim_and_effect(pool: PgPool) {
    let store = setup(&pool).await;
    let id = uuid::Uuid::new_v4();

    let out = record_then_validate
        .apply(&store, &payment(id, "acct-e", -5), &())
        .await;
    let Outcome::Failed(e) = out else {
        panic!("{out:?}")
    };
    assert!(!e.is_retryable());
    assert_eq!(
        balance(&pool, "acct-e").await,
        0,
        "the effect written before the error is rolled back"
    );
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_claims")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(claims, 0, "the claim is rolled back with it");

    // The next attempt (here with the event corrected upstream) applies exactly once.
    let fixed = payment(id, "acct-e", 5);
    assert!(matches!(
        record_then_validate.apply(&store, &fixed, &()).await,
        Outcome::Applied { .. }
    ));
    assert!(matches!(
        record_then_validate.apply(&store, &fixed, &()).await,
        Outcome::Skipped { .. }
    ));
    assert_eq!(balance(&pool, "acct-e").await, 5);
}

#[sqlx::test(migrations = false)]
async fn concurrent_deliveries_apply_exactly_once(pool: PgPool) {
    let store = setup(&pool).await;
    let msg = payment(uuid::Uuid::new_v4(), "acct-race", 100);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (store, msg) = (store.clone(), msg.clone());
            tokio::spawn(async move { record_payment.apply(&store, &msg, &()).await })
        })
        .collect();
    let mut applied = 0;
    for task in tasks {
        match task.await.unwrap() {
            Outcome::Applied { .. } => applied += 1,
            Outcome::Skipped { .. } => {}
            Outcome::Failed(e) => panic!("no delivery should fail: {e}"),
        }
    }
    assert_eq!(applied, 1);
    assert_eq!(balance(&pool, "acct-race").await, 100);
}

#[sqlx::test(migrations = false)]
async fn the_second_transaction_applies_when_the_first_rolls_back(pool: PgPool) {
    let store = setup(&pool).await;
    let id = uuid::Uuid::new_v4();
    let event = || PaymentReceived {
        event_id: id.to_string(),
        account_id: "acct-2tx".into(),
        amount_cents: 10,
    };
    let key = record_payment.dedup_key(&event(), &()).unwrap();

    // The first delivery claims and writes, but has not committed yet.
    let mut first = store.begin().await.unwrap();
    assert!(
        store
            .claim(&mut first, &key, None, record_payment.ttl())
            .await
            .unwrap()
            .is_claimed()
    );
    record_payment::call(&mut first, event()).await.unwrap();

    // The second delivery blocks on the first's claim.
    let msg = payment(id, "acct-2tx", 10);
    let second = tokio::spawn({
        let store = store.clone();
        async move { record_payment.apply(&store, &msg, &()).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second delivery must wait for the first transaction"
    );

    store.rollback(first).await.unwrap();
    let out = second.await.unwrap();
    assert!(
        matches!(out, Outcome::Applied { reclaimed: false }),
        "{out:?}"
    );
    assert_eq!(
        balance(&pool, "acct-2tx").await,
        10,
        "exactly one apply survives"
    );
}

#[sqlx::test(migrations = false)]
async fn a_stuck_claim_becomes_a_retryable_lock_timeout(pool: PgPool) {
    let config = PgConfig::default().with_lock_timeout(Duration::from_millis(200));
    let store = setup_with(&pool, config).await;
    let id = uuid::Uuid::new_v4();
    let event = PaymentReceived {
        event_id: id.to_string(),
        account_id: "a".into(),
        amount_cents: 1,
    };
    let key = record_payment.dedup_key(&event, &()).unwrap();

    let mut stuck = store.begin().await.unwrap();
    store
        .claim(&mut stuck, &key, None, record_payment.ttl())
        .await
        .unwrap();

    let out = record_payment
        .apply(&store, &payment(id, "a", 1), &())
        .await;
    let Outcome::Failed(Error::Store(e)) = out else {
        panic!("{out:?}")
    };
    assert_eq!(e.code(), Some("55P03"), "{e}");
    assert_eq!(
        e.classification(),
        Classification::Contention,
        "waited out, never dead-lettered: {e}"
    );
    store.rollback(stuck).await.unwrap();
}

/// Raises an error with the SQLSTATE given in the event, from inside the
/// handler's own transaction.
#[derive(serde::Deserialize)]
struct Raise {
    id: String,
    sqlstate: String,
}

#[idempotent(key = "id", ttl = "1h")]
async fn raise(tx: &mut PgTx, ev: Raise) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT raise_sqlstate($1)")
        .bind(&ev.sqlstate)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn handler_database_errors_are_classified_by_sqlstate(pool: PgPool) {
    let store = setup(&pool).await;
    sqlx::query(
        "CREATE FUNCTION raise_sqlstate(code text) RETURNS void LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'raised %', code USING ERRCODE = code; END $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    use Classification::{Contention, Environment, Permanent, Transient};
    for (code, whose) in [
        // Contention: retried as long as it lasts, never dead-lettered.
        ("40001", Contention),
        ("40P01", Contention),
        ("55P03", Contention),
        // The event's data: dead-lettered at once.
        ("23505", Permanent),
        ("22P02", Permanent),
        ("22003", Permanent),
        // The environment's: waited out, never dead-lettered.
        ("25006", Environment),
        ("53100", Environment),
        ("53200", Environment),
        ("57014", Environment),
        ("57P01", Environment),
        ("08006", Environment),
        ("28P01", Environment),
        ("42P01", Environment),
        ("42501", Environment),
        ("XX000", Environment),
        // Not known to be the environment's: bounded, so no event can
        // stall its partition for good.
        ("P0001", Transient),
        // A handler's statement an event can shape (a column or conflict
        // target named by the event): bounded too. (The store's own
        // statements wait these out: tests/claim_id.rs in dedup-postgres.)
        ("42703", Transient),
        ("42P10", Transient),
        ("54000", Transient),
        ("25P02", Transient),
    ] {
        let msg = serde_json::json!({ "id": code, "sqlstate": code }).to_string();
        let out = raise.apply(&store, msg.as_bytes(), &()).await;
        let Outcome::Failed(e) = out else {
            panic!("{code}: {out:?}")
        };
        assert_eq!(e.kind(), "handler");
        assert_eq!(e.classification(), whose, "SQLSTATE {code}: {e}");
    }
}

#[sqlx::test(migrations = false)]
async fn a_configured_schema_qualified_table_is_used_and_migrations_are_idempotent(pool: PgPool) {
    let config = PgConfig::default().with_table("billing.Claims");
    let store = setup_with(&pool, config.clone()).await;
    // A second instance starting up migrates again: nothing to do, no error.
    PgStore::from_pool_with(pool.clone(), config)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    // A default store in the same database keeps its own table.
    PgStore::from_pool(pool.clone()).migrate().await.unwrap();

    let msg = payment(uuid::Uuid::new_v4(), "acct-t", 3);
    assert!(matches!(
        record_payment.apply(&store, &msg, &()).await,
        Outcome::Applied { .. }
    ));
    let in_custom: i64 = sqlx::query_scalar(r#"SELECT count(*) FROM billing."Claims""#)
        .fetch_one(&pool)
        .await
        .unwrap();
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_claims")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((in_custom, in_default), (1, 0));
    let indexed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = 'billing' AND indexname = 'Claims_expires_at_idx')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(indexed, "the expiry index exists");
}

#[test]
fn invalid_table_names_are_refused_before_any_sql() {
    let err = PgConfig::default().with_table("claims; DROP TABLE accounts");
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(PgStore::connect_with(
            "postgres://nobody@127.0.0.1:1/none",
            err,
        ));
    let Err(e) = result else {
        panic!("must be refused")
    };
    assert!(e.to_string().contains("invalid table name"), "{e}");
    assert!(!e.is_retryable());
}

#[sqlx::test(migrations = false)]
async fn debug_output_hides_the_connection_string(pool: PgPool) {
    let store = PgStore::from_pool(pool);
    let shown = format!("{store:?}");
    assert!(shown.contains("dedup_claims"), "{shown}");
    assert!(
        !shown.contains("dedup:dedup") && !shown.contains("password"),
        "{shown}"
    );
}

/// The URL of the test's own database (`#[sqlx::test]` made it), for the
/// constructors that take a URL.
async fn own_database_url(pool: &PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .unwrap();
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let base = base.split('?').next().unwrap_or(&base);
    let (server, _) = base.rsplit_once('/').expect("a URL with a database");
    format!("{server}/{name}")
}

#[sqlx::test(migrations = false)]
async fn a_pool_size_of_zero_counts_as_one(pool: PgPool) {
    let mut config = PgConfig::default();
    config.max_connections = 0;
    let store = PgStore::connect_with(&own_database_url(&pool).await, config)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    setup(&pool).await;
    let msg = payment(uuid::Uuid::new_v4(), "acct-0", 7);
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        record_payment.apply(&store, &msg, &()),
    )
    .await
    .expect("a pool of 0 connections never hands one out");
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    assert_eq!(balance(&pool, "acct-0").await, 7);
}

/// PostgreSQL takes at most `i32::MAX` ms for `lock_timeout`: a longer
/// configured timeout must not fail every transaction's BEGIN (which would
/// dead-letter every message).
#[sqlx::test(migrations = false)]
async fn a_lock_timeout_of_a_month_still_begins_transactions(pool: PgPool) {
    let config = PgConfig::default().with_lock_timeout(Duration::from_secs(30 * 86_400));
    let store = setup_with(&pool, config).await;
    let msg = payment(uuid::Uuid::new_v4(), "acct-m", 3);
    let out = record_payment.apply(&store, &msg, &()).await;
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    assert_eq!(balance(&pool, "acct-m").await, 3);
}
