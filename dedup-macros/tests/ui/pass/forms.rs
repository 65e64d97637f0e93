use dedup_core::{Describe, Handler, HandlerError, Lease, LeaseHandler, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
pub struct Payment {
    event_id: uuid::Uuid,
    meta: Meta,
}

#[derive(serde::Deserialize)]
pub struct Meta {
    trace_id: Option<u64>,
    tenant: String,
}

/// Doc comments and visibility carry over to the handler value.
#[idempotent(key = "event_id", ttl = "4h")]
pub async fn by_uuid(_tx: &mut MemoryTx, _ev: Payment) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "meta.trace_id", ttl = "1h30m", scope = "payments-v2")]
async fn by_nested_option(_tx: &mut MemoryTx, _ev: Payment) -> Result<(), std::io::Error> {
    Ok(())
}

#[idempotent(key = "header:event-id", ttl = "7d")]
async fn by_header(_tx: &mut MemoryTx, _ev: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

/// A composite key: fields and headers, any mix, each part checked.
#[idempotent(key = "meta.tenant, header:event-id, event_id", ttl = "4h")]
async fn by_composite_key(_tx: &mut MemoryTx, _ev: Payment) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "header:tenant,header:event-id", ttl = "4h")]
async fn by_two_headers(_tx: &mut MemoryTx, _ev: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

/// A fingerprint of the whole payload.
#[idempotent(key = "event_id", ttl = "4h", fingerprint)]
async fn with_payload_fingerprint(_tx: &mut MemoryTx, _ev: Payment) -> Result<(), HandlerError> {
    Ok(())
}

/// A fingerprint of some fields, an `Option` among them.
#[idempotent(key = "event_id", ttl = "4h", fingerprint = "meta.tenant, meta.trace_id")]
async fn with_field_fingerprint(_tx: &mut MemoryTx, _ev: Payment) -> Result<(), HandlerError> {
    Ok(())
}

/// Lease mode: the effect is outside the database; the body gets the lease.
#[idempotent(key = "event_id", ttl = "4h", lease = "30s", fingerprint)]
async fn in_lease_mode(lease: &Lease, _ev: Payment) -> Result<(), HandlerError> {
    let _token = lease.token();
    Ok(())
}

mod reexported {
    pub use dedup_core as dedup;
}

#[idempotent(key = "event_id", ttl = "90s", crate = "reexported::dedup")]
async fn through_a_reexport(_tx: &mut MemoryTx, _ev: Payment) -> Result<(), HandlerError> {
    Ok(())
}

fn assert_handler<H: Handler<Tx = MemoryTx>>(_: H) {}

fn assert_lease_handler<H: LeaseHandler>(_: H) {}

fn main() {
    assert_handler(by_uuid);
    assert_handler(by_nested_option);
    assert_handler(by_header);
    assert_handler(through_a_reexport);
    assert_handler(by_composite_key);
    assert_handler(by_two_headers);
    assert_handler(with_payload_fingerprint);
    assert_handler(with_field_fingerprint);
    assert_lease_handler(in_lease_mode);
    assert_eq!(in_lease_mode.lease().as_secs(), 30);
    assert_eq!(by_nested_option.scope(), "payments-v2");
    assert_eq!(through_a_reexport.ttl().as_secs(), 90);
    // The body stays callable on its own.
    let _future = by_uuid::call;
}
