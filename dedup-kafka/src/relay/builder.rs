//! The relay's builder: its settings, checked when it is built.

use crate::oauth::TokenContext;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dedup_core::outbox::OutboxSource;
use rdkafka::producer::FutureProducer;

use super::{BACKLOG_INTERVAL, Relay};
use crate::Error;
use crate::config::{DEFAULT_BROKERS, idempotent_producer_config, redacted};
use crate::retry::RetryPolicy;
use crate::stats::{RelayStats, RelayStatsSnapshot};

/// What a batch's lease adds to the delivery timeout by default: time to
/// take it, queue the sends and mark it.
const LEASE_MARGIN: Duration = Duration::from_secs(15);

/// The least a lease must outlast the delivery timeout by: its sends are
/// queued within the first half of that margin.
const MIN_LEASE_MARGIN: Duration = Duration::from_secs(1);

/// The longest lease accepted: a week.
const MAX_LEASE: Duration = Duration::from_secs(7 * 24 * 3600);

/// Builds a [`Relay`] over an outbox.
///
/// ```no_run
/// # async fn run(outbox: impl dedup_core::OutboxSource) -> Result<(), dedup_kafka::Error> {
/// use dedup_kafka::Relay;
///
/// let stats = Relay::builder(outbox) // e.g. PgStore::outbox()
///     .brokers("localhost:9092")
///     .run() // until SIGINT or SIGTERM
///     .await?;
/// println!("published {}", stats.published);
/// # Ok(()) }
/// ```
pub struct RelayBuilder<S> {
    source: S,
    brokers: String,
    settings: Vec<(String, String)>,
    /// The settings taken from the environment: (setting, variable).
    from_env: Vec<(String, String)>,
    batch_size: usize,
    poll_interval: Duration,
    delivery_timeout: Duration,
    retry: RetryPolicy,
    purge_interval: Duration,
    lease_timeout: Option<Duration>,
    store_timeout: Duration,
    oauth: crate::oauth::ProviderSetting,
    #[cfg(feature = "http")]
    http: Option<String>,
}

impl<S> fmt::Debug for RelayBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let settings = redacted(&self.settings);
        f.debug_struct("RelayBuilder")
            .field("brokers", &self.brokers)
            .field("settings", &settings)
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("lease_timeout", &self.lease_timeout)
            .field("store_timeout", &self.store_timeout)
            .finish_non_exhaustive()
    }
}

impl<S: OutboxSource> RelayBuilder<S> {
    /// The defaults ([`Relay::builder`]).
    pub(super) fn new(source: S) -> Self {
        RelayBuilder {
            source,
            brokers: DEFAULT_BROKERS.to_owned(),
            settings: Vec::new(),
            from_env: Vec::new(),
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            delivery_timeout: Duration::from_secs(30),
            retry: RetryPolicy::default(),
            purge_interval: Duration::from_secs(60),
            lease_timeout: None,
            store_timeout: Duration::from_secs(30),
            oauth: crate::oauth::ProviderSetting::default(),
            #[cfg(feature = "http")]
            http: None,
        }
    }

    /// The bootstrap brokers (`bootstrap.servers`), default `localhost:9092`.
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.brokers = brokers.into();
        self
    }

    /// Passes a librdkafka producer setting through (security, client id,
    /// compression...). `enable.idempotence`, `acks` and
    /// `message.timeout.ms` (and their aliases `request.required.acks`,
    /// `delivery.timeout.ms`) are the relay's own: `build()` refuses them.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((key.into(), value.into()));
        self
    }

    /// Passes every environment variable `<prefix><NAME>` to the relay's
    /// producer as a librdkafka setting, named as
    /// [`ConsumerBuilder::set_from_env`](crate::ConsumerBuilder::set_from_env)
    /// names them (`KAFKA_CFG_SASL_PASSWORD` sets `sasl.password`), after
    /// the settings given so far. `build()` checks each one and names the
    /// variable of one librdkafka refuses, never its value.
    pub fn set_from_env(mut self, prefix: &str) -> Self {
        for (key, variable, value) in crate::config::settings_from_env(prefix) {
            self.from_env.push((key.clone(), variable));
            self.settings.push((key, value));
        }
        self
    }

    /// Where the relay's producer gets its SASL OAUTHBEARER token, as
    /// [`ConsumerBuilder::oauth_token_provider`](crate::ConsumerBuilder::oauth_token_provider).
    pub fn oauth_token_provider(mut self, provider: impl crate::TokenProvider) -> Self {
        self.oauth.set(provider);
        self
    }

    /// Most events published per batch (one lease, one marking
    /// transaction), default 500.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Longest wait for a notification before looking anyway, default 1 s.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// How long the producer tries to deliver a message before the batch
    /// counts it failed and leaves it pending (`message.timeout.ms`),
    /// default 30 s.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// The back-off between batches that failed (broker or database
    /// down). Attempts are never exhausted: the relay keeps trying.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How often published rows past their retention are purged, default 60 s.
    pub fn purge_interval(mut self, interval: Duration) -> Self {
        self.purge_interval = interval;
        self
    }

    /// How long a batch stays leased to this relay. A relay that dies
    /// leaves its batch to another relay (or to its own restart) after this
    /// long, and that relay publishes it again. Default: the delivery
    /// timeout plus 15 s; it must be at least 1 s longer than the delivery
    /// timeout, or a batch still being delivered would be taken over and
    /// sent twice. A batch's sends are queued within the first half of the
    /// difference; what is not sent by then waits for the next round.
    pub fn lease_timeout(mut self, timeout: Duration) -> Self {
        self.lease_timeout = Some(timeout);
        self
    }

    /// Longest one outbox statement may take (leasing a batch, marking it,
    /// purging sent rows), default 30 s, at least 1 ms. A database that
    /// stops answering without closing its connections (a frozen backend, a
    /// network that drops packets) would otherwise hold the relay, and its
    /// shutdown, for ever. A lease past it is given up and tried again
    /// (rows it took stay leased until the lease expires, then go out); a
    /// marking past it is retried while the batch's lease lasts.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Serves `/metrics`, `/livez`, `/readyz` and `/healthz` on `addr`
    /// (`host:port`) while the relay runs (feature `http`; see
    /// [`crate::http`]). The address is bound by `build`, which fails if it
    /// cannot be.
    #[cfg(feature = "http")]
    pub fn serve_http(mut self, addr: impl Into<String>) -> Self {
        self.http = Some(addr.into());
        self
    }

    /// Builds the relay (creates its producer) without starting it.
    pub fn build(mut self) -> Result<Relay<S>, Error> {
        crate::config::check_env_settings(&self.from_env, &self.settings)?;
        crate::config::check_features(&self.settings)?;
        crate::config::refuse_own_settings(
            &self.settings,
            &crate::config::PRODUCER_OWN_SETTINGS,
            "the relay",
            "idempotence and acks=all are always on; delivery_timeout() sets the timeouts, \
             which its leases are sized by",
        )?;
        let lease = self
            .lease_timeout
            .unwrap_or(self.delivery_timeout.saturating_add(LEASE_MARGIN));
        if lease < self.delivery_timeout.saturating_add(MIN_LEASE_MARGIN) || lease > MAX_LEASE {
            return Err(Error::Config(format!(
                "the relay's lease_timeout ({lease:?}) must be at least {MIN_LEASE_MARGIN:?} \
                 longer than its delivery timeout ({:?}), or a batch still being delivered \
                 would be taken over by another relay and published twice; and at most \
                 {MAX_LEASE:?}",
                self.delivery_timeout
            )));
        }
        let tokens = self.oauth.start(&mut self.settings)?;
        let config =
            idempotent_producer_config(&self.brokers, &self.settings, self.delivery_timeout);
        let producer: FutureProducer<TokenContext> = config.create_with_context(TokenContext)?;
        Ok(Relay {
            source: self.source,
            producer,
            access: config,
            tokens,
            batch_size: self.batch_size,
            poll_interval: self.poll_interval,
            retry: self.retry,
            purge_interval: self.purge_interval,
            store_timeout: self.store_timeout,
            lease,
            // Each send may take the delivery timeout: one queued later
            // than this into a batch could still be in flight when the
            // lease expires, and another relay would publish it too.
            send_window: (lease - self.delivery_timeout) / 2,
            stats: Arc::new(RelayStats {
                // The longest a healthy loop can go between turns: a backlog
                // count, a purge, a lease and a marking (each bounded by
                // the store timeout), two batches' sends (the one left in
                // flight and the next; each bounded by its lease) and the
                // wait after them.
                live_limit: crate::LIVE_POLL_LIMIT
                    + BACKLOG_INTERVAL
                    + self.store_timeout * 3
                    + lease * 2
                    + self.poll_interval.max(self.retry.max_backoff),
                ..RelayStats::default()
            }),
            #[cfg(feature = "http")]
            http: self
                .http
                .map(|addr| crate::http::HttpEndpoints::bind(&addr))
                .transpose()?,
        })
    }

    /// Builds and runs until SIGINT or SIGTERM; see [`Relay::run`].
    pub async fn run(self) -> Result<RelayStatsSnapshot, Error> {
        self.build()?.run().await
    }

    /// Builds and runs until `shutdown` completes.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<RelayStatsSnapshot, Error> {
        self.build()?.run_until(shutdown).await
    }
}
