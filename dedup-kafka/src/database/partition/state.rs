//! What the runtime knows of each assigned partition, below everything
//! that acts on it (the rebalance callbacks, the workers, the dead letters).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
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
    /// Under key-ordered concurrency, how far past its committed offset a
    /// worker may finish events (its window); 0 otherwise.
    pub(crate) redelivery_window: AtomicI64,
    /// Under key-ordered concurrency, duplicates below this offset are
    /// redeliveries too: set at the first event applied, at a window past
    /// it (the previous owner may have finished events out of order that
    /// far past where it stopped).
    pub(crate) redelivered_below: AtomicI64,
    /// Under key-ordered concurrency: events running, and events waiting
    /// behind an earlier event of their key (for the gauges).
    pub(crate) keyed_running: AtomicUsize,
    pub(crate) keyed_waiting: AtomicUsize,
    /// A retry tier's partition paused until its next record is due: the
    /// consumer loop does not resume it for having drained.
    pub(crate) due_wait: AtomicBool,
    /// When that record is due (ms since the Unix epoch); 0 otherwise.
    pub(crate) due_at_ms: AtomicI64,
    /// Under key hold-back, what the origin partition's worker knows of
    /// its keys held by events in retry tiers; read at its first need.
    /// By the scope of their records.
    pub(crate) holds: Mutex<HashMap<String, crate::database::hold::Held>>,
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
            redelivery_window: AtomicI64::new(0),
            redelivered_below: AtomicI64::new(i64::MIN),
            keyed_running: AtomicUsize::new(0),
            keyed_waiting: AtomicUsize::new(0),
            due_wait: AtomicBool::new(false),
            due_at_ms: AtomicI64::new(0),
            holds: Mutex::new(HashMap::new()),
            sender,
        }
    }

    /// Whether a duplicate at `offset` skipped now is a redelivery after a
    /// handover: nothing has been applied since the assignment began, or
    /// (key-ordered concurrency) it is within the first window.
    pub(crate) fn redelivery(&self, offset: i64) -> bool {
        self.fresh.load(Ordering::Relaxed)
            || offset < self.redelivered_below.load(Ordering::Relaxed)
    }

    /// The event at `offset` was applied: later duplicates are not
    /// redeliveries (under key-ordered concurrency, those beyond a window
    /// past it).
    pub(crate) fn applied(&self, offset: i64) {
        if self.fresh.load(Ordering::Acquire) {
            // The window first, so a duplicate judged meanwhile sees one
            // or the other.
            let window = self.redelivery_window.load(Ordering::Relaxed);
            if window > 0 {
                self.redelivered_below
                    .fetch_max(offset.saturating_add(window), Ordering::AcqRel);
            }
            self.fresh.store(false, Ordering::Release);
        }
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

/// Whether `map` holds `partition` of `topic` paused (for back-pressure,
/// or until a retry tier's record is due).
pub(crate) fn held_paused(map: &PartitionMap, topic: &str, partition: i32) -> bool {
    lock(map)
        .get(&(topic.to_owned(), partition))
        .is_some_and(|p| p.paused.load(Ordering::SeqCst))
}

/// The assigned partitions, by topic and partition.
pub(crate) type PartitionMap = Arc<Mutex<HashMap<(String, i32), Arc<Partition>>>>;

/// Locks the map, also after a panic elsewhere while it was locked.
pub(crate) fn lock(map: &PartitionMap) -> MutexGuard<'_, HashMap<(String, i32), Arc<Partition>>> {
    map.lock().unwrap_or_else(|p| p.into_inner())
}

/// A partition's dead-letter gate (see `dead_letter`).
pub(crate) type Gate = Arc<tokio::sync::Mutex<()>>;
