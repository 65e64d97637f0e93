//! Who may see the console and change things through it.
//!
//! On a loopback address anyone on the machine may (as with the operator
//! tool itself), but only through a loopback `Host`, so that a web page
//! elsewhere cannot read it by pointing a name of its own at 127.0.0.1.
//! On any other address, every request needs the token: as
//! `Authorization: Bearer <token>` (scripts) or a session cookie given by
//! the login form (browsers), over TLS (served here, or by a proxy in
//! front). Sessions expire after 8 hours and end at `/logout`; an address
//! that sends 5 wrong tokens in a minute is refused until the minute is
//! over. A request's credentials are checked before its body is read.
//! Every POST needs the page's CSRF token and, where the browser names it,
//! the console's own origin.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cookie::{Cookie, SameSite};
use hyper::header::{self, HeaderMap};
use hyper::{Method, StatusCode};
use subtle::ConstantTimeEq as _;

use super::{Answer, Asked, Console, pages};
use crate::Failure;

/// The session cookie's name.
const COOKIE: &str = "dedup_console";

/// The shortest token accepted: guessing one must be hopeless.
const MIN_TOKEN: usize = 16;

/// How long a session lasts from its sign-in.
const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);

/// Sessions kept at most: a new one beyond ends the one nearest its end.
const MAX_SESSIONS: usize = 1000;

/// Wrong tokens an address may send in [`FAILURE_WINDOW`].
const MAX_FAILURES: u32 = 5;

/// The window wrong tokens are counted in.
const FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// Addresses whose wrong tokens are remembered at most.
const MAX_TRACKED: usize = 10_000;

/// How the pages travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// Plain HTTP: loopback only.
    Plain,
    /// HTTPS, served here (`--tls-cert`, `--tls-key`).
    Tls,
    /// Plain HTTP to a proxy in front that adds TLS (`--behind-tls-proxy`).
    Proxy,
}

pub(crate) struct Guard {
    /// Required on a non-loopback address.
    token: Option<String>,
    transport: Transport,
    /// Live sessions, by their cookie's value: when each ends.
    sessions: Mutex<HashMap<String, Instant>>,
    /// Wrong tokens per address: how many, since when.
    failures: Mutex<HashMap<IpAddr, (u32, Instant)>>,
    /// The forms' CSRF token (new each start).
    csrf: String,
}

/// Why a request is refused.
pub(crate) enum Refused {
    /// No token or session: the login form.
    NoToken,
    /// A token that is not the console's.
    WrongToken,
    /// A POST without the page's CSRF token, or from another origin.
    Forgery,
    /// A loopback console asked through a name that is not loopback.
    Host,
    /// Too many wrong tokens from this address lately.
    TooMany,
}

/// What a request that passes may do.
pub(crate) enum Admitted {
    Yes,
    /// The login form, or its answer.
    Login(Answer),
}

/// Random text no one can guess: two v4 UUIDs (244 random bits).
fn secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Compares secrets in time that does not depend on where they differ.
fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

impl Guard {
    pub(crate) fn new(
        listen: SocketAddr,
        token: Option<String>,
        transport: Transport,
    ) -> Result<Self, Failure> {
        if let Some(token) = &token
            && token.chars().count() < MIN_TOKEN
        {
            return Err(Failure::new(format!(
                "DEDUP_CONSOLE_TOKEN is shorter than {MIN_TOKEN} characters: use a long random \
                 one (openssl rand -hex 32)"
            )));
        }
        if !listen.ip().is_loopback() && token.is_none() {
            return Err(Failure::new(format!(
                "--listen {listen} is reachable from other machines: set DEDUP_CONSOLE_TOKEN (a \
                 long random secret) in the environment, or listen on 127.0.0.1"
            )));
        }
        if transport == Transport::Proxy && token.is_none() {
            return Err(Failure::new(
                "--behind-tls-proxy: a proxy forwards anyone who reaches it, so the console needs \
                 DEDUP_CONSOLE_TOKEN (a long random secret) in the environment",
            ));
        }
        if !listen.ip().is_loopback() && transport == Transport::Plain {
            return Err(Failure::new(format!(
                "--listen {listen} is reachable from other machines, and the token and the \
                 session cookie would cross the network in clear: serve HTTPS (--tls-cert and \
                 --tls-key), or, behind a proxy that adds TLS, say so with --behind-tls-proxy"
            )));
        }
        Ok(Guard {
            token,
            transport,
            sessions: Mutex::default(),
            failures: Mutex::default(),
            csrf: secret(),
        })
    }

    pub(crate) fn needs_token(&self) -> bool {
        self.token.is_some()
    }

    pub(crate) fn csrf(&self) -> &str {
        &self.csrf
    }

    /// What can be checked before a request's body is read: its `Host`,
    /// its `Origin`, and (but for the login form) its token or session. A
    /// request that fails here is answered without reading its body.
    pub(crate) fn check_headers(&self, headers: &HeaderMap, asked: &Asked) -> Result<(), Refused> {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if self.token.is_none() && !loopback_host(host) {
            return Err(Refused::Host);
        }
        if asked.method == Method::POST {
            // A browser names the page a form was sent from; it must be
            // ours (served directly, or through a proxy that added TLS).
            if let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok())
                && origin != format!("http://{host}")
                && origin != format!("https://{host}")
            {
                return Err(Refused::Forgery);
            }
        }
        match &self.token {
            Some(token) if !is_page(asked, "login") => {
                // A bearer token is a sign-in of its own: limited as the
                // form's are.
                let bearer = headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "));
                if let Some(given) = bearer {
                    let ip = asked.remote.ip();
                    if self.too_many(ip) {
                        return Err(Refused::TooMany);
                    }
                    if same(given.trim(), token) {
                        return Ok(());
                    }
                    self.failed(ip);
                    console_log_refusal(asked);
                }
                if self.session(headers).is_none() {
                    return Err(Refused::NoToken);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The whole check, the form read: [`check_headers`](Self::check_headers),
    /// then the login form's token, a POST's CSRF token, a sign-out.
    pub(crate) fn check(&self, headers: &HeaderMap, asked: &Asked) -> Result<Admitted, Refused> {
        self.check_headers(headers, asked)?;
        let login = is_page(asked, "login");
        let Some(token) = &self.token else {
            return self.forms(asked, login).map(|()| Admitted::Yes);
        };
        if login {
            return Ok(Admitted::Login(self.login(token, headers, asked)?));
        }
        self.forms(asked, false)?;
        if is_page(asked, "logout") && asked.method == Method::POST {
            if let Some(session) = self.session(headers) {
                self.sessions().remove(&session);
            }
            let ended = Cookie::build((COOKIE, ""))
                .http_only(true)
                .same_site(SameSite::Strict)
                .path("/")
                .secure(self.secure(headers))
                .max_age(cookie::time::Duration::ZERO);
            return Ok(Admitted::Login(Answer::SetCookie {
                cookie: ended.to_string(),
                to: "/login".to_owned(),
            }));
        }
        Ok(Admitted::Yes)
    }

    /// The live sessions.
    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live session the request's cookie names, if any (compared in
    /// constant time; ended ones are dropped on the way).
    fn session(&self, headers: &HeaderMap) -> Option<String> {
        let given: Vec<String> = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(Cookie::split_parse)
            .filter_map(Result::ok)
            .filter(|c| c.name() == COOKIE)
            // A browser sends one; a request stuffed with thousands does
            // not make every one compared with every session.
            .take(4)
            .map(|c| c.value().to_owned())
            .collect();
        if given.is_empty() {
            return None;
        }
        let now = Instant::now();
        let mut sessions = self.sessions();
        sessions.retain(|_, ends| *ends > now);
        sessions
            .keys()
            .find(|live| given.iter().any(|g| same(g, live)))
            .cloned()
    }

    /// A new session, ending [`SESSION_LIFETIME`] from now.
    fn open_session(&self) -> String {
        let id = secret();
        let now = Instant::now();
        let mut sessions = self.sessions();
        sessions.retain(|_, ends| *ends > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(nearest) = sessions
                .iter()
                .min_by_key(|(_, ends)| **ends)
                .map(|(id, _)| id.clone())
        {
            sessions.remove(&nearest);
        }
        sessions.insert(id.clone(), now + SESSION_LIFETIME);
        id
    }

    /// Whether cookies travel over TLS only: the pages do (served here,
    /// or through a proxy that says so: `X-Forwarded-Proto`, or the
    /// browser's `Origin`).
    fn secure(&self, headers: &HeaderMap) -> bool {
        self.transport == Transport::Tls
            || headers
                .get("x-forwarded-proto")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.eq_ignore_ascii_case("https"))
            || headers
                .get(header::ORIGIN)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("https://"))
    }

    /// Whether `ip` sent [`MAX_FAILURES`] wrong tokens within the window.
    fn too_many(&self, ip: IpAddr) -> bool {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let counted = |key: &IpAddr| {
            failures
                .get(key)
                .is_some_and(|(n, since)| *n >= MAX_FAILURES && since.elapsed() < FAILURE_WINDOW)
        };
        counted(&counted_as(ip)) || counted(&OVERFLOW)
    }

    /// Counts a wrong token from `ip` (an IPv6 address by its /64: one
    /// host holds a whole /64). With [`MAX_TRACKED`] addresses counted in
    /// the window already, a new one is counted with every other newcomer,
    /// in one shared count.
    fn failed(&self, ip: IpAddr) {
        let mut ip = counted_as(ip);
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if failures.len() >= MAX_TRACKED && !failures.contains_key(&ip) {
            failures.retain(|_, (_, since)| since.elapsed() < FAILURE_WINDOW);
        }
        if failures.len() >= MAX_TRACKED && !failures.contains_key(&ip) {
            ip = OVERFLOW;
        }
        let entry = failures.entry(ip).or_insert((0, Instant::now()));
        if entry.1.elapsed() >= FAILURE_WINDOW {
            *entry = (0, Instant::now());
        }
        entry.0 += 1;
    }

    /// A POST carries the page's CSRF token (the login form excepted: it
    /// holds the token itself).
    fn forms(&self, asked: &Asked, login: bool) -> Result<(), Refused> {
        if asked.method != Method::POST || login {
            return Ok(());
        }
        match asked.form.get("csrf") {
            Some(given) if same(given, &self.csrf) => Ok(()),
            _ => Err(Refused::Forgery),
        }
    }

    /// `/login`: the form, or a session for the right token; an address
    /// that sent too many wrong ones is refused for the rest of the minute,
    /// whatever it sends.
    fn login(&self, token: &str, headers: &HeaderMap, asked: &Asked) -> Result<Answer, Refused> {
        let next = next_page(asked);
        if asked.method != Method::POST {
            return Ok(Answer::Page(StatusCode::OK, pages::login(&next, None)));
        }
        let ip = asked.remote.ip();
        if self.too_many(ip) {
            return Err(Refused::TooMany);
        }
        match asked.form.get("token") {
            Some(given) if same(given, token) => {
                let session = self.open_session();
                let cookie = Cookie::build((COOKIE, session))
                    .http_only(true)
                    .same_site(SameSite::Strict)
                    .path("/")
                    .secure(self.secure(headers))
                    .max_age(cookie::time::Duration::seconds(
                        SESSION_LIFETIME.as_secs() as i64
                    ));
                Ok(Answer::SetCookie {
                    cookie: cookie.to_string(),
                    to: next,
                })
            }
            _ => {
                self.failed(ip);
                console_log_refusal(asked);
                Err(Refused::WrongToken)
            }
        }
    }
}

impl Refused {
    pub(crate) fn answer(&self, console: &Console, asked: &Asked) -> Answer {
        match self {
            Refused::NoToken => {
                let next = if is_local_path(&asked.target) {
                    asked.target.as_str()
                } else {
                    "/"
                };
                Answer::Page(StatusCode::UNAUTHORIZED, pages::login(next, None))
            }
            Refused::WrongToken => Answer::Page(
                StatusCode::UNAUTHORIZED,
                pages::login(&next_page(asked), Some("That is not the console's token.")),
            ),
            Refused::Forgery => Answer::Page(
                StatusCode::FORBIDDEN,
                pages::message(
                    console,
                    "Refused",
                    "This form did not come from this console's page (or the console restarted \
                     since the page was loaded): load the page again and resend.",
                ),
            ),
            Refused::TooMany => Answer::Page(
                StatusCode::TOO_MANY_REQUESTS,
                pages::login(
                    &next_page(asked),
                    Some("Too many wrong tokens from this address: wait a minute, then sign in."),
                ),
            ),
            Refused::Host => Answer::Page(
                StatusCode::FORBIDDEN,
                pages::message(
                    console,
                    "Refused",
                    "A console on a loopback address answers only to a loopback name \
                     (127.0.0.1, localhost, [::1]).",
                ),
            ),
        }
    }
}

/// Where wrong tokens from addresses beyond [`MAX_TRACKED`] are counted.
const OVERFLOW: IpAddr = IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

/// The address wrong tokens are counted under: an IPv4 address, or an IPv6
/// address's /64.
fn counted_as(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(std::net::Ipv6Addr::from(bits))
        }
        IpAddr::V6(v6) => IpAddr::V4(v6.to_ipv4_mapped().expect("mapped")),
        v4 => v4,
    }
}

/// Whether `asked` is the one-segment page `name` (`/login`, `/logout`).
fn is_page(asked: &Asked, name: &str) -> bool {
    asked.path.len() == 1 && asked.path[0] == name
}

/// A wrong token, on standard error with where it came from (never what
/// was sent).
fn console_log_refusal(asked: &Asked) {
    super::log("login", asked.remote, "wrong token refused");
}

/// Where the login form goes on to: a path of this console (never another
/// site's: `//host` is refused), else the overview.
fn next_page(asked: &Asked) -> String {
    asked
        .query
        .get("next")
        .or(asked.form.get("next"))
        .filter(|n| is_local_path(n))
        .unwrap_or("/")
        .to_owned()
}

/// A path of this console and nothing a browser could read as another
/// site: it starts with one `/`, and holds no backslash, whitespace or
/// control character (which browsers drop, making `/\t/evil` `//evil`).
fn is_local_path(path: &str) -> bool {
    path.starts_with('/')
        && !path.starts_with("//")
        && !path
            .chars()
            .any(|c| c == '\\' || c.is_whitespace() || c.is_control())
}

/// Whether a `Host` header names this machine's loopback.
fn loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_names_reach_a_console_without_a_token() {
        for host in [
            "127.0.0.1:9470",
            "localhost:9470",
            "[::1]:9470",
            "127.0.0.2",
            "LOCALHOST",
        ] {
            assert!(loopback_host(host), "{host}");
        }
        for host in [
            "evil.example:9470",
            "10.0.0.1:9470",
            "",
            "[::2]:1",
            "127.0.0.1.evil",
        ] {
            assert!(!loopback_host(host), "{host}");
        }
    }

    #[test]
    fn the_login_form_goes_on_only_to_the_consoles_own_pages() {
        for local in ["/", "/claims?scope=a&key=b", "/dlq/t.dlq"] {
            assert!(is_local_path(local), "{local}");
        }
        for elsewhere in [
            "//evil.example",
            "/\\evil.example",
            "/\t/evil.example",
            "https://evil.example",
            "/ /x",
            "evil",
            "/\u{7f}",
        ] {
            assert!(!is_local_path(elsewhere), "{elsewhere:?}");
        }
    }

    #[test]
    fn another_address_needs_a_long_token_and_tls() {
        let any: SocketAddr = "0.0.0.0:9470".parse().unwrap();
        let err = Guard::new(any, None, Transport::Tls)
            .err()
            .expect("refused");
        assert!(err.0.contains("DEDUP_CONSOLE_TOKEN"), "{err}");
        let err = Guard::new(any, Some("short".into()), Transport::Tls)
            .err()
            .expect("refused");
        assert!(err.0.contains("shorter"), "{err}");
        let err = Guard::new(any, Some("x".repeat(32)), Transport::Plain)
            .err()
            .expect("refused");
        assert!(
            err.0.contains("--tls-cert") && err.0.contains("--behind-tls-proxy"),
            "{err}"
        );
        assert!(Guard::new(any, Some("x".repeat(32)), Transport::Tls).is_ok());
        assert!(Guard::new(any, Some("x".repeat(32)), Transport::Proxy).is_ok());
        let loopback: SocketAddr = "127.0.0.1:9470".parse().unwrap();
        let err = Guard::new(loopback, None, Transport::Proxy)
            .err()
            .expect("a proxy forwards anyone");
        assert!(err.0.contains("DEDUP_CONSOLE_TOKEN"), "{err}");
        assert!(Guard::new("127.0.0.1:0".parse().unwrap(), None, Transport::Plain).is_ok());
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
    }

    fn asked(method: Method, path: &str, form: &str) -> Asked {
        asked_from(method, path, form, "10.0.0.9:5000")
    }

    fn asked_from(method: Method, path: &str, form: &str, remote: &str) -> Asked {
        Asked {
            method,
            path: path
                .split('/')
                .filter(|p| !p.is_empty())
                .map(str::to_owned)
                .collect(),
            target: path.to_owned(),
            query: super::super::Fields::default(),
            form: super::super::Fields::parse(form.as_bytes()),
            remote: remote.parse().unwrap(),
        }
    }

    /// A guard with a token behind a TLS proxy, and a browser's headers.
    fn behind_a_proxy() -> (Guard, String, HeaderMap) {
        let token = "t".repeat(32);
        let guard = Guard::new(
            "0.0.0.0:9470".parse().unwrap(),
            Some(token.clone()),
            Transport::Proxy,
        )
        .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, "console.example:9470".parse().unwrap());
        headers.insert("x-forwarded-proto", "https".parse().unwrap());
        (guard, token, headers)
    }

    /// Signs in with `token`; the session cookie's value.
    fn sign_in(guard: &Guard, headers: &HeaderMap, token: &str) -> Cookie<'static> {
        let login = asked(Method::POST, "/login", &format!("token={token}"));
        let Ok(Admitted::Login(Answer::SetCookie { cookie, .. })) = guard.check(headers, &login)
        else {
            panic!("the right token signs in");
        };
        Cookie::parse(cookie).expect("a Set-Cookie value")
    }

    /// The right token gives a session cookie (secure, for 8 hours) that a
    /// browser sends back among its others; a wrong one, a forged one or
    /// none is refused.
    #[test]
    fn a_session_is_given_for_the_token_and_found_among_other_cookies() {
        let (guard, token, mut headers) = behind_a_proxy();
        let parsed = sign_in(&guard, &headers, &token);
        assert_eq!(parsed.name(), COOKIE);
        assert_eq!(parsed.http_only(), Some(true));
        assert_eq!(parsed.same_site(), Some(SameSite::Strict));
        assert_eq!(parsed.secure(), Some(true), "behind TLS: {parsed}");
        assert_eq!(parsed.path(), Some("/"));
        assert_eq!(
            parsed.max_age(),
            Some(cookie::time::Duration::hours(8)),
            "{parsed}"
        );
        let wrong = asked(Method::POST, "/login", "token=nope");
        assert!(matches!(
            guard.check(&headers, &wrong),
            Err(Refused::WrongToken)
        ));

        let page = asked(Method::GET, "/claims", "");
        assert!(matches!(
            guard.check(&headers, &page),
            Err(Refused::NoToken)
        ));
        headers.insert(
            header::COOKIE,
            format!("theme=dark; {COOKIE}={}; other=1", parsed.value())
                .parse()
                .unwrap(),
        );
        assert!(matches!(guard.check(&headers, &page), Ok(Admitted::Yes)));
        headers.insert(
            header::COOKIE,
            format!("{COOKIE}=forged; a=b").parse().unwrap(),
        );
        assert!(matches!(
            guard.check(&headers, &page),
            Err(Refused::NoToken)
        ));
    }

    /// A session ends at its time, or when signed out (the cookie cleared,
    /// and the old value refused even if a browser keeps sending it).
    #[test]
    fn a_session_ends_when_it_expires_or_signs_out() {
        let (guard, token, mut headers) = behind_a_proxy();
        let page = asked(Method::GET, "/claims", "");
        let session = sign_in(&guard, &headers, &token);
        headers.insert(
            header::COOKIE,
            format!("{COOKIE}={}", session.value()).parse().unwrap(),
        );
        assert!(matches!(guard.check(&headers, &page), Ok(Admitted::Yes)));
        let logout = asked(Method::POST, "/logout", &format!("csrf={}", guard.csrf()));
        let Ok(Admitted::Login(Answer::SetCookie { cookie, to })) = guard.check(&headers, &logout)
        else {
            panic!("signed out");
        };
        assert_eq!(to, "/login");
        let cleared = Cookie::parse(cookie).expect("a Set-Cookie value");
        assert_eq!(cleared.max_age(), Some(cookie::time::Duration::ZERO));
        assert!(matches!(
            guard.check(&headers, &page),
            Err(Refused::NoToken)
        ));
        let forged = asked(Method::POST, "/logout", "csrf=nope");
        assert!(matches!(
            guard.check(&headers, &forged),
            Err(Refused::NoToken | Refused::Forgery)
        ));

        let session = sign_in(&guard, &headers, &token);
        headers.insert(
            header::COOKIE,
            format!("{COOKIE}={}", session.value()).parse().unwrap(),
        );
        assert!(matches!(guard.check(&headers, &page), Ok(Admitted::Yes)));
        // Its 8 hours are over.
        *guard.sessions().get_mut(session.value()).expect("live") = Instant::now();
        assert!(matches!(
            guard.check(&headers, &page),
            Err(Refused::NoToken)
        ));
    }

    /// Five wrong tokens from an address in a minute, and the sixth try is
    /// refused even with the right token; another address is not.
    #[test]
    fn wrong_tokens_are_limited_per_address() {
        let (guard, token, headers) = behind_a_proxy();
        let from = |form: &str, remote: &str| asked_from(Method::POST, "/login", form, remote);
        for _ in 0..MAX_FAILURES {
            assert!(matches!(
                guard.check(&headers, &from("token=guess", "10.0.0.7:1")),
                Err(Refused::WrongToken)
            ));
        }
        assert!(matches!(
            guard.check(&headers, &from(&format!("token={token}"), "10.0.0.7:2")),
            Err(Refused::TooMany)
        ));
        assert!(matches!(
            guard.check(&headers, &from(&format!("token={token}"), "10.0.0.8:1")),
            Ok(Admitted::Login(Answer::SetCookie { .. }))
        ));
        // The minute is over.
        guard
            .failures
            .lock()
            .unwrap()
            .get_mut(&"10.0.0.7".parse::<IpAddr>().unwrap())
            .expect("counted")
            .1 -= FAILURE_WINDOW;
        assert!(matches!(
            guard.check(&headers, &from(&format!("token={token}"), "10.0.0.7:3")),
            Ok(Admitted::Login(Answer::SetCookie { .. }))
        ));
    }

    /// Wrong bearer tokens count as wrong sign-ins; addresses of one IPv6
    /// /64 count as one.
    #[test]
    fn wrong_bearer_tokens_count_and_ipv6_counts_by_its_64() {
        let (guard, token, mut headers) = behind_a_proxy();
        headers.insert(header::AUTHORIZATION, "Bearer guess".parse().unwrap());
        for n in 0..MAX_FAILURES {
            let page = asked_from(Method::GET, "/claims", "", &format!("[2001:db8::{n}]:1"));
            assert!(matches!(
                guard.check(&headers, &page),
                Err(Refused::NoToken)
            ));
        }
        headers.insert(
            header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        let same_64 = asked_from(Method::GET, "/claims", "", "[2001:db8::ffff]:1");
        assert!(matches!(
            guard.check(&headers, &same_64),
            Err(Refused::TooMany)
        ));
        let other_64 = asked_from(Method::GET, "/claims", "", "[2001:db8:0:1::1]:1");
        assert!(matches!(
            guard.check(&headers, &other_64),
            Ok(Admitted::Yes)
        ));
    }

    /// What is checked before the body: a page without credentials is
    /// refused there; the login form is not (its token is in the body).
    #[test]
    fn credentials_are_checked_before_the_body() {
        let (guard, _, headers) = behind_a_proxy();
        let release = asked(Method::POST, "/claims/release", "");
        assert!(matches!(
            guard.check_headers(&headers, &release),
            Err(Refused::NoToken)
        ));
        let login = asked(Method::POST, "/login", "");
        assert!(guard.check_headers(&headers, &login).is_ok());
    }
}
