//! Dead-lettering: the original record plus why it failed.

use crate::oauth::TokenContext;
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// Longest `dedup.error.message` header; longer messages are cut at a
/// character boundary.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;

/// How much of the payload a dead letter keeps when the whole record is
/// too large for the broker (headers `dedup.payload.truncated` and
/// `dedup.original.size` say so; the original stays in its topic at
/// `dedup.original.offset`). If even that is refused, the payload is dropped.
pub const TRUNCATED_PAYLOAD_BYTES: usize = 64 * 1024;

/// The largest record the dead-letter producer sends: the broker's default
/// `message.max.bytes`, so that a message that just fitted its own topic
/// still fits the dead-letter topic with dedup's headers added.
pub(crate) const MAX_DEAD_LETTER_BYTES: &str = "1048588";

/// The broker (or the producer) refused the record as too large.
pub(crate) fn is_too_large(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge)
    )
}

/// How long the dead-letter topic must look unwritable (unknown, not
/// authorized) before the consumer stops: longer than librdkafka's topic
/// metadata settling (30 s) and a grant spreading across brokers.
pub(crate) const UNWRITABLE_FOR: Duration = Duration::from_secs(60);

/// The partition a record was sent to does not exist (a retry tier's
/// topic with fewer partitions than its handled topic).
pub(crate) fn is_missing_partition(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::MessageProduction(RDKafkaErrorCode::UnknownPartition)
    )
}

/// The dead-letter topic's name is invalid: no retry can help.
pub(crate) fn is_invalid(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::MessageProduction(RDKafkaErrorCode::InvalidTopic)
    )
}

/// The dead-letter topic cannot be written as things stand: it does not
/// exist (and is not created on demand), its name is invalid, or the
/// consumer may not write it.
pub(crate) fn is_unwritable(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::MessageProduction(
            RDKafkaErrorCode::UnknownTopic
                | RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
        )
    )
}

/// Why a message is dead-lettered (or moved to a retry tier).
pub(crate) struct DeadLetter<'a> {
    pub(crate) topic: &'a str,
    pub(crate) kind: &'a str,
    pub(crate) message: String,
    pub(crate) attempts: u32,
    pub(crate) handler: &'a str,
    /// The schema id the record's frame names, for a handler that reads
    /// it through a schema registry.
    pub(crate) schema_id: Option<u32>,
    /// Where the event was before any move to a retry tier: a dead
    /// letter's `dedup.original.*`, a moved record's `dedup.origin.*`.
    pub(crate) origin: crate::tiers::Origin,
    /// Set for a move to a retry tier (`topic` is the tier's).
    pub(crate) moved: Option<crate::tiers::Moved<'a>>,
}

/// The schema id `msg`'s payload names, if its handler reads it through a
/// schema registry (dedup-core's `Prepare`) and it has the frame.
pub(crate) fn schema_id(
    preparer: Option<&dyn dedup_core::decode::Prepare>,
    msg: &OwnedMessage,
) -> Option<u32> {
    preparer?.schema_id(msg.payload()?)
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The headers a dead letter gets on top of the original's. A record
/// replayed from a dead-letter topic (`dedup dlq replay`) and dead-lettered
/// again gets one fresh set of them, not a second one.
pub const DEAD_LETTER_HEADERS: [&str; 11] = [
    "dedup.original.topic",
    "dedup.original.partition",
    "dedup.original.offset",
    "dedup.error.kind",
    "dedup.error.message",
    "dedup.attempts",
    "dedup.handler",
    "dedup.payload.truncated",
    "dedup.original.size",
    "dedup.original.timestamp",
    "dedup.error.schema-id",
];

/// How often a record went round the dead-letter topic, set by a replay.
pub const REPLAY_COUNT_HEADER: &str = "dedup.replay.count";

/// Where a replayed record was in the dead-letter topic
/// (`<topic>/<partition>/<offset>`), set by a replay.
pub const REPLAYED_FROM_HEADER: &str = "dedup.replayed.from";

/// Whether a header of the original message is kept in its dead letter:
/// all but the dead-letter headers of an earlier dead letter; in a move to
/// a retry tier, not the tier's headers of an earlier move either (they
/// are set afresh).
fn kept(key: &str, moving: bool) -> bool {
    // A released copy's mark: its dead letter or move is the event's own;
    // a signature is made afresh for each move, and a dead letter has none.
    key != crate::tiers::RETRY_RELEASED_HEADER
        && key != crate::tiers::RETRY_SIGNATURE_HEADER
        && !DEAD_LETTER_HEADERS.contains(&key)
        && !(moving
            && (crate::tiers::ORIGIN_HEADERS.contains(&key)
                || [
                    crate::tiers::RETRY_TIER_HEADER,
                    crate::tiers::RETRY_DUE_HEADER,
                    crate::tiers::RETRY_ATTEMPT_HEADER,
                ]
                .contains(&key)))
}

/// The dead-letter headers: the original ones, then `dedup.*`; with
/// `truncated`, the payload's original size. A dead letter's
/// `dedup.original.*` name the event's origin (read from a retry tier, the
/// topic it was first read from), so that a replay sends it home; a move
/// to a tier gets `dedup.origin.*` and `dedup.retry.*` instead.
pub(crate) fn headers(
    msg: &OwnedMessage,
    why: &DeadLetter<'_>,
    truncated: Option<usize>,
) -> OwnedHeaders {
    let mut out = OwnedHeaders::new();
    if let Some(original) = msg.headers() {
        for h in original.iter().filter(|h| kept(h.key, why.moved.is_some())) {
            out = out.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
    }
    let origin = &why.origin;
    let partition = origin.partition.to_string();
    let offset = origin.offset.to_string();
    let attempts = why.attempts.to_string();
    let [
        topic,
        partition_key,
        offset_key,
        kind,
        message,
        attempts_key,
        handler,
        truncated_key,
        size_key,
        timestamp_key,
        schema_key,
    ] = DEAD_LETTER_HEADERS;
    let [
        origin_topic,
        origin_partition,
        origin_offset,
        origin_timestamp,
    ] = crate::tiers::ORIGIN_HEADERS;
    let (topic, partition_key, offset_key, timestamp_key) = match why.moved {
        Some(_) => (
            origin_topic,
            origin_partition,
            origin_offset,
            origin_timestamp,
        ),
        None => (topic, partition_key, offset_key, timestamp_key),
    };
    let fields: [(&str, &str); 7] = [
        (topic, &origin.topic),
        (partition_key, &partition),
        (offset_key, &offset),
        (kind, why.kind),
        (message, truncate(&why.message, MAX_ERROR_MESSAGE_BYTES)),
        (attempts_key, &attempts),
        (handler, why.handler),
    ];
    for (key, value) in fields {
        out = out.insert(Header {
            key,
            value: Some(value.as_bytes()),
        });
    }
    if let Some(moved) = &why.moved {
        let (due, attempts) = (moved.due_ms.to_string(), moved.attempts.to_string());
        for (key, value) in [
            (crate::tiers::RETRY_TIER_HEADER, moved.tier),
            (crate::tiers::RETRY_DUE_HEADER, due.as_str()),
            (crate::tiers::RETRY_ATTEMPT_HEADER, attempts.as_str()),
        ] {
            out = out.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
    }
    // With the offset, which message it was: a topic created again reuses
    // offsets (`dedup dlq replay` tells such messages apart by it).
    if let Some(millis) = origin.timestamp {
        let millis = millis.to_string();
        out = out.insert(Header {
            key: timestamp_key,
            value: Some(millis.as_bytes()),
        });
    }
    if let Some(id) = why.schema_id {
        let id = id.to_string();
        out = out.insert(Header {
            key: schema_key,
            value: Some(id.as_bytes()),
        });
    }
    if let Some(size) = truncated {
        let size = size.to_string();
        for (key, value) in [(truncated_key, "true"), (size_key, size.as_str())] {
            out = out.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
    }
    // Signed last, over what it signs (a move is never truncated: one too
    // large goes to the dead-letter topic instead).
    if let Some(key) = why.moved.as_ref().and_then(|m| m.key)
        && truncated.is_none()
    {
        let signature = key.sign(msg.key(), msg.payload(), Some(&out));
        out = out.insert(Header {
            key: crate::tiers::RETRY_SIGNATURE_HEADER,
            value: Some(signature.as_bytes()),
        });
    }
    // Made while its message was processed (feature `opentelemetry`): the
    // dead letter's trace context is that processing's span, child of the
    // original's; without a span, the original's is kept.
    #[cfg(feature = "opentelemetry")]
    let out = crate::otel::with_trace(out, &opentelemetry::Context::current());
    out
}

/// Which message a dead letter is a copy of: where it was and, for dead
/// letters that carry it, its timestamp (a topic created again reuses
/// offsets for other messages).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OriginalMessage {
    /// `dedup.original.topic`.
    pub topic: String,
    /// `dedup.original.partition`.
    pub partition: i32,
    /// `dedup.original.offset`.
    pub offset: i64,
    /// `dedup.original.timestamp` (ms since the Unix epoch), where written.
    pub timestamp: Option<i64>,
}

impl std::fmt::Display for OriginalMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.topic, self.partition, self.offset)
    }
}

/// What a dead letter's `dedup.*` headers say: which message it is a copy
/// of, why that failed, and what replays did with it. What the runtime
/// writes ([`DEAD_LETTER_HEADERS`], and a replay's
/// [`REPLAY_COUNT_HEADER`] and [`REPLAYED_FROM_HEADER`]), read back by the
/// operator tool and its console.
///
/// ```
/// use dedup_kafka::DeadLetterHeaders;
/// use rdkafka::message::{Header, OwnedHeaders};
///
/// let headers = [
///     ("dedup.original.topic", "payments"),
///     ("dedup.original.partition", "2"),
///     ("dedup.original.offset", "41"),
///     ("dedup.error.kind", "decode"),
///     ("dedup.error.message", "expected value at line 1 column 1"),
/// ]
/// .into_iter()
/// .fold(OwnedHeaders::new(), |h, (key, value)| {
///     h.insert(Header { key, value: Some(value) })
/// });
/// let letter = DeadLetterHeaders::read(Some(&headers)).unwrap();
/// assert_eq!(letter.origin.unwrap().to_string(), "payments/2/41");
/// assert_eq!(letter.kind.as_deref(), Some("decode"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterHeaders {
    /// The message it is a copy of; `None` if it has no
    /// `dedup.original.*` headers (a record some other tool wrote).
    pub origin: Option<OriginalMessage>,
    /// `dedup.error.kind`: decode, key, handler, store, panic,
    /// fingerprint, output.
    pub kind: Option<String>,
    /// `dedup.error.message`, at most [`MAX_ERROR_MESSAGE_BYTES`].
    pub error: Option<String>,
    /// `dedup.attempts`.
    pub attempts: Option<u32>,
    /// `dedup.handler`: the handler's scope.
    pub handler: Option<String>,
    /// `dedup.error.schema-id`: the schema id the record's frame names,
    /// for a handler that reads it through a schema registry.
    pub schema_id: Option<u32>,
    /// `dedup.payload.truncated`: the payload was cut to fit; the original
    /// is whole in its topic.
    pub truncated: bool,
    /// `dedup.original.size`: the payload's size before it was cut.
    pub original_size: Option<u64>,
    /// `dedup.replay.count`: how often a replay sent it back.
    pub replays: u32,
    /// `dedup.replayed.from`: where the replayed record was in the
    /// dead-letter topic.
    pub replayed_from: Option<String>,
}

/// A dead letter's `dedup.*` headers cannot be read: a value not UTF-8,
/// `dedup.original.*` incomplete or not numbers, or a replay count that is
/// not a number. What could be read is kept ([`MalformedHeaders::partial`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{why}")]
pub struct MalformedHeaders {
    why: String,
    partial: Box<DeadLetterHeaders>,
}

impl MalformedHeaders {
    /// The headers that could be read (the kind and the reason, say, for a
    /// page to show), without an origin.
    pub fn partial(&self) -> &DeadLetterHeaders {
        &self.partial
    }
}

impl DeadLetterHeaders {
    /// Reads the `dedup.*` headers of a dead letter; of a header given
    /// more than once, the last wins, as for a consumer reading headers.
    /// Other headers (the original message's own) are left alone. The
    /// headers that say where the message was (and how often it was
    /// replayed) must be readable; the attempts and the original size are
    /// informative, and left out when they are not numbers.
    pub fn read<H: Headers>(headers: Option<&H>) -> Result<Self, MalformedHeaders> {
        let [
            topic,
            partition,
            offset,
            kind,
            error,
            attempts,
            handler,
            truncated,
            size,
            timestamp,
            schema_id,
        ] = DEAD_LETTER_HEADERS;
        let mut text: std::collections::HashMap<&str, String> = std::collections::HashMap::new();
        let mut problem = None;
        for h in headers.into_iter().flat_map(|hs| hs.iter()) {
            let Some(&key) = DEAD_LETTER_HEADERS
                .iter()
                .chain(&[REPLAY_COUNT_HEADER, REPLAYED_FROM_HEADER])
                .find(|k| **k == h.key)
            else {
                continue;
            };
            match std::str::from_utf8(h.value.unwrap_or_default()) {
                Ok(value) => {
                    text.insert(key, value.to_owned());
                }
                Err(_) => {
                    text.remove(key);
                    problem.get_or_insert_with(|| format!("header {key} is not UTF-8 text"));
                }
            }
        }
        fn number<T: std::str::FromStr>(
            text: &std::collections::HashMap<&str, String>,
            key: &str,
        ) -> Result<Option<T>, String> {
            text.get(key)
                .map(|v| {
                    v.parse::<T>()
                        .map_err(|_| format!("header {key} = {v:?} is not a number"))
                })
                .transpose()
        }
        let origin = (|| {
            Ok(
                match (
                    text.get(topic),
                    number::<i32>(&text, partition)?,
                    number::<i64>(&text, offset)?,
                ) {
                    (Some(name), Some(partition), Some(offset)) if !name.is_empty() => {
                        Some(OriginalMessage {
                            topic: name.clone(),
                            partition,
                            offset,
                            timestamp: number(&text, timestamp)?,
                        })
                    }
                    (None, None, None) => None,
                    _ => return Err("its dedup.original.* headers are incomplete".to_owned()),
                },
            )
        })();
        // A negative count (never written) reads as none.
        let replays = number::<i64>(&text, REPLAY_COUNT_HEADER)
            .map(|n| n.map_or(0, |n| u32::try_from(n).unwrap_or(0)));
        let mut read = DeadLetterHeaders {
            origin: None,
            attempts: number(&text, attempts).ok().flatten(),
            original_size: number(&text, size).ok().flatten(),
            schema_id: number(&text, schema_id).ok().flatten(),
            replays: *replays.as_ref().unwrap_or(&0),
            truncated: text.get(truncated).is_some_and(|v| v == "true"),
            kind: text.remove(kind),
            error: text.remove(error),
            handler: text.remove(handler),
            replayed_from: text.remove(REPLAYED_FROM_HEADER),
        };
        match (problem, origin, replays) {
            (None, Ok(origin), Ok(_)) => {
                read.origin = origin;
                Ok(read)
            }
            (Some(why), _, _) | (None, Err(why), _) | (None, Ok(_), Err(why)) => {
                Err(MalformedHeaders {
                    why,
                    partial: Box::new(read),
                })
            }
        }
    }
}

/// Produces the dead letter and waits for the broker's acknowledgement;
/// with `keep`, at most that many bytes of the payload.
pub(crate) async fn send(
    producer: &FutureProducer<TokenContext>,
    msg: &OwnedMessage,
    why: &DeadLetter<'_>,
    timeout: Duration,
    keep: Option<usize>,
) -> Result<(), KafkaError> {
    producer
        .send(record(msg, why, keep), timeout)
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

/// The record of `msg`'s dead letter or move `why`: its key, its payload
/// (the first `keep` bytes of it, if set) and its headers.
pub(crate) fn record<'a>(
    msg: &'a OwnedMessage,
    why: &'a DeadLetter<'_>,
    keep: Option<usize>,
) -> FutureRecord<'a, [u8], [u8]> {
    let payload = msg.payload().unwrap_or_default();
    let kept = keep.map_or(payload, |n| &payload[..n.min(payload.len())]);
    let truncated = (kept.len() < payload.len()).then_some(payload.len());
    let mut record =
        FutureRecord::<[u8], [u8]>::to(why.topic).headers(headers(msg, why, truncated));
    if let Some(key) = msg.key() {
        record = record.key(key);
    }
    if msg.payload().is_some() {
        record = record.payload(kept);
    }
    // A move goes to its origin's partition number: a tier's partition
    // keeps the order in which its origin partition's events moved.
    if why.moved.is_some() {
        record = record.partition(why.origin.partition);
    }
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_dead_lettered_again_has_one_set_of_dedup_headers() {
        let mut original = OwnedHeaders::new();
        for (key, value) in [
            ("trace-id", "t-1"),
            ("dedup.tenant", "acme"),
            ("dedup.original.topic", "payments"),
            ("dedup.original.offset", "7"),
            ("dedup.error.kind", "decode"),
            ("dedup.error.message", "old"),
            ("dedup.attempts", "1"),
            ("dedup.handler", "h"),
            ("dedup.payload.truncated", "true"),
            ("dedup.error.schema-id", "3"),
            ("dedup.replay.count", "1"),
            ("dedup.replayed.from", "payments.dlq/0/3"),
        ] {
            original = original.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let msg = OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "payments".into(),
            rdkafka::Timestamp::NotAvailable,
            0,
            42,
            Some(original),
        );
        let why = DeadLetter {
            topic: "payments.dlq",
            kind: "handler",
            message: "new".into(),
            attempts: 2,
            handler: "h",
            schema_id: None,
            origin: crate::tiers::origin_of(&msg, false),
            moved: None,
        };
        let out = headers(&msg, &why, None);
        let all: Vec<(String, String)> = out
            .iter()
            .map(|h| {
                let value = String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned();
                (h.key.to_owned(), value)
            })
            .collect();
        let count = |key: &str| all.iter().filter(|(k, _)| k == key).count();
        let value = |key: &str| all.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        for key in [
            "dedup.original.topic",
            "dedup.original.offset",
            "dedup.error.kind",
            "dedup.error.message",
            "dedup.attempts",
            "dedup.handler",
        ] {
            assert_eq!(count(key), 1, "{key} once: {all:?}");
        }
        assert_eq!(value("dedup.error.message"), Some("new"));
        assert_eq!(value("dedup.original.offset"), Some("42"));
        assert_eq!(count("dedup.payload.truncated"), 0, "not cut this time");
        assert_eq!(count("dedup.error.schema-id"), 0, "not a framed record now");
        assert_eq!(
            value("dedup.replay.count"),
            Some("1"),
            "the replay's headers stay"
        );
        assert_eq!(value("dedup.replayed.from"), Some("payments.dlq/0/3"));
        assert_eq!(value("trace-id"), Some("t-1"), "the user's headers stay");
        assert_eq!(
            value("dedup.tenant"),
            Some("acme"),
            "also in dedup's namespace"
        );
    }

    /// What the runtime writes on a dead letter, the reader gives back:
    /// the round trip the operator tool and the console rely on.
    #[test]
    fn dead_letter_headers_read_back_what_was_written() {
        let original = OwnedHeaders::new()
            .insert(Header {
                key: "trace-id",
                value: Some("t-1"),
            })
            .insert(Header {
                key: REPLAY_COUNT_HEADER,
                value: Some("2"),
            })
            .insert(Header {
                key: REPLAYED_FROM_HEADER,
                value: Some("payments.dlq/1/9"),
            });
        let msg = OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "payments".into(),
            rdkafka::Timestamp::CreateTime(1_700_000_000_123),
            3,
            42,
            Some(original),
        );
        let why = DeadLetter {
            topic: "payments.dlq",
            kind: "handler",
            message: "é".repeat(MAX_ERROR_MESSAGE_BYTES),
            attempts: 5,
            handler: "payments::record",
            schema_id: Some(100_007),
            origin: crate::tiers::origin_of(&msg, false),
            moved: None,
        };
        let written = headers(&msg, &why, Some(2_000_000));
        let read = DeadLetterHeaders::read(Some(&written)).expect("readable");
        assert_eq!(
            read,
            DeadLetterHeaders {
                origin: Some(OriginalMessage {
                    topic: "payments".into(),
                    partition: 3,
                    offset: 42,
                    timestamp: Some(1_700_000_000_123),
                }),
                kind: Some("handler".into()),
                error: Some("é".repeat(MAX_ERROR_MESSAGE_BYTES / 2)),
                attempts: Some(5),
                handler: Some("payments::record".into()),
                schema_id: Some(100_007),
                truncated: true,
                original_size: Some(2_000_000),
                replays: 2,
                replayed_from: Some("payments.dlq/1/9".into()),
            }
        );
        assert_eq!(read.origin.expect("origin").to_string(), "payments/3/42");

        // Not cut, no timestamp, no replay: those fields are empty.
        let msg = OwnedMessage::new(
            None,
            None,
            "orders".into(),
            rdkafka::Timestamp::NotAvailable,
            0,
            7,
            None,
        );
        let why = DeadLetter {
            origin: crate::tiers::origin_of(&msg, false),
            kind: "decode",
            message: "bad".into(),
            schema_id: None,
            ..why
        };
        let read = DeadLetterHeaders::read(Some(&headers(&msg, &why, None))).expect("readable");
        assert_eq!(read.origin.as_ref().map(|o| o.timestamp), Some(None));
        assert!(!read.truncated);
        assert_eq!((read.original_size, read.replays), (None, 0));
        assert_eq!((read.replayed_from, read.schema_id), (None, None));

        // A move to a retry tier is not a dead letter: no dedup.original.*.
        let moved = DeadLetter {
            moved: Some(crate::tiers::Moved {
                tier: "30s",
                due_ms: 1,
                attempts: 3,
                key: None,
            }),
            ..why
        };
        let read = DeadLetterHeaders::read(Some(&headers(&msg, &moved, None))).expect("readable");
        assert_eq!(read.origin, None);
        assert_eq!(read.kind.as_deref(), Some("decode"));
        assert_eq!(
            DeadLetterHeaders::read(None::<&OwnedHeaders>),
            Ok(DeadLetterHeaders::default())
        );
    }

    #[test]
    fn unreadable_dead_letter_headers_say_which_and_why() {
        let with = |pairs: &[(&str, &[u8])]| {
            let headers = pairs.iter().fold(OwnedHeaders::new(), |h, (key, value)| {
                h.insert(Header {
                    key,
                    value: Some(*value),
                })
            });
            DeadLetterHeaders::read(Some(&headers))
                .map_err(|e| e.to_string())
                .map(|h| h.origin)
        };
        let whole: [(&str, &[u8]); 3] = [
            ("dedup.original.topic", b"t"),
            ("dedup.original.partition", b"0"),
            ("dedup.original.offset", b"5"),
        ];
        assert!(matches!(with(&whole), Ok(Some(_))));
        let err = with(&[whole[0], whole[1]]).unwrap_err();
        assert!(err.contains("incomplete"), "{err}");
        let err = with(&[whole[0], whole[1], ("dedup.original.offset", b"five")]).unwrap_err();
        assert!(
            err.contains("dedup.original.offset") && err.contains("not a number"),
            "{err}"
        );
        let err = with(&[("dedup.error.kind", &[0xff, 0xfe])]).unwrap_err();
        assert!(
            err.contains("dedup.error.kind") && err.contains("UTF-8"),
            "{err}"
        );
        // What could be read is kept, for a page to show; informative
        // numbers that are not numbers are left out, not errors.
        let headers = [
            ("dedup.error.kind", &b"handler"[..]),
            ("dedup.original.topic", b"t"),
            ("dedup.attempts", b"many"),
            ("dedup.replay.count", b"-1"),
        ]
        .iter()
        .fold(OwnedHeaders::new(), |h, (key, value)| {
            h.insert(Header {
                key,
                value: Some(*value),
            })
        });
        let err = DeadLetterHeaders::read(Some(&headers)).unwrap_err();
        assert_eq!(err.partial().kind.as_deref(), Some("handler"));
        assert_eq!((err.partial().attempts, err.partial().replays), (None, 0));
        assert_eq!(err.partial().origin, None);
        // The last of a repeated header wins; other headers are not read.
        let last = with(&[
            whole[0],
            whole[1],
            ("dedup.original.offset", b"bad"),
            whole[2],
            ("user-header", &[0xff]),
        ]);
        assert_eq!(last.ok().flatten().map(|o| o.offset), Some(5));
    }

    fn all_headers(out: &OwnedHeaders) -> Vec<(String, String)> {
        out.iter()
            .map(|h| {
                let value = String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned();
                (h.key.to_owned(), value)
            })
            .collect()
    }

    /// A move to the next tier keeps the event's origin and sets the
    /// tier's headers afresh; a dead letter from a tier names the origin in
    /// `dedup.original.*`, so that a replay sends it home.
    #[test]
    fn a_moved_record_keeps_its_origin_through_the_tiers() {
        let mut original = OwnedHeaders::new();
        for (key, value) in [
            ("trace-id", "t-1"),
            ("dedup.origin.topic", "payments"),
            ("dedup.origin.partition", "2"),
            ("dedup.origin.offset", "41"),
            ("dedup.origin.timestamp", "1000"),
            ("dedup.retry.tier", "30s"),
            ("dedup.retry.due", "5000"),
            ("dedup.retry.attempt", "4"),
            ("dedup.error.kind", "handler"),
            ("dedup.retry.released", "payments.retry-30s/0/5"),
        ] {
            original = original.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let msg = OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "payments.retry-30s".into(),
            rdkafka::Timestamp::CreateTime(7_000),
            0,
            5,
            Some(original),
        );
        let origin = crate::tiers::origin_of(&msg, true);
        let onward = DeadLetter {
            topic: "payments.retry-5m",
            kind: "handler",
            message: "503".into(),
            attempts: 4,
            handler: "h",
            schema_id: None,
            origin: origin.clone(),
            moved: Some(crate::tiers::Moved {
                tier: "5m",
                due_ms: 9_000,
                attempts: 8,
                key: None,
            }),
        };
        let all = all_headers(&headers(&msg, &onward, None));
        let count = |key: &str| all.iter().filter(|(k, _)| k == key).count();
        let value = |key: &str| all.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        for key in [
            "dedup.origin.topic",
            "dedup.origin.offset",
            "dedup.retry.tier",
            "dedup.retry.due",
            "dedup.retry.attempt",
            "dedup.error.kind",
        ] {
            assert_eq!(count(key), 1, "{key} once: {all:?}");
        }
        assert_eq!(value("dedup.origin.topic"), Some("payments"));
        assert_eq!(value("dedup.origin.offset"), Some("41"));
        assert_eq!(value("dedup.origin.timestamp"), Some("1000"));
        assert_eq!(value("dedup.retry.tier"), Some("5m"));
        assert_eq!(value("dedup.retry.due"), Some("9000"));
        assert_eq!(value("dedup.retry.attempt"), Some("8"));
        assert_eq!(value("dedup.error.message"), Some("503"));
        assert_eq!(count("dedup.original.topic"), 0, "not a dead letter");
        assert_eq!(
            count("dedup.retry.released"),
            0,
            "the move is the event's own"
        );
        assert_eq!(value("trace-id"), Some("t-1"));

        let dead = DeadLetter {
            topic: "payments.dlq",
            moved: None,
            ..onward
        };
        let all = all_headers(&headers(&msg, &dead, None));
        let value = |key: &str| all.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        assert_eq!(value("dedup.original.topic"), Some("payments"));
        assert_eq!(value("dedup.original.partition"), Some("2"));
        assert_eq!(value("dedup.original.offset"), Some("41"));
        assert_eq!(value("dedup.original.timestamp"), Some("1000"));
        assert_eq!(value("dedup.retry.tier"), Some("30s"), "where it was last");
        assert!(
            all.iter().all(|(k, _)| k != "dedup.retry.released"),
            "a replay of the dead letter is no released copy: {all:?}"
        );
    }

    #[test]
    fn truncates_on_a_char_boundary() {
        let s = "é".repeat(3000); // 6000 bytes
        let t = truncate(&s, MAX_ERROR_MESSAGE_BYTES);
        assert!(t.len() <= MAX_ERROR_MESSAGE_BYTES && t.len() >= MAX_ERROR_MESSAGE_BYTES - 1);
        assert_eq!(truncate("short", 10), "short");
    }
}
