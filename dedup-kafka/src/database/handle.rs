//! Which handler takes which topic: the consumer builder's `handle`,
//! `handle_type` and their lease-mode forms, and the other event types of a
//! typed topic.

use dedup_core::{DedupStore, Handler};

use super::builder::ConsumerBuilder;
use crate::database::effect::Effect;
use crate::database::route::Route;

impl<S: DedupStore> ConsumerBuilder<S> {
    /// Routes `topic` to `handler`. Its dead letters go to `<topic>.dlq`
    /// unless [`dead_letter_topic`](Self::dead_letter_topic) says otherwise.
    pub fn handle<H>(self, topic: impl Into<String>, handler: H) -> Self
    where
        H: Handler<Tx = S::Tx>,
    {
        self.route(topic.into(), None, Effect::transactional(handler))
    }

    /// Routes one event type of `topic` to `handler`, for a topic that
    /// carries several (what an outbox router produces per aggregate: each
    /// type with its own handler, key and TTL). Every handler of the topic
    /// names its type the same way: the same header
    /// (`EventType::header("event-type", "OrderPlaced")`) or the same
    /// top-level JSON field (`EventType::field("type", "OrderPlaced")`, as
    /// `#[serde(tag = "type")]` writes it). A message of a type no handler
    /// takes is dead-lettered with kind `unrouted` (see
    /// [`other_types`](Self::other_types)). Consecutive messages of one type
    /// share batches; a partition's messages still go in order.
    pub fn handle_type<H>(
        self,
        topic: impl Into<String>,
        event_type: crate::EventType,
        handler: H,
    ) -> Self
    where
        H: Handler<Tx = S::Tx>,
    {
        self.route(
            topic.into(),
            Some(event_type),
            Effect::transactional(handler),
        )
    }

    /// [`handle_type`](Self::handle_type) for a lease-mode handler.
    pub fn handle_leased_type<H>(
        self,
        topic: impl Into<String>,
        event_type: crate::EventType,
        handler: H,
    ) -> Self
    where
        S: dedup_core::LeaseStore,
        H: dedup_core::LeaseHandler,
    {
        self.route(topic.into(), Some(event_type), Effect::leased(handler))
    }

    /// What becomes of a message of `topic` whose type none of its
    /// handlers takes ([`handle_type`](Self::handle_type)): dead-lettered
    /// with kind `unrouted` (the default), or skipped and counted as
    /// `ignored`, for a topic that carries types this consumer does not
    /// handle.
    pub fn other_types(mut self, topic: impl Into<String>, other: crate::OtherTypes) -> Self {
        self.other_types.insert(topic.into(), other);
        self
    }

    fn route(
        mut self,
        topic: String,
        event_type: Option<crate::EventType>,
        handler: Effect<S>,
    ) -> Self {
        self.routes.push(Route {
            dead_letter_topic: format!("{topic}.dlq"),
            topic,
            tiers: None,
            event_type,
            handler,
            metrics: std::sync::OnceLock::new(),
        });
        self
    }

    /// Routes `topic` to a lease-mode handler (`#[idempotent(lease =
    /// "30s")]`), whose effect lies outside the store: each message is
    /// acquired, its effect run under the lease, and completed, one message
    /// of a partition at a time (up to [`key_concurrency`](Self::key_concurrency)
    /// at once, one per ordering key). A message whose event another holder's lease covers waits
    /// (never dead-lettered for it) until that lease is done (then skipped)
    /// or expires (then taken over). Keep `attempt_timeout` above the
    /// longest effect: an abandoned attempt leaves its lease to expire.
    pub fn handle_leased<H>(self, topic: impl Into<String>, handler: H) -> Self
    where
        S: dedup_core::LeaseStore,
        H: dedup_core::LeaseHandler,
    {
        self.route(topic.into(), None, Effect::leased(handler))
    }
}
