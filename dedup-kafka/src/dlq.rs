//! Dead-lettering: the original record plus why it failed.

use std::time::Duration;

use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// Longest `dedup.error.message` header; longer messages are cut at a
/// character boundary.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;

/// Why a message is dead-lettered.
pub(crate) struct DeadLetter<'a> {
    pub(crate) topic: &'a str,
    pub(crate) kind: &'a str,
    pub(crate) message: String,
    pub(crate) attempts: u32,
    pub(crate) handler: &'a str,
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

/// The dead-letter headers: the original ones, then `dedup.*`.
pub(crate) fn headers(msg: &OwnedMessage, why: &DeadLetter<'_>) -> OwnedHeaders {
    let mut out = OwnedHeaders::new();
    if let Some(original) = msg.headers() {
        for h in original.iter() {
            out = out.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
    }
    let partition = msg.partition().to_string();
    let offset = msg.offset().to_string();
    let attempts = why.attempts.to_string();
    let fields: [(&str, &str); 7] = [
        ("dedup.original.topic", msg.topic()),
        ("dedup.original.partition", &partition),
        ("dedup.original.offset", &offset),
        ("dedup.error.kind", why.kind),
        (
            "dedup.error.message",
            truncate(&why.message, MAX_ERROR_MESSAGE_BYTES),
        ),
        ("dedup.attempts", &attempts),
        ("dedup.handler", why.handler),
    ];
    for (key, value) in fields {
        out = out.insert(Header {
            key,
            value: Some(value.as_bytes()),
        });
    }
    out
}

/// Produces the dead letter and waits for the broker's acknowledgement.
pub(crate) async fn send(
    producer: &FutureProducer,
    msg: &OwnedMessage,
    why: &DeadLetter<'_>,
    timeout: Duration,
) -> Result<(), rdkafka::error::KafkaError> {
    let mut record = FutureRecord::<[u8], [u8]>::to(why.topic).headers(headers(msg, why));
    if let Some(key) = msg.key() {
        record = record.key(key);
    }
    if let Some(payload) = msg.payload() {
        record = record.payload(payload);
    }
    producer
        .send(record, timeout)
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncates_on_a_char_boundary() {
        let s = "é".repeat(3000); // 6000 bytes
        let t = truncate(&s, MAX_ERROR_MESSAGE_BYTES);
        assert!(t.len() <= MAX_ERROR_MESSAGE_BYTES && t.len() >= MAX_ERROR_MESSAGE_BYTES - 1);
        assert_eq!(truncate("short", 10), "short");
    }
}
