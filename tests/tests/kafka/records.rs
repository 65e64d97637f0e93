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

#[derive(serde::Deserialize)]
struct OrderEvent {
    id: String,
}

/// Logs what it applied, in order, in the effect's transaction.
async fn log(tx: &mut PgTx, kind: &str, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO typed_log (kind, id) VALUES ($1, $2)")
        .bind(kind)
        .bind(id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(key = "id", ttl = "4h")]
async fn order_placed(tx: &mut PgTx, ev: OrderEvent) -> Result<(), sqlx::Error> {
    log(tx, "placed", &ev.id).await
}

#[idempotent(key = "id", ttl = "1h", batch)]
async fn order_shipped(tx: &mut PgTx, events: Vec<OrderEvent>) -> Result<(), sqlx::Error> {
    for ev in events {
        log(tx, "shipped", &ev.id).await?;
    }
    Ok(())
}

/// The log, in the order it was written.
async fn logged(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as("SELECT kind, id FROM typed_log ORDER BY seq")
        .fetch_all(pool)
        .await
        .expect("log")
}

async fn typed_log(pool: &PgPool) {
    sqlx::query("CREATE TABLE typed_log (seq bigserial PRIMARY KEY, kind text, id text)")
        .execute(pool)
        .await
        .expect("log table");
}

/// A consumer of `topic` in `group` routing `OrderPlaced` to
/// [`order_placed`] and `OrderShipped` to [`order_shipped`], their types
/// named as `by` says.
fn orders(
    store: &PgStore,
    group: &str,
    topic: &str,
    by: impl Fn(&str) -> dedup_kafka::EventType,
) -> ConsumerBuilder<PgStore> {
    Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(group)
        .handle_type(topic, by("OrderPlaced"), order_placed)
        .handle_type(topic, by("OrderShipped"), order_shipped)
}

/// Two event types on one topic, named by an `event-type` header, each to
/// its own handler (its own key, TTL and mode): they apply in the
/// partition's order across types, a duplicate of either is skipped, and an
/// event of a type neither takes (or of none) is dead-lettered with kind
/// `unrouted`, saying which types the topic's handlers take. A second run
/// finds nothing left.
#[sqlx::test(migrations = false)]
async fn event_types_on_one_topic_go_each_to_its_handler_in_order(pool: PgPool) {
    let log = run_typed(&pool, 0).await;
    assert_eq!(log, typed_expected());
}

/// The same under key-ordered concurrency: each order's events (the
/// record key) still apply in the partition's order across types, the
/// unrouted ones are dead-lettered once, and a second run finds nothing
/// left. Dead letters of one type and another type's first event meet in
/// one worker here (each reads the dead letters recorded before it).
#[sqlx::test(migrations = false)]
async fn event_types_under_key_concurrency_keep_each_keys_order(pool: PgPool) {
    let log = run_typed(&pool, 4).await;
    assert_eq!(log.len(), 6);
    for id in ["o1", "o2", "o3"] {
        let of = |l: &[(String, String)]| -> Vec<String> {
            l.iter()
                .filter(|(_, i)| i == id)
                .map(|(k, _)| k.clone())
                .collect()
        };
        assert_eq!(of(&log), of(&typed_expected()), "{id}'s events in order");
    }
}

/// [`send_typed`]'s events through [`orders`] by an `event-type` header
/// (with `key_concurrency`, if not 0): six applied, a duplicate skipped,
/// the two unrouted dead-lettered, and a second run finds nothing left.
/// Returns the log.
async fn run_typed(pool: &PgPool, key_concurrency: usize) -> Vec<(String, String)> {
    let store = store(pool).await;
    typed_log(pool).await;
    let topic = create_topic(1).await;
    send_typed(&topic).await;
    let group = unique("g");
    let by_header = |t: &str| dedup_kafka::EventType::header("event-type", t);
    let consumer = || orders(&store, &group, &topic, by_header).key_concurrency(key_concurrency);
    let stats = drain(consumer(), Duration::from_secs(3)).await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (6, 1, 2),
        "{stats:?}"
    );
    assert_unrouted_dead_letters(&topic, key_concurrency == 0).await;
    let again = drain(consumer(), Duration::from_secs(3)).await;
    assert_eq!(
        (again.applied, again.skipped, again.dead_lettered),
        (0, 0, 0)
    );
    logged(pool).await
}

/// Order events of two handled types, a third type and one of none, with
/// a duplicate, to partition 0 of `topic`, each keyed by its order.
async fn send_typed(topic: &str) {
    let p = producer();
    let sends = [
        (Some("OrderPlaced"), "o1"),
        (Some("OrderShipped"), "o1"),
        (Some("OrderPlaced"), "o2"),
        (Some("OrderPlaced"), "o3"),
        (Some("OrderCancelled"), "o2"),
        (None, "o4"),
        (Some("OrderShipped"), "o2"),
        (Some("OrderShipped"), "o3"),
        (Some("OrderPlaced"), "o2"),
    ];
    for (kind, id) in sends {
        let body = serde_json::json!({ "id": id }).to_string();
        let headers = kind.map(|k| {
            OwnedHeaders::new().insert(Header {
                key: "event-type",
                value: Some(k),
            })
        });
        produce(&p, topic, id, body.as_bytes(), headers).await;
    }
}

/// What [`send_typed`]'s events log, in order.
fn typed_expected() -> Vec<(String, String)> {
    [
        ("placed", "o1"),
        ("shipped", "o1"),
        ("placed", "o2"),
        ("placed", "o3"),
        ("shipped", "o2"),
        ("shipped", "o3"),
    ]
    .iter()
    .map(|(k, id)| ((*k).to_owned(), (*id).to_owned()))
    .collect()
}

/// [`send_typed`]'s two unrouted events are dead-lettered, saying what
/// they named and which types the topic's handlers take (in offset order
/// when `in_order`; under key-ordered concurrency events of different
/// keys may finish in either order).
async fn assert_unrouted_dead_letters(topic: &str, in_order: bool) {
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    let mut whys: Vec<&str> = dead
        .iter()
        .map(|msg| {
            assert_eq!(header(msg, "dedup.error.kind"), Some("unrouted"));
            header(msg, "dedup.error.message").unwrap_or_default()
        })
        .collect();
    if !in_order {
        whys.sort_by_key(|why| !why.contains("\"OrderCancelled\""));
    }
    for (why, said) in whys.iter().zip(["\"OrderCancelled\"", "(none given)"]) {
        assert!(
            why.contains(said) && why.contains("handled: OrderPlaced, OrderShipped"),
            "{why}"
        );
    }
}

/// Types named by a JSON field (`#[serde(tag = "type")]`), with the other
/// types skipped: those are counted as ignored, dead-lettered nowhere, and
/// their offsets committed with the rest. A message that names no type,
/// and one of a handled type malformed after its type, are dead-lettered
/// all the same (never skipped as another type's): kinds `unrouted` and
/// `decode`.
#[sqlx::test(migrations = false)]
async fn other_event_types_can_be_skipped(pool: PgPool) {
    let store = store(&pool).await;
    typed_log(&pool).await;
    let topic = create_topic(2).await;
    let p = producer();
    for (kind, id) in [
        ("OrderPlaced", "o1"),
        ("OrderRefunded", "o1"),
        ("OrderShipped", "o1"),
        ("OrderRefunded", "o2"),
    ] {
        let body = serde_json::json!({ "type": kind, "id": id }).to_string();
        produce(&p, &topic, id, body.as_bytes(), None).await;
    }
    produce(&p, &topic, "o3", br#"{"id": "o3"}"#, None).await;
    produce(
        &p,
        &topic,
        "o4",
        br#"{"type": "OrderPlaced", "id": "o4""#,
        None,
    )
    .await;
    let group = unique("g");
    let by_field = |t: &str| dedup_kafka::EventType::field("type", t);
    let consumer = || {
        orders(&store, &group, &topic, by_field).other_types(&topic, dedup_kafka::OtherTypes::Skip)
    };
    let stats = drain(consumer(), Duration::from_secs(3)).await;
    assert_eq!(
        (stats.applied, stats.ignored, stats.dead_lettered),
        (2, 2, 2),
        "{stats:?}"
    );
    assert_eq!(logged(&pool).await.len(), 2);
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    let mut kinds: Vec<(&str, &str)> = dead
        .iter()
        .map(|m| {
            (
                std::str::from_utf8(m.key().unwrap_or_default()).unwrap_or_default(),
                header(m, "dedup.error.kind").unwrap_or_default(),
            )
        })
        .collect();
    kinds.sort_unstable();
    assert_eq!(kinds, [("o3", "unrouted"), ("o4", "decode")]);
    let again = drain(consumer(), Duration::from_secs(3)).await;
    assert_eq!((again.applied, again.ignored), (0, 0), "committed");
}
