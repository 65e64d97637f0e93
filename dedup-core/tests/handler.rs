//! `#[idempotent]` handlers applied through `HandlerExt::apply` on the memory store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{
    Error, Handler, HandlerError, HandlerExt, KeyError, MemoryStore, MemoryTx, Outcome, idempotent,
};

#[derive(serde::Deserialize)]
struct Payment {
    event_id: uuid::Uuid,
    /// Each test pays into accounts of its own: tests run in parallel threads
    /// of one process, so no two of them may share a balance.
    account: String,
    amount_cents: i64,
}

/// Balances by account, the handlers' effect.
static BALANCES: Mutex<Option<HashMap<String, i64>>> = Mutex::new(None);

fn add_to(account: String, cents: i64) {
    let mut balances = BALANCES.lock().unwrap();
    *balances
        .get_or_insert_with(HashMap::new)
        .entry(account)
        .or_default() += cents;
}

fn balance(account: &str) -> i64 {
    BALANCES
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|b| b.get(account).copied())
        .unwrap_or(0)
}

/// A non-idempotent effect (add to a balance), staged to happen on commit.
#[idempotent(key = "event_id", ttl = "1h")]
async fn add_payment(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    if ev.amount_cents < 0 {
        return Err(HandlerError::permanent("negative amount"));
    }
    tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    Ok(())
}

fn payment(account: &str, id: &str, amount: i64) -> Vec<u8> {
    format!(r#"{{"event_id":"{id}","account":"{account}","amount_cents":{amount}}}"#).into_bytes()
}

const ID: &str = "7f0c2b0e-6a43-4a8e-9d8b-0a3c2f1e5b6d";

#[tokio::test]
async fn the_three_ttl_cases() {
    let store = MemoryStore::new();
    let msg = payment("ttl-cases", ID, 250);

    // (A) first delivery applies.
    let out = add_payment.apply(&store, &msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: false }),
        "{out:?}"
    );
    assert_eq!(balance("ttl-cases"), 250);

    // (B) a redelivery within the TTL is skipped; the balance stays.
    let out = add_payment.apply(&store, &msg, &()).await;
    assert!(matches!(out, Outcome::Skipped { .. }), "{out:?}");
    assert_eq!(balance("ttl-cases"), 250);

    // (C) after the TTL the same event is new again and applies.
    store.advance(Duration::from_secs(3600));
    let out = add_payment.apply(&store, &msg, &()).await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: true }),
        "{out:?}"
    );
    assert_eq!(balance("ttl-cases"), 500);
}

#[tokio::test]
async fn permanent_failures_are_classified() {
    let store = MemoryStore::new();
    let out = add_payment.apply(&store, b"{not json", &()).await;
    let Outcome::Failed(e @ Error::Decode(_)) = out else {
        panic!("{out:?}")
    };
    assert!(!e.is_retryable());

    let out = add_payment
        .apply(&store, br#"{"amount_cents":1}"#, &())
        .await;
    assert!(
        matches!(out, Outcome::Failed(Error::Decode(_))),
        "missing required key field: {out:?}"
    );

    let out = add_payment
        .apply(&store, &payment("permanent", ID, -1), &())
        .await;
    let Outcome::Failed(e) = out else {
        panic!("{out:?}")
    };
    assert_eq!(e.kind(), "handler");
    assert!(!e.is_retryable());
    // The failed attempt rolled back its claim: nothing is left behind.
    assert!(store.is_empty());
}

#[derive(serde::Deserialize)]
struct Envelope {
    meta: Meta,
}
#[derive(serde::Deserialize)]
struct Meta {
    event_id: Option<String>,
}

#[idempotent(key = "meta.event_id", ttl = "5m", scope = "envelopes")]
async fn nested(_tx: &mut MemoryTx, _ev: Envelope) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "header:event-id", ttl = "5m")]
async fn by_header(_tx: &mut MemoryTx, _ev: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

#[tokio::test]
async fn keys_from_nested_fields_options_and_headers() {
    let store = MemoryStore::new();
    assert_eq!(nested.scope(), "envelopes");
    assert_eq!(nested.ttl().to_string(), "5m");
    let out = nested
        .apply(&store, br#"{"meta":{"event_id":"e-1"}}"#, &())
        .await;
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    let out = nested
        .apply(&store, br#"{"meta":{"event_id":null}}"#, &())
        .await;
    assert!(
        matches!(
            out,
            Outcome::Failed(Error::Key(KeyError::MissingField {
                field: "meta.event_id"
            }))
        ),
        "{out:?}"
    );
    let out = nested
        .apply(&store, br#"{"meta":{"event_id":""}}"#, &())
        .await;
    assert!(
        matches!(out, Outcome::Failed(Error::Key(KeyError::Empty))),
        "{out:?}"
    );

    assert_eq!(by_header.scope(), concat!(module_path!(), "::by_header"));
    let headers = vec![("event-id", b"h-1".to_vec())];
    assert!(matches!(
        by_header.apply(&store, b"{}", &headers).await,
        Outcome::Applied { .. }
    ));
    assert!(matches!(
        by_header.apply(&store, b"{}", &headers).await,
        Outcome::Skipped { .. }
    ));
    let out = by_header.apply(&store, b"{}", &()).await;
    assert!(
        matches!(
            out,
            Outcome::Failed(Error::Key(KeyError::MissingHeader { .. }))
        ),
        "{out:?}"
    );
}

/// Fails the first attempt at each account with a transient error.
#[idempotent(key = "event_id", ttl = "1h")]
async fn flaky(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    static FAILED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    {
        let mut failed = FAILED.lock().unwrap();
        if !failed.contains(&ev.account) {
            failed.push(ev.account);
            return Err(HandlerError::transient(std::io::Error::other(
                "downstream timed out",
            )));
        }
    }
    tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    Ok(())
}

#[tokio::test]
async fn a_failed_attempt_rolls_back_so_the_retry_applies_once() {
    let store = MemoryStore::new();
    let msg = payment("flaky", ID, 40);
    let out = flaky.apply(&store, &msg, &()).await;
    let Outcome::Failed(e) = out else {
        panic!("{out:?}")
    };
    assert!(e.is_retryable());
    assert_eq!(balance("flaky"), 0);
    assert!(matches!(
        flaky.apply(&store, &msg, &()).await,
        Outcome::Applied { .. }
    ));
    assert!(matches!(
        flaky.apply(&store, &msg, &()).await,
        Outcome::Skipped { .. }
    ));
    assert_eq!(balance("flaky"), 40);
}

#[tokio::test]
async fn the_body_stays_callable_for_unit_tests() {
    let store = MemoryStore::new();
    let mut tx = dedup_core::DedupStore::begin(&store).await.unwrap();
    let seen = Arc::new(AtomicI64::new(0));
    add_payment::call(
        &mut tx,
        Payment {
            event_id: uuid::Uuid::nil(),
            account: "callable".into(),
            amount_cents: 1,
        },
    )
    .await
    .unwrap();
    tx.on_commit({
        let seen = seen.clone();
        move || seen.store(1, Ordering::SeqCst)
    });
    dedup_core::DedupStore::commit(&store, tx).await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert_eq!(balance("callable"), 1);
}

#[idempotent(key = "event_id", ttl = "1h")]
async fn add_in_batch(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    if ev.amount_cents < 0 {
        return Err(HandlerError::permanent("negative amount"));
    }
    tx.on_commit(move || add_to(ev.account, ev.amount_cents));
    Ok(())
}

fn prepared(ids: &[(&str, i64)]) -> Vec<(dedup_core::DedupKey, Payment)> {
    ids.iter()
        .map(|(id, cents)| {
            let ev = add_in_batch.decode(&payment("batch", id, *cents)).unwrap();
            (add_in_batch.dedup_key(&ev, &()).unwrap(), ev)
        })
        .collect()
}

#[tokio::test]
async fn a_batch_claims_once_applies_in_order_and_rolls_back_whole() {
    let store = MemoryStore::new();
    let a = "00000000-0000-0000-0000-00000000000a";
    let b = "00000000-0000-0000-0000-00000000000b";
    let c = "00000000-0000-0000-0000-00000000000c";
    let d = "00000000-0000-0000-0000-00000000000d";

    // The same key twice in a batch: applied once.
    let out = add_in_batch
        .apply_batch(&store, prepared(&[(a, 1), (b, 10), (a, 1)]))
        .await
        .unwrap();
    let names: Vec<_> = out.iter().map(Outcome::name).collect();
    assert_eq!(names, ["applied", "applied", "skipped"]);
    assert_eq!(balance("batch"), 11);

    // A failure in the middle rolls back the whole batch: c is not applied.
    let err = add_in_batch
        .apply_batch(&store, prepared(&[(c, 100), (d, -1)]))
        .await
        .unwrap_err();
    assert!(!err.is_retryable());
    assert_eq!(balance("batch"), 11);
    let out = add_in_batch
        .apply_batch(&store, prepared(&[(c, 100), (b, 10)]))
        .await
        .unwrap();
    let names: Vec<_> = out.iter().map(Outcome::name).collect();
    assert_eq!(
        names,
        ["applied", "skipped"],
        "c was rolled back, b is a live duplicate"
    );
    assert_eq!(balance("batch"), 111);
}
