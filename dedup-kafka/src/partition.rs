//! The partition workers: each runs its partition's messages in order, in
//! batches or one by one, retries and dead-letters them, and stores the
//! offsets of those finished.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dedup_core::{DedupStore, Outcome};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{Semaphore, mpsc, watch};
use tracing::Instrument;

use crate::config::{OnFingerprintMismatch, Settings};
use crate::dead_letter::{self as dead_letters, dead_letter};
use crate::failpoint::failpoint;
use crate::metrics::RetryReason;
use crate::pipeline::attempt::{self, AttemptTimedOut, Ran};
use crate::pipeline::decision::{Decision, Fault};
use crate::pipeline::outage::Retrying;
use crate::pipeline::{error_chain, headers_of};
use crate::rebalance::RebalanceContext;
use crate::retry::Jitter;
use crate::route::Route;
use crate::stats::Stats;

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

    /// A duplicate was skipped: counts it as a redelivery if nothing has been
    /// applied since the assignment began.
    fn skipped<S: 'static>(&self, shared: &Shared<S>, route: &Route<S>) {
        if self.fresh.load(Ordering::Relaxed) {
            shared.stats.redelivered.fetch_add(1, Ordering::Relaxed);
            route.metrics().redelivered();
        }
    }

    /// An event was applied: later duplicates are not redeliveries.
    fn applied(&self) {
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

/// Everything a partition worker needs, shared.
pub(crate) struct Shared<S> {
    /// Shared with the tasks that run handlers, which hold nothing else of
    /// the runtime, so the consumer is dropped (closed) by `shutdown`.
    pub(crate) store: Arc<S>,
    pub(crate) kafka: StreamConsumer<RebalanceContext>,
    pub(crate) producer: FutureProducer,
    pub(crate) stats: Arc<Stats>,
    pub(crate) settings: Settings,
    /// Bounds how many partitions run a handler at once.
    pub(crate) permits: Semaphore,
    pub(crate) stopping: watch::Sender<bool>,
    pub(crate) closing: Arc<AtomicBool>,
    /// Workers report here when a paused partition has drained.
    pub(crate) drained: mpsc::UnboundedSender<(String, i32)>,
    /// Why the consumer must stop, set by a worker that cannot go on (a
    /// dead-letter topic that cannot be written); the consumer loop is woken
    /// by `fatal_set`.
    pub(crate) fatal: Mutex<Option<String>>,
    pub(crate) fatal_set: tokio::sync::Notify,
    /// Per partition: held while a dead letter is produced and recorded,
    /// taken by a new worker of the partition before it reads the records.
    pub(crate) dead_letter_gates: Mutex<HashMap<(String, i32), Gate>>,
}

impl<S> Shared<S> {
    /// The dead-letter gate of a partition.
    pub(crate) fn dead_letter_gate(
        &self,
        topic: &str,
        partition: i32,
    ) -> Arc<tokio::sync::Mutex<()>> {
        let mut gates = self
            .dead_letter_gates
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        gates
            .entry((topic.to_owned(), partition))
            .or_default()
            .clone()
    }

    /// Stops the consumer with an error (the first reason wins).
    pub(crate) fn fail(&self, why: String) {
        let mut fatal = self.fatal.lock().unwrap_or_else(|p| p.into_inner());
        if fatal.is_none() {
            tracing::error!(error = %why, "stopping the consumer");
            *fatal = Some(why);
        }
        self.fatal_set.notify_one();
    }
}

impl<S: DedupStore> Shared<S> {
    /// Runs one handler call, `call(store)`, holding a permit until it is
    /// done, as its own task in `span` (see [`attempt::run`]): a panicking
    /// or hanging handler fails this call instead of the partition.
    async fn run_handler<Fut>(
        &self,
        span: tracing::Span,
        metrics: &crate::metrics::RouteMetrics,
        call: impl FnOnce(Arc<S>) -> Fut,
    ) -> Ran<Fut::Output>
    where
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        // Held (not `let _ =`, which would release it at once) until the
        // task is joined.
        let _permit = self.permits.acquire().await.expect("never closed");
        // Timed from here: the wait for a permit is not the transaction's.
        let started = std::time::Instant::now();
        let ran = attempt::run(
            span,
            self.settings.attempt_timeout,
            call(self.store.clone()),
        )
        .await;
        metrics.attempt(started.elapsed());
        ran
    }
}

/// A worker's end of its partition's queue. Every message the dispatcher
/// counted in flight is counted out exactly once: when its batch is done,
/// or when the worker ends, however it ends (returns, panics or is aborted
/// at the shutdown timeout), for what it holds and what is still queued.
struct Inbox {
    receiver: mpsc::UnboundedReceiver<OwnedMessage>,
    stats: Arc<Stats>,
    /// Received from the queue and not yet counted out.
    held: i64,
}

impl Inbox {
    async fn recv(&mut self) -> Option<OwnedMessage> {
        let msg = self.receiver.recv().await;
        self.held += i64::from(msg.is_some());
        msg
    }

    fn is_empty(&self) -> bool {
        self.receiver.is_empty()
    }

    fn try_recv(&mut self) -> Result<OwnedMessage, mpsc::error::TryRecvError> {
        let msg = self.receiver.try_recv();
        self.held += i64::from(msg.is_ok());
        msg
    }

    /// `n` held messages are finished, or left for redelivery.
    fn done(&mut self, n: usize) {
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

/// Processes one partition's messages strictly in order.
pub(crate) async fn worker<S: DedupStore>(
    shared: Arc<Shared<S>>,
    route: Arc<Route<S>>,
    partition: Arc<Partition>,
    receiver: mpsc::UnboundedReceiver<OwnedMessage>,
) {
    let mut inbox = Inbox {
        receiver,
        stats: shared.stats.clone(),
        held: 0,
    };
    let mut jitter = Jitter::new(partition.partition as u64);
    let low_water = shared.settings.max_buffered_per_partition / 2;
    // Dropped after the loop, so after every offset this worker stores.
    let _exited = Exited(&partition);
    let mut stopping = shared.stopping.subscribe();
    let mut revoked = partition.revoked.subscribe();
    let mut release = partition.release.subscribe();
    // The partition's offsets dead-lettered before (by this consumer before
    // a crash, or by its previous owner) whose offsets may not have been
    // committed: read once, before the first message, and skipped.
    let mut dead_lettered = None;
    loop {
        // Messages already waiting (they queued behind the batch before)
        // make the next batch without lingering.
        let idle = inbox.is_empty();
        // The partition entry (and with it the sender) may outlive this
        // worker's usefulness: stop on shutdown or revoke, not on a closed channel.
        let msg = tokio::select! {
            biased;
            _ = stopping.wait_for(|s| *s) => break,
            _ = revoked.wait_for(|r| *r) => break,
            _ = release.wait_for(|r| *r) => break,
            msg = inbox.recv() => match msg {
                Some(msg) => msg,
                None => break,
            },
        };
        let batch = if route.handler.batches() {
            gather(&mut inbox, msg, idle, &shared.settings).await
        } else {
            vec![msg]
        };
        partition
            .busy_since_ms
            .store(shared.stats.clock_ms(), Ordering::Release);
        if dead_lettered.is_none() {
            let from = batch[0].offset();
            dead_lettered =
                dead_letters::recorded(&shared, &route, &partition, from, &mut jitter).await;
            if dead_lettered.is_none() {
                // Stopped while the store was unreachable.
                inbox.done(batch.len());
                break;
            }
        }
        let known = dead_lettered.as_ref().expect("read above");
        let finished = if batch.len() == 1 {
            let msg = &batch[0];
            let done = if was_dead_lettered(&route, known, msg) {
                dead_letters::skip(&shared, &route, msg);
                true
            } else {
                process(&shared, &route, &partition, msg, &mut jitter)
                    .instrument(message_span(msg))
                    .await
            };
            usize::from(done)
        } else {
            process_batch(&shared, &route, &partition, &batch, known, &mut jitter).await
        };
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
        let left = partition.queued.fetch_sub(batch.len(), Ordering::SeqCst) - batch.len();
        if left <= low_water && partition.paused.load(Ordering::SeqCst) {
            let _ = shared
                .drained
                .send((partition.topic.clone(), partition.partition));
        }
    }
}

/// Marks the partition's worker ended when dropped.
struct Exited<'a>(&'a Partition);

impl Drop for Exited<'_> {
    fn drop(&mut self) {
        self.0.exited.store(true, Ordering::Release);
    }
}

/// Whether `msg` is one of the partition's messages dead-lettered before.
fn was_dead_lettered<S: 'static>(
    route: &Route<S>,
    known: &HashSet<String>,
    msg: &OwnedMessage,
) -> bool {
    !known.is_empty() && known.contains(route.dead_letter_record(msg).id())
}

/// Takes `first` and what else of the partition is queued, up to the batch
/// size. Only a partition that was `idle` (nothing queued when the worker
/// began waiting for `first`) waits for more, up to the linger time:
/// messages that queued behind a running batch are a batch already, even
/// one alone, and lingering would only add to their wait (at steady load
/// every batch would wait the whole linger).
async fn gather(
    receiver: &mut Inbox,
    first: OwnedMessage,
    idle: bool,
    settings: &Settings,
) -> Vec<OwnedMessage> {
    let mut batch = vec![first];
    let deadline = tokio::time::Instant::now() + settings.batch_linger;
    while batch.len() < settings.batch_size {
        match receiver.try_recv() {
            Ok(msg) => batch.push(msg),
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) if !idle => break,
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
    dead_lettered: &HashSet<String>,
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
    // Decoding and keys are known before any transaction: a message that
    // fails them is the event's fault and is dead-lettered, and the rest
    // still go as one batch (no replay at per-message speed). The batch
    // commits first, then the bad ones are dead-lettered in offset order: a
    // stop or a crash in between leaves the bad ones to be dead-lettered by
    // their redelivery, once, and the good ones to be skipped.
    let mut members = Vec::with_capacity(batch.len());
    let mut prepared = Vec::with_capacity(batch.len());
    let mut bad = Vec::new();
    for (i, msg) in batch.iter().enumerate() {
        if was_dead_lettered(route, dead_lettered, msg) {
            bad.push((i, Unprepared::DeadLettered));
            continue;
        }
        let headers = headers_of(msg);
        // User code (a Deserialize impl, a key's Display, a custom decode):
        // a panic fails this message, never the worker, which would drop
        // everything it buffered.
        let payload = msg.payload().unwrap_or_default();
        match attempt::contained(|| route.handler.prepare(payload, &headers)) {
            Ok(Ok(ready)) => {
                members.push(i);
                prepared.push(ready);
            }
            Ok(Err(e)) => bad.push((i, Unprepared::Error(e))),
            Err(said) => bad.push((
                i,
                Unprepared::Panic(format!(
                    "decoding the event or reading its key panicked: {said}"
                )),
            )),
        }
    }
    let committed = if prepared.is_empty() {
        Ok(Vec::new())
    } else {
        route.metrics().batch(prepared.len());
        let joined = {
            let task_route = route.clone();
            shared
                .run_handler(span.clone(), route.metrics(), move |store| async move {
                    task_route.handler.apply_batch(&*store, prepared).await
                })
                .await
        };
        match joined {
            Ran::Done(result) => result.map_err(|e| e.to_string()),
            Ran::Panicked(said) => Err(format!("the handler panicked: {said}")),
            Ran::TimedOut(limit) => Err(AttemptTimedOut(limit).to_string()),
        }
    };
    match committed {
        Ok(outcomes) => {
            if !outcomes.is_empty() {
                let _enter = span.enter();
                let (mut applied, mut skipped) = (0, 0);
                for (&i, outcome) in members.iter().zip(outcomes) {
                    let name = outcome.name();
                    tracing::debug!(offset = batch[i].offset(), outcome = name);
                    match outcome {
                        Outcome::Applied { reclaimed } => {
                            applied += 1;
                            partition.applied();
                            route.record(&shared.stats).applied(reclaimed);
                            failpoint("after-commit");
                        }
                        Outcome::Skipped { age, .. } => {
                            skipped += 1;
                            partition.skipped(shared, route);
                            route.record(&shared.stats).skipped(age);
                        }
                        // Neither applied nor skipped: dead-lettered after
                        // the commit, in offset order with the others.
                        Outcome::Failed(e @ dedup_core::Error::FingerprintMismatch { .. }) => {
                            let _enter = message_span(&batch[i]).entered();
                            if skips_mismatch(shared, route, &e) {
                                skipped += 1;
                            } else {
                                bad.push((i, Unprepared::Error(e)));
                            }
                        }
                        Outcome::Failed(_) => {
                            // A committed batch has no other failure; were
                            // there one, its message is finished all the same.
                            debug_assert!(false, "a failure in a committed batch");
                            skipped += 1;
                            shared.stats.skipped.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                bad.sort_by_key(|(i, _)| *i);
                shared.stats.store_answered();
                shared.stats.batches.fetch_add(1, Ordering::Relaxed);
                tracing::info!(outcome = "committed", applied, skipped);
            }
            for (i, e) in bad {
                let msg = &batch[i];
                if !dead_letter_unprepared(shared, route, partition, msg, &e, jitter).await {
                    // Everything before it is finished: applied, or dead-lettered.
                    return i;
                }
            }
            batch.len()
        }
        Err(why) => {
            shared.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            span.in_scope(|| tracing::warn!(error = %why, "batch rolled back; replaying it message by message"));
            // In offset order: each good one on its own, each bad one to the
            // dead-letter topic.
            let mut bad = bad.into_iter().peekable();
            for (i, msg) in batch.iter().enumerate() {
                let finished = match bad.next_if(|(b, _)| *b == i) {
                    Some((_, e)) => {
                        dead_letter_unprepared(shared, route, partition, msg, &e, jitter).await
                    }
                    None => {
                        process(shared, route, partition, msg, jitter)
                            .instrument(message_span(msg))
                            .await
                    }
                };
                if !finished {
                    return i;
                }
            }
            batch.len()
        }
    }
}

/// Why a message of a batch could not be prepared.
enum Unprepared {
    /// It cannot be decoded or has no key, or (found by the batch's claim)
    /// its content differs from its claim's.
    Error(dedup_core::Error),
    /// Decoding it or reading its key panicked.
    Panic(String),
    /// It was dead-lettered before (a redelivery): skipped.
    DeadLettered,
}

/// Dead-letters a message that could not be prepared.
async fn dead_letter_unprepared<S: DedupStore>(
    shared: &Shared<S>,
    route: &Route<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    unprepared: &Unprepared,
    jitter: &mut Jitter,
) -> bool {
    let (kind, message) = match unprepared {
        Unprepared::Error(e) => (e.kind(), error_chain(e)),
        Unprepared::Panic(message) => ("panic", message.clone()),
        Unprepared::DeadLettered => {
            dead_letters::skip(shared, route, msg);
            return true;
        }
    };
    let why = route.dead_letter(kind, message, 1);
    dead_letter(shared, route, partition, msg, why, jitter)
        .instrument(message_span(msg))
        .await
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
    // Every attempt, for logs and the dead letter's header.
    let mut attempt = 0;
    // The failures so far, by whose fault: the pipeline's decision rules.
    let mut retrying = Retrying::new(&shared.stats, policy);
    // Looks at another holder's lease (lease mode), for the back-off.
    let mut lease_waits = 0;
    loop {
        attempt += 1;
        // The permit is held while the handler runs, not while backing off,
        // so retrying partitions do not keep the others waiting. A panicking
        // handler fails this message instead of killing the partition.
        let joined = {
            let (task_route, payload, headers) = (route.clone(), payload.clone(), headers.clone());
            shared
                .run_handler(
                    tracing::Span::current(),
                    route.metrics(),
                    move |store| async move {
                        task_route.handler.apply(&*store, &payload, &*headers).await
                    },
                )
                .await
        };
        let (outcome, fault) = match joined {
            Ran::Done(outcome) => (outcome, None),
            // A frozen database makes attempts hang rather than fail: the
            // environment's fault, waited out, never dead-lettered. Until
            // the abandoned attempt's rollback reaches the database it holds
            // the claim's lock: the lock timeouts that follow are contention,
            // waited out too.
            Ran::TimedOut(limit) => (
                Outcome::Failed(dedup_core::Error::Store(attempt::timed_out(limit))),
                Some(Fault::TimedOut),
            ),
            Ran::Panicked(said) => (
                Outcome::Failed(attempt::panicked(&said)),
                Some(Fault::Panic),
            ),
        };
        match outcome {
            Outcome::Applied { reclaimed } => {
                shared.stats.store_answered();
                partition.applied();
                route.record(&shared.stats).applied(reclaimed);
                tracing::info!(outcome = "applied", reclaimed, attempt);
                failpoint("after-commit");
                return true;
            }
            Outcome::Skipped { age, .. } => {
                shared.stats.store_answered();
                partition.skipped(shared, route);
                route.record(&shared.stats).skipped(age);
                tracing::info!(outcome = "skipped", "duplicate within the TTL");
                return true;
            }
            Outcome::Failed(dedup_core::Error::LeaseHeld {
                key,
                expires_at,
                token,
            }) => {
                // Lease mode: another holder's effect may be under way. Not
                // the event's fault and bounded by the lease: look again
                // with back-off, never later than the lease's end, without
                // using up attempts or counting as an outage.
                lease_waits += 1;
                route
                    .record(&shared.stats)
                    .retried_because(RetryReason::LeaseHeld);
                let until_expiry = expires_at
                    .duration_since(std::time::SystemTime::now())
                    .unwrap_or_default();
                let wait = policy
                    .backoff(lease_waits, jitter.next())
                    .min(until_expiry + Duration::from_millis(50))
                    .max(Duration::from_millis(20));
                if lease_waits == 1 {
                    tracing::info!(outcome = "waiting", %key, token, ?until_expiry, "another holder's lease covers this event");
                }
                if !wait_unless_stopped(shared, partition, wait).await {
                    return false;
                }
            }
            Outcome::Failed(dedup_core::Error::LeaseLost { key, token }) => {
                // The effect ran, but its lease had expired and a newer
                // holder took the claim over: that holder finishes the event.
                shared.stats.store_answered();
                route.record(&shared.stats).lease_lost();
                tracing::warn!(outcome = "skipped", %key, token, "the lease was taken over before the effect completed: extend long effects (lease.extend()) or lengthen the lease");
                return true;
            }
            Outcome::Failed(e @ dedup_core::Error::FingerprintMismatch { .. })
                if skips_mismatch(shared, route, &e) =>
            {
                shared.stats.store_answered();
                return true;
            }
            Outcome::Failed(e) => {
                let fault = fault.unwrap_or_else(|| Fault::of(&e));
                let wait = match retrying.failed(fault, &e, jitter.next()) {
                    Decision::DeadLetter => {
                        let why = route.dead_letter(fault.kind(&e), error_chain(&e), attempt);
                        return dead_letter(shared, route, partition, msg, why, jitter).await;
                    }
                    Decision::Stop { failing_for } => {
                        // This message stays uncommitted for the next run.
                        shared.fail(retrying.outlasted(failing_for, &e));
                        return false;
                    }
                    Decision::Retry(wait) => {
                        tracing::warn!(outcome = "retry", attempt, ?wait, kind = e.kind(), error = %e);
                        wait
                    }
                    Decision::WaitOut(wait) => {
                        // Logged once at the outage's start and end (Stats).
                        tracing::debug!(outcome = "waiting", attempt, ?wait, kind = e.kind(), error = %e);
                        wait
                    }
                };
                route.record(&shared.stats).retried(fault, &e);
                if !wait_unless_stopped(shared, partition, wait).await {
                    return false;
                }
            }
        }
    }
}

/// Counts a duplicate whose content differs from its claim's and says
/// whether it is skipped (`on_fingerprint_mismatch(Skip)`, logged with its
/// key) rather than dead-lettered (the default).
fn skips_mismatch<S: 'static>(
    shared: &Shared<S>,
    route: &Route<S>,
    error: &dedup_core::Error,
) -> bool {
    let skip = shared.settings.on_fingerprint_mismatch == OnFingerprintMismatch::Skip;
    route.record(&shared.stats).fingerprint_mismatch(skip);
    if skip {
        tracing::warn!(outcome = "skipped", kind = error.kind(), error = %error, "skipped as on_fingerprint_mismatch says");
    }
    skip
}

/// Sleeps `wait`; `false` if the consumer stops or the partition is being
/// revoked meanwhile (a message waiting out a failure cannot finish in time
/// for the handover: it is left to the next owner, and the revoke need not
/// wait for it).
pub(crate) async fn wait_unless_stopped<S>(
    shared: &Shared<S>,
    partition: &Partition,
    wait: Duration,
) -> bool {
    let mut stopping = shared.stopping.subscribe();
    let mut revoked = partition.revoked.subscribe();
    let mut release = partition.release.subscribe();
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        _ = stopping.wait_for(|s| *s) => return false,
        _ = revoked.wait_for(|r| *r) => return false,
        _ = release.wait_for(|r| *r) => return false,
    }
    !*shared.stopping.borrow() && !partition.is_revoked() && !*partition.release.borrow()
}

#[cfg(test)]
mod tests {
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
        Settings {
            batch_linger: linger,
            ..Settings::default()
        }
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
            let gathering = gather(&mut inbox, first, idle, &settings);
            let batch = tokio::time::timeout(Duration::from_secs(5), gathering)
                .await
                .expect("a busy partition's batch must not wait for the linger");
            let offsets: Vec<i64> = batch.iter().map(|m| m.offset()).collect();
            assert_eq!(offsets, (0..queued).collect::<Vec<_>>());
        }
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
        let settings = Settings {
            batch_size: 2,
            ..lingering(Duration::from_secs(30))
        };
        let gathering = gather(&mut inbox, first, idle, &settings);
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
        let batch = gather(&mut inbox, first, true, &linger).await;
        assert_eq!(batch.len(), 1);
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "alone, it waited the linger out"
        );
    }
}
