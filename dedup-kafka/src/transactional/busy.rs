//! Staying in the group while a batch runs.
//!
//! A batch's handlers may retry for minutes (an outage waited out, an
//! attempt that hangs until its timeout). librdkafka counts the time between
//! two polls against `max.poll.interval.ms`: a consumer that stops polling
//! for longer leaves its group, its transaction is refused, and the next
//! owner runs the same batch into the same wait. So the run loop keeps
//! polling while the batch is judged ([`Busy::poll`]), but only while no
//! transaction is open: the rebalance callbacks run inside a poll, and a
//! partition revoked while its batch's transaction is open could be handed
//! to a new owner that runs the batch too (the transaction's offsets are
//! checked against the group's generation, not against who owns the
//! partition). A rebalance seen while the batch was judged abandons the
//! batch before its transaction ([`Busy::rebalanced`]).
//!
//! A message that comes in meanwhile is kept for the next batch and its
//! partition paused (librdkafka drops what it had fetched for it and, on
//! resume, fetches from the message after the last one it delivered).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;

use super::Context;
use crate::Error;

/// How often the run loop polls while a batch runs: well inside any
/// `max.poll.interval.ms`.
pub(super) const POLL_EVERY: Duration = Duration::from_millis(500);

/// What the run loop and the batch share while the batch runs.
pub(super) struct Busy {
    /// No transaction is open: the loop may poll.
    open: AtomicBool,
    /// A poll saw the group rebalance: the batch's waits end.
    rebalanced: watch::Sender<bool>,
    /// Partitions paused because a message of theirs came in.
    paused: Mutex<BTreeSet<i32>>,
    /// Those messages, in the order they came, for the next batch.
    carried: Mutex<Vec<OwnedMessage>>,
}

impl Busy {
    pub(super) fn new() -> Self {
        Self {
            open: AtomicBool::new(false),
            rebalanced: watch::Sender::new(false),
            paused: Mutex::default(),
            carried: Mutex::default(),
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

    /// Polls once if no transaction is open: the group sees the consumer
    /// alive, the rebalance callbacks run. What comes in is kept.
    pub(super) async fn poll(&self, consumer: &StreamConsumer<Context>, topic: &str) {
        // Bounded: each message pauses its partition.
        for _ in 0..64 {
            if !self.open.load(Ordering::Acquire) {
                return;
            }
            let received = tokio::time::timeout(Duration::ZERO, consumer.recv()).await;
            if consumer.context().pending() {
                self.rebalanced.send_replace(true);
            }
            match received {
                Err(_) => return,
                Ok(Err(e)) => tracing::warn!(error = %e, "consumer error"),
                Ok(Ok(msg)) => {
                    let p = msg.partition();
                    let mut paused = lock(&self.paused);
                    if !paused.contains(&p) {
                        let mut list = TopicPartitionList::new();
                        list.add_partition(topic, p);
                        match consumer.pause(&list) {
                            Ok(()) => {
                                paused.insert(p);
                            }
                            Err(e) => {
                                tracing::warn!(partition = p, error = %e, "pausing a partition while a batch runs failed");
                            }
                        }
                    }
                    lock(&self.carried).push(msg.detach());
                }
            }
        }
    }

    /// Whether the group rebalanced since the batch's messages came in (a
    /// change the loop has not applied yet). Called once the batch is
    /// [`closed`](Busy::close): no callback can run after it until the
    /// batch's transaction ends.
    pub(super) fn rebalanced(&self, context: &Context) -> bool {
        context.pending()
    }

    /// Resolves once a poll saw the group rebalance while the batch ran:
    /// judging it further is wasted, it will be dropped.
    pub(super) async fn rebalance(&self) {
        let _ = self.rebalanced.subscribe().wait_for(|r| *r).await;
    }

    /// Resumes the partitions paused while the batch ran (those still
    /// assigned); returns the messages kept, for the next batch.
    pub(super) fn finish(
        &self,
        consumer: &StreamConsumer<Context>,
        topic: &str,
    ) -> Vec<OwnedMessage> {
        self.close();
        self.rebalanced.send_replace(false);
        self.resume(consumer, topic);
        std::mem::take(&mut *lock(&self.carried))
    }

    /// Drops the batch and what came in meanwhile: every assigned partition
    /// that delivered any of it goes back to the first offset it delivered
    /// (the committed one), so all of it is fetched again, in order.
    pub(super) fn rewind(
        &self,
        consumer: &StreamConsumer<Context>,
        topic: &str,
        first: &BTreeMap<i32, i64>,
    ) -> Result<(), Error> {
        self.resume(consumer, topic);
        let mut back = first.clone();
        for msg in lock(&self.carried).drain(..) {
            let o = back.entry(msg.partition()).or_insert(msg.offset());
            *o = (*o).min(msg.offset());
        }
        let assigned = consumer.assignment()?;
        for (&p, &o) in &back {
            if assigned.find_partition(topic, p).is_none() {
                continue;
            }
            if let Err(e) = consumer.seek(topic, p, Offset::Offset(o), Duration::from_secs(10)) {
                return Err(Error::Fatal(format!(
                    "rewinding partition {p} to offset {o} failed ({e}): stopping, so that a \
                     restart resumes from the committed offsets"
                )));
            }
        }
        Ok(())
    }

    fn resume(&self, consumer: &StreamConsumer<Context>, topic: &str) {
        let paused = std::mem::take(&mut *lock(&self.paused));
        if paused.is_empty() {
            return;
        }
        let assigned = match consumer.assignment() {
            Ok(assigned) => assigned,
            Err(e) => {
                tracing::warn!(error = %e, "reading the assignment to resume partitions failed");
                return;
            }
        };
        let mut list = TopicPartitionList::new();
        for p in paused {
            if assigned.find_partition(topic, p).is_some() {
                list.add_partition(topic, p);
            }
        }
        if list.count() > 0
            && let Err(e) = consumer.resume(&list)
        {
            // Tried again when the next batch finishes.
            tracing::warn!(error = %e, "resuming partitions paused while a batch ran failed");
            lock(&self.paused).extend(list.elements().iter().map(|e| e.partition()));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
