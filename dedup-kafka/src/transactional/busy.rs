//! Staying in the group while a batch runs.
//!
//! A batch's handlers may retry for minutes (an outage waited out, an
//! attempt that hangs until its timeout). librdkafka counts the time between
//! two polls against `max.poll.interval.ms`: a consumer that stops polling
//! for longer leaves its group, its transaction is refused, and the next
//! owner runs the same batch into the same wait. So the run loop keeps
//! polling while the batch is judged ([`Busy::poll`]), but never while a
//! transaction is open without its offsets: the rebalance callbacks run
//! inside a poll, and a partition revoked then could be handed to a new
//! owner that runs the batch too (the transaction's offsets are checked
//! against the group's generation, not against who owns the partition).
//! A rebalance seen while the batch was judged abandons the batch before
//! its transaction ([`Busy::rebalanced`]).
//!
//! A message that comes in meanwhile is not kept: its partition is paused
//! (librdkafka drops what it had fetched for it) and, when the batch ends,
//! resumed and sought back to the first offset that came in, so it is
//! fetched again in order. A partition revoked during the batch is never
//! sought: its next assignment starts from its committed offset, and a
//! seek could only move it behind what another member committed meanwhile.
//!
//! Once a transaction's offsets are in it (the group coordinator holds
//! them, pending the commit), the loop gathers the next batch while the
//! transaction waits for its acknowledgements and commits
//! ([`Busy::carrying`], [`Busy::carry`]): the consumer thread's work of
//! taking messages overlaps the broker's of acknowledging, instead of
//! following it. Polling is safe then: a partition revoked now is fetched
//! by its next owner from the offsets the coordinator gives it, and with
//! `read_committed` (the consumer's setting, always) librdkafka asks for
//! stable offsets, which the coordinator withholds while a transaction's
//! offsets for the partition are pending: the new owner starts after
//! the batch if it commits, at its start if it aborts. What is carried
//! is dropped wherever the consumer goes back: a partition sought to an
//! offset loses its carried messages from that offset on (they come
//! again), a partition revoked loses all it carried before the revoke.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::Offset;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Message as _, OwnedMessage};
use tokio::sync::watch;

use super::lanes::{Change, Lane, Membership, Topics};
use crate::Error;

/// How often the run loop polls while a batch runs: well inside any
/// `max.poll.interval.ms`.
pub(super) const POLL_EVERY: Duration = Duration::from_millis(500);

/// How often [`Busy::resume_running`] resumes what should run.
const RESUME_RUNNING_EVERY: Duration = Duration::from_secs(1);

/// What the run loop and the batch share while the batch runs.
pub(super) struct Busy {
    /// No transaction is open: the loop may poll.
    open: AtomicBool,
    /// A poll saw the group rebalance: the batch's waits end.
    rebalanced: watch::Sender<bool>,
    /// The batch's transaction holds its offsets and waits for its
    /// acknowledgements or its commit: the loop may take messages for the
    /// next batch.
    carrying: watch::Sender<bool>,
    /// When [`Busy::resume_running`] last resumed.
    resumed: Mutex<Option<Instant>>,
    seen: Mutex<Seen>,
    topics: Topics,
}

/// What the polls of one batch saw.
#[derive(Default)]
struct Seen {
    /// Partitions paused because a message of theirs came in.
    paused: BTreeSet<Lane>,
    /// Per partition, the first offset that came in (since its last
    /// revoke): where it goes back to.
    unread: BTreeMap<Lane, i64>,
    /// Partitions revoked while the batch ran (possibly assigned again).
    moved: BTreeSet<Lane>,
    /// Rebalance changes already looked at.
    changes: usize,
    /// The messages taken for the next batch while a transaction committed,
    /// in the order they came.
    carried: Vec<OwnedMessage>,
}

impl Busy {
    /// How many partitions are paused now (for health and the gauges).
    pub(super) fn paused(&self) -> usize {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .paused
            .len()
    }

    pub(super) fn new(topics: Topics) -> Self {
        Self {
            open: AtomicBool::new(false),
            rebalanced: watch::Sender::new(false),
            carrying: watch::Sender::new(false),
            resumed: Mutex::new(None),
            seen: Mutex::default(),
            topics,
        }
    }

    /// The batch opens no transaction until [`Busy::close`].
    pub(super) fn open(&self) {
        self.open.store(true, Ordering::Release);
    }

    /// The batch is about to open a transaction: the loop stops polling.
    pub(super) fn close(&self) {
        self.open.store(false, Ordering::Release);
    }

    /// The transaction's offsets are in it: until it ends (the guard
    /// dropped), the loop may take messages for the next batch.
    pub(super) fn carry_from_here(&self) -> Carrying<'_> {
        self.carrying.send_replace(true);
        Carrying(self)
    }

    /// The next message while the batch's transaction commits: pending
    /// whenever it is not, and the consumer is polled only then (a
    /// rebalance callback must not run while a transaction is open without
    /// its offsets). Cancel-safe. Hand what it returns to [`Busy::carry`].
    pub(super) async fn carrying<'c>(
        &self,
        consumer: &'c StreamConsumer<Membership>,
    ) -> KafkaResult<BorrowedMessage<'c>> {
        let mut carrying = self.carrying.subscribe();
        loop {
            let _ = carrying.wait_for(|c| *c).await;
            tokio::select! {
                biased;
                _ = carrying.wait_for(|c| !*c) => {}
                received = consumer.recv() => return received,
            }
        }
    }

    /// Keeps `msg` (from [`Busy::carrying`]) for the next batch; `len`: how
    /// many are kept now.
    pub(super) fn carry(
        &self,
        consumer: &StreamConsumer<Membership>,
        msg: &BorrowedMessage<'_>,
    ) -> usize {
        // The callbacks a poll serves come before the message it returns.
        self.look_at_changes(consumer.context());
        let mut seen = lock(&self.seen);
        seen.carried.push(msg.detach());
        seen.carried.len()
    }

    /// Between batches, at most once a second: resumes every assigned
    /// partition but those `holds` (the retry tiers' waiting ones): a
    /// resume librdkafka dropped would leave one paused for good
    /// ([`resume_assigned`](crate::pipeline::membership::resume_assigned)).
    pub(super) fn resume_running(
        &self,
        consumer: &StreamConsumer<Membership>,
        holds: impl Fn(Lane) -> bool,
    ) {
        {
            let mut resumed = lock(&self.resumed);
            if resumed.is_some_and(|at| at.elapsed() < RESUME_RUNNING_EVERY) {
                return;
            }
            *resumed = Some(Instant::now());
        }
        crate::pipeline::membership::resume_assigned(consumer, |topic, p| {
            self.topics.find(topic, p).is_none_or(&holds)
        });
    }

    /// Polls once if no transaction is open: the group sees the consumer
    /// alive, the rebalance callbacks run. A message that comes in pauses
    /// its partition.
    pub(super) async fn poll(&self, consumer: &StreamConsumer<Membership>) {
        // Bounded: each message pauses its partition.
        for _ in 0..64 {
            if !self.open.load(Ordering::Acquire) {
                return;
            }
            let received = tokio::time::timeout(Duration::ZERO, consumer.recv()).await;
            // The callbacks a poll serves come before the message it returns.
            self.look_at_changes(consumer.context());
            match received {
                Err(_) => return,
                Ok(Err(e)) => tracing::warn!(error = %e, "consumer error"),
                Ok(Ok(msg)) => {
                    let lane = self.topics.lane(&msg);
                    let mut seen = lock(&self.seen);
                    let at = seen.unread.entry(lane).or_insert(msg.offset());
                    *at = (*at).min(msg.offset());
                    if !seen.paused.contains(&lane) {
                        // Paused even if this fails: resumed all the same.
                        seen.paused.insert(lane);
                        if let Err(e) = consumer.pause(&self.topics.list([lane])) {
                            tracing::warn!(topic = self.topics.name(lane), partition = lane.partition, error = %e, "pausing a partition while a batch runs failed");
                        }
                    }
                }
            }
        }
    }

    /// Records the rebalances the callbacks pushed since the last look.
    fn look_at_changes(&self, context: &Membership) {
        let mut seen = lock(&self.seen);
        let from = seen.changes;
        let mut rebalanced = false;
        context.each_change_from(from, |change| {
            seen.changes += 1;
            rebalanced |= !change.lanes().is_empty();
            if let Change::Revoked(lanes) = change {
                for lane in lanes {
                    seen.unread.remove(lane);
                    seen.moved.insert(*lane);
                }
                // Not ours now; if assigned again, fetched from its
                // committed offset.
                let topics = &self.topics;
                seen.carried.retain(|m| !lanes.contains(&topics.lane(m)));
            }
        });
        if rebalanced {
            self.rebalanced.send_replace(true);
        }
    }

    /// Whether the group rebalanced since the batch's messages came in (a
    /// change the loop has not applied yet). Called once the batch is
    /// [`closed`](Busy::close): no callback can run after it until the
    /// transaction's offsets are in it.
    pub(super) fn rebalanced(&self, context: &Membership) -> bool {
        context.pending()
    }

    /// Resolves once a poll saw the group rebalance while the batch ran:
    /// judging it further is wasted, it will be dropped.
    pub(super) async fn rebalance(&self) {
        let _ = self.rebalanced.subscribe().wait_for(|r| *r).await;
    }

    /// The batch ended: what came in meanwhile is fetched again, but for
    /// the messages carried for the next batch, which it returns. `true` if
    /// anything came in (the next batch has a backlog to take). Apply the
    /// rebalance changes the context holds before the carried messages
    /// join a batch: they were already dropped where a change says so.
    pub(super) fn finish(
        &self,
        consumer: &StreamConsumer<Membership>,
    ) -> Result<(bool, Vec<OwnedMessage>), Error> {
        self.close();
        self.carrying.send_replace(false);
        let came_in = !lock(&self.seen).unread.is_empty();
        self.rewind(consumer, &BTreeMap::new())?;
        self.rebalanced.send_replace(false);
        let mut seen = lock(&self.seen);
        let carried = std::mem::take(&mut seen.carried);
        // A resume that failed is tried again at the next batch's end.
        *seen = Seen {
            paused: std::mem::take(&mut seen.paused),
            ..Seen::default()
        };
        Ok((came_in || !carried.is_empty(), carried))
    }

    /// Drops the batch (its messages from `first`, by partition) and what
    /// came in meanwhile: every partition still assigned that delivered
    /// any of it, and was not revoked since, goes back to the first offset
    /// it delivered, so all of it is fetched again, in order.
    pub(super) fn rewind(
        &self,
        consumer: &StreamConsumer<Membership>,
        first: &BTreeMap<Lane, i64>,
    ) -> Result<(), Error> {
        self.look_at_changes(consumer.context());
        let mut seen = lock(&self.seen);
        // Every partition paused, assigned or not: librdkafka keeps a
        // partition paused across its revoke and its next assignment.
        let paused = std::mem::take(&mut seen.paused);
        if !paused.is_empty()
            && let Err(e) = consumer.resume(&self.topics.list(paused.iter().copied()))
        {
            tracing::warn!(error = %e, "resuming partitions paused while a batch ran failed");
            seen.paused = paused;
        }
        let mut back = std::mem::take(&mut seen.unread);
        for (&p, &o) in first {
            if !seen.moved.contains(&p) {
                let at = back.entry(p).or_insert(o);
                *at = (*at).min(o);
            }
        }
        if back.is_empty() {
            return Ok(());
        }
        let assigned = consumer.assignment()?;
        for (lane, o) in back {
            let (topic, p) = (self.topics.name(lane), lane.partition);
            if assigned.find_partition(topic, p).is_none() {
                continue;
            }
            let sought = tokio::task::block_in_place(|| {
                consumer.seek(topic, p, Offset::Offset(o), Duration::from_secs(10))
            });
            if let Err(e) = sought {
                return Err(Error::Fatal(format!(
                    "rewinding partition {p} of {topic} to offset {o} failed ({e}): stopping, so \
                     that a restart resumes from the committed offsets"
                )));
            }
            // Fetched again from `o`: what was carried from there on comes
            // again.
            let topics = &self.topics;
            seen.carried
                .retain(|m| topics.lane(m) != lane || m.offset() < o);
        }
        Ok(())
    }
}

/// While held, the loop may take messages for the next batch
/// ([`Busy::carry_from_here`]).
pub(super) struct Carrying<'a>(&'a Busy);

impl Drop for Carrying<'_> {
    fn drop(&mut self) {
        self.0.carrying.send_replace(false);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
