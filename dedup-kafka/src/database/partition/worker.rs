//! A partition's worker: its queue (every message counted in flight is
//! counted out once), its loop, and the gathering of its batches.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use dedup_core::DedupStore;
use rdkafka::message::{Message as _, OwnedMessage};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::config::Settings;
use crate::database::dead_letter::{self as dead_letters};
use crate::database::route::{Pick, TopicRoutes};
use crate::pipeline::ingest::within;
use crate::retry::Jitter;
use crate::stats::Stats;

use super::apply::process_batch;
use super::message::{message_span, process};
use super::state::Partition;
use super::{Runtime, store_offset};

/// A worker's end of its partition's queue. Every message the dispatcher
/// counted in flight is counted out exactly once: when its batch is done,
/// or when the worker ends, however it ends (returns, panics or is aborted
/// at the shutdown timeout), for what it holds and what is still queued.
pub(super) struct Inbox {
    receiver: mpsc::UnboundedReceiver<OwnedMessage>,
    stats: Arc<Stats>,
    /// Received from the queue and not yet counted out.
    held: i64,
}

impl Inbox {
    pub(super) async fn recv(&mut self) -> Option<OwnedMessage> {
        let msg = self.receiver.recv().await;
        self.held += i64::from(msg.is_some());
        msg
    }

    fn is_empty(&self) -> bool {
        self.receiver.is_empty()
    }

    pub(super) fn try_recv(&mut self) -> Result<OwnedMessage, mpsc::error::TryRecvError> {
        let msg = self.receiver.try_recv();
        self.held += i64::from(msg.is_ok());
        msg
    }

    /// `n` held messages are finished, or left for redelivery.
    pub(super) fn done(&mut self, n: usize) {
        let n = n as i64;
        self.held -= n;
        self.stats.add_in_flight(-n);
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        // What is still queued is given up (redelivered to whoever owns the
        // partition next). Closed first, so a later send fails and the
        // dispatcher counts it out itself.
        self.receiver.close();
        let mut queued = 0;
        while self.receiver.try_recv().is_ok() {
            queued += 1;
        }
        self.stats.add_in_flight(-(self.held + queued));
        self.stats.touch();
    }
}

/// Processes one partition's messages strictly in order. On a topic of
/// several event types, each message goes to its type's route; a batch
/// takes consecutive messages of one type.
pub(crate) async fn worker<S: DedupStore>(
    shared: Arc<Runtime<S>>,
    routes: Arc<TopicRoutes<S>>,
    partition: Arc<Partition>,
    receiver: mpsc::UnboundedReceiver<OwnedMessage>,
) {
    let mut inbox = Inbox {
        receiver,
        stats: shared.stats.clone(),
        held: 0,
    };
    // Dropped after the loop, so after every offset this worker stores.
    let _exited = Exited(&partition);
    // A retry tier's partition runs in order, one due record after
    // another: its records wait for their due time at its head.
    if shared.settings.pipeline.key_concurrency > 0 && !routes.in_tier() {
        return super::units::worker(&shared, &routes, &partition, inbox).await;
    }
    let mut jitter = Jitter::new(partition.partition as u64);
    let mut stopping = shared.stopping.subscribe();
    let mut revoked = partition.revoked.subscribe();
    let mut release = partition.release.subscribe();
    // Received, not yet processed: the messages after a batch's last, of
    // another event type than it. They go first, in order.
    let mut carried: VecDeque<OwnedMessage> = VecDeque::new();
    // Per route, the partition's offsets dead-lettered before (by this
    // consumer before a crash, or by its previous owner) whose offsets may
    // not have been committed: read once, before the route's first
    // message, and skipped.
    let mut dead_lettered: Vec<Option<HashSet<String>>> = vec![None; routes.all().len()];
    loop {
        // Messages already waiting (they queued behind the batch before)
        // make the next batch without lingering.
        let idle = carried.is_empty() && inbox.is_empty();
        let msg = match carried.pop_front() {
            Some(msg) => {
                if *stopping.borrow() || *revoked.borrow() || *release.borrow() {
                    break;
                }
                msg
            }
            // The partition entry (and with it the sender) may outlive this
            // worker's usefulness: stop on shutdown or revoke, not on a
            // closed channel.
            None => tokio::select! {
                biased;
                _ = stopping.wait_for(|s| *s) => break,
                _ = revoked.wait_for(|r| *r) => break,
                _ = release.wait_for(|r| *r) => break,
                msg = inbox.recv() => match msg {
                    Some(msg) => msg,
                    None => break,
                },
            },
        };
        let index = match routes.pick(&msg) {
            Pick::Route(index) => index,
            Pick::Ignore(index) => {
                // A type no handler takes, under OtherTypes::Skip: finished.
                routes.all()[index].record(&shared.stats).ignored();
                store_offset(&shared, &partition, &msg);
                shared.stats.touch();
                inbox.done(1);
                counted_out(&shared, &partition, 1);
                continue;
            }
        };
        let route = &routes.all()[index];
        // A retry tier's record not yet due: the partition is paused until
        // it is (one whose tier headers are forged is dead-lettered as it
        // comes, not waited for).
        if route.in_tier()
            && route.forged(&msg).is_none()
            && !super::until_due(&shared, &partition, &msg, route.tier_delay()).await
        {
            break;
        }
        // Only a transactional handler takes batches; a lease-mode one
        // takes its messages one at a time.
        // Under key hold-back a tier's records go one at a time: each reads
        // its key's hold from the store.
        let batcher = route
            .handler
            .batches()
            .filter(|_| !(route.in_tier() && route.holds_keys()))
            .cloned();
        let batch = match batcher {
            Some(_) => {
                // In a tier, a batch takes only records already due.
                let in_tier = route.in_tier();
                let same = |m: &OwnedMessage| {
                    matches!(routes.pick(m), Pick::Route(i) if i == index)
                        && (!in_tier || crate::tiers::due_in(m, route.tier_delay()).is_zero())
                };
                gather(&mut inbox, &mut carried, msg, idle, &shared.settings, same).await
            }
            None => vec![msg],
        };
        partition
            .busy_since_ms
            .store(shared.stats.clock_ms(), Ordering::Release);
        if dead_lettered[index].is_none() {
            let from = batch[0].offset();
            dead_lettered[index] =
                dead_letters::recorded(&shared, route, &partition, from, &mut jitter).await;
            if dead_lettered[index].is_none() {
                // Stopped while the store was unreachable.
                inbox.done(batch.len());
                break;
            }
        }
        let known = dead_lettered[index].as_ref().expect("read above");
        let finished = run_unit(&shared, route, &partition, &batch, known, &mut jitter).await;
        if let Some(last) = batch[..finished].last() {
            store_offset(&shared, &partition, last);
            shared.stats.touch();
        }
        partition.busy_since_ms.store(u64::MAX, Ordering::Release);
        // Finished, or (stopped mid-batch) left for redelivery.
        inbox.done(batch.len());
        if finished < batch.len() {
            break;
        }
        counted_out(&shared, &partition, batch.len());
    }
}

/// Runs `batch`, messages of `route` (all of distinct ordering keys):
/// in one transaction if it has several and the route takes batches, else
/// its one message with its retries. Returns how many messages, from the
/// first, are finished; fewer than all only when it stopped.
pub(super) async fn run_unit<S: DedupStore>(
    shared: &Arc<Runtime<S>>,
    route: &Arc<crate::database::route::Route<S>>,
    partition: &Partition,
    batch: &[OwnedMessage],
    dead_lettered: &HashSet<String>,
    jitter: &mut Jitter,
) -> usize {
    if let (Some(batcher), true) = (route.handler.batches(), batch.len() > 1) {
        return process_batch(
            shared,
            route,
            batcher,
            partition,
            batch,
            dead_lettered,
            jitter,
        )
        .await;
    }
    // One message (a batch of one, or a lease-mode route's).
    let msg = &batch[0];
    let done = if let Some(before) = route.finished_before(dead_lettered, msg) {
        dead_letters::skip(shared, route, msg, before);
        true
    } else {
        let processing =
            process(shared, route, partition, msg, jitter).instrument(message_span(msg));
        #[cfg(feature = "opentelemetry")]
        let processing = opentelemetry::context::FutureExt::with_context(
            processing,
            crate::otel::process(msg, &shared.group),
        );
        processing.await
    };
    usize::from(done)
}

/// `n` messages of the partition are finished: its queue is that much
/// shorter, and fetching resumes once it is down to half its bound.
pub(super) fn counted_out<S: DedupStore>(shared: &Runtime<S>, partition: &Partition, n: usize) {
    let low_water = shared.settings.max_buffered_per_partition / 2;
    let left = partition.queued.fetch_sub(n, Ordering::SeqCst) - n;
    if left <= low_water && partition.paused.load(Ordering::SeqCst) {
        let _ = shared.drained.send((
            partition.topic.clone(),
            partition.partition,
            super::Pace::Drained,
        ));
    }
}

/// Marks the partition's worker ended when dropped.
struct Exited<'a>(&'a Partition);

impl Drop for Exited<'_> {
    fn drop(&mut self) {
        self.0.exited.store(true, Ordering::Release);
    }
}

/// Takes `first` and what else of the partition is queued (`carried`
/// first, then the inbox), as the shared
/// [`Batching`](crate::pipeline::ingest::Batching) says: only a partition
/// that was `idle` (nothing queued when the worker began waiting for
/// `first`) lingers for more. The batch ends before the first message
/// that is not the `same` route's: that one, and all after it, are carried
/// to the next batch, in order.
async fn gather(
    receiver: &mut Inbox,
    carried: &mut VecDeque<OwnedMessage>,
    first: OwnedMessage,
    idle: bool,
    settings: &Settings,
    same: impl Fn(&OwnedMessage) -> bool,
) -> Vec<OwnedMessage> {
    let mut gathering = settings.pipeline.batching.start(idle);
    gathering.took(&first);
    let mut batch = vec![first];
    while let Some(wait) = gathering.wait(batch.len()) {
        let next = match carried.pop_front() {
            Some(msg) => msg,
            None => match within(wait, receiver.recv()).await {
                Some(Some(msg)) => msg,
                Some(None) | None => break,
            },
        };
        if !same(&next) {
            carried.push_front(next);
            break;
        }
        gathering.took(&next);
        batch.push(next);
    }
    batch
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use rdkafka::Timestamp;

    fn message(offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            None,
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            offset,
            None,
        )
    }

    /// A worker that dies mid-batch (a panic, or the shutdown timeout
    /// aborting it) must not leave its messages counted in flight: the
    /// consumer would never look idle again.
    #[test]
    fn an_inbox_counts_out_what_it_holds_and_what_is_queued_when_dropped() {
        let stats = Arc::new(Stats::new());
        let (sender, receiver) = mpsc::unbounded_channel();
        for offset in 0..5 {
            stats.add_in_flight(1);
            sender.send(message(offset)).unwrap();
        }
        let mut inbox = Inbox {
            receiver,
            stats: stats.clone(),
            held: 0,
        };
        for _ in 0..3 {
            inbox.try_recv().unwrap();
        }
        inbox.done(1);
        assert_eq!(stats.in_flight(), 4);
        drop(inbox);
        assert_eq!(stats.in_flight(), 0);
        assert!(sender.send(message(9)).is_err(), "closed on drop");
    }

    fn inbox_of(n: i64) -> (mpsc::UnboundedSender<OwnedMessage>, Inbox) {
        let stats = Arc::new(Stats::new());
        let (sender, receiver) = mpsc::unbounded_channel();
        for offset in 0..n {
            stats.add_in_flight(1);
            sender.send(message(offset)).unwrap();
        }
        let inbox = Inbox {
            receiver,
            stats,
            held: 0,
        };
        (sender, inbox)
    }

    fn lingering(linger: Duration) -> Settings {
        let mut settings = Settings::default();
        settings.pipeline.batching.linger = linger;
        settings
    }

    /// Messages that queued behind a running batch are the next batch at
    /// once, even one alone: at steady load, lingering made every batch
    /// wait the whole linger on top of the one before.
    #[tokio::test]
    async fn a_busy_partition_takes_what_is_queued_without_lingering() {
        let settings = lingering(Duration::from_secs(30));
        for queued in [3, 1] {
            let (_sender, mut inbox) = inbox_of(queued);
            // As the worker sees it before waiting for its next message.
            let idle = inbox.is_empty();
            let first = inbox.recv().await.unwrap();
            let mut carried = VecDeque::new();
            let gathering = gather(&mut inbox, &mut carried, first, idle, &settings, |_| true);
            let batch = tokio::time::timeout(Duration::from_secs(5), gathering)
                .await
                .expect("a busy partition's batch must not wait for the linger");
            let offsets: Vec<i64> = batch.iter().map(|m| m.offset()).collect();
            assert_eq!(offsets, (0..queued).collect::<Vec<_>>());
        }
    }

    /// Large records make smaller batches: a batch is full once its keys
    /// and payloads reach `batch_bytes`; the rest stay queued, in order.
    #[tokio::test]
    async fn large_records_fill_a_batch_by_bytes() {
        let (sender, mut inbox) = inbox_of(0);
        for offset in 0..5 {
            inbox.stats.add_in_flight(1);
            let payload = Some(vec![b'x'; 100]);
            let msg = OwnedMessage::new(
                payload,
                None,
                "t".into(),
                Timestamp::NotAvailable,
                0,
                offset,
                None,
            );
            sender.send(msg).unwrap();
        }
        let mut settings = lingering(Duration::ZERO);
        settings.pipeline.batching.bytes = 250;
        let first = inbox.recv().await.unwrap();
        let mut carried = VecDeque::new();
        let batch = gather(&mut inbox, &mut carried, first, false, &settings, |_| true).await;
        let offsets: Vec<i64> = batch.iter().map(|m| m.offset()).collect();
        assert_eq!(offsets, [0, 1, 2], "300 bytes reach the 250 allowed");
        let next = inbox.recv().await.unwrap();
        assert_eq!(next.offset(), 3, "the rest stay queued");
    }

    /// An idle partition's first message waits for company, up to the
    /// linger: what arrives meanwhile joins its batch.
    #[tokio::test]
    async fn an_idle_partition_waits_the_linger_for_more() {
        let (sender, mut inbox) = inbox_of(0);
        let stats = inbox.stats.clone();
        let idle = inbox.is_empty();
        stats.add_in_flight(1);
        sender.send(message(0)).unwrap();
        let first = inbox.recv().await.unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            stats.add_in_flight(1);
            sender.send(message(1)).unwrap();
            // Held open until the linger would have ended, so the batch
            // ends on the linger or the batch size, not on a closed queue.
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        let mut settings = lingering(Duration::from_secs(30));
        settings.pipeline.batching.size = 2;
        let mut carried = VecDeque::new();
        let gathering = gather(&mut inbox, &mut carried, first, idle, &settings, |_| true);
        let batch = tokio::time::timeout(Duration::from_secs(5), gathering)
            .await
            .expect("the second message arrives within the linger");
        assert_eq!(batch.len(), 2);

        let started = tokio::time::Instant::now();
        let (held, mut inbox) = inbox_of(0);
        inbox.stats.add_in_flight(1);
        held.send(message(0)).unwrap();
        let first = inbox.recv().await.unwrap();
        let linger = lingering(Duration::from_millis(200));
        let batch = gather(
            &mut inbox,
            &mut VecDeque::new(),
            first,
            true,
            &linger,
            |_| true,
        )
        .await;
        assert_eq!(batch.len(), 1);
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "alone, it waited the linger out"
        );
    }
}
