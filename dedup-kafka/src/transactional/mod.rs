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
//! the changelog on assignment, and judged on the input records'
//! timestamps: a record whose key was claimed by a record stamped less than
//! the TTL before it is a duplicate, skipped. Once a partition's stream time
//! (its greatest committed timestamp) passes a claim's expiry, the claim is
//! tombstoned in the changelog so compaction removes it.

mod busy;
mod claims;
mod outputs;
mod restore;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedup_core::{DedupKey, Handler, HandlerExt, StoreError};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::watch;

pub use outputs::{OutputRecord, Outputs};

use self::busy::Busy;
use self::claims::{ClaimDigest, Entry, PartitionClaims};
use crate::Error;
use crate::config::{self, OnFingerprintMismatch};
use crate::dlq::{self, DeadLetter};
use crate::pipeline::attempt::{self, AttemptTimedOut, Ran};
use crate::pipeline::decision::{Decision, Fault};
use crate::pipeline::outage::Retrying;
use crate::pipeline::{error_chain, headers_of};
use crate::retry::{Jitter, RetryPolicy};
use crate::stats::{Stats, StatsSnapshot};

/// Builds a [`TransactionalConsumer`]; see
/// [`TransactionalConsumer::builder`].
pub struct TransactionalConsumerBuilder<H> {
    topic: String,
    handler: H,
    brokers: String,
    group_id: Option<String>,
    settings: Vec<(String, String)>,
    /// Settings from the environment: (setting, variable).
    from_env: Vec<(String, String)>,
    producer_settings: Vec<(String, String)>,
    dead_letter_topic: Option<String>,
    changelog_topic: Option<String>,
    changelog_replication: i32,
    transactional_id: Option<String>,
    transaction_timeout: Duration,
    batch_size: usize,
    batch_linger: Duration,
    retry: RetryPolicy,
    on_fingerprint_mismatch: OnFingerprintMismatch,
    attempt_timeout: Duration,
}

impl<H> fmt::Debug for TransactionalConsumerBuilder<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionalConsumerBuilder")
            .field("topic", &self.topic)
            .field("brokers", &self.brokers)
            .field("group_id", &self.group_id)
            .field("settings", &config::redacted(&self.settings))
            .field(
                "producer_settings",
                &config::redacted(&self.producer_settings),
            )
            .field("transactional_id", &self.transactional_id)
            .finish_non_exhaustive()
    }
}

impl<H: Handler<Tx = Outputs>> TransactionalConsumerBuilder<H> {
    /// The bootstrap brokers (default `localhost:9092`).
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.brokers = brokers.into();
        self
    }

    /// The consumer group (required). The changelog is `<group>-dedup-claims`.
    pub fn group_id(mut self, group_id: impl Into<String>) -> Self {
        self.group_id = Some(group_id.into());
        self
    }

    /// A librdkafka setting for the consumer; connection and security
    /// settings (`security.*`, `sasl.*`, `ssl.*`, ...) go to the producer
    /// and the changelog readers too.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((key.into(), value.into()));
        self
    }

    /// Every environment variable `<prefix><NAME>` as a setting, as
    /// [`ConsumerBuilder::set_from_env`](crate::ConsumerBuilder::set_from_env)
    /// reads them (`KAFKA_CFG_SESSION_TIMEOUT_MS=6000`).
    pub fn set_from_env(mut self, prefix: &str) -> Self {
        for (key, name, value) in crate::builder::settings_from_env(prefix) {
            self.from_env.push((key.clone(), name));
            self.settings.push((key, value));
        }
        self
    }

    /// A librdkafka setting for the transactional producer alone.
    pub fn producer_set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.producer_settings.push((key.into(), value.into()));
        self
    }

    /// Where poison messages go (default `<topic>.dlq`).
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// The changelog topic's name (default `<group>-dedup-claims`).
    pub fn changelog_topic(mut self, topic: impl Into<String>) -> Self {
        self.changelog_topic = Some(topic.into());
        self
    }

    /// The replication factor the changelog is created with (default -1:
    /// the broker's `default.replication.factor`).
    pub fn changelog_replication(mut self, replicas: i32) -> Self {
        self.changelog_replication = replicas;
        self
    }

    /// The producer's `transactional.id`. Default: `<group>-dedup-<random>`,
    /// new on every start, so two instances never fence each other; a
    /// crashed instance's open transaction then blocks `read_committed`
    /// readers of its partitions until the transaction timeout. An id kept
    /// across restarts (one per instance, never two live at once: a
    /// StatefulSet's pod name) aborts it as soon as the instance is back.
    pub fn transactional_id(mut self, id: impl Into<String>) -> Self {
        self.transactional_id = Some(id.into());
        self
    }

    /// How long a transaction may stay open before the broker aborts it
    /// (default 10 s): after a crash, how long the partitions' readers wait.
    pub fn transaction_timeout(mut self, timeout: Duration) -> Self {
        self.transaction_timeout = timeout;
        self
    }

    /// Most messages per transaction (default 2,000).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How long a batch waits for more messages once it has one (default
    /// 20 ms): each transaction costs a few round trips to the brokers.
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.batch_linger = linger;
        self
    }

    /// How failures are retried: transient ones `max_attempts` times before
    /// dead-lettering, outages until `max_outage` (the failure table).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long one handler attempt may take (default 60 s): past it the
    /// attempt is abandoned and waited out as the environment's fault, as
    /// in the database runtime (bounded only by `max_outage`).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// What a duplicate whose fingerprint differs from its claim's gets.
    pub fn on_fingerprint_mismatch(mut self, action: OnFingerprintMismatch) -> Self {
        self.on_fingerprint_mismatch = action;
        self
    }

    /// Checks the settings and creates the clients.
    pub fn build(self) -> Result<TransactionalConsumer<H>, Error> {
        let group = self.group_id.clone().ok_or_else(|| {
            Error::Config("a group id is required: .group_id(\"enrich-v1\")".into())
        })?;
        let transactional_id = self.transactional_id.clone().unwrap_or_else(|| {
            format!(
                "{group}-dedup-{:016x}",
                Jitter::new(std::process::id().into()).next().to_bits()
            )
        });
        crate::builder::check_env_settings(&self.from_env, &self.settings)?;
        let mut consumer = config::consumer_config(&self.brokers, Some(&group), &self.settings)?;
        // Only what upstream committed, and offsets only through the
        // transactions.
        consumer.set("isolation.level", "read_committed");
        let mut shared = ClientConfig::new();
        shared.set("bootstrap.servers", &self.brokers);
        for (k, v) in self
            .settings
            .iter()
            .filter(|(k, _)| config::is_shared_setting(k))
        {
            shared.set(k, v);
        }
        // librdkafka's statistics are for the database runtime's lag
        // metric; this consumer does not read them (unless asked to).
        if !self
            .settings
            .iter()
            .any(|(k, _)| k == "statistics.interval.ms")
        {
            consumer.set("statistics.interval.ms", "0");
        }
        let mut producer = shared.clone();
        // A record that just fitted its input topic still fits the
        // dead-letter topic with dedup's headers (a user's setting wins).
        producer.set("message.max.bytes", dlq::MAX_DEAD_LETTER_BYTES);
        for (k, v) in &self.producer_settings {
            producer.set(k, v);
        }
        producer
            .set("transactional.id", &transactional_id)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set(
                "transaction.timeout.ms",
                self.transaction_timeout.as_millis().max(1000).to_string(),
            );
        let producer: FutureProducer = producer.create()?;
        Ok(TransactionalConsumer {
            changelog: self
                .changelog_topic
                .unwrap_or_else(|| format!("{group}-dedup-claims")),
            dead_letter_topic: self
                .dead_letter_topic
                .unwrap_or_else(|| format!("{}.dlq", self.topic)),
            topic: self.topic,
            handler: Arc::new(self.handler),
            consumer_config: consumer,
            shared_config: shared,
            producer,
            transactional_id,
            changelog_replication: self.changelog_replication,
            transaction_timeout: self.transaction_timeout,
            batch_size: self.batch_size,
            batch_linger: self.batch_linger,
            retry: self.retry,
            on_fingerprint_mismatch: self.on_fingerprint_mismatch,
            attempt_timeout: self.attempt_timeout,
            stats: Arc::new(Stats::new()),
            unwritable_since: Mutex::new(None),
            rewinds: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// Builds and runs until `stop` resolves; see
    /// [`TransactionalConsumer::run_until`].
    pub async fn run_until(self, stop: impl Future<Output = ()>) -> Result<StatsSnapshot, Error> {
        self.build()?.run_until(stop).await
    }
}

/// Runs a Kafka-only handler exactly once per distinct event: outputs,
/// claims, dead letters and input offsets of each batch in one Kafka
/// transaction. See the workspace README, "Kafka to Kafka: exactly once
/// without a database".
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
    /// Shared with the tasks its attempts run in.
    handler: Arc<H>,
    changelog: String,
    dead_letter_topic: String,
    consumer_config: ClientConfig,
    shared_config: ClientConfig,
    producer: FutureProducer,
    transactional_id: String,
    changelog_replication: i32,
    transaction_timeout: Duration,
    batch_size: usize,
    batch_linger: Duration,
    retry: RetryPolicy,
    on_fingerprint_mismatch: OnFingerprintMismatch,
    attempt_timeout: Duration,
    stats: Arc<Stats>,
    /// Since when transactions have failed on a topic that cannot be
    /// written, if they do.
    unwritable_since: Mutex<Option<Instant>>,
    /// Transactions aborted in a row (the back-off grows with them).
    rewinds: std::sync::atomic::AtomicU32,
}

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

/// What the rebalance callbacks saw, in order, for the loop to act on.
#[derive(Debug)]
enum Change {
    Assigned(Vec<i32>),
    Revoked(Vec<i32>),
}

impl Change {
    /// The partitions that moved (none: an incremental rebalance that
    /// left this member as it was).
    fn partitions(&self) -> &[i32] {
        match self {
            Change::Assigned(partitions) | Change::Revoked(partitions) => partitions,
        }
    }
}

struct Context {
    topic: String,
    changes: Mutex<Vec<Change>>,
}

impl Context {
    fn push(&self, change: Change) {
        self.changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(change);
    }

    /// Whether a rebalance happened that the loop has not acted on.
    fn pending(&self) -> bool {
        self.changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|change| !change.partitions().is_empty())
    }

    /// Calls `f` with each change from the `from`th on, in order.
    fn each_change_from(&self, from: usize, mut f: impl FnMut(&Change)) {
        let changes = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        changes.iter().skip(from).for_each(&mut f);
    }

    fn take(&self) -> Vec<Change> {
        std::mem::take(&mut *self.changes.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn partitions(&self, list: &TopicPartitionList) -> Vec<i32> {
        list.elements()
            .iter()
            .filter(|e| e.topic() == self.topic)
            .map(|e| e.partition())
            .collect()
    }
}

impl ClientContext for Context {}

/// The callbacks run inside `recv`, which the loop calls only while no
/// transaction is open (see [`busy`]): none is when partitions are revoked.
impl ConsumerContext for Context {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            self.push(Change::Revoked(self.partitions(list)));
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            self.push(Change::Assigned(self.partitions(list)));
        }
    }
}

/// The claims a batch takes, by partition and digest, on top of the
/// partitions' committed ones.
type Staged = HashMap<(i32, ClaimDigest), Entry>;

/// What became of one message of a batch.
#[derive(Clone)]
enum Fate {
    Applied {
        outputs: Vec<OutputRecord>,
        digest: ClaimDigest,
        entry: Entry,
        key: DedupKey,
    },
    /// A duplicate of the claim `digest` (the batch's or a committed one).
    Skipped { digest: ClaimDigest },
    Dead {
        kind: &'static str,
        message: String,
        attempts: u32,
        /// How much of the payload to keep (`None`: all), once the broker
        /// refused the whole.
        keep: Option<usize>,
    },
}

/// Where a record of the transaction came from, to tell whose fault its
/// failure is.
#[derive(Clone, Copy)]
enum Source {
    Output(usize),
    DeadLetter(usize),
    Changelog,
}

/// Why a batch's judging ended before its transaction.
enum Halt {
    /// The consumer cannot go on.
    Fatal(Error),
    /// The consumer stops: the batch is left uncommitted.
    Stopped,
    /// The group rebalanced: the batch is dropped and runs again.
    Rebalanced,
}

/// What a batch runs with: the consumer, the stop signal, and what it
/// shares with the run loop while it runs.
#[derive(Clone, Copy)]
struct With<'a> {
    consumer: &'a StreamConsumer<Context>,
    stopping: &'a watch::Receiver<bool>,
    busy: &'a Busy,
}

/// What became of the messages a batch's transaction was given.
enum Processed {
    /// The first `taken` committed; the rest, with the fates judged for
    /// them, go in the next transaction.
    Committed { taken: usize, rest: Piece },
    /// None committed: the batch was dropped (rewound to its first
    /// offsets), or the consumer stops.
    Dropped,
}

/// Fates judged for a batch's messages by an earlier transaction of the
/// batch, by index in what is left of it: no handler runs twice.
#[derive(Default)]
struct Piece(HashMap<usize, Fate>);

/// How a transaction attempt ended.
enum Attempt {
    Committed,
    /// A record was refused for its own sake: message `.0` now has fate
    /// `.1`; the batch is judged again around it and run in a new
    /// transaction.
    Refused(usize, Fate),
    /// The broker refused a request of records to topic `.0` for a
    /// reason no single record may have caused (a size): run again sending
    /// that topic's records one at a time, to find the one at fault.
    Ambiguous(String),
    /// The environment failed or the group moved on: the batch is dropped
    /// and its partitions rewound to their committed offsets. With
    /// `unwritable`, a topic of the transaction could not be written.
    Rewind {
        why: String,
        unwritable: bool,
        lost: bool,
    },
}

/// How long a transaction's commit, offsets or abort may stay unresolved
/// (librdkafka's retriable errors: the coordinator unreachable) before the
/// consumer stops: a restart resumes from what Kafka committed, while
/// another call on a producer with one in progress could only conflict.
const UNRESOLVED_LIMIT: Duration = Duration::from_secs(120);

/// Most records one transaction sends one at a time (to find the one a
/// broker refuses): each waits for its acknowledgement, so a few thousand
/// would outlast the transaction's timeout.
const ALONE_PER_TRANSACTION: usize = 200;

/// Most tombstones one transaction writes per partition.
const MAX_TOMBSTONES: usize = 10_000;

/// Aborted transactions of a batch retried before its partitions are
/// rewound.
const IN_PLACE_RETRIES: u32 = 3;

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    /// A builder for `handler` on `topic`.
    pub fn builder(topic: impl Into<String>, handler: H) -> TransactionalConsumerBuilder<H> {
        TransactionalConsumerBuilder {
            topic: topic.into(),
            handler,
            brokers: config::DEFAULT_BROKERS.to_owned(),
            group_id: None,
            settings: Vec::new(),
            from_env: Vec::new(),
            producer_settings: Vec::new(),
            dead_letter_topic: None,
            changelog_topic: None,
            changelog_replication: -1,
            transactional_id: None,
            transaction_timeout: Duration::from_secs(10),
            batch_size: 2000,
            batch_linger: Duration::from_millis(20),
            retry: RetryPolicy::default(),
            on_fingerprint_mismatch: OnFingerprintMismatch::default(),
            attempt_timeout: Duration::from_secs(60),
        }
    }

    /// The counters, live; [`Stats::idle_for`] tells an idle consumer.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// The changelog topic's name.
    pub fn changelog_topic(&self) -> &str {
        &self.changelog
    }

    /// Runs until `stop` resolves, then commits the batch in hand and
    /// leaves the group. Needs a multi-thread Tokio runtime (the clients'
    /// blocking calls run in `block_in_place`).
    pub async fn run_until(self, stop: impl Future<Output = ()>) -> Result<StatsSnapshot, Error> {
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
        restore::ensure_changelog(
            &self.shared_config,
            &self.topic,
            &self.changelog,
            self.changelog_replication,
        )
        .await?;
        self.init_transactions().await?;
        // Readiness: the transaction coordinator (this consumer's store) answered.
        self.stats.store_answered();
        let context = Context {
            topic: self.topic.clone(),
            changes: Mutex::new(Vec::new()),
        };
        let consumer: StreamConsumer<Context> =
            self.consumer_config.create_with_context(context)?;
        consumer.subscribe(&[&self.topic])?;
        tracing::info!(topic = %self.topic, changelog = %self.changelog, transactional_id = %self.transactional_id, "transactional consumer started");
        let mut states: HashMap<i32, PartitionClaims> = HashMap::new();
        let mut assigned: HashSet<i32> = HashSet::new();
        let mut jitter = Jitter::new(u64::from(std::process::id()));
        let mut stopping = false;
        let (stop_tx, stop_rx) = watch::channel(false);
        let busy = Busy::new();
        // Topics whose records go one at a time, to find the one a broker
        // refuses: kept while a batch is rewound and runs again.
        let mut isolate: BTreeSet<String> = BTreeSet::new();
        tokio::pin!(stop);
        while !stopping {
            let mut batch: Vec<OwnedMessage> = Vec::new();
            let mut deadline: Option<tokio::time::Instant> = None;
            loop {
                self.stats.polled();
                let wait = match deadline {
                    None => Duration::from_millis(500),
                    Some(at) => match at.checked_duration_since(tokio::time::Instant::now()) {
                        Some(left) => left,
                        None => break,
                    },
                };
                let received = tokio::select! {
                    biased;
                    () = &mut stop => {
                        // The batch in hand still runs; its waits end.
                        stopping = true;
                        let _ = stop_tx.send(true);
                        break
                    }
                    received = tokio::time::timeout(wait, consumer.recv()) => received,
                };
                self.apply_changes(consumer.context(), &mut states, &mut assigned, &mut batch);
                match received {
                    Err(_) if batch.is_empty() => {}
                    Err(_) => break,
                    Ok(Ok(msg)) => {
                        if batch.is_empty() {
                            deadline = Some(tokio::time::Instant::now() + self.batch_linger);
                        }
                        batch.push(msg.detach());
                        if batch.len() >= self.batch_size {
                            break;
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "consumer error");
                    }
                }
            }
            self.apply_changes(consumer.context(), &mut states, &mut assigned, &mut batch);
            let restored = tokio::select! {
                restored = self.restore_assigned(&mut states, &batch, &mut jitter, &stop_rx) => restored?,
                () = &mut stop, if !stopping => false,
            };
            if !restored {
                tracing::info!("stopping while restoring claims; the batch is left uncommitted");
                break;
            }
            if batch.is_empty() {
                continue;
            }
            self.stats.add_in_flight(batch.len() as i64);
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
            let mut poll = tokio::time::interval(busy::POLL_EVERY);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
                        busy.poll(&consumer, &self.topic).await;
                    }
                }
            };
            let finished = busy.finish(&consumer, &self.topic);
            self.stats.add_in_flight(-(batch.len() as i64));
            self.stats.touch();
            done?;
            finished?;
        }
        tracing::info!("transactional consumer stopping");
        Ok(())
    }

    async fn init_transactions(&self) -> Result<(), Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let timeout = self.transaction_timeout.max(Duration::from_secs(10));
            match tokio::task::block_in_place(|| self.producer.init_transactions(timeout)) {
                Ok(()) => return Ok(()),
                Err(e) if is_fatal(&e) || attempt >= 30 => {
                    return Err(Error::Fatal(format!(
                        "initializing transactions failed: {e}"
                    )));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "initializing transactions; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// Acts on the rebalance callbacks: a revoked partition's claims and
    /// buffered messages are dropped (its next owner restores and reads
    /// them from the committed offsets); an assigned one is restored before
    /// its first message runs.
    fn apply_changes(
        &self,
        context: &Context,
        states: &mut HashMap<i32, PartitionClaims>,
        assigned: &mut HashSet<i32>,
        batch: &mut Vec<OwnedMessage>,
    ) {
        for change in context.take() {
            match change {
                Change::Revoked(partitions) => {
                    for p in &partitions {
                        states.remove(p);
                        assigned.remove(p);
                    }
                    batch.retain(|m| !partitions.contains(&m.partition()));
                    self.stats
                        .revoked_partitions
                        .fetch_add(partitions.len() as u64, Ordering::Relaxed);
                }
                Change::Assigned(partitions) => {
                    self.stats.assignments.fetch_add(1, Ordering::Relaxed);
                    self.stats.touch();
                    // Restored before their first message runs.
                    for p in partitions {
                        states.remove(&p);
                        assigned.insert(p);
                    }
                }
            }
            self.stats
                .health
                .assigned
                .store(assigned.len() as u64, Ordering::Release);
        }
    }

    /// Restores the claims of every partition with a message in `batch`
    /// that has none yet. A broker that fails it is waited out as an
    /// outage (bounded by `max_outage`); `false` when the consumer stops
    /// meanwhile.
    async fn restore_assigned(
        &self,
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
        let mut retrying = Retrying::new(&self.stats, self.retry);
        loop {
            match tokio::task::block_in_place(|| {
                restore::restore(&self.shared_config, &self.changelog, &missing)
            }) {
                Ok(restored) => {
                    states.extend(restored);
                    return Ok(true);
                }
                // A changelog that cannot be read as claims.
                Err(e @ Error::Fatal(_)) => return Err(e),
                // The brokers, waited out as an outage (health, max_outage).
                Err(e) => {
                    let wait = match retrying.failed(Fault::Environment, &e, jitter.next()) {
                        Decision::Stop { failing_for } => {
                            return Err(Error::Fatal(retrying.outlasted(failing_for, &e)));
                        }
                        Decision::Retry(wait) | Decision::WaitOut(wait) => wait,
                        Decision::DeadLetter => unreachable!("the environment's fault"),
                    };
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

    /// Runs one batch in as few transactions as it takes (one, unless
    /// records go one at a time: see [`split_at`](Self::split_at)).
    async fn run_batch(
        &self,
        with: &With<'_>,
        states: &mut HashMap<i32, PartitionClaims>,
        batch: &[OwnedMessage],
        jitter: &mut Jitter,
        isolate: &mut BTreeSet<String>,
    ) -> Result<(), Error> {
        let mut rest = batch;
        let mut piece = Piece::default();
        while !rest.is_empty() {
            match self
                .process(with, states, rest, jitter, piece, isolate)
                .await?
            {
                Processed::Committed { taken, rest: left } => {
                    rest = &rest[taken..];
                    piece = left;
                    // No transaction is open: the group sees the member.
                    with.busy.open();
                    self.stats.polled();
                    with.busy.poll(with.consumer, &self.topic).await;
                }
                Processed::Dropped => return Ok(()),
            }
        }
        isolate.clear();
        Ok(())
    }

    /// Runs one transaction of a batch (`batch` is what is left of it):
    /// each message's fate, then one transaction with everything the
    /// messages it takes produce and their offsets. A drop (a rewind, a
    /// rebalance) takes all of `batch` back.
    async fn process(
        &self,
        with: &With<'_>,
        states: &mut HashMap<i32, PartitionClaims>,
        batch: &[OwnedMessage],
        jitter: &mut Jitter,
        piece: Piece,
        isolate: &mut BTreeSet<String>,
    ) -> Result<Processed, Error> {
        let With {
            consumer,
            stopping,
            busy,
        } = *with;
        let mut first: BTreeMap<i32, i64> = BTreeMap::new();
        for msg in batch {
            let f = first.entry(msg.partition()).or_insert(msg.offset());
            *f = (*f).min(msg.offset());
        }
        // Fates that a refused record decided, or that the batch's earlier
        // transaction judged; the others are judged again around them (a
        // later duplicate of a refused event is not one).
        let mut forced: HashMap<usize, Fate> = HashMap::new();
        // Fates judged before (by the batch's earlier transaction, or before
        // a refusal): kept unless a refusal changed the claim they relied on.
        let Piece(mut reused) = piece;
        // Aborted transactions retried with the batch in hand (what the
        // refusals decided kept): a producer recovering from an aborted
        // transaction (an epoch bump) fails the first records of the next.
        let mut in_place = 0u32;
        let mut sweeps: BTreeMap<i32, (i64, bool)> = BTreeMap::new();
        // The fates under the current `forced`: judged again only when a
        // refusal changes it (retried transactions reuse them).
        let mut judged: Option<(Vec<Fate>, Staged)> = None;
        let (fates, tombstones, newest, rest) = loop {
            busy.open();
            if judged.is_none() {
                let mut given = reused.clone();
                given.extend(forced.clone());
                judged = match self
                    .fates(batch, states, &given, jitter, stopping, busy)
                    .await
                {
                    Ok(judged) => Some(judged),
                    Err(Halt::Fatal(e)) => return Err(e),
                    // Nothing of the batch was sent: it runs again from the
                    // committed offsets after the restart.
                    Err(Halt::Stopped) => {
                        tracing::info!(
                            "stopping while a message waits to be retried; its batch is left uncommitted"
                        );
                        return Ok(Processed::Dropped);
                    }
                    Err(Halt::Rebalanced) => {
                        busy.close();
                        tracing::info!(
                            "the group rebalanced while a message waited to be retried: the batch is dropped and runs again from its first offsets"
                        );
                        busy.rewind(consumer, &self.topic, &first)?;
                        return Ok(Processed::Dropped);
                    }
                };
            }
            let (all, staged) = judged.as_ref().expect("judged above");
            // The messages this transaction takes: all, unless records go
            // one at a time (then as many as fit in its timeout).
            let take = self.split_at(all, isolate).unwrap_or(all.len());
            let fates = &all[..take];
            let offsets = next_offsets(&self.topic, &batch[..take])?;
            // Stream time moves with the records applied or skipped (a
            // dead-lettered one may carry any timestamp).
            let mut newest: BTreeMap<i32, i64> = BTreeMap::new();
            for (msg, fate) in batch.iter().zip(fates) {
                if !matches!(fate, Fate::Dead { .. }) {
                    let n = newest.entry(msg.partition()).or_insert(i64::MIN);
                    *n = (*n).max(timestamp(msg));
                }
            }
            let mut tombstones: BTreeMap<i32, Vec<ClaimDigest>> = BTreeMap::new();
            // Per partition of the batch: the sweep's stream time, and
            // whether it tombstones all it found (at most MAX_TOMBSTONES per
            // transaction; the rest in the next batches).
            sweeps.clear();
            for (&p, state) in states.iter() {
                if !first.contains_key(&p) {
                    continue;
                }
                let now = sweep_time(
                    state
                        .stream_time
                        .max(newest.get(&p).copied().unwrap_or(i64::MIN)),
                );
                let mut expired: Vec<ClaimDigest> = state
                    .expired(now)
                    .into_iter()
                    .filter(|d| !staged.contains_key(&(p, *d)))
                    .collect();
                // Tombstones sent one at a time count against the
                // transaction's timeout too.
                let most = if isolate.contains(&self.changelog) {
                    ALONE_PER_TRANSACTION
                } else {
                    MAX_TOMBSTONES
                };
                sweeps.insert(p, (now, expired.len() <= most));
                expired.truncate(most);
                if !expired.is_empty() {
                    tombstones.insert(p, expired);
                }
            }
            busy.close();
            if busy.rebalanced(consumer.context()) {
                tracing::info!(
                    "the group rebalanced while the batch ran: it is dropped before its transaction and runs again from its first offsets"
                );
                busy.rewind(consumer, &self.topic, &first)?;
                return Ok(Processed::Dropped);
            }
            match self
                .transact(consumer, batch, fates, &tombstones, &offsets, isolate)
                .await?
            {
                Attempt::Committed => {
                    let (mut fates, _) = judged.take().expect("judged above");
                    let rest = fates.split_off(take);
                    break (fates, tombstones, newest, rest);
                }
                Attempt::Refused(i, fate) => {
                    let (all, _) = judged.take().expect("judged above");
                    reused = independent_of(batch, all, i);
                    forced.insert(i, fate);
                }
                Attempt::Ambiguous(topic) => {
                    isolate.insert(topic);
                }
                Attempt::Rewind {
                    why,
                    unwritable,
                    lost,
                } => {
                    if lost || in_place >= IN_PLACE_RETRIES {
                        self.rewind(consumer, busy, &first, &why, unwritable, jitter)
                            .await?;
                        return Ok(Processed::Dropped);
                    }
                    in_place += 1;
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    let wait = self.retry.backoff(in_place, jitter.next());
                    tracing::warn!(why, ?wait, "transaction aborted; running the batch again");
                    busy.open();
                    tokio::time::sleep(wait).await;
                }
            }
        };
        *self
            .unwritable_since
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        self.rewinds.store(0, Ordering::Relaxed);
        // Committed: what the partitions now hold.
        let (mut applied, mut skipped, mut dead) = (0, 0, 0);
        for (msg, fate) in batch.iter().zip(fates) {
            let Some(state) = states.get_mut(&msg.partition()) else {
                continue;
            };
            match fate {
                Fate::Applied { digest, entry, .. } => {
                    applied += 1;
                    state.put(digest, entry);
                }
                Fate::Skipped { .. } => skipped += 1,
                Fate::Dead { .. } => dead += 1,
            }
        }
        for (&p, state) in states.iter_mut() {
            if let Some(&at) = newest.get(&p) {
                state.advance(at);
            }
            if let Some(&(now, true)) = sweeps.get(&p) {
                state.swept(now, self.sweep_every());
            }
        }
        for (p, digests) in tombstones {
            if let Some(state) = states.get_mut(&p) {
                for d in digests {
                    state.remove(&d);
                }
            }
        }
        let s = &self.stats;
        s.applied.fetch_add(applied, Ordering::Relaxed);
        s.skipped.fetch_add(skipped, Ordering::Relaxed);
        s.dead_lettered.fetch_add(dead, Ordering::Relaxed);
        s.batches.fetch_add(1, Ordering::Relaxed);
        Ok(Processed::Committed {
            taken: batch.len() - rest.len(),
            rest: Piece(rest.into_iter().enumerate().collect()),
        })
    }

    /// How many of the batch's first messages one transaction takes while
    /// records to `isolate` topics go one at a time (each waits for its
    /// acknowledgement): as many as send at most [`ALONE_PER_TRANSACTION`]
    /// such records, at least one message, so the transaction ends within
    /// its timeout. `None`: all of them.
    fn split_at(&self, fates: &[Fate], isolate: &BTreeSet<String>) -> Option<usize> {
        if isolate.is_empty() {
            return None;
        }
        let changelog = usize::from(isolate.contains(&self.changelog));
        let mut alone = 0;
        for (i, fate) in fates.iter().enumerate() {
            alone += match fate {
                Fate::Applied { outputs, .. } => {
                    outputs
                        .iter()
                        .filter(|o| isolate.contains(&o.topic))
                        .count()
                        + changelog
                }
                Fate::Dead { .. } => usize::from(isolate.contains(&self.dead_letter_topic)),
                Fate::Skipped { .. } => 0,
            };
            if alone > ALONE_PER_TRANSACTION && i > 0 {
                return Some(i);
            }
        }
        None
    }

    /// Stream time between sweeps for expired claims: a tenth of the TTL,
    /// at least a second.
    fn sweep_every(&self) -> i64 {
        (self.handler.ttl().as_duration().as_millis() as i64 / 10).max(1_000)
    }

    /// Each message's fate, in order, and the claims they take: `forced`
    /// fates stand, the rest are judged around them.
    async fn fates(
        &self,
        batch: &[OwnedMessage],
        states: &HashMap<i32, PartitionClaims>,
        forced: &HashMap<usize, Fate>,
        jitter: &mut Jitter,
        stopping: &watch::Receiver<bool>,
        busy: &Busy,
    ) -> Result<(Vec<Fate>, Staged), Halt> {
        let mut fates = Vec::with_capacity(batch.len());
        // Claims taken in this batch, on top of the partitions' committed ones.
        let mut staged = Staged::new();
        for (i, msg) in batch.iter().enumerate() {
            let fate = match forced.get(&i) {
                Some(fate) => fate.clone(),
                None => {
                    self.fate(msg, states, &staged, jitter, stopping, busy)
                        .await?
                }
            };
            if let Fate::Applied { digest, entry, .. } = &fate {
                staged.insert((msg.partition(), *digest), *entry);
            }
            fates.push(fate);
        }
        Ok((fates, staged))
    }

    /// After an aborted transaction: the batch's partitions go back to their
    /// first offsets, so the batch runs again (or its partitions' next owner
    /// runs it). A partition still assigned that cannot be rewound stops the
    /// consumer: going on would commit past the batch.
    async fn rewind(
        &self,
        consumer: &StreamConsumer<Context>,
        busy: &Busy,
        first: &BTreeMap<i32, i64>,
        why: &str,
        unwritable: bool,
        jitter: &mut Jitter,
    ) -> Result<(), Error> {
        let failures = self.rewinds.fetch_add(1, Ordering::Relaxed) + 1;
        self.stats.retries.fetch_add(1, Ordering::Relaxed);
        if unwritable {
            let since = *self
                .unwritable_since
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(Instant::now);
            if since.elapsed() >= dlq::UNWRITABLE_FOR && failures >= 3 {
                return Err(Error::Fatal(format!(
                    "a topic of the transaction cannot be written ({why}) for {:?}: create it or \
                     grant the producer's principal Write on it",
                    since.elapsed()
                )));
            }
        }
        let wait = self.retry.outage_backoff(failures, jitter.next());
        tracing::warn!(
            why,
            ?wait,
            "transaction aborted; the batch runs again from its first offsets"
        );
        busy.rewind(consumer, &self.topic, first)?;
        busy.open();
        tokio::time::sleep(wait).await;
        Ok(())
    }

    /// What becomes of `msg`: decoded and keyed, claimed unless a live
    /// claim covers it, and run (with retries) into its outputs. Its
    /// attempts run contained ([`attempt::run`]) and their failures are
    /// judged as the database runtime's are ([`Retrying`]). It halts when an
    /// outage outlasted `max_outage` (the consumer stops with an error), or
    /// when the consumer stops while it waits to retry.
    async fn fate(
        &self,
        msg: &OwnedMessage,
        states: &HashMap<i32, PartitionClaims>,
        staged: &Staged,
        jitter: &mut Jitter,
        stopping: &watch::Receiver<bool>,
        busy: &Busy,
    ) -> Result<Fate, Halt> {
        let payload = msg.payload().unwrap_or_default();
        let headers = headers_of(msg);
        let (key, fingerprint, event) =
            match attempt::contained(|| self.handler.prepare(payload, &headers)) {
                Ok(Ok(prepared)) => prepared,
                Ok(Err(e)) => return Ok(dead(e.kind(), error_chain(&e), 1)),
                Err(said) => return Ok(dead("panic", unprepared_panic(&said), 1)),
            };
        let digest = claims::digest(&key);
        let at = timestamp(msg);
        let live = staged
            .get(&(msg.partition(), digest))
            .filter(|e| e.covers(at))
            .or_else(|| {
                states
                    .get(&msg.partition())
                    .and_then(|s| s.live(&digest, at))
            });
        if let Some(claim) = live {
            if let (Some(kept), Some(ours)) = (claim.fingerprint, fingerprint)
                && kept != ours
            {
                tracing::warn!(key = %key, "a duplicate's fingerprint differs from its claim's: the id was reused for other content");
                if self.on_fingerprint_mismatch == OnFingerprintMismatch::DeadLetter {
                    return Ok(dead(
                        "fingerprint_mismatch",
                        format!(
                            "event id {key} was claimed with fingerprint {kept} and came again with {ours}"
                        ),
                        1,
                    ));
                }
            }
            return Ok(Fate::Skipped { digest });
        }
        let mut event = Some(event);
        let mut attempt = 0u32;
        let mut retrying = Retrying::new(&self.stats, self.retry);
        loop {
            attempt += 1;
            let ev = match event.take() {
                Some(ev) => ev,
                // It decoded once; decoding is pure.
                None => match attempt::contained(|| self.handler.decode(payload)) {
                    Ok(Ok(ev)) => ev,
                    Ok(Err(e)) => return Ok(dead(e.kind(), error_chain(&e), attempt)),
                    Err(said) => return Ok(dead("panic", unprepared_panic(&said), attempt)),
                },
            };
            let handler = self.handler.clone();
            let ran = attempt::run(tracing::Span::current(), self.attempt_timeout, async move {
                let mut out = Outputs::default();
                let result = handler.handle(&mut out, ev).await;
                (out, result)
            })
            .await;
            let (error, fault) = match ran {
                Ran::Done((out, Ok(()))) => {
                    let ttl = i64::try_from(self.handler.ttl().as_duration().as_millis())
                        .unwrap_or(i64::MAX);
                    return Ok(Fate::Applied {
                        outputs: out.into_records(),
                        digest,
                        entry: Entry {
                            claimed_at: at,
                            expires_at: at.saturating_add(ttl),
                            fingerprint,
                        },
                        key,
                    });
                }
                Ran::Done((_, Err(e))) => {
                    let e = e.into_unstored_error();
                    let fault = Fault::of(&e);
                    (e, fault)
                }
                Ran::Panicked(said) => (attempt::panicked(&said), Fault::Panic),
                Ran::TimedOut(limit) => (
                    dedup_core::Error::Store(
                        StoreError::environment(AttemptTimedOut(limit))
                            .with_code("attempt_timeout"),
                    ),
                    Fault::TimedOut,
                ),
            };
            let wait = match retrying.failed(fault, &error, jitter.next()) {
                Decision::DeadLetter => {
                    return Ok(dead(fault.kind(&error), error_chain(&error), attempt));
                }
                Decision::Stop { failing_for } => {
                    return Err(Halt::Fatal(Error::Fatal(
                        retrying.outlasted(failing_for, &error),
                    )));
                }
                Decision::Retry(wait) | Decision::WaitOut(wait) => wait,
            };
            tracing::warn!(key = %key, attempt, error = %error, ?wait, "handler failed; retrying");
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            let mut stopping = stopping.clone();
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = stopping.wait_for(|s| *s) => return Err(Halt::Stopped),
                () = busy.rebalance() => return Err(Halt::Rebalanced),
            }
        }
    }

    /// One try at the batch's transaction.
    async fn transact(
        &self,
        consumer: &StreamConsumer<Context>,
        batch: &[OwnedMessage],
        fates: &[Fate],
        tombstones: &BTreeMap<i32, Vec<ClaimDigest>>,
        offsets: &TopicPartitionList,
        isolate: &BTreeSet<String>,
    ) -> Result<Attempt, Error> {
        let timeout = self.transaction_timeout;
        if let Err(e) = self.producer.begin_transaction() {
            return Err(Error::Fatal(format!("beginning a transaction failed: {e}")));
        }
        crate::failpoint::failpoint("transaction-before-outputs");
        let mut sent: Vec<(Source, DeliveryFuture)> = Vec::new();
        // Outputs and dead letters in partition order, then the changelog:
        // tombstones before the claims taken again.
        for (i, (msg, fate)) in batch.iter().zip(fates.iter()).enumerate() {
            let sent_one = match fate {
                Fate::Applied { outputs, .. } => {
                    let mut result = Ok(());
                    for out in outputs {
                        let mut record = FutureRecord::<[u8], [u8]>::to(&out.topic);
                        if let Some(k) = &out.key {
                            record = record.key(k);
                        }
                        if let Some(p) = &out.payload {
                            record = record.payload(p);
                        }
                        if let Some(p) = out.partition {
                            record = record.partition(p);
                        }
                        if !out.headers.is_empty() {
                            let mut hs = OwnedHeaders::new();
                            for (name, value) in &out.headers {
                                hs = hs.insert(Header {
                                    key: name,
                                    value: Some(value),
                                });
                            }
                            record = record.headers(hs);
                        }
                        result = self
                            .send(record, Source::Output(i), &mut sent, isolate)
                            .await;
                        if result.is_err() {
                            break;
                        }
                    }
                    result
                }
                Fate::Skipped { .. } => Ok(()),
                Fate::Dead {
                    kind,
                    message,
                    attempts,
                    keep,
                } => {
                    let why = DeadLetter {
                        topic: &self.dead_letter_topic,
                        kind,
                        message: message.clone(),
                        attempts: *attempts,
                        handler: self.handler.scope(),
                    };
                    let payload = msg.payload().unwrap_or_default();
                    let kept = keep.map_or(payload, |n| &payload[..n.min(payload.len())]);
                    let truncated = (kept.len() < payload.len()).then_some(payload.len());
                    let mut record = FutureRecord::<[u8], [u8]>::to(&self.dead_letter_topic)
                        .headers(dlq::headers(msg, &why, truncated));
                    if let Some(k) = msg.key() {
                        record = record.key(k);
                    }
                    if msg.payload().is_some() {
                        record = record.payload(kept);
                    }
                    self.send(record, Source::DeadLetter(i), &mut sent, isolate)
                        .await
                }
            };
            if let Err((source, e)) = sent_one {
                return self.send_failed(source, e, sent, isolate, fates).await;
            }
        }
        let mut values = Vec::new();
        for (msg, fate) in batch.iter().zip(fates.iter()) {
            if let Fate::Applied {
                digest, entry, key, ..
            } = fate
            {
                values.push((msg.partition(), *digest, claims::encode(entry, key)));
            }
        }
        for (&p, digests) in tombstones {
            for d in digests {
                let record = FutureRecord::<[u8], [u8]>::to(&self.changelog)
                    .partition(p)
                    .key(&d[..]);
                if let Err((source, e)) = self
                    .send(record, Source::Changelog, &mut sent, isolate)
                    .await
                {
                    return self.send_failed(source, e, sent, isolate, fates).await;
                }
            }
        }
        for (p, d, value) in &values {
            let record = FutureRecord::<[u8], [u8]>::to(&self.changelog)
                .partition(*p)
                .key(&d[..])
                .payload(&value[..]);
            if let Err((source, e)) = self
                .send(record, Source::Changelog, &mut sent, isolate)
                .await
            {
                return self.send_failed(source, e, sent, isolate, fates).await;
            }
        }
        // Every record acknowledged (or refused) before the offsets: a
        // refusal names its record, and the commit has nothing left to
        // flush (rust-rdkafka's flush would wait out a 100 ms poll for
        // acknowledgements that its polling thread takes).
        match tokio::time::timeout(timeout, first_refusal(sent)).await {
            Ok(None) => {}
            Ok(Some(refusal)) => {
                self.abort().await?;
                return self.refused_report(refusal, isolate, fates);
            }
            Err(_) => {
                return self
                    .failed(
                        "produce",
                        KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut),
                    )
                    .await;
            }
        }
        crate::failpoint::failpoint("transaction-before-offsets");
        // A member that lost partitions of the batch (it was dropped from
        // its group) must not commit them: their new owner runs them.
        let assigned = match consumer.assignment() {
            Ok(assigned) => assigned,
            Err(e) => {
                self.abort().await?;
                return Err(e.into());
            }
        };
        let lost = consumer.assignment_lost()
            || offsets
                .elements()
                .iter()
                .any(|e| assigned.find_partition(e.topic(), e.partition()).is_none());
        let group = consumer.group_metadata().filter(|_| !lost);
        let Some(group) = group else {
            self.abort().await?;
            return Ok(Attempt::Rewind {
                why: "partitions of the batch are no longer assigned".into(),
                unwritable: false,
                lost: true,
            });
        };
        let started = Instant::now();
        loop {
            match tokio::task::block_in_place(|| {
                self.producer
                    .send_offsets_to_transaction(offsets, &group, timeout)
            }) {
                Ok(()) => break,
                Err(KafkaError::Transaction(e)) if e.is_retriable() && !e.is_fatal() => {
                    self.unresolved("sending the offsets", &e, started)?;
                }
                Err(e) => return self.failed("send offsets", e).await,
            }
        }
        crate::failpoint::failpoint("transaction-before-commit");
        if crate::failpoint::fails("transaction-fails-before-commit") {
            self.abort().await?;
            return Ok(Attempt::Rewind {
                why: "failpoint transaction-fails-before-commit".into(),
                unwritable: false,
                lost: false,
            });
        }
        let started = Instant::now();
        loop {
            match tokio::task::block_in_place(|| self.producer.commit_transaction(timeout)) {
                Ok(()) => break,
                // Resumable: the same call again, until it resolves.
                Err(KafkaError::Transaction(e)) if e.is_retriable() && !e.is_fatal() => {
                    self.unresolved("committing", &e, started)?;
                }
                Err(e) => return self.failed("commit", e).await,
            }
        }
        crate::failpoint::failpoint("transaction-after-commit");
        Ok(Attempt::Committed)
    }

    /// Sends one record of the transaction, waiting while librdkafka's
    /// queue is full; `Err` if the producer refused it outright.
    async fn send<'a>(
        &self,
        mut record: FutureRecord<'a, [u8], [u8]>,
        source: Source,
        sent: &mut Vec<(Source, DeliveryFuture)>,
        isolate: &BTreeSet<String>,
    ) -> Result<(), (Source, KafkaError)> {
        let alone = isolate.contains(record.topic);
        loop {
            match self.producer.send_result(record) {
                // Alone in its request: its acknowledgement names it.
                Ok(fut) if alone => {
                    let _ = self.producer.flush(Duration::ZERO);
                    return match tokio::time::timeout(self.transaction_timeout, fut).await {
                        Ok(Ok(Ok(_))) => Ok(()),
                        Ok(Ok(Err((e, _)))) => Err((source, e)),
                        _ => Err((source, KafkaError::Canceled)),
                    };
                }
                Ok(fut) => {
                    sent.push((source, fut));
                    return Ok(());
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err((source, e)),
            }
        }
    }

    /// A send refused outright. Its own size or topic: its message's fate.
    /// Anything else may follow from an earlier request's refusal (the
    /// transaction, once failed, refuses every later record), so the earlier
    /// records' reports are looked at first.
    async fn send_failed(
        &self,
        source: Source,
        e: KafkaError,
        sent: Vec<(Source, DeliveryFuture)>,
        isolate: &BTreeSet<String>,
        fates: &[Fate],
    ) -> Result<Attempt, Error> {
        if is_records_fault(&e) {
            self.abort().await?;
            return self.refused(source, e, fates);
        }
        let earlier = tokio::time::timeout(self.transaction_timeout, first_refusal(sent))
            .await
            .ok()
            .flatten();
        self.abort().await?;
        match earlier {
            Some(refusal) if is_records_fault(&refusal.1) => {
                self.refused_report(refusal, isolate, fates)
            }
            _ => self.refused(source, e, fates),
        }
    }

    /// A refusal reported by the broker for a record of topic `.2`: named
    /// for certain only if the record was alone in its request.
    fn refused_report(
        &self,
        (source, e, topic): (Source, KafkaError, Option<String>),
        isolate: &BTreeSet<String>,
        fates: &[Fate],
    ) -> Result<Attempt, Error> {
        match topic {
            Some(topic) if is_records_fault(&e) && !isolate.contains(&topic) => {
                tracing::warn!(error = %e, topic, "the broker refused records of the transaction; sending that topic's one at a time to find the one at fault");
                Ok(Attempt::Ambiguous(topic))
            }
            _ => self.refused(source, e, fates),
        }
    }

    /// A record refused for its own sake changes its message's fate: an
    /// output too large (or to an invalid topic) dead-letters its event, a
    /// dead letter too large is cut. Anything else is the environment's.
    fn refused(&self, source: Source, e: KafkaError, fates: &[Fate]) -> Result<Attempt, Error> {
        match source {
            Source::Output(i) if is_records_fault(&e) => {
                tracing::warn!(error = %e, "an output of the handler was refused; the event is dead-lettered");
                Ok(Attempt::Refused(
                    i,
                    dead(
                        "output",
                        format!("the handler's output was refused: {e}"),
                        1,
                    ),
                ))
            }
            Source::DeadLetter(i) if dlq::is_too_large(&e) => {
                let Fate::Dead {
                    kind,
                    message,
                    attempts,
                    keep,
                } = &fates[i]
                else {
                    unreachable!("a dead letter's source is dead");
                };
                let keep = match keep {
                    None => Some(dlq::TRUNCATED_PAYLOAD_BYTES),
                    Some(0) => {
                        return Err(Error::Fatal(format!(
                            "a dead letter for {:?} is too large even without its payload: raise the topic's max.message.bytes",
                            self.dead_letter_topic
                        )));
                    }
                    Some(_) => Some(0),
                };
                tracing::warn!(error = %e, ?keep, "the dead letter is too large for the broker; sending it with its payload cut");
                Ok(Attempt::Refused(
                    i,
                    Fate::Dead {
                        kind,
                        message: message.clone(),
                        attempts: *attempts,
                        keep,
                    },
                ))
            }
            Source::Changelog
                if matches!(
                    e,
                    KafkaError::MessageProduction(
                        RDKafkaErrorCode::UnknownPartition
                            | RDKafkaErrorCode::UnknownTopicOrPartition
                    )
                ) && self.partition_missing() =>
            {
                Err(Error::Fatal(format!(
                    "the changelog {:?} has no partition for every input partition of {:?}: the \
                     input gained partitions; add as many to the changelog",
                    self.changelog, self.topic
                )))
            }
            Source::DeadLetter(_)
                if matches!(
                    e,
                    KafkaError::MessageProduction(RDKafkaErrorCode::InvalidRecord)
                ) =>
            {
                Err(Error::Fatal(format!(
                    "the dead-letter topic {:?} refuses dead letters ({e}): is it compacted? \
                     Dead letters may have no key",
                    self.dead_letter_topic
                )))
            }
            _ => Ok(Attempt::Rewind {
                why: format!("a record was refused: {e}"),
                unwritable: dlq::is_unwritable(&e),
                lost: false,
            }),
        }
    }

    /// Whether the changelog has fewer partitions than the input now.
    fn partition_missing(&self) -> bool {
        let count = |topic: &str| -> Option<usize> {
            let metadata = self
                .producer
                .client()
                .fetch_metadata(Some(topic), Duration::from_secs(10))
                .ok()?;
            metadata.topics().first().map(|t| t.partitions().len())
        };
        tokio::task::block_in_place(
            || matches!((count(&self.topic), count(&self.changelog)), (Some(i), Some(c)) if c < i),
        )
    }

    /// A retriable error of a call librdkafka resumes: the same call goes
    /// again, unless it has stayed unresolved for [`UNRESOLVED_LIMIT`].
    fn unresolved(
        &self,
        step: &str,
        e: &rdkafka::error::RDKafkaError,
        since: Instant,
    ) -> Result<(), Error> {
        if since.elapsed() >= UNRESOLVED_LIMIT {
            return Err(Error::Fatal(format!(
                "{step} a transaction stayed unresolved for {:?} ({e}): stopping; a restart \
                 resumes from what Kafka committed",
                since.elapsed()
            )));
        }
        tracing::warn!(error = %e, step, "transaction: retrying");
        Ok(())
    }

    /// Aborts the open transaction; a retriable failure is retried (the
    /// same call resumes), anything else stops the consumer.
    async fn abort(&self) -> Result<(), Error> {
        let started = Instant::now();
        loop {
            match tokio::task::block_in_place(|| {
                self.producer.abort_transaction(self.transaction_timeout)
            }) {
                Ok(()) => return Ok(()),
                Err(KafkaError::Transaction(e)) if e.is_retriable() && !e.is_fatal() => {
                    self.unresolved("aborting", &e, started)?;
                }
                Err(e) => {
                    return Err(Error::Fatal(format!(
                        "aborting the transaction failed: {e}"
                    )));
                }
            }
        }
    }

    /// A step of the transaction failed: fatal errors stop the consumer,
    /// anything else aborts and rewinds.
    async fn failed(&self, step: &str, e: KafkaError) -> Result<Attempt, Error> {
        if is_fatal(&e) {
            return Err(Error::Fatal(format!(
                "the transactional producer failed fatally at {step} (another instance with \
                 transactional.id {:?}?): {e}",
                self.transactional_id
            )));
        }
        self.abort().await?;
        Ok(Attempt::Rewind {
            why: format!("{step}: {e}"),
            unwritable: dlq::is_unwritable(&e),
            lost: false,
        })
    }
}

/// The first record the broker refused, awaiting every report: one refused
/// for its own sake (a size, an invalid record) if there is one, since a
/// refusal makes the transaction fail the records after it too; with the
/// topic it was sent to.
async fn first_refusal(
    sent: Vec<(Source, DeliveryFuture)>,
) -> Option<(Source, KafkaError, Option<String>)> {
    let mut first = None;
    for (source, fut) in sent {
        let (error, topic) = match fut.await {
            Ok(Ok(_)) => continue,
            Ok(Err((err, msg))) => (err, Some(msg.topic().to_owned())),
            Err(_) => (KafkaError::Canceled, None),
        };
        if is_records_fault(&error) && !matches!(source, Source::Changelog) {
            return Some((source, error, topic));
        }
        first.get_or_insert((source, error, topic));
    }
    first
}

/// The fates of `all` that stand when message `refused`'s fate changes
/// after a refusal: all but its own and, if it had taken a claim, those of
/// the later messages of its partition that relied on that claim (skipped
/// as its duplicates, or dead-lettered for a fingerprint that differs from
/// it). Those are judged again; no handler runs twice for the others.
fn independent_of(batch: &[OwnedMessage], all: Vec<Fate>, refused: usize) -> HashMap<usize, Fate> {
    let claim = match &all[refused] {
        Fate::Applied { digest, .. } => Some(*digest),
        _ => None,
    };
    let partition = batch[refused].partition();
    all.into_iter()
        .enumerate()
        .filter(|(j, fate)| {
            let relied = claim.is_some()
                && *j > refused
                && batch[*j].partition() == partition
                && match fate {
                    Fate::Skipped { digest } => Some(*digest) == claim,
                    Fate::Dead { kind, .. } => *kind == "fingerprint_mismatch",
                    Fate::Applied { .. } => false,
                };
            *j != refused && !relied
        })
        .collect()
}

/// The offsets to commit after `messages`: each partition's next.
fn next_offsets(topic: &str, messages: &[OwnedMessage]) -> Result<TopicPartitionList, Error> {
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    for msg in messages {
        let n = next.entry(msg.partition()).or_insert(msg.offset() + 1);
        *n = (*n).max(msg.offset() + 1);
    }
    let mut offsets = TopicPartitionList::new();
    for (p, o) in next {
        offsets.add_partition_offset(topic, p, Offset::Offset(o))?;
    }
    Ok(offsets)
}

/// The stream time up to which claims may be tombstoned: never past the
/// wall clock, so a record stamped in the future cannot expire the claims
/// of everything before it.
fn sweep_time(stream_time: i64) -> i64 {
    stream_time.min(now_ms())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Why a message that panicked before its handler ran is dead-lettered.
fn unprepared_panic(said: &str) -> String {
    format!("decoding the event or reading its key panicked: {said}")
}

fn dead(kind: &'static str, message: String, attempts: u32) -> Fate {
    Fate::Dead {
        kind,
        message,
        attempts,
        keep: None,
    }
}

/// The record's timestamp in ms; the wall clock for a record without one.
fn timestamp(msg: &OwnedMessage) -> i64 {
    msg.timestamp().to_millis().unwrap_or_else(now_ms)
}

fn is_fatal(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(t) if t.is_fatal())
}

/// A produce error that no retry can help for this record.
fn is_records_fault(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::UnknownPartition
        )
    )
}

#[cfg(test)]
mod tests {
    use rdkafka::Timestamp;

    use super::*;

    fn message(partition: i32, offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            None,
            None,
            "in".into(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    fn applied(id: &str) -> Fate {
        let key = DedupKey::new("t", id).expect("key");
        Fate::Applied {
            outputs: Vec::new(),
            digest: claims::digest(&key),
            entry: Entry {
                claimed_at: 0,
                expires_at: 1,
                fingerprint: None,
            },
            key,
        }
    }

    fn skipped(id: &str) -> Fate {
        Fate::Skipped {
            digest: claims::digest(&DedupKey::new("t", id).expect("key")),
        }
    }

    /// An output refused dead-letters its event: what relied on its claim
    /// (later duplicates in its partition, fingerprint mismatches) is
    /// judged again, everything else stands (no handler runs twice).
    #[test]
    fn a_refusal_rejudges_only_what_relied_on_the_refused_claim() {
        let batch: Vec<OwnedMessage> = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (0, 5)]
            .into_iter()
            .map(|(p, o)| message(p, o))
            .collect();
        let fates = vec![
            skipped("a"),
            applied("a"),
            applied("b"),
            skipped("a"),
            dead("fingerprint_mismatch", String::new(), 1),
            skipped("a"),
            skipped("b"),
        ];
        let mut stand: Vec<usize> = independent_of(&batch, fates.clone(), 1)
            .into_keys()
            .collect();
        stand.sort_unstable();
        // 0 came before the refused one, 2 and 6 rely on "b", 5 is another
        // partition's.
        assert_eq!(stand, [0, 2, 5, 6]);
        // A dead letter refused (cut) changes no claim: only its own fate.
        let mut stand: Vec<usize> = independent_of(&batch, fates, 4).into_keys().collect();
        stand.sort_unstable();
        assert_eq!(stand, [0, 1, 2, 3, 5, 6]);
    }
}
