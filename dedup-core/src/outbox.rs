//! The transactional outbox: events written in the same transaction as the
//! change they announce, published afterwards by a relay.
//!
//! A backend stores [`OutboxMessage`]s (its own `enqueue`, inside the
//! caller's transaction) and implements [`OutboxSource`], through which the
//! relay of the Kafka runtime reads them, so the relay knows no SQL.

use std::future::Future;
use std::time::Duration;

use crate::StoreError;

/// The header every relayed event carries its stable id in, and the name a
/// downstream `#[idempotent(key = "header:event-id")]` handler reads.
pub const EVENT_ID_HEADER: &str = "event-id";

/// An event to enqueue: where it goes, its key and payload, extra headers.
///
/// The event id is given at enqueue time (a random UUID unless
/// [`with_event_id`](OutboxMessage::with_event_id) sets one) and travels as
/// the [`EVENT_ID_HEADER`] header, so every copy the relay may publish
/// carries the same id.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxMessage {
    /// The Kafka topic.
    pub topic: String,
    /// The message key (events of one key keep their order); `None` lets
    /// the producer spread them.
    pub key: Option<Vec<u8>>,
    /// The message value.
    pub payload: Vec<u8>,
    /// Extra headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// A caller-chosen event id, for example derived from the consumed
    /// event's id so that a replayed handler enqueues the same id.
    pub event_id: Option<String>,
    /// How many of the first headers are the current trace context's,
    /// added when it was made; a trace header the caller sets replaces
    /// them.
    #[cfg(feature = "opentelemetry")]
    traced: usize,
}

impl std::fmt::Debug for OutboxMessage {
    // Payloads may hold personal data: show their size, not their bytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxMessage")
            .field("topic", &self.topic)
            .field("key", &self.key.as_deref().map(String::from_utf8_lossy))
            .field("payload_bytes", &self.payload.len())
            .field(
                "headers",
                &self.headers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("event_id", &self.event_id)
            .finish()
    }
}

impl OutboxMessage {
    /// An event whose payload is `value` as JSON.
    pub fn json(
        topic: impl Into<String>,
        value: &impl serde::Serialize,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self::bytes(topic, serde_json::to_vec(value)?))
    }

    /// An event with a raw payload.
    ///
    /// With the `opentelemetry` feature, it carries the current trace
    /// context (`traceparent`, `tracestate`): made in a handler, the span of
    /// the event that caused it, which the relay and the next consumer
    /// continue. A header set later with the same name wins.
    pub fn bytes(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))]
        let mut headers = Vec::new();
        #[cfg(feature = "opentelemetry")]
        if let Some(trace) = crate::trace::current_headers() {
            headers.extend(
                trace
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v.into_bytes())),
            );
        }
        OutboxMessage {
            topic: topic.into(),
            key: None,
            payload: payload.into(),
            #[cfg(feature = "opentelemetry")]
            traced: headers.len(),
            headers,
            event_id: None,
        }
    }

    /// Sets the message key.
    pub fn with_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    ///
    /// A `traceparent` or `tracestate` header set here replaces both of the
    /// ones the message took from the current trace context.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        let name = name.into();
        #[cfg(feature = "opentelemetry")]
        if name == crate::trace::TRACEPARENT || name == crate::trace::TRACESTATE {
            self.headers.drain(..self.traced.min(self.headers.len()));
            self.traced = 0;
        }
        self.headers.push((name, value.into()));
        self
    }

    /// Sets the event id instead of a random one.
    pub fn with_event_id(mut self, id: impl Into<String>) -> Self {
        self.event_id = Some(id.into());
        self
    }
}

/// An enqueued event as the relay reads it.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// Its position in the outbox: events are published in this order.
    pub seq: i64,
    /// The stable id, sent as the [`EVENT_ID_HEADER`] header.
    pub event_id: String,
    /// The Kafka topic.
    pub topic: String,
    /// The message key.
    pub key: Option<Vec<u8>>,
    /// The message value.
    pub payload: Vec<u8>,
    /// Extra headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Failed publish attempts so far.
    pub attempts: u32,
}

impl std::fmt::Debug for OutboxRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxRecord")
            .field("seq", &self.seq)
            .field("event_id", &self.event_id)
            .field("topic", &self.topic)
            .field("key", &self.key.as_deref().map(String::from_utf8_lossy))
            .field("payload_bytes", &self.payload.len())
            .field("attempts", &self.attempts)
            .finish()
    }
}

impl OutboxRecord {
    /// A record as a backend read it from its table: no key, no headers, no
    /// attempts yet; the `with_*` methods add them.
    pub fn new(seq: i64, event_id: String, topic: String, payload: Vec<u8>) -> Self {
        OutboxRecord {
            seq,
            event_id,
            topic,
            key: None,
            payload,
            headers: Vec::new(),
            attempts: 0,
        }
    }

    /// Sets the message key.
    pub fn with_key(mut self, key: Option<Vec<u8>>) -> Self {
        self.key = key;
        self
    }

    /// Sets the headers.
    pub fn with_headers(mut self, headers: Vec<(String, Vec<u8>)>) -> Self {
        self.headers = headers;
        self
    }

    /// Sets how many publishing attempts failed before.
    pub fn with_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }
}

/// What happens to an event once the broker acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Delete the row in the transaction that marks it published.
    Delete,
    /// Keep the row marked sent for this long (for inspection and audit),
    /// then let the relay's purge delete it.
    Keep(Duration),
}

impl Default for Retention {
    /// Kept for one hour.
    fn default() -> Self {
        Retention::Keep(Duration::from_secs(3600))
    }
}

/// The first pause of [`poll_for_events`].
pub const POLL_FIRST: Duration = Duration::from_millis(5);

/// The longest pause of [`poll_for_events`]: the latency, at most, of an
/// event committed while a relay of a store without notifications waits.
pub const POLL_MAX: Duration = Duration::from_millis(250);

/// [`OutboxSource::wait_for_events`] for a store that cannot notify (SQLite,
/// MySQL): asks `changed` whether events were enqueued since the relay
/// last looked, after [`POLL_FIRST`], then at pauses doubling to
/// [`POLL_MAX`], until it says yes or `timeout` has passed. A relay that
/// keeps finding events waits a few milliseconds; an idle one asks four
/// times a second. An error of `changed` counts as a change: the relay's
/// next look reports it. A probe still unanswered at `timeout` is dropped.
///
/// It notices events enqueued since the relay last looked; events that
/// become available otherwise (released by another relay, a back-off or a
/// lease that ran out) wait for the relay's next look, at most `timeout`.
pub async fn poll_for_events<F, Fut>(timeout: Duration, mut changed: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, StoreError>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = POLL_FIRST;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return;
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        // A probe that hangs (a half-open connection, a pool with none to
        // give) ends with the timeout, as the wait must.
        match tokio::time::timeout_at(deadline, changed()).await {
            Ok(Ok(false)) => {}
            Ok(_) | Err(_) => return,
        }
        pause = (pause * 2).min(POLL_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_poll_ends_at_its_timeout_even_if_a_probe_hangs() {
        let started = tokio::time::Instant::now();
        poll_for_events(Duration::from_secs(3), std::future::pending).await;
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_poll_backs_off_to_its_longest_pause_and_stops_at_a_change() {
        let probes = std::sync::atomic::AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        poll_for_events(Duration::from_secs(60), || {
            let n = probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::future::ready(Ok(n == 11))
        })
        .await;
        // 5, 10, .., 160 ms, then 250 ms pauses: 0.315 s + 6 x 0.25 s.
        assert_eq!(started.elapsed(), Duration::from_millis(1815));
        let probes = std::sync::atomic::AtomicU32::new(0);
        poll_for_events(Duration::from_secs(1), || {
            probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::future::ready(Err(StoreError::environment(std::io::Error::other("down"))))
        })
        .await;
        assert_eq!(
            probes.into_inner(),
            1,
            "an error ends the wait: the next look reports it"
        );
    }
}

/// A publish attempt that failed: the event stays pending and is not
/// offered again (nor any later event of its topic and key) before
/// `retry_after` has passed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublishFailure {
    /// The event's [`OutboxRecord::seq`].
    pub seq: i64,
    /// Why, as the producer said it; recorded with the event.
    pub reason: String,
    /// Its back-off.
    pub retry_after: Duration,
}

impl PublishFailure {
    /// A failure of event `seq`.
    pub fn new(seq: i64, reason: impl Into<String>, retry_after: Duration) -> Self {
        PublishFailure {
            seq,
            reason: reason.into(),
            retry_after,
        }
    }
}

/// Where a relay reads pending events from: the outbox of a backend.
///
/// # The contract
///
/// - [`lease_pending`](OutboxSource::lease_pending) returns pending events
///   in outbox order and leases them to the caller for `lease_for`: until
///   [`finish`](OutboxSource::finish) or the lease expires, another
///   relay's `lease_pending` skips them (it does not wait for them to be
///   published). Taking the lease is one short write; nothing stays open
///   while the relay
///   publishes, so a relay that dies leaves leases that simply expire and
///   another relay (or its own restart) takes those events over.
/// - It never returns an event while an earlier pending event of the same
///   topic and key is leased to another relay, so several relays keep each
///   key's order. (Events without a key have no order to keep.)
/// - `finish` atomically marks the published events as sent (or deletes
///   them), records the failures and releases the rest of the lease;
///   events neither published nor failed stay pending and are offered
///   again at once. A failed event is not offered again before its
///   back-off has passed, and neither is any later event of its key; other
///   keys' events are, so one poison event cannot stall the outbox. If the
///   relay dies before `finish`, every event of the batch stays pending and
///   is published again once the lease expires: the relay is
///   at-least-once, and consumers deduplicate on the event id.
pub trait OutboxSource: Send + Sync + 'static {
    /// Identifies a batch until [`finish`](OutboxSource::finish).
    type Lease: Send + Sync;

    /// Leases up to `limit` pending events, in outbox order, for `lease_for`.
    fn lease_pending(
        &self,
        limit: usize,
        lease_for: Duration,
    ) -> impl Future<Output = Result<(Self::Lease, Vec<OutboxRecord>), StoreError>> + Send;

    /// Leases the next batch while `before`, the caller's previous batch,
    /// is still being published: as [`lease_pending`](Self::lease_pending),
    /// except that `before` does not hold back the later events of its
    /// keys. The caller promises what makes that safe: it sends this
    /// batch's events after every one of `before`'s (one producer keeps a
    /// key's events in order), and marks none of a key's events past one
    /// of `before`'s that failed or went unsent. `None` when the source
    /// cannot (the default): the caller finishes `before` first.
    #[allow(clippy::type_complexity)]
    fn lease_pending_after(
        &self,
        limit: usize,
        lease_for: Duration,
        before: &Self::Lease,
    ) -> impl Future<Output = Result<Option<(Self::Lease, Vec<OutboxRecord>)>, StoreError>> + Send
    {
        let _ = (limit, lease_for, before);
        std::future::ready(Ok(None))
    }

    /// Marks `published` (sequence numbers) sent, records `failed` attempts
    /// with their reasons and back-offs, and releases the rest of the
    /// batch, in one transaction. Marking is right even after the lease
    /// expired: the broker acknowledged those events.
    fn finish(
        &self,
        lease: &Self::Lease,
        published: &[i64],
        failed: &[PublishFailure],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Waits until new events may have been enqueued (a notification), or
    /// at most `timeout`: the polling fallback when notifications are lost.
    /// Notifications that arrived since the last wait, however many, wake
    /// it once: a backlog of them never costs a look each.
    fn wait_for_events(&self, timeout: Duration) -> impl Future<Output = ()> + Send;

    /// Deletes events marked sent longer ago than the retention, at most
    /// `limit` of them; returns how many went. Backends that delete on
    /// publish return 0.
    fn purge_sent(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// How many events wait to be published and how long the oldest has
    /// waited (zero when none), for the relay's gauges; `None` when the
    /// source cannot tell (the default).
    fn backlog(&self) -> impl Future<Output = Result<Option<(u64, Duration)>, StoreError>> + Send {
        std::future::ready(Ok(None))
    }
}
