//! Feature `oidc`: a [`TokenProvider`] for OAuth 2.0 client credentials
//! (RFC 6749 section 4.4), the flow Confluent Cloud, Aiven, Redpanda Cloud
//! and self-run brokers with an OIDC validator take: a POST of
//! `grant_type=client_credentials` (and the scope) to the identity
//! provider's token endpoint, the client authenticated with HTTP Basic; the
//! answer's `access_token` is the token, `expires_in` (or else the JWT's
//! `exp`) its expiry. Built on reqwest with rustls (ring, the system's
//! CAs, plus a CA file of your own for a private identity provider).

use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::{OAuthToken, TokenError, TokenFuture, TokenProvider};

/// How long one request to the token endpoint may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// OAuth 2.0 client credentials from an OIDC token endpoint. `Debug` never
/// shows the secret.
///
/// ```no_run
/// # fn with<S: dedup_core::OutboxSource>(builder: dedup_kafka::RelayBuilder<S>) -> Result<(), dedup_kafka::TokenError> {
/// use dedup_kafka::OidcClientCredentials;
///
/// let provider = OidcClientCredentials::new(
///     "https://login.example.com/oauth2/token",
///     std::env::var("OIDC_CLIENT_ID").unwrap_or_default(),
///     std::env::var("OIDC_CLIENT_SECRET").unwrap_or_default(),
/// )?
/// .scope("kafka");
/// let builder = builder
///     .set("security.protocol", "SASL_SSL")
///     .set("sasl.mechanisms", "OAUTHBEARER")
///     .oauth_token_provider(provider);
/// # Ok(()) }
/// ```
pub struct OidcClientCredentials {
    endpoint: String,
    client_id: String,
    client_secret: String,
    scope: Option<String>,
    principal: Option<String>,
    http: reqwest::Client,
}

impl std::fmt::Debug for OidcClientCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OidcClientCredentials")
            .field("endpoint", &self.endpoint)
            .field("client_id", &self.client_id)
            .field("client_secret", &"***")
            .field("scope", &self.scope)
            .field("principal", &self.principal)
            .finish()
    }
}

impl OidcClientCredentials {
    /// Tokens from `token_endpoint` for the client `client_id` with
    /// `client_secret`, trusting the system's CAs.
    pub fn new(
        token_endpoint: impl Into<String>,
        client_id: impl Into<String>,
        client_secret: impl Into<String>,
    ) -> Result<Self, TokenError> {
        Self::with_roots(token_endpoint, client_id, client_secret, None)
    }

    /// The same, trusting also the CA certificates in the PEM file `ca_file`
    /// (an identity provider with a certificate of a private CA).
    pub fn with_ca_file(
        token_endpoint: impl Into<String>,
        client_id: impl Into<String>,
        client_secret: impl Into<String>,
        ca_file: impl AsRef<Path>,
    ) -> Result<Self, TokenError> {
        let path = ca_file.as_ref();
        let pem = std::fs::read(path).map_err(|e| {
            TokenError::refused(format!(
                "the CA file {} cannot be read: {e}",
                path.display()
            ))
        })?;
        let certificates = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
            TokenError::refused(format!(
                "the CA file {} holds no PEM certificate: {e}",
                path.display()
            ))
        })?;
        if certificates.is_empty() {
            return Err(TokenError::refused(format!(
                "the CA file {} holds no PEM certificate",
                path.display()
            )));
        }
        Self::with_roots(token_endpoint, client_id, client_secret, Some(certificates))
    }

    fn with_roots(
        token_endpoint: impl Into<String>,
        client_id: impl Into<String>,
        client_secret: impl Into<String>,
        roots: Option<Vec<reqwest::Certificate>>,
    ) -> Result<Self, TokenError> {
        let endpoint = token_endpoint.into();
        let parsed = reqwest::Url::parse(&endpoint).map_err(|e| {
            TokenError::refused(format!("the token endpoint {endpoint:?} is not a URL: {e}"))
        })?;
        match parsed.scheme() {
            "https" => {}
            // The secret crosses in clear: only on this machine.
            "http" if is_loopback(&parsed) => {}
            _ => {
                return Err(TokenError::refused(format!(
                    "the token endpoint {endpoint:?} is not https (plain http only to \
                     localhost)"
                )));
            }
        }
        let mut http = reqwest::Client::builder().timeout(REQUEST_TIMEOUT);
        if is_loopback(&parsed) {
            // Never through a proxy: the secret may cross in clear here.
            http = http.no_proxy();
        }
        for root in roots.into_iter().flatten() {
            http = http.add_root_certificate(root);
        }
        let http = http
            .build()
            .map_err(|e| TokenError::refused(format!("cannot make the HTTP client: {e}")))?;
        Ok(OidcClientCredentials {
            endpoint,
            client_id: client_id.into(),
            client_secret: client_secret.into(),
            scope: None,
            principal: None,
            http,
        })
    }

    /// The `scope` asked for (space-separated scopes, as the identity
    /// provider names them).
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// The principal librdkafka reports the token for (by default the
    /// token's `sub` claim, else the client id). The brokers take theirs
    /// from the token.
    pub fn principal(mut self, principal: impl Into<String>) -> Self {
        self.principal = Some(principal.into());
        self
    }

    async fn fetch(&self) -> Result<OAuthToken, TokenError> {
        let mut form = vec![("grant_type", "client_credentials")];
        if let Some(scope) = &self.scope {
            form.push(("scope", scope));
        }
        let asked_at = SystemTime::now();
        let answer = self
            .http
            .post(&self.endpoint)
            .header(
                reqwest::header::AUTHORIZATION,
                basic(&self.client_id, &self.client_secret),
            )
            .form(&form)
            .send()
            .await
            // Unreachable, slow, reset, a certificate it cannot verify: an
            // outage, with its causes (which hold no secret).
            .map_err(|e| TokenError::new(format!("the token endpoint: {}", causes(&e))))?;
        let status = answer.status();
        let body = answer
            .bytes()
            .await
            .map_err(|e| TokenError::new(format!("the token endpoint's answer: {}", causes(&e))))?;
        read_answer(
            status.as_u16(),
            &body,
            asked_at,
            self.principal.as_deref(),
            &self.client_id,
        )
    }
}

impl TokenProvider for OidcClientCredentials {
    fn token(&self) -> TokenFuture<'_> {
        Box::pin(self.fetch())
    }
}

/// HTTP Basic credentials as RFC 6749 section 2.3.1 has them: the client id
/// and secret each form-urlencoded, then joined by `:` and base64-encoded
/// (so that a secret holding `+`, `%` or `:` reaches the server intact).
fn basic(client_id: &str, client_secret: &str) -> String {
    use base64::Engine as _;
    let encode = |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
    let pair = format!("{}:{}", encode(client_id), encode(client_secret));
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

/// A request's error and its causes, without the URL.
fn causes(e: &reqwest::Error) -> String {
    let mut said = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        said.push_str(": ");
        said.push_str(&cause.to_string());
        source = cause.source();
    }
    said
}

/// Whether `url` is on this machine: plain http is allowed only there.
fn is_loopback(url: &reqwest::Url) -> bool {
    match url.host_str() {
        Some("localhost") => true,
        Some(host) => host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback()),
        None => false,
    }
}

/// The token in an answer of the token endpoint with HTTP `status` and
/// `body`, asked at `asked_at`. 400 and 401 (RFC 6749 5.2: `invalid_client`,
/// `unauthorized_client`, `invalid_scope`...) and 403 are refusals; other
/// failures an outage. The body's error fields are quoted, never a token.
fn read_answer(
    status: u16,
    body: &[u8],
    asked_at: SystemTime,
    principal: Option<&str>,
    client_id: &str,
) -> Result<OAuthToken, TokenError> {
    let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    if !(200..300).contains(&status) {
        let said = json
            .as_ref()
            .map(|j| {
                [j.get("error"), j.get("error_description")]
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str())
                    .collect::<Vec<_>>()
                    .join(": ")
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "no OAuth error in the answer".to_owned());
        let why = format!("the token endpoint answered HTTP {status} ({said})");
        return Err(if matches!(status, 400 | 401 | 403) {
            TokenError::refused(why)
        } else {
            TokenError::new(why)
        });
    }
    let json = json.ok_or_else(|| TokenError::new("the token endpoint's answer is not JSON"))?;
    let token = json
        .get("access_token")
        .and_then(|t| t.as_str())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| TokenError::new("the token endpoint's answer has no access_token"))?;
    let claims = jwt_claims(token);
    // A number, or a number as a string (some providers send one).
    let seconds = |v: &serde_json::Value| {
        v.as_f64()
            .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
            .and_then(|secs: f64| Duration::try_from_secs_f64(secs).ok())
            .filter(|d| !d.is_zero())
    };
    let expires_at = json
        .get("expires_in")
        .and_then(seconds)
        .and_then(|life| asked_at.checked_add(life))
        .or_else(|| {
            claims
                .as_ref()
                .and_then(|c| c.get("exp"))
                .and_then(seconds)
                .and_then(|exp| SystemTime::UNIX_EPOCH.checked_add(exp))
        })
        .ok_or_else(|| {
            TokenError::new("the token endpoint's answer says no usable expires_in or exp")
        })?;
    let principal = principal
        .map(str::to_owned)
        .or_else(|| {
            claims
                .as_ref()
                .and_then(|c| c.get("sub"))
                .and_then(|s| s.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| client_id.to_owned());
    Ok(OAuthToken::new(token, principal, expires_at))
}

/// The claims of a JWT (its middle part), if `token` is one.
fn jwt_claims(token: &str) -> Option<serde_json::Value> {
    use base64::Engine as _;
    let claims = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(claims.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    fn jwt(claims: serde_json::Value) -> String {
        let e = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        format!(
            "{}.{}.",
            e(br#"{"alg":"none"}"#),
            e(claims.to_string().as_bytes())
        )
    }

    #[test]
    fn expiry_from_expires_in_else_the_jwts_exp_and_the_principal_from_sub() {
        let asked = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let token = jwt(serde_json::json!({"sub": "svc-a", "exp": 5_000}));
        let body = serde_json::json!({"access_token": token, "expires_in": 300}).to_string();
        let t = read_answer(200, body.as_bytes(), asked, None, "client").expect("a token");
        assert_eq!(t.expires_at(), asked + Duration::from_secs(300));
        assert_eq!(t.principal(), "svc-a");

        let body = serde_json::json!({"access_token": token}).to_string();
        let t = read_answer(200, body.as_bytes(), asked, Some("me"), "client").expect("a token");
        assert_eq!(
            t.expires_at(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(5_000)
        );
        assert_eq!(t.principal(), "me");

        let body = serde_json::json!({"access_token": "opaque", "expires_in": "60"}).to_string();
        let t = read_answer(200, body.as_bytes(), asked, None, "client").expect("a token");
        assert_eq!(t.principal(), "client");
        assert_eq!(t.expires_at(), asked + Duration::from_secs(60));

        // Absurd expiries are unusable answers, not a panic.
        for expires_in in [
            serde_json::json!(1e300),
            serde_json::json!(-5),
            serde_json::json!(0),
        ] {
            let body =
                serde_json::json!({"access_token": "opaque", "expires_in": expires_in}).to_string();
            let e = read_answer(200, body.as_bytes(), asked, None, "client").expect_err("unusable");
            assert!(!e.is_refused(), "{e}");
        }
    }

    #[test]
    fn basic_credentials_are_form_urlencoded_first() {
        let header = basic("my:client", "a+b%c d");
        let encoded = header.strip_prefix("Basic ").expect("Basic");
        let pair = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .expect("base64");
        assert_eq!(
            String::from_utf8(pair).expect("utf-8"),
            "my%3Aclient:a%2Bb%25c+d"
        );
    }

    #[test]
    fn refusals_outages_and_nonsense_are_told_apart_and_quote_no_token() {
        let asked = SystemTime::now();
        let refused = read_answer(
            401,
            br#"{"error":"invalid_client","error_description":"bad secret"}"#,
            asked,
            None,
            "c",
        )
        .expect_err("401");
        assert!(refused.is_refused());
        assert!(
            refused.to_string().contains("invalid_client: bad secret"),
            "{refused}"
        );

        let down = read_answer(503, b"<html>busy</html>", asked, None, "c").expect_err("503");
        assert!(!down.is_refused());
        assert!(down.to_string().contains("HTTP 503"), "{down}");

        for body in [
            &br#"{"token_type":"bearer"}"#[..],
            b"not json",
            br#"{"access_token":"x"}"#,
        ] {
            let e = read_answer(200, body, asked, None, "c").expect_err("unusable");
            assert!(!e.is_refused(), "{e}");
        }
    }

    #[test]
    fn debug_never_shows_the_secret_and_plain_http_only_on_loopback() {
        let p = OidcClientCredentials::new("http://127.0.0.1:1/token", "id", "s3cret-value")
            .expect("loopback http");
        assert!(!format!("{p:?}").contains("s3cret-value"));
        for refused in [
            "ftp://idp/token",
            "http://idp.example.com/token",
            "not a url",
        ] {
            let e = OidcClientCredentials::new(refused, "id", "s").expect_err(refused);
            assert!(e.is_refused(), "{refused}: {e}");
        }
    }
}
