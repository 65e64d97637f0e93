//! `dedup dlq`: what a dead-letter topic holds, and putting it back.

use std::collections::{BTreeMap, HashMap, HashSet};

use rdkafka::message::{Headers as _, Message as _, OwnedMessage};
use serde_json::json;

use crate::kafka::{self};
use crate::time::rfc3339_millis;
use crate::{Failure, KafkaArgs, Report};
use dedup_kafka::{DeadLetterHeaders, OriginalMessage};

/// Which message a dead letter is a copy of (dedup-kafka reads its headers).
type Origin = OriginalMessage;

/// A dead letter and what its headers say.
pub(crate) struct DeadLetter {
    pub(crate) msg: OwnedMessage,
    pub(crate) origin: Option<Origin>,
    pub(crate) kind: Option<String>,
    pub(crate) handler: Option<String>,
    pub(crate) error: Option<String>,
    /// The schema id the record's frame names (a registry's handler).
    pub(crate) schema_id: Option<u32>,
    pub(crate) truncated: bool,
    pub(crate) replays: u32,
    /// Why its dedup headers cannot be read (not UTF-8, not a number,
    /// incomplete), if they cannot.
    pub(crate) malformed: Option<String>,
}

impl DeadLetter {
    /// Reads the dedup headers; a malformed one is noted, not fatal: it
    /// matters only if the record is to be replayed.
    pub(crate) fn parse(msg: OwnedMessage) -> Self {
        // A malformed header leaves what could be read (the kind, the
        // reason) for the eye, never an origin to replay to.
        let (read, malformed) = match DeadLetterHeaders::read(msg.headers()) {
            Ok(read) => (read, None),
            Err(why) => (why.partial().clone(), Some(why.to_string())),
        };
        DeadLetter {
            msg,
            origin: read.origin,
            kind: read.kind,
            handler: read.handler,
            error: read.error,
            schema_id: read.schema_id,
            truncated: read.truncated,
            replays: read.replays,
            malformed,
        }
    }

    pub(crate) fn at(&self) -> String {
        format!(
            "{}/{}/{}",
            self.msg.topic(),
            self.msg.partition(),
            self.msg.offset()
        )
    }

    pub(crate) fn millis(&self) -> Option<i64> {
        self.msg.timestamp().to_millis()
    }
}

/// A bounded, printable preview of bytes.
pub(crate) fn preview(bytes: Option<&[u8]>, max: usize) -> String {
    let Some(bytes) = bytes else {
        return "(none)".to_owned();
    };
    let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(max)]);
    let mut out: String = shown.chars().flat_map(char::escape_debug).collect();
    if bytes.len() > max {
        out.push_str(&format!("... ({} bytes)", bytes.len()));
    }
    out
}

/// What a read of a dead-letter topic found: its letters, partition by
/// partition in offset order, and where each partition's read ended.
struct Read {
    letters: Vec<DeadLetter>,
    consumer: kafka::KafkaConsumer,
    ends: HashMap<i32, i64>,
}

/// Reads every dead letter of `topic` with `group`: to each partition's
/// end as of now, or (`until`) to where an earlier read ended.
fn read(
    kafka: &KafkaArgs,
    topic: &str,
    group: &str,
    until: Option<&HashMap<i32, i64>>,
) -> Result<Read, Failure> {
    let consumer = kafka::consumer(kafka, group)?;
    let (records, ends) = kafka::read_between(&consumer, topic, &HashMap::new(), until)?;
    let letters = records.into_iter().map(DeadLetter::parse).collect();
    Ok(Read {
        letters,
        consumer,
        ends,
    })
}

/// `dlq inspect`.
pub(crate) async fn inspect(
    kafka: &KafkaArgs,
    topic: &str,
    show: usize,
) -> Result<InspectReport, Failure> {
    let (kafka, topic) = (kafka.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let group = format!("dedup-inspect-{}", uuid::Uuid::new_v4().simple());
        let read = read(&kafka, &topic, &group, None)?;
        Ok(InspectReport::new(topic, read.letters, show))
    })
    .await
    .map_err(|e| Failure::new(format!("reading failed: {e}")))?
}

/// `dlq inspect`'s counts.
pub(crate) struct InspectReport {
    topic: String,
    records: usize,
    by_kind: BTreeMap<String, usize>,
    by_origin: BTreeMap<String, usize>,
    by_handler: BTreeMap<String, usize>,
    distinct: usize,
    copies: usize,
    without_headers: usize,
    malformed: usize,
    first: Option<i64>,
    last: Option<i64>,
    shown: Vec<serde_json::Value>,
}

impl InspectReport {
    fn new(topic: String, letters: Vec<DeadLetter>, show: usize) -> Self {
        let mut report = InspectReport {
            topic,
            records: letters.len(),
            by_kind: BTreeMap::new(),
            by_origin: BTreeMap::new(),
            by_handler: BTreeMap::new(),
            distinct: 0,
            copies: 0,
            without_headers: 0,
            malformed: 0,
            first: None,
            last: None,
            shown: Vec::new(),
        };
        let mut seen = HashSet::new();
        let none = || "(none)".to_owned();
        for letter in &letters {
            *report
                .by_kind
                .entry(letter.kind.clone().unwrap_or_else(none))
                .or_default() += 1;
            *report
                .by_handler
                .entry(letter.handler.clone().unwrap_or_else(none))
                .or_default() += 1;
            match &letter.origin {
                Some(origin) => {
                    *report
                        .by_origin
                        .entry(format!("{}/{}", origin.topic, origin.partition))
                        .or_default() += 1;
                    if seen.insert(origin.clone()) {
                        report.distinct += 1;
                    } else {
                        report.copies += 1;
                    }
                }
                None if letter.malformed.is_some() => report.malformed += 1,
                None => report.without_headers += 1,
            }
            if let Some(ms) = letter.millis() {
                report.first = Some(report.first.map_or(ms, |f| f.min(ms)));
                report.last = Some(report.last.map_or(ms, |l| l.max(ms)));
            }
        }
        report.shown = letters.iter().take(show).map(shown).collect();
        report
    }
}

/// One record as `--show` prints it.
fn shown(letter: &DeadLetter) -> serde_json::Value {
    let headers: Vec<_> = letter
        .msg
        .headers()
        .map(|hs| {
            hs.iter()
                .map(|h| json!([h.key, preview(h.value, 200)]))
                .collect()
        })
        .unwrap_or_default();
    json!({
        "at": letter.at(),
        "timestamp": letter.millis().map(rfc3339_millis),
        "kind": letter.kind,
        "error": letter.error,
        "schema_id": letter.schema_id,
        "original": letter.origin.as_ref().map(ToString::to_string),
        "malformed": letter.malformed,
        "key": preview(letter.msg.key(), 100),
        "payload": preview(letter.msg.payload(), 200),
        "headers": headers,
    })
}

fn counts(map: &BTreeMap<String, usize>) -> String {
    map.iter()
        .map(|(k, n)| format!("{k}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl Report for InspectReport {
    fn text(&self) -> String {
        let mut out = format!(
            "{}: {} dead letters, {} distinct original messages, {} copies",
            self.topic, self.records, self.distinct, self.copies
        );
        if self.without_headers > 0 {
            out.push_str(&format!(", {} without dedup headers", self.without_headers));
        }
        if self.malformed > 0 {
            out.push_str(&format!(
                ", {} with malformed dedup headers",
                self.malformed
            ));
        }
        out.push('\n');
        if let (Some(first), Some(last)) = (self.first, self.last) {
            out.push_str(&format!(
                "  from {} to {}\n",
                rfc3339_millis(first),
                rfc3339_millis(last)
            ));
        }
        out.push_str(&format!("  by kind:      {}\n", counts(&self.by_kind)));
        out.push_str(&format!("  by original:  {}\n", counts(&self.by_origin)));
        out.push_str(&format!("  by handler:   {}\n", counts(&self.by_handler)));
        for record in &self.shown {
            out.push_str(&format!("\n{:#}\n", record));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "topic": self.topic,
            "records": self.records,
            "distinct": self.distinct,
            "copies": self.copies,
            "without_headers": self.without_headers,
            "malformed": self.malformed,
            "first": self.first.map(rfc3339_millis),
            "last": self.last.map(rfc3339_millis),
            "by_kind": self.by_kind,
            "by_original": self.by_origin,
            "by_handler": self.by_handler,
            "shown": self.shown,
        })
    }
}

mod replay;
mod select;

pub(crate) use replay::{committed_offsets, replay};
pub(crate) use select::{Pinned, ReplayArgs, Selection, event_id, parse_key};
