//! Through the broker's SASL_SSL listener with OAUTHBEARER tokens from a
//! token provider in code (scripts/kafka.sh: unsigned JWTs accepted,
//! sessions re-authenticated when their token expires).

use super::*;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use dedup_kafka::{OAuthToken, TokenError};

/// An unsigned JWT for `principal`, valid for `life` (what the test broker's
/// unsecured validator accepts; a real provider's is signed).
fn unsigned_jwt(principal: &str, life: Duration) -> OAuthToken {
    let (jwt, expires) = dedup_tests::oidc::unsigned_jwt_text(principal, life);
    OAuthToken::new(jwt, principal, expires)
}

/// The SASL_SSL listener's address and CA, with OAUTHBEARER.
fn oauthbearer(builder: ConsumerBuilder<PgStore>) -> ConsumerBuilder<PgStore> {
    let secured = common::secured_env();
    let get = |k: &str| {
        secured
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{k} in kafka.sh secure-env"))
    };
    builder
        .brokers(get("KAFKA_BROKERS"))
        .set("security.protocol", "SASL_SSL")
        .set("ssl.ca.location", get("KAFKA_CFG_SSL_CA_LOCATION"))
        .set("sasl.mechanisms", "OAUTHBEARER")
}

/// For a minute, payments arrive while the provider's tokens live 10 s each
/// and the broker makes every connection re-authenticate when its token
/// expires (shorter tokens make librdkafka's re-authentication race their
/// expiry: with 4 s tokens most re-authentications failed and connections
/// were dropped, losing nothing but stalling the group): every payment is applied exactly once, the malformed ones are
/// dead-lettered (by the consumer's producer, with the same tokens), and
/// the provider was asked again and again.
#[sqlx::test(migrations = false)]
async fn tokens_that_expire_every_few_seconds_lose_nothing(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(2).await;
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let provider = move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, TokenError>(unsigned_jwt("dedup", Duration::from_secs(10))) }
    };
    let running = start(
        oauthbearer(consumer(&store, &unique("g")))
            .oauth_token_provider(provider)
            .handle(&topic, record_payment),
    );
    // Payments over a minute (over PLAINTEXT: the producer is not what is
    // tested), with a malformed one now and then.
    let producer = producer();
    let mut sent = 0i64;
    let mut malformed = 0u64;
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until {
        for _ in 0..10 {
            sent += 1;
            let event = payment(uuid::Uuid::new_v4(), "acct", 1);
            produce(&producer, &topic, &format!("k{}", sent % 7), &event, None).await;
        }
        if sent % 200 == 0 {
            malformed += 1;
            produce(&producer, &topic, "bad", b"{not json", None).await;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let total = sent as u64;
    running
        .wait_for("every payment applied", |s| {
            s.applied == total && s.dead_lettered == malformed
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(balance(&pool).await, sent, "each payment applied once");
    assert_eq!((stats.applied, stats.dead_lettered), (total, malformed));
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), malformed as usize).await;
    assert!(
        dead.iter()
            .all(|m| header(m, "dedup.error.kind") == Some("decode"))
    );
    // A token lives 10 s and is renewed at 60% of its life: about 10 in a
    // minute, surely more than 5.
    let asked = calls.load(Ordering::SeqCst);
    assert!(
        asked > 5,
        "the provider was asked {asked} times in a minute"
    );
}

/// A provider that fails for a while is an outage: nothing is consumed,
/// nothing dead-lettered, and once it gives tokens again every payment is
/// applied once.
#[sqlx::test(migrations = false)]
async fn a_failing_token_provider_is_waited_out(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    for _ in 0..20 {
        let event = payment(uuid::Uuid::new_v4(), "acct", 1);
        produce(&producer, &topic, "acct", &event, None).await;
    }
    let healthy_after = Instant::now() + Duration::from_secs(8);
    let provider = move || async move {
        if Instant::now() < healthy_after {
            Err(TokenError::new("identity provider answered 503"))
        } else {
            Ok(unsigned_jwt("dedup", Duration::from_secs(30)))
        }
    };
    let running = start(
        oauthbearer(consumer(&store, &unique("g")))
            .oauth_token_provider(provider)
            .handle(&topic, record_payment),
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(balance(&pool).await, 0, "nothing consumed without a token");
    running
        .wait_for("every payment applied", |s| s.applied == 20)
        .await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.dead_lettered), (20, 0));
    assert_eq!(balance(&pool).await, 20);
}

/// The OIDC client-credentials provider shipped with dedup, against a
/// token endpoint of the test's own: the consumer reaches the SASL_SSL
/// listener with its tokens (10 s each, renewed as they age) and applies
/// every payment once.
#[sqlx::test(migrations = false)]
async fn the_oidc_client_credentials_provider_gets_the_tokens(pool: PgPool) {
    let endpoint = dedup_tests::oidc::token_endpoint(Duration::from_secs(10)).await;
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    for _ in 0..20 {
        let event = payment(uuid::Uuid::new_v4(), "acct", 1);
        produce(&producer, &topic, "acct", &event, None).await;
    }
    let provider = dedup_kafka::OidcClientCredentials::new(&endpoint.url, "dedup-svc", "s3cret")
        .expect("provider")
        .scope("kafka");
    let running = start(
        oauthbearer(consumer(&store, &unique("g")))
            .oauth_token_provider(provider)
            .handle(&topic, record_payment),
    );
    running
        .wait_for("every payment applied", |s| s.applied == 20)
        .await;
    // Past a token's 60%: renewed at least once.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.dead_lettered), (20, 0));
    assert_eq!(balance(&pool).await, 20);
    let given = endpoint.given.load(Ordering::SeqCst);
    assert!(given >= 2, "the endpoint gave {given} tokens");
}

/// The identity provider refuses the client's secret: the start stops
/// within seconds with its reason (`invalid_client`), never the secret,
/// and nothing is consumed.
#[sqlx::test(migrations = false)]
async fn a_refused_client_secret_stops_the_start_with_the_identity_providers_reason(pool: PgPool) {
    let endpoint = dedup_tests::oidc::token_endpoint(Duration::from_secs(10)).await;
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let event = payment(uuid::Uuid::new_v4(), "acct", 1);
    produce(&producer(), &topic, "acct", &event, None).await;
    let provider =
        dedup_kafka::OidcClientCredentials::new(&endpoint.url, "dedup-svc", "wrong-secret-value")
            .expect("provider")
            .scope("kafka");
    let consumer = oauthbearer(consumer(&store, &unique("g")))
        .oauth_token_provider(provider)
        .handle(&topic, record_payment)
        .build()
        .expect("built");
    let ran = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run_until(std::future::pending()),
    )
    .await
    .expect("the start must not hang");
    let said = ran.expect_err("a refused secret").to_string();
    assert!(said.contains("refused its credentials"), "{said}");
    assert!(said.contains("invalid_client"), "{said}");
    assert!(!said.contains("wrong-secret-value"), "{said}");
    assert_eq!(balance(&pool).await, 0);
}

/// The SASL_SSL listener as the SCRAM user `dedup`.
fn scram(builder: ConsumerBuilder<PgStore>) -> ConsumerBuilder<PgStore> {
    let (brokers, settings) = common::secured_settings();
    settings
        .into_iter()
        .fold(builder.brokers(brokers), |b, (k, v)| b.set(k, v))
}

/// A principal missing an ACL: missing Read on the topic, then on the group,
/// then any right on the dead-letter topic, each stops the start with the
/// ACL to add named (`kafka-acls.sh` arguments), nothing consumed. Allowed
/// only to see the dead-letter topic, it starts: the malformed event holds
/// its partition (nothing committed past it, nothing dead-lettered) until
/// Write is granted, and then every event is applied or dead-lettered once.
#[sqlx::test(migrations = false)]
async fn a_missing_acl_is_named_at_start_or_holds_the_partition(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let dlq = format!("{topic}.dlq");
    let group = unique("g");
    let producer = producer();
    for _ in 0..20 {
        let event = payment(uuid::Uuid::new_v4(), "acct", 1);
        produce(&producer, &topic, "acct", &event, None).await;
    }
    produce(&producer, &topic, "acct", b"{not json", None).await;
    for _ in 0..5 {
        let event = payment(uuid::Uuid::new_v4(), "acct", 1);
        produce(&producer, &topic, "acct", &event, None).await;
    }
    let built = || {
        scram(consumer(&store, &group))
            .handle(&topic, record_payment)
            .build()
            .expect("built")
    };
    let refused = || common::start_error(30, built().run_until(std::future::pending()));
    common::each_missing_acl_is_named(refused, &topic, &group, &dlq).await;
    assert_eq!(balance(&pool).await, 0, "nothing applied while refused");
    assert_eq!(
        common::committed(&topic, &group, 0),
        rdkafka::Offset::Invalid
    );

    // Allowed to see the dead-letter topic but not to write it.
    let running = start(scram(consumer(&store, &group)).handle(&topic, record_payment));
    running
        .wait_for("the payments before the malformed event applied", |s| {
            s.applied >= 20
        })
        .await;
    // The dead letter refused, waited out as an outage: held, not skipped.
    running
        .wait_for("the refused dead letter waited out", |s| s.outages >= 1)
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = running.stats.snapshot();
    assert_eq!(held.dead_lettered, 0, "{held}");
    match common::committed(&topic, &group, 0) {
        rdkafka::Offset::Offset(at) => assert!(at <= 20, "committed past the held event: {at}"),
        other => assert_eq!(other, rdkafka::Offset::Invalid),
    }
    common::allow_dedup("Write", "--topic", &dlq);
    running
        .wait_for("every event applied or dead-lettered", |s| {
            s.applied == 25 && s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.dead_lettered), (25, 1));
    assert_eq!(balance(&pool).await, 25, "each payment applied once");
    assert_eq!(
        common::committed(&topic, &group, 0),
        rdkafka::Offset::Offset(26)
    );
    let dead = read_exactly(&brokers(), &dlq, 1).await;
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("decode"));
}
