#![doc = include_str!("../../README.md")]
//!
//! (This crate holds the runnable examples; its docs are the repository
//! README, so every Rust example in the README compiles as a doctest.)

/// Logs to stderr for the examples. If stderr goes away (its reader died),
/// log lines are dropped instead of panicking inside a librdkafka callback.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .log_internal_errors(false)
        .init();
}

/// The environment variable `name`, or `default` if unset.
pub fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}
