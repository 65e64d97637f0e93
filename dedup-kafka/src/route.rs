//! Handlers of different event types behind one interface.

use std::future::Future;
use std::pin::Pin;

use dedup_core::{DedupStore, Handler, Headers, Outcome};

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A handler with its event type erased, so one consumer can route topics to
/// handlers of different event types over one store.
pub(crate) trait ErasedHandler<S>: Send + Sync + 'static {
    fn scope(&self) -> &str;

    fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome>;
}

impl<S, H> ErasedHandler<S> for H
where
    S: DedupStore,
    H: Handler<Tx = S::Tx>,
{
    fn scope(&self) -> &str {
        Handler::scope(self)
    }

    fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome> {
        Box::pin(Handler::apply(self, store, payload, headers))
    }
}
