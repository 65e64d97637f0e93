//! `dedup console`: the operator tool's pages, for a browser.
//!
//! Server-rendered HTML (maud) on hyper's HTTP/1 server, the stylesheet
//! and the overview's refresh script embedded: one binary, nothing fetched
//! from anywhere. Every page is the operator tool's library calls shown
//! differently: the dead letters through the runtime's header reader, the
//! claims and the outbox through each backend's admin functions, a replay
//! through `dlq replay` itself.
//!
//! | path | answers |
//! |------|---------|
//! | `/` | consumer groups, members, lag per partition; the services' outcomes and outages |
//! | `/dlq` | the dead-letter topics |
//! | `/dlq/<topic>` | a topic's dead letters, newest first, by kind, searchable; replay |
//! | `/dlq/<topic>/<partition>/<offset>` | one dead letter: why, headers, payload, its claim |
//! | `/claims` | claims per scope; one claim by scope and key; release |
//! | `/outbox` | the outbox's backlog per topic |
//!
//! Safe by default: it binds to 127.0.0.1; any other address needs a token
//! (`DEDUP_CONSOLE_TOKEN`) and TLS (served here with `--tls-cert` and
//! `--tls-key`, or by a proxy in front: `--behind-tls-proxy`); sessions
//! expire and can be ended, wrong tokens are rate-limited, connections are
//! capped (`--max-connections`). Changes (a release, a replay) are POSTs with a
//! CSRF token and a confirmation step, hidden by `--read-only`, and each
//! is logged on standard error with what it did.

mod guard;
mod overview;
mod pages;
mod reading;
mod replay;
mod tls;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use maud::Markup;

use crate::{Database, Failure, KafkaArgs, Report};

/// `dedup console`'s options.
#[derive(Args)]
pub(crate) struct ConsoleArgs {
    /// Where to serve the pages. An address other than loopback needs
    /// `DEDUP_CONSOLE_TOKEN` in the environment, and TLS: `--tls-cert` and
    /// `--tls-key`, or `--behind-tls-proxy`.
    #[arg(long, default_value = "127.0.0.1:9470")]
    listen: SocketAddr,
    /// Serve HTTPS with this certificate chain (PEM, the server's first).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of `--tls-cert` (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Plain HTTP on a non-loopback address is only for a proxy in front
    /// that adds TLS (and sets `X-Forwarded-Proto: https`): say it is there.
    #[arg(long, conflicts_with = "tls_cert")]
    behind_tls_proxy: bool,
    /// Connections served at once; more wait to be accepted.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    max_connections: u32,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// The database of the claims and the outbox: `postgres://..`,
    /// `mysql://..` or `sqlite://path` (without it, those pages say so).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The claims table.
    #[arg(long, default_value = "dedup_claims")]
    table: String,
    /// The outbox table.
    #[arg(long, default_value = "dedup_outbox")]
    outbox_table: String,
    /// A service's metrics endpoint (`http://host:9464/metrics`), for
    /// outcome rates and outages (repeatable).
    #[arg(long = "metrics", value_name = "URL")]
    metrics: Vec<String>,
    /// Where handlers take the event id from, as their
    /// `#[idempotent(key = ..)]` says: for a dead letter's claim and a
    /// replay's claim check (a page can say otherwise).
    #[arg(long, default_value = "event_id")]
    key: String,
    /// Show, never change: no release, no replay.
    #[arg(long)]
    read_only: bool,
}

/// What every request sees.
pub(crate) struct Console {
    kafka: KafkaArgs,
    db: Option<Database>,
    outbox_table: String,
    metrics: Vec<String>,
    key: String,
    read_only: bool,
    guard: guard::Guard,
    /// The previous scrape of each metrics endpoint, for rates.
    scrapes: overview::Scrapes,
    /// Held while a confirmed replay runs: one at a time.
    replaying: Arc<tokio::sync::Mutex<()>>,
}

/// Serves the console until Ctrl-C or SIGTERM.
pub(crate) async fn serve(args: ConsoleArgs) -> Result<Stopped, Failure> {
    let token = std::env::var("DEDUP_CONSOLE_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(tls::acceptor(cert, key)?),
        _ => None,
    };
    let transport = match (&tls, args.behind_tls_proxy) {
        (Some(_), _) => guard::Transport::Tls,
        (None, true) => guard::Transport::Proxy,
        (None, false) => guard::Transport::Plain,
    };
    let guard = guard::Guard::new(args.listen, token, transport)?;
    crate::dlq::parse_key(&args.key).map_err(|e| Failure::new(format!("--key: {e}")))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Failure::new(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::new(e.to_string()))?;
    let console = Arc::new(Console {
        db: args.database_url.map(|database_url| Database {
            database_url,
            table: args.table,
        }),
        kafka: args.kafka,
        outbox_table: args.outbox_table,
        metrics: args.metrics,
        key: args.key,
        read_only: args.read_only,
        guard,
        scrapes: overview::Scrapes::default(),
        replaying: Arc::default(),
    });
    // The one line a script waits for: where the pages are.
    println!(
        "dedup console: serving {}://{addr}/{}{}",
        if tls.is_some() { "https" } else { "http" },
        if console.guard.needs_token() {
            " (token required)"
        } else {
            ""
        },
        if console.read_only {
            " (read-only)"
        } else {
            ""
        }
    );
    let stop = dedup_kafka::shutdown_signal();
    tokio::pin!(stop);
    // A connection holds a permit from its acceptance to its end: beyond
    // the cap, clients wait in the listen queue.
    let permits = Arc::new(tokio::sync::Semaphore::new(args.max_connections as usize));
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            () = &mut stop => break,
        };
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    eprintln!("dedup console: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let console = console.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tls {
                // A handshake that does not finish in 10 s is given up.
                Some(acceptor) => {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
                    if let Ok(Ok(stream)) = handshake.await {
                        serve_connection(console, remote, stream).await;
                    }
                }
                None => serve_connection(console, remote, stream).await,
            }
        });
    }
    Ok(Stopped { addr })
}

/// How long a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection may last, however it is used: one that stops
/// reading its answers (hyper's writes have no timeout) gives its place
/// back by then. (A replay runs to its end on its own.)
const CONNECTION_LIFETIME: Duration = Duration::from_secs(600);

/// Serves one connection's requests (plain or TLS) until it ends.
async fn serve_connection<S>(console: Arc<Console>, remote: SocketAddr, stream: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let console = console.clone();
        async move { Ok::<_, Infallible>(handle(&console, remote, req).await) }
    });
    // A client that goes away mid-request is its own business.
    let serving = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(Duration::from_secs(10))
        .timer(hyper_util::rt::TokioTimer::new())
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    let _ = tokio::time::timeout(CONNECTION_LIFETIME, serving).await;
}

/// The console stopped (Ctrl-C or SIGTERM).
pub(crate) struct Stopped {
    addr: SocketAddr,
}

impl Report for Stopped {
    fn text(&self) -> String {
        format!("dedup console on {} stopped\n", self.addr)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "stopped": self.addr.to_string() })
    }
}

/// A request as the pages see it: its path's parts, its query and (for a
/// POST) its form, decoded.
pub(crate) struct Asked {
    pub(crate) method: Method,
    pub(crate) path: Vec<String>,
    /// The path and query as asked (for the login form to return to).
    pub(crate) target: String,
    pub(crate) query: Fields,
    pub(crate) form: Fields,
    pub(crate) remote: SocketAddr,
}

/// Decoded `name=value` pairs, in order (a name may repeat).
#[derive(Default)]
pub(crate) struct Fields(Vec<(String, String)>);

impl Fields {
    fn parse(text: &[u8]) -> Self {
        Fields(
            form_urlencoded::parse(text)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    /// The first value of `name`, trimmed, if not empty.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// Every value of `name`, in order.
    pub(crate) fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// What a page answers.
pub(crate) enum Answer {
    Page(StatusCode, Markup),
    /// A part of a page (the overview's refresh).
    Fragment(Markup),
    Redirect(String),
    /// A cookie to set (a session given, or ended), and on to `to`.
    SetCookie {
        cookie: String,
        to: String,
    },
    Asset(&'static str, &'static str),
}

/// The longest form a POST may send.
const MAX_FORM_BYTES: usize = 64 * 1024;

/// How long a POST may take to send its form.
const FORM_TIMEOUT: Duration = Duration::from_secs(10);

async fn handle(
    console: &Console,
    remote: SocketAddr,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let path: Vec<String> = parts
        .uri
        .path()
        .split('/')
        .filter(|s| !s.is_empty())
        .map(percent_decode)
        .collect();
    let query = Fields::parse(parts.uri.query().unwrap_or("").as_bytes());
    let mut asked = Asked {
        method: parts.method.clone(),
        path,
        target: parts
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |pq| pq.as_str().to_owned()),
        query,
        form: Fields::default(),
        remote,
    };
    // The stylesheet and script hold nothing: served to anyone.
    if asked.method == Method::GET && asked.path.first().map(String::as_str) == Some("assets") {
        return respond(pages::asset(&asked.path));
    }
    // Credentials first: a request without them is answered before its
    // body is read (nobody unknown makes the console read 64 KiB, or wait
    // 10 s for it).
    if let Err(refused) = console.guard.check_headers(&parts.headers, &asked) {
        return respond(refused.answer(console, &asked));
    }
    if asked.method == Method::POST {
        // A client that sends its form slowly is not waited for long.
        let read = tokio::time::timeout(FORM_TIMEOUT, Limited::new(body, MAX_FORM_BYTES).collect());
        match read.await {
            Ok(Ok(collected)) => asked.form = Fields::parse(&collected.to_bytes()),
            Ok(Err(_)) | Err(_) => {
                return respond(Answer::Page(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    pages::message(
                        console,
                        "Refused",
                        "The form is larger than 64 KiB, or took over 10 seconds to arrive.",
                    ),
                ));
            }
        }
    }
    let answer = match console.guard.check(&parts.headers, &asked) {
        Err(refused) => refused.answer(console, &asked),
        Ok(guard::Admitted::Login(answer)) => answer,
        Ok(guard::Admitted::Yes) => route(console, &asked).await,
    };
    respond(answer)
}

/// Decodes `%XX` in a path segment (a topic name needs none; a browser may
/// send them anyway).
fn percent_decode(segment: &str) -> String {
    form_urlencoded::parse(format!("x={}", segment.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

async fn route(console: &Console, asked: &Asked) -> Answer {
    let path: Vec<&str> = asked.path.iter().map(String::as_str).collect();
    let get = asked.method == Method::GET;
    let post = asked.method == Method::POST;
    if post && console.read_only {
        return Answer::Page(
            StatusCode::FORBIDDEN,
            pages::message(
                console,
                "Read-only",
                "This console was started with --read-only: it changes nothing.",
            ),
        );
    }
    match (path.as_slice(), get, post) {
        ([], true, _) => overview::page(console, asked).await,
        (["dlq"], true, _) => reading::topics(console, asked).await,
        (["dlq", topic], true, _) => reading::topic(console, topic, asked).await,
        (["dlq", topic, "replay"], _, true) => replay::replay(console, topic, asked).await,
        (["dlq", topic, partition, offset], true, _) => match (partition.parse(), offset.parse()) {
            (Ok(p), Ok(o)) => reading::letter(console, topic, p, o, asked).await,
            _ => not_found(console),
        },
        (["claims"], true, _) => pages::claims(console, asked).await,
        (["claims", "release"], _, true) => pages::release(console, asked).await,
        (["outbox"], true, _) => pages::outbox(console).await,
        _ if !get && !post => Answer::Page(
            StatusCode::METHOD_NOT_ALLOWED,
            pages::message(
                console,
                "Not allowed",
                "Pages answer GET; changes are POSTs.",
            ),
        ),
        _ => not_found(console),
    }
}

fn not_found(console: &Console) -> Answer {
    Answer::Page(
        StatusCode::NOT_FOUND,
        pages::message(
            console,
            "Not found",
            "No page here: start from the overview.",
        ),
    )
}

/// Headers every answer carries: nothing cached, nothing framed, no script
/// or style but the console's own.
fn respond(answer: Answer) -> Response<Full<Bytes>> {
    const HTML: &str = "text/html; charset=utf-8";
    let (status, content_type, body, location, cookie) = match answer {
        Answer::Page(status, markup) => (status, HTML, markup.into_string(), None, None),
        Answer::Fragment(markup) => (StatusCode::OK, HTML, markup.into_string(), None, None),
        Answer::Redirect(to) => (StatusCode::SEE_OTHER, HTML, String::new(), Some(to), None),
        Answer::SetCookie { cookie, to } => (
            StatusCode::SEE_OTHER,
            HTML,
            String::new(),
            Some(to),
            Some(cookie),
        ),
        Answer::Asset(content_type, text) => {
            (StatusCode::OK, content_type, text.to_owned(), None, None)
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             frame-ancestors 'none'; form-action 'self'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    if let Some(cookie) = cookie
        && let Ok(value) = HeaderValue::from_str(&cookie)
    {
        headers.insert(header::SET_COOKIE, value);
    }
    if let Some(to) = location
        && let Ok(value) = HeaderValue::from_str(&to)
    {
        headers.insert(header::LOCATION, value);
    }
    response
}

/// Logs a change the console made, with who asked.
pub(crate) fn log_action(asked: &Asked, what: &str) {
    log(&asked.path.join("/"), asked.remote, what);
}

/// Logs what a request to `path` from `remote` did.
pub(crate) fn log(path: &str, remote: SocketAddr, what: &str) {
    eprintln!(
        "dedup console: {} {path} from {remote}: {what}",
        crate::time::rfc3339(std::time::SystemTime::now()),
    );
}

/// Runs blocking Kafka work off the server's threads.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Failure::new(format!("the work failed: {e}")))?
}

/// The database's pages' tables, if a database was given.
impl Console {
    pub(crate) fn db(&self) -> Option<&Database> {
        self.db.as_ref()
    }

    pub(crate) fn kafka(&self) -> &KafkaArgs {
        &self.kafka
    }

    pub(crate) fn read_only(&self) -> bool {
        self.read_only
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    pub(crate) fn outbox_table(&self) -> &str {
        &self.outbox_table
    }

    pub(crate) fn metrics(&self) -> &[String] {
        &self.metrics
    }

    pub(crate) fn scrapes(&self) -> &overview::Scrapes {
        &self.scrapes
    }

    pub(crate) fn csrf(&self) -> &str {
        self.guard.csrf()
    }

    /// Whether pages need the token (and a session can be ended).
    pub(crate) fn needs_token(&self) -> bool {
        self.guard.needs_token()
    }

    pub(crate) fn replaying(&self) -> &Arc<tokio::sync::Mutex<()>> {
        &self.replaying
    }
}
