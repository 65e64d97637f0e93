//! `dedup retry`: what waits in a retry tier, and releasing it early.

use std::collections::{BTreeMap, HashMap};

use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;

use crate::kafka::{self, TIMEOUT};
use crate::time::rfc3339_millis;
use crate::{Failure, KafkaArgs, Report};
use dedup_kafka::{
    DEAD_LETTER_HEADERS, ORIGIN_HEADERS, RETRY_ATTEMPT_HEADER, RETRY_DUE_HEADER,
    RETRY_RELEASED_HEADER, RETRY_SIGNATURE_HEADER, RETRY_TIER_HEADER,
};

/// A tier's record and what its headers say.
struct Waiting {
    msg: OwnedMessage,
    tier: Option<String>,
    due_ms: Option<i64>,
    attempt: Option<u32>,
    origin: Option<(String, i32, i64)>,
    kind: Option<String>,
    error: Option<String>,
}

fn header(msg: &OwnedMessage, key: &str) -> Option<String> {
    let headers = msg.headers()?;
    headers
        .iter()
        .filter(|h| h.key == key)
        .last()
        .and_then(|h| std::str::from_utf8(h.value?).ok())
        .map(str::to_owned)
}

impl Waiting {
    fn parse(msg: OwnedMessage) -> Self {
        let [topic, partition, offset, _] = ORIGIN_HEADERS;
        let origin = (|| {
            Some((
                header(&msg, topic)?,
                header(&msg, partition)?.parse().ok()?,
                header(&msg, offset)?.parse().ok()?,
            ))
        })();
        Waiting {
            tier: header(&msg, RETRY_TIER_HEADER),
            due_ms: header(&msg, RETRY_DUE_HEADER).and_then(|d| d.parse().ok()),
            attempt: header(&msg, RETRY_ATTEMPT_HEADER).and_then(|a| a.parse().ok()),
            kind: header(&msg, DEAD_LETTER_HEADERS[3]),
            error: header(&msg, DEAD_LETTER_HEADERS[4]),
            origin,
            msg,
        }
    }

    fn key(&self) -> String {
        self.msg
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .unwrap_or_default()
    }

    fn json(&self, now_ms: i64) -> serde_json::Value {
        json!({
            "partition": self.msg.partition(),
            "offset": self.msg.offset(),
            "key": self.key(),
            "tier": self.tier,
            "due": self.due_ms.map(rfc3339_millis),
            "due_in_seconds": self.due_ms.map(|d| ((d - now_ms).max(0) as f64) / 1000.0),
            "attempts": self.attempt,
            "origin": self.origin.as_ref().map(|(t, p, o)| json!({"topic": t, "partition": p, "offset": o})),
            "error_kind": self.kind,
            "error": self.error,
        })
    }
}

/// The records of `topic` (a retry tier) that `group` has not consumed
/// yet: what waits there; only those of `keys` if any are given.
fn waiting(
    kafka: &KafkaArgs,
    topic: &str,
    group: &str,
    keys: &[String],
) -> Result<Vec<Waiting>, Failure> {
    let consumer = kafka::consumer(kafka, group)?;
    let committed: HashMap<i32, i64> = crate::dlq::committed_offsets(&consumer, topic)?
        .into_iter()
        .map(|(p, (offset, _))| (p, offset))
        .collect();
    let records = kafka::read_to_end_from(&consumer, topic, &committed)?;
    Ok(records
        .into_iter()
        .map(Waiting::parse)
        .filter(|w| keys.is_empty() || keys.contains(&w.key()))
        .collect())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// What `dedup retry list` prints.
pub(crate) struct Listing {
    topic: String,
    now_ms: i64,
    waiting: Vec<Waiting>,
    show: usize,
}

/// Lists what waits in retry tier `topic` for consumer group `group`.
pub(crate) fn list(
    kafka: &KafkaArgs,
    topic: &str,
    group: &str,
    keys: &[String],
    show: usize,
) -> Result<Listing, Failure> {
    Ok(Listing {
        topic: topic.to_owned(),
        now_ms: now_ms(),
        waiting: waiting(kafka, topic, group, keys)?,
        show,
    })
}

impl Report for Listing {
    fn text(&self) -> String {
        let mut by_partition: BTreeMap<i32, (usize, Option<i64>)> = BTreeMap::new();
        for w in &self.waiting {
            let entry = by_partition.entry(w.msg.partition()).or_default();
            entry.0 += 1;
            entry.1 = match (entry.1, w.due_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        let mut out = format!("{}: {} waiting\n", self.topic, self.waiting.len());
        for (partition, (n, next)) in by_partition {
            let next = next.map_or_else(
                || "no due time".to_owned(),
                |d| {
                    format!(
                        "next due {} (in {:.1} s)",
                        rfc3339_millis(d),
                        ((d - self.now_ms).max(0) as f64) / 1000.0
                    )
                },
            );
            out.push_str(&format!("  partition {partition}: {n} waiting, {next}\n"));
        }
        for w in self.waiting.iter().take(self.show) {
            let origin = w
                .origin
                .as_ref()
                .map_or_else(|| "-".to_owned(), |(t, p, o)| format!("{t}/{p}/{o}"));
            out.push_str(&format!(
                "  {}/{} key {:?} from {origin}, due {}, {} attempts, {}: {}\n",
                w.msg.partition(),
                w.msg.offset(),
                w.key(),
                w.due_ms.map_or_else(|| "-".to_owned(), rfc3339_millis),
                w.attempt.unwrap_or(0),
                w.kind.as_deref().unwrap_or("-"),
                w.error.as_deref().unwrap_or("-"),
            ));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "topic": self.topic,
            "waiting": self.waiting.len(),
            "records": self.waiting.iter().map(|w| w.json(self.now_ms)).collect::<Vec<_>>(),
        })
    }
}

/// What `dedup retry release` did.
pub(crate) struct Released {
    topic: String,
    released: Vec<(String, i32, i64)>,
    /// Records of the tier not released, with why: their tier headers are
    /// not the runtime's (`<tier>/<partition>/<offset>`, reason).
    refused: Vec<(String, String)>,
}

/// Releases what waits in retry tier `topic` for `group` (those of `keys`
/// if given) early: a copy of each goes back to its origin topic and
/// partition, where the consumer applies it at once. The tier's record
/// stays, and is skipped as applied when it is due (its claim); a copy
/// that fails again moves to the tiers like any event.
pub(crate) async fn release(
    kafka: &KafkaArgs,
    topic: &str,
    group: &str,
    keys: &[String],
    signing: Option<&dedup_kafka::TierKey>,
) -> Result<Released, Failure> {
    let waiting = waiting(kafka, topic, group, keys)?;
    let producer: FutureProducer<dedup_kafka::TokenContext> = kafka::config(kafka)?
        .set("enable.idempotence", "true")
        .create_with_context(dedup_kafka::TokenContext)
        .map_err(|e| kafka::refused("producer", &e))?;
    let mut released = Vec::new();
    let mut refused = Vec::new();
    for w in &waiting {
        let from = format!("{topic}/{}/{}", w.msg.partition(), w.msg.offset());
        // Never sign (or send home) what the runtime did not move: a record
        // written into the tier by another producer, naming someone else's
        // event as its origin, would release that event's key. Without a
        // key this is a best effort (a move keeps its partition, and a
        // tier's topic names its handled topic); with one, the signature
        // covers the origin.
        let Some((origin, partition, offset)) = &w.origin else {
            refused.push((from, "it has no readable dedup.origin.* headers".to_owned()));
            continue;
        };
        if *partition != w.msg.partition() || !topic.contains(origin.as_str()) {
            refused.push((
                from,
                format!(
                    "its origin {origin}/{partition}/{offset} is not in this partition of a \
                     topic whose tier this is"
                ),
            ));
            continue;
        }
        if let Some(signing) = signing
            && !signing.verifies(&w.msg)
        {
            refused.push((
                from,
                "not signed with this key (during a key roll-out, with \
                 require_signatures(false), leave --tier-key-file out)"
                    .to_owned(),
            ));
            continue;
        }
        let mut headers = OwnedHeaders::new();
        if let Some(original) = w.msg.headers() {
            let own = |key: &str| key == RETRY_RELEASED_HEADER || key == RETRY_SIGNATURE_HEADER;
            for h in original.iter().filter(|h| !own(h.key)) {
                headers = headers.insert(Header {
                    key: h.key,
                    value: h.value,
                });
            }
        }
        headers = headers.insert(Header {
            key: RETRY_RELEASED_HEADER,
            value: Some(from.as_bytes()),
        });
        // Signed over the copy's own headers, key and payload, as the
        // consumer checks it.
        if let Some(signing) = signing {
            let signature = signing.sign(w.msg.key(), w.msg.payload(), Some(&headers));
            headers = headers.insert(Header {
                key: RETRY_SIGNATURE_HEADER,
                value: Some(signature.as_bytes()),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(origin)
            .partition(*partition)
            .headers(headers);
        if let Some(key) = w.msg.key() {
            record = record.key(key);
        }
        if let Some(payload) = w.msg.payload() {
            record = record.payload(payload);
        }
        producer
            .send(record, TIMEOUT)
            .await
            .map_err(|(e, _)| Failure::new(format!("releasing {from} to {origin}: {e}")))?;
        released.push((origin.clone(), *partition, *offset));
    }
    Ok(Released {
        topic: topic.to_owned(),
        released,
        refused,
    })
}

impl Report for Released {
    fn text(&self) -> String {
        let mut out = format!(
            "released {} record(s) of {} to their origin\n",
            self.released.len(),
            self.topic
        );
        for (topic, partition, offset) in &self.released {
            out.push_str(&format!("  {topic}/{partition}/{offset}\n"));
        }
        if !self.refused.is_empty() {
            out.push_str(&format!(
                "not released, {} record(s) whose tier headers may not be dedup's own (a \
                 consumer that judges them forged dead-letters them when they come due):\n",
                self.refused.len()
            ));
            for (record, why) in &self.refused {
                out.push_str(&format!("  {record}: {why}\n"));
            }
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "topic": self.topic,
            "released": self.released.iter().map(|(t, p, o)| json!({"topic": t, "partition": p, "offset": o})).collect::<Vec<_>>(),
            "refused": self.refused.iter().map(|(r, why)| json!({"record": r, "reason": why})).collect::<Vec<_>>(),
        })
    }
}
