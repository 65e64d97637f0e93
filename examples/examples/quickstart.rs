//! dedup in one screen, with no services: a retrying producer delivers some
//! payments twice, an `#[idempotent]` handler adds each amount to a balance
//! (a NON-idempotent effect), and the balance still comes out right. Then the
//! clock passes the TTL and a late redelivery is applied again, by design.
//!
//! Runs on the in-memory store. `cargo run -p dedup-examples --example quickstart`

#![allow(clippy::print_stdout)]

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use dedup_core::{Handler, HandlerError, MemoryStore, MemoryTx, Outcome, idempotent};

#[derive(serde::Deserialize)]
struct PaymentReceived {
    event_id: uuid::Uuid,
    amount_cents: i64,
}

static BALANCE: AtomicI64 = AtomicI64::new(0);

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut MemoryTx, ev: PaymentReceived) -> Result<(), HandlerError> {
    tx.on_commit(move || {
        BALANCE.fetch_add(ev.amount_cents, Ordering::SeqCst);
    });
    Ok(())
}

#[derive(Default)]
struct Tally {
    applied: u32,
    skipped: u32,
    failed: u32,
}

async fn deliver(store: &MemoryStore, payload: &[u8], tally: &mut Tally) {
    match record_payment.apply(store, payload, &()).await {
        Outcome::Applied { .. } => tally.applied += 1,
        Outcome::Skipped { .. } => tally.skipped += 1,
        Outcome::Failed(e) => {
            eprintln!("  failed ({}): {e}", e.kind());
            tally.failed += 1;
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = MemoryStore::new();
    let events: Vec<(uuid::Uuid, i64)> =
        (1..=100).map(|i| (uuid::Uuid::new_v4(), i * 10)).collect();
    let expected: i64 = events.iter().map(|(_, cents)| cents).sum();

    // Every third event is delivered twice, as a producer retry would.
    let mut tally = Tally::default();
    let mut deliveries = 0;
    for (i, (id, cents)) in events.iter().enumerate() {
        let payload = serde_json::json!({ "event_id": id, "amount_cents": cents }).to_string();
        let copies = if i % 3 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            deliveries += 1;
            deliver(&store, payload.as_bytes(), &mut tally).await;
        }
    }
    deliver(&store, b"{\"amount_cents\": 5}", &mut tally).await; // no event_id: rejected

    let balance = BALANCE.load(Ordering::SeqCst);
    println!(
        "delivered {deliveries} payments ({} distinct) and 1 malformed",
        events.len()
    );
    println!(
        "applied={} skipped={} failed={}  balance={balance} expected={expected}",
        tally.applied, tally.skipped, tally.failed
    );

    // Past the TTL the claim has expired: a very late redelivery is new again.
    store.advance(record_payment.ttl().as_duration() + Duration::from_secs(1));
    let (id, cents) = events[0];
    let late = serde_json::json!({ "event_id": id, "amount_cents": cents }).to_string();
    let out = record_payment.apply(&store, late.as_bytes(), &()).await;
    println!(
        "after the {} TTL a redelivery of the first event was {} (balance {})",
        record_payment.ttl(),
        out.name(),
        BALANCE.load(Ordering::SeqCst)
    );

    if balance != expected || tally.applied != 100 || tally.failed != 1 {
        eprintln!("CHECK FAILED: balance {balance} != {expected}");
        std::process::exit(1);
    }
    println!("check passed: every payment applied exactly once within the TTL");
}
