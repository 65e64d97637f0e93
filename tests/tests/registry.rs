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
