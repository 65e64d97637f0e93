//! The record a handler's event came in: its topic, partition, offset,
//! timestamp, key and headers.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::Headers;

/// The metadata of the record an event came in. A handler takes it as an
/// optional last argument (`meta: &Meta`; a batch body `meta: &[Meta]`, one
/// per event, in order):
///
/// ```
/// use dedup_core::{HandlerError, MemoryTx, Meta, idempotent};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { event_id: String, amount_cents: i64 }
///
/// #[idempotent(key = "event_id", ttl = "4h")]
/// async fn record(tx: &mut MemoryTx, ev: Payment, meta: &Meta) -> Result<(), HandlerError> {
///     let tenant = meta.header_str("tenant").unwrap_or("default");
///     let (partition, offset) = (meta.partition(), meta.offset());
///     # let _ = (tx, ev, tenant, partition, offset);
///     Ok(())
/// }
/// ```
///
/// The runtime fills it in from the Kafka record; a test builds one with
/// [`Meta::new`] and the `with_*` methods and passes it where headers go
/// (`handler.apply(&store, payload, &meta)`). `Debug` shows header names and
/// sizes, never their values.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Meta {
    topic: String,
    partition: i32,
    offset: i64,
    timestamp_ms: Option<i64>,
    key: Option<Vec<u8>>,
    headers: Vec<(String, Vec<u8>)>,
}

impl Meta {
    /// A record of `topic`, `partition` and `offset`, without timestamp,
    /// key or headers.
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Meta {
            topic: topic.into(),
            partition,
            offset,
            ..Meta::default()
        }
    }

    /// With the record's timestamp, in milliseconds since the Unix epoch
    /// (as Kafka keeps it).
    pub fn with_timestamp_millis(mut self, millis: i64) -> Self {
        self.timestamp_ms = Some(millis);
        self
    }

    /// With the record's key.
    pub fn with_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// With one more header (a repeated name keeps both; the last wins for
    /// [`header`](Self::header)).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The topic the record was read from.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Its partition.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// Its offset in the partition.
    pub fn offset(&self) -> i64 {
        self.offset
    }

    /// Its timestamp (the producer's or the broker's, as the topic's
    /// `message.timestamp.type` says), in milliseconds since the Unix
    /// epoch, if it has one.
    pub fn timestamp_millis(&self) -> Option<i64> {
        self.timestamp_ms
    }

    /// Its timestamp as a [`SystemTime`], if it has one.
    pub fn timestamp(&self) -> Option<SystemTime> {
        let millis = u64::try_from(self.timestamp_ms?).ok()?;
        UNIX_EPOCH.checked_add(Duration::from_millis(millis))
    }

    /// Its key, if it has one.
    pub fn key(&self) -> Option<&[u8]> {
        self.key.as_deref()
    }

    /// Its key as UTF-8, if it has one that is.
    pub fn key_str(&self) -> Option<&str> {
        std::str::from_utf8(self.key()?).ok()
    }

    /// Its headers, in the record's order.
    pub fn headers(&self) -> &[(String, Vec<u8>)] {
        &self.headers
    }

    /// The value of the header `name`; the last one if it repeats.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        Headers::get(self.headers.as_slice(), name)
    }

    /// The value of the header `name` as UTF-8, if it is.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.header(name)?).ok()
    }
}

impl Headers for Meta {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.header(name)
    }

    fn meta(&self) -> Option<&Meta> {
        Some(self)
    }
}

impl fmt::Debug for Meta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values and the key are the application's data, and may be
        // credentials (a token passed along): names and sizes only.
        let headers: Vec<String> = self
            .headers
            .iter()
            .map(|(name, value)| format!("{name} ({} bytes)", value.len()))
            .collect();
        f.debug_struct("Meta")
            .field("topic", &self.topic)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .field("timestamp_ms", &self.timestamp_ms)
            .field("key_bytes", &self.key.as_ref().map(Vec::len))
            .field("headers", &headers)
            .finish()
    }
}

/// An event with the metadata of its record: the event type of a handler
/// that takes `meta: &Meta` (`#[idempotent]` makes it; the body receives
/// the two apart).
#[derive(Debug, Clone, PartialEq)]
pub struct WithMeta<E> {
    /// The decoded event.
    pub event: E,
    /// Its record's metadata.
    pub meta: Meta,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_it_was_given_and_debug_hides_values() {
        let meta = Meta::new("payments", 3, 42)
            .with_timestamp_millis(1_700_000_000_123)
            .with_key("acct-1")
            .with_header("event-type", "PaymentReceived")
            .with_header("authorization", "Bearer secret-token")
            .with_header("event-type", "PaymentSettled");
        assert_eq!(
            (meta.topic(), meta.partition(), meta.offset()),
            ("payments", 3, 42)
        );
        assert_eq!(meta.key_str(), Some("acct-1"));
        assert_eq!(meta.header_str("event-type"), Some("PaymentSettled"));
        assert_eq!(meta.header("missing"), None);
        assert_eq!(
            meta.timestamp(),
            Some(UNIX_EPOCH + Duration::from_millis(1_700_000_000_123))
        );
        assert_eq!(
            Headers::get(&meta, "event-type"),
            Some(&b"PaymentSettled"[..])
        );
        let debug = format!("{meta:?}");
        assert!(debug.contains("authorization (19 bytes)"), "{debug}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(!debug.contains("acct-1"), "{debug}");
    }

    #[test]
    fn a_negative_timestamp_is_none() {
        assert_eq!(
            Meta::new("t", 0, 0).with_timestamp_millis(-1).timestamp(),
            None
        );
    }
}
