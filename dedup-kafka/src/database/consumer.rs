//! The consumer loop: receives messages and hands each to its partition's
//! worker, pauses and resumes partitions for back-pressure, commits offsets
//! on an interval, and shuts down gracefully.

use crate::oauth::TokenContext;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use dedup_core::DedupStore;
use rdkafka::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::producer::Producer as _;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use crate::Error;
use crate::config::Settings;
use crate::database::handover::{HandOver, RebalanceContext, commit};
use crate::database::partition::Runtime;
use crate::database::partition::state::{Partition, PartitionMap, held_paused, lock};
use crate::database::partition::worker::worker;
use crate::database::route::TopicRoutes;
use crate::metrics::ConsumerGauges;
use crate::pipeline::fatal_error;
use crate::pipeline::membership::Membership;
use crate::pipeline::membership::resume_assigned;
use crate::shutdown::shutdown_signal;
use crate::stats::{Stats, StatsSnapshot};

/// An idempotent Kafka consumer: runs each message through its topic's
/// `#[idempotent]` handler and commits its offset only once the handler's
/// transaction has committed (or the message was skipped as a duplicate, or
/// dead-lettered).
pub struct Consumer<S: DedupStore> {
    pub(super) shared: Arc<Runtime<S>>,
    pub(crate) routes: HashMap<String, Arc<TopicRoutes<S>>>,
    pub(super) partitions: PartitionMap,
    pub(super) drained: mpsc::UnboundedReceiver<(String, i32, crate::database::partition::Pace)>,
    pub(super) admin_config: ClientConfig,
    /// The OAUTHBEARER tokens' keeper its clients ask, if a provider is set.
    pub(super) tokens: Option<crate::oauth::Tokens>,
    pub(crate) group: String,
    /// The partitions whose key-ordered gauges were last set.
    pub(super) keyed_reported: std::sync::Mutex<HashSet<(String, i32)>>,
    /// The retry tiers' partitions whose due gauges were last set.
    pub(super) tiers_reported: std::sync::Mutex<HashSet<(String, i32)>>,
    /// Resumed partitions whose fetcher is still to be woken.
    wakes: Arc<std::sync::Mutex<Wakes>>,
    /// The task waking them, if one runs (awaited at shutdown).
    pub(super) waking: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The metrics and health endpoints to serve while running.
    #[cfg(feature = "http")]
    pub(crate) http: Option<crate::http::HttpEndpoints>,
}

impl<S: DedupStore> Consumer<S> {
    /// Creates the Kafka clients; nothing is fetched before `run_until`.
    pub(crate) fn new(
        store: S,
        routes: Vec<TopicRoutes<S>>,
        consumer_config: ClientConfig,
        producer_config: ClientConfig,
        settings: Settings,
    ) -> Result<Self, Error> {
        let partitions = PartitionMap::default();
        let stats = Arc::new(Stats::new());
        let kafka: StreamConsumer<RebalanceContext> =
            consumer_config.create_with_context(Membership::new(
                stats.clone(),
                HandOver {
                    partitions: partitions.clone(),
                    revoke_timeout: settings.revoke_timeout,
                },
            ))?;
        let producer: FutureProducer<TokenContext> =
            producer_config.create_with_context(TokenContext)?;
        // How to reach the brokers, for the start-up TTL check.
        let admin_config = producer_config;
        let group = consumer_config
            .get("group.id")
            .unwrap_or_default()
            .to_owned();
        let (drained_tx, drained) = mpsc::unbounded_channel();
        let permits = Semaphore::new(settings.max_concurrent_partitions);
        Ok(Consumer {
            shared: Arc::new(Runtime {
                store: Arc::new(store),
                kafka,
                producer,
                stats,
                settings,
                group: group.clone(),
                permits,
                stopping: watch::channel(false).0,
                drained: drained_tx,
                fatal: std::sync::Mutex::new(None),
                fatal_set: tokio::sync::Notify::new(),
                dead_letter_gates: std::sync::Mutex::new(std::collections::HashMap::new()),
            }),
            routes: routes
                .into_iter()
                .map(|r| (r.topic.clone(), Arc::new(r)))
                .collect(),
            partitions,
            drained,
            admin_config,
            tokens: None,
            group,
            keyed_reported: std::sync::Mutex::default(),
            tiers_reported: std::sync::Mutex::default(),
            wakes: Arc::default(),
            waking: std::sync::Mutex::default(),
            #[cfg(feature = "http")]
            http: None,
        })
    }

    /// How many partitions may run a handler at once: the builder's
    /// setting, or the store's connections if it has fewer and the setting
    /// was left at its default.
    pub fn max_concurrent_partitions(&self) -> usize {
        self.shared.settings.max_concurrent_partitions
    }

    /// Live counters: applied, skipped, dead-lettered, retries, and how long
    /// the consumer has been idle.
    pub fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    /// The consumer's health now. `run` consumes the consumer: for probes
    /// while it runs, keep [`stats`](Self::stats) and call
    /// [`Stats::health`] on it.
    pub fn health(&self) -> crate::Health {
        self.shared.stats.health()
    }

    /// Where [`ConsumerBuilder::serve_http`](crate::ConsumerBuilder::serve_http)
    /// serves the consumer's metrics and health while it runs (the port
    /// chosen, if it asked for port 0).
    #[cfg(feature = "http")]
    pub fn http_addr(&self) -> Option<std::net::SocketAddr> {
        self.http
            .as_ref()
            .map(crate::http::HttpEndpoints::local_addr)
    }

    /// Runs until SIGINT or SIGTERM, then shuts down gracefully (see
    /// [`run_until`](Self::run_until)).
    pub async fn run(self) -> Result<StatsSnapshot, Error> {
        self.run_until(shutdown_signal()).await
    }

    /// Runs until `shutdown` completes. Then: stop fetching, let in-flight
    /// messages finish (up to the shutdown timeout), commit what finished,
    /// leave the group. Returns the final counters.
    pub async fn run_until(
        mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<StatsSnapshot, Error> {
        // Running until this returns or is dropped, however it ends.
        let mut running = Running::start(self.shared.stats.clone());
        #[cfg(feature = "http")]
        let _server = self.http.take().map(crate::http::HttpEndpoints::spawn);
        if !self.shared.settings.revoke_timeout.is_zero()
            && matches!(
                tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()),
                Ok(tokio::runtime::RuntimeFlavor::CurrentThread)
            )
        {
            tracing::warn!(
                "a current-thread runtime: a revoke cannot wait for the revoked partitions' \
                 batches in flight (the next owner skips what they commit); run on a \
                 multi-thread runtime, or set revoke_timeout(Duration::ZERO) to silence this"
            );
        }
        // Credentials and TLS the brokers refuse are named first.
        crate::access::check(&self.admin_config, "consumer", &self.rights()).await?;
        // The tiers' topics first: a missing one is named as such, not as a
        // retention the TTL check cannot read.
        self.check_tiers().await?;
        self.check_ttls().await?;
        // Every route's series exist from the start (at 0), so that an
        // alert's increase() sees the first dead letter or reclaim.
        for route in self.routes.values().flat_map(|r| r.all()) {
            route.metrics();
        }
        let topics: Vec<&str> = self.routes.keys().map(String::as_str).collect();
        self.shared.kafka.subscribe(&topics)?;
        tracing::info!(?topics, "consumer started");

        let mut workers = JoinSet::new();
        let mut commit_tick = tokio::time::interval(self.shared.settings.commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut refresh_tick = tokio::time::interval(REFRESH_INTERVAL);
        refresh_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let gauges = ConsumerGauges::new(&self.group);
        running.probe = Some(tokio::spawn(probe_store(
            self.shared.store.clone(),
            self.shared.stats.clone(),
            self.shared.settings.pipeline.attempt_timeout,
        )));
        tokio::pin!(shutdown);
        let fatal = loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break None,
                _ = refresh_tick.tick() => {
                    self.refresh(&gauges);
                    resume_assigned(&self.shared.kafka, |t, p| held_paused(&self.partitions, t, p));
                }
                () = self.shared.fatal_set.notified() => {
                    let why = self.shared.fatal.lock().unwrap_or_else(|p| p.into_inner()).take();
                    break Some(Error::Fatal(why.unwrap_or_default()));
                }
                Some((topic, partition, pace)) = self.drained.recv() => match pace {
                    crate::database::partition::Pace::Drained => self.resume(&topic, partition),
                    crate::database::partition::Pace::WaitDue => self.pause_until_due(&topic, partition),
                },
                Some(done) = workers.join_next(), if !workers.is_empty() => {
                    if let Err(e) = done
                        && e.is_panic()
                    {
                        // User code runs where panics are contained, so this
                        // is a bug of the runtime: its partition's buffered
                        // messages are gone, and no later one may be applied
                        // past them.
                        tracing::error!(error = %e, "a partition worker panicked; stopping");
                        break Some(Error::Fatal(format!("a partition worker panicked: {e}")));
                    }
                }
                _ = commit_tick.tick() => {
                    commit(&self.shared.kafka, CommitMode::Async, "interval");
                    if let Some(e) = self.fatal_client_error() {
                        break Some(e);
                    }
                }
                received = self.shared.kafka.recv() => match received {
                    Ok(msg) => {
                        let msg = msg.detach();
                        if let Err(e) = self.dispatch(msg, &mut workers) {
                            break Some(e);
                        }
                    }
                    Err(e) => {
                        if let Some(fatal) = self.fatal_client_error() {
                            break Some(fatal);
                        }
                        crate::access::consumer_error(&e);
                    }
                },
            }
        };
        let stats = self.shared.stats.clone();
        // A worker's reason wins: it may have failed while the loop was
        // already stopping, or just before another symptom of it was seen.
        let reason = self.shutdown(workers).await;
        let fatal = reason.map(Error::Fatal).or(fatal);
        if let Some(e) = &fatal {
            *stats.health.fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
        match fatal {
            Some(e) => {
                tracing::error!(error = %e, "consumer stopped");
                Err(e)
            }
            None => Ok(stats.snapshot()),
        }
    }

    /// What the consumer's principal must be allowed: Read on its topics
    /// (retry tiers' too) and group, Write on the dead-letter topics.
    fn rights(&self) -> crate::access::Rights {
        let mut write: Vec<String> = self
            .routes
            .values()
            .flat_map(|r| r.all())
            .map(|r| r.dead_letter_topic.clone())
            .collect();
        write.sort();
        write.dedup();
        crate::access::Rights {
            read: self.routes.keys().cloned().collect(),
            write,
            group: Some(self.group.clone()),
        }
    }

    /// A fatal error of the consumer or of the dead-letter producer: the
    /// client cannot be used any more (librdkafka says so once; retrying
    /// cannot help), so the consumer stops instead of hanging.
    fn fatal_client_error(&self) -> Option<Error> {
        fatal_error("consumer", self.shared.kafka.client())
            .or_else(|| fatal_error("dead-letter producer", self.shared.producer.client()))
    }

    /// Compares each handler's TTL with how long its topic keeps records
    /// (see [`TtlCheck`](crate::TtlCheck)).
    async fn check_ttls(&self) -> Result<(), Error> {
        let handlers: Vec<crate::ttl_check::Checked<'_>> = self
            .routes
            .values()
            .flat_map(|routes| routes.handlers())
            .map(|route| crate::ttl_check::Checked {
                topic: &route.topic,
                scope: route.handler.scope(),
                ttl: route.handler.ttl(),
            })
            .collect();
        crate::ttl_check::check(
            self.shared.settings.pipeline.ttl_check,
            &self.admin_config,
            &handlers,
        )
        .await
    }

    /// Checks the retry tiers' topics (see `tiers::check_topics`).
    async fn check_tiers(&self) -> Result<(), Error> {
        let mut tiers: Vec<std::sync::Arc<crate::tiers::TopicTiers>> = Vec::new();
        for route in self.routes.values().flat_map(|r| r.all()) {
            if let Some(place) = &route.tiers
                && !tiers
                    .iter()
                    .any(|t| std::sync::Arc::ptr_eq(t, &place.tiers))
            {
                tiers.push(place.tiers.clone());
            }
        }
        crate::tiers::check_topics(&self.admin_config, tiers, false).await
    }

    /// Hands a message to its partition's worker, starting one if needed.
    fn dispatch(&self, msg: OwnedMessage, workers: &mut JoinSet<()>) -> Result<(), Error> {
        self.shared.stats.touch();
        let Some(route) = self.routes.get(msg.topic()) else {
            tracing::warn!(
                topic = msg.topic(),
                "message from a topic without a handler"
            );
            return Ok(());
        };
        let key = (msg.topic().to_owned(), msg.partition());
        let mut partitions = lock(&self.partitions);
        let partition = match partitions.get(&key) {
            Some(p) if !p.is_revoked() && !p.sender.is_closed() => p.clone(),
            Some(p) if !p.is_revoked() => {
                // A worker ends on its own only when its partition is revoked
                // or the consumer stops. This one died: what it buffered is
                // gone, and a new worker would store offsets past it.
                return Err(Error::Fatal(format!(
                    "the worker of partition {}/{} ended unexpectedly",
                    p.topic, p.partition
                )));
            }
            _ => {
                let (sender, receiver) = mpsc::unbounded_channel();
                let p = Arc::new(Partition::new(key.0.clone(), key.1, sender));
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
        // SeqCst here and in the worker: each side writes one of `queued` and
        // `paused` and then reads the other, which only sequential
        // consistency guarantees one of them sees.
        let queued = partition.queued.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.stats.add_in_flight(1);
        if partition.sender.send(msg).is_err() {
            // The worker is gone (stopping): the message stays unfinished and
            // its offset unstored, so it is delivered again.
            self.shared.stats.add_in_flight(-1);
            return Ok(());
        }
        if queued >= self.shared.settings.max_buffered_per_partition
            && !partition.paused.swap(true, Ordering::SeqCst)
        {
            // Stop fetching this partition only: the others keep flowing.
            if let Err(e) = self.shared.kafka.pause(&partition.tpl()) {
                tracing::warn!(error = %e, "pausing a partition failed");
                partition.paused.store(false, Ordering::Release);
            }
            // The worker may have drained the buffer between the send and
            // the flag, seeing no pause to report: then nothing would ever
            // resume the partition. Look again now that the flag is set.
            let low_water = self.shared.settings.max_buffered_per_partition / 2;
            if partition.queued.load(Ordering::SeqCst) <= low_water {
                self.resume(&partition.topic, partition.partition);
            }
        }
        Ok(())
    }

    fn resume(&self, topic: &str, partition: i32) {
        let partitions = lock(&self.partitions);
        let Some(p) = partitions.get(&(topic.to_owned(), partition)) else {
            return;
        };
        // A tier's partition waiting for its next record's due time stays
        // paused (its worker asks again when the record is due), and so
        // does a partition still over half its bound.
        let low_water = self.shared.settings.max_buffered_per_partition / 2;
        if !p.is_revoked()
            && !p.due_wait.load(Ordering::SeqCst)
            && p.queued.load(Ordering::SeqCst) <= low_water
            && p.paused.swap(false, Ordering::AcqRel)
        {
            // Test-only: a resume librdkafka drops (`resume_assigned`).
            if crate::failpoint::fails("resume-lost") {
                return;
            }
            match self.shared.kafka.resume(&p.tpl()) {
                Ok(()) => self.wake_fetcher(topic, partition),
                Err(e) => tracing::warn!(error = %e, "resuming a partition failed"),
            }
        }
    }

    /// Makes librdkafka fetch a resumed partition now. A resume does not
    /// wake the thread that fetches from the partition's leader: with every
    /// partition of that broker paused (a backlog fills every buffer) it
    /// sleeps up to a second before it looks again, and each pause-resume
    /// cycle of a full buffer then costs that second. A watermark query
    /// goes to the partition's leader and wakes its thread; what it answers
    /// is not used. (With follower fetching, `client.rack`, the fetch is
    /// from a follower, whose thread this does not wake.) One blocking task
    /// at a time wakes every partition resumed meanwhile, each once.
    fn wake_fetcher(&self, topic: &str, partition: i32) {
        let mut wakes = guard(&self.wakes);
        wakes.pending.insert((topic.to_owned(), partition));
        if wakes.running {
            return;
        }
        wakes.running = true;
        let (shared, queue) = (self.shared.clone(), self.wakes.clone());
        let task = tokio::task::spawn_blocking(move || {
            loop {
                let next = {
                    let mut wakes = guard(&queue);
                    match wakes.pending.pop_first() {
                        Some(next) => next,
                        None => {
                            wakes.running = false;
                            return;
                        }
                    }
                };
                let _ = shared.kafka.fetch_watermarks(
                    &next.0,
                    next.1,
                    std::time::Duration::from_secs(1),
                );
            }
        });
        *guard(&self.waking) = Some(task);
    }

    /// Ends the waking of resumed partitions: what is pending is dropped,
    /// the query under way (at most a second) is waited for, so that the
    /// runtime's last reference is this consumer's and it closes where
    /// [`shutdown`](Self::shutdown) drops it.
    async fn stop_waking(&self) {
        guard(&self.wakes).pending.clear();
        let task = guard(&self.waking).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// Pauses a retry tier's partition whose worker waits for its next
    /// record to be due, if it still does.
    fn pause_until_due(&self, topic: &str, partition: i32) {
        let partitions = lock(&self.partitions);
        let Some(p) = partitions.get(&(topic.to_owned(), partition)) else {
            return;
        };
        if !p.is_revoked()
            && p.due_wait.load(Ordering::SeqCst)
            && !p.paused.swap(true, Ordering::AcqRel)
            && let Err(e) = self.shared.kafka.pause(&p.tpl())
        {
            tracing::warn!(error = %e, "pausing a partition until its record is due failed");
            p.paused.store(false, Ordering::Release);
        }
    }

    /// Finishes in-flight work, commits and closes; returns the reason a
    /// worker gave for stopping the consumer, if one did.
    async fn shutdown(self, mut workers: JoinSet<()>) -> Option<String> {
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
        self.stop_waking().await;
        // Dropping the consumer closes it: it leaves the group, which revokes
        // the partitions once more; everything finished is committed already.
        self.shared.kafka.context().close();
        tracing::info!(stats = %self.shared.stats.snapshot(), "consumer stopped");
        let reason = self
            .shared
            .fatal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        // Workers are gone and handler tasks hold only the store, so this
        // is the last reference: the consumer closes here, while the runtime
        // still runs, not in some task dropped during runtime teardown.
        drop(self);
        reason
    }
}

/// A mutex's guard, poisoned or not (what it guards stays consistent).
fn guard<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Resumed partitions whose fetcher is still to be woken
/// ([`Consumer::wake_fetcher`]), and whether a task is waking them.
#[derive(Default)]
struct Wakes {
    pending: std::collections::BTreeSet<(String, i32)>,
    running: bool,
}

/// How often health and the gauges are refreshed.
const REFRESH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// The consumer counts as running while this lives; dropping it (however
/// `run_until` ends, or when its future is dropped) also stops the store
/// probe.
struct Running {
    stats: Arc<Stats>,
    probe: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    fn start(stats: Arc<Stats>) -> Self {
        stats.health.running.store(true, Ordering::Release);
        stats.polled();
        Running { stats, probe: None }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stats.health.running.store(false, Ordering::Release);
        if let Some(probe) = &self.probe {
            probe.abort();
        }
    }
}

/// Asks the store for an empty transaction until it answers, so a consumer
/// with nothing to do yet can still say it is ready.
async fn probe_store<S: DedupStore>(store: Arc<S>, stats: Arc<Stats>, limit: std::time::Duration) {
    loop {
        if let Ok(Ok(tx)) = tokio::time::timeout(limit, store.begin()).await {
            let _ = store.rollback(tx).await;
            stats.store_answered();
            return;
        }
        tokio::time::sleep(REFRESH_INTERVAL).await;
    }
}

impl<S: DedupStore> fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("stats", &self.shared.stats.snapshot())
            .finish_non_exhaustive()
    }
}
