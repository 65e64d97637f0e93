//! The partition workers: each runs its partition's messages in order, in
//! batches or one by one, retries and dead-letters them, and stores the
//! offsets of those finished.
//!
//! - [`state`]: what the runtime knows of each assigned partition;
//! - this file: what its workers run with, and storing an offset once its
//!   message is finished;
//! - [`worker`]: a partition's worker loop, its queue and its batches'
//!   gathering;
//! - [`apply`]: one batch in one transaction, or one message with its
//!   retries, and what becomes of each message;
//! - [`units`]: the worker under key-ordered concurrency, up to n units
//!   (transactions) at once over a `pipeline::keyed::Window`;
//! - [`due`]: a retry tier's partition waiting for its next record.

mod apply;
mod due;
mod message;
pub(crate) mod state;
mod units;
pub(crate) mod worker;

pub(crate) use due::until_due;

use crate::oauth::TokenContext;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::DedupStore;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::config::Settings;
use crate::database::handover::RebalanceContext;
use crate::pipeline::attempt::{self, Ran};

use self::state::{Gate, Partition};
use crate::stats::Stats;

/// What every partition worker of a consumer runs with: the store, the
/// Kafka clients, the settings, the counters, the stop signal, the permits
/// and the dead-letter gates.
pub(crate) struct Runtime<S> {
    /// Shared with the tasks that run handlers, which hold nothing else of
    /// the runtime, so the consumer is dropped (closed) by `shutdown`.
    pub(crate) store: Arc<S>,
    pub(crate) kafka: StreamConsumer<RebalanceContext>,
    pub(crate) producer: FutureProducer<TokenContext>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) settings: Settings,
    /// The consumer group: the spans' attributes, the scope of key
    /// hold-back's records.
    pub(crate) group: String,
    /// Bounds how many partitions run a handler at once.
    pub(crate) permits: Semaphore,
    pub(crate) stopping: watch::Sender<bool>,
    /// Workers ask the consumer loop here to pause or resume a partition:
    /// only the loop calls librdkafka's pause and resume, so their order is
    /// the order of the requests.
    pub(crate) drained: mpsc::UnboundedSender<(String, i32, Pace)>,
    /// Why the consumer must stop, set by a worker that cannot go on (a
    /// dead-letter topic that cannot be written); the consumer loop is woken
    /// by `fatal_set`.
    pub(crate) fatal: Mutex<Option<String>>,
    pub(crate) fatal_set: tokio::sync::Notify,
    /// Per partition: held while a dead letter is produced and recorded,
    /// taken by a new worker of the partition before it reads the records.
    pub(crate) dead_letter_gates: Mutex<HashMap<(String, i32), Gate>>,
}

/// What a worker asks of the consumer loop for its partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pace {
    /// Its queue is down to half its bound (or a wait for a due record is
    /// over): resume it, unless it waits for a due record or is still full.
    Drained,
    /// It waits for its next record to be due: pause it.
    WaitDue,
}

impl<S> Runtime<S> {
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

impl<S: DedupStore> Runtime<S> {
    /// Runs one handler call of `route`, `call(store)`, holding a permit
    /// until it is done, as its own task in `span` (see [`attempt::run`]):
    /// a panicking or hanging handler fails this call instead of the
    /// partition. Under key-ordered concurrency a lease handler's calls
    /// take no permit: they hold a connection only for their short claim
    /// statements, and their number is the partition's own bound.
    async fn run_handler<Fut>(
        &self,
        span: tracing::Span,
        route: &crate::database::route::Route<S>,
        call: impl FnOnce(Arc<S>) -> Fut,
    ) -> Ran<Fut::Output>
    where
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        let metrics = route.metrics();
        // Every transactional route takes batches; a lease's does not.
        let transaction = route.handler.batches().is_some();
        let bounded = self.settings.pipeline.key_concurrency == 0 || transaction;
        // Held (not `let _ =`, which would release it at once) until the
        // task is joined.
        let _permit = match bounded {
            true => Some(self.permits.acquire().await.expect("never closed")),
            false => None,
        };
        // Timed from here: the wait for a permit is not the transaction's.
        let started = std::time::Instant::now();
        // A transaction is abandoned with its waiter; a lease's call is not
        // (see attempt::run).
        let ran = attempt::run(
            span,
            self.settings.pipeline.attempt_timeout,
            transaction,
            attempt::Start::OwnTask,
            call(self.store.clone()),
        )
        .await;
        metrics.attempt(started.elapsed());
        ran
    }
}

/// Marks `msg` finished: its offset + 1 is committed by the next commit.
/// Workers finish messages in order, so no offset is stored past an
/// unfinished message.
pub(super) fn store_offset<S>(shared: &Runtime<S>, partition: &Partition, msg: &OwnedMessage) {
    store_next(shared, partition, msg.offset() + 1);
}

/// Stores `next` as the partition's offset to commit: every message below
/// it is finished.
pub(super) fn store_next<S>(shared: &Runtime<S>, partition: &Partition, next: i64) {
    if partition.is_revoked() {
        return;
    }
    let mut tpl = TopicPartitionList::new();
    if let Err(e) =
        tpl.add_partition_offset(&partition.topic, partition.partition, Offset::Offset(next))
    {
        tracing::warn!(error = %e, "bad offset");
        return;
    }
    if let Err(e) = shared.kafka.store_offsets(&tpl) {
        // The partition was revoked meanwhile: the next owner redelivers and skips it.
        tracing::debug!(error = %e, "offset not stored");
    }
}

/// Sleeps `wait`; `false` if the consumer stops or the partition is being
/// revoked meanwhile (a message waiting out a failure cannot finish in time
/// for the handover: it is left to the next owner, and the revoke need not
/// wait for it).
pub(crate) async fn wait_unless_stopped<S>(
    shared: &Runtime<S>,
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
