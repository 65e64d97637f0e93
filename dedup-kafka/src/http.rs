//! Prometheus metrics and health probes over HTTP (feature `http`).
//!
//! One call on a builder serves them while that consumer or relay runs:
//!
//! ```no_run
//! # use dedup_kafka::Consumer;
//! # fn demo(store: dedup_core::MemoryStore) -> Result<(), dedup_kafka::Error> {
//! let consumer = Consumer::builder(store)
//!     .group_id("payments")
//!     .serve_http("9464") // loopback only; "0.0.0.0:9464" for probes from elsewhere
//!     // .handle("payments", record_payment)
//! #   ;
//! # Ok(()) }
//! ```
//!
//! | path | answers |
//! |------|---------|
//! | `/metrics` | the process's metrics, Prometheus text format |
//! | `/livez` | 200 while every component is live ([`Health::is_live`]), else 503: restart it |
//! | `/readyz`, `/healthz` | 200 while every component is ready ([`Health::is_ready`]), else 503 |
//!
//! The probes answer with a [`Report`] as JSON. Several components in one
//! process (two consumers and a relay, say) share one address through
//! [`HttpEndpoints`].
//!
//! The server is hyper's HTTP/1 server on the consumer's own tokio runtime:
//! the stack `metrics-exporter-prometheus` would run for its own listener,
//! without that listener's single path, and without a router for four fixed
//! paths.

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::Serialize;

use crate::stats::{RelayHealth, RelayStats};
use crate::{Error, Health, Stats};

/// How long a client has to send its request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How often histograms are drained into their summaries.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The buckets of every `*_seconds` histogram, so that dashboards can
/// aggregate quantiles across instances: up to 30 days, since duplicate
/// ages are read over weeks to choose a TTL.
const SECONDS_BUCKETS: [f64; 21] = [
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

/// The buckets of `dedup_batch_size`.
const SIZE_BUCKETS: [f64; 10] = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

/// The recorder this module installed, shared by every server of the
/// process.
static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs a Prometheus recorder with dedup's histogram buckets as the
/// process's metrics recorder, once; later calls return the same handle.
/// An error if another recorder was installed first: then pass its handle
/// to [`HttpEndpoints::bind_with`] instead.
pub fn install_prometheus() -> Result<PrometheusHandle, Error> {
    if let Some(handle) = RECORDER.get() {
        return Ok(handle.clone());
    }
    static INSTALL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(handle) = RECORDER.get() {
        return Ok(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full("dedup_batch_size".into()), &SIZE_BUCKETS)
        })
        .map_err(|e| Error::Config(format!("prometheus buckets: {e}")))?
        .install_recorder()
        .map_err(|e| {
            Error::Config(format!(
                "serving /metrics: {e}; another metrics recorder is installed: serve its \
                 PrometheusHandle with HttpEndpoints::bind_with"
            ))
        })?;
    Ok(RECORDER.get_or_init(|| handle).clone())
}

/// What one component of the process says of its health.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ComponentHealth {
    /// A [`Consumer`](crate::Consumer) or
    /// [`TransactionalConsumer`](crate::TransactionalConsumer).
    Consumer(Health),
    /// A [`Relay`](crate::Relay).
    Relay(RelayHealth),
}

impl ComponentHealth {
    /// Whether it is live: see [`Health::is_live`] and
    /// [`RelayHealth::is_live`].
    pub fn is_live(&self) -> bool {
        match self {
            ComponentHealth::Consumer(h) => h.is_live(),
            ComponentHealth::Relay(h) => h.is_live(),
        }
    }

    /// Whether it is ready: see [`Health::is_ready`] and
    /// [`RelayHealth::is_ready`].
    pub fn is_ready(&self) -> bool {
        match self {
            ComponentHealth::Consumer(h) => h.is_ready(),
            ComponentHealth::Relay(h) => h.is_ready(),
        }
    }
}

/// One component in a [`Report`].
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct ComponentReport {
    /// Its name: a consumer's group id, or `relay`.
    pub name: String,
    /// [`ComponentHealth::is_live`].
    pub live: bool,
    /// [`ComponentHealth::is_ready`].
    pub ready: bool,
    /// The details.
    #[serde(flatten)]
    pub health: ComponentHealth,
}

/// What `/livez`, `/readyz` and `/healthz` answer, as JSON.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Report {
    /// Every component is live.
    pub live: bool,
    /// Every component is ready.
    pub ready: bool,
    /// Each component's health.
    pub components: Vec<ComponentReport>,
}

/// A component whose health the endpoints report.
#[derive(Clone)]
enum Watched {
    Consumer(Arc<Stats>),
    Relay(Arc<RelayStats>),
}

/// An address bound for the endpoints, with the components they report
/// on; [`spawn`](Self::spawn) serves them. The builders' `serve_http` make
/// one of these for a single component; make one yourself when a process
/// runs several:
///
/// ```no_run
/// # async fn demo(payments: dedup_kafka::Consumer<impl dedup_core::DedupStore>,
/// #               relay: dedup_kafka::Relay<impl dedup_core::OutboxSource>) -> Result<(), dedup_kafka::Error> {
/// use dedup_kafka::http::HttpEndpoints;
///
/// let server = HttpEndpoints::bind("0.0.0.0:9464")?
///     .consumer("payments", payments.stats())
///     .relay("relay", relay.stats())
///     .spawn();
/// // ... run them; the endpoints are served until `server` is dropped.
/// # Ok(()) }
/// ```
pub struct HttpEndpoints {
    listener: StdTcpListener,
    local_addr: SocketAddr,
    metrics: PrometheusHandle,
    components: Vec<(String, Watched)>,
}

impl std::fmt::Debug for HttpEndpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.components.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("HttpEndpoints")
            .field("local_addr", &self.local_addr)
            .field("components", &names)
            .finish_non_exhaustive()
    }
}

impl HttpEndpoints {
    /// Binds `addr` (`host:port`, or a port alone for loopback's:
    /// `"9464"` is `127.0.0.1:9464`; port 0 picks a free one, see
    /// [`local_addr`](Self::local_addr)) and installs dedup's Prometheus
    /// recorder ([`install_prometheus`]). Nothing is served until
    /// [`spawn`](Self::spawn).
    pub fn bind(addr: &str) -> Result<Self, Error> {
        Self::bind_with(addr, install_prometheus()?)
    }

    /// [`bind`](Self::bind), serving the metrics of a Prometheus recorder
    /// the application installed itself.
    pub fn bind_with(addr: &str, metrics: PrometheusHandle) -> Result<Self, Error> {
        let addr = &bind_address(addr);
        let bound = StdTcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(|l| l.local_addr().map(|a| (l, a)));
        let (listener, local_addr) =
            bound.map_err(|e| Error::Config(format!("serve_http({addr:?}): {e}")))?;
        Ok(HttpEndpoints {
            listener,
            local_addr,
            metrics,
            components: Vec::new(),
        })
    }

    /// The address bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Reports on a consumer (of either runtime) by its counters.
    pub fn consumer(mut self, name: impl Into<String>, stats: Arc<Stats>) -> Self {
        self.components
            .push((name.into(), Watched::Consumer(stats)));
        self
    }

    /// Reports on a relay by its counters.
    pub fn relay(mut self, name: impl Into<String>, stats: Arc<RelayStats>) -> Self {
        self.components.push((name.into(), Watched::Relay(stats)));
        self
    }

    /// Serves the endpoints on the current tokio runtime until the returned
    /// server is dropped. Panics outside a tokio runtime.
    pub fn spawn(self) -> HttpServer {
        let local_addr = self.local_addr;
        let shared = Arc::new(Served {
            metrics: self.metrics,
            components: self.components,
        });
        let upkeep = shared.clone();
        let upkeep = tokio::spawn(async move {
            let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
            loop {
                tick.tick().await;
                upkeep.metrics.run_upkeep();
            }
        });
        let accept = tokio::spawn(accept(self.listener, shared));
        HttpServer {
            local_addr,
            tasks: [upkeep, accept],
        }
    }
}

/// What a builder's `serve_http` binds: `addr` reporting on one consumer.
pub(crate) fn bind(
    addr: Option<String>,
    name: &str,
    stats: Arc<Stats>,
) -> Result<Option<HttpEndpoints>, Error> {
    addr.map(|addr| Ok(HttpEndpoints::bind(&addr)?.consumer(name, stats)))
        .transpose()
}

/// The endpoints being served; dropping it stops them.
#[derive(Debug)]
pub struct HttpServer {
    local_addr: SocketAddr,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl HttpServer {
    /// The address served.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// What the server answers from.
struct Served {
    metrics: PrometheusHandle,
    components: Vec<(String, Watched)>,
}

impl Served {
    fn report(&self) -> Report {
        let components: Vec<ComponentReport> = self
            .components
            .iter()
            .map(|(name, watched)| {
                let health = match watched {
                    Watched::Consumer(stats) => ComponentHealth::Consumer(stats.health()),
                    Watched::Relay(stats) => ComponentHealth::Relay(stats.health()),
                };
                ComponentReport {
                    name: name.clone(),
                    live: health.is_live(),
                    ready: health.is_ready(),
                    health,
                }
            })
            .collect();
        Report {
            live: components.iter().all(|c| c.live),
            ready: components.iter().all(|c| c.ready),
            components,
        }
    }

    fn answer(&self, method: &Method, path: &str) -> Response<Full<Bytes>> {
        if method != Method::GET && method != Method::HEAD {
            return reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "GET or HEAD\n".into(),
            );
        }
        match path {
            "/metrics" => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            "/livez" | "/readyz" | "/healthz" => {
                let report = self.report();
                let ok = if path == "/livez" {
                    report.live
                } else {
                    report.ready
                };
                let body = serde_json::to_string(&report).unwrap_or_default();
                let status = if ok {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                reply(status, "application/json", body)
            }
            _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
        }
    }
}

fn reply(status: StatusCode, kind: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(kind),
    );
    response
}

/// Accepts connections until aborted; each is served on its own task.
async fn accept(listener: StdTcpListener, served: Arc<Served>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::error!(error = %e, "serve_http: cannot listen");
            return;
        }
    };
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let served = served.clone();
                    connections.spawn(serve_connection(stream, served));
                }
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "serve_http: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve_connection(stream: tokio::net::TcpStream, served: Arc<Served>) {
    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        let response = served.answer(request.method(), request.uri().path());
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    if let Err(e) = connection.await {
        tracing::debug!(error = %e, "serve_http: a connection failed");
    }
}

/// The address to bind for `addr`: a port alone (`"9464"`, `":9464"`) is
/// loopback's, reachable from this machine only; anything else as given.
fn bind_address(addr: &str) -> String {
    let port = addr.strip_prefix(':').unwrap_or(addr);
    if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
        format!("127.0.0.1:{port}")
    } else {
        addr.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_alone_binds_loopback_only() {
        assert_eq!(bind_address("9464"), "127.0.0.1:9464");
        assert_eq!(bind_address(":9464"), "127.0.0.1:9464");
        assert_eq!(bind_address("0.0.0.0:9464"), "0.0.0.0:9464");
        assert_eq!(bind_address("[::]:9464"), "[::]:9464");
        assert_eq!(bind_address("ops.internal:9464"), "ops.internal:9464");
        let server =
            HttpEndpoints::bind_with("0", PrometheusBuilder::new().build_recorder().handle())
                .expect("bound");
        assert!(server.local_addr().ip().is_loopback());
    }
}
