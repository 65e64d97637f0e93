//! OAUTHBEARER fixtures: unsigned JWTs (what the test broker's unsecured
//! validator accepts) and an OIDC token endpoint of a test's own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use base64::Engine as _;

/// An unsigned JWT for `principal`, valid for `life` (what the test
/// broker's unsecured OAUTHBEARER validator accepts; a real provider's is
/// signed), and its expiry.
pub fn unsigned_jwt_text(principal: &str, life: Duration) -> (String, std::time::SystemTime) {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let now = std::time::SystemTime::now();
    let secs = |t: std::time::SystemTime| {
        t.duration_since(std::time::SystemTime::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64()
    };
    let expires = now + life;
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#);
    let claims = URL_SAFE_NO_PAD.encode(
        serde_json::json!({ "sub": principal, "iat": secs(now) - 1.0, "exp": secs(expires) })
            .to_string(),
    );
    (format!("{header}.{claims}."), expires)
}

/// A token endpoint of the test's own on loopback, as an identity provider
/// serves OAuth 2.0 client credentials: the client `dedup-svc` with secret
/// `s3cret` and scope `kafka` gets an unsigned JWT living `life`; anything
/// else is refused as `invalid_client`. Counts the tokens it gave.
pub struct TokenEndpoint {
    /// Its URL (plain http on loopback).
    pub url: String,
    /// How many tokens it gave.
    pub given: Arc<AtomicU32>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for TokenEndpoint {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Starts a [`TokenEndpoint`] whose tokens live `life`.
pub async fn token_endpoint(life: Duration) -> TokenEndpoint {
    use http_body_util::{BodyExt as _, Full};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/oauth2/token",
        listener.local_addr().expect("address")
    );
    let given = Arc::new(AtomicU32::new(0));
    let counted = given.clone();
    let expected = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("dedup-svc:s3cret")
    );
    let server = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (counted, expected) = (counted.clone(), expected.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (counted, expected) = (counted.clone(), expected.clone());
                        async move {
                            let authorized = req
                                .headers()
                                .get(hyper::header::AUTHORIZATION)
                                .and_then(|v| v.to_str().ok())
                                == Some(expected.as_str());
                            let body = req.into_body().collect().await?.to_bytes();
                            let form = String::from_utf8_lossy(&body).into_owned();
                            let asked = form.contains("grant_type=client_credentials")
                                && form.contains("scope=kafka");
                            let (status, answer) = if authorized && asked {
                                counted.fetch_add(1, Ordering::SeqCst);
                                let (jwt, _) = unsigned_jwt_text("dedup-svc", life);
                                (
                                    200,
                                    serde_json::json!({
                                        "access_token": jwt,
                                        "token_type": "bearer",
                                        "expires_in": life.as_secs(),
                                    }),
                                )
                            } else {
                                (
                                    401,
                                    serde_json::json!({
                                        "error": "invalid_client",
                                        "error_description": "unknown client or wrong secret",
                                    }),
                                )
                            };
                            Ok::<_, hyper::Error>(
                                hyper::Response::builder()
                                    .status(status)
                                    .header("content-type", "application/json")
                                    .body(Full::new(hyper::body::Bytes::from(answer.to_string())))
                                    .expect("response"),
                            )
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    TokenEndpoint { url, given, server }
}
