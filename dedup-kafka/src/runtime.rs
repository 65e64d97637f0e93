//! The consume -> claim/apply/commit -> store offset loop.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dedup_core::{DedupStore, Outcome};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers as _, Message as _, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::dlq::{self, DeadLetter};
use crate::retry::{Jitter, RetryPolicy};
use crate::{Error, Route};

pub(crate) struct Settings {
    pub(crate) batch_size: usize,
    pub(crate) batch_linger: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) max_concurrent_partitions: usize,
    pub(crate) max_buffered_per_partition: usize,
    pub(crate) commit_interval: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) dead_letter_timeout: Duration,
}

/// Counters of a running consumer.
#[derive(Debug)]
pub struct Stats {
    applied: AtomicU64,
    skipped: AtomicU64,
    dead_lettered: AtomicU64,
    retries: AtomicU64,
    batches: AtomicU64,
    batch_replays: AtomicU64,
    started: Instant,
    /// Milliseconds since `started` of the last assignment, message received
    /// or message finished; `u64::MAX` until the first assignment.
    last_activity_ms: AtomicU64,
    /// Messages handed to partition workers and not yet finished or given
    /// up; while any are, the consumer is not idle however long they take.
    in_flight: AtomicI64,
}

/// A point-in-time copy of [`Stats`]; `Display` prints
/// `applied=N skipped=N dead_lettered=N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Messages whose effect was applied (claims taken and committed).
    pub applied: u64,
    /// Messages skipped as duplicates within the TTL.
    pub skipped: u64,
    /// Messages sent to a dead-letter topic.
    pub dead_lettered: u64,
    /// Retries of transient failures.
    pub retries: u64,
    /// Batches committed as one transaction.
    pub batches: u64,
    /// Batches rolled back and replayed message by message.
    pub batch_replays: u64,
}

impl fmt::Display for StatsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "applied={} skipped={} dead_lettered={}",
            self.applied, self.skipped, self.dead_lettered
        )
    }
}

impl Stats {
    fn new() -> Self {
        Stats {
            applied: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batch_replays: AtomicU64::new(0),
            started: Instant::now(),
            last_activity_ms: AtomicU64::new(u64::MAX),
            in_flight: AtomicI64::new(0),
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            applied: self.applied.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            batch_replays: self.batch_replays.load(Ordering::Relaxed),
        }
    }

    /// How long since a message was last received or finished, or since
    /// partitions were assigned. Zero until the first assignment: joining a
    /// group can take a while (a crashed member is waited for until its
    /// session times out), and that is not idleness. Zero, too, while any
    /// received message is unfinished: a long batch or a message being
    /// retried is work, not idleness.
    pub fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return Duration::ZERO;
        }
        match self.last_activity_ms.load(Ordering::Relaxed) {
            u64::MAX => Duration::ZERO,
            last => self
                .started
                .elapsed()
                .saturating_sub(Duration::from_millis(last)),
        }
    }

    /// `n` messages handed to workers (negative: finished or given up).
    fn in_flight(&self, n: i64) {
        self.in_flight.fetch_add(n, Ordering::AcqRel);
    }

    fn touch(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        let _ = self
            .last_activity_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                (last == u64::MAX || last < now).then_some(now)
            });
    }
}

/// What the runtime knows of one assigned partition.
struct Partition {
    topic: String,
    partition: i32,
    /// Messages handed to the worker and not yet finished.
    queued: AtomicUsize,
    paused: AtomicBool,
    /// Set when the partition is revoked: its worker stops, its offsets are
    /// no longer stored.
    revoked: watch::Sender<bool>,
    sender: mpsc::UnboundedSender<OwnedMessage>,
}

impl Partition {
    fn is_revoked(&self) -> bool {
        *self.revoked.borrow()
    }

    fn tpl(&self) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.topic, self.partition);
        tpl
    }
}

type PartitionMap = Arc<Mutex<HashMap<(String, i32), Arc<Partition>>>>;

fn lock(map: &PartitionMap) -> MutexGuard<'_, HashMap<(String, i32), Arc<Partition>>> {
    map.lock().unwrap_or_else(|p| p.into_inner())
}

/// Rebalance callbacks: they run inside the consumer's poll, on the task
/// that receives messages.
pub(crate) struct Context {
    partitions: PartitionMap,
    stats: Arc<Stats>,
    /// Set once shutdown has made its final commit: the revoke that closing
    /// the consumer triggers must not commit again (a synchronous commit from
    /// inside close can wait forever on a group that is leaving).
    closing: Arc<AtomicBool>,
}

impl ClientContext for Context {}

impl Context {
    fn on_pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                // Stop the workers of the revoked partitions first, so no
                // offset past what is committed here is stored for them.
                // A message in flight still finishes or rolls back; if it
                // commits after this point its offset is not committed, the
                // next owner receives it again and skips it as a duplicate.
                let mut partitions = lock(&self.partitions);
                for elem in tpl.elements() {
                    if let Some(p) = partitions.remove(&(elem.topic().to_owned(), elem.partition()))
                    {
                        p.revoked.send_replace(true);
                    }
                }
                drop(partitions);
                if !self.closing.load(Ordering::Acquire) {
                    commit(consumer, CommitMode::Sync, "revoke");
                }
                tracing::info!(partitions = tpl.count(), "partitions revoked");
            }
            Rebalance::Assign(tpl) => {
                // Idleness counts from having partitions, not from start-up.
                self.stats.touch();
                tracing::info!(
                    partitions = tpl.count(),
                    "partitions assigned; resuming from committed offsets"
                );
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }

    fn on_post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        // A partition paused for back-pressure and then revoked starts its
        // new assignment unpaused: its new worker has an empty buffer.
        if let Rebalance::Assign(tpl) = rebalance
            && let Err(e) = consumer.resume(tpl)
        {
            tracing::debug!(error = %e, "resuming newly assigned partitions");
        }
    }

    fn on_commit(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => tracing::debug!(partitions = offsets.count(), "offsets committed"),
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "offset commit failed; the next commit retries it")
            }
        }
    }
}

/// The callbacks run inside librdkafka (on the thread polling the
/// consumer). A panic must not unwind through it: it leaves the consumer in a
/// state where closing it never completes. So each one is contained.
impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        contained("pre_rebalance", || {
            self.on_pre_rebalance(consumer, rebalance)
        });
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        contained("post_rebalance", || {
            self.on_post_rebalance(consumer, rebalance)
        });
    }

    fn commit_callback(
        &self,
        result: rdkafka::error::KafkaResult<()>,
        offsets: &TopicPartitionList,
    ) {
        contained("commit_callback", || self.on_commit(result, offsets));
    }
}

fn contained(callback: &str, f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        // Logging may be what panicked; stay silent beyond one attempt.
        let _ =
            std::panic::catch_unwind(|| tracing::error!(callback, "a consumer callback panicked"));
    }
}

/// Commits the stored offsets; "nothing to commit" is not an error.
fn commit<C: rdkafka::consumer::Consumer<Ctx>, Ctx: ConsumerContext>(
    consumer: &C,
    mode: CommitMode,
    why: &str,
) {
    match consumer.commit_consumer_state(mode) {
        Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
        Err(e) => tracing::warn!(error = %e, why, "offset commit failed"),
    }
}

/// Everything a partition worker needs, shared.
struct Shared<S> {
    /// Shared with the tasks that run handlers, which hold nothing else of
    /// the runtime, so the consumer is dropped (closed) by `shutdown`.
    store: Arc<S>,
    kafka: StreamConsumer<Context>,
    producer: FutureProducer,
    stats: Arc<Stats>,
    settings: Settings,
    permits: Semaphore,
    stopping: watch::Sender<bool>,
    closing: Arc<AtomicBool>,
    /// Workers report here when a paused partition has drained.
    drained: mpsc::UnboundedSender<(String, i32)>,
}

pub(crate) struct Consumer<S> {
    shared: Arc<Shared<S>>,
    routes: HashMap<String, Arc<Route<S>>>,
    partitions: PartitionMap,
    drained: mpsc::UnboundedReceiver<(String, i32)>,
}

impl<S: DedupStore> Consumer<S> {
    pub(crate) fn new(
        store: S,
        routes: Vec<Route<S>>,
        consumer_config: ClientConfig,
        producer_config: ClientConfig,
        settings: Settings,
    ) -> Result<Self, Error> {
        let partitions = PartitionMap::default();
        let stats = Arc::new(Stats::new());
        let closing = Arc::new(AtomicBool::new(false));
        let kafka: StreamConsumer<Context> = consumer_config.create_with_context(Context {
            partitions: partitions.clone(),
            stats: stats.clone(),
            closing: closing.clone(),
        })?;
        let producer: FutureProducer = producer_config.create()?;
        let (drained_tx, drained) = mpsc::unbounded_channel();
        let permits = Semaphore::new(settings.max_concurrent_partitions);
        Ok(Consumer {
            shared: Arc::new(Shared {
                store: Arc::new(store),
                kafka,
                producer,
                stats,
                settings,
                permits,
                stopping: watch::channel(false).0,
                closing,
                drained: drained_tx,
            }),
            routes: routes
                .into_iter()
                .map(|r| (r.topic.clone(), Arc::new(r)))
                .collect(),
            partitions,
            drained,
        })
    }

    pub(crate) fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    pub(crate) async fn run_until(
        mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<StatsSnapshot, Error> {
        let topics: Vec<&str> = self.routes.keys().map(String::as_str).collect();
        self.shared.kafka.subscribe(&topics)?;
        tracing::info!(?topics, "consumer started");

        let mut workers = JoinSet::new();
        let mut commit_tick = tokio::time::interval(self.shared.settings.commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some((topic, partition)) = self.drained.recv() => self.resume(&topic, partition),
                Some(done) = workers.join_next(), if !workers.is_empty() => {
                    if let Err(e) = done
                        && e.is_panic()
                    {
                        tracing::error!(error = %e, "a partition worker panicked");
                    }
                }
                _ = commit_tick.tick() => commit(&self.shared.kafka, CommitMode::Async, "interval"),
                received = self.shared.kafka.recv() => match received {
                    Ok(msg) => {
                        let msg = msg.detach();
                        self.dispatch(msg, &mut workers);
                    }
                    Err(e) => tracing::warn!(error = %e, "kafka consumer error"),
                },
            }
        }
        let stats = self.shared.stats.clone();
        self.shutdown(workers).await;
        Ok(stats.snapshot())
    }

    /// Hands a message to its partition's worker, starting one if needed.
    fn dispatch(&self, msg: OwnedMessage, workers: &mut JoinSet<()>) {
        self.shared.stats.touch();
        let Some(route) = self.routes.get(msg.topic()) else {
            tracing::warn!(
                topic = msg.topic(),
                "message from a topic without a handler"
            );
            return;
        };
        let key = (msg.topic().to_owned(), msg.partition());
        let mut partitions = lock(&self.partitions);
        let partition = match partitions.get(&key) {
            Some(p) if !p.is_revoked() && !p.sender.is_closed() => p.clone(),
            _ => {
                let (sender, receiver) = mpsc::unbounded_channel();
                let p = Arc::new(Partition {
                    topic: key.0.clone(),
                    partition: key.1,
                    queued: AtomicUsize::new(0),
                    paused: AtomicBool::new(false),
                    revoked: watch::channel(false).0,
                    sender,
                });
                partitions.insert(key, p.clone());
                workers.spawn(worker(
                    self.shared.clone(),
                    route.clone(),
                    p.clone(),
                    receiver,
                ));
                p
            }
        };
        drop(partitions);
        let queued = partition.queued.fetch_add(1, Ordering::AcqRel) + 1;
        self.shared.stats.in_flight(1);
        if partition.sender.send(msg).is_err() {
            // The worker is gone (stopping): the message stays unfinished and
            // its offset unstored, so it is delivered again.
            self.shared.stats.in_flight(-1);
            return;
        }
        if queued >= self.shared.settings.max_buffered_per_partition
            && !partition.paused.swap(true, Ordering::AcqRel)
        {
            // Stop fetching this partition only: the others keep flowing.
            if let Err(e) = self.shared.kafka.pause(&partition.tpl()) {
                tracing::warn!(error = %e, "pausing a partition failed");
                partition.paused.store(false, Ordering::Release);
            }
        }
    }

    fn resume(&self, topic: &str, partition: i32) {
        let partitions = lock(&self.partitions);
        let Some(p) = partitions.get(&(topic.to_owned(), partition)) else {
            return;
        };
        if !p.is_revoked()
            && p.paused.swap(false, Ordering::AcqRel)
            && let Err(e) = self.shared.kafka.resume(&p.tpl())
        {
            tracing::warn!(error = %e, "resuming a partition failed");
        }
    }

    async fn shutdown(self, mut workers: JoinSet<()>) {
        tracing::info!("shutting down: finishing in-flight messages");
        self.shared.stopping.send_replace(true);
        // Dropping the senders ends each worker after its current message.
        lock(&self.partitions).clear();
        let deadline = tokio::time::sleep(self.shared.settings.shutdown_timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                next = workers.join_next() => if next.is_none() { break },
                () = &mut deadline => {
                    tracing::warn!(remaining = workers.len(), "shutdown timeout: abandoning in-flight messages (they will be redelivered)");
                    workers.abort_all();
                    // Aborted workers still have to drop their state.
                    while workers.join_next().await.is_some() {}
                    break;
                }
            }
        }
        commit(&self.shared.kafka, CommitMode::Sync, "shutdown");
        // Dropping the consumer closes it: it leaves the group, which revokes
        // the partitions once more; everything finished is committed already.
        self.shared.closing.store(true, Ordering::Release);
        tracing::info!(stats = %self.shared.stats.snapshot(), "consumer stopped");
        // Workers are gone and handler tasks hold only the store, so this
        // is the last reference: the consumer closes here, while the runtime
        // still runs, not in some task dropped during runtime teardown.
        drop(self);
    }
}

/// Processes one partition's messages strictly in order.
async fn worker<S: DedupStore>(
    shared: Arc<Shared<S>>,
    route: Arc<Route<S>>,
    partition: Arc<Partition>,
    mut receiver: mpsc::UnboundedReceiver<OwnedMessage>,
) {
    let mut jitter = Jitter::new(partition.partition as u64);
    let low_water = shared.settings.max_buffered_per_partition / 2;
    let mut stopping = shared.stopping.subscribe();
    let mut revoked = partition.revoked.subscribe();
    loop {
        // The partition entry (and with it the sender) may outlive this
        // worker's usefulness: stop on shutdown or revoke, not on a closed channel.
        let msg = tokio::select! {
            biased;
            _ = stopping.wait_for(|s| *s) => break,
            _ = revoked.wait_for(|r| *r) => break,
            msg = receiver.recv() => match msg {
                Some(msg) => msg,
                None => break,
            },
        };
        let batch = gather(&mut receiver, msg, &shared.settings).await;
        let finished = if batch.len() == 1 {
            let msg = &batch[0];
            let span = message_span(msg);
            let done = process(&shared, &route, &partition, msg, &mut jitter)
                .instrument(span)
                .await;
            usize::from(done)
        } else {
            process_batch(&shared, &route, &partition, &batch, &mut jitter).await
        };
        if let Some(last) = batch[..finished].last() {
            store_offset(&shared, &partition, last);
            shared.stats.touch();
        }
        // Finished, or (stopped mid-batch) left for redelivery.
        shared.stats.in_flight(-(batch.len() as i64));
        if finished < batch.len() {
            break;
        }
        let left = partition.queued.fetch_sub(batch.len(), Ordering::AcqRel) - batch.len();
        if left <= low_water && partition.paused.load(Ordering::Acquire) {
            let _ = shared
                .drained
                .send((partition.topic.clone(), partition.partition));
        }
    }
    // What is still buffered is given up (redelivered to whoever owns the
    // partition next). Closed first, so a later send fails and is not
    // counted by the dispatcher.
    receiver.close();
    let mut abandoned = 0;
    while receiver.try_recv().is_ok() {
        abandoned += 1;
    }
    shared.stats.in_flight(-abandoned);
    shared.stats.touch();
}

/// Takes `first` and whatever else of the partition arrives within the
/// linger time, up to the batch size.
async fn gather(
    receiver: &mut mpsc::UnboundedReceiver<OwnedMessage>,
    first: OwnedMessage,
    settings: &Settings,
) -> Vec<OwnedMessage> {
    let mut batch = vec![first];
    let deadline = tokio::time::Instant::now() + settings.batch_linger;
    while batch.len() < settings.batch_size {
        match receiver.try_recv() {
            Ok(msg) => batch.push(msg),
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) => {
                match tokio::time::timeout_at(deadline, receiver.recv()).await {
                    Ok(Some(msg)) => batch.push(msg),
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }
    batch
}

/// The span a message is processed in; the core records its dedup key.
fn message_span(msg: &OwnedMessage) -> tracing::Span {
    tracing::info_span!(
        "message",
        topic = msg.topic(),
        partition = msg.partition(),
        offset = msg.offset(),
        dedup.key = tracing::field::Empty,
    )
}

/// A message's headers, owned, for the handler.
fn headers_of(msg: &OwnedMessage) -> Vec<(String, Vec<u8>)> {
    msg.headers()
        .map(|hs| {
            hs.iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs a batch of one partition's messages in one transaction (one claim
/// statement, one commit). If a message cannot be decoded or keyed, or any
/// handler or the store fails, nothing of the batch is committed and it is
/// replayed message by message, so the poison message is isolated (retried
/// or dead-lettered) and every other one is still applied exactly once.
/// Returns how many messages, from the first, are finished.
async fn process_batch<S: DedupStore>(
    shared: &Arc<Shared<S>>,
    route: &Arc<Route<S>>,
    partition: &Partition,
    batch: &[OwnedMessage],
    jitter: &mut Jitter,
) -> usize {
    let span = tracing::info_span!(
        "batch",
        topic = batch[0].topic(),
        partition = batch[0].partition(),
        first_offset = batch[0].offset(),
        last_offset = batch[batch.len() - 1].offset(),
        size = batch.len(),
    );
    let prepared: Result<Vec<_>, _> = batch
        .iter()
        .map(|msg| {
            let headers = headers_of(msg);
            route
                .handler
                .prepare(msg.payload().unwrap_or_default(), &headers)
        })
        .collect();
    let outcome = match prepared {
        Ok(prepared) => {
            let permit = shared.permits.acquire().await.expect("never closed");
            let (store, route) = (shared.store.clone(), route.clone());
            let task = tokio::spawn(
                async move { route.handler.apply_batch(&*store, prepared).await }
                    .instrument(span.clone()),
            );
            let joined = task.await;
            drop(permit);
            match joined {
                Ok(result) => result.map_err(|e| e.to_string()),
                Err(e) => Err(format!("the handler panicked: {e}")),
            }
        }
        Err(e) => Err(format!("message not decodable or without a key: {e}")),
    };
    match outcome {
        Ok(outcomes) => {
            let _enter = span.enter();
            let (mut applied, mut skipped) = (0, 0);
            for (msg, outcome) in batch.iter().zip(&outcomes) {
                let name = outcome.name();
                tracing::debug!(offset = msg.offset(), outcome = name);
                if matches!(outcome, Outcome::Applied { .. }) {
                    applied += 1;
                    failpoint("after-commit");
                } else {
                    skipped += 1;
                }
            }
            shared.stats.applied.fetch_add(applied, Ordering::Relaxed);
            shared.stats.skipped.fetch_add(skipped, Ordering::Relaxed);
            shared.stats.batches.fetch_add(1, Ordering::Relaxed);
            tracing::info!(outcome = "committed", applied, skipped);
            batch.len()
        }
        Err(why) => {
            shared.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            span.in_scope(|| tracing::warn!(error = %why, "batch rolled back; replaying it message by message"));
            for (i, msg) in batch.iter().enumerate() {
                let span = message_span(msg);
                if !process(shared, route, partition, msg, jitter)
                    .instrument(span)
                    .await
                {
                    return i;
                }
            }
            batch.len()
        }
    }
}

/// Marks `msg` finished: its offset + 1 is committed by the next commit.
/// Workers finish messages in order, so no offset is stored past an
/// unfinished message.
fn store_offset<S>(shared: &Shared<S>, partition: &Partition, msg: &OwnedMessage) {
    if partition.is_revoked() {
        return;
    }
    let mut tpl = TopicPartitionList::new();
    if let Err(e) = tpl.add_partition_offset(
        msg.topic(),
        msg.partition(),
        Offset::Offset(msg.offset() + 1),
    ) {
        tracing::warn!(error = %e, "bad offset");
        return;
    }
    if let Err(e) = shared.kafka.store_offsets(&tpl) {
        // The partition was revoked meanwhile: the next owner redelivers and skips it.
        tracing::debug!(error = %e, "offset not stored");
    }
}

/// Runs one message to a final state. Returns `false` if it was abandoned
/// (shutdown or revoke during a retry wait): then its offset is not stored.
async fn process<S: DedupStore>(
    shared: &Arc<Shared<S>>,
    route: &Arc<Route<S>>,
    partition: &Partition,
    msg: &OwnedMessage,
    jitter: &mut Jitter,
) -> bool {
    let headers = Arc::new(headers_of(msg));
    let payload: Arc<[u8]> = msg.payload().unwrap_or_default().into();
    let policy = shared.settings.retry;
    let mut attempt = 0;
    loop {
        attempt += 1;
        // The permit bounds how many partitions run a handler at once; it is
        // held while the handler runs, not while backing off, so retrying
        // partitions do not keep the others waiting.
        let permit = shared.permits.acquire().await.expect("never closed");
        // Its own task, so that a panicking handler fails this message
        // instead of killing the partition.
        let task = {
            let (store, route, payload, headers) = (
                shared.store.clone(),
                route.clone(),
                payload.clone(),
                headers.clone(),
            );
            tokio::spawn(
                async move { route.handler.apply(&*store, &payload, &*headers).await }
                    .instrument(tracing::Span::current()),
            )
        };
        let joined = task.await;
        drop(permit);
        let outcome = match joined {
            Ok(outcome) => outcome,
            Err(e) => {
                let why = DeadLetter {
                    topic: &route.dead_letter_topic,
                    kind: "panic",
                    message: format!("the handler panicked: {e}"),
                    attempts: attempt,
                    handler: route.handler.scope(),
                };
                return dead_letter(shared, partition, msg, why, jitter).await;
            }
        };
        match outcome {
            Outcome::Applied { reclaimed } => {
                shared.stats.applied.fetch_add(1, Ordering::Relaxed);
                tracing::info!(outcome = "applied", reclaimed, attempt);
                failpoint("after-commit");
                return true;
            }
            Outcome::Skipped { .. } => {
                shared.stats.skipped.fetch_add(1, Ordering::Relaxed);
                tracing::info!(outcome = "skipped", "duplicate within the TTL");
                return true;
            }
            Outcome::Failed(e) if e.is_retryable() && attempt < policy.attempts() => {
                shared.stats.retries.fetch_add(1, Ordering::Relaxed);
                let wait = policy.backoff(attempt, jitter.next());
                tracing::warn!(outcome = "retry", attempt, ?wait, kind = e.kind(), error = %e);
                if !wait_unless_stopped(shared, partition, wait).await {
                    return false;
                }
            }
            Outcome::Failed(e) => {
                let why = DeadLetter {
                    topic: &route.dead_letter_topic,
                    kind: e.kind(),
                    message: error_chain(&e),
                    attempts: attempt,
                    handler: route.handler.scope(),
                };
                return dead_letter(shared, partition, msg, why, jitter).await;
            }
        }
    }
}

/// The error and its sources, `: `-separated.
fn error_chain(e: &dedup_core::Error) -> String {
    let mut out = e.to_string();
    for source in dedup_core::chain(e).skip(1) {
        let s = source.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
    }
    out
}

/// Sends `msg` to the dead-letter topic, retrying the produce until the
/// broker acknowledges it: a message is never dropped because its dead
/// letter could not be written.
async fn dead_letter<S: DedupStore>(
    shared: &Shared<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    why: DeadLetter<'_>,
    jitter: &mut Jitter,
) -> bool {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match dlq::send(
            &shared.producer,
            msg,
            &why,
            shared.settings.dead_letter_timeout,
        )
        .await
        {
            Ok(()) => {
                shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    outcome = "dead_lettered",
                    dead_letter_topic = why.topic,
                    kind = why.kind,
                    error = %why.message,
                );
                return true;
            }
            Err(e) => {
                let wait = shared.settings.retry.backoff(attempt, jitter.next());
                tracing::error!(error = %e, ?wait, "producing the dead letter failed; retrying");
                if !wait_unless_stopped(shared, partition, wait).await {
                    return false;
                }
            }
        }
    }
}

/// Sleeps `wait`; `false` if the consumer stops or the partition is revoked
/// meanwhile.
async fn wait_unless_stopped<S>(shared: &Shared<S>, partition: &Partition, wait: Duration) -> bool {
    let mut stopping = shared.stopping.subscribe();
    let mut revoked = partition.revoked.subscribe();
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        _ = stopping.wait_for(|s| *s) => return false,
        _ = revoked.wait_for(|r| *r) => return false,
    }
    !*shared.stopping.borrow() && !partition.is_revoked()
}

/// Test-only crash points: with the `failpoints` feature and
/// `DEDUP_FAILPOINT=<name>` (or `<name>:<n>`, the n-th time) set, the process
/// aborts there, as a crash would.
pub(crate) fn failpoint(name: &str) {
    #[cfg(feature = "failpoints")]
    {
        static HITS: AtomicU64 = AtomicU64::new(0);
        let Ok(spec) = std::env::var("DEDUP_FAILPOINT") else {
            return;
        };
        let (point, nth) = match spec.split_once(':') {
            Some((point, n)) => (point, n.parse::<u64>().unwrap_or(1)),
            None => (spec.as_str(), 1),
        };
        if point == name && HITS.fetch_add(1, Ordering::SeqCst) + 1 >= nth {
            tracing::error!(failpoint = name, "failpoint: aborting the process");
            std::process::abort();
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Completes on SIGINT or SIGTERM: the shutdown [`Consumer::run`](crate::Consumer::run)
/// waits for, to combine with a condition of your own in
/// [`run_until`](crate::Consumer::run_until).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unfinished_messages_are_not_idleness() {
        let stats = Stats::new();
        assert_eq!(stats.idle_for(), Duration::ZERO, "no assignment yet");
        stats.touch();
        stats.in_flight(3);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(stats.idle_for(), Duration::ZERO, "three in flight");
        stats.in_flight(-3);
        assert!(stats.idle_for() >= Duration::from_millis(30));
    }
}
