//! What the runtime knows of each assigned partition, below everything
//! that acts on it (the rebalance callbacks, the workers, the dead letters).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rdkafka::TopicPartitionList;
use rdkafka::message::OwnedMessage;
use tokio::sync::{mpsc, watch};

/// What the runtime knows of one assigned partition.
pub(crate) struct Partition {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    /// Messages handed to the worker and not yet finished.
    pub(crate) queued: AtomicUsize,
    pub(crate) paused: AtomicBool,
    /// Since when (`Stats::clock_ms`) the worker has been on its current
    /// message or batch; `u64::MAX` while it waits for one.
    pub(crate) busy_since_ms: std::sync::atomic::AtomicU64,
    /// Set when the partition is revoked: its worker stops, its offsets are
    /// no longer stored.
    pub(crate) revoked: watch::Sender<bool>,
    /// Set when a revoke begins: the worker finishes the batch it is on
    /// (and stores its offsets), takes no other, and ends.
    pub(crate) release: watch::Sender<bool>,
    /// The worker has ended (however it ended): it stores no more offsets.
    pub(crate) exited: AtomicBool,
    /// Nothing has been applied since the assignment began: a duplicate
    /// skipped now is a redelivery after a handover.
    pub(crate) fresh: AtomicBool,
    pub(crate) sender: mpsc::UnboundedSender<OwnedMessage>,
}

impl Partition {
    /// The state of a newly assigned partition, whose messages go to
    /// `sender`.
    pub(crate) fn new(
        topic: String,
        partition: i32,
        sender: mpsc::UnboundedSender<OwnedMessage>,
    ) -> Self {
        Partition {
            topic,
            partition,
            queued: AtomicUsize::new(0),
            paused: AtomicBool::new(false),
            busy_since_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
            revoked: watch::channel(false).0,
            release: watch::channel(false).0,
            exited: AtomicBool::new(false),
            fresh: AtomicBool::new(true),
            sender,
        }
    }

    /// Whether a duplicate skipped now is a redelivery after a handover:
    /// nothing has been applied since the assignment began.
    pub(crate) fn redelivery(&self) -> bool {
        self.fresh.load(Ordering::Relaxed)
    }

    /// An event was applied: later duplicates are not redeliveries.
    pub(crate) fn applied(&self) {
        self.fresh.store(false, Ordering::Relaxed);
    }

    pub(crate) fn is_revoked(&self) -> bool {
        *self.revoked.borrow()
    }

    pub(crate) fn tpl(&self) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.topic, self.partition);
        tpl
    }
}

/// The assigned partitions, by topic and partition.
pub(crate) type PartitionMap = Arc<Mutex<HashMap<(String, i32), Arc<Partition>>>>;

/// Locks the map, also after a panic elsewhere while it was locked.
pub(crate) fn lock(map: &PartitionMap) -> MutexGuard<'_, HashMap<(String, i32), Arc<Partition>>> {
    map.lock().unwrap_or_else(|p| p.into_inner())
}

/// A partition's dead-letter gate (see `dead_letter`).
pub(crate) type Gate = Arc<tokio::sync::Mutex<()>>;
