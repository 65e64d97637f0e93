//! What a Kafka-only handler produces: records buffered in memory, written
//! by the runtime inside the batch's Kafka transaction.

use dedup_core::HandlerError;

/// The records one event's handler produces, written by the
/// [`TransactionalConsumer`](crate::TransactionalConsumer) inside the
/// batch's Kafka transaction, together with the event's claim and its
/// input offset: all of them are visible to `read_committed` consumers, or
/// none is.
///
/// It is the transaction type of a Kafka-only handler: the first argument of
/// an `#[idempotent]` function.
///
/// ```
/// use dedup_core::{HandlerError, idempotent};
/// use dedup_kafka::Outputs;
///
/// #[derive(serde::Deserialize, serde::Serialize)]
/// struct OrderPlaced { event_id: String, order_id: String }
///
/// #[idempotent(key = "event_id", ttl = "1d")]
/// async fn enrich(out: &mut Outputs, ev: OrderPlaced) -> Result<(), HandlerError> {
///     out.send("orders.enriched", &ev.order_id, &ev)?;
///     Ok(())
/// }
/// ```
///
/// Nothing is sent while the handler runs: a handler that fails leaves no
/// record behind, and a retry starts from an empty `Outputs`.
#[derive(Debug, Default)]
pub struct Outputs {
    records: Vec<OutputRecord>,
}

impl Outputs {
    /// Buffers a record to `topic` with `key`, its value `value` as JSON.
    /// A value that cannot be serialized is the event's fault (permanent).
    pub fn send<V: serde::Serialize + ?Sized>(
        &mut self,
        topic: &str,
        key: impl AsRef<[u8]>,
        value: &V,
    ) -> Result<(), HandlerError> {
        let payload = serde_json::to_vec(value).map_err(HandlerError::permanent)?;
        self.push(OutputRecord::new(topic).key(key).payload(payload));
        Ok(())
    }

    /// Buffers a record built by hand (raw bytes, no key, headers, a
    /// partition of its own).
    ///
    /// With the `opentelemetry` feature, a record without trace headers of
    /// its own (`traceparent`, `tracestate`) gets the current trace
    /// context: in a handler, its event's processing span, which the next
    /// consumer continues.
    pub fn push(&mut self, record: OutputRecord) {
        #[cfg(feature = "opentelemetry")]
        let record = {
            let mut record = record;
            let has_own = record.headers.iter().any(|(name, _)| {
                name == dedup_core::trace::TRACEPARENT || name == dedup_core::trace::TRACESTATE
            });
            if !has_own && let Some(trace) = dedup_core::trace::current_headers() {
                for (name, value) in trace {
                    record.headers.push((name.to_owned(), value.into_bytes()));
                }
            }
            record
        };
        self.records.push(record);
    }

    /// The records buffered so far.
    pub fn records(&self) -> &[OutputRecord] {
        &self.records
    }

    pub(crate) fn into_records(self) -> Vec<OutputRecord> {
        self.records
    }
}

/// One record for [`Outputs::push`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputRecord {
    pub(crate) topic: String,
    pub(crate) partition: Option<i32>,
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) payload: Option<Vec<u8>>,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
}

impl OutputRecord {
    /// A record to `topic`, without key or payload (a tombstone) until given.
    pub fn new(topic: impl Into<String>) -> Self {
        OutputRecord {
            topic: topic.into(),
            partition: None,
            key: None,
            payload: None,
            headers: Vec::new(),
        }
    }

    /// Sets the key (the partitioner hashes it unless a partition is set).
    pub fn key(mut self, key: impl AsRef<[u8]>) -> Self {
        self.key = Some(key.as_ref().to_vec());
        self
    }

    /// Sets the payload.
    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = Some(payload.into());
        self
    }

    /// Sends it to this partition instead of the key's.
    pub fn partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.into(), value.as_ref().to_vec()));
        self
    }

    /// The topic it goes to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Its payload, if any.
    pub fn payload_bytes(&self) -> Option<&[u8]> {
        self.payload.as_deref()
    }

    /// Its key, if any.
    pub fn key_bytes(&self) -> Option<&[u8]> {
        self.key.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_buffers_json_under_the_key() {
        let mut out = Outputs::default();
        out.send("t", "acct-1", &serde_json::json!({"a": 1}))
            .unwrap();
        out.push(
            OutputRecord::new("u")
                .payload(b"raw".to_vec())
                .header("h", "v"),
        );
        let records = out.into_records();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].key_bytes(), Some(&b"acct-1"[..]));
        assert_eq!(records[0].payload_bytes(), Some(&br#"{"a":1}"#[..]));
        assert_eq!(records[1].headers, vec![("h".to_owned(), b"v".to_vec())]);
        assert_eq!(records[1].key, None);
    }

    #[test]
    fn a_value_that_does_not_serialize_is_the_events_fault() {
        let mut bad = std::collections::HashMap::new();
        bad.insert(vec![1u8], 1); // JSON object keys must be strings
        let e = Outputs::default().send("t", "k", &bad).unwrap_err();
        assert_eq!(e.classification(), dedup_core::Classification::Permanent);
    }
}
