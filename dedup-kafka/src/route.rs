//! Topics routed to handlers, and handlers of different event types behind
//! one interface.

use crate::pipeline::record::Record;
use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use dedup_core::{
    DedupKey, DedupStore, Describe, DescribeExt, Error, Fingerprint, Handler, HandlerExt, Headers,
    LeaseHandler, LeaseHandlerExt, LeaseStore, Outcome, Ttl, ordered_scope,
};

/// A topic routed to a handler, with where its poison messages go.
pub(crate) struct Route<S> {
    pub(crate) topic: String,
    pub(crate) handler: Effect<S>,
    pub(crate) dead_letter_topic: String,
    /// Registered on first use, after the application installed its
    /// recorder.
    pub(crate) metrics: std::sync::OnceLock<crate::metrics::RouteMetrics>,
}

impl<S: 'static> Route<S> {
    /// The route's metric handles.
    pub(crate) fn metrics(&self) -> &crate::metrics::RouteMetrics {
        self.metrics
            .get_or_init(|| crate::metrics::RouteMetrics::new(&self.topic, self.handler.scope()))
    }

    /// Where this route's outcomes are recorded: `stats` and its metrics.
    pub(crate) fn record<'a>(&'a self, stats: &'a crate::stats::Stats) -> Record<'a> {
        Record {
            stats,
            metrics: self.metrics(),
        }
    }

    /// Why a message of this route is dead-lettered.
    pub(crate) fn dead_letter(
        &self,
        kind: &'static str,
        message: String,
        attempts: u32,
    ) -> crate::dlq::DeadLetter<'_> {
        crate::dlq::DeadLetter {
            topic: &self.dead_letter_topic,
            kind,
            message,
            attempts,
            handler: self.handler.scope(),
        }
    }

    /// The claim that records that `msg` was dead-lettered: scope
    /// `dedup.dead-letter/<handler scope>/<topic>/<partition>` (the part
    /// after the prefix digested when the whole is too long:
    /// [`ordered_scope`]), id the
    /// offset as 20 digits (so ids sort as offsets), then the message's
    /// timestamp, payload size and a fingerprint, so that a different message at the same
    /// offset (a topic deleted and created again, another cluster) is never
    /// taken for it, then a 64-bit fingerprint of its key and payload. Taken in the store once the dead-letter topic has
    /// acknowledged the copy, it tells a redelivery of the message (a crash
    /// or a rebalance before its offset was committed) not to dead-letter
    /// it again, nor to apply it.
    pub(crate) fn dead_letter_record(&self, msg: &rdkafka::message::OwnedMessage) -> DedupKey {
        use rdkafka::message::Message as _;
        let timestamp = msg
            .timestamp()
            .to_millis()
            .map_or_else(|| "-".to_owned(), |t| t.to_string());
        let payload = msg.payload().unwrap_or_default();
        let id = format!(
            "{:020}.{timestamp}.{}.{:016x}",
            msg.offset().max(0),
            payload.len(),
            fingerprint(msg.key().unwrap_or_default(), payload)
        );
        self.dead_letter_key(msg.topic(), msg.partition(), id)
    }

    /// The first possible record of a message at `offset` or later.
    pub(crate) fn dead_letter_records_from(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> DedupKey {
        self.dead_letter_key(topic, partition, format!("{:020}", offset.max(0)))
    }

    fn dead_letter_key(&self, topic: &str, partition: i32, id: String) -> DedupKey {
        let scope = ordered_scope(&format!("{}/{topic}/{partition}", self.handler.scope()));
        DedupKey::new(scope, id).expect("never empty")
    }
}

/// FNV-1a (64 bits) of a message's key and payload: stable across
/// versions and platforms (it is stored), not cryptographic (telling two
/// unrelated messages apart is all it is for).
fn fingerprint(key: &[u8], payload: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in key.iter().chain(&[0xff]).chain(payload) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

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

impl<S, H> ErasedApply<S> for H
where
    S: DedupStore,
    H: Handler<Tx = S::Tx>,
{
    fn scope(&self) -> &str {
        Describe::scope(self)
    }

    fn ttl(&self) -> Ttl {
        Describe::ttl(self)
    }

    fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome> {
        Box::pin(HandlerExt::apply(self, store, payload, headers))
    }
}

impl<S, H> ErasedHandler<S> for H
where
    S: DedupStore,
    H: Handler<Tx = S::Tx>,
{
    fn prepare(&self, payload: &[u8], headers: &(dyn Headers + Sync)) -> Result<Prepared, Error> {
        let (key, fingerprint, event) = DescribeExt::prepare(self, payload, headers)?;
        Ok((key, fingerprint, Box::new(event)))
    }

    fn apply_batch<'a>(
        &'a self,
        store: &'a S,
        batch: Vec<Prepared>,
    ) -> BoxFuture<'a, Result<Vec<Outcome>, Error>> {
        let batch = batch
            .into_iter()
            .map(|(key, fingerprint, event)| {
                let event = event
                    .downcast::<H::Event>()
                    .expect("prepared by this same handler");
                (key, fingerprint, *event)
            })
            .collect();
        Box::pin(HandlerExt::apply_batch(self, store, batch))
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

    fn apply<'a>(
        &'a self,
        store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome> {
        Box::pin(self.0.apply_leased(store, payload, headers))
    }
}

#[cfg(test)]
mod tests {
    use super::fingerprint;

    #[test]
    fn fingerprints_are_stable_and_tell_key_from_payload() {
        // The FNV-1a test vector for the empty input, after the separator.
        assert_eq!(fingerprint(b"", b""), 0xaf64_724c_8602_eb6e);
        assert_ne!(fingerprint(b"ab", b"c"), fingerprint(b"a", b"bc"));
        assert_ne!(
            fingerprint(b"k", b"{\"amount\":1}"),
            fingerprint(b"k", b"{\"amount\":2}")
        );
    }
}
