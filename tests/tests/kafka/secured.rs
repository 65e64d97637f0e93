//! Through the broker's SASL_SSL listener with OAUTHBEARER tokens from a
//! token provider in code (scripts/kafka.sh: unsigned JWTs accepted,
//! sessions re-authenticated when their token expires).

use super::*;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::SystemTime;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use dedup_kafka::{OAuthToken, TokenError};

/// An unsigned JWT for `principal`, valid for `life` (what the test broker's
/// unsecured validator accepts; a real provider's is signed).
fn unsigned_jwt(principal: &str, life: Duration) -> OAuthToken {
    let now = SystemTime::now();
    let secs = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64()
    };
    let expires = now + life;
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#);
    let claims = URL_SAFE_NO_PAD.encode(
        serde_json::json!({ "sub": principal, "iat": secs(now) - 1.0, "exp": secs(expires) })
            .to_string(),
    );
    OAuthToken::new(format!("{header}.{claims}."), principal, expires)
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
        asked > 10,
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
