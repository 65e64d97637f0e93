//! A topic's routes (its one handler, or one per event type and the route
//! of the other types) and what a route does with a message beyond its
//! handler: its dead letter and its record, its moves to a retry tier,
//! which tier headers it trusts. The handlers themselves are in `effect`.

use crate::database::effect::{BoxFuture, Effect, ErasedApply};
use crate::pipeline::outcome::Record;
use crate::select::{EventType, OrderBy, Selector, event_type_of, said_type};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use dedup_core::{DedupKey, DedupStore, Error, Headers, Outcome, Ttl, ordered_scope};

/// The routes of one topic: its one handler, or a handler per event type
/// plus the route of the types none takes.
pub(crate) struct TopicRoutes<S> {
    pub(crate) topic: String,
    /// What orders its events under key-ordered concurrency.
    pub(crate) order_by: OrderBy,
    /// Where its messages say their type, if it has several.
    by: Option<Selector>,
    /// Its handlers; with several types, the route of the other types
    /// last.
    routes: Vec<Arc<Route<S>>>,
    /// Messages of other types are skipped, not dead-lettered.
    skip_others: bool,
}

/// Which route a message goes to.
pub(crate) enum Pick {
    /// The route at this index.
    Route(usize),
    /// Skipped: a type no handler takes, under `OtherTypes::Skip`; the
    /// index of the other types' route, whose metrics count it.
    Ignore(usize),
}

impl<S: 'static> TopicRoutes<S> {
    /// A topic with one handler.
    pub(crate) fn one(route: Route<S>) -> Self {
        TopicRoutes {
            order_by: OrderBy::default(),
            topic: route.topic.clone(),
            by: None,
            routes: vec![Arc::new(route)],
            skip_others: false,
        }
    }

    /// A topic whose event types go to `typed` (each with its type; at
    /// least one, all by `by`), the others to `others`.
    pub(crate) fn typed(
        by: Selector,
        typed: Vec<Route<S>>,
        others: Route<S>,
        skip_others: bool,
    ) -> Self {
        let mut routes: Vec<Arc<Route<S>>> = typed.into_iter().map(Arc::new).collect();
        routes.push(Arc::new(others));
        TopicRoutes {
            order_by: OrderBy::default(),
            topic: routes[0].topic.clone(),
            by: Some(by),
            routes,
            skip_others,
        }
    }

    /// The routes of tier `at` of this topic (see [`Route::for_tier`]).
    pub(crate) fn for_tier(&self, place: &crate::tiers::Place, at: usize) -> Self {
        let routes: Vec<Arc<Route<S>>> = self
            .routes
            .iter()
            .map(|r| Arc::new(r.for_tier(place, at)))
            .collect();
        TopicRoutes {
            topic: routes[0].topic.clone(),
            order_by: self.order_by.clone(),
            by: self.by.clone(),
            routes,
            skip_others: self.skip_others,
        }
    }

    /// Whether these are a retry tier's routes.
    pub(crate) fn in_tier(&self) -> bool {
        self.routes[0].in_tier()
    }

    /// Sets every route's place among the topic's tiers.
    pub(crate) fn set_tiers(&mut self, place: &crate::tiers::Place) {
        for route in &mut self.routes {
            Arc::get_mut(route).expect("not shared yet").tiers = Some(place.clone());
        }
    }

    /// Every route, the other types' last.
    pub(crate) fn all(&self) -> &[Arc<Route<S>>] {
        &self.routes
    }

    /// The handlers' routes (not the other types').
    pub(crate) fn handlers(&self) -> &[Arc<Route<S>>] {
        match self.by {
            Some(_) => &self.routes[..self.routes.len() - 1],
            None => &self.routes,
        }
    }

    /// Where `msg` goes.
    pub(crate) fn pick(&self, msg: &rdkafka::message::OwnedMessage) -> Pick {
        let Some(by) = &self.by else {
            return Pick::Route(0);
        };
        let others = self.routes.len() - 1;
        // A message that names no type (or not readably) is dead-lettered
        // even under Skip: it may be one a handler takes, malformed.
        let Some(said) = event_type_of(by, msg) else {
            return Pick::Route(others);
        };
        let found = self
            .handlers()
            .iter()
            .position(|r| r.event_type.as_ref().is_some_and(|e| e.value() == said));
        match found {
            Some(i) => Pick::Route(i),
            None if self.skip_others => Pick::Ignore(others),
            None => Pick::Route(others),
        }
    }
}

/// The route of the event types no handler of a typed topic takes: its
/// messages fail as [`Error::Unrouted`], the event's fault, and are
/// dead-lettered one at a time like any poison message.
pub(crate) struct Unrouted {
    pub(crate) scope: String,
    pub(crate) topic: String,
    pub(crate) by: Selector,
    pub(crate) known: Vec<String>,
    /// The longest TTL of the topic's handlers: how long the record of a
    /// dead letter lives.
    pub(crate) ttl: Ttl,
}

impl<S: 'static> ErasedApply<S> for Unrouted {
    fn scope(&self) -> &str {
        &self.scope
    }

    fn ttl(&self) -> Ttl {
        self.ttl
    }

    fn preparer(&self) -> Option<&dyn dedup_core::decode::Prepare> {
        None
    }

    fn apply<'a>(
        &'a self,
        _store: &'a S,
        payload: &'a [u8],
        headers: &'a (dyn Headers + Sync),
    ) -> BoxFuture<'a, Outcome> {
        let error = Error::Unrouted {
            topic: self.topic.clone(),
            // What the message said, for the dead letter's reason.
            event_type: said_type(&self.by, headers, payload),
            known: self.known.clone(),
        };
        Box::pin(async move { Outcome::Failed(error) })
    }
}

/// A topic routed to a handler, with where its poison messages go.
pub(crate) struct Route<S> {
    pub(crate) topic: String,
    /// The event type it takes, on a topic of several.
    pub(crate) event_type: Option<EventType>,
    pub(crate) handler: Effect<S>,
    pub(crate) dead_letter_topic: String,
    /// Its place among its topic's retry tiers, if it has any.
    pub(crate) tiers: Option<crate::tiers::Place>,
    /// Registered on first use, after the application installed its
    /// recorder.
    pub(crate) metrics: std::sync::OnceLock<crate::metrics::RouteMetrics>,
}

impl<S: 'static> Route<S> {
    /// The route's metric handles.
    pub(crate) fn metrics(&self) -> &crate::metrics::RouteMetrics {
        self.metrics.get_or_init(|| {
            let metrics = crate::metrics::RouteMetrics::new(&self.topic, self.handler.scope());
            // Its moves' series exist from the start, at 0.
            if let Some(next) = self.tiers.as_ref().and_then(|p| p.next()) {
                let _registered = metrics.moved_series(&next.name);
            }
            metrics
        })
    }

    /// Where this route's outcomes are recorded: `stats` and its metrics.
    pub(crate) fn record<'a>(&'a self, stats: &'a crate::stats::Stats) -> Record<'a> {
        Record {
            stats,
            metrics: self.metrics(),
        }
    }

    /// Why `msg`, a message of this route, is dead-lettered.
    pub(crate) fn dead_letter(
        &self,
        msg: &rdkafka::message::OwnedMessage,
        kind: &'static str,
        message: String,
        attempts: u32,
    ) -> crate::dead_letter_format::DeadLetter<'_> {
        crate::dead_letter_format::DeadLetter {
            topic: &self.dead_letter_topic,
            kind,
            message,
            attempts,
            handler: self.handler.scope(),
            schema_id: crate::dead_letter_format::schema_id(self.handler.preparer(), msg),
            origin: self.origin(msg),
            moved: None,
        }
    }

    /// Where `msg`, failing transiently after `attempts` here, goes: the
    /// next retry tier, or (from the last, or without tiers) the
    /// dead-letter topic.
    pub(crate) fn onward(
        &self,
        msg: &rdkafka::message::OwnedMessage,
        kind: &'static str,
        message: String,
        attempts: u32,
    ) -> crate::dead_letter_format::DeadLetter<'_> {
        let why = self.dead_letter(msg, kind, message, attempts);
        match self.tiers.as_ref().and_then(|p| p.next()) {
            Some(next) => self.moved_to(msg, why, next),
            None => why,
        }
    }

    /// Whether its topic's tiers hold keys back.
    pub(crate) fn holds_keys(&self) -> bool {
        self.tiers.as_ref().is_some_and(|p| p.tiers.hold_keys)
    }

    /// The key `msg` holds under key hold-back (`RetryTiers::hold_keys`),
    /// if it has an ordering key.
    pub(crate) fn hold_key(
        &self,
        msg: &rdkafka::message::OwnedMessage,
    ) -> Option<crate::pipeline::keyed::OrderKey> {
        let place = self.tiers.as_ref()?;
        place
            .tiers
            .hold_keys
            .then(|| place.tiers.order_by.key_of(msg))
            .flatten()
    }

    /// Where `msg` goes when an earlier event of its key (at origin offset
    /// `earlier`) waits in a tier: on, without attempts, to the next tier
    /// (from the last, back into it, behind the earlier one).
    pub(crate) fn follow(
        &self,
        msg: &rdkafka::message::OwnedMessage,
        earlier: i64,
    ) -> crate::dead_letter_format::DeadLetter<'_> {
        let message =
            format!("an earlier event of its key (offset {earlier}) waits in a retry tier");
        let why = self.dead_letter(msg, "held", message, 0);
        match &self.tiers {
            Some(place) => match place.next().or_else(|| place.tiers.tiers.last()) {
                Some(tier) => self.moved_to(msg, why, tier),
                None => why,
            },
            None => why,
        }
    }

    /// `why` made a move of `msg` to `tier`.
    fn moved_to<'a>(
        &self,
        msg: &rdkafka::message::OwnedMessage,
        mut why: crate::dead_letter_format::DeadLetter<'a>,
        tier: &'a crate::tiers::TierTopic,
    ) -> crate::dead_letter_format::DeadLetter<'a> {
        why.topic = &tier.topic;
        why.moved = Some(tier.moved(
            msg,
            self.reads_origin_headers(msg),
            why.attempts,
            tier.due_from_now(),
        ));
        why
    }

    /// Where `msg` came from before any move: itself, or (read from a tier,
    /// or a copy released from one to a topic with tiers) what its
    /// `dedup.origin.*` say, if they are its own.
    pub(crate) fn origin(&self, msg: &rdkafka::message::OwnedMessage) -> crate::tiers::Origin {
        crate::tiers::origin_of(msg, self.reads_origin_headers(msg))
    }

    /// Whether `msg`'s `dedup.origin.*` and `dedup.retry.attempt` are its
    /// own story: read from a tier, or released from one, and not forged.
    fn reads_origin_headers(&self, msg: &rdkafka::message::OwnedMessage) -> bool {
        self.tiers
            .as_ref()
            .is_some_and(|p| p.tiers.trusts_origin(p.at, msg))
    }

    /// Why `msg`'s tier headers are not its own, if it has such headers and
    /// they are not (`TopicTiers::forged`): it is then dead-lettered as
    /// itself.
    pub(crate) fn forged(&self, msg: &rdkafka::message::OwnedMessage) -> Option<String> {
        let place = self.tiers.as_ref()?;
        place.tiers.forged(place.at, msg)
    }

    /// Whether `msg` is a copy released home from a tier whose headers are
    /// its own: it stands for its origin, and lets its key go.
    pub(crate) fn released(&self, msg: &rdkafka::message::OwnedMessage) -> bool {
        self.tiers
            .as_ref()
            .is_some_and(|p| p.at.is_none() && p.tiers.trusted_release(msg))
    }

    /// The delay of the tier this route reads (`Duration::MAX` for a
    /// handled topic's route).
    pub(crate) fn tier_delay(&self) -> std::time::Duration {
        self.tiers
            .as_ref()
            .and_then(|p| Some(p.tiers.tiers[p.at?].delay))
            .unwrap_or(std::time::Duration::MAX)
    }

    /// Whether this route reads a retry tier.
    pub(crate) fn in_tier(&self) -> bool {
        self.tiers.as_ref().is_some_and(|p| p.is_tier())
    }

    /// The retry policy of this route's attempts in place: with retry
    /// tiers, transient failures get the tiers' few attempts before the
    /// event moves on.
    pub(crate) fn in_place(&self, policy: crate::RetryPolicy) -> crate::RetryPolicy {
        match &self.tiers {
            Some(place) => policy.with_max_attempts(place.tiers.attempts),
            None => policy,
        }
    }

    /// The route of tier `at` of this one's topic: the same handler, read
    /// from the tier's topic, dead-lettering to the same topic.
    pub(crate) fn for_tier(&self, place: &crate::tiers::Place, at: usize) -> Route<S> {
        Route {
            topic: place.tiers.tiers[at].topic.clone(),
            event_type: self.event_type.clone(),
            handler: self.handler.clone(),
            dead_letter_topic: self.dead_letter_topic.clone(),
            tiers: Some(crate::tiers::Place {
                tiers: place.tiers.clone(),
                at: Some(at),
            }),
            metrics: std::sync::OnceLock::new(),
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
    ///
    /// A move to a retry tier is recorded the same way, its id ending in
    /// [`MOVED`] (so that a redelivery skipped for it is counted as
    /// `already_moved`).
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
            crate::pipeline::keyed::fnv1a(msg.key().unwrap_or_default(), payload)
        );
        self.dead_letter_key(msg.topic(), msg.partition(), id)
    }

    /// The record of `msg`'s move to a retry tier.
    pub(crate) fn moved_record(&self, msg: &rdkafka::message::OwnedMessage) -> DedupKey {
        let record = self.dead_letter_record(msg);
        DedupKey::new(record.scope(), format!("{}{MOVED}", record.id())).expect("never empty")
    }

    /// What the records read before a partition's first message say of
    /// `msg`: dead-lettered, moved to a tier, or neither.
    pub(crate) fn finished_before(
        &self,
        known: &std::collections::HashSet<String>,
        msg: &rdkafka::message::OwnedMessage,
    ) -> Option<Before> {
        if known.is_empty() {
            return None;
        }
        let id = self.dead_letter_record(msg).id().to_owned();
        if known.contains(&id) {
            return Some(Before::DeadLettered);
        }
        known
            .contains(&format!("{id}{MOVED}"))
            .then_some(Before::Moved)
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

/// The end of a move's record id.
pub(crate) const MOVED: &str = ".moved";

/// What became of a redelivered message before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Before {
    DeadLettered,
    Moved,
}

/// The handled topics' routes with their retry tiers: each handled
/// topic's routes know their tiers, and (unless another process reads
/// them) each tier has routes of its own; with [`ReadTiers::Only`](crate::ReadTiers::Only), only those.
pub(crate) fn with_tiers<S: DedupStore>(
    routes: Vec<TopicRoutes<S>>,
    tiers: &crate::RetryTiers,
) -> Result<Vec<TopicRoutes<S>>, crate::Error> {
    use crate::ReadTiers;
    let handled: HashSet<String> = routes.iter().map(|t| t.topic.clone()).collect();
    let mut out = Vec::new();
    for mut topic in routes {
        let place = crate::tiers::Place {
            tiers: tiers.of(
                &topic.topic,
                topic.order_by.clone(),
                crate::tiers::DEFAULT_ATTEMPTS_IN_PLACE,
            ),
            at: None,
        };
        for tier in &place.tiers.tiers {
            let dead_letters = topic.all().iter().map(|r| &r.dead_letter_topic);
            if handled.contains(&tier.topic) || dead_letters.clone().any(|d| *d == tier.topic) {
                return Err(crate::Error::Config(format!(
                    "retry tier {:?} of {:?} would be read from {:?}, which is a handled or \
                     dead-letter topic: name its tier's topic otherwise",
                    tier.name, topic.topic, tier.topic
                )));
            }
        }
        topic.set_tiers(&place);
        if tiers.reader() != ReadTiers::Elsewhere {
            for at in 0..place.tiers.tiers.len() {
                out.push(topic.for_tier(&place, at));
            }
        }
        if tiers.reader() != ReadTiers::Only {
            out.push(topic);
        }
    }
    Ok(out)
}

/// The routes grouped by topic: one handler, or one per event type plus
/// the route of the other types. Refuses two handlers of one topic unless
/// each takes its own event type, named the same way.
pub(crate) fn topic_routes<S: DedupStore>(
    routes: Vec<Route<S>>,
    other_types: &HashMap<String, crate::OtherTypes>,
    group: &str,
) -> Result<Vec<TopicRoutes<S>>, crate::Error> {
    let mut by_topic: Vec<(String, Vec<Route<S>>)> = Vec::new();
    for route in routes {
        match by_topic.iter_mut().find(|(t, _)| *t == route.topic) {
            Some((_, same)) => same.push(route),
            None => by_topic.push((route.topic.clone(), vec![route])),
        }
    }
    if let Some(topic) = other_types.keys().find(|t| {
        !by_topic
            .iter()
            .any(|(topic, rs)| topic == *t && rs[0].event_type.is_some())
    }) {
        return Err(crate::Error::Config(format!(
            "other_types({topic:?}, ..): the topic has no handle_type handlers"
        )));
    }
    let mut out = Vec::with_capacity(by_topic.len());
    for (topic, mut routes) in by_topic {
        if routes.iter().all(|r| r.event_type.is_none()) {
            if routes.len() > 1 {
                return Err(crate::Error::Config(format!(
                    "topic {topic:?} has two handlers: give each its event type with \
                     handle_type(topic, EventType::header(..) or EventType::field(..), handler)"
                )));
            }
            out.push(TopicRoutes::one(routes.remove(0)));
            continue;
        }
        if routes.iter().any(|r| r.event_type.is_none()) {
            return Err(crate::Error::Config(format!(
                "topic {topic:?} has handlers by event type and one without: route every \
                 type with handle_type, or use handle alone"
            )));
        }
        let types: Vec<&crate::EventType> = routes
            .iter()
            .filter_map(|r| r.event_type.as_ref())
            .collect();
        let by = types[0].selector().clone();
        if let Some(other) = types.iter().find(|t| *t.selector() != by) {
            return Err(crate::Error::Config(format!(
                "topic {topic:?} names its event types by {by} and by {}: every handler of a \
                 topic reads the type the same way",
                other.selector()
            )));
        }
        let mut seen = HashSet::new();
        if let Some(dup) = types.iter().find(|t| !seen.insert(t.value())) {
            return Err(crate::Error::Config(format!(
                "topic {topic:?} has two handlers of event type {:?}",
                dup.value()
            )));
        }
        let known: Vec<String> = types.iter().map(|t| t.value().to_owned()).collect();
        let ttl = routes
            .iter()
            .map(|r| r.handler.ttl())
            .max()
            .expect("at least one route");
        let others = Route {
            topic: topic.clone(),
            event_type: None,
            dead_letter_topic: routes[0].dead_letter_topic.clone(),
            tiers: None,
            handler: crate::database::effect::Effect::Leased(Arc::new(
                crate::database::route::Unrouted {
                    // The group's own: another group of the same store that
                    // leaves the same types unhandled dead-letters them too,
                    // to its own topic.
                    scope: format!("dedup.unrouted/{group}/{topic}"),
                    topic: topic.clone(),
                    by: by.clone(),
                    known,
                    ttl,
                },
            )),
            metrics: std::sync::OnceLock::new(),
        };
        let skip = other_types.get(&topic) == Some(&crate::OtherTypes::Skip);
        out.push(TopicRoutes::typed(by, routes, others, skip));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// Dead-letter records hold this fingerprint: pinned, so an earlier
    /// version's records are still found for a redelivery of their message.
    #[test]
    fn message_fingerprints_are_pinned_and_tell_payloads_apart() {
        assert_eq!(
            crate::pipeline::keyed::fnv1a(b"", b""),
            0xaf64_724c_8602_eb6e
        );
        assert_ne!(
            crate::pipeline::keyed::fnv1a(b"k", b"{\"amount\":1}"),
            crate::pipeline::keyed::fnv1a(b"k", b"{\"amount\":2}")
        );
    }
}
