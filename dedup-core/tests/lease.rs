//! Lease-mode handlers (`#[idempotent(lease = "...")]`) through
//! `LeaseHandlerExt::apply_leased` on the memory store: one holder at a
//! time, a failed effect released, a stale holder fenced.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{
    Error, HandlerError, Lease, LeaseError, LeaseHandler, LeaseHandlerExt, MemoryStore, Outcome,
    Token, idempotent,
};
use tokio::sync::Notify;

#[derive(serde::Deserialize)]
struct Charge {
    event_id: String,
    /// Each test charges accounts of its own (tests share this process).
    account: String,
    cents: i64,
}

/// The outside system: every effect performed, with the token it came
/// under, by account.
static EFFECTS: Mutex<Vec<(String, Token, i64)>> = Mutex::new(Vec::new());

fn effects(account: &str) -> Vec<(Token, i64)> {
    EFFECTS
        .lock()
        .unwrap()
        .iter()
        .filter(|(a, ..)| a == account)
        .map(|(_, token, cents)| (*token, *cents))
        .collect()
}

/// Gates that hold a body mid-effect, by account: the first body of the
/// account takes its gate, later ones run through.
static GATES: Mutex<Vec<(String, Arc<Notify>)>> = Mutex::new(Vec::new());

fn gate(account: &str) -> Option<Arc<Notify>> {
    let mut gates = GATES.lock().unwrap();
    let i = gates.iter().position(|(a, _)| a == account)?;
    Some(gates.remove(i).1)
}

/// Outcomes of `lease.extend()` after a gate opened, by account.
static EXTENDED: Mutex<Vec<(String, bool, bool)>> = Mutex::new(Vec::new());

#[idempotent(key = "event_id", ttl = "1h", lease = "30s", fingerprint)]
async fn charge(lease: &Lease, ev: Charge) -> Result<(), HandlerError> {
    if ev.cents < 0 {
        return Err(HandlerError::transient("the provider refused: try again"));
    }
    if let Some(gate) = gate(&ev.account) {
        gate.notified().await;
        let extended = lease.extend().await;
        let lost = matches!(extended, Err(LeaseError::Lost { .. }));
        EXTENDED
            .lock()
            .unwrap()
            .push((ev.account.clone(), lost, lease.is_lost()));
        if ev.account.ends_with("-stops") {
            // Stops before its effect, passing the loss on.
            extended?;
        }
    }
    EFFECTS
        .lock()
        .unwrap()
        .push((ev.account, lease.token(), ev.cents));
    Ok(())
}

fn payload(account: &str, id: &str, cents: i64) -> Vec<u8> {
    format!(r#"{{"event_id":"{id}","account":"{account}","cents":{cents}}}"#).into_bytes()
}

#[tokio::test]
async fn an_effect_runs_once_and_redeliveries_are_skipped() {
    let store = MemoryStore::new();
    assert_eq!(charge.lease().as_secs(), 30);
    let out = charge
        .apply_leased(&store, &payload("once", "c1", 5), &())
        .await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: false }),
        "{out:?}"
    );
    let out = charge
        .apply_leased(&store, &payload("once", "c1", 5), &())
        .await;
    assert!(matches!(out, Outcome::Skipped { .. }), "{out:?}");
    let out = charge
        .apply_leased(&store, &payload("once", "c1", 500), &())
        .await;
    assert!(
        matches!(out, Outcome::Failed(Error::FingerprintMismatch { .. })),
        "{out:?}"
    );
    assert_eq!(effects("once").len(), 1);
    // After the TTL, the event is new again.
    store.advance(Duration::from_secs(3601));
    let out = charge
        .apply_leased(&store, &payload("once", "c1", 5), &())
        .await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: true }),
        "{out:?}"
    );
}

#[tokio::test]
async fn a_failed_effect_releases_its_lease_for_the_retry() {
    let store = MemoryStore::new();
    let out = charge
        .apply_leased(&store, &payload("failing", "c2", -1), &())
        .await;
    let Outcome::Failed(e) = out else {
        panic!("{out:?}")
    };
    assert!(e.is_retryable(), "{e}");
    let out = charge
        .apply_leased(&store, &payload("failing", "c2", 7), &())
        .await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: false }),
        "released, so acquired at once: {out:?}"
    );
    assert_eq!(effects("failing").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_makes_a_duplicate_wait_and_a_stale_holder_is_fenced() {
    held_then_overtaken("held").await;
}

/// The same, with a stale holder that stops when `extend` says it lost and
/// returns that error: it is told it was taken over, not failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holder_that_stops_on_its_lost_lease_is_not_failed() {
    held_then_overtaken("held-stops").await;
}

async fn held_then_overtaken(account: &'static str) {
    let stops = account.ends_with("-stops");
    let store = MemoryStore::new();
    let held = Arc::new(Notify::new());
    GATES.lock().unwrap().push((account.into(), held.clone()));
    let first = tokio::spawn({
        let store = store.clone();
        async move {
            charge
                .apply_leased(&store, &payload(account, "c3", 11), &())
                .await
        }
    });
    // Once the first holder has its lease (the store holds its claim), it
    // is mid-effect: a duplicate is told to wait.
    for _ in 0..500 {
        if !store.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let out = charge
        .apply_leased(&store, &payload(account, "c3", 11), &())
        .await;
    let Outcome::Failed(e) = out else {
        panic!("the duplicate must meet the held lease: {out:?}")
    };
    assert!(e.is_retryable() && e.kind() == "lease_held", "{e}");
    assert!(effects(account).is_empty(), "no second effect meanwhile");

    // The holder stalls past its lease: the next delivery takes over.
    store.advance(Duration::from_secs(31));
    let out = charge
        .apply_leased(&store, &payload(account, "c3", 11), &())
        .await;
    assert!(
        matches!(out, Outcome::Applied { reclaimed: true }),
        "{out:?}"
    );

    // The stale holder wakes: it learns it lost, and its completion is
    // refused rather than overwriting the newer holder's.
    held.notify_one();
    let out = first.await.expect("first holder");
    assert!(
        matches!(out, Outcome::Failed(Error::LeaseLost { .. })),
        "{out:?}"
    );
    let extended = EXTENDED.lock().unwrap().clone();
    assert!(
        extended.contains(&(account.to_owned(), true, true)),
        "{extended:?}"
    );
    let tokens: Vec<Token> = effects(account).iter().map(|(t, _)| *t).collect();
    if stops {
        assert_eq!(
            tokens.len(),
            1,
            "only the newer holder's effect: {tokens:?}"
        );
    } else {
        assert_eq!(
            tokens.len(),
            2,
            "the stale effect ran (the outside system sees its token)"
        );
        assert!(
            tokens[0] > tokens[1],
            "the newer holder's token is greater: {tokens:?}"
        );
    }
    let out = charge
        .apply_leased(&store, &payload(account, "c3", 11), &())
        .await;
    assert!(
        matches!(out, Outcome::Skipped { .. }),
        "done by the newer holder: {out:?}"
    );
}

/// The idempotency keys and tokens a provider saw, in call order.
static PROVIDER_CALLS: Mutex<Vec<(String, Token)>> = Mutex::new(Vec::new());

/// A provider call whose reply is lost on the first attempt: the charge
/// went through, but the body fails as if it had not.
#[idempotent(key = "event_id", ttl = "1h", lease = "30s")]
async fn charge_losing_the_first_reply(lease: &Lease, ev: Charge) -> Result<(), HandlerError> {
    let first = {
        let mut calls = PROVIDER_CALLS.lock().unwrap();
        calls.push((lease.idempotency_key(), lease.token()));
        calls.len() == 1
    };
    if first {
        return Err(HandlerError::transient(format!(
            "timed out waiting for the provider's reply to {}",
            ev.event_id
        )));
    }
    Ok(())
}

/// A provider call retried after a lost reply (the lease released, a new
/// token taken) carries the same idempotency key, so the provider charges
/// once; the token still grows, for fencing.
#[tokio::test]
async fn the_idempotency_key_is_the_same_for_every_attempt_of_an_event() {
    let store = MemoryStore::new();
    let first = charge_losing_the_first_reply
        .apply_leased(&store, &payload("reply-lost", "c9", 5), &())
        .await;
    assert!(matches!(first, Outcome::Failed(_)), "{first:?}");
    let retried = charge_losing_the_first_reply
        .apply_leased(&store, &payload("reply-lost", "c9", 5), &())
        .await;
    assert!(matches!(retried, Outcome::Applied { .. }), "{retried:?}");
    let calls = PROVIDER_CALLS.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0].0, calls[1].0, "one key for both calls: {calls:?}");
    assert!(calls[0].0.ends_with("/c9"), "scope and event id: {calls:?}");
    assert!(calls[1].1 > calls[0].1, "a new holder, a greater token");
}
