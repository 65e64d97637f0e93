//! `dedup outbox pending`: the relay's backlog.

use serde_json::json;

use crate::claims::{connect, existing};
use crate::time::human_seconds;
use crate::{Failure, Report};

#[derive(Debug, sqlx::FromRow)]
struct TopicBacklog {
    topic: String,
    pending: i64,
    /// Seconds the oldest pending event has waited, on the database clock.
    oldest_age: f64,
    /// Pending events backing off after a failed publish.
    failing: i64,
    /// Pending events a relay holds now (being published).
    leased: i64,
    /// Pending events whose lease expired unfinished (their relay stopped
    /// or died): the next relay to look publishes them again.
    lease_expired: i64,
    last_error: Option<String>,
}

/// The pending events of the outbox `table`, per topic.
pub(crate) async fn pending(url: &str, table: &str) -> Result<PendingReport, Failure> {
    let pool = connect(url).await?;
    let name = existing(&pool, table, "outbox").await?;
    let query = format!(
        "SELECT topic, count(*)::int8 AS pending, \
         extract(epoch FROM now() - min(enqueued_at))::float8 AS oldest_age, \
         count(*) FILTER (WHERE attempts > 0)::int8 AS failing, \
         count(*) FILTER (WHERE leased_until > now())::int8 AS leased, \
         count(*) FILTER (WHERE leased_until <= now())::int8 AS lease_expired, \
         (array_agg(last_error ORDER BY seq DESC) FILTER (WHERE last_error IS NOT NULL))[1] AS last_error \
         FROM {} WHERE sent_at IS NULL GROUP BY topic ORDER BY topic",
        name.quoted()
    );
    let topics = sqlx::query_as::<_, TopicBacklog>(sqlx::AssertSqlSafe(query))
        .fetch_all(&pool)
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
    topics: Vec<TopicBacklog>,
}

impl Report for PendingReport {
    fn text(&self) -> String {
        if self.topics.is_empty() {
            return format!("{}: nothing pending\n", self.table);
        }
        let total: i64 = self.topics.iter().map(|t| t.pending).sum();
        let mut out = format!("{}: {total} events pending\n", self.table);
        for t in &self.topics {
            out.push_str(&format!(
                "  {}: {} pending, oldest waiting {}",
                t.topic,
                t.pending,
                human_seconds(t.oldest_age)
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
            "pending": self.topics.iter().map(|t| t.pending).sum::<i64>(),
            "topics": self.topics.iter().map(|t| json!({
                "topic": t.topic,
                "pending": t.pending,
                "oldest_age_seconds": t.oldest_age,
                "failing": t.failing,
                "leased": t.leased,
                "lease_expired": t.lease_expired,
                "last_error": t.last_error,
            })).collect::<Vec<_>>(),
        })
    }
}
