//! The schema registry's client and Avro codec against a real registry
//! (Apicurio Registry's Confluent-compatible API, behind TLS and basic auth:
//! scripts/registry.sh): round trips, schema evolution, and every failure
//! sorted by whose fault it is.

// The derive writes paths from `apache_avro::`.
use dedup_registry::apache_avro;
use dedup_registry::avro::{AvroDecoder, AvroEncoder, AvroSchema, AvroSchemaText, readability};
use dedup_registry::{Fault, Registry, RegistryError, Schema, SchemaError, SchemaKind};
use dedup_tests::common::unique;
use dedup_tests::registry::{OwnRegistry, ca_file, client, client_of, credentials, url};

/// The first version of a payment.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, AvroSchema)]
#[avro(name = "PaymentRecorded")]
struct PaymentV1 {
    event_id: String,
    account_id: String,
    amount_cents: i64,
}

/// The next: a currency added, with a default.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, AvroSchema)]
#[avro(name = "PaymentRecorded")]
struct PaymentV2 {
    event_id: String,
    account_id: String,
    amount_cents: i64,
    #[avro(default = r#""EUR""#)]
    #[serde(default = "euro")]
    currency: String,
}

fn euro() -> String {
    "EUR".to_owned()
}

/// A reader that no longer wants the account: a field removed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, AvroSchema)]
#[avro(name = "PaymentRecorded")]
struct PaymentAmountOnly {
    event_id: String,
    amount_cents: i64,
}

/// A reader that needs a field no writer had, without a default.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, AvroSchema)]
#[avro(name = "PaymentRecorded")]
struct PaymentWithMerchant {
    event_id: String,
    amount_cents: i64,
    merchant: String,
}

fn v1(n: i64) -> PaymentV1 {
    PaymentV1 {
        event_id: format!("e-{n}"),
        account_id: "acct-1".to_owned(),
        amount_cents: 100 * n,
    }
}

#[tokio::test]
async fn avro_round_trips_through_the_registry_and_reads_evolved_schemas() {
    let registry = client();
    let subject = unique("payments-value");
    let writer_v1 = AvroEncoder::<PaymentV1>::register(&registry, &subject)
        .await
        .expect("register v1");
    // Registering the same schema again is the same id.
    let again = AvroEncoder::<PaymentV1>::register(&registry, &subject)
        .await
        .unwrap();
    assert_eq!(again.id(), writer_v1.id());
    let writer_v2 = AvroEncoder::<PaymentV2>::register(&registry, &subject)
        .await
        .expect("register v2");
    assert_ne!(writer_v1.id(), writer_v2.id());
    assert_eq!(registry.versions(&subject).await.unwrap(), vec![1, 2]);

    let old = writer_v1.encode(&v1(1)).unwrap();
    assert_eq!(old[0], 0, "magic byte");
    assert_eq!(old[1..5], writer_v1.id().to_be_bytes());
    let new = writer_v2
        .encode(&PaymentV2 {
            event_id: "e-2".to_owned(),
            account_id: "acct-2".to_owned(),
            amount_cents: 250,
            currency: "USD".to_owned(),
        })
        .unwrap();

    // The same type reads its own records.
    let same = AvroDecoder::<PaymentV1>::new(registry.clone());
    assert_eq!(same.decode_fetching(&old).await.unwrap(), v1(1));

    // A field added with a default: an old record reads with the default,
    // a new one with its value.
    let evolved = AvroDecoder::<PaymentV2>::new(registry.clone());
    let read_old = evolved.decode_fetching(&old).await.unwrap();
    assert_eq!(read_old.currency, "EUR");
    assert_eq!(read_old.amount_cents, 100);
    assert_eq!(evolved.decode_fetching(&new).await.unwrap().currency, "USD");

    // A field removed: old and new records both read without it.
    let narrow = AvroDecoder::<PaymentAmountOnly>::new(registry.clone());
    assert_eq!(
        narrow.decode_fetching(&new).await.unwrap(),
        PaymentAmountOnly {
            event_id: "e-2".to_owned(),
            amount_cents: 250
        }
    );
    assert_eq!(
        narrow.decode_fetching(&old).await.unwrap().amount_cents,
        100
    );

    // A reader that needs a field no writer had (no default): the record's
    // fault, with its schema id.
    let strict = AvroDecoder::<PaymentWithMerchant>::new(registry.clone());
    let err = strict.decode_fetching(&old).await.unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    assert_eq!(err.schema_id(), Some(writer_v1.id()));

    // The compatibility check says the same before a deploy.
    let report = readability(&registry, &subject, &PaymentV2::get_schema())
        .await
        .unwrap();
    assert!(report.all_readable(), "{report:?}");
    assert_eq!(report.versions.len(), 2);
    let report = readability(&registry, &subject, &PaymentWithMerchant::get_schema())
        .await
        .unwrap();
    assert!(!report.all_readable());
    assert!(
        report.versions.iter().all(|v| v
            .readable
            .as_ref()
            .is_err_and(|why| why.contains("merchant"))),
        "{report:?}"
    );
}

#[tokio::test]
async fn a_record_is_to_blame_for_its_frame_its_schema_id_and_its_bytes() {
    let registry = client();
    let subject = unique("payments-value");
    let writer = AvroEncoder::<PaymentV1>::register(&registry, &subject)
        .await
        .unwrap();
    let decoder = AvroDecoder::<PaymentV1>::new(registry.clone());

    // Not framed: plain JSON where Avro is expected.
    let err = decoder
        .decode_fetching(br#"{"event_id": "e"}"#)
        .await
        .unwrap_err();
    assert!(matches!(err, SchemaError::Frame(_)), "{err}");
    assert_eq!(err.fault(), Fault::Record);

    // An id the registry never gave.
    let mut unknown = writer.encode(&v1(1)).unwrap();
    unknown[1..5].copy_from_slice(&999_999u32.to_be_bytes());
    let err = decoder.decode_fetching(&unknown).await.unwrap_err();
    assert!(
        matches!(
            &err,
            SchemaError::Registry {
                id: 999_999,
                source: RegistryError::NotFound { .. }
            }
        ),
        "{err}"
    );
    assert_eq!(err.fault(), Fault::Record);

    // Bytes cut short, or trailing bytes.
    let good = writer.encode(&v1(2)).unwrap();
    let err = decoder
        .decode_fetching(&good[..good.len() - 3])
        .await
        .unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    let mut long = good.clone();
    long.extend_from_slice(b"xyz");
    let err = decoder.decode_fetching(&long).await.unwrap_err();
    assert!(err.to_string().contains("bytes follow"), "{err}");

    // A schema id that names a schema of another format.
    let proto = registry
        .register(
            &unique("protos-value"),
            &Schema::new(
                SchemaKind::Protobuf,
                "syntax = \"proto3\";\nmessage Paid { string event_id = 1; }\n",
            ),
        )
        .await
        .unwrap();
    let mut framed_proto = vec![0];
    framed_proto.extend_from_slice(&proto.to_be_bytes());
    framed_proto.extend_from_slice(&[0, 10, 1, b'e']);
    let err = decoder.decode_fetching(&framed_proto).await.unwrap_err();
    assert!(err.to_string().contains("PROTOBUF schema"), "{err}");
    assert_eq!(err.fault(), Fault::Record);

    // The good record still reads, and its schema is kept: asked once.
    assert_eq!(decoder.decode_fetching(&good).await.unwrap(), v1(2));
    assert!(registry.cached(writer.id()).is_some());
}

#[tokio::test]
async fn credentials_and_certificates_are_the_configurations_fault() {
    let subject = unique("payments-value");
    // Wrong password: 401.
    let (user, _) = credentials();
    let wrong = Registry::builder(url())
        .ca_file(ca_file())
        .basic_auth(&user, "not-the-password")
        .build()
        .unwrap();
    let err = wrong.versions(&subject).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::Refused { status: 401, .. }),
        "{err}"
    );
    assert_eq!(err.fault(), Fault::Configuration);
    assert!(!err.to_string().contains("not-the-password"));
    // No credentials: 401.
    let anonymous = Registry::builder(url()).ca_file(ca_file()).build().unwrap();
    let err = anonymous.schema(1).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::Refused { status: 401, .. }),
        "{err}"
    );
    // Signed in without the right: 403.
    let stranger = Registry::builder(url())
        .ca_file(ca_file())
        .basic_auth("stranger", "stranger-secret")
        .build()
        .unwrap();
    let err = stranger.schema(1).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::Refused { status: 403, .. }),
        "{err}"
    );
    assert_eq!(err.fault(), Fault::Configuration);
    // Through the decoder, a refusal is never the record's fault.
    let decoder = AvroDecoder::<PaymentV1>::new(stranger);
    let err = decoder
        .decode_fetching(&[0, 0, 0, 0, 1, 2])
        .await
        .unwrap_err();
    assert_eq!(err.fault(), Fault::Configuration, "{err}");

    // A registry whose certificate's CA is not trusted: the system's CAs
    // alone do not know the test CA.
    let (user, password) = credentials();
    let untrusting = Registry::builder(url())
        .basic_auth(user, password)
        .build()
        .unwrap();
    let err = untrusting.schema(1).await.unwrap_err();
    assert!(matches!(err, RegistryError::Certificate(_)), "{err}");
    assert_eq!(err.fault(), Fault::Configuration);
    assert!(err.to_string().contains("ca_file"), "{err}");

    // A URL that is not the registry's API (Apicurio's without
    // /apis/ccompat/v6): its 404 is no record's fault.
    let base = url().replace("/apis/ccompat/v6", "");
    let (user, password) = credentials();
    let elsewhere = Registry::builder(base)
        .ca_file(ca_file())
        .basic_auth(user, password)
        .build()
        .unwrap();
    let err = elsewhere.schema(1).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::Rejected { status: 404, .. }),
        "{err}"
    );
    assert_eq!(err.fault(), Fault::Configuration);
}

#[tokio::test]
async fn a_registry_that_is_down_is_an_outage_and_known_schemas_still_decode() {
    let own = OwnRegistry::start("registry-outage", 8186).await;
    let registry = client_of(&own.url);
    let subject = unique("payments-value");
    let writer = AvroEncoder::<PaymentV1>::register(&registry, &subject)
        .await
        .unwrap();
    let decoder = AvroDecoder::<PaymentV1>::new(registry.clone());
    let seen = writer.encode(&v1(1)).unwrap();
    assert_eq!(decoder.decode_fetching(&seen).await.unwrap(), v1(1));

    // A schema registered before the outage, not yet fetched.
    let writer_v2 = AvroEncoder::<PaymentV2>::register(&registry, &subject)
        .await
        .unwrap();
    let unseen = writer_v2
        .encode(&PaymentV2 {
            event_id: "e-9".to_owned(),
            account_id: "acct-9".to_owned(),
            amount_cents: 900,
            currency: "EUR".to_owned(),
        })
        .unwrap();

    // The registry crashes behind its load balancer: 502.
    own.run("kill").await;
    let err = decoder.decode_fetching(&unseen).await.unwrap_err();
    assert_eq!(err.fault(), Fault::Outage, "{err}");
    assert!(err.to_string().contains("502"), "{err}");
    // What was fetched before still decodes: nothing asked.
    assert_eq!(decoder.decode_fetching(&seen).await.unwrap(), v1(1));

    // Nothing answers at all.
    own.run("stop").await;
    let err = decoder.decode_fetching(&unseen).await.unwrap_err();
    assert_eq!(err.fault(), Fault::Outage, "{err}");

    // Back: the record that waited reads, with its own schema.
    own.run("start").await;
    let read = decoder.decode_fetching(&unseen).await.unwrap();
    assert_eq!((read.event_id.as_str(), read.amount_cents), ("e-9", 900));
}

#[tokio::test]
async fn a_producer_that_may_not_register_finds_its_schema_or_says_so() {
    let registry = client();
    let subject = unique("payments-value");
    let err = AvroEncoder::<PaymentV1>::lookup(&registry, &subject)
        .await
        .unwrap_err();
    assert!(matches!(err, SchemaError::Unregistered { .. }), "{err}");
    assert_eq!(err.fault(), Fault::Configuration);
    let registered = AvroEncoder::<PaymentV1>::register(&registry, &subject)
        .await
        .unwrap();
    let found = AvroEncoder::<PaymentV1>::lookup(&registry, &subject)
        .await
        .unwrap();
    assert_eq!(found.id(), registered.id());
    // A reader's schema of one's own, parsed from text.
    let reader = AvroSchemaText::parse_str(
        r#"{"type": "record", "name": "PaymentRecorded", "fields": [
            {"name": "event_id", "type": "string"}, {"name": "amount_cents", "type": "long"}]}"#,
    )
    .unwrap();
    let decoder = AvroDecoder::<PaymentAmountOnly>::with_reader_schema(registry, reader);
    let read = decoder
        .decode_fetching(&found.encode(&v1(3)).unwrap())
        .await
        .unwrap();
    assert_eq!(read.amount_cents, 300);
}

/// A payment as the Avro producers publish it (schema `PaymentRecorded`).
mod consumed {
    use dedup_core::{HandlerError, idempotent};
    use dedup_postgres::PgTx;
    // The derive writes paths from `apache_avro::`.
    use dedup_registry::apache_avro;
    use dedup_registry::avro::AvroSchema;

    /// What the handler reads: v2, whose `currency` v1 records lack.
    #[derive(Debug, serde::Deserialize, AvroSchema)]
    #[avro(name = "PaymentRecorded")]
    pub(crate) struct Payment {
        pub(crate) event_id: String,
        pub(crate) account_id: String,
        pub(crate) amount_cents: i64,
        #[avro(default = r#""EUR""#)]
        #[serde(default)]
        pub(crate) currency: String,
    }

    /// Credits the account (not idempotent by itself: a double apply shows)
    /// and counts the currencies seen.
    #[idempotent(key = "event_id", ttl = "4h", scope = "registry::record_avro")]
    pub(crate) async fn record_avro(tx: &mut PgTx, ev: Payment) -> Result<(), HandlerError> {
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(format!("{}:{}", ev.account_id, ev.currency))
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

async fn send(topic: &str, payload: &[u8]) {
    use rdkafka::producer::FutureRecord;
    dedup_tests::common::producer()
        .send(
            FutureRecord::<(), [u8]>::to(topic).payload(payload),
            std::time::Duration::from_secs(10),
        )
        .await
        .expect("produce");
}

/// Avro events through Kafka into PostgreSQL with the registry's schemas:
/// each applied once (an evolved writer's record too), the undecodable ones
/// dead-lettered once as they came; then, with the registry down, records
/// of a schema the consumer has not fetched wait (nothing dead-lettered,
/// nothing committed past them) and apply once it is back.
#[sqlx::test(migrations = false)]
async fn avro_events_apply_once_and_a_registry_outage_dead_letters_nothing(pool: sqlx::PgPool) {
    use dedup_tests::common::{create_topic, header, read_exactly, start};
    let own = OwnRegistry::start("registry-consumer", 8188).await;
    let registry = client_of(&own.url);
    let store = dedup_tests::store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("avro");
    let subject = format!("{topic}-value");
    let v1_writer = AvroEncoder::<PaymentV1>::register(&registry, &subject)
        .await
        .unwrap();
    let v2_writer = AvroEncoder::<PaymentV2>::register(&registry, &subject)
        .await
        .unwrap();
    let v2 = |n: i64, currency: &str| PaymentV2 {
        event_id: format!("e2-{n}"),
        account_id: "acct-2".to_owned(),
        amount_cents: n,
        currency: currency.to_owned(),
    };

    // v1 records (one twice), plain JSON, and a record of an unknown id.
    for n in 1..=3 {
        send(&topic, &v1_writer.encode(&v1(n)).unwrap()).await;
    }
    send(&topic, &v1_writer.encode(&v1(2)).unwrap()).await;
    send(&topic, br#"{"event_id": "json-1"}"#).await;
    let mut unknown = v1_writer.encode(&v1(9)).unwrap();
    unknown[1..5].copy_from_slice(&999_999u32.to_be_bytes());
    send(&topic, &unknown).await;

    let consumer = |group: &str| {
        dedup_kafka::Consumer::builder(store.clone())
            .brokers(dedup_tests::common::brokers())
            .group_id(group)
            .commit_interval(std::time::Duration::from_millis(200))
            .retry(quick_outage_retries())
            .handle(
                &topic,
                dedup_registry::AvroHandler::new(consumed::record_avro, registry.clone()),
            )
    };
    let running = start(consumer(&group));
    running
        .wait_for("the v1 records and the bad ones", |s| {
            s.applied == 3 && s.skipped == 1 && s.dead_lettered == 2
        })
        .await;
    assert_eq!(dedup_tests::balance(&pool, "acct-1:EUR").await, 600);
    let dead = read_exactly(&dedup_tests::common::brokers(), &format!("{topic}.dlq"), 2).await;
    for msg in &dead {
        assert_eq!(header(msg, "dedup.error.kind"), Some("decode"));
    }
    let reasons: Vec<&str> = dead
        .iter()
        .map(|m| header(m, "dedup.error.message").unwrap_or_default())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("magic byte")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("schema id 999999")),
        "{reasons:?}"
    );
    // The schema id a framed record names is a header of its own; a
    // record without the frame has none.
    let schema_ids: Vec<_> = dead
        .iter()
        .map(|m| header(m, "dedup.error.schema-id"))
        .collect();
    assert!(
        schema_ids.contains(&Some("999999")) && schema_ids.contains(&None),
        "{schema_ids:?}"
    );
    assert_eq!(
        dead.iter().find_map(|m| rdkafka::Message::payload(m)),
        Some(&br#"{"event_id": "json-1"}"#[..]),
        "kept as it came"
    );

    // The registry goes down; v2 records, whose schema the consumer has
    // never fetched, arrive meanwhile.
    own.run("kill").await;
    for n in 1..=4 {
        send(&topic, &v2_writer.encode(&v2(n, "USD")).unwrap()).await;
    }
    running
        .wait_for("the outage seen", |s| s.outages >= 1)
        .await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let during = running.stats.snapshot();
    assert_eq!((during.applied, during.dead_lettered), (3, 2), "{during}");
    own.run("start").await;
    running
        .wait_for("the waiting records applied", |s| s.applied == 7)
        .await;
    let after = running.stop().await;
    assert_eq!(
        (after.applied, after.skipped, after.dead_lettered),
        (7, 1, 2),
        "{after}"
    );
    assert_eq!(dedup_tests::balance(&pool, "acct-2:USD").await, 10);
    // Every record again, from the start, in a new group: the applied ones
    // are duplicates now (the bad ones were dead-lettered once already).
    let again = dedup_tests::common::drain(
        consumer(&unique("avro-again")),
        std::time::Duration::from_secs(2),
    )
    .await;
    assert_eq!((again.applied, again.skipped), (0, 8), "{again}");
}

/// Retries that wait at most a second between tries of an outage, so a
/// test sees the registry's return within its deadlines.
fn quick_outage_retries() -> dedup_kafka::RetryPolicy {
    dedup_kafka::RetryPolicy::default().with_outage_backoff(std::time::Duration::from_secs(1))
}

/// The Kafka-only runtime's handler: each payment out again, as Avro of the
/// output subject's schema (registered when the test starts).
mod forwarded {
    use dedup_core::{HandlerError, idempotent};
    use dedup_kafka::{OutputRecord, Outputs};
    use dedup_registry::avro::AvroEncoder;

    use super::PaymentV2;

    /// The output topic and its encoder, set once by the test.
    pub(crate) static OUT: std::sync::OnceLock<(String, AvroEncoder<PaymentV2>)> =
        std::sync::OnceLock::new();

    #[idempotent(key = "event_id", ttl = "4h", scope = "registry::forward_avro")]
    pub(crate) async fn forward_avro(out: &mut Outputs, ev: PaymentV2) -> Result<(), HandlerError> {
        let (topic, encoder) = OUT.get().expect("set by the test");
        let payload = encoder.encode(&ev).map_err(HandlerError::permanent)?;
        out.push(
            OutputRecord::new(topic)
                .key(ev.event_id.as_bytes())
                .payload(payload),
        );
        Ok(())
    }
}

/// The Kafka-only runtime reads Avro through the registry and writes Avro
/// of its output subject: every record out once, the undecodable ones (one
/// framed, its schema id in a header; one not) dead-lettered once; with the registry down, a batch of a schema not yet
/// fetched waits (nothing dead-lettered, nothing output), then goes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_only_runtime_reads_and_writes_avro_and_waits_out_the_registry() {
    use dedup_tests::common::{brokers, create_topic, header, read_exactly};
    let own = OwnRegistry::start("registry-kafka-only", 8190).await;
    let registry = client_of(&own.url);
    let topic = create_topic(1).await;
    let out = create_topic(1).await;
    let group = unique("avro-kafka-only");
    let v1_writer = AvroEncoder::<PaymentV1>::register(&registry, &format!("{topic}-value"))
        .await
        .unwrap();
    let v2_writer = AvroEncoder::<PaymentV2>::register(&registry, &format!("{topic}-value"))
        .await
        .unwrap();
    let out_writer = AvroEncoder::<PaymentV2>::register(&registry, &format!("{out}-value"))
        .await
        .unwrap();
    let out_id = out_writer.id();
    assert!(forwarded::OUT.set((out.clone(), out_writer)).is_ok());

    for n in 1..=3 {
        send(&topic, &v1_writer.encode(&v1(n)).unwrap()).await;
    }
    send(&topic, &v1_writer.encode(&v1(1)).unwrap()).await;
    let mut not_avro = vec![0];
    not_avro.extend_from_slice(&v1_writer.id().to_be_bytes());
    not_avro.extend_from_slice(b"not avro");
    send(&topic, &not_avro).await;
    send(&topic, b"no frame").await;

    // The registry is down before the consumer starts: it has fetched
    // nothing.
    own.run("kill").await;
    let consumer = dedup_kafka::TransactionalConsumer::builder(
        &topic,
        dedup_registry::AvroHandler::new(forwarded::forward_avro, registry.clone()),
    )
    .group_id(&group)
    .brokers(brokers())
    .retry(quick_outage_retries())
    .build()
    .expect("consumer");
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while stats.snapshot().outages == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no outage seen: {}",
            stats.snapshot()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let during = stats.snapshot();
    assert_eq!((during.applied, during.dead_lettered), (0, 0), "{during}");

    own.run("start").await;
    send(
        &topic,
        &v2_writer
            .encode(&PaymentV2 {
                event_id: "e-4".to_owned(),
                account_id: "acct-4".to_owned(),
                amount_cents: 400,
                currency: "USD".to_owned(),
            })
            .unwrap(),
    )
    .await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while stats.snapshot().applied < 4 || stats.snapshot().dead_lettered < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "not all out: {}",
            stats.snapshot()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    let after = task.await.expect("join").expect("consumer ran");
    assert_eq!(
        (after.applied, after.skipped, after.dead_lettered),
        (4, 1, 2),
        "{after}"
    );

    // The outputs are Avro of the output subject's schema, each once.
    let outputs = read_exactly(&brokers(), &out, 4).await;
    let reader = AvroDecoder::<PaymentV2>::new(registry.clone());
    let mut ids = Vec::new();
    for msg in &outputs {
        let payload = rdkafka::Message::payload(msg).expect("payload");
        assert_eq!(payload[1..5], out_id.to_be_bytes());
        let read = reader.decode_fetching(payload).await.unwrap();
        ids.push((read.event_id, read.currency));
    }
    ids.sort();
    assert_eq!(
        ids,
        [
            ("e-1", "EUR"),
            ("e-2", "EUR"),
            ("e-3", "EUR"),
            ("e-4", "USD")
        ]
        .map(|(id, c)| (id.to_owned(), c.to_owned()))
    );
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    assert_eq!(rdkafka::Message::payload(&dead[0]), Some(&not_avro[..]));
    assert_eq!(rdkafka::Message::payload(&dead[1]), Some(&b"no frame"[..]));
    assert_eq!(header(&dead[1], "dedup.error.schema-id"), None);
    let schema_id = v1_writer.id().to_string();
    assert_eq!(
        header(&dead[0], "dedup.error.schema-id"),
        Some(schema_id.as_str())
    );
}

/// A registry that refuses the consumer's credentials is a configuration
/// error: the consumer stops at the first record with the registry's
/// answer, and neither applies nor dead-letters nor commits anything.
#[sqlx::test(migrations = false)]
async fn refused_credentials_stop_the_consumer_without_a_dead_letter(pool: sqlx::PgPool) {
    use dedup_tests::common::{brokers, committed, create_topic};
    let store = dedup_tests::store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("avro-refused");
    let writer = AvroEncoder::<PaymentV1>::register(&client(), &format!("{topic}-value"))
        .await
        .unwrap();
    send(&topic, &writer.encode(&v1(1)).unwrap()).await;
    let stranger = Registry::builder(url())
        .ca_file(ca_file())
        .basic_auth("stranger", "stranger-secret")
        .build()
        .unwrap();
    let consumer = dedup_kafka::Consumer::builder(store)
        .brokers(brokers())
        .group_id(&group)
        .handle(
            &topic,
            dedup_registry::AvroHandler::new(consumed::record_avro, stranger),
        )
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    let ran = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        consumer.run_until(std::future::pending::<()>()),
    )
    .await
    .expect("stopped within a minute");
    let error = ran.expect_err("the consumer stops").to_string();
    assert!(error.contains("HTTP 403"), "{error}");
    assert!(!error.contains("stranger-secret"), "{error}");
    let snapshot = stats.snapshot();
    assert_eq!(
        (snapshot.applied, snapshot.dead_lettered),
        (0, 0),
        "{snapshot}"
    );
    assert_eq!(committed(&topic, &group, 0), rdkafka::Offset::Invalid);
}

/// `dedup check --reader-schema`: before a deploy, whether the handler's
/// schema reads every version of its topic's subject; non-zero exit when it
/// does not, naming the field.
#[tokio::test]
async fn dedup_check_says_whether_a_reader_schema_reads_every_version() {
    let registry = client();
    let topic = unique("checked");
    let subject = format!("{topic}-value");
    AvroEncoder::<PaymentV1>::register(&registry, &subject)
        .await
        .unwrap();
    AvroEncoder::<PaymentV2>::register(&registry, &subject)
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(unique("reader-schemas"));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, schema: AvroSchemaText| {
        let path = dir.join(name);
        std::fs::write(&path, serde_json::to_string(&schema).unwrap()).unwrap();
        path
    };
    let evolved = write("v2.avsc", PaymentV2::get_schema());
    let strict = write("strict.avsc", PaymentWithMerchant::get_schema());
    let (user, password) = credentials();
    let check = |schema: &std::path::Path| {
        let out = std::process::Command::new(dedup_tests::common::cli())
            .args(["check", "--topic", &topic, "--reader-schema"])
            .arg(schema)
            .args([
                "--registry",
                &url(),
                "--registry-user",
                &user,
                "--registry-ca",
                &ca_file(),
            ])
            .env("DEDUP_REGISTRY_PASSWORD", &password)
            .output()
            .expect("run dedup");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, said) = check(&evolved);
    assert!(ok, "{said}");
    assert!(
        said.contains("version 1") && said.contains("version 2"),
        "{said}"
    );
    assert!(said.contains("reads every version"), "{said}");
    let (ok, said) = check(&strict);
    assert!(!ok, "{said}");
    assert!(
        said.contains("NOT readable") && said.contains("merchant"),
        "{said}"
    );
    assert!(!said.contains(&password), "{said}");
    std::fs::remove_dir_all(dir).ok();
}

/// The `payments_avro` example against the real registry: each payment
/// credited once in its currency (version 1 records read with the
/// default), its duplicate skipped, and the two bad payloads dead-lettered
/// as they came. The example checks the balances itself and exits non-zero
/// if one is off.
#[sqlx::test(migrations = false)]
async fn the_payments_avro_example_applies_each_payment_once(pool: sqlx::PgPool) {
    use dedup_tests::common::{brokers, database_url, example, header, last_line, read_exactly};
    let topic = unique("payments-avro");
    let (user, password) = credentials();
    let output = tokio::task::spawn_blocking({
        let mut cmd = std::process::Command::new(example("payments_avro"));
        cmd.env("DATABASE_URL", database_url(&pool))
            .env("KAFKA_BROKERS", brokers())
            .env("TOPIC", &topic)
            .env("GROUP_ID", unique("payments-avro"))
            .env("DEDUP_REGISTRY_URL", url())
            .env("DEDUP_REGISTRY_USERNAME", user)
            .env("DEDUP_REGISTRY_PASSWORD", password)
            .env("DEDUP_REGISTRY_CA", ca_file());
        move || cmd.output().expect("run the payments_avro example")
    })
    .await
    .expect("join");
    assert!(
        output.status.success(),
        "the example's check failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(last_line(&output), "applied=10 skipped=10 dead_lettered=2");
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    for msg in &dead {
        assert_eq!(header(msg, "dedup.error.kind"), Some("decode"));
    }
    assert!(
        dead.iter()
            .any(|m| rdkafka::Message::payload(m) == Some(&br#"{"event_id": "json"}"#[..])),
        "kept as it came"
    );
}

/// JSON Schema: records validated against the schema their id names, then
/// read by serde; a field added (optional) reads in old and new records; a
/// record that breaks its schema is the record's fault, naming where.
#[tokio::test]
async fn json_schema_records_are_validated_then_read_and_evolve() {
    use dedup_registry::json::{JsonSchemaDecoder, JsonSchemaEncoder};
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Paid {
        event_id: String,
        amount_cents: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        currency: Option<String>,
    }
    const V1: &str = r#"{"type": "object", "required": ["event_id", "amount_cents"],
        "properties": {"event_id": {"type": "string", "minLength": 1},
                       "amount_cents": {"type": "integer", "minimum": 0}}}"#;
    const V2: &str = r#"{"type": "object", "required": ["event_id", "amount_cents"],
        "properties": {"event_id": {"type": "string", "minLength": 1},
                       "amount_cents": {"type": "integer", "minimum": 0},
                       "currency": {"type": "string", "enum": ["EUR", "USD"]}}}"#;
    let registry = client();
    let subject = unique("paid-json-value");
    let v1 = JsonSchemaEncoder::<Paid>::register(&registry, &subject, V1)
        .await
        .unwrap();
    let v2 = JsonSchemaEncoder::<Paid>::register(&registry, &subject, V2)
        .await
        .unwrap();
    assert_ne!(v1.id(), v2.id());
    let old = v1
        .encode(&Paid {
            event_id: "e1".into(),
            amount_cents: 100,
            currency: None,
        })
        .unwrap();
    let new = v2
        .encode(&Paid {
            event_id: "e2".into(),
            amount_cents: 200,
            currency: Some("USD".into()),
        })
        .unwrap();
    let decoder = JsonSchemaDecoder::<Paid>::new(registry.clone());
    assert_eq!(decoder.decode_fetching(&old).await.unwrap().currency, None);
    assert_eq!(
        decoder
            .decode_fetching(&new)
            .await
            .unwrap()
            .currency
            .as_deref(),
        Some("USD")
    );

    // A value its own schema refuses is not sent.
    let err = v2
        .encode(&Paid {
            event_id: "e3".into(),
            amount_cents: 1,
            currency: Some("GBP".into()),
        })
        .unwrap_err();
    assert_eq!(err.fault(), Fault::Configuration, "{err}");

    // Records that break their schema: the record's fault, saying where.
    let framed = |id: u32, json: &str| {
        let mut p = vec![0];
        p.extend_from_slice(&id.to_be_bytes());
        p.extend_from_slice(json.as_bytes());
        p
    };
    let err = decoder
        .decode_fetching(&framed(
            v2.id(),
            r#"{"event_id": "e4", "amount_cents": -5}"#,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    assert!(err.to_string().contains("amount_cents"), "{err}");
    let err = decoder
        .decode_fetching(&framed(v1.id(), r#"{"amount_cents": 5}"#))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("event_id"), "{err}");
    let err = decoder
        .decode_fetching(&framed(v1.id(), "{not json"))
        .await
        .unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    // An Avro schema's id where JSON Schema is expected.
    let avro = AvroEncoder::<PaymentV1>::register(&registry, &unique("avro-value"))
        .await
        .unwrap();
    let err = decoder
        .decode_fetching(&framed(
            avro.id(),
            r#"{"event_id": "e5", "amount_cents": 5}"#,
        ))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("AVRO schema"), "{err}");
}

/// A JSON Schema that refers to another registered one (`$ref` by the
/// reference's name): the referred schema is fetched from its subject and
/// applies, and a `$ref` to anything else is never fetched.
#[tokio::test]
async fn json_schemas_follow_their_references_in_the_registry() {
    use dedup_registry::SchemaReference;
    use dedup_registry::json::JsonSchemaDecoder;
    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Address {
        city: String,
    }
    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Order {
        event_id: String,
        to: Address,
    }
    let registry = client();
    let address_subject = unique("address-value");
    registry
        .register(
            &address_subject,
            &Schema::new(
                SchemaKind::Json,
                r#"{"type": "object", "required": ["city"],
                    "properties": {"city": {"type": "string", "minLength": 2}}}"#,
            ),
        )
        .await
        .unwrap();
    let order = Schema {
        references: vec![SchemaReference {
            name: "address.json".into(),
            subject: address_subject.clone(),
            version: 1,
        }],
        ..Schema::new(
            SchemaKind::Json,
            r#"{"type": "object", "required": ["event_id", "to"],
                "properties": {"event_id": {"type": "string"},
                               "to": {"$ref": "address.json"}}}"#,
        )
    };
    let order_id = registry
        .register(&unique("order-value"), &order)
        .await
        .unwrap();
    let framed = |id: u32, json: &str| [&[0][..], &id.to_be_bytes(), json.as_bytes()].concat();
    let decoder = JsonSchemaDecoder::<Order>::new(registry.clone());
    let read = decoder
        .decode_fetching(&framed(
            order_id,
            r#"{"event_id": "o1", "to": {"city": "Lyon"}}"#,
        ))
        .await
        .unwrap();
    assert_eq!(read.to.city, "Lyon");
    // The referred schema's rule holds inside the referring one.
    let err = decoder
        .decode_fetching(&framed(
            order_id,
            r#"{"event_id": "o2", "to": {"city": "L"}}"#,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    assert!(err.to_string().contains("/to/city"), "{err}");

    // Two references whose names end alike: each `$ref` gets its own.
    let zip_subject = unique("zip-value");
    registry
        .register(
            &zip_subject,
            &Schema::new(
                SchemaKind::Json,
                r#"{"type": "object", "required": ["zip"], "properties": {"zip": {"type": "string"}}}"#,
            ),
        )
        .await
        .unwrap();
    let both = Schema {
        references: vec![
            SchemaReference {
                name: "v2/address.json".into(),
                subject: zip_subject,
                version: 1,
            },
            SchemaReference {
                name: "address.json".into(),
                subject: address_subject.clone(),
                version: 1,
            },
        ],
        ..Schema::new(
            SchemaKind::Json,
            r#"{"type": "object", "properties": {"to": {"$ref": "address.json"},
                                                "from": {"$ref": "v2/address.json"}}}"#,
        )
    };
    let both_id = registry
        .register(&unique("both-value"), &both)
        .await
        .unwrap();
    let read = decoder
        .decode_fetching(&framed(
            both_id,
            r#"{"event_id": "o3", "to": {"city": "Lyon"}, "from": {"zip": "69001"}}"#,
        ))
        .await
        .unwrap();
    assert_eq!(read.event_id, "o3");
    let err = decoder
        .decode_fetching(&framed(
            both_id,
            r#"{"event_id": "o4", "to": {"city": "Lyon"}, "from": {"city": "Lyon"}}"#,
        ))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("zip"), "{err}");

    // A `$ref` to a schema that is not among its references.
    let elsewhere = registry
        .register(
            &unique("elsewhere-value"),
            &Schema::new(
                SchemaKind::Json,
                r#"{"type": "object", "properties": {"to": {"$ref": "https://example.com/a.json"}}}"#,
            ),
        )
        .await
        .unwrap();
    let err = decoder
        .decode_fetching(&framed(elsewhere, r#"{"to": {}}"#))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("not among the schema's references"),
        "{err}"
    );
}

/// JSON Schema events through the database runtime: the valid ones applied
/// once, the one that breaks its schema dead-lettered as it came.
#[sqlx::test(migrations = false)]
async fn json_schema_events_apply_once_and_invalid_ones_are_dead_lettered(pool: sqlx::PgPool) {
    use dedup_registry::json::JsonSchemaEncoder;
    use dedup_tests::common::{brokers, create_topic, drain, header, read_exactly};
    const SCHEMA: &str = r#"{"type": "object", "required": ["event_id", "account_id", "amount_cents"],
        "properties": {"event_id": {"type": "string"}, "account_id": {"type": "string"},
                       "amount_cents": {"type": "integer", "minimum": 1},
                       "currency": {"type": "string"}}}"#;
    let registry = client();
    let store = dedup_tests::store(&pool).await;
    let topic = create_topic(1).await;
    let writer =
        JsonSchemaEncoder::<PaymentV2>::register(&registry, &format!("{topic}-value"), SCHEMA)
            .await
            .unwrap();
    for n in 1..=3 {
        let payment = PaymentV2 {
            event_id: format!("j-{n}"),
            account_id: "acct-j".to_owned(),
            amount_cents: n,
            currency: "EUR".to_owned(),
        };
        send(&topic, &writer.encode(&payment).unwrap()).await;
        send(&topic, &writer.encode(&payment).unwrap()).await;
    }
    let mut invalid = vec![0];
    invalid.extend_from_slice(&writer.id().to_be_bytes());
    invalid.extend_from_slice(br#"{"event_id": "j-9", "account_id": "acct-j", "amount_cents": 0}"#);
    send(&topic, &invalid).await;
    let stats = drain(
        dedup_kafka::Consumer::builder(store)
            .brokers(brokers())
            .group_id(unique("json-schema"))
            .commit_interval(std::time::Duration::from_millis(200))
            .handle(
                &topic,
                dedup_registry::JsonSchemaHandler::new(consumed::record_avro, registry),
            ),
        std::time::Duration::from_secs(2),
    )
    .await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (3, 3, 1),
        "{stats}"
    );
    assert_eq!(dedup_tests::balance(&pool, "acct-j:EUR").await, 6);
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("decode"));
    assert_eq!(
        rdkafka::Message::payload(&dead[0]),
        Some(&invalid[..]),
        "kept as it came"
    );
    let reason = header(&dead[0], "dedup.error.message").unwrap_or_default();
    assert!(reason.contains("amount_cents"), "{reason}");
    let schema_id = writer.id().to_string();
    assert_eq!(
        header(&dead[0], "dedup.error.schema-id"),
        Some(schema_id.as_str())
    );
}

/// Protobuf payments as prost reads them: v2 of `shop.v1.PaymentRecorded`
/// (`currency` added as field 4; v1 records lack it).
mod protos {
    use dedup_core::{HandlerError, idempotent};
    use dedup_postgres::PgTx;

    /// The first `.proto`: a refund declared before the payment, so the
    /// payment is message 1 of the file (its records carry indexes `[1]`).
    pub(crate) const V1: &str = r#"
        syntax = "proto3";
        package shop.v1;
        // A refund, not a payment.
        message Refunded { string event_id = 1; int64 amount_cents = 2; }
        message PaymentRecorded {
          string event_id = 1;
          string account_id = 2;
          int64 amount_cents = 3;
          map<string, string> labels = 5;
          message Source { string system = 1; }
        }
    "#;

    /// The next: `currency` added, `account_id` removed (its number kept
    /// reserved), a nested type moved.
    pub(crate) const V2: &str = r#"
        syntax = "proto3";
        package shop.v1;
        message Refunded { string event_id = 1; int64 amount_cents = 2; }
        message PaymentRecorded {
          message Source { string system = 1; }
          string event_id = 1;
          reserved 2;
          int64 amount_cents = 3;
          string currency = 4;
        }
    "#;

    /// The handler's type.
    #[derive(Clone, PartialEq, prost::Message)]
    pub(crate) struct PaymentRecorded {
        #[prost(string, tag = "1")]
        pub(crate) event_id: String,
        #[prost(string, tag = "2")]
        pub(crate) account_id: String,
        #[prost(int64, tag = "3")]
        pub(crate) amount_cents: i64,
        #[prost(string, tag = "4")]
        pub(crate) currency: String,
    }

    impl prost::Name for PaymentRecorded {
        const NAME: &'static str = "PaymentRecorded";
        const PACKAGE: &'static str = "shop.v1";
    }

    /// Another message of the same file.
    #[derive(Clone, PartialEq, prost::Message)]
    pub(crate) struct Refunded {
        #[prost(string, tag = "1")]
        pub(crate) event_id: String,
        #[prost(int64, tag = "2")]
        pub(crate) amount_cents: i64,
    }

    impl prost::Name for Refunded {
        const NAME: &'static str = "Refunded";
        const PACKAGE: &'static str = "shop.v1";
    }

    /// Credits the account in its currency (no currency: v1, euros).
    #[idempotent(
        key = "event_id",
        ttl = "4h",
        format = "protobuf",
        scope = "registry::proto"
    )]
    pub(crate) async fn record_proto(
        tx: &mut PgTx,
        ev: PaymentRecorded,
    ) -> Result<(), HandlerError> {
        let currency = if ev.currency.is_empty() {
            "EUR"
        } else {
            &ev.currency
        };
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(format!("{}:{currency}", ev.account_id))
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

fn proto_payment(n: i64, currency: &str) -> protos::PaymentRecorded {
    protos::PaymentRecorded {
        event_id: format!("p-{n}"),
        account_id: "acct-p".to_owned(),
        amount_cents: n,
        currency: currency.to_owned(),
    }
}

/// Protobuf: each record's message indexes placed in its schema's `.proto`
/// file and checked to be the handler's type; records of an evolved file
/// (a field added, one removed) read both ways; a record of another message
/// type, of indexes the file lacks, of bytes prost cannot read or of another
/// format's schema is the record's fault, saying which.
#[tokio::test]
async fn protobuf_records_are_placed_by_their_message_indexes_and_evolve() {
    use dedup_registry::protobuf::{ProtobufDecoder, ProtobufEncoder};
    use protos::{PaymentRecorded, Refunded};
    let registry = client();
    let subject = unique("paid-proto-value");
    let v1 = ProtobufEncoder::<PaymentRecorded>::register(&registry, &subject, protos::V1)
        .await
        .unwrap();
    let v2 = ProtobufEncoder::<PaymentRecorded>::register(&registry, &subject, protos::V2)
        .await
        .unwrap();
    assert_ne!(v1.id(), v2.id());
    let old = v1.encode(&proto_payment(1, ""));
    let new = v2.encode(&PaymentRecorded {
        account_id: String::new(),
        ..proto_payment(2, "USD")
    });
    let frame = dedup_core::decode::ConfluentFrame::parse_protobuf(&old).unwrap();
    assert_eq!(frame.message_indexes, [1], "the file's second message");

    let decoder = ProtobufDecoder::<PaymentRecorded>::new(registry.clone());
    assert_eq!(
        decoder.decode_fetching(&old).await.unwrap(),
        proto_payment(1, "")
    );
    let read = decoder.decode_fetching(&new).await.unwrap();
    assert_eq!((read.currency.as_str(), read.amount_cents), ("USD", 2));

    // Another message of the same file: told apart by the indexes alone.
    let refunds = ProtobufEncoder::<Refunded>::register(&registry, &subject, protos::V2)
        .await
        .unwrap();
    assert_eq!(refunds.id(), v2.id(), "the same file, the same id");
    let refund = refunds.encode(&Refunded {
        event_id: "r-1".into(),
        amount_cents: 5,
    });
    let err = decoder.decode_fetching(&refund).await.unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    assert!(
        err.to_string()
            .contains("it is a shop.v1.Refunded, and the handler reads shop.v1.PaymentRecorded"),
        "{err}"
    );
    // The nested type of a payment, and an index the file does not have.
    let mut nested = vec![0];
    nested.extend_from_slice(&v2.id().to_be_bytes());
    nested.extend_from_slice(&[4, 2, 0, 10, 1, b'x']); // indexes [1, 0]
    let err = decoder.decode_fetching(&nested).await.unwrap_err();
    assert!(err.to_string().contains("PaymentRecorded.Source"), "{err}");
    let mut missing = vec![0];
    missing.extend_from_slice(&v2.id().to_be_bytes());
    missing.extend_from_slice(&[2, 14, 10, 1, b'x']); // indexes [7]
    let err = decoder.decode_fetching(&missing).await.unwrap_err();
    assert!(err.to_string().contains("name no message type"), "{err}");
    // Bytes prost cannot read: a varint cut short.
    let mut cut = v2.encode(&proto_payment(3, "EUR"));
    cut.extend_from_slice(&[0x18, 0xff]);
    let err = decoder.decode_fetching(&cut).await.unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    // Malformed indexes, and an Avro schema's id.
    let mut bad_indexes = vec![0];
    bad_indexes.extend_from_slice(&v2.id().to_be_bytes());
    bad_indexes.push(0xff);
    let err = decoder.decode_fetching(&bad_indexes).await.unwrap_err();
    assert!(matches!(err, SchemaError::Frame(_)), "{err}");
    let avro = AvroEncoder::<PaymentV1>::register(&registry, &unique("avro-value"))
        .await
        .unwrap();
    let mut avro_id = vec![0];
    avro_id.extend_from_slice(&avro.id().to_be_bytes());
    avro_id.push(0);
    let err = decoder.decode_fetching(&avro_id).await.unwrap_err();
    assert!(err.to_string().contains("AVRO schema"), "{err}");
    assert_eq!(err.fault(), Fault::Record);

    // In V1 a map field comes before the nested `Source`: protoc counts its
    // entry type, Confluent's Java client does not. `[1, 0]` is the entry
    // to one (never a record's type) and `Source` to the other: a Source.
    let v1_nested = [&old[..5], &[4, 2, 0, 10, 1, b'x'][..]].concat();
    let err = decoder.decode_fetching(&v1_nested).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("it is a shop.v1.PaymentRecorded.Source"),
        "{err}"
    );

    // A nested type after a map field, with a sibling after it: `[0, 1]`
    // is the payment as protoc counts and the refund as Java counts, so
    // it is refused rather than guessed; the encoder writes `[0, 0]`,
    // which only one count reads as a type at all.
    const ENVELOPE: &str = "syntax = \"proto3\"; package shop.v1;
        message Envelope {
          map<string, string> meta = 1;
          message Payment { string event_id = 1; }
          message Refund { string event_id = 1; }
        }";
    #[derive(Clone, PartialEq, prost::Message)]
    struct EnvelopePayment {
        #[prost(string, tag = "1")]
        event_id: String,
    }
    impl prost::Name for EnvelopePayment {
        const NAME: &'static str = "Envelope.Payment";
        const PACKAGE: &'static str = "shop.v1";
    }
    let envelopes =
        ProtobufEncoder::<EnvelopePayment>::register(&registry, &unique("env-value"), ENVELOPE)
            .await
            .unwrap();
    let payment = EnvelopePayment {
        event_id: "env-1".into(),
    };
    let written = envelopes.encode(&payment);
    let frame = dedup_core::decode::ConfluentFrame::parse_protobuf(&written).unwrap();
    assert_eq!(frame.message_indexes, [0, 0]);
    let reader = ProtobufDecoder::<EnvelopePayment>::new(registry.clone());
    assert_eq!(reader.decode_fetching(&written).await.unwrap(), payment);
    let ambiguous = [&written[..5], &[4, 0, 2, 10, 1, b'y'][..]].concat(); // [0, 1]
    let err = reader.decode_fetching(&ambiguous).await.unwrap_err();
    assert_eq!(err.fault(), Fault::Record, "{err}");
    assert!(err.to_string().contains("cannot be told"), "{err}");

    // A producer: a file that does not declare its type is refused before
    // anything is registered; one that may not register finds its file.
    let err = ProtobufEncoder::<PaymentRecorded>::register(
        &registry,
        &unique("other-value"),
        "syntax = \"proto3\"; package shop.v2; message PaymentRecorded {}",
    )
    .await
    .unwrap_err();
    assert_eq!(err.fault(), Fault::Configuration, "{err}");
    assert!(err.to_string().contains("shop.v1.PaymentRecorded"), "{err}");
    let v2_schema = Schema::new(SchemaKind::Protobuf, protos::V2);
    let found = ProtobufEncoder::<PaymentRecorded>::lookup(&registry, &subject, &v2_schema)
        .await
        .unwrap();
    assert_eq!(found.id(), v2.id());
    let err =
        ProtobufEncoder::<PaymentRecorded>::lookup(&registry, &unique("none-value"), &v2_schema)
            .await
            .unwrap_err();
    assert!(matches!(err, SchemaError::Unregistered { .. }), "{err}");
}

/// Protobuf events through Kafka into PostgreSQL: v1 and v2 records applied
/// once each, the duplicates skipped, a record of another message type and
/// one of an unknown schema id dead-lettered as they came.
#[sqlx::test(migrations = false)]
async fn protobuf_events_apply_once_and_other_types_are_dead_lettered(pool: sqlx::PgPool) {
    use dedup_registry::protobuf::ProtobufEncoder;
    use dedup_tests::common::{brokers, create_topic, drain, header, read_exactly};
    let registry = client();
    let store = dedup_tests::store(&pool).await;
    let topic = create_topic(1).await;
    let subject = format!("{topic}-value");
    let v1 = ProtobufEncoder::<protos::PaymentRecorded>::register(&registry, &subject, protos::V1)
        .await
        .unwrap();
    let v2 = ProtobufEncoder::<protos::PaymentRecorded>::register(&registry, &subject, protos::V2)
        .await
        .unwrap();
    for n in 1..=3 {
        let old = v1.encode(&proto_payment(n, ""));
        send(&topic, &old).await;
        send(&topic, &old).await;
        send(&topic, &v2.encode(&proto_payment(10 + n, "USD"))).await;
    }
    let refunds = ProtobufEncoder::<protos::Refunded>::register(&registry, &subject, protos::V2)
        .await
        .unwrap();
    let refund = refunds.encode(&protos::Refunded {
        event_id: "r-1".into(),
        amount_cents: 99,
    });
    send(&topic, &refund).await;
    let mut unknown = v2.encode(&proto_payment(20, "USD"));
    unknown[1..5].copy_from_slice(&999_998u32.to_be_bytes());
    send(&topic, &unknown).await;
    let stats = drain(
        dedup_kafka::Consumer::builder(store)
            .brokers(brokers())
            .group_id(unique("protobuf"))
            .commit_interval(std::time::Duration::from_millis(200))
            .handle(
                &topic,
                dedup_registry::ProtobufHandler::new(protos::record_proto, registry),
            ),
        std::time::Duration::from_secs(2),
    )
    .await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (6, 3, 2),
        "{stats}"
    );
    assert_eq!(dedup_tests::balance(&pool, "acct-p:EUR").await, 6);
    assert_eq!(dedup_tests::balance(&pool, "acct-p:USD").await, 36);
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    let payloads: Vec<_> = dead.iter().map(rdkafka::Message::payload).collect();
    assert_eq!(
        payloads,
        [Some(&refund[..]), Some(&unknown[..])],
        "kept as they came"
    );
    for record in &dead {
        assert_eq!(header(record, "dedup.error.kind"), Some("decode"));
    }
    let reason = header(&dead[0], "dedup.error.message").unwrap_or_default();
    assert!(reason.contains("shop.v1.Refunded"), "{reason}");
    let reason = header(&dead[1], "dedup.error.message").unwrap_or_default();
    assert!(reason.contains("999998"), "{reason}");
    let schema_id = v2.id().to_string();
    assert_eq!(
        header(&dead[0], "dedup.error.schema-id"),
        Some(schema_id.as_str())
    );
    assert_eq!(header(&dead[1], "dedup.error.schema-id"), Some("999998"));
}

/// A registry that answers only after `delay` (milliseconds, changeable
/// while it runs) every request for a schema by id with the same Avro
/// schema: a slow registry, on plain HTTP on loopback.
fn slow_registry(delay: std::sync::Arc<std::sync::atomic::AtomicU64>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let schema = serde_json::to_string(&PaymentV1::get_schema()).expect("schema");
    let body = serde_json::json!({ "schema": schema }).to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let (delay, body) = (delay.clone(), body.clone());
            std::thread::spawn(move || {
                let mut request = Vec::new();
                let mut buf = [0; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let wait = delay.load(std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(wait));
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/vnd.schemaregistry.v1+json\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    url
}

/// A registry slower than the client's timeout is an outage (waited out,
/// never the record's fault); once it answers in time, the same record
/// reads.
#[tokio::test]
async fn a_slow_registry_is_an_outage_until_it_answers_in_time() {
    use dedup_core::decode::{Prepare, Unready};
    let delay = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(3_000));
    let registry = Registry::builder(slow_registry(delay.clone()))
        .timeout(std::time::Duration::from_millis(500))
        .build()
        .unwrap();
    let decoder = AvroDecoder::<PaymentV1>::new(registry);
    let mut record = vec![0, 0, 0, 0, 7];
    apache_avro::write_avro_datum_ref(&PaymentV1::get_schema(), &v1(4), &mut record).unwrap();

    let started = std::time::Instant::now();
    let err = decoder.decode_fetching(&record).await.unwrap_err();
    assert_eq!(err.fault(), Fault::Outage, "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(3),
        "the timeout, not the registry, ended the wait"
    );
    let unready = Prepare::prepare(&decoder, &record).await.unwrap_err();
    assert!(matches!(unready, Unready::Outage(_)), "{unready}");

    // Slow, but within the timeout: read.
    delay.store(100, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(decoder.decode_fetching(&record).await.unwrap(), v1(4));
}

/// A lease-mode handler (an effect outside the database) reading Avro.
mod leased {
    use dedup_core::{HandlerError, Lease, idempotent};

    /// Each effect, by event id: a double call shows.
    pub(crate) static CALLS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

    #[idempotent(
        key = "event_id",
        ttl = "4h",
        lease = "30s",
        scope = "registry::leased"
    )]
    pub(crate) async fn notify(
        lease: &Lease,
        ev: super::consumed::Payment,
    ) -> Result<(), HandlerError> {
        let _ = lease;
        CALLS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("{}:{}", ev.event_id, ev.currency));
        Ok(())
    }
}

/// Lease mode reads through the registry too: each Avro event's effect
/// runs once (a v1 record's currency from the reader's default), the
/// duplicate is skipped, the record of an unknown schema id dead-lettered
/// with its id.
#[sqlx::test(migrations = false)]
async fn lease_mode_handlers_read_avro_through_the_registry(pool: sqlx::PgPool) {
    use dedup_tests::common::{brokers, create_topic, drain, header, read_exactly};
    let registry = client();
    let store = dedup_tests::store(&pool).await;
    let topic = create_topic(1).await;
    let writer = AvroEncoder::<PaymentV1>::register(&registry, &format!("{topic}-value"))
        .await
        .unwrap();
    let mut payment = v1(1);
    payment.event_id = format!("{topic}-1");
    send(&topic, &writer.encode(&payment).unwrap()).await;
    send(&topic, &writer.encode(&payment).unwrap()).await;
    payment.event_id = format!("{topic}-2");
    send(&topic, &writer.encode(&payment).unwrap()).await;
    let mut unknown = writer.encode(&payment).unwrap();
    unknown[1..5].copy_from_slice(&999_997u32.to_be_bytes());
    send(&topic, &unknown).await;
    let stats = drain(
        dedup_kafka::Consumer::builder(store)
            .brokers(brokers())
            .group_id(unique("leased"))
            .commit_interval(std::time::Duration::from_millis(200))
            .handle_leased(
                &topic,
                dedup_registry::AvroHandler::new(leased::notify, registry),
            ),
        std::time::Duration::from_secs(2),
    )
    .await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (2, 1, 1),
        "{stats}"
    );
    let mut calls: Vec<String> = leased::CALLS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|c| c.starts_with(&topic))
        .cloned()
        .collect();
    calls.sort();
    assert_eq!(calls, [format!("{topic}-1:EUR"), format!("{topic}-2:EUR")]);
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.error.schema-id"), Some("999997"));
}
