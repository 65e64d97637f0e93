//! Events that are not JSON, end to end (real Kafka, real PostgreSQL): the
//! protobuf example decodes plain Protobuf (`format = "protobuf"`) and
//! Confluent's schema-registry wire format (`decode = from_registry`).

use dedup_tests::common;

use common::{brokers, database_url, example, header, last_line, read_exactly, unique};
use rdkafka::Message as _;
use sqlx::PgPool;

/// Each payment of both topics is credited once, its duplicate skipped,
/// and the two payloads that do not decode (not Protobuf; a schema id the
/// service does not know) are dead-lettered as they came, with kind
/// `decode`. The example checks the balances itself and exits non-zero if
/// one is off.
#[sqlx::test(migrations = false)]
async fn protobuf_and_registry_framed_events_apply_once_and_bad_ones_are_dead_lettered(
    pool: PgPool,
) {
    let topic = unique("proto");
    let group = unique("proto");
    let output = tokio::task::spawn_blocking({
        let mut cmd = std::process::Command::new(example("protobuf"));
        cmd.env("DATABASE_URL", database_url(&pool))
            .env("KAFKA_BROKERS", brokers())
            .env("TOPIC", &topic)
            .env("GROUP_ID", &group);
        move || cmd.output().expect("run the protobuf example")
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

    let plain = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(
        plain[0].payload(),
        Some(&[0x00, 0x01][..]),
        "kept as it came"
    );
    assert_eq!(header(&plain[0], "dedup.error.kind"), Some("decode"));
    let framed = read_exactly(&brokers(), &format!("{topic}-registry.dlq"), 1).await;
    assert_eq!(
        framed[0].payload().map(|p| &p[..6]),
        Some(&[0, 0, 0, 0, 7, 0][..])
    );
    assert_eq!(header(&framed[0], "dedup.error.kind"), Some("decode"));
    let message = header(&framed[0], "dedup.error.message").unwrap_or_default();
    assert!(message.contains("schema id 7"), "{message}");
}
