#![doc = include_str!("../../README.md")]
//!
//! (This crate holds the runnable examples; its docs are the repository
//! README, so every Rust example in the README compiles as a doctest, as
//! every one in the book does.)

/// Every Rust example of the book compiles as a doctest: each chapter is the
/// docs of a module here, compiled only by `cargo test`'s doctests
/// (`scripts/doclinks.py` checks that every chapter is listed).
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../../docs/src/architecture.md")]
    mod architecture {}
    #[doc = include_str!("../../docs/src/backends.md")]
    mod backends {}
    #[doc = include_str!("../../docs/src/choosing-ttl.md")]
    mod choosing_ttl {}
    #[doc = include_str!("../../docs/src/concepts.md")]
    mod concepts {}
    #[doc = include_str!("../../docs/src/configuration.md")]
    mod configuration {}
    #[doc = include_str!("../../docs/src/console.md")]
    mod console {}
    #[doc = include_str!("../../docs/src/crates.md")]
    mod crates {}
    #[doc = include_str!("../../docs/src/decoding.md")]
    mod decoding {}
    #[doc = include_str!("../../docs/src/deploying.md")]
    mod deploying {}
    #[doc = include_str!("../../docs/src/failures.md")]
    mod failures {}
    #[doc = include_str!("../../docs/src/getting-started.md")]
    mod getting_started {}
    #[doc = include_str!("../../docs/src/handler-options.md")]
    mod handler_options {}
    #[doc = include_str!("../../docs/src/introduction.md")]
    mod introduction {}
    #[doc = include_str!("../../docs/src/kafka-to-kafka.md")]
    mod kafka_to_kafka {}
    #[doc = include_str!("../../docs/src/key-concurrency.md")]
    mod key_concurrency {}
    #[doc = include_str!("../../docs/src/lease-mode.md")]
    mod lease_mode {}
    #[doc = include_str!("../../docs/src/metrics.md")]
    mod metrics {}
    #[doc = include_str!("../../docs/src/operating.md")]
    mod operating {}
    #[doc = include_str!("../../docs/src/outbox.md")]
    mod outbox {}
    #[doc = include_str!("../../docs/src/performance.md")]
    mod performance {}
    #[doc = include_str!("../../docs/src/retry-tiers.md")]
    mod retry_tiers {}
    #[doc = include_str!("../../docs/src/scaling.md")]
    mod scaling {}
    #[doc = include_str!("../../docs/src/security.md")]
    mod security {}
    #[doc = include_str!("../../docs/src/semantics.md")]
    mod semantics {}
    #[doc = include_str!("../../docs/src/testing.md")]
    mod testing {}
    #[doc = include_str!("../../docs/src/tracing.md")]
    mod tracing {}
    #[doc = include_str!("../../docs/src/upgrading.md")]
    mod upgrading {}
}

/// Logs to stderr for the examples. If stderr goes away (its reader died),
/// log lines are dropped instead of panicking inside a librdkafka callback.
pub fn init_logging() {
    // DEBUG_LOG set: the debug lines too (the tests read the batches' own).
    let level = if std::env::var_os("DEBUG_LOG").is_some() {
        tracing_subscriber::filter::LevelFilter::DEBUG
    } else {
        tracing_subscriber::filter::LevelFilter::INFO
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .log_internal_errors(false)
        .init();
}

/// The environment variable `name`, or `default` if unset.
pub fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// `METRICS_ADDR` (e.g. `9464`, loopback's, or `0.0.0.0:9464`), where the examples serve
/// `/metrics`, `/livez`, `/readyz` and `/healthz` through the library's
/// `serve_http`, if it is set.
pub fn metrics_addr() -> Option<String> {
    std::env::var("METRICS_ADDR").ok()
}

/// `DEDUP_KEY_CONCURRENCY`: how many handler calls of one partition may
/// run at once, events of one key still in order (0 or unset: one at a
/// time, in offset order).
pub fn key_concurrency() -> Result<usize, Box<dyn std::error::Error>> {
    match std::env::var("DEDUP_KEY_CONCURRENCY") {
        Ok(n) => n
            .parse()
            .map_err(|_| format!("DEDUP_KEY_CONCURRENCY must be a whole number, not {n:?}").into()),
        Err(_) => Ok(0),
    }
}

/// `DEDUP_RETRY_TIERS` (delays like `5s,30s`), `DEDUP_RETRY_HOLD_KEYS=1`
/// and `DEDUP_TIER_KEY_FILE` (the tiers' signing key, as `dedup retry
/// release` reads it): the consumer's retry tiers, if any
/// (`<topic>.retry-5s`...).
pub fn retry_tiers() -> Result<Option<dedup_kafka::RetryTiers>, Box<dyn std::error::Error>> {
    let Ok(delays) = std::env::var("DEDUP_RETRY_TIERS") else {
        return Ok(None);
    };
    if delays.trim().is_empty() {
        return Ok(None);
    }
    let hold = std::env::var("DEDUP_RETRY_HOLD_KEYS").is_ok_and(|v| v == "1");
    let mut tiers = dedup_kafka::RetryTiers::new(delays.split(','))?.hold_keys(hold);
    if let Some(path) = std::env::var_os("DEDUP_TIER_KEY_FILE") {
        tiers = tiers.signing_key(dedup_kafka::TierKey::from_file(path)?);
    }
    Ok(Some(tiers))
}

/// `--exit-when-idle <ttl>`, the one flag of the consumer examples, if
/// given; `example` names the binary in the usage message.
pub fn exit_when_idle(
    example: &str,
) -> Result<Option<dedup_core::Ttl>, Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut idle = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--exit-when-idle" => {
                let value = args
                    .next()
                    .ok_or("--exit-when-idle needs a duration, like 10s")?;
                idle = Some(value.parse()?);
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: {example} [--exit-when-idle <ttl>]"
                )
                .into());
            }
        }
    }
    Ok(idle)
}

/// Resolves when `signal` does, or once the consumer has been idle for
/// `limit` (if given): what the examples run until.
pub async fn until_idle(
    stats: std::sync::Arc<dedup_kafka::Stats>,
    limit: Option<dedup_core::Ttl>,
    signal: impl std::future::Future<Output = ()>,
) {
    let Some(limit) = limit else {
        return signal.await;
    };
    let idle = async {
        while stats.idle_for() < limit.as_duration() {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    };
    tokio::select! {
        () = idle => {}
        () = signal => {}
    }
}

/// Produces one record of `payload`, without a key, to `topic`: the
/// examples that make their own events.
pub async fn send(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    payload: &[u8],
) -> Result<(), Box<dyn std::error::Error>> {
    producer
        .send(
            rdkafka::producer::FutureRecord::<(), [u8]>::to(topic).payload(payload),
            std::time::Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    Ok(())
}

/// Whether a run that made ten events (each twice) and two bad payloads
/// came out right: ten applied, ten skipped, two dead-lettered, and every
/// balance (`(what, got, expected)`, printed) as expected. Prints the
/// summary last; an error says what is off.
#[allow(clippy::print_stdout)]
pub fn check_run(
    summary: &dedup_kafka::StatsSnapshot,
    balances: &[(String, Option<i64>, i64)],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut ok = summary.applied == 10 && summary.skipped == 10 && summary.dead_lettered == 2;
    for (what, got, expected) in balances {
        println!("{what}: {got:?} cents, expected {expected}");
        ok &= *got == Some(*expected);
    }
    println!("{summary}");
    if !ok {
        return Err(
            "a balance or a count is off: expected applied=10 skipped=10 dead_lettered=2".into(),
        );
    }
    Ok(())
}

/// The protobuf example's events, generated from `proto/payments.proto` by
/// prost-build at build time.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/dedup.examples.rs"));
}
