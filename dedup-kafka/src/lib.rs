#![doc = include_str!("../README.md")]

mod builder;
mod config;
mod consumer;
mod dead_letter;
mod dlq;
mod failpoint;
mod partition;
mod rebalance;
mod relay;
mod retry;
mod route;
mod shutdown;
mod stats;

pub use builder::ConsumerBuilder;
pub use consumer::Consumer;
pub use dlq::{MAX_ERROR_MESSAGE_BYTES, TRUNCATED_PAYLOAD_BYTES};
pub use relay::{Relay, RelayBuilder, RelayStats, RelayStatsSnapshot};
pub use retry::RetryPolicy;
pub use shutdown::shutdown_signal;
pub use stats::{Stats, StatsSnapshot};

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
    /// The consumer cannot go on and stopped, after committing what it had
    /// finished: a fatal client error (another instance with the same
    /// `group.instance.id`, say), or a partition whose worker died, whose
    /// later messages must not be applied past the ones it dropped.
    #[error("the consumer stopped: {0}")]
    Fatal(String),
}
