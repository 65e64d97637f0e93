//! `dedup check`: a handler's TTL against its topic's retention.

use std::time::Duration;

use dedup_core::Ttl;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use serde_json::json;

use crate::kafka::{self, TIMEOUT, config, unreachable_brokers};
use crate::time::human_seconds;
use crate::{Failure, KafkaArgs, Report};

/// Reads `topic`'s retention and compares it with `ttl`.
pub(crate) async fn check(
    kafka: &KafkaArgs,
    topic: &str,
    ttl: Ttl,
) -> Result<CheckReport, Failure> {
    let admin: AdminClient<DefaultClientContext> = config(kafka)?
        .create()
        .map_err(|e| kafka::refused("admin client", &e))?;
    let options = AdminOptions::new().request_timeout(Some(TIMEOUT));
    let results = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &options)
        .await
        .map_err(|e| unreachable_brokers(&e))?;
    let resource = results
        .into_iter()
        .next()
        .ok_or_else(|| Failure::new("the brokers returned no configuration"))?
        .map_err(|e| {
            Failure::new(format!(
                "topic {topic:?}: {e:?} (does it exist? check the name and --brokers)"
            ))
        })?;
    let value = |name: &str| resource.get(name).and_then(|entry| entry.value.clone());
    let retention_ms: i64 = value("retention.ms")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Failure::new(format!("topic {topic:?} has no readable retention.ms")))?;
    let compacted = value("cleanup.policy").is_some_and(|p| p.contains("compact"));
    // Kafka deletes whole segments: a record outlives retention.ms by up to
    // the age of the segment it is in (segment.ms, a week by default).
    let segment_ms: u64 = value("segment.ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(604_800_000);
    let retention = u64::try_from(retention_ms).ok().map(Duration::from_millis);
    Ok(CheckReport {
        topic: topic.to_owned(),
        ttl,
        retention,
        segment: Duration::from_millis(segment_ms),
        compacted,
    })
}

/// `check`.
pub(crate) struct CheckReport {
    topic: String,
    ttl: Ttl,
    /// `None`: kept for ever (`retention.ms = -1`).
    retention: Option<Duration>,
    /// How long a segment stays open (`segment.ms`).
    segment: Duration,
    compacted: bool,
}

impl CheckReport {
    /// How long a record may stay readable: its retention plus the age of
    /// the segment it is in (`None`: for ever).
    fn kept_for(&self) -> Option<Duration> {
        if self.compacted {
            return None;
        }
        self.retention.map(|r| r + self.segment)
    }

    /// Whether every record a replay from the earliest offset could deliver
    /// is younger than the TTL, so each one already applied is skipped.
    fn covered(&self) -> bool {
        self.kept_for().is_some_and(|k| k <= self.ttl.as_duration())
    }

    fn verdict(&self) -> String {
        let ttl = human_seconds(self.ttl.as_duration().as_secs_f64());
        if self.covered() {
            return format!(
                "ok: records stay readable at most as long as the TTL ({ttl}; retention.ms \
                 plus segment.ms), so a replay from the earliest offset (a reset group, a new \
                 group) skips every event already applied"
            );
        }
        let kept = match (self.compacted, self.kept_for()) {
            (true, _) => "a compacted topic keeps a key's latest record for ever".to_owned(),
            (false, None) => "records are kept for ever (retention.ms = -1)".to_owned(),
            (false, Some(k)) => format!(
                "records stay readable up to {} (retention.ms plus segment.ms: Kafka deletes \
                 whole segments)",
                human_seconds(k.as_secs_f64())
            ),
        };
        format!(
            "warning: {kept}, longer than the TTL ({ttl}): a replay from the earliest offset \
             would apply again every event older than the TTL, whose claim has expired. \
             Raise the TTL to the retention, or never reset this topic's groups to earliest \
             (a new group: auto.offset.reset=latest)"
        )
    }
}

impl Report for CheckReport {
    fn text(&self) -> String {
        format!("{}: {}\n", self.topic, self.verdict())
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "topic": self.topic,
            "ttl_seconds": self.ttl.as_duration().as_secs(),
            "retention_ms": self.retention.map(|r| r.as_millis() as u64),
            "segment_ms": self.segment.as_millis() as u64,
            "compacted": self.compacted,
            "replay_from_earliest_is_deduplicated": self.covered(),
            "verdict": self.verdict(),
        })
    }
}
