//! `dedup outbox pending`: the relay's backlog, on any store.

use serde_json::json;

use dedup_core::admin::TopicBacklog;

use crate::store::Outbox;
use crate::time::human_seconds;
use crate::{Failure, Report};

/// The pending events of the outbox `table` of the database at `url`, per
/// topic.
pub(crate) async fn pending(url: &str, table: &str) -> Result<PendingReport, Failure> {
    let topics = Outbox::open(url, table)
        .await?
        .backlog_by_topic()
        .await
        .map_err(|e| Failure::new(format!("reading the outbox: {e}")))?;
    Ok(PendingReport {
        table: table.to_owned(),
        topics,
    })
}

/// `outbox pending`.
pub(crate) struct PendingReport {
    table: String,
    pub(crate) topics: Vec<TopicBacklog>,
}

impl Report for PendingReport {
    fn text(&self) -> String {
        if self.topics.is_empty() {
            return format!("{}: nothing pending\n", self.table);
        }
        let total: u64 = self.topics.iter().map(|t| t.pending).sum();
        let mut out = format!("{}: {total} events pending\n", self.table);
        for t in &self.topics {
            out.push_str(&format!(
                "  {}: {} pending, oldest waiting {}",
                t.topic,
                t.pending,
                human_seconds(t.oldest_age.as_secs_f64())
            ));
            if t.leased > 0 {
                out.push_str(&format!(", {} being published (leased)", t.leased));
            }
            if t.lease_expired > 0 {
                out.push_str(&format!(
                    ", {} left by a relay that stopped (lease expired; published again next)",
                    t.lease_expired
                ));
            }
            if t.failing > 0 {
                out.push_str(&format!(
                    ", {} failing (last error: {})",
                    t.failing,
                    t.last_error.as_deref().unwrap_or("-")
                ));
            }
            out.push('\n');
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "table": self.table,
            "pending": self.topics.iter().map(|t| t.pending).sum::<u64>(),
            "topics": self.topics.iter().map(|t| json!({
                "topic": t.topic,
                "pending": t.pending,
                "oldest_age_seconds": t.oldest_age.as_secs_f64(),
                "failing": t.failing,
                "leased": t.leased,
                "lease_expired": t.lease_expired,
                "last_error": t.last_error,
            })).collect::<Vec<_>>(),
        })
    }
}
