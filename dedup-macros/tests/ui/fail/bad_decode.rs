use dedup_core::{HandlerError, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Paid {
    event_id: String,
}

#[idempotent(key = "event_id", ttl = "4h", format = "avro")]
async fn unknown_format(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "event_id", ttl = "4h", format = "json", decode = other)]
async fn both(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "event_id", ttl = "4h", decode = "other")]
async fn a_string(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Ok(())
}

fn other(_payload: &[u8]) -> Result<String, std::io::Error> {
    Ok(String::new())
}

/// Decodes into another type than the handler's event.
#[idempotent(key = "event_id", ttl = "4h", decode = other)]
async fn wrong_type(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Ok(())
}

/// Built without dedup-core's `protobuf` feature.
#[idempotent(key = "event_id", ttl = "4h", format = "protobuf")]
async fn protobuf(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
