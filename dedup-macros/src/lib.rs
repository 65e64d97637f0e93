//! The `#[idempotent]` attribute. Use it through `dedup_core::idempotent`,
//! where it is documented; this crate only holds the compiler plugin.
//!
//! ```
//! use dedup_core::{Describe, HandlerError, MemoryTx, idempotent};
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced { event_id: String }
//!
//! #[idempotent(key = "event_id", ttl = "4h", scope = "orders::place")]
//! async fn place(_tx: &mut MemoryTx, _ev: OrderPlaced) -> Result<(), HandlerError> {
//!     Ok(())
//! }
//!
//! assert_eq!(place.scope(), "orders::place");
//! assert_eq!(place.ttl().as_duration().as_secs(), 4 * 3_600);
//! ```
//!
//! A key that names no field of the event, or a TTL outside the grammar,
//! fails the build with the error on the string written.

mod attr;
mod errors;
mod expand;

use proc_macro::TokenStream;

/// Turns an `async fn(tx, event)` into an idempotent handler; see
/// `dedup_core` for the options and what is generated.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(attr.into(), item.into()).into()
}
