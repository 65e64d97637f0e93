//! SASL OAUTHBEARER tokens from code: a [`TokenProvider`] (OIDC client
//! credentials, a cloud's IAM, a file a sidecar renews) that every client of
//! a runtime or relay asks for its token. One keeper per process part runs
//! the provider on a thread of its own (so a token can be had before the
//! application's runtime polls anything, and a slow provider never stalls
//! the consumer's loop): it fetches the first token at once, the next one
//! when 60% of the current one's life has passed or when librdkafka asks,
//! and on failure tries again with a growing wait (1 s to 30 s). A failure
//! is an outage, never a message's fault: it is logged, counted
//! (`dedup_oauth_token_failures_total`), shown by
//! `dedup_oauth_token_expiry_seconds`, and waited out; connections made
//! with the last token go on until the brokers' re-authentication asks for
//! a new one. A provider that panics or hangs (30 s) counts as a failure.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime};

/// How long a provider's call may take before it counts as failed (2 s in
/// the unit tests, which hang one).
const CALL_TIMEOUT: Duration = Duration::from_secs(if cfg!(test) { 2 } else { 30 });
/// How long a client's first request for a token waits for the keeper's
/// first token (later requests never wait: the last token, or a failure).
const FIRST_TOKEN_WAIT: Duration = Duration::from_secs(10);
/// The longest wait between failed calls.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A token for SASL OAUTHBEARER: what the brokers check, the principal it
/// names, and when it expires. `Debug` never shows the token.
#[derive(Clone)]
pub struct OAuthToken {
    token: String,
    principal: String,
    expires_at: SystemTime,
}

impl OAuthToken {
    /// `token` (a JWT, as the brokers' validator expects) for `principal`,
    /// valid until `expires_at`.
    pub fn new(
        token: impl Into<String>,
        principal: impl Into<String>,
        expires_at: SystemTime,
    ) -> Self {
        OAuthToken {
            token: token.into(),
            principal: principal.into(),
            expires_at,
        }
    }

    /// The principal the token names.
    pub fn principal(&self) -> &str {
        &self.principal
    }

    /// When the token expires.
    pub fn expires_at(&self) -> SystemTime {
        self.expires_at
    }

    /// Why the token cannot be given to librdkafka, if it cannot.
    fn invalid(&self) -> Option<&'static str> {
        if self.token.is_empty() {
            Some("the token is empty")
        } else if self.principal.is_empty() {
            Some("the principal is empty")
        } else if self.token.contains('\0') || self.principal.contains('\0') {
            Some("the token or principal holds a NUL character")
        } else if self.expires_at <= SystemTime::now() {
            Some("the token has already expired")
        } else {
            None
        }
    }
}

impl fmt::Debug for OAuthToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OAuthToken")
            .field("token", &"***")
            .field("principal", &self.principal)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// Why a provider has no token. Its text is logged: it must hold no
/// secret. Either way the keeper tries again; a refusal also stops a
/// runtime's start with the reason, as a wrong password does.
#[derive(Debug, Clone)]
pub struct TokenError {
    why: String,
    refused: bool,
}

impl TokenError {
    /// The provider could not get a token this time (the endpoint is down,
    /// slow, answering 5xx or nonsense): an outage, waited out.
    pub fn new(why: impl fmt::Display) -> Self {
        TokenError {
            why: why.to_string(),
            refused: false,
        }
    }

    /// The identity provider refused the provider's own credentials (an
    /// unknown client, a wrong secret, a scope it may not have): a
    /// configuration error, which stops a runtime's start with this reason.
    pub fn refused(why: impl fmt::Display) -> Self {
        TokenError {
            why: why.to_string(),
            refused: true,
        }
    }

    /// Whether the credentials were refused.
    pub fn is_refused(&self) -> bool {
        self.refused
    }
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.refused {
            write!(f, "{REFUSED}: {}", self.why)
        } else {
            f.write_str(&self.why)
        }
    }
}

impl std::error::Error for TokenError {}

/// A token's future, as a provider returns it.
pub type TokenFuture<'a> =
    Pin<Box<dyn Future<Output = Result<OAuthToken, TokenError>> + Send + 'a>>;

/// Where the clients' OAUTHBEARER tokens come from. Called on a thread of
/// its own, with a Tokio runtime (timers and I/O) of its own, at start,
/// before each token expires and whenever librdkafka asks for a new one.
/// An async closure returning `Result<OAuthToken, TokenError>` is one.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use dedup_kafka::{OAuthToken, TokenError};
///
/// async fn from_my_identity_provider() -> Result<OAuthToken, TokenError> {
///     // ... ask the token endpoint, read the JWT's expiry ...
///     let jwt = "eyJhbGciOi...".to_owned();
///     Ok(OAuthToken::new(jwt, "my-service", SystemTime::now() + Duration::from_secs(3600)))
/// }
///
/// # fn with<S: dedup_core::OutboxSource>(builder: dedup_kafka::RelayBuilder<S>) {
/// let builder = builder
///     .set("security.protocol", "SASL_SSL")
///     .set("sasl.mechanisms", "OAUTHBEARER")
///     .oauth_token_provider(from_my_identity_provider);
/// # }
/// ```
pub trait TokenProvider: Send + Sync + 'static {
    /// A new token.
    fn token(&self) -> TokenFuture<'_>;
}

impl<F, Fut> TokenProvider for F
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<OAuthToken, TokenError>> + Send + 'static,
{
    fn token(&self) -> TokenFuture<'_> {
        Box::pin(self())
    }
}

/// What the keeper knows.
#[derive(Default)]
struct State {
    token: Option<OAuthToken>,
    /// When the current token was had: its refresh is due at 60% of the
    /// time from here to its expiry.
    fetched_at: Option<SystemTime>,
    last_error: Option<String>,
    /// A client asked for a new token.
    asked: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a token arrives or a client asks.
    changed: Condvar,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The tokens of one runtime's (or relay's) clients, kept fresh by a
/// keeper thread that ends when the last handle goes. The runtime holds
/// it; its clients find it through their `sasl.oauthbearer.config`
/// ([`Tokens::setting`]), which librdkafka hands to their contexts with
/// each request for a token.
#[derive(Clone)]
pub(crate) struct Tokens(Arc<Shared>, u64);

/// The keepers of this process, by number.
static KEEPERS: Mutex<Vec<(u64, Weak<Shared>)>> = Mutex::new(Vec::new());

/// What a client says when the provider has no token for it: an outage
/// (the start-up check waits it out rather than calling it a refusal).
pub(crate) const NO_TOKEN: &str = "no OAUTHBEARER token from the token provider";

/// How a refused provider's error begins: the start-up check stops the
/// start on it.
pub(crate) const REFUSED: &str = "the identity provider refused the credentials";

/// The prefix of the `sasl.oauthbearer.config` that names a keeper.
const SETTING_PREFIX: &str = "dedup.token.provider=";

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tokens(..)")
    }
}

impl Tokens {
    /// Starts the keeper of `provider`'s tokens.
    pub(crate) fn start(provider: Arc<dyn TokenProvider>) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            changed: Condvar::new(),
        });
        let weak = Arc::downgrade(&shared);
        let number = {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        };
        {
            let mut keepers = KEEPERS.lock().unwrap_or_else(|p| p.into_inner());
            keepers.retain(|(_, k)| k.strong_count() > 0);
            keepers.push((number, weak.clone()));
        }
        std::thread::Builder::new()
            .name("dedup-oauth".into())
            .spawn(move || keep(weak, provider))?;
        Ok(Tokens(shared, number))
    }

    /// The `sasl.oauthbearer.config` value by which the clients find
    /// these tokens.
    pub(crate) fn setting(&self) -> String {
        format!("{SETTING_PREFIX}{}", self.1)
    }

    /// The tokens a client's `sasl.oauthbearer.config` names, while they
    /// are kept.
    fn named(config: &str) -> Option<Tokens> {
        let number: u64 = config.strip_prefix(SETTING_PREFIX)?.parse().ok()?;
        let keepers = KEEPERS.lock().unwrap_or_else(|p| p.into_inner());
        let (_, weak) = keepers.iter().find(|(n, _)| *n == number)?;
        Some(Tokens(weak.upgrade()?, number))
    }

    /// The token to give librdkafka now: the current one (asking the keeper
    /// for the next when it is due); the first time, waiting up to 10 s for
    /// it; else why there is none.
    pub(crate) fn current(&self) -> Result<OAuthToken, String> {
        let mut state = self.0.state();
        if state.token.is_none() && state.last_error.is_none() {
            state = self
                .0
                .changed
                .wait_timeout_while(state, FIRST_TOKEN_WAIT, |s| {
                    s.token.is_none() && s.last_error.is_none()
                })
                .map(|(s, _)| s)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        let now = SystemTime::now();
        match state.token.clone() {
            Some(token) if token.expires_at > now => {
                // librdkafka asks at 80% of the token's life: a new one,
                // unless the keeper just fetched it.
                if refresh_due(state.fetched_at, token.expires_at, now, 0.5) {
                    state.asked = true;
                    self.0.changed.notify_all();
                }
                Ok(token)
            }
            _ => {
                state.asked = true;
                self.0.changed.notify_all();
                Err(format!(
                    "{NO_TOKEN}: {}",
                    state.last_error.as_deref().unwrap_or("none yet")
                ))
            }
        }
    }
}

/// Whether `fraction` of the time from `fetched_at` to `expires_at` has
/// passed at `now`.
fn refresh_due(
    fetched_at: Option<SystemTime>,
    expires_at: SystemTime,
    now: SystemTime,
    fraction: f64,
) -> bool {
    let Some(fetched_at) = fetched_at else {
        return true;
    };
    let life = expires_at.duration_since(fetched_at).unwrap_or_default();
    now.duration_since(fetched_at).unwrap_or_default() >= life.mul_f64(fraction)
}

/// The keeper's thread: calls the provider until the last handle goes.
fn keep(weak: Weak<Shared>, provider: Arc<dyn TokenProvider>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            if let Some(shared) = weak.upgrade() {
                shared.state().last_error = Some(format!("cannot start its runtime: {e}"));
                shared.changed.notify_all();
            }
            return;
        }
    };
    let mut backoff = Duration::from_secs(1);
    let mut failures_in_a_row = 0u32;
    loop {
        if weak.strong_count() == 0 {
            return;
        }
        let called = {
            let provider = provider.clone();
            runtime.block_on(async move {
                let mut call = tokio::spawn(async move { provider.token().await });
                match tokio::time::timeout(CALL_TIMEOUT, &mut call).await {
                    Err(_) => {
                        call.abort();
                        Err(format!(
                            "the token provider did not answer in {CALL_TIMEOUT:?}"
                        ))
                    }
                    Ok(Err(join)) if join.is_panic() => {
                        Err("the token provider panicked".to_owned())
                    }
                    Ok(Err(join)) => Err(format!("the token provider's call failed: {join}")),
                    Ok(Ok(Err(e))) => Err(e.to_string()),
                    Ok(Ok(Ok(token))) => match token.invalid() {
                        Some(why) => Err(format!("the token provider's token is unusable: {why}")),
                        None => Ok(token),
                    },
                }
            })
        };
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let next = match called {
            Ok(token) => {
                if failures_in_a_row > 0 {
                    tracing::info!(
                        failures = failures_in_a_row,
                        "the token provider answers again"
                    );
                }
                failures_in_a_row = 0;
                backoff = Duration::from_secs(1);
                let expires_at = token.expires_at;
                metrics::gauge!("dedup_oauth_token_expiry_seconds").set(
                    expires_at
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs_f64(),
                );
                let now = SystemTime::now();
                let mut state = shared.state();
                state.token = Some(token);
                state.fetched_at = Some(now);
                state.last_error = None;
                state.asked = false;
                shared.changed.notify_all();
                // At 60% of its life (at least 1 s from now).
                expires_at
                    .duration_since(now)
                    .unwrap_or_default()
                    .mul_f64(0.6)
                    .max(Duration::from_secs(1))
            }
            Err(why) => {
                metrics::counter!("dedup_oauth_token_failures_total").increment(1);
                failures_in_a_row += 1;
                // The first failure of a run and then one line a minute or so.
                if failures_in_a_row == 1 || failures_in_a_row.is_multiple_of(10) {
                    tracing::warn!(
                        error = %why,
                        failures = failures_in_a_row,
                        "no OAUTHBEARER token; trying again (the clients keep the last token \
                         until it expires)"
                    );
                }
                let mut state = shared.state();
                state.last_error = Some(why);
                state.asked = false;
                shared.changed.notify_all();
                let wait = backoff;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                wait
            }
        };
        // Until the next call is due or a client asks; a second at a time,
        // so that the thread ends soon after the last handle.
        let due = std::time::Instant::now() + next;
        drop(shared);
        loop {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            let now = std::time::Instant::now();
            if now >= due {
                break;
            }
            let state = shared.state();
            if state.asked {
                break;
            }
            let (state, _) = shared
                .changed
                .wait_timeout(state, (due - now).min(Duration::from_secs(1)))
                .unwrap_or_else(|p| p.into_inner());
            if state.asked {
                break;
            }
        }
    }
}

/// librdkafka's token for a client whose `sasl.oauthbearer.config` is
/// `config` (for a client context's `generate_oauth_token`). librdkafka
/// asks only when OAUTHBEARER is on without its own token settings
/// (`enable.sasl.oauthbearer.unsecure.jwt`, `sasl.oauthbearer.method=oidc`).
pub(crate) fn generate(
    config: Option<&str>,
) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
    let Some(tokens) = config.and_then(Tokens::named) else {
        return Err(
            "sasl.mechanisms=OAUTHBEARER needs a token: give the builder \
             .oauth_token_provider(..), or the dedup CLI --oidc-token-endpoint (this build's \
             librdkafka has no OIDC client of its own)"
                .into(),
        );
    };
    let token = tokens.current()?;
    let lifetime_ms = token
        .expires_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    Ok(rdkafka::client::OAuthToken {
        token: token.token,
        principal_name: token.principal,
        lifetime_ms: i64::try_from(lifetime_ms).unwrap_or(i64::MAX),
    })
}

/// Whether clients made from `config` take their tokens from a provider's
/// keeper.
pub(crate) fn from_provider(config: &rdkafka::ClientConfig) -> bool {
    config
        .get("sasl.oauthbearer.config")
        .is_some_and(|v| v.starts_with(SETTING_PREFIX))
}

/// Gives a client that is never polled otherwise (a probe that only asks
/// for metadata or watermarks) its token: librdkafka asks for one as the
/// client is made (first in its queue), and only a poll answers; what else
/// is queued is served too. Blocking (at most the first token's wait):
/// call it off the async workers.
pub(crate) fn take_token<C: rdkafka::consumer::ConsumerContext>(
    client: &rdkafka::consumer::BaseConsumer<C>,
) {
    for _ in 0..16 {
        if client.poll(Duration::ZERO).is_none() {
            return;
        }
    }
}

/// The context of a runtime's clients other than its consumer, and of
/// clients made with a [`TokenKeeper`](crate::TokenKeeper): librdkafka's default behaviour, and
/// OAUTHBEARER tokens from the provider their `sasl.oauthbearer.config`
/// names.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenContext;

/// Inside an `impl rdkafka::ClientContext`: the client's OAUTHBEARER tokens
/// come from the runtime's provider ([`generate`]).
macro_rules! tokens_from_the_provider {
    () => {
        const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

        fn generate_oauth_token(
            &self,
            config: Option<&str>,
        ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
            crate::oauth::generate(config)
        }
    };
}
pub(crate) use tokens_from_the_provider;

impl rdkafka::ClientContext for TokenContext {
    tokens_from_the_provider!();
}

impl rdkafka::consumer::ConsumerContext for TokenContext {}

/// What the builders keep of a token provider, and start at `build()`.
#[derive(Clone, Default)]
pub(crate) struct ProviderSetting(Option<Arc<dyn TokenProvider>>);

impl fmt::Debug for ProviderSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Some(..)" } else { "None" })
    }
}

impl ProviderSetting {
    pub(crate) fn set(&mut self, provider: impl TokenProvider) {
        self.0 = Some(Arc::new(provider));
    }

    /// Starts the provider's keeper, if one is set, and adds the setting by
    /// which every client finds its tokens to `settings` (refusing a
    /// `sasl.oauthbearer.config` of the user's own beside a provider).
    pub(crate) fn start(
        &self,
        settings: &mut Vec<(String, String)>,
    ) -> Result<Option<Tokens>, crate::Error> {
        let Some(provider) = &self.0 else {
            return Ok(None);
        };
        if settings.iter().any(|(k, _)| k == "sasl.oauthbearer.config") {
            return Err(crate::Error::Config(
                "sasl.oauthbearer.config is set beside a token provider: the provider gives \
                 the tokens; remove the setting"
                    .into(),
            ));
        }
        let tokens = Tokens::start(provider.clone())
            .map_err(|e| crate::Error::Config(format!("cannot start the token provider: {e}")))?;
        settings.push(("sasl.oauthbearer.config".into(), tokens.setting()));
        Ok(Some(tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Why `generate` gave no token.
    fn refused(config: Option<&str>) -> String {
        match generate(config) {
            Ok(_) => panic!("a token"),
            Err(e) => e.to_string(),
        }
    }

    fn in_secs(s: u64) -> SystemTime {
        SystemTime::now() + Duration::from_secs(s)
    }

    #[test]
    fn debug_never_shows_the_token() {
        let token = OAuthToken::new("secret-jwt", "svc", in_secs(60));
        let shown = format!("{token:?}");
        assert!(!shown.contains("secret-jwt"), "{shown}");
        assert!(shown.contains("svc"), "{shown}");
    }

    #[test]
    fn the_first_token_is_waited_for_then_served() {
        let tokens = Tokens::start(Arc::new(|| async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok(OAuthToken::new("t1", "svc", in_secs(3600)))
        }))
        .expect("keeper");
        let token = generate(Some(&tokens.setting())).expect("a token");
        assert_eq!(token.token, "t1");
        assert_eq!(token.principal_name, "svc");
    }

    #[test]
    fn a_failing_panicking_or_unusable_provider_is_an_error_naming_why() {
        let tokens = Tokens::start(Arc::new(|| async {
            Err::<OAuthToken, _>(TokenError::new("endpoint said 503"))
        }))
        .expect("keeper");
        let why = refused(Some(&tokens.setting()));
        assert!(why.contains("endpoint said 503"), "{why}");

        let tokens = Tokens::start(Arc::new(|| async {
            if SystemTime::now() > SystemTime::UNIX_EPOCH {
                panic!("provider bug");
            }
            Ok(OAuthToken::new("t", "svc", in_secs(60)))
        }))
        .expect("keeper");
        let why = refused(Some(&tokens.setting()));
        assert!(why.contains("panicked"), "{why}");

        let tokens = Tokens::start(Arc::new(|| async {
            Ok(OAuthToken::new(
                "t",
                "svc",
                SystemTime::now() - Duration::from_secs(1),
            ))
        }))
        .expect("keeper");
        let why = refused(Some(&tokens.setting()));
        assert!(why.contains("already expired"), "{why}");

        // One that never answers: a failure once its call times out.
        let tokens = Tokens::start(Arc::new(std::future::pending)).expect("keeper");
        let why = refused(Some(&tokens.setting()));
        assert!(why.contains("did not answer in 2s"), "{why}");

        let why = refused(None);
        assert!(why.contains("oauth_token_provider"), "{why}");
        let why = refused(Some("principal=admin"));
        assert!(why.contains("oauth_token_provider"), "{why}");
    }

    /// Tokens of 2 s: the keeper fetches the next at 60% of each one's
    /// life, so the token served is always valid.
    #[test]
    fn short_tokens_are_renewed_before_they_expire() {
        let calls = Arc::new(AtomicU32::new(0));
        let counted = calls.clone();
        let tokens = Tokens::start(Arc::new(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                Ok(OAuthToken::new(
                    format!("t{n}"),
                    "svc",
                    SystemTime::now() + Duration::from_secs(2),
                ))
            }
        }))
        .expect("keeper");
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(5) {
            let token = generate(Some(&tokens.setting())).expect("always a token");
            let expires = SystemTime::UNIX_EPOCH + Duration::from_millis(token.lifetime_ms as u64);
            assert!(expires > SystemTime::now(), "an expired token was served");
            std::thread::sleep(Duration::from_millis(100));
        }
        let n = calls.load(Ordering::SeqCst);
        assert!((3..=12).contains(&n), "{n} calls in 5 s");
    }

    #[test]
    fn the_keeper_ends_with_the_last_handle() {
        let calls = Arc::new(AtomicU32::new(0));
        let counted = calls.clone();
        let tokens = Tokens::start(Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async {
                Ok(OAuthToken::new(
                    "t",
                    "svc",
                    SystemTime::now() + Duration::from_millis(1500),
                ))
            }
        }))
        .expect("keeper");
        let setting = tokens.setting();
        generate(Some(&setting)).expect("a token");
        drop(tokens);
        // The keeper notices within a second.
        std::thread::sleep(Duration::from_millis(1500));
        assert!(
            generate(Some(&setting)).is_err(),
            "found after the last handle went"
        );
        let after_drop = calls.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_secs(3));
        assert_eq!(calls.load(Ordering::SeqCst), after_drop, "still calling");
    }
}
