//! The registry's answers, sorted by whose fault a failure is: what
//! `Registry`'s requests go through.

use serde::Deserialize;

use crate::error::RegistryError;

/// Sends `request` and reads its answer, sorting failures by whose fault
/// they are.
pub(crate) async fn send<T: serde::de::DeserializeOwned>(
    what: &str,
    request: reqwest::RequestBuilder,
) -> Result<T, RegistryError> {
    let answer = request.send().await.map_err(|e| transport(&e))?;
    let status = answer.status().as_u16();
    let body = answer.bytes().await.map_err(|e| transport(&e))?;
    if (200..300).contains(&status) {
        return serde_json::from_slice(&body).map_err(|e| {
            // A proxy's page in place of the API's JSON: not the record's
            // fault, and a later answer may be right.
            RegistryError::Unavailable(format!(
                "{what}: the answer (HTTP {status}) is not the registry's JSON: {e}"
            ))
        });
    }
    let message = said(&body);
    let what = what.to_owned();
    Err(match status {
        401 | 403 => RegistryError::Refused {
            what,
            status,
            message,
        },
        // The registry's own "not found" carries its error code (40401
        // subject, 40402 version, 40403 schema); a 404 without one is a URL
        // that is not the registry's API (Apicurio's lacks
        // /apis/ccompat/v6): a configuration error, never a record's.
        404 if has_error_code(&body) => RegistryError::NotFound { what, message },
        408 | 429 | 500..=599 => {
            RegistryError::Unavailable(format!("{what}: HTTP {status} ({message})"))
        }
        _ => RegistryError::Rejected {
            what,
            status,
            message,
        },
    })
}

/// Whether an error answer is the registry's JSON with its `error_code`.
fn has_error_code(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error_code").and_then(serde_json::Value::as_i64))
        .is_some()
}

/// The registry's words in an error answer: its `message` and
/// `error_code`, else the start of the body (a proxy's page).
fn said(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct ErrorJson {
        #[serde(default)]
        error_code: Option<i64>,
        #[serde(default)]
        message: Option<String>,
    }
    if let Ok(ErrorJson {
        error_code,
        message: Some(message),
    }) = serde_json::from_slice::<ErrorJson>(body)
    {
        return match error_code {
            Some(code) => format!("error {code}: {message}"),
            None => message,
        };
    }
    let text = String::from_utf8_lossy(body);
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut cut: String = text.chars().take(200).collect();
    if cut.is_empty() {
        cut.push_str("no body");
    }
    cut
}

/// A request that got no answer: a certificate that cannot be verified is
/// a configuration error, anything else (refused, reset, timed out) an
/// outage.
fn transport(e: &reqwest::Error) -> RegistryError {
    let causes = causes(e);
    if causes.contains("certificate") || causes.contains("UnknownIssuer") {
        RegistryError::Certificate(causes)
    } else {
        RegistryError::Unavailable(causes)
    }
}

/// A request's error and its causes (reqwest's words hold the URL, never a
/// credential).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_registrys_own_404_is_not_found() {
        assert!(has_error_code(
            br#"{"error_code":40403,"message":"Schema not found"}"#
        ));
        assert!(!has_error_code(b"<html>404 Not Found</html>"));
        assert!(!has_error_code(
            br#"{"message":"RESTEASY003210: Could not find resource"}"#
        ));
    }

    #[test]
    fn error_answers_are_quoted_without_a_page() {
        assert_eq!(
            said(br#"{"error_code":40403,"message":"Schema not found"}"#),
            "error 40403: Schema not found"
        );
        assert_eq!(
            said(b"<html>\n<body>502 Bad Gateway</body></html>"),
            "<html> <body>502 Bad Gateway</body></html>"
        );
        assert_eq!(said(b""), "no body");
    }
}
