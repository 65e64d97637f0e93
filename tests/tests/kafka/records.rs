//! What a handler sees of the record its event came in (`meta: &Meta`), in
//! every mode of the database runtime.

use super::*;

use std::sync::Mutex;

use dedup_core::{HandlerError, Lease, Meta};

/// One record as a handler saw it: (mode, topic, partition, offset, key,
/// tenant header, timestamp).
type Seen = (&'static str, String, i32, i64, String, String, i64);

/// What the handlers saw, in every test of this binary (each reads only its
/// own topics).
static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());

fn saw(mode: &'static str, meta: &Meta) {
    SEEN.lock().expect("lock").push((
        mode,
        meta.topic().to_owned(),
        meta.partition(),
        meta.offset(),
        meta.key_str().unwrap_or_default().to_owned(),
        meta.header_str("tenant").unwrap_or_default().to_owned(),
        meta.timestamp_millis().unwrap_or_default(),
    ));
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn one(tx: &mut PgTx, ev: PaymentReceived, meta: &Meta) -> Result<(), sqlx::Error> {
    saw("one", meta);
    credit(tx, &ev).await
}

#[idempotent(key = "event_id", ttl = "4h", batch)]
async fn many(
    tx: &mut PgTx,
    events: Vec<PaymentReceived>,
    meta: &[Meta],
) -> Result<(), sqlx::Error> {
    assert_eq!(events.len(), meta.len());
    for (ev, meta) in events.iter().zip(meta) {
        saw("many", meta);
        credit(tx, ev).await?;
    }
    Ok(())
}

#[idempotent(key = "event_id", ttl = "4h", lease = "30s")]
async fn leased(_lease: &Lease, _ev: PaymentReceived, meta: &Meta) -> Result<(), HandlerError> {
    saw("leased", meta);
    Ok(())
}

/// Each mode's handler sees each event's own record: the topic, partition
/// and offset the broker gave it, its key, its headers and its timestamp,
/// as produced. (Batches: one `Meta` per event, in order.)
#[sqlx::test(migrations = false)]
async fn handlers_see_the_record_of_each_event_in_every_mode(pool: PgPool) {
    let store = store(&pool).await;
    let topics = [
        ("one", create_topic(2).await),
        ("many", create_topic(2).await),
        ("leased", create_topic(2).await),
    ];
    let producer = producer();
    let mut produced = Vec::new();
    for (mode, topic) in &topics {
        for i in 0..4_i64 {
            let key = format!("acct-{i}");
            let at = 1_700_000_000_000 + i;
            let body = payment(uuid::Uuid::new_v4(), &key, 1);
            let tenant = format!("tenant-{i}");
            let record = FutureRecord::to(topic)
                .key(&key)
                .payload(&body)
                .timestamp(at)
                .headers(OwnedHeaders::new().insert(Header {
                    key: "tenant",
                    value: Some(&tenant),
                }));
            let delivery = producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)
                .expect("produced");
            produced.push((
                *mode,
                topic.clone(),
                delivery.partition,
                delivery.offset,
                key,
                tenant,
                at,
            ));
        }
    }
    let [(_, one_topic), (_, many_topic), (_, leased_topic)] = &topics;
    let stats = drain(
        Consumer::builder(store)
            .brokers(brokers())
            .group_id(unique("g"))
            .handle(one_topic, one)
            .handle(many_topic, many)
            .handle_leased(leased_topic, leased),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(stats.applied, 12, "{stats:?}");
    let mut seen: Vec<_> = SEEN
        .lock()
        .expect("lock")
        .iter()
        .filter(|s| topics.iter().any(|(_, t)| *t == s.1))
        .cloned()
        .collect();
    seen.sort();
    produced.sort();
    assert_eq!(seen, produced);
}
