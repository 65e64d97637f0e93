use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    event_id: String,
}

// In lease mode the body gets the lease, not a transaction.
#[idempotent(key = "event_id", ttl = "4h", lease = "30s")]
async fn charge(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "event_id", ttl = "4h", lease = "30", batch)]
async fn batched(_lease: &dedup_core::Lease, _evs: Vec<Ev>) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
