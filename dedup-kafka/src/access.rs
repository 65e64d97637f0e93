//! Start-up's first word with the brokers, for every runtime and the relay:
//! credentials the brokers refuse (a wrong SASL password or mechanism) and a
//! TLS handshake that fails (a CA that did not sign the brokers'
//! certificates, an expired client certificate) are configuration errors,
//! named at start in one error instead of librdkafka retrying them in the
//! log for ever. Brokers that do not answer at all are an outage: the start
//! goes on and waits them out, as the loop does.
//!
//! Once the brokers answer, the rights the runtime needs are checked too: a
//! topic it reads or writes that its principal may not even see (no ACL
//! grants it anything there), and a consumer group it may not use, stop the
//! start with the ACL to add named. Rights the check cannot see without
//! reading or writing (Read where only Describe is granted, Write on a
//! topic it may see) show up later: the dead-letter producer names the
//! missing Write and holds the partition, as does the transactional
//! producer.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer as _, ProducerContext};
use rdkafka::{ClientConfig, TopicPartitionList};

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
            // OpenSSL refusing the brokers' certificate (a CA not in
            // ssl.ca.location, another host name, expired) is this
            // client's configuration, never an outage; librdkafka reports
            // it as an SSL error or, when the read that meets it is not
            // the handshake's own, as a transport failure with the same
            // reason.
            Some(RDKafkaErrorCode::BrokerTransportFailure)
                if reason.contains("certificate verify failed") =>
            {
                *self.refused.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((RDKafkaErrorCode::SSL, reason.to_owned()));
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

impl ConsumerContext for Refusals {}

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
/// refuse); then, if they answered, whether the principal may use what
/// `rights` lists (see the module's comment). `who` names the client in
/// the error.
pub(crate) async fn check(config: &ClientConfig, who: &str, rights: &Rights) -> Result<(), Error> {
    let mut config = config.clone();
    // Asking for a topic's metadata must not create it.
    config.set("allow.auto.create.topics", "false");
    let named = who.to_owned();
    let rights = rights.clone();
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
            // Every event queued so far, for a while: one poll serves one
            // event, and librdkafka's log lines share the queue with the
            // errors. Serving one per try (a failed fetch returns at once)
            // fell behind on a loaded machine, and the refusal was never
            // read: the start waited a misconfiguration out as an outage.
            client.poll(Duration::from_millis(100));
            if answered {
                return permitted(&client, &config, &who, &rights);
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

/// What a client's principal must be allowed on the cluster.
#[derive(Debug, Default, Clone)]
pub(crate) struct Rights {
    /// Topics it consumes (Read).
    pub(crate) read: Vec<String>,
    /// Topics it produces to (Write): dead letters, retry tiers, changelog.
    pub(crate) write: Vec<String>,
    /// The consumer group it consumes in (Read).
    pub(crate) group: Option<String>,
}

/// How long each question of the rights check waits for its answer.
const RIGHTS_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the principal may see every topic in `rights` and use its
/// group: `Ok` when it may, or when the brokers do not say (they stopped
/// answering: an outage, waited out after); an error naming the ACL to add
/// when they refuse.
fn permitted(
    client: &BaseProducer<Refusals>,
    config: &ClientConfig,
    who: &str,
    rights: &Rights,
) -> Result<(), Error> {
    let principal = principal(config);
    // In the order a user grants them: the topics read, the group, the
    // topics written.
    let mut readable = None;
    for topic in &rights.read {
        match may_see(client, who, &principal, topic, "Read", "read")? {
            Seen::Partition(partition) => {
                readable.get_or_insert((topic, partition));
            }
            Seen::Other => {}
            // The brokers stopped answering: an outage, not a refusal, and
            // no reason to wait for each topic in turn.
            Seen::Unanswered => return Ok(()),
        }
    }
    if let (Some(group), Some((topic, partition))) = (&rights.group, readable) {
        may_use_group(config, who, &principal, group, topic, partition)?;
    }
    for topic in &rights.write {
        if let Seen::Unanswered = may_see(client, who, &principal, topic, "Write", "write")? {
            return Ok(());
        }
    }
    Ok(())
}

/// What the brokers said of a topic the principal may see.
enum Seen {
    /// It exists: one of its partitions.
    Partition(i32),
    /// It does not exist yet, is a pattern, or came with another error.
    Other,
    /// No answer in time.
    Unanswered,
}

/// Whether the principal may see `topic`: an error naming `operation` if
/// the brokers say it may not; else what they said.
fn may_see(
    client: &BaseProducer<Refusals>,
    who: &str,
    principal: &Principal,
    topic: &str,
    operation: &str,
    verb: &str,
) -> Result<Seen, Error> {
    // A pattern (`^orders-.*`) names no one topic to ask about.
    if topic.starts_with('^') {
        return Ok(Seen::Other);
    }
    let Ok(metadata) = client.client().fetch_metadata(Some(topic), RIGHTS_TIMEOUT) else {
        return Ok(Seen::Unanswered);
    };
    let Some(answer) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(Seen::Other);
    };
    match answer.error().map(RDKafkaErrorCode::from) {
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => Err(Error::Config(format!(
            "{who}: the brokers do not let {principal} {verb} topic {topic:?} (no ACL lets it \
             even see the topic): grant it {operation} on the topic, e.g. {}",
            grant_command(principal, operation, &format!("--topic {topic}"))
        ))),
        None => Ok(answer
            .partitions()
            .first()
            .map_or(Seen::Other, |p| Seen::Partition(p.id()))),
        Some(_) => Ok(Seen::Other),
    }
}

/// Whether the principal may use `group`, asked as the group's committed
/// offset of one partition (the brokers answer it only to a principal
/// allowed the group).
fn may_use_group(
    config: &ClientConfig,
    who: &str,
    principal: &Principal,
    group: &str,
    topic: &str,
    partition: i32,
) -> Result<(), Error> {
    let mut config = config.clone();
    config
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        // Not to wait for another member's open transaction.
        .set("isolation.level", "read_uncommitted");
    let consumer: BaseConsumer<Refusals> = config.create_with_context(Refusals::default())?;
    let mut asked = TopicPartitionList::new();
    asked.add_partition(topic, partition);
    // A group the principal may not use is refused when the consumer
    // looks for its coordinator, an error its poll returns, while the ask
    // times out.
    let deadline = Instant::now() + RIGHTS_TIMEOUT;
    loop {
        let asked = consumer.committed_offsets(asked.clone(), Duration::from_millis(500));
        while let Some(polled) = consumer.poll(Duration::ZERO) {
            if let Err(e) = polled
                && e.rdkafka_error_code() == Some(RDKafkaErrorCode::GroupAuthorizationFailed)
            {
                return Err(Error::Config(format!(
                    "{who}: the brokers do not let {principal} consume as group {group:?}: \
                     grant it Read on the group, e.g. {}",
                    grant_command(principal, "Read", &format!("--group {group}"))
                )));
            }
        }
        match asked {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                tracing::debug!(error = %e, "{who}: the group's offsets, asked to check its rights");
                return Ok(());
            }
            Err(_) => {}
        }
    }
}

/// Logs an error the consumer met; one of the brokers' ACLs says which ACL
/// is missing (the consumer's partitions wait meanwhile: nothing fetched,
/// nothing committed).
pub(crate) fn consumer_error(e: &KafkaError) {
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => tracing::error!(
            error = %e,
            "the consumer's principal may not read a topic it consumes: grant it Read on the \
             topic ({}); waiting",
            grant_command(&Principal(None), "Read", "--topic <topic>")
        ),
        Some(RDKafkaErrorCode::GroupAuthorizationFailed) => tracing::error!(
            error = %e,
            "the consumer's principal may not use its group: grant it Read on the group ({}); \
             waiting",
            grant_command(&Principal(None), "Read", "--group <group>")
        ),
        _ => tracing::warn!(error = %e, "kafka consumer error"),
    }
}

/// The `kafka-acls.sh` command that grants `principal` `operation` on
/// `resource` (`--topic orders`, `--group payments`, ...): how every error
/// about a missing ACL says what to add.
pub(crate) fn grant_command(principal: &Principal, operation: &str, resource: &str) -> String {
    let named = principal.0.as_deref().unwrap_or("<principal>");
    format!(
        "kafka-acls.sh --bootstrap-server <brokers> --add --allow-principal {named} \
         --operation {operation} {resource}"
    )
}

/// The principal the brokers most likely see, if a client can tell:
/// `User:<sasl.username>` for PLAIN and SCRAM; otherwise (a certificate's
/// subject, a token's) only the brokers know it.
pub(crate) struct Principal(Option<String>);

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.as_deref().unwrap_or("this client's principal"))
    }
}

/// The principal of clients made from `config`.
pub(crate) fn principal(config: &ClientConfig) -> Principal {
    let mechanism = config
        .get("sasl.mechanisms")
        .or(config.get("sasl.mechanism"));
    Principal(match (config.get("sasl.username"), mechanism) {
        (Some(user), Some(m)) if m.eq_ignore_ascii_case("PLAIN") || m.starts_with("SCRAM") => {
            Some(format!("User:{user}"))
        }
        _ => None,
    })
}

/// The error for access refused with `code`: librdkafka's reason (which
/// never holds a password) and what to look at.
fn refusal(who: &str, code: RDKafkaErrorCode, reason: &str) -> String {
    let what = if reason.contains(crate::oauth::REFUSED) {
        "the token provider cannot get a token: its identity provider refused its \
         credentials; check the provider's client id, secret and scope"
    } else if code == RDKafkaErrorCode::SSL && reason.contains("certificate verify failed") {
        "this client could not verify the brokers' certificate: signed by a CA that is not in \
         ssl.ca.location, issued for another host name than the one connected to, or expired \
         (OpenSSL does not say which through librdkafka; `openssl s_client -connect \
         <broker:port> -CAfile <ssl.ca.location>` prints the reason, and `openssl x509 -noout \
         -dates` the certificate's dates)"
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
        assert!(said.contains("or expired"), "{said}");
        assert!(said.contains("certificate verify failed"), "{said}");
        let said = refusal("relay", RDKafkaErrorCode::SSL, "SSL alert number 45");
        assert!(said.contains("ssl.certificate.location"), "{said}");
    }

    /// The brokers' certificate failing verification is a refusal however
    /// librdkafka files it: as an SSL error, or as a transport failure when
    /// a read other than the handshake's own meets it.
    #[test]
    fn a_certificate_that_fails_verification_is_refused_either_way() {
        use rdkafka::ClientContext as _;
        let reason = "sasl_ssl://127.0.0.1:9096/bootstrap: error:0A000086:SSL routines::\
                      certificate verify failed (after 2ms in state SSL_HANDSHAKE)";
        for code in [
            RDKafkaErrorCode::SSL,
            RDKafkaErrorCode::BrokerTransportFailure,
        ] {
            let refusals = Refusals::default();
            refusals.error(KafkaError::Global(code), reason);
            let refused = refusals.refused.lock().unwrap().take();
            let (code, said) = refused.unwrap_or_else(|| panic!("{code:?}: not a refusal"));
            assert!(
                refusal("consumer", code, &said)
                    .contains("could not verify the brokers' certificate"),
                "{code:?}"
            );
        }
        // Any other transport failure is an outage, waited out.
        let refusals = Refusals::default();
        refusals.error(
            KafkaError::Global(RDKafkaErrorCode::BrokerTransportFailure),
            "127.0.0.1:9096/bootstrap: Connect to ipv4#127.0.0.1:9096 failed: Connection refused",
        );
        assert!(refusals.refused.lock().unwrap().is_none());
    }

    /// The principal is named where a client can tell (SASL PLAIN and
    /// SCRAM), a placeholder in the command where it cannot.
    #[test]
    fn a_missing_acl_is_told_as_the_command_that_adds_it() {
        let mut config = ClientConfig::new();
        config
            .set("sasl.mechanisms", "SCRAM-SHA-512")
            .set("sasl.username", "svc");
        let scram = principal(&config);
        assert_eq!(scram.to_string(), "User:svc");
        assert_eq!(
            grant_command(&scram, "Read", "--group g"),
            "kafka-acls.sh --bootstrap-server <brokers> --add --allow-principal User:svc \
             --operation Read --group g"
        );
        config.set("sasl.mechanisms", "OAUTHBEARER");
        let token = principal(&config);
        assert_eq!(token.to_string(), "this client's principal");
        assert!(
            grant_command(&token, "Write", "--topic t").contains("--allow-principal <principal> ")
        );
    }

    /// Nothing listens on port 9: no refusal, only silence, which is an
    /// outage to wait out (so the check lets the start go on).
    #[tokio::test]
    async fn brokers_that_do_not_answer_are_waited_out_not_refused() {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", "127.0.0.1:9");
        let started = Instant::now();
        check(&config, "consumer", &Rights::default())
            .await
            .expect("an outage");
        assert!(started.elapsed() >= ACCESS_TIMEOUT);
    }
}
