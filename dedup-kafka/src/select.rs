//! Reading what a record says of itself without decoding it: its event
//! type (a header, or a top-level JSON field) and its ordering key. Shared
//! by both runtimes (and the tiers' key hold-back).

use dedup_core::Headers;

/// Which of a topic's event types a handler takes
/// ([`ConsumerBuilder::handle_type`](crate::ConsumerBuilder::handle_type)):
/// a header's value, or a top-level field of a JSON payload (what serde
/// writes for `#[serde(tag = "type")]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventType {
    by: Selector,
    value: String,
}

/// Where a message says its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Selector {
    Header(String),
    Field(String),
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::Header(name) => write!(f, "header {name:?}"),
            Selector::Field(name) => write!(f, "field {name:?}"),
        }
    }
}

impl EventType {
    /// Events whose header `name` is `value` (the last one, if it repeats),
    /// such as an outbox router's `event-type: OrderPlaced`.
    pub fn header(name: impl Into<String>, value: impl Into<String>) -> Self {
        EventType {
            by: Selector::Header(name.into()),
            value: value.into(),
        }
    }

    /// Events whose JSON payload's top-level field `name` is the string
    /// `value`: `EventType::field("type", "OrderPlaced")` for an enum with
    /// `#[serde(tag = "type")]`.
    pub fn field(name: impl Into<String>, value: impl Into<String>) -> Self {
        EventType {
            by: Selector::Field(name.into()),
            value: value.into(),
        }
    }

    pub(crate) fn selector(&self) -> &Selector {
        &self.by
    }

    pub(crate) fn value(&self) -> &str {
        &self.value
    }
}

/// What becomes of a message whose type no handler of its topic takes
/// ([`ConsumerBuilder::other_types`](crate::ConsumerBuilder::other_types)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OtherTypes {
    /// Dead-lettered with kind `unrouted` (the default): nothing is lost,
    /// and a handler added later can replay them.
    #[default]
    DeadLetter,
    /// Skipped (counted as `ignored`): for a topic that carries types this
    /// consumer does not care about.
    Skip,
}

/// The type a message says it is, by `by`: a header's value (the last
/// one), or a top-level string field of its JSON payload. `None` if it
/// says none (or not as UTF-8, or not as a JSON object).
pub(crate) fn said_type(by: &Selector, headers: &dyn Headers, payload: &[u8]) -> Option<String> {
    match by {
        Selector::Header(name) => std::str::from_utf8(headers.get(name)?)
            .ok()
            .map(str::to_owned),
        Selector::Field(name) => top_level_string(payload, name),
    }
}

/// [`said_type`] of a record.
pub(crate) fn event_type_of(by: &Selector, msg: &rdkafka::message::OwnedMessage) -> Option<String> {
    use rdkafka::message::Message as _;
    let headers = crate::pipeline::KafkaHeaders(msg.headers());
    said_type(by, &headers, msg.payload().unwrap_or_default())
}

/// The string value of the top-level field `name` of a JSON object, read
/// without decoding the rest. A payload that turns out malformed after the
/// field still names its type: it goes to that type's handler, which
/// dead-letters it as a decode error (never skipped as another type).
pub(crate) fn top_level_string(json: &[u8], name: &str) -> Option<String> {
    // Not a string: it names no type.
    top_level(json, name)?.as_str().map(str::to_owned)
}

/// The value of the top-level field `name` of a JSON object (the first),
/// read without decoding the rest.
pub(crate) fn top_level(json: &[u8], name: &str) -> Option<serde_json::Value> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};

    struct Field<'a>(&'a str, &'a mut Option<serde_json::Value>);

    impl<'de> Visitor<'de> for Field<'_> {
        type Value = ();

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if key == self.0 {
                    *self.1 = Some(map.next_value::<serde_json::Value>()?);
                    return Ok(());
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(())
        }
    }

    impl<'de> DeserializeSeed<'de> for Field<'_> {
        type Value = ();

        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }

    let mut found = None;
    let mut de = serde_json::Deserializer::from_slice(json);
    // Malformed after the field or not: what it said is kept.
    let _ = Field(name, &mut found).deserialize(&mut de);
    found
}

/// What orders a topic's events under key-ordered concurrency
/// ([`ConsumerBuilder::key_concurrency`](crate::ConsumerBuilder::key_concurrency)):
/// events with the same ordering key run one at a time, in offset order;
/// events of different keys may run at once. The default is the record's
/// Kafka key, which is what decides its partition. An event without one
/// (no record key, no such header or field) is ordered with nothing: it
/// may run beside any other.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OrderBy(Option<Selector>);

impl OrderBy {
    /// The record's Kafka key (the default).
    pub fn record_key() -> Self {
        OrderBy(None)
    }

    /// The value of header `name` (the last one, if it repeats).
    pub fn header(name: impl Into<String>) -> Self {
        OrderBy(Some(Selector::Header(name.into())))
    }

    /// The value of the JSON payload's top-level field `name`, such as
    /// `account_id` when events of one account must stay in order but
    /// their records are keyed by something else. Read without decoding
    /// the rest of the payload.
    pub fn field(name: impl Into<String>) -> Self {
        OrderBy(Some(Selector::Field(name.into())))
    }

    /// The ordering key of `msg`, if it has one.
    pub(crate) fn key_of(
        &self,
        msg: &rdkafka::message::OwnedMessage,
    ) -> Option<crate::pipeline::keyed::OrderKey> {
        use crate::pipeline::keyed::order_key;
        use dedup_core::Headers as _;
        use rdkafka::message::Message as _;
        match &self.0 {
            None => msg.key().map(order_key),
            Some(Selector::Header(name)) => crate::pipeline::KafkaHeaders(msg.headers())
                .get(name)
                .map(order_key),
            Some(Selector::Field(name)) => {
                match top_level(msg.payload().unwrap_or_default(), name)? {
                    serde_json::Value::String(s) => Some(order_key(s.as_bytes())),
                    serde_json::Value::Null => None,
                    other => Some(order_key(other.to_string().as_bytes())),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::top_level_string;

    #[test]
    fn an_event_type_field_is_read_at_the_top_level_only() {
        let read = |json: &str| top_level_string(json.as_bytes(), "type");
        assert_eq!(
            read(r#"{"id": 1, "type": "OrderPlaced", "lines": [{"type": "x"}]}"#),
            Some("OrderPlaced".to_owned())
        );
        assert_eq!(
            read(r#"{"lines": [{"type": "x"}], "nested": {"type": "y"}}"#),
            None
        );
        assert_eq!(read(r#"{"type": 3}"#), None, "not a string");
        assert_eq!(read(r#"{"type": "A", "type": "B"}"#), Some("A".to_owned()));
        assert_eq!(read("not json"), None);
        assert_eq!(
            read(r#"{"type": "OrderPlaced", "id": 1,"#),
            Some("OrderPlaced".to_owned()),
            "malformed after the field: still its type"
        );
        assert_eq!(read(r#"{"id": 1, "type": "#), None, "cut before the value");
        assert_eq!(read(r#"["type", "A"]"#), None, "not an object");
        assert_eq!(
            read(r#"{"ty\u0070e": "Escaped"}"#),
            Some("Escaped".to_owned())
        );
    }
}
