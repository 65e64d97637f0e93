//! A handler may take its record's metadata last, in every mode; the key
//! still comes from the event's fields or headers, and the body gets the
//! record it came in.

use dedup_core::{
    Describe, DescribeExt, HandlerError, HandlerExt, Lease, MemoryStore, MemoryTx, Meta,
    Outcome, idempotent,
};

#[derive(serde::Deserialize)]
pub struct Payment {
    event_id: String,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn single(_tx: &mut MemoryTx, ev: Payment, meta: &Meta) -> Result<(), HandlerError> {
    assert_eq!(ev.event_id, "p-1");
    assert_eq!((meta.topic(), meta.partition(), meta.offset()), ("payments", 2, 7));
    assert_eq!(meta.header_str("tenant"), Some("acme"));
    Ok(())
}

#[idempotent(key = "header:event-id", ttl = "4h", batch)]
async fn batch(
    _tx: &mut MemoryTx,
    events: Vec<Payment>,
    meta: &[dedup_core::Meta],
) -> Result<(), HandlerError> {
    assert_eq!(events.len(), meta.len());
    assert_eq!(meta[0].offset(), 7);
    Ok(())
}

#[idempotent(key = "event_id, header:tenant", ttl = "4h", lease = "30s", fingerprint = "event_id")]
async fn leased(_lease: &Lease, ev: Payment, meta: &Meta) -> Result<(), HandlerError> {
    assert_eq!(meta.key_str(), Some("acct-1"));
    let _ = ev.event_id;
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let meta = Meta::new("payments", 2, 7)
        .with_key("acct-1")
        .with_header("tenant", "acme")
        .with_header("event-id", "h-1");
    let payload = br#"{"event_id":"p-1"}"#;
    let store = MemoryStore::new();
    assert!(matches!(single.apply(&store, payload, &meta).await, Outcome::Applied { .. }));
    assert!(matches!(batch.apply(&store, payload, &meta).await, Outcome::Applied { .. }));
    let (key, _, event) = leased.prepare(payload, &meta).expect("prepared");
    assert_eq!(key.id(), dedup_core::composite_id(["p-1", "acme"]));
    assert_eq!(event.meta, meta);
    // Without a record (bare headers), the metadata is empty.
    assert_eq!(single.decode(payload).expect("decoded").meta, Meta::default());
}
