//! The Kafka-only runtime's rebalance actions (on the shared
//! [`Membership`](crate::pipeline::membership::Membership)): what the
//! callbacks saw, in order, for the run loop (and a batch that polls) to
//! act on.
use std::sync::Mutex;

use rdkafka::TopicPartitionList;
use rdkafka::consumer::BaseConsumer;

use crate::pipeline::membership::OnRebalance;

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

/// The changes to what this member owns of the input topic, in order,
/// for the loop (and a batch that polls) to act on. The callbacks run
/// inside `recv`, which the loop calls only while no transaction is open
/// (see [`busy`](super::busy)): none is when partitions are revoked.
pub(super) struct Changes {
    pub(super) topic: String,
    pub(super) changes: Mutex<Vec<Change>>,
}

/// The Kafka-only runtime's consumer context.
pub(super) type Membership = crate::pipeline::membership::Membership<Changes>;

impl Changes {
    pub(super) fn new(topic: String) -> Self {
        Changes {
            topic,
            changes: Mutex::new(Vec::new()),
        }
    }

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

impl OnRebalance for Changes {
    fn revoking(&self, _: &BaseConsumer<Membership>, list: &TopicPartitionList) {
        self.push(Change::Revoked(self.partitions(list)));
    }

    fn assigned(&self, _: &BaseConsumer<Membership>, list: &TopicPartitionList) {
        self.push(Change::Assigned(self.partitions(list)));
    }
}
