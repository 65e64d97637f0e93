use dedup_core::{HandlerError, MemoryTx, Meta, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    event_id: String,
}

// A batch body gets one Meta per event: `&[Meta]`.
#[idempotent(key = "event_id", ttl = "4h", batch)]
async fn handler(_tx: &mut MemoryTx, _evs: Vec<Ev>, _meta: &Meta) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
