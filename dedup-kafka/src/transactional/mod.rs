//! Kafka-to-Kafka handlers, exactly once with no database.
//!
//! A handler whose only effect is records to other topics takes
//! [`Outputs`] as its transaction. The [`TransactionalConsumer`] runs it in
//! batches; each batch is one Kafka transaction (KIP-447, fenced by the
//! consumer group's generation) holding the batch's outputs, its dead
//! letters, its claims (records of a compacted changelog topic,
//! `<group>-dedup-claims`, co-partitioned with the input) and its input
//! offsets. All of it becomes visible to `read_committed` consumers at
//! once, or none of it does: a crash anywhere aborts the open transaction,
//! and the batch runs again from the committed offsets.
//!
//! Claims are kept in memory per assigned input partition, restored from
//! the changelog on assignment, and judged on the partition's stream time
//! (the greatest timestamp up to each record, committed with the offsets):
//! a record whose key was claimed less than the TTL earlier in stream time
//! is a duplicate, skipped. Once stream time passes a claim's expiry, the
//! claim is tombstoned in the changelog so compaction removes it.

mod batch;
mod builder;
mod busy;
mod changelog;
mod claims;
mod fate;
mod lanes;
mod outputs;
mod ready;
mod refusal;
mod restore;
mod tiered;
mod transact;

use crate::oauth::TokenContext;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedup_core::Handler;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::producer::FutureProducer;
use tokio::sync::watch;

pub use builder::TransactionalConsumerBuilder;
pub use outputs::{OutputRecord, Outputs};

use self::batch::With;
use self::busy::Busy;
use self::claims::PartitionClaims;
use self::lanes::{Change, Changes, Membership, Topics};
use self::tiered::Waiting;
use crate::Error;
use crate::config::PipelineSettings;
use crate::metrics::{ConsumerGauges, RouteMetrics};
use crate::pipeline::ingest::{Gathering, within};
use crate::pipeline::outage::Retrying;
use crate::pipeline::outcome::Record;
use crate::retry::Jitter;
use crate::stats::{Stats, StatsSnapshot};

/// Runs a Kafka-only handler exactly once per distinct event: outputs,
/// claims, dead letters and input offsets of each batch in one Kafka
/// transaction. See the book's chapter "Kafka to Kafka"
/// (`docs/src/kafka-to-kafka.md`).
///
/// ```no_run
/// # use dedup_core::{HandlerError, idempotent};
/// # use dedup_kafka::{Outputs, TransactionalConsumer};
/// # #[derive(serde::Deserialize, serde::Serialize)] struct OrderPlaced { event_id: String, order_id: String }
/// #[idempotent(key = "event_id", ttl = "1d")]
/// async fn enrich(out: &mut Outputs, ev: OrderPlaced) -> Result<(), HandlerError> {
///     out.send("orders.enriched", &ev.order_id, &ev)?;
///     Ok(())
/// }
///
/// # async fn run() -> Result<(), dedup_kafka::Error> {
/// let summary = TransactionalConsumer::builder("orders", enrich)
///     .brokers("localhost:9092")
///     .group_id("enrich-v1")
///     .run_until(dedup_kafka::shutdown_signal())
///     .await?;
/// println!("{summary}");
/// # Ok(()) }
/// ```
pub struct TransactionalConsumer<H> {
    topic: String,
    /// The input topic, then its retry tiers' topics.
    topics: Topics,
    /// The input topic's retry tiers, if any.
    tiers: Option<Arc<crate::tiers::TopicTiers>>,
    /// Shared with the tasks its attempts run in.
    handler: Arc<H>,
    changelog: String,
    /// Makes the keys of its claim records.
    record_keys: changelog::Keys,
    dead_letter_topic: String,
    consumer_config: ClientConfig,
    shared_config: ClientConfig,
    producer: FutureProducer<TokenContext>,
    transactional_id: String,
    changelog_replication: i32,
    transaction_timeout: Duration,
    /// What both runtimes set alike (key concurrency: handler calls of a
    /// batch at once, one per ordering key and claim).
    pipeline: PipelineSettings,
    order_by: crate::OrderBy,
    stats: Arc<Stats>,
    /// Registered on first use, after the application installed its
    /// recorder.
    metrics: std::sync::OnceLock<RouteMetrics>,
    /// Since when transactions have failed on a topic that cannot be
    /// written, if they do.
    unwritable_since: Mutex<Option<Instant>>,
    /// Transactions aborted in a row (the back-off grows with them).
    rewinds: std::sync::atomic::AtomicU32,
    /// The metrics and health endpoints to serve while running.
    #[cfg(feature = "http")]
    http: Option<crate::http::HttpEndpoints>,
    /// The OAUTHBEARER tokens' keeper its clients ask, if a provider is set.
    _tokens: Option<crate::oauth::Tokens>,
}

/// The messages of the batch in hand, counted in flight until it is
/// dropped, however the loop's turn ends.
struct Held<'a> {
    stats: &'a Stats,
    n: usize,
}

impl Held<'_> {
    /// The batch holds `n` messages now.
    fn count(&mut self, n: usize) {
        self.stats.add_in_flight(n as i64 - self.n as i64);
        self.n = n;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.count(0);
    }
}

/// Marks the consumer closing when dropped (before the consumer is).
struct Closing<'a>(&'a Membership);

/// Keeps a consumer live while it starts: its loop does not turn yet.
struct StartingUp(tokio::task::JoinHandle<()>);

impl StartingUp {
    fn begin(stats: Arc<Stats>) -> Self {
        StartingUp(tokio::spawn(async move {
            loop {
                stats.polled();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }))
    }
}

impl Drop for StartingUp {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// How long the loop waits for a first message before it looks at the
/// stop signal, health and the gauges again.
const IDLE_WAIT: Duration = Duration::from_millis(500);

impl<H> fmt::Debug for TransactionalConsumer<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionalConsumer")
            .field("topic", &self.topic)
            .field("changelog", &self.changelog)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("transactional_id", &self.transactional_id)
            .finish_non_exhaustive()
    }
}

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    /// A builder for `handler` on `topic`.
    pub fn builder(topic: impl Into<String>, handler: H) -> TransactionalConsumerBuilder<H> {
        TransactionalConsumerBuilder::new(topic.into(), handler)
    }

    /// The counters, live; [`Stats::idle_for`] tells an idle consumer.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Where outcomes are recorded: the counters and the metrics, labelled
    /// as the database runtime's are (the input topic, the handler's scope).
    fn record(&self) -> Record<'_> {
        Record {
            stats: &self.stats,
            metrics: self
                .metrics
                .get_or_init(|| RouteMetrics::new(&self.topic, self.handler.scope())),
        }
    }

    /// The changelog topic's name.
    pub fn changelog_topic(&self) -> &str {
        &self.changelog
    }

    /// Runs until `stop` resolves, then commits the batch in hand and
    /// leaves the group. Needs a multi-thread Tokio runtime (the clients'
    /// blocking calls run in `block_in_place`).
    pub async fn run_until(
        #[cfg_attr(not(feature = "http"), allow(unused_mut))] mut self,
        stop: impl Future<Output = ()>,
    ) -> Result<StatsSnapshot, Error> {
        #[cfg(feature = "http")]
        let _server = self.http.take().map(crate::http::HttpEndpoints::spawn);
        self.stats.health.running.store(true, Ordering::Release);
        let result = self.run(stop).await;
        self.stats.health.running.store(false, Ordering::Release);
        if let Err(e) = &result {
            *self
                .stats
                .health
                .fatal
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
        result.map(|()| self.stats.snapshot())
    }

    async fn run(&self, stop: impl Future<Output = ()>) -> Result<(), Error> {
        // Start-up (the TTL check, the changelog, the producer's
        // transactions) waits out a slow or absent broker, as the loop waits
        // out an outage: live meanwhile, its loop not yet turning.
        let starting = StartingUp::begin(self.stats.clone());
        // Its series exist from the start (at 0), so that an alert's
        // increase() sees the first dead letter or reclaim.
        let _ = self.record();
        // The input's retention, and its tiers' (a tier's record is judged
        // against the same claims).
        let checked: Vec<crate::ttl_check::Checked<'_>> = self
            .topics
            .names()
            .iter()
            .map(|topic| crate::ttl_check::Checked {
                topic,
                scope: self.handler.scope(),
                ttl: self.handler.ttl(),
            })
            .collect();
        // Credentials and TLS the brokers refuse are named first.
        let rights = crate::access::Rights {
            read: self.topics.names().to_vec(),
            write: vec![self.dead_letter_topic.clone(), self.changelog.clone()],
            group: self.consumer_config.get("group.id").map(str::to_owned),
        };
        crate::access::check(&self.shared_config, "consumer", &rights).await?;
        crate::ttl_check::check(self.pipeline.ttl_check, &self.shared_config, &checked).await?;
        if let Some(tiers) = &self.tiers {
            crate::tiers::check_topics(&self.shared_config, vec![tiers.clone()], true).await?;
            // Their series exist from the start too.
            for tier in &tiers.tiers {
                let _registered = self.record().metrics.moved_series(&tier.name);
            }
        }
        restore::ensure_changelog(
            &self.shared_config,
            &self.topic,
            &self.changelog,
            self.changelog_replication,
        )
        .await?;
        self.init_transactions().await?;
        drop(starting);
        // Readiness: the transaction coordinator (this consumer's store) answered.
        self.stats.store_answered();
        let context = Membership::new(self.stats.clone(), Changes::new(self.topics.clone()));
        let gauges = ConsumerGauges::new(self.consumer_config.get("group.id").unwrap_or_default());
        let consumer: StreamConsumer<Membership> =
            self.consumer_config.create_with_context(context)?;
        // However the loop ends, what dropping the consumer revokes is not
        // a rebalance.
        let _closing = Closing(consumer.context());
        let names: Vec<&str> = self.topics.names().iter().map(String::as_str).collect();
        consumer.subscribe(&names)?;
        tracing::info!(topic = %self.topic, changelog = %self.changelog, transactional_id = %self.transactional_id, "transactional consumer started");
        let mut states: HashMap<i32, PartitionClaims> = HashMap::new();
        let mut jitter = Jitter::new(u64::from(std::process::id()));
        let mut stopping = false;
        let (stop_tx, stop_rx) = watch::channel(false);
        let busy = Busy::new(self.topics.clone());
        // The tiers' partitions paused until their next record is due.
        let mut waiting = Waiting::default();
        // Topics whose records go one at a time (to find the one a broker
        // refuses), kept while a batch is rewound and runs again.
        let mut isolate: BTreeSet<String> = BTreeSet::new();
        tokio::pin!(stop);
        // The last batch left a backlog (full, or messages came meanwhile):
        // the next takes what is queued and goes, without lingering.
        let mut backlog = false;
        // Taken while the last batch committed, and their gathering.
        let mut carried: Vec<OwnedMessage> = Vec::new();
        let mut next: Option<Gathering> = None;
        while !stopping {
            // The changes carried messages answer to already (busy.rs),
            // before they join the batch, which answers to later ones.
            self.apply_changes(&consumer, &mut states, &mut Vec::new(), &mut waiting);
            busy.resume_running(&consumer, |lane| waiting.holds(lane));
            let mut batch: Vec<OwnedMessage> = std::mem::take(&mut carried);
            let from_last = batch.len();
            // Counted in flight from receipt, as the database runtime's are:
            // a batch gathering or waiting for its restores is work.
            let mut held = Held {
                stats: &self.stats,
                n: 0,
            };
            held.count(batch.len());
            // From the batch's first message on (carried ones may be gone).
            let gathering = next.take().filter(|_| !batch.is_empty());
            let mut gathering = gathering.map(|g| g.recounted(&batch));
            self.refresh(&gauges, None, batch.len(), waiting.len());
            waiting.report(&self.topics);
            loop {
                self.stats.polled();
                waiting.resume_due(&consumer, &self.topics);
                let wait = match &gathering {
                    None => IDLE_WAIT,
                    Some(gathering) => match gathering.wait(batch.len()) {
                        Some(wait) => wait,
                        None => break,
                    },
                };
                // Wakes up for the next tier partition due.
                let wait = waiting.next_in().map_or(wait, |due| wait.min(due));
                let received = tokio::select! {
                    biased;
                    () = &mut stop => {
                        // The batch in hand still runs; its waits end.
                        stopping = true;
                        let _ = stop_tx.send(true);
                        break
                    }
                    received = within(wait, consumer.recv()) => received,
                };
                self.apply_changes(&consumer, &mut states, &mut batch, &mut waiting);
                held.count(batch.len());
                match received {
                    // An idle wait: the next batch starts from idle.
                    None if gathering.is_none() => {
                        backlog = false;
                        busy.resume_running(&consumer, |lane| waiting.holds(lane));
                    }
                    None => break,
                    Some(Ok(msg)) => {
                        gathering
                            .get_or_insert_with(|| self.pipeline.batching.start(!backlog))
                            .took(&msg);
                        batch.push(msg.detach());
                        held.count(batch.len());
                    }
                    Some(Err(e)) => crate::access::consumer_error(&e),
                }
            }
            self.apply_changes(&consumer, &mut states, &mut batch, &mut waiting);
            waiting.hold_undue(
                &consumer,
                &self.topics,
                self.tiers.as_deref(),
                |m| self.forged(m).is_some(),
                &mut batch,
            )?;
            held.count(batch.len());
            let restored = tokio::select! {
                restored = self.restore_assigned(&consumer, &mut states, &batch, &mut jitter, &stop_rx) => restored?,
                () = &mut stop, if !stopping => false,
            };
            if !restored {
                tracing::info!("stopping while restoring claims; the batch is left uncommitted");
                break;
            }
            if batch.is_empty() {
                backlog = false;
                continue;
            }
            if let Some(gathering) = &gathering {
                tracing::debug!(
                    messages = batch.len(),
                    carried = from_last,
                    gather_ms = transact::ms(gathering.since()),
                    "batch gathered"
                );
            }
            // A stop while the batch runs ends the waits of its retries (a
            // hung handler or an outage would hold the shutdown for ever);
            // the batch's transaction itself is finished. Meanwhile the
            // consumer polls, to stay in its group.
            let with = With {
                consumer: &consumer,
                stopping: &stop_rx,
                busy: &busy,
            };
            let work = self.run_batch(&with, &mut states, &batch, &mut jitter, &mut isolate);
            tokio::pin!(work);
            // The first poll after POLL_EVERY, not at once: a poll at the
            // batch's start nearly always receives a message prefetched
            // behind the batch, which pauses its partition and costs a
            // resume and a seek (a fetch started again) at the batch's end:
            // done for every batch of a backlog, that cut the throughput to
            // a quarter. A batch that ends sooner never needs the poll.
            let mut poll = tokio::time::interval_at(
                tokio::time::Instant::now() + busy::POLL_EVERY,
                busy::POLL_EVERY,
            );
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let began = Instant::now();
            // The batch in hand, shown at once (the first poll's refresh
            // comes only if it runs past POLL_EVERY).
            self.refresh(
                &gauges,
                Some(began),
                batch.len(),
                busy.paused() + waiting.len(),
            );
            // Whether the next batch has room for messages carried.
            let mut room = true;
            let done = loop {
                tokio::select! {
                    done = &mut work => break done,
                    () = &mut stop, if !stopping => {
                        stopping = true;
                        let _ = stop_tx.send(true);
                    }
                    _ = poll.tick() => {
                        // The loop turns: liveness.
                        self.stats.polled();
                        self.refresh(&gauges, Some(began), batch.len(), busy.paused() + waiting.len());
                        busy.poll(&consumer).await;
                    }
                    received = busy.carrying(&consumer), if room && !stopping => match received {
                        Ok(msg) => {
                            let next = next.get_or_insert_with(|| self.pipeline.batching.start(false));
                            next.took(&msg);
                            room = !next.is_full(busy.carry(&consumer, &msg));
                        }
                        Err(e) => crate::access::consumer_error(&e),
                    },
                }
            };
            let finished = busy.finish(&consumer);
            drop(held);
            self.stats.touch();
            done?;
            let came_in;
            (came_in, carried) = finished?;
            backlog = came_in || gathering.is_some_and(|g| g.is_full(batch.len()));
        }
        tracing::info!("transactional consumer stopping");
        Ok(())
    }

    /// Refreshes what health and the gauges report, as the database
    /// runtime's loop does: the batch in hand (since when, how many
    /// messages), the partitions paused while it runs, an outage.
    fn refresh(
        &self,
        gauges: &ConsumerGauges,
        since: Option<Instant>,
        in_flight: usize,
        paused: usize,
    ) {
        let oldest = since.map_or(Duration::ZERO, |at| at.elapsed());
        gauges.report(&self.stats, paused, oldest);
        crate::metrics::in_flight(&self.topic, in_flight);
    }

    /// Acts on the rebalance callbacks: a revoked partition's claims and
    /// buffered messages are dropped (its next owner restores and reads
    /// them from the committed offsets); an assigned one is restored before
    /// its first message runs. (What the member owns, health's count of it
    /// and the rebalance counters the shared context keeps.)
    ///
    /// A tier's partition waiting for its due time is resumed when revoked;
    /// one assigned without its input partition waits for a rebalance that
    /// assigns them together (see [`Waiting`]).
    fn apply_changes(
        &self,
        consumer: &StreamConsumer<Membership>,
        states: &mut HashMap<i32, PartitionClaims>,
        batch: &mut Vec<OwnedMessage>,
        waiting: &mut Waiting,
    ) {
        for change in consumer.context().take() {
            match change {
                Change::Revoked(lanes) => {
                    for lane in &lanes {
                        states.remove(&lane.partition);
                    }
                    batch.retain(|m| !lanes.contains(&self.topics.lane(m)));
                    waiting.revoked(consumer, &self.topics, &lanes);
                }
                Change::Assigned(lanes) => {
                    waiting.assigned(consumer, &self.topics, &lanes);
                    // Restored before their first message runs.
                    for lane in lanes {
                        states.remove(&lane.partition);
                    }
                }
            }
        }
    }

    /// Restores the claims of every partition with a message in `batch`
    /// that has none yet, and the stream time committed with its offset. A
    /// broker that fails it is waited out as an outage (bounded by
    /// `max_outage`); `false` when the consumer stops meanwhile.
    async fn restore_assigned(
        &self,
        consumer: &StreamConsumer<Membership>,
        states: &mut HashMap<i32, PartitionClaims>,
        batch: &[OwnedMessage],
        jitter: &mut Jitter,
        stopping: &watch::Receiver<bool>,
    ) -> Result<bool, Error> {
        let missing: HashSet<i32> = batch
            .iter()
            .map(|m| m.partition())
            .filter(|p| !states.contains_key(p))
            .collect();
        if missing.is_empty() {
            return Ok(true);
        }
        let missing: Vec<i32> = missing.into_iter().collect();
        let mut retrying = Retrying::new(&self.stats, self.pipeline.retry);
        loop {
            match tokio::task::block_in_place(|| {
                let mut restored =
                    restore::restore(&self.shared_config, &self.changelog, &missing)?;
                // The stream time committed with the input partition's
                // offset and its tiers' (the same, or the input's ahead).
                for topic in self.topics.names() {
                    let committed = restore::committed(consumer, topic, &missing)?;
                    for (
                        p,
                        restore::Committed {
                            offset,
                            stream_time,
                        },
                    ) in committed
                    {
                        if let (Some(claims), Some(at)) = (restored.get_mut(&p), stream_time) {
                            claims.advance(at);
                        }
                        // Lag counts from here until the first transaction.
                        if let Some(offset) = offset {
                            consumer.context().committed_at(topic, p, offset);
                        }
                    }
                }
                // What the log's head still holds of records tombstoned
                // since (compaction has not reached it) is gone.
                for claims in restored.values_mut() {
                    claims.forget_expired(batch::sweep_time(claims.stream_time));
                }
                Ok::<_, Error>(restored)
            }) {
                Ok(restored) => {
                    states.extend(restored);
                    return Ok(true);
                }
                // A changelog that cannot be read as claims.
                Err(e @ Error::Fatal(_)) => return Err(e),
                // The brokers, waited out as an outage (health, max_outage).
                Err(e) => {
                    let wait = retrying
                        .environment_failed(&e, jitter.next())
                        .map_err(Error::Fatal)?;
                    tracing::warn!(partitions = ?missing, error = %e, ?wait, "restoring claims failed; retrying");
                    let mut stopping = stopping.clone();
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        _ = stopping.wait_for(|s| *s) => return Ok(false),
                    }
                }
            }
        }
    }
}
