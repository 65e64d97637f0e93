//! The database runtime's rebalance actions (on the shared
//! [`Membership`]): stop the workers of revoked partitions and commit what
//! they finished, resume newly assigned partitions.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::database::partition::state::{Partition, PartitionMap, lock};
use crate::pipeline::membership::{Membership, OnRebalance, contained};

/// The database runtime's rebalance: a revoke hands the revoked
/// partitions' batches in flight over (waits for them, up to the revoke
/// timeout) and commits what they finished; an assignment resumes what
/// back-pressure may have left paused.
pub(crate) struct HandOver {
    pub(crate) partitions: PartitionMap,
    /// How long a revoke waits for the revoked partitions' batches in flight.
    pub(crate) revoke_timeout: Duration,
}

/// The database runtime's consumer context.
pub(crate) type RebalanceContext = Membership<HandOver>;

impl HandOver {
    /// Waits, up to the revoke timeout, for the workers of `leaving` to
    /// finish their batches in flight and end. This runs inside the
    /// consumer's poll, on the task of the consumer loop: on a multi-thread
    /// Tokio runtime the wait hands this thread's other tasks to another
    /// thread (`block_in_place`), so the workers, wherever they run, go on.
    /// On a current-thread runtime they could not: no wait.
    fn wait_for(&self, leaving: &[Arc<Partition>]) {
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

impl OnRebalance for HandOver {
    fn revoking(&self, consumer: &BaseConsumer<RebalanceContext>, tpl: &TopicPartitionList) {
        // The revoked partitions' workers finish the batch they are on and
        // take no other; their offsets are stored as they finish, and
        // committed below, before the partitions go, so the next owner
        // receives none of it again. Past the revoke timeout the rest is
        // abandoned: a batch that commits after that has its offsets
        // uncommitted, and the next owner receives it again and skips it as
        // a duplicate.
        let started = Instant::now();
        let mut partitions = lock(&self.partitions);
        let mut leaving = Vec::new();
        for elem in tpl.elements() {
            if let Some(p) = partitions.remove(&(elem.topic().to_owned(), elem.partition())) {
                p.release.send_replace(true);
                leaving.push(p);
            }
        }
        drop(partitions);
        // Closing: shutdown has already finished the workers and made the
        // final commit; the revoke that closing the consumer triggers must
        // not commit again (a synchronous commit from inside close can wait
        // forever on a group that is leaving).
        let closing = consumer.context().is_closing();
        // Lost (the session expired, or the member was fenced): the
        // partitions may be another member's already, and a commit would be
        // refused. Abandoned at once, as after the timeout.
        let lost = consumer.assignment_lost();
        if !closing && !lost {
            // Contained on its own: whatever happens while waiting, the
            // partitions are marked revoked and committed below.
            contained("revoke wait", || self.wait_for(&leaving));
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

    fn assigned(&self, consumer: &BaseConsumer<RebalanceContext>, tpl: &TopicPartitionList) {
        tracing::info!(
            partitions = tpl.count(),
            "partitions assigned; resuming from committed offsets"
        );
        // A partition paused for back-pressure and then revoked starts its
        // new assignment unpaused: its new worker has an empty buffer.
        if let Err(e) = consumer.resume(tpl) {
            tracing::debug!(error = %e, "resuming newly assigned partitions");
        }
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
