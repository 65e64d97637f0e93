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
    #[doc = include_str!("../../docs/src/crates.md")]
    mod crates {}
    #[doc = include_str!("../../docs/src/decoding.md")]
    mod decoding {}
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
    #[doc = include_str!("../../docs/src/scaling.md")]
    mod scaling {}
    #[doc = include_str!("../../docs/src/semantics.md")]
    mod semantics {}
    #[doc = include_str!("../../docs/src/testing.md")]
    mod testing {}
    #[doc = include_str!("../../docs/src/upgrading.md")]
    mod upgrading {}
}

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

/// Prometheus metrics at `/metrics` and health checks, served on
/// `METRICS_ADDR` (e.g. `127.0.0.1:9464`) when it is set; nothing otherwise.
/// Installs the process's metrics recorder, so call it before the consumer
/// runs. `/livez` (a liveness probe: restart when 503) answers 200 while the
/// consumer is live, `/readyz` and `/healthz` (a readiness probe) while it
/// is live and ready (see `dedup_kafka::Health`), with the health as JSON;
/// without a consumer, 200 while the process runs.
pub fn serve_metrics(
    health: Option<std::sync::Arc<dedup_kafka::Stats>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let Ok(addr) = std::env::var("METRICS_ADDR") else {
        return Ok(());
    };
    serve_metrics_on(&addr, health)
}

/// [`serve_metrics`] on `addr`.
pub fn serve_metrics_on(
    addr: &str,
    health: Option<std::sync::Arc<dedup_kafka::Stats>>,
) -> Result<(), Box<dyn std::error::Error>> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

    // Buckets, so that dashboards can aggregate quantiles across instances.
    // Up to 30 days: duplicate ages are read over weeks to choose a TTL.
    let seconds = [
        0.001,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
        30.0,
        60.0,
        300.0,
        900.0,
        3600.0,
        14_400.0,
        86_400.0,
        604_800.0,
        2_592_000.0,
    ];
    let sizes = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)?
        .set_buckets_for_metric(Matcher::Full("dedup_batch_size".into()), &sizes)?
        .install_recorder()?;
    let server = tiny_http::Server::http(addr).map_err(|e| format!("METRICS_ADDR {addr}: {e}"))?;
    let upkeep = handle.clone();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(5));
            upkeep.run_upkeep();
        }
    });
    std::thread::spawn(move || {
        for request in server.incoming_requests() {
            let (status, body, kind) = match request.url() {
                "/metrics" => (200, handle.render(), "text/plain; version=0.0.4"),
                path @ ("/healthz" | "/readyz" | "/livez") => {
                    let (ok, body) = match &health {
                        Some(stats) => {
                            let h = stats.health();
                            let ok = if path == "/livez" {
                                h.is_live()
                            } else {
                                h.is_ready()
                            };
                            let body = serde_json::json!({
                                "live": h.is_live(),
                                "ready": h.is_ready(),
                                "running": h.running,
                                "joined": h.joined,
                                "assigned_partitions": h.assigned_partitions,
                                "since_last_poll_seconds": h.since_last_poll.as_secs_f64(),
                                "oldest_in_flight_seconds": h.oldest_in_flight.as_secs_f64(),
                                "paused_partitions": h.paused_partitions,
                                "outage": h.outage,
                                "store_answered": h.store_answered,
                                "fatal": h.fatal,
                            });
                            (ok, body.to_string())
                        }
                        None => (true, "{\"live\":true,\"ready\":true}".to_owned()),
                    };
                    (if ok { 200 } else { 503 }, body, "application/json")
                }
                _ => (404, "not found\n".to_owned(), "text/plain"),
            };
            let header = tiny_http::Header::from_bytes("Content-Type", kind).expect("valid header");
            let response = tiny_http::Response::from_string(body)
                .with_status_code(status)
                .with_header(header);
            let _ = request.respond(response);
        }
    });
    Ok(())
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

/// The protobuf example's events, generated from `proto/payments.proto` by
/// prost-build at build time.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/dedup.examples.rs"));
}
