//! Building a [`TransactionalConsumer`]: its settings and clients.
use crate::oauth::TokenContext;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::Handler;
use rdkafka::ClientConfig;
use rdkafka::producer::FutureProducer;

use super::outputs::Outputs;

use super::TransactionalConsumer;
use crate::Error;
use crate::config::{self, ClientSettings, OnFingerprintMismatch};
use crate::config::{PipelineSettings, TierSetting};
use crate::dead_letter_format;
use crate::retry::{Jitter, RetryPolicy};
use crate::stats::{Stats, StatsSnapshot};

/// Builds a [`TransactionalConsumer`]; see
/// [`TransactionalConsumer::builder`].
pub struct TransactionalConsumerBuilder<H> {
    topic: String,
    handler: H,
    client: ClientSettings,
    producer_settings: Vec<(String, String)>,
    dead_letter_topic: Option<String>,
    changelog_topic: Option<String>,
    changelog_replication: i32,
    transactional_id: Option<String>,
    transaction_timeout: Duration,
    /// What both runtimes set alike.
    pipeline: PipelineSettings,
    order_by: crate::OrderBy,
    tiers: TierSetting,
    /// Where to serve metrics and health, if anywhere.
    #[cfg(feature = "http")]
    http: Option<String>,
}

impl<H> fmt::Debug for TransactionalConsumerBuilder<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionalConsumerBuilder")
            .field("topic", &self.topic)
            .field("client", &self.client)
            .field(
                "producer_settings",
                &config::redacted(&self.producer_settings),
            )
            .field("transactional_id", &self.transactional_id)
            .finish_non_exhaustive()
    }
}

impl<H: Handler<Tx = Outputs>> TransactionalConsumerBuilder<H> {
    /// The defaults; see [`TransactionalConsumer::builder`].
    pub(super) fn new(topic: String, handler: H) -> Self {
        TransactionalConsumerBuilder {
            topic,
            handler,
            client: ClientSettings::default(),
            producer_settings: Vec::new(),
            dead_letter_topic: None,
            changelog_topic: None,
            changelog_replication: -1,
            transactional_id: None,
            transaction_timeout: Duration::from_secs(10),
            pipeline: PipelineSettings::with_batches(5000, Duration::from_millis(20)),
            order_by: crate::OrderBy::default(),
            tiers: TierSetting::default(),
            #[cfg(feature = "http")]
            http: None,
        }
    }

    /// The bootstrap brokers (default `localhost:9092`).
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.client.brokers = brokers.into();
        self
    }

    /// The consumer group (required). The changelog is `<group>-dedup-claims`.
    pub fn group_id(mut self, group_id: impl Into<String>) -> Self {
        self.client.group_id = Some(group_id.into());
        self
    }

    /// A librdkafka setting for the consumer; connection and security
    /// settings (`security.*`, `sasl.*`, `ssl.*`, ...) go to the producer
    /// and the changelog readers too.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client.set(key.into(), value.into());
        self
    }

    /// Every environment variable `<prefix><NAME>` as a setting, as
    /// [`ConsumerBuilder::set_from_env`](crate::ConsumerBuilder::set_from_env)
    /// reads them (`KAFKA_CFG_SESSION_TIMEOUT_MS=6000`).
    pub fn set_from_env(mut self, prefix: &str) -> Self {
        self.client.set_from_env(prefix);
        self
    }

    /// Where every client of the runtime (the consumer, the transactional
    /// producer, the changelog's readers, the start-up checks' clients) gets
    /// its SASL OAUTHBEARER token, as
    /// [`ConsumerBuilder::oauth_token_provider`](crate::ConsumerBuilder::oauth_token_provider)
    /// says. rdkafka's admin client cannot take tokens from code, so with a
    /// provider the changelog topic must exist (the start names the
    /// command that creates it) and its compaction and the TTLs are not
    /// checked (said with a warning).
    pub fn oauth_token_provider(mut self, provider: impl crate::TokenProvider) -> Self {
        self.client.oauth.set(provider);
        self
    }

    /// A librdkafka setting for the transactional producer alone.
    /// `transactional.id`, `transaction.timeout.ms`, `enable.idempotence`
    /// and `acks` (and its alias `request.required.acks`) are the runtime's:
    /// `build()` refuses them. `linger.ms` is 0 unless set here (a
    /// transaction queues its records at once and then waits for them), and
    /// `retry.backoff.ms` 20 (a transaction begun while the broker still
    /// writes the previous one's markers sends its offsets again after it).
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

    /// Most messages per transaction (default 5,000). Each transaction
    /// costs a few round trips to the brokers (its offsets, its commit):
    /// larger ones spread them over more messages (on a backlog, 5,000
    /// moved 1.21x the events of 2,000 a second, `dedup-bench`), while an
    /// aborted transaction sends all of its batch's records again (a
    /// rewind, after repeated aborts or a rebalance, also judges it again),
    /// and its outputs are seen by `read_committed` readers only once it
    /// commits. [`batch_bytes`](Self::batch_bytes) caps it for large
    /// records.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.pipeline.set_batch_size(n);
        self
    }

    /// Most bytes of input keys and payloads per transaction (default 16
    /// MiB): a batch is full at [`batch_size`](Self::batch_size) messages
    /// or at this many bytes, whichever comes first, so a batch of large
    /// records stays well inside [`transaction_timeout`](Self::transaction_timeout)
    /// (a record larger than this is a batch alone). Outputs much larger
    /// than their inputs call for a lower figure.
    pub fn batch_bytes(mut self, bytes: usize) -> Self {
        self.pipeline.batching.bytes = bytes;
        self
    }

    /// Key-ordered concurrency: up to `n` handler calls of a batch run at
    /// once (default 0: one after another, in offset order), as
    /// [`ConsumerBuilder::key_concurrency`](crate::ConsumerBuilder::key_concurrency)
    /// does for the database runtime (0 or 1: one after another here). Events of
    /// one ordering key, and events of one event id, each in their
    /// partition, still run one at a time in offset order; the batch's outputs, claims and offsets still go in one
    /// transaction, its outputs in offset order. For handlers that wait on
    /// something slow (a lookup to enrich with).
    pub fn key_concurrency(mut self, n: usize) -> Self {
        self.pipeline.key_concurrency = n;
        self
    }

    /// What orders events under [`key_concurrency`](Self::key_concurrency)
    /// (default: the record key).
    pub fn order_by(mut self, order: crate::OrderBy) -> Self {
        self.order_by = order;
        self
    }

    /// How long a batch that starts from idle waits for more messages once
    /// it has one (default 20 ms): each transaction costs a few round trips
    /// to the brokers. After a full batch, or one during which more came
    /// in, the next takes what is queued and goes at once.
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.pipeline.batching.linger = linger;
        self
    }

    /// How failures are retried: transient ones `max_attempts` times before
    /// dead-lettering, outages until `max_outage` (the failure table).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.pipeline.retry = policy;
        self
    }

    /// How long one handler attempt may take (default 60 s, at least 1 ms): past it the
    /// attempt is abandoned and waited out as the environment's fault, as
    /// in the database runtime (bounded only by `max_outage`).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.pipeline.set_attempt_timeout(timeout);
        self
    }

    /// What to do at start-up when the handler's TTL is shorter than how
    /// long its topic keeps records, as in the database runtime
    /// ([`ConsumerBuilder::ttl_check`](crate::ConsumerBuilder::ttl_check)):
    /// a replay from the earliest offset would apply again every record
    /// older than the TTL, whose claim has expired from the changelog.
    pub fn ttl_check(mut self, check: crate::TtlCheck) -> Self {
        self.pipeline.ttl_check = check;
        self
    }

    /// Non-blocking retries, as
    /// [`ConsumerBuilder::retry_tiers`](crate::ConsumerBuilder::retry_tiers)
    /// has them: after a few short attempts in place, an event whose
    /// handler keeps failing transiently moves to the first of these retry
    /// tiers (`<topic>.retry-30s` for `"30s"`), then the next, then the
    /// dead-letter topic, while its partition moves on. The move is a
    /// record of the batch's transaction, committed with its offset: it
    /// happens once or not at all.
    ///
    /// This consumer reads the tiers itself: partition `p` of each tier is
    /// assigned with partition `p` of the input (the range assignor, which
    /// `build()` sets) and shares its claims, so a duplicate met in the
    /// input after its event was applied from a tier is skipped. Create
    /// the tier topics with exactly as many partitions as the input. A
    /// tier's partition is paused until its next record is due. Key
    /// hold-back ([`RetryTiers::hold_keys`](crate::RetryTiers::hold_keys))
    /// and reading the tiers elsewhere are the database runtime's only:
    /// `build()` refuses them here.
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

    /// What a duplicate whose fingerprint differs from its claim's gets.
    pub fn on_fingerprint_mismatch(mut self, action: OnFingerprintMismatch) -> Self {
        self.pipeline.on_fingerprint_mismatch = action;
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

    /// Checks the settings and creates the clients.
    pub fn build(mut self) -> Result<TransactionalConsumer<H>, Error> {
        let group = self.client.group_id.clone().ok_or_else(|| {
            Error::Config("a group id is required: .group_id(\"enrich-v1\")".into())
        })?;
        let transactional_id = self.transactional_id.clone().unwrap_or_else(|| {
            format!(
                "{group}-dedup-{:016x}",
                Jitter::new(std::process::id().into()).next().to_bits()
            )
        });
        self.client.check_env()?;
        self.pipeline.refuse_idle_order(
            &self.order_by,
            "order_by(..)",
            "a batch's events run one after another, in offset order",
        )?;
        config::refuse_own_settings(
            &self.producer_settings,
            &config::TRANSACTIONAL_OWN_SETTINGS,
            "the transactional producer",
            "transactional_id() and transaction_timeout() set them; idempotence and acks=all \
             are always on",
        )?;
        let tiers = self.tiers.built()?;
        if let Some(tiers) = &tiers {
            if tiers.holds_keys() {
                return Err(Error::Config(
                    "key hold-back (RetryTiers::hold_keys) is the database runtime's only: the \
                     Kafka-only runtime's tiers let later events of a key go ahead"
                        .into(),
                ));
            }
            if tiers.reader() != crate::ReadTiers::Here {
                return Err(Error::Config(
                    "the Kafka-only runtime reads its retry tiers itself (a tier's partition \
                     shares its input partition's claims): drop RetryTiers::read(..)"
                        .into(),
                ));
            }
            if self
                .client
                .get("group.protocol")
                .is_some_and(|p| p.trim().eq_ignore_ascii_case("consumer"))
            {
                return Err(Error::Config(
                    "retry tiers need the classic group protocol here (a tier's partition is \
                     assigned with its input partition by the range assignor): drop \
                     group.protocol=consumer"
                        .into(),
                ));
            }
            if let Some(other) = self
                .client
                .get("partition.assignment.strategy")
                .filter(|s| !s.trim().eq_ignore_ascii_case("range"))
            {
                return Err(Error::Config(format!(
                    "retry tiers need partition.assignment.strategy=range here (a tier's \
                     partition is assigned with its input partition), not {other:?}"
                )));
            }
        }
        let tiers = tiers.map(|t| {
            t.of(
                &self.topic,
                self.order_by.clone(),
                crate::tiers::KAFKA_ONLY_ATTEMPTS_IN_PLACE,
            )
        });
        if let Some(tiers) = &tiers {
            crate::tiers::refuse_short_ttl(self.handler.scope(), self.handler.ttl(), tiers)?;
        }
        let mut topics = vec![self.topic.clone()];
        topics.extend(
            tiers
                .iter()
                .flat_map(|t| t.tiers.iter().map(|t| t.topic.clone())),
        );
        if let Some(repeated) = topics
            .iter()
            .enumerate()
            .find_map(|(i, t)| topics[..i].contains(t).then_some(t))
        {
            return Err(Error::Config(format!(
                "the topic {repeated:?} is both the input and a retry tier, or two tiers"
            )));
        }
        // Before the configurations: they name the provider's keeper.
        let tokens = self.client.start_tokens()?;
        let mut consumer = self.client.consumer_config()?;
        if tiers.is_some() {
            consumer.set("partition.assignment.strategy", "range");
        }
        // Only what upstream committed, and offsets only through the
        // transactions.
        consumer.set("isolation.level", "read_committed");
        let shared = self.client.shared_config();
        let mut producer = shared.clone();
        // A record that just fitted its input topic still fits the
        // dead-letter topic with dedup's headers (a user's setting wins).
        producer.set(
            "message.max.bytes",
            dead_letter_format::MAX_DEAD_LETTER_BYTES,
        );
        no_linger_unless_set(&mut producer, &self.producer_settings);
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
        let producer: FutureProducer<TokenContext> = producer.create_with_context(TokenContext)?;
        let stats = Arc::new(Stats::new());
        Ok(TransactionalConsumer {
            topics: super::lanes::Topics::new(topics),
            tiers,
            #[cfg(feature = "http")]
            http: crate::http::bind(self.http, &group, stats.clone())?,
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
            record_keys: super::changelog::Keys::new(),
            transaction_timeout: self.transaction_timeout,
            pipeline: self.pipeline,
            order_by: self.order_by,
            stats,
            metrics: std::sync::OnceLock::new(),
            unwritable_since: Mutex::new(None),
            rewinds: std::sync::atomic::AtomicU32::new(0),
            _tokens: tokens,
        })
    }

    /// Builds and runs until `stop` resolves; see
    /// [`TransactionalConsumer::run_until`].
    pub async fn run_until(self, stop: impl Future<Output = ()>) -> Result<StatsSnapshot, Error> {
        self.build()?.run_until(stop).await
    }
}

/// A transaction's records are queued all at once and then waited for: a
/// linger (librdkafka's default is 5 ms) would only hold the last of them
/// back, every transaction. So `linger.ms` is 0 unless the user set it,
/// under either of librdkafka's names for it (with both set, the one
/// applied last would win at random).
fn no_linger_unless_set(producer: &mut ClientConfig, settings: &[(String, String)]) {
    default_unless_set(
        producer,
        settings,
        &["linger.ms", "queue.buffering.max.ms"],
        "0",
    );
    default_unless_set(producer, settings, &["retry.backoff.ms"], RETRY_BACKOFF_MS);
}

/// librdkafka's first retry after a retriable error, 100 ms by default, is
/// what a transaction waits when it begins while the broker still writes
/// the previous one's markers: its offsets are refused
/// (`CONCURRENT_TRANSACTIONS`) and sent again after the backoff. That took
/// 80-120 ms in one transaction of twenty of the benchmark's, a fifth of
/// its time. 20 ms is what librdkafka (and the Java client) wait before
/// adding partitions again in the same case; later retries still back off
/// to `retry.backoff.max.ms`.
const RETRY_BACKOFF_MS: &str = "20";

/// `value` under the first of `names` unless the user set one of them.
fn default_unless_set(
    producer: &mut ClientConfig,
    settings: &[(String, String)],
    names: &[&str],
    value: &str,
) {
    let set = settings.iter().any(|(k, _)| names.contains(&k.as_str()))
        || names.iter().any(|k| producer.get(k).is_some());
    if !set {
        producer.set(names[0], value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::settings;

    #[test]
    fn the_producer_does_not_linger_unless_the_user_says_so() {
        let mut producer = ClientConfig::new();
        no_linger_unless_set(&mut producer, &[]);
        assert_eq!(producer.get("linger.ms"), Some("0"));

        // The user's value is applied after this, under either name; this
        // adds nothing that could race it.
        for name in ["linger.ms", "queue.buffering.max.ms"] {
            let mut producer = ClientConfig::new();
            no_linger_unless_set(&mut producer, &settings(&[(name, "7")]));
            assert_eq!(producer.get("linger.ms"), None, "{name}");
        }
        let mut producer = ClientConfig::new();
        producer.set("queue.buffering.max.ms", "3");
        no_linger_unless_set(&mut producer, &[]);
        assert_eq!(producer.get("linger.ms"), None);
    }
}
