//! The Kafka-only runtime's rebalance actions (on the shared
//! [`Membership`](crate::pipeline::membership::Membership)): what the
//! callbacks saw, in order, for the run loop (and a batch that polls) to
//! act on.
use std::sync::Mutex;

use rdkafka::TopicPartitionList;
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::Message;

use crate::pipeline::membership::OnRebalance;

/// A partition of one of the consumer's topics: its input's (topic 0) or
/// one of its retry tiers' (1, 2, ...). Partition `p` of every tier is
/// assigned with partition `p` of the input (the range assignor, on
/// topics of as many partitions) and shares its claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct Lane {
    pub(super) topic: usize,
    pub(super) partition: i32,
}

/// The consumer's topics: its input's first, then its retry tiers', in
/// order.
#[derive(Debug, Clone)]
pub(super) struct Topics(Vec<String>);

impl Topics {
    pub(super) fn new(names: Vec<String>) -> Self {
        Topics(names)
    }

    /// Every topic, the input's first.
    pub(super) fn names(&self) -> &[String] {
        &self.0
    }

    /// The topic of `lane`.
    pub(super) fn name(&self, lane: Lane) -> &str {
        &self.0[lane.topic]
    }

    /// The lane of partition `partition` of `topic`, if it is one of ours.
    pub(super) fn find(&self, topic: &str, partition: i32) -> Option<Lane> {
        let topic = self.0.iter().position(|t| t == topic)?;
        Some(Lane { topic, partition })
    }

    /// The lane `msg` came from (only our topics are subscribed to).
    pub(super) fn lane(&self, msg: &impl Message) -> Lane {
        self.find(msg.topic(), msg.partition()).unwrap_or(Lane {
            topic: 0,
            partition: msg.partition(),
        })
    }

    /// `lanes` as a partition list.
    pub(super) fn list(&self, lanes: impl IntoIterator<Item = Lane>) -> TopicPartitionList {
        let mut list = TopicPartitionList::new();
        for lane in lanes {
            list.add_partition(self.name(lane), lane.partition);
        }
        list
    }
}

/// What the rebalance callbacks saw, in order, for the loop to act on.
#[derive(Debug)]
pub(super) enum Change {
    Assigned(Vec<Lane>),
    Revoked(Vec<Lane>),
}

impl Change {
    /// The partitions that moved (none: an incremental rebalance that
    /// left this member as it was).
    pub(super) fn lanes(&self) -> &[Lane] {
        match self {
            Change::Assigned(lanes) | Change::Revoked(lanes) => lanes,
        }
    }
}

/// The changes to what this member owns of its topics, in order,
/// for the loop (and a batch that polls) to act on. The callbacks run
/// inside `recv`, which the loop never calls while a transaction is open
/// without its offsets (see [`busy`](super::busy)).
pub(super) struct Changes {
    pub(super) topics: Topics,
    pub(super) changes: Mutex<Vec<Change>>,
}

/// The Kafka-only runtime's consumer context.
pub(super) type Membership = crate::pipeline::membership::Membership<Changes>;

impl Changes {
    pub(super) fn new(topics: Topics) -> Self {
        Changes {
            topics,
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
            .any(|change| !change.lanes().is_empty())
    }

    /// Calls `f` with each change from the `from`th on, in order.
    pub(super) fn each_change_from(&self, from: usize, mut f: impl FnMut(&Change)) {
        let changes = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        changes.iter().skip(from).for_each(&mut f);
    }

    pub(super) fn take(&self) -> Vec<Change> {
        std::mem::take(&mut *self.changes.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Our topics' partitions in `list`.
    pub(super) fn lanes(&self, list: &TopicPartitionList) -> Vec<Lane> {
        list.elements()
            .iter()
            .filter_map(|e| self.topics.find(e.topic(), e.partition()))
            .collect()
    }
}

impl OnRebalance for Changes {
    fn revoking(&self, _: &BaseConsumer<Membership>, list: &TopicPartitionList) {
        self.push(Change::Revoked(self.lanes(list)));
    }

    fn assigned(&self, _: &BaseConsumer<Membership>, list: &TopicPartitionList) {
        self.push(Change::Assigned(self.lanes(list)));
    }
}
