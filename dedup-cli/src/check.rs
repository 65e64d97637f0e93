//! `dedup check`: a handler's TTL against how long its topic keeps records
//! (the runtime's start-up check, on demand).

use dedup_core::Ttl;
use dedup_kafka::TopicRetention;
use serde_json::json;

use crate::kafka::{TIMEOUT, config};
use crate::time::human_seconds;
use crate::{Failure, KafkaArgs, Report};

/// Reads `topic`'s retention and compares it with `ttl`.
pub(crate) async fn check(
    kafka: &KafkaArgs,
    topic: &str,
    ttl: Ttl,
) -> Result<CheckReport, Failure> {
    let mut retention = dedup_kafka::topic_retention(&config(kafka)?, &[topic], TIMEOUT)
        .await
        .map_err(|why| {
            Failure::new(format!(
                "cannot read the configuration of topic {topic:?} ({why}): does it exist? check \
                 the name and --brokers"
            ))
        })?;
    let kept = retention
        .remove(topic)
        .ok_or_else(|| Failure::new("the brokers returned no configuration"))?;
    Ok(CheckReport {
        topic: topic.to_owned(),
        ttl,
        kept,
    })
}

/// `check`.
pub(crate) struct CheckReport {
    topic: String,
    ttl: Ttl,
    kept: TopicRetention,
}

impl CheckReport {
    fn covered(&self) -> bool {
        self.kept.covered_by(self.ttl.as_duration())
    }

    fn verdict(&self) -> String {
        let ttl = human_seconds(self.ttl.as_duration().as_secs_f64());
        let kept = match self.kept.readable_for() {
            Some(k) if !self.kept.compacted => format!(
                "up to {} (retention.ms plus segment.ms: Kafka deletes whole segments)",
                human_seconds(k.as_secs_f64())
            ),
            _ => self.kept.describe(),
        };
        if self.covered() {
            return format!(
                "ok: records stay readable {kept}, no longer than the TTL ({ttl}), so a replay \
                 from the earliest offset (a reset group, a new group) skips every event \
                 already applied"
            );
        }
        format!(
            "warning: records stay readable {kept}, longer than the TTL ({ttl}): a replay from \
             the earliest offset would apply again every event older than the TTL, whose claim \
             has expired. Raise the TTL, or never reset this topic's groups to earliest (a new \
             group: auto.offset.reset=latest)"
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
            "retention_ms": self.kept.retention.map(|r| r.as_millis() as u64),
            "segment_ms": self.kept.segment.as_millis() as u64,
            "compacted": self.kept.compacted,
            "replay_from_earliest_is_deduplicated": self.covered(),
            "verdict": self.verdict(),
        })
    }
}

/// Several checks' reports, one after the other (`json`: an array, or the
/// one report alone).
pub(crate) struct Reports(pub(crate) Vec<Box<dyn Report>>);

impl Report for Reports {
    fn text(&self) -> String {
        self.0.iter().map(|r| r.text()).collect()
    }

    fn json(&self) -> serde_json::Value {
        match self.0.as_slice() {
            [one] => one.json(),
            all => serde_json::Value::Array(all.iter().map(|r| r.json()).collect()),
        }
    }
}
