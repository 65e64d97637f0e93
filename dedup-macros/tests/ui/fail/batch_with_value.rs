use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    event_id: String,
}

#[idempotent(key = "event_id", ttl = "4h", batch = "yes")]
async fn handler(_tx: &mut MemoryTx, _ev: Vec<Ev>) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
