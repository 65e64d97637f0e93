#![doc = include_str!("../README.md")]

mod access;
mod config;
mod database;
mod dead_letter_format;
mod failpoint;
#[cfg(feature = "http")]
pub mod http;
mod metrics;
mod oauth;
#[cfg(feature = "oidc")]
mod oidc;
#[cfg(feature = "opentelemetry")]
mod otel;
mod pipeline;
mod relay;
mod retry;
mod select;
mod shutdown;
mod stats;
mod tiers;
mod token_keeper;
mod transactional;
mod ttl_check;

pub use config::{OnFingerprintMismatch, PREFETCH_DEFAULTS, settings_from_env};
pub use database::builder::ConsumerBuilder;
pub use database::consumer::Consumer;
pub use dead_letter_format::{
    DEAD_LETTER_HEADERS, DeadLetterHeaders, MAX_ERROR_MESSAGE_BYTES, MalformedHeaders,
    OriginalMessage, REPLAY_COUNT_HEADER, REPLAYED_FROM_HEADER, TRUNCATED_PAYLOAD_BYTES,
};
pub use oauth::{OAuthToken, TokenContext, TokenError, TokenFuture, TokenProvider};
#[cfg(feature = "oidc")]
pub use oidc::OidcClientCredentials;
pub use relay::{Relay, RelayBuilder};
pub use retry::RetryPolicy;
pub use select::{EventType, OrderBy, OtherTypes};
pub use shutdown::shutdown_signal;
pub use stats::{
    Health, LIVE_POLL_LIMIT, RelayHealth, RelayStats, RelayStatsSnapshot, Stats, StatsSnapshot,
};
pub use tiers::{
    DEFAULT_ATTEMPTS_IN_PLACE, KAFKA_ONLY_ATTEMPTS_IN_PLACE, ORIGIN_HEADERS, RETRY_ATTEMPT_HEADER,
    RETRY_DUE_HEADER, RETRY_RELEASED_HEADER, RETRY_SIGNATURE_HEADER, RETRY_TIER_HEADER, ReadTiers,
    RetryTier, RetryTiers, TierKey,
};
pub use token_keeper::TokenKeeper;
pub use transactional::{
    OutputRecord, Outputs, TransactionalConsumer, TransactionalConsumerBuilder,
};
pub use ttl_check::{TopicRetention, TtlCheck, topic_retention};

/// Errors that stop a consumer from starting or running.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The builder's settings are incomplete or inconsistent.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// librdkafka refused a setting or an operation.
    #[error("kafka: {}", redacted(.0))]
    Kafka(rdkafka::error::KafkaError),
    /// The consumer cannot go on and stopped, after committing what it had
    /// finished: a fatal client error (another instance with the same
    /// `group.instance.id`, say), or a partition whose worker died, whose
    /// later messages must not be applied past the ones it dropped.
    #[error("the consumer stopped: {0}")]
    Fatal(String),
}

impl Error {
    /// A configuration error's own words (without the "invalid consumer
    /// configuration" its display adds), to be wrapped again later.
    pub(crate) fn into_config_message(self) -> String {
        match self {
            Error::Config(message) => message,
            other => other.to_string(),
        }
    }
}

impl From<rdkafka::error::KafkaError> for Error {
    fn from(e: rdkafka::error::KafkaError) -> Self {
        Error::Kafka(e)
    }
}

/// A librdkafka error as text, without the value of a setting it refused:
/// a mistyped key (`sasl.pasword`) would otherwise print the password.
pub fn redacted(e: &rdkafka::error::KafkaError) -> String {
    match e {
        rdkafka::error::KafkaError::ClientConfig(_, description, key, _) => {
            format!("the setting {key:?} was refused: {description} (its value is not shown)")
        }
        // OpenSSL's words for a client key given without its certificate.
        rdkafka::error::KafkaError::ClientCreation(why)
            if why.contains("no certificate assigned") =>
        {
            format!(
                "{e}: a client key (ssl.key.location, ssl.key.pem) needs its certificate: set \
                 ssl.certificate.location (or ssl.certificate.pem)"
            )
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_setting_never_shows_its_value() {
        let e = rdkafka::ClientConfig::new()
            .set("sasl.pasword", "hunter2-secret")
            .create::<rdkafka::producer::FutureProducer>()
            .err()
            .expect("an unknown property is refused");
        let shown = Error::from(e).to_string();
        assert!(shown.contains("sasl.pasword"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
