//! What counts as a duplicate: TTLs on the database clock, composite keys, fingerprints of reused ids, a handler slower than its TTL.

use super::*;

#[sqlx::test(migrations = false)]
async fn ttl_cases_end_to_end(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    // Long enough that the duplicate surely arrives within it on a loaded
    // machine, short enough to wait out.
    let ttl = Ttl::from_secs(6).unwrap();
    let running =
        start(consumer(&store, &unique("g")).handle(&topic, record_payment.with_ttl(ttl)));
    let producer = producer();
    let event = payment(uuid::Uuid::new_v4(), "acct", 100);

    produce(&producer, &topic, "acct", &event, None).await;
    running
        .wait_for("first delivery applied", |s| s.applied == 1)
        .await;
    // The claim was taken before this, so it has expired by then.
    let expired_by = Instant::now() + ttl.as_duration() + Duration::from_millis(300);
    assert_eq!(balance(&pool).await, 100, "(A) the first delivery applies");

    produce(&producer, &topic, "acct", &event, None).await;
    running
        .wait_for("duplicate skipped", |s| s.skipped == 1)
        .await;
    assert_eq!(
        balance(&pool).await,
        100,
        "(B) a duplicate within the TTL is skipped"
    );

    tokio::time::sleep_until(expired_by.into()).await;
    produce(&producer, &topic, "acct", &event, None).await;
    running
        .wait_for("late redelivery applied", |s| s.applied == 2)
        .await;
    assert_eq!(
        balance(&pool).await,
        200,
        "(C) after the TTL the event applies again"
    );

    let stats = running.stop().await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (2, 1, 0)
    );
}

/// Event ids are unique per tenant only: the claim is on both.
#[idempotent(key = "header:tenant, event_id", ttl = "4h")]
async fn record_tenant_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

#[sqlx::test(migrations = false)]
async fn a_composite_key_claims_per_tenant_and_a_missing_part_is_dead_lettered(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let event = |id: &str, cents: i64| {
        serde_json::json!({ "event_id": id, "account_id": "acct", "amount_cents": cents })
            .to_string()
            .into_bytes()
    };
    let tenant = |name: &'static str| {
        Some(OwnedHeaders::new().insert(Header {
            key: "tenant",
            value: Some(name),
        }))
    };
    let records = [
        (tenant("t-a"), event("e1", 1)),
        (tenant("t-b"), event("e1", 2)),
        (tenant("t-a"), event("e1", 4)),
        (tenant("a,b"), event("c", 8)),
        (tenant("a"), event("b,c", 16)),
        (None, event("e2", 32)),
        (tenant("t-a"), event("", 64)),
        (tenant("t-a"), event("e3", 128)),
    ];
    for (headers, payload) in records {
        produce(&producer, &topic, "k", &payload, headers).await;
    }

    let running = start(consumer(&store, &unique("g")).handle(&topic, record_tenant_payment));
    running
        .wait_for("5 applied, 1 skipped, 2 dead-lettered", |s| {
            s.applied + s.skipped + s.dead_lettered == 8
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (5, 1, 2)
    );
    assert_eq!(
        balance(&pool).await,
        1 + 2 + 8 + 16 + 128,
        "t-b's e1 is not t-a's; (\"a,b\", \"c\") is not (\"a\", \"b,c\")"
    );
    let mut ids: Vec<String> = sqlx::query_scalar("SELECT key FROM dedup_claims WHERE scope = $1")
        .bind(record_tenant_payment.scope())
        .fetch_all(&pool)
        .await
        .unwrap();
    ids.sort();
    assert_eq!(
        ids,
        [r"a,b\,c", r"a\,b,c", "t-a,e1", "t-a,e3", "t-b,e1"],
        "the claims as the CLI finds them (`--key t-a --key e1`)"
    );

    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 2).await;
    for (m, part) in dead.iter().zip(["`tenant` header", "key part `event_id`"]) {
        assert_eq!(header(m, "dedup.error.kind"), Some("key"));
        let message = header(m, "dedup.error.message").unwrap();
        assert!(message.contains(part), "{message:?} names {part}");
    }
}

/// The claim keeps a fingerprint of the fields that make a payment.
#[idempotent(key = "event_id", ttl = "4h", fingerprint = "account_id, amount_cents")]
async fn record_payment_checked(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

/// Sends, in one partition: e1, e2, e1 again written otherwise (a
/// redelivery), e1 and e2 with other amounts (reused ids), e3; then, once
/// those are finished, e3 with another amount (against a committed claim).
/// Returns the stats and the dead-letter topic.
async fn send_reused_ids(
    pool: &PgPool,
    tune: impl FnOnce(ConsumerBuilder<PgStore>) -> ConsumerBuilder<PgStore>,
    finished: u64,
) -> (dedup_kafka::StatsSnapshot, String) {
    let store = store(pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let event = |id: &str, cents: i64| {
        format!(r#"{{"event_id":"{id}","account_id":"acct","amount_cents":{cents}}}"#).into_bytes()
    };
    let resent = br#"{ "amount_cents": 1, "account_id": "acct", "event_id": "e1", "sent_at": 2 }"#;
    let first = [
        event("e1", 1),
        event("e2", 2),
        resent.to_vec(),
        event("e1", 100),
        event("e2", 200),
        event("e3", 4),
    ];
    for payload in first {
        produce(&producer, &topic, "k", &payload, None).await;
    }
    let running =
        start(tune(consumer(&store, &unique("g"))).handle(&topic, record_payment_checked));
    running
        .wait_for("the first six finished", |s| {
            s.applied + s.skipped + s.dead_lettered == finished - 1
        })
        .await;
    produce(&producer, &topic, "k", &event("e3", 400), None).await;
    running
        .wait_for("the last one finished", |s| {
            s.applied + s.skipped + s.dead_lettered == finished
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(
        balance(pool).await,
        1 + 2 + 4,
        "each id applied once, with its first content"
    );
    (stats, format!("{topic}.dlq"))
}

/// The three reused ids are dead-lettered in offset order with their kind.
async fn assert_reused_ids_dead_lettered(stats: &dedup_kafka::StatsSnapshot, dlq: &str) {
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (3, 1, 3)
    );
    let dead = read_exactly(&brokers(), dlq, 3).await;
    let offsets: Vec<_> = dead
        .iter()
        .map(|m| header(m, "dedup.original.offset").unwrap().to_owned())
        .collect();
    assert_eq!(offsets, ["3", "4", "6"]);
    for m in &dead {
        assert_eq!(header(m, "dedup.error.kind"), Some("fingerprint_mismatch"));
        let message = header(m, "dedup.error.message").unwrap();
        assert!(message.contains("reused an id"), "{message}");
    }
}

#[sqlx::test(migrations = false)]
async fn a_reused_id_with_other_content_is_dead_lettered_not_skipped(pool: PgPool) {
    let (stats, dlq) = send_reused_ids(&pool, |c| c, 7).await;
    assert_reused_ids_dead_lettered(&stats, &dlq).await;
}

#[sqlx::test(migrations = false)]
async fn a_reused_id_is_dead_lettered_message_by_message_too(pool: PgPool) {
    let (stats, dlq) = send_reused_ids(&pool, |c| c.batch_size(1), 7).await;
    assert_reused_ids_dead_lettered(&stats, &dlq).await;
}

#[sqlx::test(migrations = false)]
async fn a_reused_id_can_be_skipped_with_a_warning_instead(pool: PgPool) {
    let (stats, dlq) = send_reused_ids(
        &pool,
        |c| c.on_fingerprint_mismatch(dedup_kafka::OnFingerprintMismatch::Skip),
        7,
    )
    .await;
    assert_eq!(
        (stats.applied, stats.skipped, stats.dead_lettered),
        (3, 4, 0),
        "nothing dead-lettered to {dlq}"
    );
}

/// Slower than its own TTL: the claim taken at the start of the
/// transaction would expire before the commit.
#[idempotent(key = "event_id", ttl = "2s")]
async fn record_payment_slower_than_its_ttl(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    tokio::time::sleep(Duration::from_secs(3)).await;
    credit(tx, &ev).await
}

/// A handler that runs longer than its TTL still commits a live claim (its
/// TTL restarts at the commit), so the duplicate right behind it is skipped.
#[sqlx::test(migrations = false)]
async fn a_handler_slower_than_its_ttl_still_applies_once(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let event = payment(uuid::Uuid::new_v4(), "a", 5);
    produce(&producer, &topic, "k", &event, None).await;
    produce(&producer, &topic, "k", &event, None).await;
    let running = start(
        consumer(&store, &unique("g"))
            .batch_size(1)
            .handle(&topic, record_payment_slower_than_its_ttl),
    );
    running
        .wait_for("applied, then skipped", |s| s.applied + s.skipped == 2)
        .await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.skipped), (1, 1), "{stats}");
    assert_eq!(balance(&pool).await, 5);
}
