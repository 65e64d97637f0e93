//! Attributes written on a handler apply where they mean something: docs on
//! the handler value, lint levels on the body, `cfg` on everything generated.
#![deny(unused_variables, missing_docs)]

use dedup_core::{HandlerError, MemoryTx, idempotent};

/// An event.
#[derive(serde::Deserialize)]
pub struct Payment {
    /// Its id.
    pub event_id: String,
}

/// Documented, so `missing_docs` is satisfied by the generated struct; the
/// `allow` reaches the body, whose parameters are unused.
#[idempotent(key = "event_id", ttl = "4h")]
#[allow(unused_variables)]
pub async fn lenient(tx: &mut MemoryTx, ev: Payment) -> Result<(), HandlerError> {
    Ok(())
}

/// Compiled out, with every item generated for it: its event type does not
/// exist.
#[idempotent(key = "event_id", ttl = "4h")]
#[cfg(any())]
pub async fn compiled_out(_tx: &mut MemoryTx, _ev: NoSuchEvent) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {
    let _handler = lenient;
}
