//! A handler's TTL against how long its topic keeps records: a replay from
//! the earliest offset (a group reset, a new group id, a restore) delivers
//! every record still in the topic, and those older than the TTL have lost
//! their claims, so they are applied again.

use crate::oauth::TokenContext;
use std::collections::HashMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};

/// What the consumer does at start-up when a handler's TTL is shorter than
/// how long its topic keeps records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TtlCheck {
    /// Log a warning with both numbers and the consequence (the default).
    #[default]
    Warn,
    /// Refuse to start: `run` returns `Error::Config`.
    Strict,
    /// Do not check (for those who never replay from the earliest offset,
    /// or whose brokers do not allow describing topic configs).
    Off,
}

/// How long a topic keeps its records, from its configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicRetention {
    /// `retention.ms`; `None` for -1 (for ever).
    pub retention: Option<Duration>,
    /// `segment.ms`: Kafka deletes whole segments, so a record stays
    /// readable up to this much past its retention.
    pub segment: Duration,
    /// `cleanup.policy` is `compact` (without `delete`): a key's latest
    /// record is kept for ever.
    pub compacted: bool,
}

impl TopicRetention {
    /// How long a record may stay readable (`None`: for ever).
    pub fn readable_for(&self) -> Option<Duration> {
        if self.compacted {
            return None;
        }
        self.retention.map(|r| r + self.segment)
    }

    /// Whether a TTL covers every record a replay from the earliest offset
    /// could deliver.
    pub fn covered_by(&self, ttl: Duration) -> bool {
        self.readable_for().is_some_and(|kept| kept <= ttl)
    }

    /// How long records are kept, in words, for messages.
    pub fn describe(&self) -> String {
        match (self.compacted, self.readable_for()) {
            (true, _) => "for ever (a compacted topic keeps each key's latest record)".to_owned(),
            (false, None) => "for ever (retention.ms = -1)".to_owned(),
            (false, Some(kept)) => format!(
                "up to {} (retention.ms {} plus segment.ms {}: Kafka deletes whole segments)",
                words(kept),
                words(self.retention.unwrap_or_default()),
                words(self.segment)
            ),
        }
    }
}

/// A duration as a TTL is written (`8d`, `1h30m`), to the second.
fn words(d: Duration) -> String {
    dedup_core::Ttl::from_secs(d.as_secs()).map_or_else(|| format!("{d:?}"), |t| t.to_string())
}

/// How long the start-up TTL check waits for the brokers.
const TTL_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// A handler whose TTL is checked against its topic.
pub(crate) struct Checked<'a> {
    pub(crate) topic: &'a str,
    pub(crate) scope: &'a str,
    pub(crate) ttl: dedup_core::Ttl,
}

/// The start-up check of both runtimes: each handler's TTL against how long
/// its topic keeps records, as `mode` says. Whatever the mode, the gauges
/// `dedup_ttl_seconds{topic, handler}` and, once read,
/// `dedup_topic_readable_seconds{topic}` (`+Inf`: for ever) are set, so an
/// alert can compare them.
pub(crate) async fn check(
    mode: TtlCheck,
    admin: &rdkafka::ClientConfig,
    handlers: &[Checked<'_>],
) -> Result<(), crate::Error> {
    for h in handlers {
        metrics::gauge!("dedup_ttl_seconds", "topic" => h.topic.to_owned(), "handler" => h.scope.to_owned())
            .set(h.ttl.as_duration().as_secs_f64());
    }
    let strict = match mode {
        TtlCheck::Off => return Ok(()),
        TtlCheck::Warn => false,
        TtlCheck::Strict => true,
    };
    let mut topics: Vec<&str> = handlers.iter().map(|h| h.topic).collect();
    topics.sort_unstable();
    topics.dedup();
    // rdkafka's admin client is never polled for a token refresh, so it
    // cannot take tokens from a provider: said at once, not after a timeout.
    let retention = if crate::oauth::from_provider(admin) {
        Err(
            "its admin client cannot take OAUTHBEARER tokens from a token provider (rdkafka \
             gives no way to hand them over)"
                .to_owned(),
        )
    } else {
        topic_retention(admin, &topics, TTL_CHECK_TIMEOUT).await
    };
    let retention = match retention {
        Ok(retention) => retention,
        Err(why) if strict => {
            return Err(crate::Error::Config(format!(
                "cannot check the TTLs against the topics' retention ({why}); \
                 .ttl_check(TtlCheck::Off) starts without checking"
            )));
        }
        Err(why) => {
            tracing::warn!(error = %why, "cannot check the TTLs against the topics' retention");
            return Ok(());
        }
    };
    for (topic, kept) in &retention {
        metrics::gauge!("dedup_topic_readable_seconds", "topic" => topic.clone()).set(
            kept.readable_for()
                .map_or(f64::INFINITY, |d| d.as_secs_f64()),
        );
    }
    for h in handlers {
        let Some(kept) = retention.get(h.topic) else {
            continue;
        };
        if kept.covered_by(h.ttl.as_duration()) {
            continue;
        }
        let why = format!(
            "the TTL of handler {} ({}) is shorter than topic {:?} keeps records ({}): a replay \
             from the earliest offset (a group reset, a new group id, a restore) would apply \
             again every event older than the TTL. Raise the TTL, or never replay this topic \
             from its start",
            h.scope,
            h.ttl,
            h.topic,
            kept.describe()
        );
        if strict {
            return Err(crate::Error::Config(why));
        }
        tracing::warn!(topic = h.topic, handler = h.scope, "{why}");
    }
    Ok(())
}

/// Reads the retention of each of `topics` with an admin client made from
/// `config`.
pub async fn topic_retention(
    config: &rdkafka::ClientConfig,
    topics: &[&str],
    timeout: Duration,
) -> Result<HashMap<String, TopicRetention>, String> {
    let admin: AdminClient<TokenContext> = config
        .create_with_context(TokenContext)
        .map_err(|e| crate::redacted(&e))?;
    let specifiers: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let options = AdminOptions::new().request_timeout(Some(timeout));
    let results = admin
        .describe_configs(&specifiers, &options)
        .await
        .map_err(|e| e.to_string())?;
    let mut out = HashMap::new();
    for (topic, result) in topics.iter().zip(results) {
        let resource = result.map_err(|e| format!("topic {topic:?}: {e:?}"))?;
        let value = |name: &str| resource.get(name).and_then(|entry| entry.value.clone());
        let retention_ms: i64 = value("retention.ms")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("topic {topic:?} has no readable retention.ms"))?;
        let segment_ms: u64 = value("segment.ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(604_800_000);
        out.insert(
            (*topic).to_owned(),
            TopicRetention {
                retention: u64::try_from(retention_ms).ok().map(Duration::from_millis),
                segment: Duration::from_millis(segment_ms),
                // `compact,delete` still deletes by retention.
                compacted: value("cleanup.policy")
                    .is_some_and(|p| p.contains("compact") && !p.contains("delete")),
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn a_ttl_covers_retention_plus_a_segment() {
        let topic = TopicRetention {
            retention: Some(HOUR),
            segment: HOUR / 6,
            compacted: false,
        };
        assert_eq!(topic.readable_for(), Some(HOUR + HOUR / 6));
        assert!(topic.covered_by(2 * HOUR));
        assert!(
            !topic.covered_by(HOUR),
            "the segment outlives the retention"
        );
        let forever = TopicRetention {
            retention: None,
            ..topic
        };
        assert!(!forever.covered_by(Duration::from_secs(3_153_600_000)));
        let compacted = TopicRetention {
            compacted: true,
            ..topic
        };
        assert!(!compacted.covered_by(100 * HOUR));
    }
}
