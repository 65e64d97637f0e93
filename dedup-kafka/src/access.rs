//! Start-up's first word with the brokers, for every runtime and the relay:
//! credentials the brokers refuse (a wrong SASL password or mechanism) and a
//! TLS handshake that fails (a CA that did not sign the brokers'
//! certificates, an expired client certificate) are configuration errors,
//! named at start in one error instead of librdkafka retrying them in the
//! log for ever. Brokers that do not answer at all are an outage: the start
//! goes on and waits them out, as the loop does.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer as _, ProducerContext};

use crate::Error;

/// How long start-up tries to reach the brokers before going on to wait
/// them out.
const ACCESS_TIMEOUT: Duration = Duration::from_secs(10);

/// What librdkafka reported of refused access, kept for the check.
#[derive(Default)]
struct Refusals {
    /// Refused credentials or a failed handshake of this client's own.
    refused: Mutex<Option<(RDKafkaErrorCode, String)>>,
    /// The last TLS alert the brokers sent, while it is the latest
    /// transport failure (another failure since clears it).
    alert: Mutex<Option<String>>,
}

impl rdkafka::ClientContext for Refusals {
    crate::oauth::tokens_from_the_provider!();

    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            Some(
                code @ (RDKafkaErrorCode::Authentication
                | RDKafkaErrorCode::SSL
                | RDKafkaErrorCode::UnsupportedSASLMechanism
                | RDKafkaErrorCode::SaslAuthenticationFailed),
            ) => {
                *self.refused.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((code, reason.to_owned()));
            }
            // A TLS alert the brokers sent (they refused this client's
            // certificate: expired, unknown, revoked) arrives as a
            // transport failure; OpenSSL's "SSL alert number N" is the only
            // sign. A broker in trouble can send one too (a revocation
            // check it cannot make, an internal error): a refusal only if
            // no broker answers for the whole check and an alert is still
            // the latest failure at its end (librdkafka passes on only the
            // first repeats of an error, so repeats are not counted).
            Some(RDKafkaErrorCode::BrokerTransportFailure) => {
                *self.alert.lock().unwrap_or_else(|p| p.into_inner()) = reason
                    .contains("SSL alert number")
                    .then(|| reason.to_owned());
                tracing::debug!(error = %error, reason, "reaching the brokers");
            }
            _ => tracing::debug!(error = %error, reason, "reaching the brokers"),
        }
    }

    // The check's own client logs nothing: what matters is in its error.
    fn log(&self, _: rdkafka::config::RDKafkaLogLevel, _: &str, _: &str) {}
}

impl ProducerContext for Refusals {
    type DeliveryOpaque = ();

    // It sends nothing.
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: ()) {}
}

/// Reaches the brokers with `config` (bootstrap servers and the security
/// settings every client of the runtime shares), asking for the cluster's
/// metadata: `Ok` once they answer, or when they do not answer within 10 s
/// (an outage, waited out after); an error naming what to fix when they
/// refuse the credentials or the TLS handshake fails (at once), or when for
/// those 10 s they answer only with TLS alerts (a client certificate they
/// refuse). `who` names the
/// client in the error.
pub(crate) async fn check(config: &ClientConfig, who: &str) -> Result<(), Error> {
    let config = config.clone();
    let named = who.to_owned();
    tokio::task::spawn_blocking(move || {
        let who = named;
        // A producer that sends nothing: its poll serves librdkafka's
        // error events, which say why access was refused.
        let client: BaseProducer<Refusals> = config.create_with_context(Refusals::default())?;
        let deadline = Instant::now() + ACCESS_TIMEOUT;
        loop {
            let answered = client
                .client()
                .fetch_metadata(None, Duration::from_millis(500))
                .is_ok();
            client.poll(Duration::ZERO);
            if answered {
                return Ok(());
            }
            let refused = client
                .context()
                .refused
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            match refused {
                // The token provider's outage, not a refusal: waited out.
                Some((_, reason))
                    if reason.contains(crate::oauth::NO_TOKEN)
                        && !reason.contains(crate::oauth::REFUSED) =>
                {
                    tracing::debug!(reason, "{who}: no OAUTHBEARER token yet");
                }
                // librdkafka reports a connection dropped mid-handshake as a
                // transport error, not as one of these.
                Some((code, reason)) => {
                    return Err(Error::Config(refusal(&who, code, &reason)));
                }
                None => {}
            }
            if Instant::now() >= deadline {
                // Never an answer, and the latest failure an alert: refused.
                let alert = client
                    .context()
                    .alert
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                if let Some(reason) = alert {
                    return Err(Error::Config(refusal(&who, RDKafkaErrorCode::SSL, &reason)));
                }
                tracing::warn!(
                    "{who}: the brokers do not answer yet; starting, and waiting them out"
                );
                return Ok(());
            }
        }
    })
    .await
    .map_err(|e| Error::Config(format!("{who}: checking access to the brokers: {e}")))?
}

/// The error for access refused with `code`: librdkafka's reason (which
/// never holds a password) and what to look at.
fn refusal(who: &str, code: RDKafkaErrorCode, reason: &str) -> String {
    let what = if reason.contains(crate::oauth::REFUSED) {
        "the token provider cannot get a token: its identity provider refused its \
         credentials; check the provider's client id, secret and scope"
    } else if code == RDKafkaErrorCode::SSL {
        "the TLS handshake with the brokers failed; check ssl.ca.location (the CA that \
         signed the brokers' certificates) and, where the brokers ask for one, the client \
         certificate (ssl.certificate.location, ssl.key.location): that the brokers trust \
         its CA, and its dates (openssl x509 -noout -dates -in <file>)"
    } else {
        "the brokers refused this client's credentials; check security.protocol, \
         sasl.mechanisms, sasl.username and sasl.password (or the token provider)"
    };
    format!("{who}: {what}: {reason}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_says_what_to_check_and_keeps_librdkafkas_reason() {
        let said = refusal(
            "consumer",
            RDKafkaErrorCode::Authentication,
            "SASL authentication error: invalid credentials with SASL mechanism SCRAM-SHA-512",
        );
        assert!(said.starts_with("consumer: the brokers refused"), "{said}");
        assert!(said.contains("sasl.password"), "{said}");
        assert!(said.contains("SCRAM-SHA-512"), "{said}");
        let said = refusal("relay", RDKafkaErrorCode::SSL, "certificate verify failed");
        assert!(said.contains("ssl.ca.location"), "{said}");
        assert!(said.contains("certificate verify failed"), "{said}");
    }

    /// Nothing listens on port 9: no refusal, only silence, which is an
    /// outage to wait out (so the check lets the start go on).
    #[tokio::test]
    async fn brokers_that_do_not_answer_are_waited_out_not_refused() {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", "127.0.0.1:9");
        let started = Instant::now();
        check(&config, "consumer").await.expect("an outage");
        assert!(started.elapsed() >= ACCESS_TIMEOUT);
    }
}
