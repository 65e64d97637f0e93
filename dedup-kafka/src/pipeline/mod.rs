//! What both runtimes share on a message's path, whatever commits it: the
//! Kafka-only runtime (`transactional/`) and the database runtime
//! (`database/`) call these, so a panic, a hang, an unclassified error or
//! an outage means the same thing in both.
//!
//! - [`attempt`]: runs user code where a panic or a hang is contained.
//! - [`attempts`]: one event's attempts driven to an end: done, wait and
//!   try again, give up (a retry tier, the dead letters) or stop.
//! - [`decision`]: whose fault a failure is, and what follows (retry, wait
//!   out, dead-letter, stop): a pure function, table-tested.
//! - [`outage`]: an event's retries: the decision applied, and its wait
//!   out of an outage as health sees it.
//! - [`ingest`]: how a batch is gathered (linger only when idle).
//! - [`keyed`]: key-ordered concurrency: which events may start (by their
//!   ordering key, and in the Kafka-only runtime their claim too), and the
//!   offset below which all are finished.
//! - [`membership`]: the rebalance context: what a member owns, its count,
//!   its lag, the rebalance counters, each callback contained.
//! - [`outcome`]: what became of a message, in the counters and the metrics
//!   at once.

pub(crate) mod attempt;
pub(crate) mod attempts;
pub(crate) mod decision;
pub(crate) mod ingest;
pub(crate) mod keyed;
pub(crate) mod membership;
pub(crate) mod outage;
pub(crate) mod outcome;

use rdkafka::message::{Headers as _, Message as _, OwnedMessage};

/// The fatal error of the Kafka client `name`, if it had one: it cannot be
/// used any more (librdkafka says so once; retrying cannot help), so what
/// runs it stops instead of hanging.
pub(crate) fn fatal_error<C: rdkafka::ClientContext>(
    name: &str,
    client: &rdkafka::client::Client<C>,
) -> Option<crate::Error> {
    let (code, reason) = client.fatal_error()?;
    Some(crate::Error::Fatal(format!(
        "fatal error of the {name}: {reason} ({code:?})"
    )))
}

/// A record's headers, read in place as dedup-core reads headers (the
/// last value of a repeated one).
pub(crate) struct KafkaHeaders<'a>(pub(crate) Option<&'a rdkafka::message::OwnedHeaders>);

impl dedup_core::Headers for KafkaHeaders<'_> {
    fn get(&self, name: &str) -> Option<&[u8]> {
        use rdkafka::message::Headers as _;
        self.0?.iter().filter(|h| h.key == name).last()?.value
    }
}

/// A message's record, owned, for the handler: its headers (keys may come
/// from them) and the rest of its metadata (handlers may take `&Meta`).
pub(crate) fn meta_of(msg: &OwnedMessage) -> dedup_core::Meta {
    let mut meta = dedup_core::Meta::new(msg.topic(), msg.partition(), msg.offset());
    if let Some(millis) = msg.timestamp().to_millis() {
        meta = meta.with_timestamp_millis(millis);
    }
    if let Some(key) = msg.key() {
        meta = meta.with_key(key);
    }
    if let Some(headers) = msg.headers() {
        for h in headers.iter() {
            meta = meta.with_header(h.key, h.value.unwrap_or_default());
        }
    }
    meta
}

/// The error and its sources, `: `-separated.
pub(crate) fn error_chain(e: &dedup_core::Error) -> String {
    let mut out = e.to_string();
    for source in std::iter::successors(std::error::Error::source(e), |&s| s.source()) {
        let s = source.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
    }
    out
}
