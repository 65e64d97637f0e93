#![doc = include_str!("../README.md")]

mod dlq;
mod relay;
mod retry;
mod route;
mod runtime;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::{DedupStore, Handler};
use rdkafka::ClientConfig;

pub use dlq::MAX_ERROR_MESSAGE_BYTES;
pub use relay::{Relay, RelayBuilder, RelayStats, RelayStatsSnapshot};
pub use retry::RetryPolicy;
pub use runtime::{Stats, StatsSnapshot, shutdown_signal};

use route::ErasedHandler;

/// Errors that stop a consumer from starting or running.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The builder's settings are incomplete or inconsistent.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// librdkafka refused a setting or an operation.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

/// A topic routed to a handler, with where its poison messages go.
struct Route<S> {
    topic: String,
    handler: Arc<dyn ErasedHandler<S>>,
    dead_letter_topic: String,
}

/// Settings whose values must never be logged or shown by `Debug`.
fn is_secret(key: &str) -> bool {
    [
        "password",
        "secret",
        "jaas",
        "token",
        "ssl.key.pem",
        "ssl.keystore",
    ]
    .iter()
    .any(|s| key.contains(s))
}

/// Settings as `Debug` may show them: secrets' values masked.
fn redacted(settings: &[(String, String)]) -> Vec<(&str, &str)> {
    settings
        .iter()
        .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v.as_str() }))
        .collect()
}

/// Builds a [`Consumer`]: brokers, group, topic -> handler routes, and any
/// librdkafka setting passed through.
///
/// ```no_run
/// # use dedup_core::{HandlerError, MemoryStore, MemoryTx, idempotent};
/// # #[derive(serde::Deserialize)] struct Payment { event_id: String }
/// # #[idempotent(key = "event_id", ttl = "4h")]
/// # async fn record_payment(_tx: &mut MemoryTx, _ev: Payment) -> Result<(), HandlerError> { Ok(()) }
/// # async fn run() -> Result<(), dedup_kafka::Error> {
/// use dedup_kafka::Consumer;
///
/// let stats = Consumer::builder(MemoryStore::new())
///     .brokers("localhost:9092")
///     .group_id("payments-v1")
///     .set("security.protocol", "plaintext")
///     .handle("payments", record_payment) // poison messages go to payments.dlq
///     .run() // until SIGINT or SIGTERM
///     .await?;
/// println!("{stats}");
/// # Ok(()) }
/// ```
pub struct ConsumerBuilder<S> {
    store: S,
    brokers: String,
    group_id: Option<String>,
    settings: Vec<(String, String)>,
    routes: Vec<Route<S>>,
    dead_letter_overrides: HashMap<String, String>,
    retry: RetryPolicy,
    batch_size: usize,
    batch_linger: Duration,
    max_concurrent_partitions: usize,
    max_buffered_per_partition: usize,
    commit_interval: Duration,
    shutdown_timeout: Duration,
    dead_letter_timeout: Duration,
}

impl<S> fmt::Debug for ConsumerBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let settings = redacted(&self.settings);
        f.debug_struct("ConsumerBuilder")
            .field("brokers", &self.brokers)
            .field("group_id", &self.group_id)
            .field("settings", &settings)
            .field(
                "topics",
                &self.routes.iter().map(|r| &r.topic).collect::<Vec<_>>(),
            )
            .field("retry", &self.retry)
            .finish_non_exhaustive()
    }
}

impl<S: DedupStore> ConsumerBuilder<S> {
    fn new(store: S) -> Self {
        ConsumerBuilder {
            store,
            brokers: "localhost:9092".to_owned(),
            group_id: None,
            settings: Vec::new(),
            routes: Vec::new(),
            dead_letter_overrides: HashMap::new(),
            retry: RetryPolicy::default(),
            batch_size: 200,
            batch_linger: Duration::from_millis(5),
            max_concurrent_partitions: 16,
            max_buffered_per_partition: 10_000,
            commit_interval: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(30),
            dead_letter_timeout: Duration::from_secs(30),
        }
    }

    /// The bootstrap brokers (`bootstrap.servers`), default `localhost:9092`.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.brokers = brokers.into();
        self
    }

    /// The consumer group (required).
    pub fn group_id(mut self, group_id: impl Into<String>) -> Self {
        self.group_id = Some(group_id.into());
        self
    }

    /// Passes any librdkafka setting through, to the consumer and the
    /// dead-letter producer (`security.protocol`, `sasl.*`, `ssl.*`,
    /// `auto.offset.reset`, ...). The settings that make offsets safe
    /// (`enable.auto.commit`, `enable.auto.offset.store`) cannot be
    /// overridden.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((key.into(), value.into()));
        self
    }

    /// Routes `topic` to `handler`. Its dead letters go to `<topic>.dlq`
    /// unless [`dead_letter_topic`](Self::dead_letter_topic) says otherwise.
    pub fn handle<H>(mut self, topic: impl Into<String>, handler: H) -> Self
    where
        H: Handler<Tx = S::Tx>,
    {
        let topic = topic.into();
        self.routes.push(Route {
            dead_letter_topic: format!("{topic}.dlq"),
            topic,
            handler: Arc::new(handler),
        });
        self
    }

    /// Sends the dead letters of `topic` to `dead_letter_topic`.
    pub fn dead_letter_topic(
        mut self,
        topic: impl Into<String>,
        dead_letter_topic: impl Into<String>,
    ) -> Self {
        self.dead_letter_overrides
            .insert(topic.into(), dead_letter_topic.into());
        self
    }

    /// How retryable failures are retried before dead-lettering.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Most messages of one partition applied in one transaction (default
    /// 200): one claim statement for all their keys and one commit, instead
    /// of a commit per message. `1` is the per-message mode. A failure inside
    /// a batch rolls it back and replays it message by message.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How long a partition waits for more messages to fill a batch
    /// (default 5 ms); what is already fetched is taken at once.
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.batch_linger = linger;
        self
    }

    /// How many partitions may run a handler at once (default 16).
    /// Messages of one partition always run one at a time, in order.
    pub fn max_concurrent_partitions(mut self, n: usize) -> Self {
        self.max_concurrent_partitions = n.max(1);
        self
    }

    /// How many fetched messages one partition may hold before fetching from
    /// it pauses (default 10,000); it resumes at half. Pausing makes
    /// librdkafka drop what it prefetched for the partition and fetch it
    /// again, so the bound is for a partition that has fallen far behind, not
    /// for steady flow: the benchmark ran about 4x slower with 1,000. Memory
    /// is about this many payloads per slow partition.
    pub fn max_buffered_per_partition(mut self, n: usize) -> Self {
        self.max_buffered_per_partition = n.max(2);
        self
    }

    /// How often stored offsets are committed (default 5 s). They are also
    /// committed synchronously on revoke and on shutdown.
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// How long shutdown waits for in-flight messages (default 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    fn client_config(&self) -> Result<ClientConfig, Error> {
        let group = self.group_id.as_deref().ok_or_else(|| {
            Error::Config("a group id is required: .group_id(\"my-service-v1\")".into())
        })?;
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("auto.offset.reset", "earliest");
        for (k, v) in &self.settings {
            config.set(k, v);
        }
        // Offsets are stored only once a message is finished, and committed
        // by the runtime: never by librdkafka on its own schedule.
        config
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        Ok(config)
    }

    fn producer_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (k, v) in self.settings.iter().filter(|(k, _)| is_shared_setting(k)) {
            config.set(k, v);
        }
        config
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set(
                "message.timeout.ms",
                self.dead_letter_timeout.as_millis().to_string(),
            );
        config
    }

    /// Builds the consumer without starting it.
    pub fn build(self) -> Result<Consumer<S>, Error> {
        if self.routes.is_empty() {
            return Err(Error::Config(
                "no topic has a handler: add .handle(\"topic\", handler)".into(),
            ));
        }
        let mut topics = std::collections::HashSet::new();
        if let Some(dup) = self.routes.iter().find(|r| !topics.insert(r.topic.clone())) {
            return Err(Error::Config(format!(
                "topic {:?} has two handlers",
                dup.topic
            )));
        }
        let consumer_config = self.client_config()?;
        let producer_config = self.producer_config();
        let ConsumerBuilder {
            store,
            mut routes,
            dead_letter_overrides,
            ..
        } = self;
        for route in &mut routes {
            if let Some(dlq) = dead_letter_overrides.get(&route.topic) {
                route.dead_letter_topic = dlq.clone();
            }
        }
        runtime::Consumer::new(
            store,
            routes,
            consumer_config,
            producer_config,
            runtime::Settings {
                batch_size: self.batch_size,
                batch_linger: self.batch_linger,
                retry: self.retry,
                max_concurrent_partitions: self.max_concurrent_partitions,
                max_buffered_per_partition: self.max_buffered_per_partition,
                commit_interval: self.commit_interval,
                shutdown_timeout: self.shutdown_timeout,
                dead_letter_timeout: self.dead_letter_timeout,
            },
        )
        .map(Consumer)
    }

    /// Builds and runs until SIGINT or SIGTERM; see [`Consumer::run`].
    pub async fn run(self) -> Result<StatsSnapshot, Error> {
        self.build()?.run().await
    }

    /// Builds and runs until `shutdown` completes; see
    /// [`Consumer::run_until`].
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<StatsSnapshot, Error> {
        self.build()?.run_until(shutdown).await
    }
}

/// Client settings that apply to the dead-letter producer as well (security
/// and networking), as opposed to consumer-only ones.
fn is_shared_setting(key: &str) -> bool {
    [
        "security.",
        "sasl.",
        "ssl.",
        "client.",
        "socket.",
        "broker.",
        "reconnect.",
        "metadata.",
        "debug",
    ]
    .iter()
    .any(|p| key.starts_with(p))
}

/// An idempotent Kafka consumer: runs each message through its topic's
/// `#[idempotent]` handler and commits its offset only once the handler's
/// transaction has committed (or the message was skipped as a duplicate, or
/// dead-lettered).
pub struct Consumer<S: DedupStore>(runtime::Consumer<S>);

impl<S: DedupStore> Consumer<S> {
    /// Starts building a consumer over `store`.
    pub fn builder(store: S) -> ConsumerBuilder<S> {
        ConsumerBuilder::new(store)
    }

    /// Live counters: applied, skipped, dead-lettered, retries, and how long
    /// the consumer has been idle.
    pub fn stats(&self) -> Arc<Stats> {
        self.0.stats()
    }

    /// Runs until SIGINT or SIGTERM, then shuts down gracefully (see
    /// [`run_until`](Self::run_until)).
    pub async fn run(self) -> Result<StatsSnapshot, Error> {
        self.run_until(runtime::shutdown_signal()).await
    }

    /// Runs until `shutdown` completes. Then: stop fetching, let in-flight
    /// messages finish (up to the shutdown timeout), commit what finished,
    /// leave the group. Returns the final counters.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<StatsSnapshot, Error> {
        self.0.run_until(shutdown).await
    }
}

impl<S: DedupStore> fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("stats", &self.0.stats().snapshot())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedup_core::MemoryStore;

    #[test]
    fn debug_hides_secrets() {
        let b = Consumer::builder(MemoryStore::new())
            .group_id("g")
            .set("sasl.password", "hunter2")
            .set("sasl.username", "svc");
        let shown = format!("{b:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("svc"), "{shown}");
    }

    #[test]
    fn offsets_settings_cannot_be_overridden() {
        let b = Consumer::builder(MemoryStore::new())
            .group_id("g")
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "true");
        let config = b.client_config().unwrap();
        assert_eq!(config.get("enable.auto.commit"), Some("false"));
        assert_eq!(config.get("enable.auto.offset.store"), Some("false"));
    }

    /// A consumer must read whatever codec its producers chose; a librdkafka
    /// built without one fails every batch of a topic that uses it. The
    /// build no longer needs system headers, so check what it linked.
    #[test]
    fn the_linked_librdkafka_decodes_every_compression_codec() {
        let native = rdkafka::ClientConfig::new()
            .create_native_config()
            .expect("native config");
        let features = native.get("builtin.features").expect("builtin.features");
        let features: Vec<&str> = features.split(',').collect();
        for codec in ["gzip", "snappy", "lz4", "zstd"] {
            assert!(features.contains(&codec), "{codec} missing: {features:?}");
        }
    }

    #[test]
    fn a_group_and_a_handler_are_required() {
        let err = Consumer::builder(MemoryStore::new()).build().unwrap_err();
        assert!(err.to_string().contains("no topic has a handler"), "{err}");
    }
}
