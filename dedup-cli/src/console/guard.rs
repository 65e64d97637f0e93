//! Who may see the console and change things through it.
//!
//! On a loopback address anyone on the machine may (as with the operator
//! tool itself), but only through a loopback `Host`, so that a web page
//! elsewhere cannot read it by pointing a name of its own at 127.0.0.1.
//! On any other address, every request needs the token: as
//! `Authorization: Bearer <token>` (scripts) or a session cookie given by
//! the login form (browsers). Every POST needs the page's CSRF token and,
//! where the browser names it, the console's own origin.

use std::net::SocketAddr;

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

pub(crate) struct Guard {
    /// Required on a non-loopback address.
    token: Option<String>,
    /// The session cookie's value, given for the token (new each start).
    session: String,
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
    pub(crate) fn new(listen: SocketAddr, token: Option<String>) -> Result<Self, Failure> {
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
        Ok(Guard {
            token,
            session: secret(),
            csrf: secret(),
        })
    }

    pub(crate) fn needs_token(&self) -> bool {
        self.token.is_some()
    }

    pub(crate) fn csrf(&self) -> &str {
        &self.csrf
    }

    pub(crate) fn check(&self, headers: &HeaderMap, asked: &Asked) -> Result<Admitted, Refused> {
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
        let login = asked.path.len() == 1 && asked.path[0] == "login";
        let Some(token) = &self.token else {
            return self.forms(asked, login).map(|()| Admitted::Yes);
        };
        if login {
            return Ok(Admitted::Login(self.login(token, headers, asked)?));
        }
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| same(given.trim(), token));
        let session = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(Cookie::split_parse)
            .filter_map(Result::ok)
            .any(|c| c.name() == COOKIE && same(c.value(), &self.session));
        if !bearer && !session {
            return Err(Refused::NoToken);
        }
        self.forms(asked, false).map(|()| Admitted::Yes)
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

    /// `/login`: the form, or a session for the right token.
    fn login(&self, token: &str, headers: &HeaderMap, asked: &Asked) -> Result<Answer, Refused> {
        let next = next_page(asked);
        if asked.method != Method::POST {
            return Ok(Answer::Page(StatusCode::OK, pages::login(&next, None)));
        }
        match asked.form.get("token") {
            Some(given) if same(given, token) => {
                // Behind a proxy that added TLS, the cookie travels only
                // over it.
                let https = headers
                    .get("x-forwarded-proto")
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.eq_ignore_ascii_case("https"))
                    || headers
                        .get(header::ORIGIN)
                        .and_then(|v| v.to_str().ok())
                        .is_some_and(|v| v.starts_with("https://"));
                let cookie = Cookie::build((COOKIE, self.session.as_str()))
                    .http_only(true)
                    .same_site(SameSite::Strict)
                    .path("/")
                    .secure(https);
                Ok(Answer::SignedIn {
                    cookie: cookie.to_string(),
                    to: next,
                })
            }
            _ => Err(Refused::WrongToken),
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
    fn another_address_needs_a_long_token() {
        let any: SocketAddr = "0.0.0.0:9470".parse().unwrap();
        let err = Guard::new(any, None).err().expect("refused");
        assert!(err.0.contains("DEDUP_CONSOLE_TOKEN"), "{err}");
        let err = Guard::new(any, Some("short".into()))
            .err()
            .expect("refused");
        assert!(err.0.contains("shorter"), "{err}");
        assert!(Guard::new(any, Some("x".repeat(32))).is_ok());
        assert!(Guard::new("127.0.0.1:0".parse().unwrap(), None).is_ok());
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
    }

    fn asked(method: Method, path: &str, form: &str) -> Asked {
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
            remote: "10.0.0.9:5000".parse().unwrap(),
        }
    }

    /// The right token gives a session cookie that a browser sends back
    /// among its others; a wrong one, a forged one or none is refused.
    #[test]
    fn a_session_is_given_for_the_token_and_found_among_other_cookies() {
        let token = "t".repeat(32);
        let guard = Guard::new("0.0.0.0:9470".parse().unwrap(), Some(token.clone())).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, "console.example:9470".parse().unwrap());
        headers.insert("x-forwarded-proto", "https".parse().unwrap());
        let login = asked(Method::POST, "/login", &format!("token={token}"));
        let Ok(Admitted::Login(Answer::SignedIn { cookie, .. })) = guard.check(&headers, &login)
        else {
            panic!("the right token signs in");
        };
        let parsed = Cookie::parse(cookie.as_str()).expect("a Set-Cookie value");
        assert_eq!(parsed.name(), COOKIE);
        assert_eq!(parsed.value(), guard.session);
        assert_eq!(parsed.http_only(), Some(true));
        assert_eq!(parsed.same_site(), Some(SameSite::Strict));
        assert_eq!(parsed.secure(), Some(true), "behind TLS: {cookie}");
        assert_eq!(parsed.path(), Some("/"));
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
            format!("theme=dark; {COOKIE}={}; other=1", guard.session)
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
}
