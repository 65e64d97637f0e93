//! The runtime's settings and the librdkafka client configurations: the
//! consumer's, and the idempotent producer's (dead letters and the relay);
//! what both runtimes set alike is in [`pipeline`].

mod pipeline;

pub(crate) use pipeline::{PipelineSettings, TierSetting};

use std::fmt;
use std::time::Duration;

use rdkafka::ClientConfig;

use crate::Error;

/// The bootstrap brokers unless `.brokers(...)` says otherwise.
pub(crate) const DEFAULT_BROKERS: &str = "localhost:9092";

/// The runtime's tunables, as the builder sets them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// What both runtimes set alike.
    pub(crate) pipeline: PipelineSettings,
    pub(crate) max_concurrent_partitions: usize,
    pub(crate) max_buffered_per_partition: usize,
    pub(crate) commit_interval: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) revoke_timeout: Duration,
    pub(crate) dead_letter_timeout: Duration,
}

/// What the consumer does with a duplicate whose fingerprint differs from
/// its claim's (`#[idempotent(fingerprint)]`): an event id reused for other
/// content, a producer bug. Either way it is counted in
/// `dedup_messages_total{outcome="fingerprint_mismatch"}` and never applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnFingerprintMismatch {
    /// Dead-letter it with kind `fingerprint_mismatch` (the default): the
    /// event is kept for an operator to look at.
    #[default]
    DeadLetter,
    /// Skip it like a duplicate, with a warning naming the key.
    Skip,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            pipeline: PipelineSettings::with_batches(200, Duration::from_millis(5)),
            max_concurrent_partitions: 16,
            max_buffered_per_partition: 5_000,
            commit_interval: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(30),
            revoke_timeout: Duration::from_secs(5),
            dead_letter_timeout: Duration::from_secs(30),
        }
    }
}

/// How a runtime's consumer reaches its brokers and group, and the
/// librdkafka settings given to its builder (`set`, `set_from_env`): one
/// set, read the same way by both runtimes' builders. `Debug` masks
/// secrets.
pub(crate) struct ClientSettings {
    pub(crate) brokers: String,
    pub(crate) group_id: Option<String>,
    /// In the order given; the last value of a setting wins.
    settings: Vec<(String, String)>,
    /// Settings taken from the environment: (setting, variable).
    from_env: Vec<(String, String)>,
    /// Where OAUTHBEARER tokens come from, if from code.
    pub(crate) oauth: crate::oauth::ProviderSetting,
}

impl Default for ClientSettings {
    fn default() -> Self {
        ClientSettings {
            brokers: DEFAULT_BROKERS.to_owned(),
            group_id: None,
            settings: Vec::new(),
            from_env: Vec::new(),
            oauth: crate::oauth::ProviderSetting::default(),
        }
    }
}

impl fmt::Debug for ClientSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientSettings")
            .field("brokers", &self.brokers)
            .field("group_id", &self.group_id)
            .field("settings", &redacted(&self.settings))
            .field("oauth_token_provider", &self.oauth)
            .finish()
    }
}

impl ClientSettings {
    pub(crate) fn set(&mut self, key: String, value: String) {
        self.settings.push((key, value));
    }

    /// Every environment variable `<prefix><NAME>` as a setting, in name
    /// order (see `ConsumerBuilder::set_from_env`).
    pub(crate) fn set_from_env(&mut self, prefix: &str) {
        for (key, name, value) in settings_from_env(prefix) {
            self.from_env.push((key.clone(), name));
            self.settings.push((key, value));
        }
    }

    /// Starts the token provider's keeper, if one is set: every client made
    /// from these settings after this asks it for its tokens. The runtime
    /// keeps the handle for as long as its clients live.
    pub(crate) fn start_tokens(&mut self) -> Result<Option<crate::oauth::Tokens>, Error> {
        self.oauth.start(&mut self.settings)
    }

    /// The value `key` ends with, if it was set.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.settings
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The settings that apply to every client of the runtime (how to
    /// reach and trust the brokers), in order.
    pub(crate) fn shared(&self) -> impl Iterator<Item = &(String, String)> {
        self.settings.iter().filter(|(k, _)| is_shared_setting(k))
    }

    /// A configuration with the brokers and the shared settings: what the
    /// runtime's other clients start from.
    pub(crate) fn shared_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (k, v) in self.shared() {
            config.set(k, v);
        }
        config
    }

    /// Checks each setting taken from the environment with librdkafka, so
    /// that a refusal names its variable (never its value). The builders
    /// call it first.
    pub(crate) fn check_env(&self) -> Result<(), Error> {
        check_env_settings(&self.from_env, &self.settings)
    }

    /// The consumer's configuration (see [`consumer_config`]).
    pub(crate) fn consumer_config(&self) -> Result<ClientConfig, Error> {
        consumer_config(&self.brokers, self.group_id.as_deref(), &self.settings)
    }
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
        "passphrase",
        "private.key",
        // May hold a client secret or a token (`key=value ...`).
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.client.secret",
    ]
    .iter()
    .any(|s| key.contains(s))
}

/// Settings as `Debug` may show them: secrets' values masked.
pub(crate) fn redacted(settings: &[(String, String)]) -> Vec<(&str, &str)> {
    settings
        .iter()
        .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v.as_str() }))
        .collect()
}

/// Client settings that apply to the dead-letter producer as well (how to
/// reach and trust the brokers: security, networking, protocol, logging), as
/// opposed to consumer-only ones.
pub(crate) fn is_shared_setting(key: &str) -> bool {
    [
        "security.",
        "sasl.",
        "ssl.",
        "enable.ssl.",
        "enable.sasl.",
        "https.",
        "client.",
        "socket.",
        "broker.",
        "reconnect.",
        "retry.backoff",
        "metadata.",
        "topic.metadata.",
        "api.version.",
        "connections.max.idle.ms",
        "debug",
        "log_level",
        "log.",
    ]
    .iter()
    .any(|p| key.starts_with(p))
}

/// How often librdkafka reports statistics, unless the user says otherwise.
pub(crate) const STATISTICS_INTERVAL_MS: &str = "5000";

/// The consumer's pre-fetch, unless the user says otherwise. librdkafka's
/// own defaults keep up to 64 MiB or 100,000 messages fetched ahead in the
/// consumer's queue (one for all assigned partitions), on top of the
/// runtime's per-partition buffers, and once over that wait a whole second
/// (`fetch.queue.backoff.ms`) before looking again: a small queue then
/// starves the handlers. A 2 MiB queue looked at again every 10 ms kept the
/// benchmark's throughput (62,103 events/s vs 61,968) at 54 MiB peak RSS
/// instead of 118 MiB (the book's Performance chapter). The queue may be overshot by one
/// fetch per broker (`fetch.max.bytes`, which librdkafka caps at this queue
/// size unless set, or a single record batch larger than that).
///
/// A broker answers a connection's requests in order, and librdkafka has
/// one fetch in flight per broker: a partition resumed while a fetch waits
/// at another's end for new records (`fetch.wait.max.ms`, 500 ms by
/// default) fetches only when that one returns. At 100 ms a pause-resume
/// cycle near a partition's end costs at most that, and a caught-up
/// consumer sends 10 empty fetches a second per broker instead of 2.
///
/// Public so that a consumer of your own beside dedup's (a plain loop to
/// compare with, as dedup-bench's `kafka-plain`) can fetch the same way.
pub const PREFETCH_DEFAULTS: [(&str, &str); 4] = [
    ("queued.max.messages.kbytes", "2048"),
    ("queued.min.messages", "5000"),
    ("fetch.queue.backoff.ms", "10"),
    ("fetch.wait.max.ms", "100"),
];

/// The consumer's configuration: `client_settings` passed through, except
/// the group and the settings that make offsets safe.
fn consumer_config(
    brokers: &str,
    group_id: Option<&str>,
    client_settings: &[(String, String)],
) -> Result<ClientConfig, Error> {
    let group = group_id.ok_or_else(|| {
        Error::Config("a group id is required: .group_id(\"my-service-v1\")".into())
    })?;
    check_features(client_settings)?;
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("auto.offset.reset", "earliest")
        // Consumer lag (dedup_consumer_lag) comes from librdkafka's
        // statistics; `.set("statistics.interval.ms", ..)` changes how
        // often, "0" turns them off.
        .set("statistics.interval.ms", STATISTICS_INTERVAL_MS);
    for (k, v) in PREFETCH_DEFAULTS {
        config.set(k, v);
    }
    for (k, v) in client_settings {
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

/// The features the linked librdkafka was built with (`gzip,snappy,...`),
/// read once.
pub(crate) fn builtin_features() -> &'static str {
    static FEATURES: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FEATURES.get_or_init(|| {
        ClientConfig::new()
            .create_native_config()
            .and_then(|native| native.get("builtin.features"))
            .unwrap_or_default()
    })
}

/// Refuses settings that need a librdkafka feature this build lacks, with
/// the remedy: TLS and the SASL mechanisms built on OpenSSL are the `ssl`
/// cargo feature (on by default; `default-features = false` builds without OpenSSL).
/// (librdkafka alone would only say the value is unsupported.)
pub(crate) fn check_features(settings: &[(String, String)]) -> Result<(), Error> {
    const REMEDY: &str = "this build of librdkafka has no OpenSSL: enable dedup-kafka's `ssl` \
        feature (links the system OpenSSL; needs libssl-dev) or `ssl-vendored` (builds it; needs perl)";
    let has = |feature: &str| builtin_features().split(',').any(|f| f == feature);
    for (key, value) in settings {
        let value = value.to_ascii_lowercase();
        let needs = match key.as_str() {
            "security.protocol" if matches!(value.as_str(), "ssl" | "sasl_ssl") => "ssl",
            "sasl.mechanism" | "sasl.mechanisms" if value.starts_with("scram-") => "sasl_scram",
            "sasl.mechanism" | "sasl.mechanisms" if value == "oauthbearer" => "sasl_oauthbearer",
            _ => continue,
        };
        if !has(needs) {
            return Err(Error::Config(format!(
                "{key}={value} needs {needs}, and {REMEDY}"
            )));
        }
    }
    Ok(())
}

/// The environment variables `<prefix><NAME>`, in name order, as
/// `(setting, variable, value)`: the librdkafka setting named as the
/// builders' `set_from_env` names it (`KAFKA_CFG_GROUP_PROTOCOL` ->
/// `group.protocol`, `KAFKA_CFG_LOG__LEVEL` -> `log_level`), for a client
/// of your own (the `dedup` CLI reads `KAFKA_CFG_*` so). The value may be a
/// secret: show the variable, never the value.
pub fn settings_from_env(prefix: &str) -> Vec<(String, String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(name, _)| name.len() > prefix.len() && name.starts_with(prefix))
        .collect();
    vars.sort();
    vars.into_iter()
        .map(|(name, value)| (setting_name(&name[prefix.len()..]), name, value))
        .collect()
}

/// Checks each setting taken from the environment (`from_env`: setting,
/// variable) with librdkafka at the value it ends with in `settings`, so
/// that a refusal names its variable, never its value.
pub(crate) fn check_env_settings(
    from_env: &[(String, String)],
    settings: &[(String, String)],
) -> Result<(), Error> {
    for (key, variable) in from_env {
        let value = settings
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map_or("", |(_, v)| v.as_str());
        if let Err(e) = ClientConfig::new().set(key, value).create_native_config() {
            return Err(Error::Config(format!(
                "environment variable {variable}: {}",
                crate::redacted(&e)
            )));
        }
    }
    Ok(())
}

fn setting_name(suffix: &str) -> String {
    suffix
        .to_lowercase()
        .split("__")
        .map(|part| part.replace('_', "."))
        .collect::<Vec<_>>()
        .join("_")
}

/// The producer settings [`idempotent_producer_config`] sets itself, with
/// their librdkafka aliases.
pub(crate) const PRODUCER_OWN_SETTINGS: [&str; 5] = [
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "message.timeout.ms",
    "delivery.timeout.ms",
];

/// The transactional producer's own settings, with their aliases.
pub(crate) const TRANSACTIONAL_OWN_SETTINGS: [&str; 5] = [
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "transactional.id",
    "transaction.timeout.ms",
];

/// Refuses a setting that a producer of dedup's (`who`) keeps for itself
/// (`own`, aliases included): left beside dedup's value, librdkafka would
/// apply one or the other by the order it reads the map in. `instead` says
/// what sets it. Every producer (dead letters, the relay, the Kafka-only
/// runtime's) is guarded the same way.
pub(crate) fn refuse_own_settings(
    settings: &[(String, String)],
    own: &[&str],
    who: &str,
    instead: &str,
) -> Result<(), Error> {
    match settings.iter().find(|(k, _)| own.contains(&k.as_str())) {
        Some((key, _)) => Err(Error::Config(format!(
            "{who} sets {key:?} itself ({instead})"
        ))),
        None => Ok(()),
    }
}

/// The configuration of an idempotent producer (the consumer's dead letters,
/// the relay): `settings` passed through, then the idempotence settings,
/// which they cannot override. A message not acknowledged within
/// `message_timeout` fails (at least 1 ms: librdkafka takes 0 as no limit).
pub(crate) fn idempotent_producer_config<'a>(
    brokers: &str,
    settings: impl IntoIterator<Item = &'a (String, String)>,
    message_timeout: Duration,
) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (k, v) in settings {
        // The settings below and their aliases are this producer's own: an
        // alias left beside them would win or lose at random (librdkafka
        // applies them in the map's order).
        if !PRODUCER_OWN_SETTINGS.contains(&k.as_str()) {
            config.set(k, v);
        }
    }
    // The broker writes each message once per producer session and in
    // order per partition, and a message counts only once all replicas
    // have it.
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set(
            "message.timeout.ms",
            message_timeout.as_millis().max(1).to_string(),
        );
    config
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Settings as the builders hold them, from pairs.
    pub(crate) fn settings(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Without the `ssl` feature, asking for TLS fails at build time with
    /// the remedy, not with librdkafka's bare "unsupported value".
    #[cfg(not(feature = "ssl"))]
    #[test]
    fn tls_without_the_ssl_feature_names_the_remedy() {
        for pair in [
            ("security.protocol", "SSL"),
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanisms", "SCRAM-SHA-512"),
        ] {
            let err = consumer_config("b", Some("g"), &settings(&[pair])).unwrap_err();
            assert!(err.to_string().contains("`ssl`"), "{pair:?}: {err}");
        }
        let plain = settings(&[
            ("security.protocol", "sasl_plaintext"),
            ("sasl.mechanisms", "PLAIN"),
        ]);
        assert!(consumer_config("b", Some("g"), &plain).is_ok());
    }

    #[test]
    fn secrets_are_masked_including_the_oauthbearer_config() {
        let all = settings(&[
            ("sasl.password", "p1"),
            ("sasl.oauthbearer.config", "principal=svc secret=p2"),
            ("ssl.key.password", "p3"),
            ("client.id", "visible"),
        ]);
        let shown = format!("{:?}", redacted(&all));
        for secret in ["p1", "p2", "p3"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("visible"), "{shown}");
    }

    #[test]
    fn how_to_reach_and_trust_the_brokers_is_shared_with_the_dead_letter_producer() {
        for key in [
            "security.protocol",
            "ssl.ca.location",
            "enable.ssl.certificate.verification",
            "https.ca.location",
            "api.version.request",
            "sasl.oauthbearer.token.endpoint.url",
            "client.id",
        ] {
            assert!(is_shared_setting(key), "{key}");
        }
        for key in ["auto.offset.reset", "fetch.min.bytes", "group.instance.id"] {
            assert!(!is_shared_setting(key), "{key}");
        }
    }

    #[test]
    fn the_prefetch_is_small_by_default_and_the_users_setting_wins() {
        let config = consumer_config("b", Some("g"), &[]).unwrap();
        assert_eq!(config.get("queued.max.messages.kbytes"), Some("2048"));
        assert_eq!(config.get("queued.min.messages"), Some("5000"));
        assert_eq!(config.get("fetch.queue.backoff.ms"), Some("10"));
        assert_eq!(config.get("fetch.wait.max.ms"), Some("100"));
        let mine = settings(&[
            ("queued.max.messages.kbytes", "65536"),
            ("fetch.queue.backoff.ms", "1000"),
        ]);
        let config = consumer_config("b", Some("g"), &mine).unwrap();
        assert_eq!(config.get("queued.max.messages.kbytes"), Some("65536"));
        assert_eq!(config.get("fetch.queue.backoff.ms"), Some("1000"));
        assert_eq!(config.get("queued.min.messages"), Some("5000"));
    }

    #[test]
    fn offsets_settings_cannot_be_overridden() {
        let client_settings = settings(&[
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "true"),
        ]);
        let config = consumer_config(DEFAULT_BROKERS, Some("g"), &client_settings).unwrap();
        assert_eq!(config.get("enable.auto.commit"), Some("false"));
        assert_eq!(config.get("enable.auto.offset.store"), Some("false"));
    }

    #[test]
    fn idempotence_settings_cannot_be_overridden() {
        let passed = settings(&[
            ("enable.idempotence", "false"),
            ("acks", "1"),
            ("request.required.acks", "0"),
            ("delivery.timeout.ms", "0"),
            ("sasl.username", "svc"),
        ]);
        let config = idempotent_producer_config(DEFAULT_BROKERS, &passed, Duration::ZERO);
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("message.timeout.ms"), Some("1"));
        // An alias would race the setting it stands for.
        assert_eq!(config.get("request.required.acks"), None);
        assert_eq!(config.get("delivery.timeout.ms"), None);
        assert_eq!(config.get("sasl.username"), Some("svc"));
    }

    /// A consumer must read whatever codec its producers chose; a librdkafka
    /// built without one fails every batch of a topic that uses it. The
    /// build no longer needs system headers, so check what it linked.
    #[test]
    fn the_linked_librdkafka_decodes_every_compression_codec() {
        let features: Vec<&str> = builtin_features().split(',').collect();
        for codec in ["gzip", "snappy", "lz4", "zstd"] {
            assert!(features.contains(&codec), "{codec} missing: {features:?}");
        }
    }
}
