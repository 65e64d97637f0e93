//! The rebalance context, one for both runtimes: what this member owns,
//! as the rebalance callbacks say, with health's count of it, the
//! assignment and revoke counters and the `dedup_consumer_lag` gauge kept
//! the same way in both; each callback contained, so a panic never unwinds
//! through librdkafka. What a revoke or an assignment does beyond that is
//! the runtime's: the database runtime hands its revoked partitions' batches
//! over and commits (its `HandOver`, an [`OnRebalance`] of its own); the
//! Kafka-only one queues the change for its loop, which never polls while
//! a transaction is open without its offsets.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::{ClientContext, TopicPartitionList};

use crate::stats::Stats;

/// What a runtime does on a rebalance, beyond the bookkeeping every
/// runtime shares. Called inside the consumer's poll, contained.
pub(crate) trait OnRebalance: Send + Sync + Sized + 'static {
    /// Before partitions go (`consumer.assignment_lost()` says whether
    /// they may be another member's already).
    fn revoking(&self, consumer: &BaseConsumer<Membership<Self>>, list: &TopicPartitionList);

    /// Once partitions were assigned.
    fn assigned(&self, consumer: &BaseConsumer<Membership<Self>>, list: &TopicPartitionList);
}

/// The partitions owned, by (topic, partition), each with the offset this
/// member committed last where the runtime commits itself (the Kafka-only
/// runtime commits through its transactions, which librdkafka's lag does
/// not see).
type Owned = HashMap<(String, i32), Option<i64>>;

/// The consumer's context: ownership kept the same way in both runtimes,
/// and the runtime's own rebalance actions (`R`), reached through `Deref`.
pub(crate) struct Membership<R> {
    stats: Arc<Stats>,
    owned: Mutex<Owned>,
    /// Set once the runtime is done with the consumer (its last commit is
    /// made): the revoke that closing it triggers is not counted, and the
    /// runtime's own actions may skip what a closing member must not do.
    closing: AtomicBool,
    runtime: R,
}

impl<R: OnRebalance> Membership<R> {
    pub(crate) fn new(stats: Arc<Stats>, runtime: R) -> Self {
        Membership {
            stats,
            owned: Mutex::default(),
            closing: AtomicBool::new(false),
            runtime,
        }
    }

    /// The runtime is done with the consumer: what closing it revokes is
    /// not a rebalance.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    fn owned(&self) -> MutexGuard<'_, Owned> {
        self.owned.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The offsets a transaction committed, for the lag.
    pub(crate) fn committed(&self, offsets: &TopicPartitionList) {
        for e in offsets.elements() {
            if let rdkafka::Offset::Offset(o) = e.offset() {
                self.committed_at(e.topic(), e.partition(), o);
            }
        }
    }

    /// The offset `partition` of `topic` committed last (if it is still
    /// owned), for the lag.
    pub(crate) fn committed_at(&self, topic: &str, partition: i32, offset: i64) {
        if let Some(at) = self.owned().get_mut(&(topic.to_owned(), partition)) {
            *at = Some(offset);
        }
    }

    fn revoke(&self, consumer: &BaseConsumer<Self>, list: &TopicPartitionList) {
        let counted = !self.is_closing();
        tracing::info!(partitions = %listed(list), "partitions revoked");
        // Contained on its own: whatever happens here, the runtime's own
        // actions below run.
        contained("revoke bookkeeping", || {
            let mut owned = self.owned();
            for e in list.elements() {
                owned.remove(&(e.topic().to_owned(), e.partition()));
                // Not this member's to report any more: the next owner's.
                crate::metrics::consumer_lag(e.topic(), e.partition(), 0);
            }
            self.count(owned.len());
            drop(owned);
            if counted {
                self.stats
                    .revoked_partitions
                    .fetch_add(list.count() as u64, Ordering::Relaxed);
            }
        });
        self.runtime.revoking(consumer, list);
    }

    fn assign(&self, consumer: &BaseConsumer<Self>, list: &TopicPartitionList) {
        tracing::info!(partitions = %listed(list), "partitions assigned");
        {
            let mut owned = self.owned();
            for e in list.elements() {
                owned
                    .entry((e.topic().to_owned(), e.partition()))
                    .or_insert(None);
            }
            self.count(owned.len());
        }
        // Idleness counts from having partitions, not from start-up.
        self.stats.touch();
        self.stats.assignments.fetch_add(1, Ordering::Relaxed);
        self.runtime.assigned(consumer, list);
    }

    /// Records the partitions owned now, for health.
    fn count(&self, owned: usize) {
        self.stats
            .health
            .assigned
            .store(owned as u64, Ordering::Release);
    }
}

impl<R> Deref for Membership<R> {
    type Target = R;

    fn deref(&self) -> &R {
        &self.runtime
    }
}

/// A partition's lag in librdkafka's statistics: from the end of its
/// committed log (its last stable offset, else its high watermark) back to
/// the offset this member committed last, where the runtime commits itself;
/// otherwise librdkafka's own, behind the stored offset (what finished:
/// current) or else behind the committed one (for the Kafka-only runtime,
/// until its first transaction of the partition: the offset it was
/// assigned at). `None`: not known yet.
fn lag(p: &rdkafka::statistics::Partition, committed: Option<i64>) -> Option<i64> {
    lag_of(
        [p.ls_offset, p.hi_offset],
        [p.consumer_lag_stored, p.consumer_lag],
        committed,
    )
}

/// [`lag`] on the figures it reads: the log's `[last stable offset, high
/// watermark]` and librdkafka's `[stored lag, committed lag]` (-1: unknown).
fn lag_of(end: [i64; 2], librdkafka: [i64; 2], committed: Option<i64>) -> Option<i64> {
    let lag = match committed {
        Some(committed) => {
            let end = end.into_iter().find(|&o| o >= 0)?;
            (end - committed).max(0)
        }
        None => librdkafka.into_iter().find(|&l| l >= 0)?,
    };
    Some(lag)
}

impl<R: OnRebalance> ClientContext for Membership<R> {
    crate::oauth::tokens_from_the_provider!();

    /// librdkafka's statistics (every `statistics.interval.ms`): the lag of
    /// each owned partition, as the `dedup_consumer_lag` gauge. Only owned
    /// ones: a report can still list a partition being revoked.
    fn stats(&self, statistics: rdkafka::Statistics) {
        contained("stats", || {
            let owned = self.owned();
            for (name, topic) in &statistics.topics {
                for (&id, partition) in &topic.partitions {
                    // `desired`: assigned to this member (-1 is librdkafka's
                    // internal partition).
                    let Some(&committed) = owned.get(&(name.clone(), id)) else {
                        continue;
                    };
                    if partition.desired
                        && let Some(lag) = lag(partition, committed)
                    {
                        crate::metrics::consumer_lag(name, id, lag);
                    }
                }
            }
        });
    }
}

/// The callbacks run inside librdkafka (on the thread polling the
/// consumer). A panic must not unwind through it: it leaves the consumer in
/// a state where closing it never completes. So each one is contained.
impl<R: OnRebalance> ConsumerContext for Membership<R> {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        contained("pre_rebalance", || match rebalance {
            Rebalance::Revoke(list) => self.revoke(consumer, list),
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        });
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        contained("post_rebalance", || {
            if let Rebalance::Assign(list) = rebalance {
                self.assign(consumer, list);
            }
        });
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        contained("commit_callback", || match result {
            Ok(()) => tracing::debug!(partitions = offsets.count(), "offsets committed"),
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "offset commit failed; the next commit retries it")
            }
        });
    }
}

/// Resumes every assigned partition but those `held` (by topic and
/// partition), for both runtimes, now and then, from the loop that pauses
/// (never beside a pause). librdkafka versions each partition's pause and
/// resume requests and drops one that reaches the partition after a newer
/// one, while the call still returns Ok; its own thread makes such
/// requests around an assignment (a fetch started, a rebalance's own pause
/// and resume), so a resume of ours can be lost, and nothing would resume
/// the partition again: its lag grows while the others flow. A partition
/// not paused is left as it is.
pub(crate) fn resume_assigned<C: ConsumerContext>(
    consumer: &impl Consumer<C>,
    held: impl Fn(&str, i32) -> bool,
) {
    let Ok(assigned) = consumer.assignment() else {
        return;
    };
    let mut running = TopicPartitionList::new();
    for e in assigned.elements() {
        if !held(e.topic(), e.partition()) {
            running.add_partition(e.topic(), e.partition());
        }
    }
    if running.count() > 0
        && let Err(e) = consumer.resume(&running)
    {
        tracing::debug!(error = %e, "resuming the partitions that run");
    }
}

/// Runs `f`; a panic in it is logged, not unwound.
pub(crate) fn contained(callback: &str, f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        // Logging may be what panicked; stay silent beyond one attempt.
        let _ =
            std::panic::catch_unwind(|| tracing::error!(callback, "a consumer callback panicked"));
    }
}

/// `topic[0,1,2] other[0]`: a partition list for a log line.
fn listed(list: &TopicPartitionList) -> String {
    let mut by_topic: std::collections::BTreeMap<String, Vec<i32>> = Default::default();
    for e in list.elements() {
        by_topic
            .entry(e.topic().to_owned())
            .or_default()
            .push(e.partition());
    }
    by_topic
        .into_iter()
        .map(|(topic, mut partitions)| {
            partitions.sort_unstable();
            let partitions: Vec<String> = partitions.iter().map(i32::to_string).collect();
            format!("{topic}[{}]", partitions.join(","))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both runtimes report the lag of what they own by one rule: from
    /// their own committed offset where they commit it themselves (the
    /// Kafka-only runtime, through its transactions, which librdkafka's
    /// figures do not see), else librdkafka's, the stored offset's first.
    #[test]
    fn lag_counts_from_the_members_own_commit_or_else_librdkafkas() {
        // Committed by the member: to the last stable offset (records of
        // an open transaction are not readable yet), or the high watermark.
        assert_eq!(lag_of([90, 100], [-1, -1], Some(40)), Some(50));
        assert_eq!(lag_of([-1, 100], [-1, -1], Some(40)), Some(60));
        assert_eq!(
            lag_of([30, 100], [-1, -1], Some(40)),
            Some(0),
            "never negative"
        );
        assert_eq!(lag_of([-1, -1], [5, 7], Some(40)), None, "no end known yet");
        // Not committed by the member: librdkafka's.
        assert_eq!(lag_of([90, 100], [5, 7], None), Some(5));
        assert_eq!(lag_of([90, 100], [-1, 7], None), Some(7));
        assert_eq!(lag_of([90, 100], [-1, -1], None), None);
    }
}
