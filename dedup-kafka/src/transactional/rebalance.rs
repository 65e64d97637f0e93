//! The rebalance callbacks: what they saw, in order, for the run loop (and
//! a batch that polls) to act on.
use std::collections::HashMap;
use std::sync::Mutex;

use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::{ClientContext, TopicPartitionList};

/// What the rebalance callbacks saw, in order, for the loop to act on.
#[derive(Debug)]
pub(super) enum Change {
    Assigned(Vec<i32>),
    Revoked(Vec<i32>),
}

impl Change {
    /// The partitions that moved (none: an incremental rebalance that
    /// left this member as it was).
    pub(super) fn partitions(&self) -> &[i32] {
        match self {
            Change::Assigned(partitions) | Change::Revoked(partitions) => partitions,
        }
    }
}

/// The consumer's context: what this member owns of the input topic, and
/// the changes to it the rebalance callbacks saw, in order, for the loop
/// (and a batch that polls) to act on; the lag of what it owns.
pub(super) struct Membership {
    pub(super) topic: String,
    pub(super) changes: Mutex<Vec<Change>>,
    /// The input partitions this member owns, as the callbacks say, and
    /// the offset each committed last (once it has): their lag is reported.
    pub(super) owned: Mutex<HashMap<i32, Option<i64>>>,
}

impl Membership {
    pub(super) fn push(&self, change: Change) {
        self.changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(change);
    }

    /// Whether a rebalance happened that the loop has not acted on.
    pub(super) fn pending(&self) -> bool {
        self.changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|change| !change.partitions().is_empty())
    }

    /// The offsets a transaction committed, for the lag.
    pub(super) fn committed(&self, offsets: &TopicPartitionList) {
        for e in offsets.elements() {
            if let rdkafka::Offset::Offset(o) = e.offset() {
                self.committed_at(e.partition(), o);
            }
        }
    }

    /// The offset `partition` committed last (if it is still owned), for
    /// the lag.
    pub(super) fn committed_at(&self, partition: i32, offset: i64) {
        let mut owned = self.owned.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = owned.get_mut(&partition) {
            *at = Some(offset);
        }
    }

    /// Calls `f` with each change from the `from`th on, in order.
    pub(super) fn each_change_from(&self, from: usize, mut f: impl FnMut(&Change)) {
        let changes = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        changes.iter().skip(from).for_each(&mut f);
    }

    pub(super) fn take(&self) -> Vec<Change> {
        std::mem::take(&mut *self.changes.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(super) fn partitions(&self, list: &TopicPartitionList) -> Vec<i32> {
        list.elements()
            .iter()
            .filter(|e| e.topic() == self.topic)
            .map(|e| e.partition())
            .collect()
    }
}

impl ClientContext for Membership {
    /// librdkafka's statistics (every `statistics.interval.ms`): the lag of
    /// each owned input partition, from the end of its committed log (its
    /// last stable offset) back to the offset this member's transactions
    /// committed last, as the `dedup_consumer_lag` gauge. (librdkafka's own
    /// lag counts from offsets the consumer commits itself, and this one
    /// commits through its transactions.)
    fn stats(&self, statistics: rdkafka::Statistics) {
        let owned = self.owned.lock().unwrap_or_else(|p| p.into_inner());
        let Some(topic) = statistics.topics.get(&self.topic) else {
            return;
        };
        for (&id, partition) in &topic.partitions {
            let end = if partition.ls_offset >= 0 {
                partition.ls_offset
            } else {
                partition.hi_offset
            };
            if let Some(Some(committed)) = owned.get(&id)
                && partition.desired
                && end >= 0
            {
                crate::metrics::consumer_lag(&self.topic, id, (end - committed).max(0));
            }
        }
    }
}

/// The callbacks run inside `recv`, which the loop calls only while no
/// transaction is open (see [`busy`]): none is when partitions are revoked.
impl ConsumerContext for Membership {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let partitions = self.partitions(list);
            let mut owned = self.owned.lock().unwrap_or_else(|p| p.into_inner());
            for p in &partitions {
                owned.remove(p);
                // Not this member's to report any more.
                crate::metrics::consumer_lag(&self.topic, *p, 0);
            }
            drop(owned);
            self.push(Change::Revoked(partitions));
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let partitions = self.partitions(list);
            self.owned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(partitions.iter().map(|&p| (p, None)));
            self.push(Change::Assigned(partitions));
        }
    }
}
