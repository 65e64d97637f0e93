//! Poison messages: dead-lettered once with their reason (decode, key, handler, panic, integrity, size), the partition moving on, and never dead-lettered twice or applied after a crash.

use super::*;

#[sqlx::test(migrations = false)]
async fn poison_messages_are_dead_lettered_and_the_partition_moves_on(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let traced = OwnedHeaders::new().insert(Header {
        key: "trace-id",
        value: Some("t-42"),
    });
    produce(
        &producer,
        &topic,
        "k1",
        b"{\"event_id\": \"e1\", oops",
        Some(traced),
    )
    .await;
    produce(
        &producer,
        &topic,
        "k2",
        br#"{"account_id": "a", "amount_cents": 5}"#,
        None,
    )
    .await;
    produce(
        &producer,
        &topic,
        "k3",
        br#"{"event_id": "", "account_id": "a", "amount_cents": 5}"#,
        None,
    )
    .await;
    for i in 0..3 {
        produce(
            &producer,
            &topic,
            "good",
            &payment(uuid::Uuid::new_v4(), "a", 10 + i),
            None,
        )
        .await;
    }

    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payment));
    running
        .wait_for("3 applied and 3 dead-lettered", |s| {
            s.applied == 3 && s.dead_lettered == 3
        })
        .await;
    running.stop().await;
    assert_eq!(
        balance(&pool).await,
        10 + 11 + 12,
        "the good messages after the poison ones are applied"
    );

    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 3).await;
    let kinds: Vec<_> = dead
        .iter()
        .map(|m| header(m, "dedup.error.kind").unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["decode", "decode", "key"],
        "malformed JSON, missing key field, empty key"
    );
    for (i, m) in dead.iter().enumerate() {
        assert_eq!(header(m, "dedup.original.topic"), Some(topic.as_str()));
        assert_eq!(header(m, "dedup.original.partition"), Some("0"));
        assert_eq!(
            header(m, "dedup.original.offset"),
            Some(i.to_string().as_str())
        );
        assert_eq!(
            header(m, "dedup.attempts"),
            Some("1"),
            "permanent errors are not retried"
        );
        assert_eq!(header(m, "dedup.handler"), Some(record_payment.scope()));
        assert!(!header(m, "dedup.error.message").unwrap().is_empty());
        assert_eq!(
            m.key(),
            Some(format!("k{}", i + 1).as_bytes()),
            "the original key is kept"
        );
    }
    assert_eq!(
        dead[0].payload(),
        Some(&b"{\"event_id\": \"e1\", oops"[..]),
        "the original bytes are kept"
    );
    assert_eq!(
        header(&dead[0], "trace-id"),
        Some("t-42"),
        "the original headers are kept"
    );
    assert!(
        header(&dead[2], "dedup.error.message")
            .unwrap()
            .contains("empty")
    );
}

/// A crash after a dead letter is acknowledged and before its offset is
/// committed: the restarted consumer neither dead-letters the message again
/// (the dead-letter topic holds exactly one copy) nor, once the cause is
/// gone, applies it. Run as the payments example, killed at the failpoint.
#[sqlx::test(migrations = false)]
async fn a_crash_after_a_dead_letter_neither_copies_nor_applies_it(pool: PgPool) {
    let topic = create_topic(1).await;
    let group = unique("g");
    // The database refuses account "blocked" (a CHECK-like rule of the
    // event's data, SQLSTATE 23514): dead-lettered at once.
    sqlx::raw_sql(
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL); \
         CREATE FUNCTION refuse_blocked() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.id = 'blocked' THEN \
             RAISE EXCEPTION 'account blocked' USING ERRCODE = 'check_violation'; \
         END IF; RETURN NEW; END $$; \
         CREATE TRIGGER refuse_blocked BEFORE INSERT OR UPDATE ON accounts \
         FOR EACH ROW EXECUTE FUNCTION refuse_blocked();",
    )
    .execute(&pool)
    .await
    .expect("schema");
    let producer = producer();
    produce(&producer, &topic, "x", b"not json", None).await;
    let blocked = payment(uuid::Uuid::new_v4(), "blocked", 1000);
    produce(&producer, &topic, "blocked", &blocked, None).await;
    let good = payment(uuid::Uuid::new_v4(), "acct", 5);
    produce(&producer, &topic, "acct", &good, None).await;
    let run = |failpoint| run_payments(&pool, &topic, &group, failpoint);

    // Both dead letters acknowledged, then the process dies before any
    // offset commit (every 5 s).
    let crashed = run(Some("after-dead-letter:2"));
    assert!(
        !crashed.status.success(),
        "the failpoint must kill the process: {}",
        String::from_utf8_lossy(&crashed.stderr)
    );
    assert_eq!(balance(&pool).await, 0, "nothing applied before the crash");

    // The cause is fixed: the blocked account would now be credited.
    sqlx::query("DROP TRIGGER refuse_blocked ON accounts")
        .execute(&pool)
        .await
        .expect("unblock");
    let restarted = run(None);
    assert!(
        restarted.status.success(),
        "{}",
        String::from_utf8_lossy(&restarted.stderr)
    );
    assert_eq!(
        last_line(&restarted),
        "applied=1 skipped=0 dead_lettered=0",
        "{}",
        String::from_utf8_lossy(&restarted.stdout)
    );
    assert_eq!(
        balance(&pool).await,
        5,
        "the dead-lettered payment is not applied by its redelivery"
    );
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    let offsets: Vec<_> = dead
        .iter()
        .map(|m| header(m, "dedup.original.offset").map(str::to_owned))
        .collect();
    assert_eq!(
        offsets,
        [Some("0".into()), Some("1".into())],
        "one copy each"
    );
}

/// A dead letter's record belongs to that message, not to its offset: a
/// topic deleted and created again (offsets from 0 again) within the TTL
/// gets its new messages applied, never skipped as dead-lettered before.
#[sqlx::test(migrations = false)]
async fn a_topic_created_again_is_not_taken_for_its_dead_letters(pool: PgPool) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(&producer, &topic, "k", b"not json", None).await;
    let first = drain(
        consumer(&store, &unique("g")).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(first.dead_lettered, 1, "{first:?}");

    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin");
    let options = AdminOptions::new();
    admin
        .delete_topics(&[&topic], &options)
        .await
        .expect("delete")
        .into_iter()
        .for_each(|r| {
            r.expect("deleted");
        });
    // Deletion finishes in the background: retry the creation until the
    // name is free.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let created = admin
            .create_topics(
                &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
                &options,
            )
            .await
            .expect("create");
        if created.iter().all(Result::is_ok) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the topic was not created again: {created:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Offset 0 again, a different message.
    let event = payment(uuid::Uuid::new_v4(), "acct", 9);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sent = producer
            .send(
                FutureRecord::to(&topic).key("acct").payload(&event),
                Duration::from_secs(10),
            )
            .await;
        match sent {
            Ok(_) => break,
            Err((e, _)) => {
                assert!(Instant::now() < deadline, "producing to the new topic: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    let second = drain(
        consumer(&store, &unique("g")).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        (second.applied, second.already_dead_lettered),
        (1, 0),
        "{second:?}"
    );
    assert_eq!(balance(&pool).await, 9);
}

/// Refuses negative amounts: a permanent failure in the middle of a batch.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_refusing_negatives(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), dedup_core::HandlerError> {
    credit(tx, &ev).await?;
    if ev.amount_cents < 0 {
        return Err(dedup_core::HandlerError::permanent("negative amount"));
    }
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn a_poison_message_inside_a_batch_is_isolated(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    // All produced before the consumer starts, so they arrive as one batch.
    for i in 0..5 {
        produce(
            &producer,
            &topic,
            "k",
            &payment(uuid::Uuid::new_v4(), "a", 10 + i),
            None,
        )
        .await;
    }
    produce(
        &producer,
        &topic,
        "k",
        &payment(uuid::Uuid::new_v4(), "a", -1000),
        None,
    )
    .await;
    for i in 0..5 {
        produce(
            &producer,
            &topic,
            "k",
            &payment(uuid::Uuid::new_v4(), "a", 20 + i),
            None,
        )
        .await;
    }

    let running = start(
        consumer(&store, &unique("g"))
            .batch_linger(Duration::from_millis(200))
            .handle(&topic, record_payment_refusing_negatives),
    );
    running
        .wait_for("10 applied, 1 dead-lettered", |s| {
            s.applied == 10 && s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    assert!(
        stats.batch_replays >= 1,
        "the batch with the poison was rolled back and replayed: {stats:?}"
    );
    // The negative amount's own write was rolled back with its transaction.
    assert_eq!(
        balance(&pool).await,
        (10..15).sum::<i64>() + (20..25).sum::<i64>()
    );
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("handler"));
    assert_eq!(header(&dead[0], "dedup.original.offset"), Some("5"));
}

/// Opens an account: a plain INSERT, so a second event for the same account
/// violates the primary key (SQLSTATE 23505), which is that event's fault.
#[idempotent(key = "event_id", ttl = "4h")]
async fn open_account(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO accounts (id, balance) VALUES ($1, $2)")
        .bind(&ev.account_id)
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The database rejecting an event's own data is dead-lettered at once,
/// with the SQLSTATE in the reason, and the partition moves on.
#[sqlx::test(migrations = false)]
async fn an_integrity_violation_of_the_events_data_is_dead_lettered_at_once(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let running = start(
        consumer(&store, &unique("g"))
            .batch_size(1)
            .handle(&topic, open_account),
    );
    let producer = producer();
    for account in ["a", "a", "b"] {
        let event = payment(uuid::Uuid::new_v4(), account, 5);
        produce(&producer, &topic, account, &event, None).await;
    }
    running
        .wait_for("two opened, one dead-lettered", |s| {
            s.applied == 2 && s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.retries, 0, "not retried: {stats}");
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.attempts"), Some("1"));
    let message = header(&dead[0], "dedup.error.message").unwrap_or_default();
    assert!(message.contains("23505"), "{message}");
    assert_eq!(balance(&pool).await, 10);
}

/// A message that cannot be decoded is known to be bad before any
/// transaction: it is dead-lettered where it stands and its neighbours
/// still go as batches, instead of each batch being replayed message by
/// message.
#[sqlx::test(migrations = false)]
async fn malformed_messages_do_not_slow_their_batches(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let records = (0..2000).map(|i| {
        let payload = if i % 100 == 99 {
            b"{not json".to_vec()
        } else {
            payment(uuid::Uuid::new_v4(), "a", 1)
        };
        ("k".to_owned(), payload)
    });
    produce_all(&producer, &topic, records).await;
    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payment));
    running
        .wait_for("1,980 applied and 20 dead-lettered", |s| {
            s.applied == 1980 && s.dead_lettered == 20
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.batch_replays, 0, "{stats:?}");
    assert!(stats.batches >= 8, "{stats:?}");
    assert_eq!(balance(&pool).await, 1980);
}

/// A payment whose decoding panics for one amount: user code (a
/// `Deserialize` impl) that the runtime must contain.
#[derive(Debug, serde::Deserialize)]
struct PanickyPayment {
    event_id: String,
    account_id: String,
    #[serde(deserialize_with = "amount_or_panic")]
    amount_cents: i64,
}

fn amount_or_panic<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    let amount = <i64 as serde::Deserialize>::deserialize(d)?;
    assert_ne!(amount, 666, "a Deserialize impl that panics");
    Ok(amount)
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_panicky_payment(tx: &mut PgTx, ev: PanickyPayment) -> Result<(), sqlx::Error> {
    let ev = PaymentReceived {
        event_id: ev.event_id,
        account_id: ev.account_id,
        amount_cents: ev.amount_cents,
    };
    credit(tx, &ev).await
}

/// A panic while decoding one message of a batch fails that message (a dead
/// letter of kind `panic`), not the partition's worker, which would drop
/// the messages it buffered and let a new worker commit past them.
#[sqlx::test(migrations = false)]
async fn a_panicking_decode_is_dead_lettered_and_its_neighbours_applied(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    for i in 0..11 {
        let cents = if i == 5 { 666 } else { 1 };
        let event = payment(uuid::Uuid::new_v4(), "a", cents);
        produce(&producer, &topic, "k", &event, None).await;
    }
    let running = start(
        consumer(&store, &unique("g"))
            .batch_linger(Duration::from_millis(200))
            .handle(&topic, record_panicky_payment),
    );
    running
        .wait_for("10 applied, 1 dead-lettered", |s| {
            s.applied == 10 && s.dead_lettered == 1
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("panic"));
    assert_eq!(header(&dead[0], "dedup.original.offset"), Some("5"));
    assert_eq!(balance(&pool).await, 10);
}

/// A poison message just under Kafka's size limit: its dead letter (the
/// original plus dedup's headers) still fits, instead of being refused by
/// the producer and retried for ever while the partition stalls.
#[sqlx::test(migrations = false)]
async fn a_message_near_the_size_limit_is_dead_lettered_not_stalled(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(&producer, &topic, "k", &vec![b'x'; 999_900], None).await;
    let event = payment(uuid::Uuid::new_v4(), "a", 7);
    produce(&producer, &topic, "k", &event, None).await;
    let running = start(consumer(&store, &unique("g")).handle(&topic, record_payment));
    running
        .wait_for("dead-lettered, and the next one applied", |s| {
            s.dead_lettered == 1 && s.applied == 1
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(
        dead[0].payload().map(<[u8]>::len),
        Some(999_900),
        "kept whole"
    );
    assert_eq!(balance(&pool).await, 7);
}

/// A dead letter larger than its topic takes keeps a cut payload, says so,
/// and the partition moves on.
#[sqlx::test(migrations = false)]
async fn a_dead_letter_too_large_for_its_topic_keeps_a_cut_payload(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let dlq = common::create_topic_with(&brokers(), 1, &[("max.message.bytes", "100000")]).await;
    let producer = producer();
    produce(&producer, &topic, "k", &vec![b'x'; 200_000], None).await;
    let event = payment(uuid::Uuid::new_v4(), "a", 3);
    produce(&producer, &topic, "k", &event, None).await;
    let running = start(
        consumer(&store, &unique("g"))
            .handle(&topic, record_payment)
            .dead_letter_topic(&topic, &dlq),
    );
    running
        .wait_for("dead-lettered, and the next one applied", |s| {
            s.dead_lettered == 1 && s.applied == 1
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &dlq, 1).await;
    assert_eq!(
        dead[0].payload().map(<[u8]>::len),
        Some(dedup_kafka::TRUNCATED_PAYLOAD_BYTES)
    );
    assert_eq!(header(&dead[0], "dedup.payload.truncated"), Some("true"));
    assert_eq!(header(&dead[0], "dedup.original.size"), Some("200000"));
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("decode"));
}

/// A dead-letter topic that can never be written stops the consumer with an
/// error that says what to do, instead of retrying silently for ever; the
/// poison message's offset is not committed.
#[sqlx::test(migrations = false)]
async fn an_unwritable_dead_letter_topic_stops_the_consumer(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(&producer, &topic, "k", b"not json", None).await;
    let consumer = consumer(&store, &unique("g"))
        .handle(&topic, record_payment)
        .dead_letter_topic(&topic, "no such topic: spaces are invalid")
        .build()
        .expect("consumer");
    let stats = consumer.stats();
    // An invalid name stops it at the first refusal; should the broker
    // first answer something less plain (a loaded machine's metadata
    // timeout), it stops once the topic stayed unwritable for
    // UNWRITABLE_FOR (60 s). Either way it must stop on its own.
    let result = tokio::time::timeout(
        Duration::from_secs(150),
        consumer.run_until(std::future::pending()),
    )
    .await
    .expect("the consumer must stop on its own");
    let err = result.expect_err("an unwritable dead-letter topic is fatal");
    assert!(err.to_string().contains("cannot be written"), "{err}");
    assert_eq!(stats.snapshot().dead_lettered, 0);
}
