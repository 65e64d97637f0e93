//! The consumer's builder: brokers, group, routes, librdkafka settings
//! passed through, and the runtime's settings.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use dedup_core::DedupStore;
use rdkafka::ClientConfig;

use crate::Error;
use crate::config::{self, ClientSettings, Settings, redacted};
use crate::database::consumer::Consumer;
use crate::database::route::Route;
use crate::retry::RetryPolicy;
use crate::stats::StatsSnapshot;

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
    pub(super) store: S,
    /// The brokers, the group and the librdkafka settings passed through.
    pub(super) client: ClientSettings,
    /// librdkafka settings of the dead-letter producer only.
    pub(super) dead_letter_settings: Vec<(String, String)>,
    pub(super) routes: Vec<Route<S>>,
    pub(super) dead_letter_overrides: HashMap<String, String>,
    /// What becomes of the other event types of a typed topic.
    pub(super) other_types: HashMap<String, crate::OtherTypes>,
    pub(super) order_by: HashMap<String, crate::OrderBy>,
    /// The retry tiers of every handled topic, or why they are wrong.
    pub(super) tiers: crate::config::TierSetting,
    pub(super) runtime: Settings,
    /// Whether `max_concurrent_partitions` was set (else it is fitted to
    /// the store's connections).
    pub(super) concurrency_set: bool,
    /// Where to serve metrics and health, if anywhere.
    #[cfg(feature = "http")]
    pub(super) http: Option<String>,
}

impl<S> fmt::Debug for ConsumerBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("client", &self.client)
            .field(
                "dead_letter_settings",
                &redacted(&self.dead_letter_settings),
            )
            .field(
                "topics",
                &self.routes.iter().map(|r| &r.topic).collect::<Vec<_>>(),
            )
            .field("retry", &self.runtime.pipeline.retry)
            .finish_non_exhaustive()
    }
}

impl<S> ConsumerBuilder<S> {
    /// The dead-letter producer's configuration: the shared settings (how to
    /// reach and trust the brokers; the others are the consumer's), the
    /// runtime's defaults, the dead-letter producer's own settings, then the
    /// idempotence settings, which none of them can override.
    fn dead_letter_producer_config(&self) -> Result<ClientConfig, Error> {
        config::check_features(&self.dead_letter_settings)?;
        config::refuse_own_settings(
            &self.dead_letter_settings,
            &config::PRODUCER_OWN_SETTINGS,
            "the dead-letter producer",
            "idempotence and acks=all are always on; dead_letter_timeout() sets the timeout",
        )?;
        let defaults = [
            // librdkafka's own default (1,000,000 bytes) is below the
            // broker's, so a message that fitted its topic could not be
            // dead-lettered.
            (
                "message.max.bytes".to_owned(),
                crate::dead_letter_format::MAX_DEAD_LETTER_BYTES.to_owned(),
            ),
            // One dead letter per request: dead letters are rare, and
            // batched together they could exceed a limit each one fits.
            ("batch.num.messages".to_owned(), "1".to_owned()),
        ];
        let settings = self
            .client
            .shared()
            .chain(&defaults)
            .chain(&self.dead_letter_settings);
        Ok(config::idempotent_producer_config(
            &self.client.brokers,
            settings,
            self.runtime.dead_letter_timeout,
        ))
    }
}

impl<S: DedupStore> Consumer<S> {
    /// Starts building a consumer over `store`.
    pub fn builder(store: S) -> ConsumerBuilder<S> {
        ConsumerBuilder::new(store)
    }
}

impl<S: DedupStore> ConsumerBuilder<S> {
    pub(crate) fn new(store: S) -> Self {
        ConsumerBuilder {
            store,
            client: ClientSettings::default(),
            dead_letter_settings: Vec::new(),
            routes: Vec::new(),
            dead_letter_overrides: HashMap::new(),
            other_types: HashMap::new(),
            order_by: HashMap::new(),
            tiers: Default::default(),
            runtime: Settings::default(),
            concurrency_set: false,
            #[cfg(feature = "http")]
            http: None,
        }
    }

    /// The bootstrap brokers (`bootstrap.servers`), default `localhost:9092`.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.client.brokers = brokers.into();
        self
    }

    /// The consumer group (required).
    pub fn group_id(mut self, group_id: impl Into<String>) -> Self {
        self.client.group_id = Some(group_id.into());
        self
    }

    /// Passes any librdkafka setting through, to the consumer and the
    /// dead-letter producer (`security.protocol`, `sasl.*`, `ssl.*`,
    /// `auto.offset.reset`, ...). The settings that make offsets safe
    /// (`enable.auto.commit`, `enable.auto.offset.store`) cannot be
    /// overridden.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client.set(key.into(), value.into());
        self
    }

    /// Passes every environment variable `<prefix><NAME>` to librdkafka as
    /// `<name>`: lower case, `_` becoming `.` and `__` a literal `_`
    /// (`KAFKA_CFG_GROUP_PROTOCOL=consumer` sets `group.protocol`,
    /// `KAFKA_CFG_PARTITION_ASSIGNMENT_STRATEGY=cooperative-sticky`,
    /// `KAFKA_CFG_LOG__LEVEL=7` sets `log_level`), in name order, after the
    /// settings given so far. `build()` checks each one with librdkafka and
    /// names the variable of one it refuses (never its value, which may be a
    /// password).
    pub fn set_from_env(mut self, prefix: &str) -> Self {
        self.client.set_from_env(prefix);
        self
    }

    /// Where every client of the consumer (the consumer, the dead-letter
    /// producer, the start-up checks' clients) gets its SASL OAUTHBEARER
    /// token: called on a thread of its own at `build()`, before each token
    /// expires, and whenever librdkafka asks (see [`TokenProvider`](crate::TokenProvider)).
    /// Use with `security.protocol=SASL_SSL` and `sasl.mechanisms=OAUTHBEARER`.
    /// Its failures are an outage: logged, counted, waited out.
    pub fn oauth_token_provider(mut self, provider: impl crate::TokenProvider) -> Self {
        self.client.oauth.set(provider);
        self
    }

    /// Passes a librdkafka setting to the dead-letter producer only, after
    /// the shared ones (`linger.ms`, `compression.type`, a
    /// `message.max.bytes` for topics that allow larger records...).
    /// `enable.idempotence`, `acks` and `message.timeout.ms` (and their
    /// aliases `request.required.acks`, `delivery.timeout.ms`) stay the
    /// runtime's: `build()` refuses them.
    pub fn dead_letter_producer_set(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        self.dead_letter_settings.push((key.into(), value.into()));
        self
    }

    /// Non-blocking retries: after a few short attempts in place, an event
    /// whose handler keeps failing transiently moves to the first of these
    /// retry tiers (`<topic>.retry-30s` for `"30s"`), then the next, then
    /// the dead-letter topic, while its partition moves on. Each tier's
    /// records wait their delay (the tier's partition is paused until its
    /// next record is due), and this consumer reads the tiers too unless
    /// [`RetryTiers::read`](crate::RetryTiers::read) says otherwise. A move is recorded like a dead
    /// letter, so a redelivery neither moves an event twice nor applies
    /// it; failures of the environment (an outage, a timeout) are waited
    /// out in place as always. Create the tier topics like the dead-letter
    /// topic, with as many partitions as the handled topic. A bad delay is
    /// reported by `build()`.
    ///
    /// Events of one key may be applied out of their order while an
    /// earlier one waits in a tier (see the book's "Retry tiers").
    pub fn retry_tiers<I>(mut self, delays: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        self.tiers.set_delays(delays);
        self
    }

    /// Retry tiers named and placed as `tiers` says (see
    /// [`retry_tiers`](Self::retry_tiers)).
    pub fn retry_tiers_with(mut self, tiers: crate::RetryTiers) -> Self {
        self.tiers.set(tiers);
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
        self.runtime.pipeline.retry = policy;
        self
    }

    /// Most messages of one partition applied in one transaction (default
    /// 200): one claim statement for all their keys and one commit, instead
    /// of a commit per message. `1` is the per-message mode. A failure inside
    /// a batch rolls it back and replays it message by message.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.runtime.pipeline.set_batch_size(n);
        self
    }

    /// Most bytes of keys and payloads in one batch (default 16 MiB): a
    /// batch is full at [`batch_size`](Self::batch_size) messages or at
    /// this many bytes, whichever comes first, so large records make
    /// smaller batches (a record larger than this is a batch alone).
    pub fn batch_bytes(mut self, bytes: usize) -> Self {
        self.runtime.pipeline.batching.bytes = bytes;
        self
    }

    /// How long an idle partition's first message waits for more to fill a
    /// batch (default 5 ms). Messages that queued behind a running batch
    /// are taken at once, without waiting: under load a batch forms while
    /// the one before it runs.
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.runtime.pipeline.batching.linger = linger;
        self
    }

    /// How many partitions may run a handler at once (default 16, or the
    /// store's connections if it has fewer: each running partition holds
    /// one). Messages of one partition run one batch at a time, in order,
    /// unless [`key_concurrency`](Self::key_concurrency) is set: then this
    /// bounds the transactions running at once (default: the store's
    /// connections). Set above the store's connections, the consumer warns at start-up:
    /// partitions would wait for connections.
    pub fn max_concurrent_partitions(mut self, n: usize) -> Self {
        self.runtime.max_concurrent_partitions = n.max(1);
        self.concurrency_set = true;
        self
    }

    /// Key-ordered concurrency: up to `n` handler calls of one partition
    /// run at once (default 0: one at a time, in offset order). Events of
    /// one ordering key (the record key, or what [`order_by`](Self::order_by)
    /// names) still run one at a time, in offset order; only events of
    /// different keys overlap. A handler that waits on something slow (a
    /// payment provider, a slow statement) then goes up to `n` times
    /// faster per partition without repartitioning the topic.
    ///
    /// - A lease handler ([`handle_leased`](Self::handle_leased)) runs up
    ///   to `n` events at once.
    /// - A database handler runs up to `n` transactions at once; the events
    ///   free to start are shared among them (at most `batch_size` each), so
    ///   a slow statement holds up few others while a fast handler still
    ///   batches under load. Each transaction holds a connection: the
    ///   store's pool bounds them across partitions (`max_concurrent_partitions`
    ///   defaults to the pool's size here, and counts transactions).
    ///
    /// The offset committed is always the partition's first unfinished
    /// event: after a crash, events that finished above it are redelivered
    /// and skipped by their claims (counted as redelivered). Events
    /// received and not yet below the committed offset count against
    /// `max_buffered_per_partition`, so a key that is slow for long holds
    /// the others back only once that many have passed it.
    pub fn key_concurrency(mut self, n: usize) -> Self {
        self.runtime.pipeline.key_concurrency = n;
        self
    }

    /// What orders `topic`'s events under
    /// [`key_concurrency`](Self::key_concurrency) (default: the record
    /// key): `OrderBy::field("account_id")` keeps each account's events in
    /// order when records are keyed by something else.
    pub fn order_by(mut self, topic: impl Into<String>, order: crate::OrderBy) -> Self {
        self.order_by.insert(topic.into(), order);
        self
    }

    /// How many fetched messages one partition may hold before fetching from
    /// it pauses (default 5,000); it resumes at half. Pausing makes
    /// librdkafka drop what it prefetched for the partition and fetch it
    /// again, so the bound is for a partition that has fallen far behind, not
    /// for steady flow: in the benchmark's backlog (6 partitions) 5,000 ran
    /// as fast as 10,000 at 40 MiB peak RSS instead of 60, and 2,000 about
    /// 0.75x as fast at 31 MiB. Memory is about this many payloads per
    /// slow partition.
    pub fn max_buffered_per_partition(mut self, n: usize) -> Self {
        self.runtime.max_buffered_per_partition = n.max(2);
        self
    }

    /// How often stored offsets are committed (default 5 s, at least 1 ms).
    /// They are also committed synchronously on revoke and on shutdown.
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        // A zero period would panic in the consumer loop's timer.
        self.runtime.commit_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Longest one attempt at a message or a batch may take: begin, claim,
    /// the handler body, commit (default 60 s, at least 1 ms). A database
    /// that vanishes without closing its connections, or a downstream that
    /// never answers, would otherwise hang the attempt for ever while the
    /// partition is held. An attempt past it is abandoned (rolled back) and
    /// the message waited out as a failure of the environment (never
    /// dead-lettered for it); if its commit did go through, the retry finds
    /// the claim and skips the event. Keep it under half the shortest TTL, so
    /// that a commit abandoned in flight cannot land an expired claim.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.runtime.pipeline.set_attempt_timeout(timeout);
        self
    }

    /// What to do at start-up when a handler's TTL is shorter than how long
    /// its topic keeps records (`retention.ms` plus `segment.ms`, or for
    /// ever): warn (the default), refuse to start, or not check. A replay
    /// from the earliest offset would apply again every event older than the
    /// TTL.
    pub fn ttl_check(mut self, check: crate::TtlCheck) -> Self {
        self.runtime.pipeline.ttl_check = check;
        self
    }

    /// What to do with a duplicate whose fingerprint differs from its
    /// claim's (`#[idempotent(fingerprint)]`): dead-letter it with kind
    /// `fingerprint_mismatch` (the default) or skip it with a warning. Either
    /// way it is counted in `dedup_messages_total{outcome="fingerprint_mismatch"}`.
    pub fn on_fingerprint_mismatch(mut self, action: crate::OnFingerprintMismatch) -> Self {
        self.runtime.pipeline.on_fingerprint_mismatch = action;
        self
    }

    /// How long one dead letter's produce may take before it counts as
    /// failed and is tried again (the dead-letter producer's
    /// `message.timeout.ms`; default 30 s, at least 1 ms). A broker that
    /// keeps failing it is waited out as an outage, bounded by the retry
    /// policy's `max_outage`; the message's offset is not committed
    /// meanwhile.
    pub fn dead_letter_timeout(mut self, timeout: Duration) -> Self {
        self.runtime.dead_letter_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long a revoke waits for the revoked partitions' batches in flight
    /// to finish (default 5 s; zero: not at all), so their offsets are
    /// committed before the partitions go and the next owner receives
    /// nothing again. What has not finished by then is abandoned: if it
    /// commits afterwards, the next owner skips it as a duplicate
    /// (`StatsSnapshot::redelivered`). Keep it well under
    /// `max.poll.interval.ms` (librdkafka's default 300 s); `build()` refuses
    /// 15 s or more (half the liveness limit: the consumer loop does not turn
    /// while a revoke waits). The other partitions' workers keep running
    /// meanwhile, but no new message is handed to them; on a current-thread
    /// Tokio runtime the revoke cannot wait (the workers would wait for the
    /// thread it holds) and abandons at once (a warning at start says so).
    pub fn revoke_timeout(mut self, timeout: Duration) -> Self {
        self.runtime.revoke_timeout = timeout;
        self
    }

    /// How long shutdown waits for in-flight messages (default 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.runtime.shutdown_timeout = timeout;
        self
    }

    /// Serves `/metrics`, `/livez`, `/readyz` and `/healthz` on `addr`
    /// (`host:port`) while the consumer runs (feature `http`; see
    /// [`crate::http`]). The address is bound by `build`, which fails if it
    /// cannot be.
    #[cfg(feature = "http")]
    pub fn serve_http(mut self, addr: impl Into<String>) -> Self {
        self.http = Some(addr.into());
        self
    }

    /// Builds the consumer without starting it.
    pub fn build(mut self) -> Result<Consumer<S>, Error> {
        if self.routes.is_empty() {
            return Err(Error::Config(
                "no topic has a handler: add .handle(\"topic\", handler)".into(),
            ));
        }
        self.client.check_env()?;
        // The consumer loop does not turn while a revoke waits: longer than
        // the liveness limit, a probe would restart a consumer that is fine.
        if self.runtime.revoke_timeout >= crate::LIVE_POLL_LIMIT / 2 {
            return Err(Error::Config(format!(
                "revoke_timeout {:?} is too long: the consumer does not poll while a revoke \
                 waits; keep it under {:?}",
                self.runtime.revoke_timeout,
                crate::LIVE_POLL_LIMIT / 2
            )));
        }
        // Nor may it outlast the poll interval: the group would drop the
        // member for not polling while it waits.
        if let Some(max_poll) = self
            .client
            .get("max.poll.interval.ms")
            .and_then(|v| v.parse::<u64>().ok())
            && self.runtime.revoke_timeout >= Duration::from_millis(max_poll)
        {
            return Err(Error::Config(format!(
                "revoke_timeout {:?} is not under max.poll.interval.ms ({max_poll} ms): the \
                 consumer does not poll while a revoke waits",
                self.runtime.revoke_timeout
            )));
        }
        let tokens = self.client.start_tokens()?;
        let consumer_config = self.client.consumer_config()?;
        let group = self.client.group_id.clone().unwrap_or_default();
        let producer_config = self.dead_letter_producer_config()?;
        let ConsumerBuilder {
            store,
            mut routes,
            dead_letter_overrides,
            other_types,
            mut order_by,
            tiers,
            mut runtime,
            concurrency_set,
            #[cfg(feature = "http")]
            http,
            ..
        } = self;
        // Under key-ordered concurrency a partition runs several
        // transactions at once: by default as many as the pool holds.
        if runtime.pipeline.key_concurrency > 0
            && !concurrency_set
            && let Some(connections) = store.connections()
        {
            runtime.max_concurrent_partitions = connections.max(1);
        }
        // Each partition running a transaction holds a connection.
        if let Some(connections) = store.connections()
            && connections < runtime.max_concurrent_partitions
        {
            if concurrency_set {
                tracing::warn!(
                    connections,
                    max_concurrent_partitions = runtime.max_concurrent_partitions,
                    "the store has fewer connections than partitions may run at once: they will \
                     wait for connections (a pool timeout counts as an outage); raise the pool \
                     size or lower max_concurrent_partitions"
                );
            } else {
                runtime.max_concurrent_partitions = connections.max(1);
            }
        }
        for route in &mut routes {
            if let Some(dlq) = dead_letter_overrides.get(&route.topic) {
                route.dead_letter_topic = dlq.clone();
            }
        }
        let mut routes = crate::database::route::topic_routes(routes, &other_types, &group)?;
        for topic in &mut routes {
            if let Some(order) = order_by.remove(&topic.topic) {
                topic.order_by = order;
            }
        }
        let routes = match tiers.built()? {
            None => routes,
            Some(tiers) => crate::database::route::with_tiers(routes, &tiers)?,
        };
        // Every route with tiers: with ReadTiers::Only there are only the
        // tiers' own.
        for route in routes.iter().flat_map(|t| t.handlers()) {
            if let Some(place) = &route.tiers {
                crate::tiers::refuse_short_ttl(
                    route.handler.scope(),
                    route.handler.ttl(),
                    &place.tiers,
                )?;
            }
        }
        if let Some(topic) = order_by.keys().next() {
            return Err(Error::Config(format!(
                "order_by({topic:?}, ..): the consumer has no handler for that topic"
            )));
        }
        for topic in &routes {
            runtime.pipeline.refuse_idle_order(
                &topic.order_by,
                &format!("order_by({:?}, ..)", topic.topic),
                "a partition runs one event at a time, in offset order",
            )?;
        }
        if runtime.pipeline.key_concurrency > runtime.max_concurrent_partitions
            && routes
                .iter()
                .flat_map(|t| t.all())
                .any(|r| r.handler.batches().is_some())
        {
            tracing::info!(
                key_concurrency = runtime.pipeline.key_concurrency,
                transactions = runtime.max_concurrent_partitions,
                "a partition may run more transactions than the consumer allows at once: \
                 they take turns (raise the pool size and max_concurrent_partitions to run \
                 them all)"
            );
        }
        #[cfg_attr(not(feature = "http"), allow(unused_mut))]
        let mut consumer = Consumer::new(store, routes, consumer_config, producer_config, runtime)?;
        consumer.tokens = tokens;
        #[cfg(feature = "http")]
        {
            consumer.http = crate::http::bind(http, &consumer.group, consumer.stats())?;
        }
        Ok(consumer)
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

#[cfg(test)]
mod tests {
    use super::*;
    use dedup_core::MemoryStore;

    #[test]
    fn the_dead_letter_producer_gets_shared_settings_and_its_own() {
        let b = Consumer::builder(MemoryStore::new())
            .group_id("g")
            .set("enable.ssl.certificate.verification", "false")
            .set("fetch.min.bytes", "9")
            .dead_letter_producer_set("linger.ms", "7")
            .dead_letter_producer_set("message.max.bytes", "5000000");
        let config = b.dead_letter_producer_config().unwrap();
        assert_eq!(
            config.get("enable.ssl.certificate.verification"),
            Some("false")
        );
        assert_eq!(config.get("fetch.min.bytes"), None, "the consumer's");
        assert_eq!(config.get("linger.ms"), Some("7"));
        assert_eq!(config.get("message.max.bytes"), Some("5000000"));
        assert_eq!(config.get("batch.num.messages"), Some("1"));
        assert_eq!(config.get("enable.idempotence"), Some("true"));
    }

    /// Every producer refuses the settings it keeps, aliases included: one
    /// left beside dedup's would win or lose by librdkafka's map order.
    #[test]
    fn a_producer_refuses_the_settings_it_keeps_and_their_aliases() {
        let consumer = |k: &str| {
            Consumer::builder(MemoryStore::new())
                .group_id("g")
                .dead_letter_producer_set(k, "1")
                .dead_letter_producer_config()
        };
        for key in [
            "enable.idempotence",
            "request.required.acks",
            "delivery.timeout.ms",
        ] {
            let err = consumer(key).unwrap_err().to_string();
            assert!(
                err.contains(key) && err.contains("dead-letter producer"),
                "{err}"
            );
        }
        let transactional = |k: &str| {
            crate::TransactionalConsumer::builder("t", Echo)
                .group_id("g")
                .producer_set(k, "1")
                .build()
        };
        for key in [
            "request.required.acks",
            "transactional.id",
            "transaction.timeout.ms",
        ] {
            let err = transactional(key).unwrap_err().to_string();
            assert!(
                err.contains(key) && err.contains("transactional producer"),
                "{err}"
            );
        }
        assert!(transactional("linger.ms").is_ok(), "others pass through");
    }

    #[derive(serde::Deserialize)]
    struct Ev {
        id: String,
    }

    #[dedup_core::idempotent(key = "id", ttl = "1h")]
    async fn placed(
        _tx: &mut dedup_core::MemoryTx,
        _ev: Ev,
    ) -> Result<(), dedup_core::HandlerError> {
        Ok(())
    }

    #[dedup_core::idempotent(key = "id", ttl = "2h")]
    async fn shipped(
        _tx: &mut dedup_core::MemoryTx,
        _ev: Ev,
    ) -> Result<(), dedup_core::HandlerError> {
        Ok(())
    }

    /// Several handlers on one topic only by event type, each type once,
    /// all named the same way; other_types only for such a topic.
    #[tokio::test]
    async fn a_topic_takes_several_handlers_only_by_event_type() {
        use crate::{EventType, OtherTypes};
        let builder = || Consumer::builder(MemoryStore::new()).group_id("g");
        let refused = |b: ConsumerBuilder<MemoryStore>| b.build().unwrap_err().to_string();
        let err = refused(builder().handle("orders", placed).handle("orders", shipped));
        assert!(
            err.contains("two handlers") && err.contains("handle_type"),
            "{err}"
        );
        let err = refused(
            builder()
                .handle_type("orders", EventType::header("event-type", "Placed"), placed)
                .handle("orders", shipped),
        );
        assert!(err.contains("one without"), "{err}");
        let err = refused(
            builder()
                .handle_type("orders", EventType::header("event-type", "Placed"), placed)
                .handle_type("orders", EventType::field("type", "Shipped"), shipped),
        );
        assert!(
            err.contains("header \"event-type\"") && err.contains("field \"type\""),
            "{err}"
        );
        let err = refused(
            builder()
                .handle_type("orders", EventType::header("event-type", "Placed"), placed)
                .handle_type("orders", EventType::header("event-type", "Placed"), shipped),
        );
        assert!(
            err.contains("two handlers of event type \"Placed\""),
            "{err}"
        );
        let err = refused(
            builder()
                .handle("orders", placed)
                .other_types("orders", OtherTypes::Skip),
        );
        assert!(err.contains("no handle_type"), "{err}");
        let consumer = builder()
            .handle_type("orders", EventType::header("event-type", "Placed"), placed)
            .handle_type(
                "orders",
                EventType::header("event-type", "Shipped"),
                shipped,
            )
            .handle("payments", placed)
            .build()
            .expect("types of one topic, and another topic");
        let orders = &consumer.routes["orders"];
        assert_eq!(orders.handlers().len(), 2);
        assert_eq!(orders.all().len(), 3, "and the other types' route");
        let others = &orders.all()[2];
        assert_eq!(others.handler.scope(), "dedup.unrouted/g/orders");
        assert_eq!(others.handler.ttl().to_string(), "2h", "the longest");
        assert_eq!(others.dead_letter_topic, "orders.dlq");
    }

    /// A handler whose TTL the way through its retry tiers can outlive
    /// is refused at build, in both runtimes, with the sum in the error:
    /// its claims would lapse while its events wait in a tier.
    #[tokio::test]
    async fn a_ttl_the_tiers_can_outlive_is_refused_at_build() {
        let db = |tiers: crate::RetryTiers| {
            Consumer::builder(MemoryStore::new())
                .group_id("g")
                .handle("orders", placed)
                .retry_tiers_with(tiers)
                .build()
                .map(drop)
        };
        let tiers = |d: &[&str]| crate::RetryTiers::new(d).expect("tiers");
        let err = db(tiers(&["30m", "45m"])).unwrap_err().to_string();
        assert!(
            err.contains("\"orders\"")
                && err.contains("TTL 1h")
                && err.contains("30m + 45m = 1h15m"),
            "{err}"
        );
        assert!(db(tiers(&["30m", "29m"])).is_ok());
        let err = db(tiers(&["30m", "29m"]).hold_keys(true))
            .unwrap_err()
            .to_string();
        assert!(err.contains("30m + 29m + 29m = 1h28m"), "{err}");
        // Echo's TTL is 1m.
        let kafka_only = |d: &[&str]| {
            crate::TransactionalConsumer::builder("t", Echo)
                .group_id("g")
                .retry_tiers(d.to_vec())
                .build()
                .map(drop)
        };
        let err = kafka_only(&["30s", "31s"]).unwrap_err().to_string();
        assert!(
            err.contains("TTL 1m is not longer") && err.contains("30s + 31s = 1m1s"),
            "{err}"
        );
        assert!(kafka_only(&["30s", "29s"]).is_ok());
    }

    /// A Kafka-only handler that outputs nothing.
    struct Echo;

    impl dedup_core::Describe for Echo {
        type Event = ();

        fn scope(&self) -> &str {
            "echo"
        }

        fn ttl(&self) -> dedup_core::Ttl {
            dedup_core::Ttl::from_secs(60).expect("ttl")
        }

        fn key(&self, _: &(), _: &dyn dedup_core::Headers) -> Result<String, dedup_core::KeyError> {
            Ok("k".into())
        }

        fn decode(&self, _: &[u8]) -> Result<(), dedup_core::Error> {
            Ok(())
        }
    }

    impl dedup_core::Handler for Echo {
        type Tx = crate::Outputs;

        async fn handle(
            &self,
            _: &mut crate::Outputs,
            (): (),
        ) -> Result<(), dedup_core::HandlerError> {
            Ok(())
        }
    }

    #[test]
    fn a_zero_commit_interval_is_clamped() {
        // tokio's interval panics on a zero period.
        let b = Consumer::builder(MemoryStore::new()).commit_interval(Duration::ZERO);
        assert_eq!(b.runtime.commit_interval, Duration::from_millis(1));
        let b = Consumer::builder(MemoryStore::new()).attempt_timeout(Duration::ZERO);
        assert_eq!(b.runtime.pipeline.attempt_timeout, Duration::from_millis(1));
    }

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
    fn a_group_and_a_handler_are_required() {
        let err = Consumer::builder(MemoryStore::new()).build().unwrap_err();
        assert!(err.to_string().contains("no topic has a handler"), "{err}");
    }

    /// Bad security settings: one clear error at `build()` naming the
    /// setting, never a hang, never a secret's value.
    #[tokio::test]
    async fn bad_security_settings_are_refused_at_build_naming_the_setting() {
        let dir = std::env::temp_dir().join(format!("dedup-bad-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let garbage = dir.join("not-a-ca.pem");
        std::fs::write(&garbage, "not a certificate\n").expect("written");
        let key = dir.join("client.key");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .expect("written");
        let refused = |pairs: &[(&str, &str)]| {
            let mut b = Consumer::builder(MemoryStore::new())
                .group_id("g")
                .set("sasl.password", "hunter2-secret");
            for (k, v) in pairs {
                b = b.set(*k, *v);
            }
            let said = match b.handle("orders", placed).build() {
                Ok(_) => panic!("{pairs:?} built"),
                Err(e) => e.to_string(),
            };
            assert!(!said.contains("hunter2-secret"), "{said}");
            said
        };
        let said = refused(&[("security.protocol", "SASL_SSLX")]);
        assert!(
            said.contains("security.protocol") && said.contains("SASL_SSLX"),
            "{said}"
        );
        let ca = garbage.to_str().expect("a path");
        let said = refused(&[("security.protocol", "SSL"), ("ssl.ca.location", ca)]);
        assert!(
            said.contains("ssl.ca.location") && said.contains("no certificate"),
            "{said}"
        );
        let key = key.to_str().expect("a path");
        let said = refused(&[("security.protocol", "SSL"), ("ssl.key.location", key)]);
        assert!(said.contains("ssl.key.location"), "{said}");
        // A well-formed key (this one's own) without its certificate.
        let own = dir.join("own.key");
        let made = std::process::Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
            ])
            .arg(&own)
            .output()
            .expect("openssl (scripts/tls.sh needs it too)");
        assert!(made.status.success(), "openssl genpkey");
        let own = own.to_str().expect("a path");
        let said = refused(&[("security.protocol", "SSL"), ("ssl.key.location", own)]);
        assert!(said.contains("set ssl.certificate.location"), "{said}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
