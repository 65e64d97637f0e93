//! Every way to decode: JSON by default or by name, and a function of the
//! user's, whose own error type becomes a decode error.

use dedup_core::decode::ConfluentFrame;
use dedup_core::{Describe, Error, HandlerError, Lease, MemoryTx, idempotent};

#[derive(serde::Deserialize)]
struct Paid {
    event_id: String,
}

#[idempotent(key = "event_id", ttl = "4h", format = "json")]
async fn by_name(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Ok(())
}

/// A hand-rolled text format: `id`.
struct Plain {
    id: String,
}

#[derive(Debug)]
struct NotUtf8;

impl std::fmt::Display for NotUtf8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not UTF-8")
    }
}

impl std::error::Error for NotUtf8 {}

fn plain(payload: &[u8]) -> Result<Plain, NotUtf8> {
    let id = std::str::from_utf8(payload).map_err(|_| NotUtf8)?;
    Ok(Plain { id: id.to_owned() })
}

mod wire {
    /// The schema-registry frame around a JSON record.
    pub fn framed(payload: &[u8]) -> Result<super::Paid, dedup_core::Error> {
        let frame = super::ConfluentFrame::parse(payload)?;
        dedup_core::decode::json(frame.body)
    }
}

#[idempotent(key = "id", ttl = "4h", decode = plain)]
async fn custom(_tx: &mut MemoryTx, _ev: Plain) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "event_id", ttl = "4h", decode = wire::framed)]
async fn registry(_tx: &mut MemoryTx, _ev: Paid) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "id", ttl = "4h", decode = plain, batch)]
async fn custom_batch(_tx: &mut MemoryTx, _evs: Vec<Plain>) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "id", ttl = "4h", decode = plain, lease = "30s")]
async fn custom_leased(_lease: &Lease, _ev: Plain) -> Result<(), HandlerError> {
    Ok(())
}

/// An attribute written by a `macro_rules!`: the generated decoder still
/// finds its payload.
macro_rules! decoded_with {
    ($name:ident, $decode:path) => {
        #[idempotent(key = "id", ttl = "4h", decode = $decode)]
        async fn $name(_tx: &mut MemoryTx, _ev: Plain) -> Result<(), HandlerError> {
            Ok(())
        }
    };
}

decoded_with!(from_a_macro, plain);

fn main() {
    assert_eq!(Describe::decode(&custom_batch, b"b").unwrap().id, "b");
    assert_eq!(Describe::decode(&custom_leased, b"l").unwrap().id, "l");
    assert_eq!(from_a_macro.decode(b"m").unwrap().id, "m");
    assert_eq!(by_name.decode(br#"{"event_id": "e"}"#).unwrap().event_id, "e");
    assert_eq!(custom.decode(b"e").unwrap().id, "e");
    assert!(matches!(custom.decode(&[0xff]), Err(Error::Decode(e)) if e.to_string() == "not UTF-8"));
    let framed = [&[0, 0, 0, 0, 1][..], br#"{"event_id": "e"}"#].concat();
    assert_eq!(registry.decode(&framed).unwrap().event_id, "e");
    assert!(matches!(registry.decode(b"{}"), Err(Error::Decode(_))));
}
