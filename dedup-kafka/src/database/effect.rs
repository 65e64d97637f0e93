//! A route's handler behind one interface, by its effect: a transactional
//! handler (its body writes through the store's transaction; one message or
//! a batch) or a lease-mode one (one message under a lease), its event's
//! type erased so that one topic's routes sit side by side.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use dedup_core::{
    DedupKey, DedupStore, Describe, DescribeExt, Error, Fingerprint, Handler, HandlerExt, Headers,
    LeaseHandler, LeaseHandlerExt, LeaseStore, Outcome, Ttl,
};

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A decoded event whose type only its handler knows.
pub(crate) type AnyEvent = Box<dyn Any + Send>;

/// A message ready for a batch: its key, its fingerprint, its event.
pub(crate) type Prepared = (DedupKey, Option<Fingerprint>, AnyEvent);

/// What a route's handler does with a message, by its effect: the one
/// place the two kinds of handler differ. Both apply one message; only a
/// transactional handler takes a batch in one transaction.
pub(crate) enum Effect<S> {
    /// The body writes through the store's transaction
    /// ([`Handler`]): one message, or a batch in one transaction.
    Transactional(Arc<dyn ErasedHandler<S>>),
    /// The body runs under a lease ([`LeaseHandler`]), one message at a
    /// time.
    Leased(Arc<dyn ErasedApply<S>>),
}

impl<S> Clone for Effect<S> {
    fn clone(&self) -> Self {
        match self {
            Effect::Transactional(h) => Effect::Transactional(h.clone()),
            Effect::Leased(h) => Effect::Leased(h.clone()),
        }
    }
}

impl<S: 'static> Effect<S> {
    /// What both effects do: apply one message.
    fn one(&self) -> &dyn ErasedApply<S> {
        match self {
            Effect::Transactional(h) => &**h,
            Effect::Leased(h) => &**h,
        }
    }

    pub(crate) fn scope(&self) -> &str {
        self.one().scope()
    }

    pub(crate) fn ttl(&self) -> Ttl {
        self.one().ttl()
    }

    pub(crate) fn preparer(&self) -> Option<&dyn dedup_core::decode::Prepare> {
        self.one().preparer()
    }

    /// Applies one message.
    pub(crate) fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome> {
        self.one().apply(store, payload, headers)
    }

    /// The handler that takes batches, if this one does.
    pub(crate) fn batches(&self) -> Option<&Arc<dyn ErasedHandler<S>>> {
        match self {
            Effect::Transactional(h) => Some(h),
            Effect::Leased(_) => None,
        }
    }
}

/// A handler with its event type erased, so one consumer can route topics
/// to handlers of different event types over one store: what every effect
/// does with one message.
pub(crate) trait ErasedApply<S>: Send + Sync + 'static {
    fn scope(&self) -> &str;

    fn ttl(&self) -> Ttl;

    /// What decoding needs fetched first (`Describe::preparer`).
    fn preparer(&self) -> Option<&dyn dedup_core::decode::Prepare>;

    fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome>;
}

/// A transactional handler, erased: one message, or a batch of them in one
/// transaction.
pub(crate) trait ErasedHandler<S>: ErasedApply<S> {
    /// Decodes a message and extracts its key and fingerprint, for the
    /// batch path.
    fn prepare(&self, payload: &[u8], headers: &(dyn Headers + Sync)) -> Result<Prepared, Error>;

    /// Applies events that [`prepare`](Self::prepare) made, in one
    /// transaction (see `HandlerExt::apply_batch`).
    fn apply_batch<'a>(
        &'a self,
        store: &'a S,
        batch: Vec<Prepared>,
    ) -> BoxFuture<'a, Result<Vec<Outcome>, Error>>;
}

impl<S: DedupStore> Effect<S> {
    /// A transactional handler's effect.
    pub(crate) fn transactional<H: Handler<Tx = S::Tx>>(handler: H) -> Self {
        Effect::Transactional(Arc::new(Erased(Arc::new(handler))))
    }

    /// A lease-mode handler's effect.
    pub(crate) fn leased<H: LeaseHandler>(handler: H) -> Self
    where
        S: LeaseStore,
    {
        Effect::Leased(Arc::new(Leased(handler)))
    }
}

/// A transactional handler routed to a topic (`ConsumerBuilder::handle`),
/// shared so a batch can run it through an adapter.
pub(crate) struct Erased<H>(pub(crate) Arc<H>);

impl<S, H> ErasedApply<S> for Erased<H>
where
    S: DedupStore,
    H: Handler<Tx = S::Tx>,
{
    fn scope(&self) -> &str {
        Describe::scope(&*self.0)
    }

    fn ttl(&self) -> Ttl {
        Describe::ttl(&*self.0)
    }

    fn preparer(&self) -> Option<&dyn dedup_core::decode::Prepare> {
        Describe::preparer(&*self.0)
    }

    fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome> {
        Box::pin(HandlerExt::apply(&*self.0, store, payload, headers))
    }
}

impl<S, H> ErasedHandler<S> for Erased<H>
where
    S: DedupStore,
    H: Handler<Tx = S::Tx>,
{
    fn prepare(&self, payload: &[u8], headers: &(dyn Headers + Sync)) -> Result<Prepared, Error> {
        let (key, fingerprint, event) = DescribeExt::prepare(&*self.0, payload, headers)?;
        // Prepared in its message's span (feature `opentelemetry`), which
        // its body runs in.
        #[cfg(feature = "opentelemetry")]
        let event = (event, opentelemetry::Context::current());
        Ok((key, fingerprint, Box::new(event)))
    }

    fn apply_batch<'a>(
        &'a self,
        store: &'a S,
        batch: Vec<Prepared>,
    ) -> BoxFuture<'a, Result<Vec<Outcome>, Error>> {
        #[cfg(feature = "opentelemetry")]
        type Event<H> = <traced::Traced<H> as Describe>::Event;
        #[cfg(not(feature = "opentelemetry"))]
        type Event<H> = <H as Describe>::Event;
        let batch = batch
            .into_iter()
            .map(|(key, fingerprint, event)| {
                let event = event
                    .downcast::<Event<H>>()
                    .expect("prepared by this same handler");
                (key, fingerprint, *event)
            })
            .collect();
        #[cfg(feature = "opentelemetry")]
        return Box::pin(async move {
            HandlerExt::apply_batch(&traced::Traced(self.0.clone()), store, batch).await
        });
        #[cfg(not(feature = "opentelemetry"))]
        Box::pin(HandlerExt::apply_batch(&*self.0, store, batch))
    }
}

/// A batch's events, each with its message's trace context (feature
/// `opentelemetry`): a handler that takes its events one at a time runs
/// each in its own message's span, so what it writes (an outbox event)
/// continues that message's trace; one that takes the batch at once runs
/// in the batch's span, which links to them all.
#[cfg(feature = "opentelemetry")]
mod traced {
    use std::sync::Arc;

    use dedup_core::{Describe, Error, Fingerprint, Handler, HandlerError, Headers, KeyError, Ttl};
    use opentelemetry::Context;
    use opentelemetry::context::FutureExt as _;

    pub(crate) struct Traced<H>(pub(crate) Arc<H>);

    impl<H: Handler> Describe for Traced<H> {
        type Event = (H::Event, Context);

        fn scope(&self) -> &str {
            self.0.scope()
        }

        fn ttl(&self) -> Ttl {
            self.0.ttl()
        }

        fn key(&self, event: &Self::Event, headers: &dyn Headers) -> Result<String, KeyError> {
            self.0.key(&event.0, headers)
        }

        fn fingerprint(&self, event: &Self::Event, payload: &[u8]) -> Option<Fingerprint> {
            self.0.fingerprint(&event.0, payload)
        }

        fn decode(&self, payload: &[u8]) -> Result<Self::Event, Error> {
            Ok((self.0.decode(payload)?, Context::current()))
        }

        fn decode_record(
            &self,
            payload: &[u8],
            headers: &dyn Headers,
        ) -> Result<Self::Event, Error> {
            Ok((self.0.decode_record(payload, headers)?, Context::current()))
        }

        fn preparer(&self) -> Option<&dyn dedup_core::decode::Prepare> {
            self.0.preparer()
        }
    }

    impl<H: Handler> Handler for Traced<H> {
        type Tx = H::Tx;

        fn takes_batches(&self) -> bool {
            self.0.takes_batches()
        }

        async fn handle(
            &self,
            tx: &mut Self::Tx,
            (event, cx): Self::Event,
        ) -> Result<(), HandlerError> {
            self.0.handle(tx, event).with_context(cx).await
        }

        async fn handle_batch(
            &self,
            tx: &mut Self::Tx,
            events: Vec<Self::Event>,
        ) -> Result<(), HandlerError> {
            if self.0.takes_batches() {
                let events = events.into_iter().map(|(event, _)| event).collect();
                return self.0.handle_batch(tx, events).await;
            }
            for (event, cx) in events {
                self.0.handle(tx, event).with_context(cx).await?;
            }
            Ok(())
        }
    }
}

/// A lease-mode handler routed to a topic (`ConsumerBuilder::handle_leased`).
pub(crate) struct Leased<H>(pub(crate) H);

impl<S, H> ErasedApply<S> for Leased<H>
where
    S: LeaseStore,
    H: LeaseHandler,
{
    fn scope(&self) -> &str {
        Describe::scope(&self.0)
    }

    fn ttl(&self) -> Ttl {
        Describe::ttl(&self.0)
    }

    fn preparer(&self) -> Option<&dyn dedup_core::decode::Prepare> {
        Describe::preparer(&self.0)
    }

    fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome> {
        Box::pin(self.0.apply_leased(store, payload, headers))
    }
}
