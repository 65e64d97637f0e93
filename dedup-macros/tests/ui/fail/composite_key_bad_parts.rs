use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    tenant_id: String,
    event_id: String,
}

#[idempotent(key = "tenant_id, event_id, tenant_id", ttl = "4h")]
async fn twice(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "tenant_id,, event_id", ttl = "4h")]
async fn empty_part(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "tenant-id, header:", ttl = "4h")]
async fn every_bad_part_reported(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
