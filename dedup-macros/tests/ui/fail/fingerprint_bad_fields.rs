use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    event_id: String,
    amount: i64,
    lines: Vec<u32>,
}

// A typo in a fingerprint field is reported on its string.
#[idempotent(key = "event_id", ttl = "4h", fingerprint = "amount, acount")]
async fn typo(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

// Fingerprint fields are printed like keys: they must implement Display.
#[idempotent(key = "event_id", ttl = "4h", fingerprint = "lines")]
async fn not_displayable(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "event_id", ttl = "4h", fingerprint = "header:x, amount,")]
async fn not_fields(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
