//! The test kit on the memory store: it passes a handler whose effect is
//! transactional, and catches one that writes outside its transaction,
//! whatever the delivery pattern that shows it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use dedup_core::testing::{Delivery, Failure, Pattern, assert_idempotent, check_idempotent};
use dedup_core::{HandlerError, MemoryStore, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Paid {
    event_id: String,
    account: String,
    cents: i64,
}

fn paid(id: u32, account: &str, cents: i64) -> Delivery {
    Delivery::json(
        &serde_json::json!({ "event_id": format!("e{id}"), "account": account, "cents": cents }),
    )
}

/// Seven payments to two accounts: an odd count, so the halves differ.
fn payments() -> Vec<Delivery> {
    (0..7)
        .map(|i| paid(i, if i % 2 == 0 { "a" } else { "b" }, 10 + i64::from(i)))
        .collect()
}

type Balances = BTreeMap<String, i64>;

fn add(balances: &Mutex<Balances>, account: String, cents: i64) {
    *balances.lock().unwrap().entry(account).or_default() += cents;
}

static GOOD: Mutex<Balances> = Mutex::new(BTreeMap::new());

/// Changes the balance only when its transaction commits.
#[idempotent(key = "event_id", ttl = "4h")]
async fn transactional(tx: &mut MemoryTx, ev: Paid) -> Result<(), HandlerError> {
    tx.on_commit(move || add(&GOOD, ev.account, ev.cents));
    Ok(())
}

#[tokio::test]
async fn a_transactional_handler_passes_and_the_ttl_trade_off_shows() {
    let report = assert_idempotent(
        &transactional,
        &MemoryStore::new(),
        &payments(),
        async |_| GOOD.lock().unwrap().clear(),
        async |_| GOOD.lock().unwrap().clone(),
    )
    .await;
    let expected: Balances = [("a".into(), 10 + 12 + 14 + 16), ("b".into(), 11 + 13 + 15)].into();
    assert_eq!(report.once, expected);
    // Delivered again after its 1 s TTL: applied again, by design.
    let doubled: Balances = expected.iter().map(|(k, v)| (k.clone(), 2 * v)).collect();
    assert_eq!(report.after_ttl, doubled);
    assert!(report.applied_again_after_ttl());
}

static PAUSED: Mutex<Balances> = Mutex::new(BTreeMap::new());

#[idempotent(key = "event_id", ttl = "4h")]
async fn transactional_paused(tx: &mut MemoryTx, ev: Paid) -> Result<(), HandlerError> {
    tx.on_commit(move || add(&PAUSED, ev.account, ev.cents));
    Ok(())
}

/// A test runtime with a paused clock jumps tokio's timers, not the
/// store's clock: the kit waits for the TTL in real time all the same, so
/// the redelivery after it is applied, not skipped and reported unchanged.
#[tokio::test(start_paused = true)]
async fn the_ttl_is_waited_out_in_real_time_under_a_paused_clock() {
    let report = assert_idempotent(
        &transactional_paused,
        &MemoryStore::new(),
        &payments(),
        async |_| PAUSED.lock().unwrap().clear(),
        async |_| PAUSED.lock().unwrap().clone(),
    )
    .await;
    assert_eq!(report.after_ttl["a"], 2 * report.once["a"]);
}

static LEAKY: Mutex<Balances> = Mutex::new(BTreeMap::new());

/// Writes the balance at once, outside its transaction, as a handler that
/// calls another service or uses another connection would.
#[idempotent(key = "event_id", ttl = "4h")]
async fn outside_its_transaction(_tx: &mut MemoryTx, ev: Paid) -> Result<(), HandlerError> {
    add(&LEAKY, ev.account, ev.cents);
    Ok(())
}

#[tokio::test]
async fn a_handler_writing_outside_its_transaction_is_caught_by_a_crash_before_the_commit() {
    let failure = check_idempotent(
        &outside_its_transaction,
        &MemoryStore::new(),
        &payments(),
        async |_| LEAKY.lock().unwrap().clear(),
        async |_| LEAKY.lock().unwrap().clone(),
    )
    .await
    .expect_err("the effect is doubled by a retry after a rollback");
    let message = failure.to_string();
    let Failure::Differs { pattern, once, got } = failure else {
        panic!("{message}")
    };
    assert_eq!(pattern, Pattern::CrashBeforeCommit, "{message}");
    assert_eq!(once["a"], 52);
    assert_eq!(got["a"], 104, "every event's effect twice");
    assert!(
        message.contains("not idempotent under `crash_before_commit`"),
        "{message}"
    );
    assert!(
        message.contains(r#"each event once: {"a": 52, "b": 39}"#),
        "{message}"
    );
    assert!(
        message.contains(r#"crash_before_commit: {"a": 104, "b": 78}"#),
        "{message}"
    );
}

static BATCHED: Mutex<Balances> = Mutex::new(BTreeMap::new());

/// A batch body that credits the first event for the whole batch: right
/// one event at a time, wrong in a batch.
#[idempotent(key = "event_id", ttl = "4h", batch)]
async fn wrong_in_a_batch(tx: &mut MemoryTx, events: Vec<Paid>) -> Result<(), HandlerError> {
    let n = events.len() as i64;
    if let Some(first) = events.into_iter().next() {
        tx.on_commit(move || add(&BATCHED, first.account, first.cents * n));
    }
    Ok(())
}

#[tokio::test]
async fn a_batch_body_that_differs_from_one_event_at_a_time_is_caught() {
    let failure = check_idempotent(
        &wrong_in_a_batch,
        &MemoryStore::new(),
        &payments(),
        async |_| BATCHED.lock().unwrap().clear(),
        async |_| BATCHED.lock().unwrap().clone(),
    )
    .await
    .expect_err("the batch differs");
    assert!(
        matches!(
            failure,
            Failure::Differs {
                pattern: Pattern::Batch,
                ..
            }
        ),
        "{failure}"
    );
}

static POISONED: Mutex<Balances> = Mutex::new(BTreeMap::new());

#[idempotent(key = "event_id", ttl = "4h")]
async fn with_poison(tx: &mut MemoryTx, ev: Paid) -> Result<(), HandlerError> {
    tx.on_commit(move || add(&POISONED, ev.account, ev.cents));
    Ok(())
}

/// Events that do not decode or have no key are the runtime's dead
/// letters: they change nothing under any pattern, batch included.
#[tokio::test]
async fn poison_among_the_events_changes_nothing() {
    let mut events = payments();
    events.insert(2, Delivery::bytes("not json"));
    events.insert(
        5,
        Delivery::json(&serde_json::json!({ "account": "a", "cents": 1 })),
    );
    let report = assert_idempotent(
        &with_poison,
        &MemoryStore::new(),
        &events,
        async |_| POISONED.lock().unwrap().clear(),
        async |_| POISONED.lock().unwrap().clone(),
    )
    .await;
    assert_eq!(report.once["a"], 52);
    let dead: Vec<usize> = report.dead_lettered.iter().map(|(i, _)| *i).collect();
    assert_eq!(dead, [2, 5]);
    assert!(
        report.dead_lettered[0].1.contains("cannot decode"),
        "{:?}",
        report.dead_lettered
    );
    assert!(
        report.dead_lettered[1].1.contains("event_id"),
        "{:?}",
        report.dead_lettered
    );
}

/// Payloads that all miss the event type (here `event_id` as a number)
/// would pass every pattern with nothing applied: the kit says so instead.
#[tokio::test]
async fn events_that_all_fail_to_decode_test_nothing_and_say_so() {
    let events: Vec<Delivery> = (0..3)
        .map(|i| Delivery::json(&serde_json::json!({ "event_id": i, "account": "a", "cents": 1 })))
        .collect();
    let failure = check_idempotent(
        &with_poison,
        &MemoryStore::new(),
        &events,
        async |_| {},
        async |_| (),
    )
    .await
    .expect_err("nothing applied");
    let message = failure.to_string();
    assert!(
        matches!(failure, Failure::NothingApplied { first: Some(_) }),
        "{message}"
    );
    assert!(message.contains("every one was dead-lettered"), "{message}");
    assert!(message.contains("invalid type: integer"), "{message}");
    let failure = check_idempotent(
        &with_poison,
        &MemoryStore::new(),
        &[],
        async |_| {},
        async |_| (),
    )
    .await
    .expect_err("no events");
    assert!(
        matches!(failure, Failure::NothingApplied { first: None }),
        "{failure}"
    );
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn always_busy(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Err(HandlerError::transient("the downstream is busy"))
}

#[tokio::test]
async fn an_event_that_never_succeeds_is_reported_not_skipped() {
    let failure = check_idempotent(
        &always_busy,
        &MemoryStore::new(),
        &payments(),
        async |_| {},
        async |_| (),
    )
    .await
    .expect_err("nothing applies");
    let message = failure.to_string();
    assert!(
        matches!(
            failure,
            Failure::KeptFailing {
                pattern: Pattern::Once,
                event: 0,
                ..
            }
        ),
        "{message}"
    );
    assert!(message.contains("the downstream is busy"), "{message}");
}
