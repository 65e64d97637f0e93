use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    tenant_id: String,
    event_id: String,
}

// Each part of a composite key is checked: the typo is the second one.
#[idempotent(key = "tenant_id, eventid", ttl = "4h")]
async fn handler(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
