use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    event_id: Vec<u8>,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn handler(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
