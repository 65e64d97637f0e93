use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    event_id: String,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn handler(_tx: &mut MemoryTx, _ev: Ev, _extra: u32) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
