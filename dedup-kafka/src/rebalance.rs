//! The rebalance callbacks: stop the workers of revoked partitions and commit
//! what they finished, resume newly assigned partitions.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::{ClientContext, TopicPartitionList};

use crate::partition::state::{Partition, PartitionMap, lock};
use crate::stats::Stats;

/// Rebalance callbacks: they run inside the consumer's poll, on the task
/// that receives messages.
pub(crate) struct RebalanceContext {
    pub(crate) partitions: PartitionMap,
    pub(crate) stats: Arc<Stats>,
    /// Set once shutdown has made its final commit: the revoke that closing
    /// the consumer triggers must not commit again (a synchronous commit from
    /// inside close can wait forever on a group that is leaving).
    pub(crate) closing: Arc<AtomicBool>,
    /// The partitions this member owns, as the rebalance callbacks say:
    /// only their lag is reported (a statistics report can still list a
    /// partition being revoked).
    pub(crate) owned: std::sync::Mutex<std::collections::HashSet<(String, i32)>>,
    /// How long a revoke waits for the revoked partitions' batches in flight.
    pub(crate) revoke_timeout: Duration,
}

impl RebalanceContext {
    fn owned(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<(String, i32)>> {
        self.owned.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the partitions owned now, for health.
    fn count_owned(&self, owned: usize) {
        self.stats
            .health
            .assigned
            .store(owned as u64, Ordering::Release);
    }
}

impl RebalanceContext {
    /// Waits, up to the revoke timeout, for the workers of `leaving` to
    /// finish their batches in flight and end. This runs inside the
    /// consumer's poll, on the task of the consumer loop: on a multi-thread
    /// Tokio runtime the wait hands this thread's other tasks to another
    /// thread (`block_in_place`), so the workers, wherever they run, go on.
    /// On a current-thread runtime they could not: no wait.
    fn hand_over(&self, leaving: &[Arc<Partition>]) {
        if leaving.is_empty() || self.revoke_timeout.is_zero() {
            return;
        }
        let limit = self.revoke_timeout;
        let wait = || {
            let started = Instant::now();
            loop {
                let left = leaving
                    .iter()
                    .filter(|p| !p.exited.load(Ordering::Acquire))
                    .count();
                if left == 0 {
                    tracing::debug!(waited = ?started.elapsed(), "revoked partitions handed over");
                    return;
                }
                if started.elapsed() >= limit {
                    tracing::warn!(
                        partitions = left,
                        revoke_timeout = ?limit,
                        "revoked partitions still had batches in flight; abandoned (if they \
                         commit, the next owner skips them as duplicates)"
                    );
                    return;
                }
                std::thread::sleep(HAND_OVER_POLL);
            }
        };
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(wait),
            Ok(_) => tracing::debug!(
                "a current-thread runtime: the revoke cannot wait for batches in flight"
            ),
            // Not on a runtime thread: the workers run elsewhere.
            Err(_) => wait(),
        }
    }
}

/// How often a revoke looks whether the revoked partitions' workers ended.
const HAND_OVER_POLL: Duration = Duration::from_millis(2);

impl ClientContext for RebalanceContext {
    /// librdkafka's statistics (every `statistics.interval.ms`): the lag of
    /// each assigned partition, as the `dedup_consumer_lag` gauge.
    fn stats(&self, statistics: rdkafka::Statistics) {
        contained("stats", || {
            let owned = self.owned();
            for (name, topic) in &statistics.topics {
                for (&id, partition) in &topic.partitions {
                    // `desired`: assigned to this member (-1 is librdkafka's
                    // internal partition). The lag behind the stored offset
                    // (what finished) is current; behind the committed one
                    // it trails by the commit interval. -1: not known yet.
                    let lag = if partition.consumer_lag_stored >= 0 {
                        partition.consumer_lag_stored
                    } else {
                        partition.consumer_lag
                    };
                    if partition.desired && lag >= 0 && owned.contains(&(name.clone(), id)) {
                        crate::metrics::consumer_lag(name, id, lag);
                    }
                }
            }
        });
    }
}

impl RebalanceContext {
    fn on_pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                // The revoked partitions' workers finish the batch they are
                // on and take no other; their offsets are stored as they
                // finish, and committed below, before the partitions go, so
                // the next owner receives none of it again. Past the revoke
                // timeout the rest is abandoned: a batch that commits after
                // that has its offsets uncommitted, and the next owner
                // receives it again and skips it as a duplicate.
                let started = Instant::now();
                let mut partitions = lock(&self.partitions);
                let mut leaving = Vec::new();
                for elem in tpl.elements() {
                    if let Some(p) = partitions.remove(&(elem.topic().to_owned(), elem.partition()))
                    {
                        p.release.send_replace(true);
                        leaving.push(p);
                    }
                    // Not this member's any more: its lag is the next owner's.
                    let mut owned = self.owned();
                    owned.remove(&(elem.topic().to_owned(), elem.partition()));
                    self.count_owned(owned.len());
                    drop(owned);
                    crate::metrics::consumer_lag(elem.topic(), elem.partition(), 0);
                }
                drop(partitions);
                // Closing: shutdown has already finished the workers and
                // made the final commit.
                let closing = self.closing.load(Ordering::Acquire);
                // Lost (the session expired, or the member was fenced): the
                // partitions may be another member's already, and a commit
                // would be refused. Abandoned at once, as after the timeout.
                let lost = consumer.assignment_lost();
                if !closing {
                    self.stats
                        .revoked_partitions
                        .fetch_add(tpl.count() as u64, Ordering::Relaxed);
                }
                if !closing && !lost {
                    // Contained on its own: whatever happens while waiting,
                    // the partitions are marked revoked and committed below.
                    contained("revoke wait", || self.hand_over(&leaving));
                }
                // From here no offset is stored for them.
                for p in &leaving {
                    p.revoked.send_replace(true);
                }
                let waited = started.elapsed();
                if !closing && !lost {
                    commit(consumer, CommitMode::Sync, "revoke");
                }
                tracing::info!(
                    partitions = tpl.count(),
                    lost,
                    closing,
                    ?waited,
                    took = ?started.elapsed(),
                    "partitions revoked"
                );
            }
            Rebalance::Assign(tpl) => {
                let mut owned = self.owned();
                owned.extend(
                    tpl.elements()
                        .iter()
                        .map(|e| (e.topic().to_owned(), e.partition())),
                );
                self.count_owned(owned.len());
                drop(owned);
                // Idleness counts from having partitions, not from start-up.
                self.stats.touch();
                self.stats.assignments.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    partitions = tpl.count(),
                    "partitions assigned; resuming from committed offsets"
                );
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }

    fn on_post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        // A partition paused for back-pressure and then revoked starts its
        // new assignment unpaused: its new worker has an empty buffer.
        if let Rebalance::Assign(tpl) = rebalance
            && let Err(e) = consumer.resume(tpl)
        {
            tracing::debug!(error = %e, "resuming newly assigned partitions");
        }
    }

    fn on_commit(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => tracing::debug!(partitions = offsets.count(), "offsets committed"),
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "offset commit failed; the next commit retries it")
            }
        }
    }
}

/// The callbacks run inside librdkafka (on the thread polling the
/// consumer). A panic must not unwind through it: it leaves the consumer in a
/// state where closing it never completes. So each one is contained.
impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        contained("pre_rebalance", || {
            self.on_pre_rebalance(consumer, rebalance)
        });
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        contained("post_rebalance", || {
            self.on_post_rebalance(consumer, rebalance)
        });
    }

    fn commit_callback(
        &self,
        result: rdkafka::error::KafkaResult<()>,
        offsets: &TopicPartitionList,
    ) {
        contained("commit_callback", || self.on_commit(result, offsets));
    }
}

fn contained(callback: &str, f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        // Logging may be what panicked; stay silent beyond one attempt.
        let _ =
            std::panic::catch_unwind(|| tracing::error!(callback, "a consumer callback panicked"));
    }
}

/// Commits the stored offsets; "nothing to commit" is not an error.
pub(crate) fn commit<C: rdkafka::consumer::Consumer<Ctx>, Ctx: ConsumerContext>(
    consumer: &C,
    mode: CommitMode,
    why: &str,
) {
    match consumer.commit_consumer_state(mode) {
        Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
        Err(e) => tracing::warn!(error = %e, why, "offset commit failed"),
    }
}
