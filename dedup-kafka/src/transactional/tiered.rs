//! Retry tiers in the Kafka-only runtime.
//!
//! A transiently failing event is moved by the batch's transaction: its
//! copy to the next tier is a record of the transaction, like its outputs
//! and its offset, so it is moved once or not at all (no claim records
//! the move: nothing commits its offset without it).
//!
//! The consumer reads its tiers itself. Partition `p` of every tier is
//! assigned with partition `p` of the input (the range assignor, on topics
//! of as many partitions), and a move keeps its partition number, so an
//! event read back from a tier is judged against the claims of its input
//! partition: applied once, and its later duplicates in the input skipped.
//! A tier's record is judged at its partition's stream time without
//! advancing it (by its origin's timestamp, not its move's).
//!
//! A tier's partition whose next record is not due yet is paused and
//! sought back to that record ([`Waiting`]): librdkafka fetches nothing
//! of it until the loop resumes it at the due time.
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use dedup_core::Handler;
use rdkafka::Offset;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Message as _, OwnedMessage};

use super::TransactionalConsumer;
use super::lanes::{Lane, Membership, Topics};
use super::outputs::Outputs;
use crate::Error;
use crate::dead_letter_format::DeadLetter;
use crate::retry::RetryPolicy;
use crate::tiers::{Origin, PAUSE_FROM, TierTopic};

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    /// The retry policy of attempts in place: with retry tiers, transient
    /// failures get the tiers' few attempts before the event moves on.
    pub(super) fn in_place(&self) -> RetryPolicy {
        match &self.tiers {
            Some(tiers) => self.pipeline.retry.with_max_attempts(tiers.attempts),
            None => self.pipeline.retry,
        }
    }

    /// Tier `i` (of a move: the consumer has tiers).
    pub(super) fn tier(&self, i: usize) -> &TierTopic {
        &self.tiers.as_ref().expect("a move has tiers").tiers[i]
    }

    /// Where `msg`, failing transiently, goes: the next tier (its index and
    /// itself); `None` from the last tier, or without tiers (the
    /// dead-letter topic).
    pub(super) fn next_tier(&self, msg: &OwnedMessage) -> Option<(usize, &TierTopic)> {
        let tiers = self.tiers.as_ref()?;
        // The input is topic 0 (next: tier 0); tier i is topic i + 1.
        let next = self.topics.lane(msg).topic;
        tiers.tiers.get(next).map(|tier| (next, tier))
    }

    /// Whether `msg`'s `dedup.origin.*` and `dedup.retry.attempt` are its
    /// own story: read from a tier, or a copy released from one, and not
    /// forged.
    fn reads_origin_headers(&self, msg: &OwnedMessage) -> bool {
        self.tiers
            .as_ref()
            .is_some_and(|t| t.trusts_origin(self.tier_at(msg), msg))
    }

    /// The tier `msg` was read from: `None` for the input (topic 0); tier
    /// i is topic i + 1.
    fn tier_at(&self, msg: &OwnedMessage) -> Option<usize> {
        self.topics.lane(msg).topic.checked_sub(1)
    }

    /// Why `msg`'s tier headers are not its own, if it has such headers and
    /// they are not (`TopicTiers::forged`): it is then dead-lettered as
    /// itself.
    pub(super) fn forged(&self, msg: &OwnedMessage) -> Option<String> {
        self.tiers.as_ref()?.forged(self.tier_at(msg), msg)
    }

    /// Where `msg` came from before any move.
    pub(super) fn origin(&self, msg: &OwnedMessage) -> Origin {
        crate::tiers::origin_of(msg, self.reads_origin_headers(msg))
    }

    /// The timestamp `msg` counts with in its partition's stream time: its
    /// own, or none for a tier's record (judged at the stream time its
    /// partition has reached: its origin counted already, and its move's
    /// time would expire claims early in a backlog).
    pub(super) fn stream_stamp(&self, msg: &OwnedMessage) -> i64 {
        match self.topics.lane(msg).topic {
            0 => super::fate::timestamp(msg),
            _ => i64::MIN,
        }
    }

    /// The move of `msg` to tier `tier` after `attempts` here, due at
    /// `due_ms`, failing with `kind` and `message`.
    pub(super) fn move_to(
        &self,
        msg: &OwnedMessage,
        tier: usize,
        kind: &'static str,
        message: String,
        attempts: u32,
        due_ms: i64,
    ) -> DeadLetter<'_> {
        let to = self.tier(tier);
        DeadLetter {
            topic: &to.topic,
            kind,
            message,
            attempts,
            handler: self.handler.scope(),
            schema_id: crate::dead_letter_format::schema_id(self.handler.preparer(), msg),
            origin: self.origin(msg),
            moved: Some(to.moved(msg, self.reads_origin_headers(msg), attempts, due_ms)),
        }
    }
}

/// The tiers' partitions not read for now: paused and sought back to
/// their first record not taken.
#[derive(Debug, Default)]
pub(super) struct Waiting {
    /// Until their next record is due: when (ms since the epoch).
    due: BTreeMap<Lane, i64>,
    /// Assigned without their input partition (the group's members
    /// subscribe to different tiers, as in a rolling deploy that adds
    /// them): a tier's record is judged against its input partition's
    /// claims, so it waits for a rebalance that assigns them together.
    parked: BTreeSet<Lane>,
}

impl Waiting {
    /// How many partitions wait (counted paused in health and the gauges).
    pub(super) fn len(&self) -> usize {
        self.due.len() + self.parked.len()
    }

    /// The member was assigned `lanes` (its whole assignment: the eager
    /// protocol): the tiers' partitions among them without their input
    /// partition are parked, and whatever waited that is not among them (a
    /// revoke not seen) is resumed and forgotten.
    pub(super) fn assigned(
        &mut self,
        consumer: &StreamConsumer<Membership>,
        topics: &Topics,
        lanes: &[Lane],
    ) {
        let parked = apart(lanes);
        let stale: Vec<Lane> = self
            .parked
            .iter()
            .chain(self.due.keys())
            .copied()
            .filter(|lane| !parked.contains(lane))
            .collect();
        self.revoked(consumer, topics, &stale);
        if parked.is_empty() {
            return;
        }
        let named: Vec<(&str, i32)> = parked
            .iter()
            .map(|&lane| (topics.name(lane), lane.partition))
            .collect();
        tracing::warn!(partitions = ?named, "retry tier partitions assigned without their input partition (the group's members have different retry tiers: a deploy in progress?); they are not read until a rebalance assigns them together");
        if let Err(e) = consumer.pause(&topics.list(parked.iter().copied())) {
            // Their records are cut from each batch all the same.
            tracing::warn!(error = %e, "pausing retry tier partitions failed");
        }
        self.parked.extend(parked);
    }

    /// Takes out of `batch` each tier partition's records from its first
    /// one not yet due (or each record of a parked partition): the
    /// partition is paused and sought back to that record, so nothing more
    /// of it is fetched until it is due. Records of the input are never
    /// held, nor are records whose tier headers are `forged`.
    pub(super) fn hold_undue(
        &mut self,
        consumer: &StreamConsumer<Membership>,
        topics: &Topics,
        tiers: Option<&crate::tiers::TopicTiers>,
        forged: impl Fn(&OwnedMessage) -> bool,
        batch: &mut Vec<OwnedMessage>,
    ) -> Result<(), Error> {
        let mut cut: BTreeMap<Lane, (i64, Option<i64>)> = BTreeMap::new();
        for msg in batch.iter() {
            let lane = topics.lane(msg);
            if lane.topic == 0 || cut.contains_key(&lane) {
                continue;
            }
            if self.parked.contains(&lane) {
                cut.insert(lane, (msg.offset(), None));
                continue;
            }
            // One whose tier headers are forged is not waited for: it is
            // dead-lettered as it comes.
            if forged(msg) {
                continue;
            }
            let delay = tiers.map_or(Duration::ZERO, |t| t.tiers[lane.topic - 1].delay);
            let wait = crate::tiers::due_in(msg, delay);
            // A shorter wait is not waited: the record runs now, at most
            // that much early, rather than its partition being paused,
            // sought back and fetched again.
            if wait >= PAUSE_FROM {
                let due = crate::tiers::now_ms().saturating_add(wait.as_millis() as i64);
                cut.insert(lane, (msg.offset(), Some(due)));
            }
        }
        if cut.is_empty() {
            return Ok(());
        }
        batch.retain(|msg| {
            cut.get(&topics.lane(msg))
                .is_none_or(|&(from, _)| msg.offset() < from)
        });
        if let Err(e) = consumer.pause(&topics.list(cut.keys().copied())) {
            // Read again at once, and held again: no record goes early.
            tracing::warn!(error = %e, "pausing a retry tier's partitions failed");
        }
        for (lane, (offset, due)) in cut {
            let (topic, p) = (topics.name(lane), lane.partition);
            let sought = tokio::task::block_in_place(|| {
                consumer.seek(topic, p, Offset::Offset(offset), Duration::from_secs(10))
            });
            if let Err(e) = sought {
                return Err(Error::Fatal(format!(
                    "holding partition {p} of retry tier {topic:?} at offset {offset} until it \
                     is due failed ({e}): stopping, so that a restart resumes from the \
                     committed offsets"
                )));
            }
            if let Some(due) = due {
                tracing::debug!(topic, partition = p, offset, due, "retry tier waits");
                self.due.insert(lane, due);
            }
        }
        self.report(topics);
        Ok(())
    }

    /// Resumes the partitions whose record is due now.
    pub(super) fn resume_due(&mut self, consumer: &StreamConsumer<Membership>, topics: &Topics) {
        // Called for every message received: without a tier partition
        // waiting, not even the clock is read (1.2% of the consumer's
        // thread in the profile of the book's performance chapter).
        if self.due.is_empty() {
            return;
        }
        let now = crate::tiers::now_ms();
        let due: Vec<Lane> = self
            .due
            .iter()
            .filter(|&(_, &at)| at <= now)
            .map(|(&lane, _)| lane)
            .collect();
        self.resume(consumer, topics, &due);
    }

    /// `lanes` were revoked: resumed (librdkafka keeps a partition paused
    /// across its revoke and its next assignment) and forgotten.
    pub(super) fn revoked(
        &mut self,
        consumer: &StreamConsumer<Membership>,
        topics: &Topics,
        lanes: &[Lane],
    ) {
        let parked: Vec<Lane> = lanes
            .iter()
            .copied()
            .filter(|lane| self.parked.contains(lane))
            .collect();
        if !parked.is_empty() {
            match consumer.resume(&topics.list(parked.iter().copied())) {
                Ok(()) => {
                    for lane in parked {
                        self.parked.remove(&lane);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "resuming retry tier partitions failed"),
            }
        }
        self.resume(consumer, topics, lanes);
    }

    /// Resumes those of `lanes` that wait for their due time, and forgets
    /// them.
    fn resume(&mut self, consumer: &StreamConsumer<Membership>, topics: &Topics, lanes: &[Lane]) {
        let lanes: Vec<Lane> = lanes
            .iter()
            .copied()
            .filter(|lane| self.due.contains_key(lane))
            .collect();
        if lanes.is_empty() {
            return;
        }
        // Test-only: a resume librdkafka drops (`resume_assigned`).
        let resumed = match crate::failpoint::fails("tier-resume-lost") {
            true => Ok(()),
            false => consumer.resume(&topics.list(lanes.iter().copied())),
        };
        match resumed {
            Ok(()) => {
                for lane in lanes {
                    self.due.remove(&lane);
                    crate::metrics::tier_due(topics.name(lane), lane.partition, 0.0);
                }
            }
            // Tried again at the loop's next turn.
            Err(e) => tracing::warn!(error = %e, "resuming a retry tier's partitions failed"),
        }
    }

    /// Whether `lane` waits paused (for its record's due time, or for its
    /// input partition).
    pub(super) fn holds(&self, lane: Lane) -> bool {
        self.due.contains_key(&lane) || self.parked.contains(&lane)
    }

    /// How long until the next partition is due, if one waits: at least
    /// [`RESUME_EVERY`], so that a resume that fails is not tried again at
    /// once.
    pub(super) fn next_in(&self) -> Option<Duration> {
        let next = *self.due.values().min()?;
        let wait = Duration::from_millis(next.saturating_sub(crate::tiers::now_ms()).max(0) as u64);
        Some(wait.max(RESUME_EVERY))
    }

    /// Sets `dedup_retry_due_seconds` of each waiting partition.
    pub(super) fn report(&self, topics: &Topics) {
        let now = crate::tiers::now_ms();
        for (&lane, &due) in &self.due {
            let seconds = due.saturating_sub(now).max(0) as f64 / 1000.0;
            crate::metrics::tier_due(topics.name(lane), lane.partition, seconds);
        }
    }
}

/// How often, at most, the loop wakes up to resume a partition come due.
const RESUME_EVERY: Duration = Duration::from_millis(50);

/// The tiers' partitions among `lanes` whose input partition (of the same
/// number) is not among them.
fn apart(lanes: &[Lane]) -> BTreeSet<Lane> {
    let inputs: BTreeSet<i32> = lanes
        .iter()
        .filter(|lane| lane.topic == 0)
        .map(|lane| lane.partition)
        .collect();
    lanes
        .iter()
        .copied()
        .filter(|lane| lane.topic > 0 && !inputs.contains(&lane.partition))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_partition_assigned_without_its_input_partition_is_set_apart() {
        let lane = |topic, partition| Lane { topic, partition };
        assert!(apart(&[lane(0, 0), lane(1, 0), lane(2, 0), lane(0, 1), lane(1, 1)]).is_empty());
        // Input partition 0 is another member's: tier partition 0 waits;
        // input partition 1 without its tier is read as usual.
        assert_eq!(
            apart(&[lane(1, 0), lane(2, 0), lane(0, 1)]),
            BTreeSet::from([lane(1, 0), lane(2, 0)])
        );
    }
}
