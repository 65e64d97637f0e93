//! The `#[idempotent]` attribute. Use it through `dedup_core::idempotent`,
//! where it is documented; this crate only holds the compiler plugin.

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
