use dedup_core::{Handler, HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
pub struct Payment {
    event_id: String,
}

/// All claimed events of a batch at once, for one multi-row write.
#[idempotent(key = "event_id", ttl = "4h", batch)]
async fn record_payments(_tx: &mut MemoryTx, events: Vec<Payment>) -> Result<(), HandlerError> {
    let _ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
    Ok(())
}

fn assert_handler<H: Handler<Tx = MemoryTx, Event = Payment>>(_: H) {}

fn main() {
    assert_handler(record_payments);
}
