//! What PostgreSQL's outbox adds to the conformance suite
//! (outbox_conformance.rs), each test in its own database: what its rows
//! hold, that a lease keeps no transaction open, schema-qualified tables,
//! and notifications.

use std::time::{Duration, Instant};

use dedup_core::{OutboxMessage, OutboxSource, PublishFailure};
use dedup_postgres::{OutboxConfig, OutboxReader, OutboxWriter, Retention};
use sqlx::PgPool;

/// Long enough never to expire within a test, unless a test says so.
const LEASE: Duration = Duration::from_secs(600);

async fn outbox(pool: &PgPool, retention: Retention) -> OutboxReader {
    let outbox =
        OutboxWriter::new(OutboxConfig::default().with_retention(retention)).expect("config");
    outbox.migrate(pool).await.expect("migrate");
    outbox
        .migrate(pool)
        .await
        .expect("migrating twice is a no-op");
    outbox.reader(pool.clone())
}

/// Enqueues one event per `(key, payload)` in one committed transaction.
async fn enqueue_all(pool: &PgPool, events: &[(Option<&str>, &str)]) {
    let mut tx = pool.begin().await.expect("begin");
    for (key, payload) in events {
        let mut message = OutboxMessage::bytes("topic-a", payload.as_bytes());
        if let Some(key) = key {
            message = message.with_key(*key);
        }
        dedup_postgres::enqueue(&mut tx, message)
            .await
            .expect("enqueue");
    }
    tx.commit().await.expect("commit");
}

fn seqs(records: &[dedup_core::OutboxRecord]) -> Vec<i64> {
    records.iter().map(|r| r.seq).collect()
}

fn payloads(records: &[dedup_core::OutboxRecord]) -> Vec<String> {
    records
        .iter()
        .map(|r| String::from_utf8(r.payload.clone()).expect("utf-8"))
        .collect()
}

#[sqlx::test(migrations = false)]
async fn enqueue_gives_ids_and_only_committed_events_are_pending(pool: PgPool) {
    let source = outbox(&pool, Retention::Delete).await;

    let mut tx = pool.begin().await.expect("begin");
    let chosen = dedup_postgres::enqueue(
        &mut tx,
        OutboxMessage::bytes("t", "x")
            .with_event_id("order-7:shipped")
            .with_header("trace", "abc"),
    )
    .await
    .expect("enqueue");
    let random = dedup_postgres::enqueue(&mut tx, OutboxMessage::bytes("t", "y"))
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    assert_eq!(chosen, "order-7:shipped");
    assert_eq!(random.len(), 36, "a UUID: {random}");

    let mut tx = pool.begin().await.expect("begin");
    dedup_postgres::enqueue(&mut tx, OutboxMessage::bytes("t", "rolled back"))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");

    assert_eq!(source.pending().await.expect("pending"), 2);
    let age = source.oldest_pending_age().await.expect("age");
    assert!(
        age.is_some_and(|a| a < Duration::from_secs(600)),
        "the lag of events enqueued just now: {age:?}"
    );
    let (lease, records) = source.lease_pending(10, LEASE).await.expect("lock");
    assert_eq!(payloads(&records), ["x", "y"]);
    assert_eq!(records[0].event_id, "order-7:shipped");
    assert_eq!(records[0].headers, [("trace".to_owned(), b"abc".to_vec())]);
    assert_eq!(records[1].event_id, random);
    source.finish(&lease, &[], &[]).await.expect("finish");
}

#[sqlx::test(migrations = false)]
async fn a_second_relay_skips_held_events_and_never_overtakes_their_keys(pool: PgPool) {
    let source = outbox(&pool, Retention::Delete).await;
    enqueue_all(
        &pool,
        &[
            (Some("k1"), "k1-1"),
            (Some("k2"), "k2-1"),
            (Some("k1"), "k1-2"),
            (Some("k3"), "k3-1"),
            (None, "no key"),
            (Some("k2"), "k2-2"),
            (Some("k3"), "k3-2"),
        ],
    )
    .await;

    // Relay A holds the two oldest events.
    let (lease_a, held) = source.lease_pending(2, LEASE).await.expect("lock A");
    assert_eq!(payloads(&held), ["k1-1", "k2-1"]);

    // Relay B gets the rest except k1 and k2, whose earlier events A holds.
    let (lease_b, taken) = source.lease_pending(100, LEASE).await.expect("lock B");
    assert_eq!(payloads(&taken), ["k3-1", "no key", "k3-2"]);

    // B publishes; A fails k2-1 (it stays pending, attempts recorded).
    source
        .finish(&lease_b, &seqs(&taken), &[])
        .await
        .expect("finish B");
    source
        .finish(
            &lease_a,
            &[held[0].seq],
            &[PublishFailure::new(
                held[1].seq,
                "broker down",
                Duration::ZERO,
            )],
        )
        .await
        .expect("finish A");

    // What is left comes out in order, the failed event first for its key.
    let (lease, rest) = source.lease_pending(100, LEASE).await.expect("lock again");
    assert_eq!(payloads(&rest), ["k2-1", "k1-2", "k2-2"]);
    assert_eq!(rest[0].attempts, 1, "the failure was recorded");
    let last_error: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM dedup_outbox WHERE seq = $1")
            .bind(rest[0].seq)
            .fetch_one(&pool)
            .await
            .expect("last_error");
    assert_eq!(last_error.as_deref(), Some("broker down"));
    source
        .finish(&lease, &seqs(&rest), &[])
        .await
        .expect("finish");
    assert_eq!(source.pending().await.expect("pending"), 0);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_outbox")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, 0, "delete-on-publish leaves no rows");
    assert_eq!(source.oldest_pending_age().await.expect("age"), None);
}

#[sqlx::test(migrations = false)]
async fn an_event_backing_off_holds_back_its_key_and_nothing_else(pool: PgPool) {
    let source = outbox(&pool, Retention::Delete).await;
    enqueue_all(
        &pool,
        &[
            (Some("k1"), "poison"),
            (Some("k1"), "k1-2"),
            (Some("k1"), "k1-3"),
            (Some("k2"), "k2-1"),
        ],
    )
    .await;
    // A batch of 3 holds only k1; its first event fails and backs off.
    let (lease, records) = source.lease_pending(3, LEASE).await.expect("lock");
    assert_eq!(payloads(&records), ["poison", "k1-2", "k1-3"]);
    source
        .finish(
            &lease,
            &[],
            &[PublishFailure::new(
                records[0].seq,
                "Message size too large",
                Duration::from_secs(3600),
            )],
        )
        .await
        .expect("finish");

    // The next batch of 3 gets past the whole key to k2.
    let (lease, records) = source.lease_pending(3, LEASE).await.expect("lock");
    assert_eq!(payloads(&records), ["k2-1"]);
    source
        .finish(&lease, &[records[0].seq], &[])
        .await
        .expect("finish");
    assert_eq!(source.pending().await.expect("pending"), 3, "k1 waits");

    // Once the back-off is over, the key comes back, in order.
    sqlx::query("UPDATE dedup_outbox SET next_attempt_at = now() - interval '1 second'")
        .execute(&pool)
        .await
        .expect("end the back-off");
    let (lease, records) = source.lease_pending(10, LEASE).await.expect("lock");
    assert_eq!(payloads(&records), ["poison", "k1-2", "k1-3"]);
    assert_eq!(records[0].attempts, 1);
    source.finish(&lease, &[], &[]).await.expect("finish");
}

#[sqlx::test(migrations = false)]
async fn outbox_tables_are_validated_and_can_live_in_a_schema(pool: PgPool) {
    assert!(OutboxWriter::new(OutboxConfig::default().with_table("outbox; DROP TABLE x")).is_err());
    let outbox =
        OutboxWriter::new(OutboxConfig::default().with_table("events.outbox")).expect("valid");
    outbox.migrate(&pool).await.expect("migrate");
    let mut tx = pool.begin().await.expect("begin");
    outbox
        .enqueue(&mut tx, OutboxMessage::bytes("t", "x").with_key("k"))
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    let source = outbox.reader(pool.clone());
    assert_eq!(source.pending().await.expect("pending"), 1);
    let (lease, records) = source.lease_pending(10, LEASE).await.expect("lock");
    assert_eq!(records.len(), 1);
    source
        .finish(&lease, &[records[0].seq], &[])
        .await
        .expect("finish");
    assert_eq!(source.pending().await.expect("pending"), 0);
}

#[sqlx::test(migrations = false)]
async fn a_lease_holds_its_events_and_its_keys_until_it_expires(pool: PgPool) {
    let source = outbox(&pool, Retention::Keep(Duration::from_secs(3600))).await;
    enqueue_all(
        &pool,
        &[(Some("k"), "k-1"), (Some("k"), "k-2"), (Some("k"), "k-3")],
    )
    .await;
    // Relay A leases two for 4 s and dies (never finishes).
    let leased_at = Instant::now();
    let (_dead, taken) = source
        .lease_pending(2, Duration::from_secs(4))
        .await
        .expect("lease A");
    assert_eq!(payloads(&taken), ["k-1", "k-2"]);
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&pool)
    .await
    .expect("activity");
    assert_eq!(open, 0, "a lease keeps no transaction open");

    // While A's lease lasts, B gets nothing: not A's events, and not k-3,
    // which would overtake them.
    let (lease, none) = source.lease_pending(10, LEASE).await.expect("lease B");
    assert!(none.is_empty(), "{:?}", payloads(&none));
    source.finish(&lease, &[], &[]).await.expect("finish");

    // Once it expired, B takes the key over from its first event.
    tokio::time::sleep(Duration::from_millis(4_500).saturating_sub(leased_at.elapsed())).await;
    let (lease, records) = source.lease_pending(10, LEASE).await.expect("lease B");
    assert_eq!(payloads(&records), ["k-1", "k-2", "k-3"]);
    source
        .finish(&lease, &[records[0].seq], &[])
        .await
        .expect("finish");
    // What B neither published nor failed is offered again at once.
    let (lease, records) = source.lease_pending(10, LEASE).await.expect("lease C");
    assert_eq!(payloads(&records), ["k-2", "k-3"]);
    source
        .finish(&lease, &[records[0].seq, records[1].seq], &[])
        .await
        .expect("finish");
    assert_eq!(source.pending().await.expect("pending"), 0);
}

#[sqlx::test(migrations = false)]
async fn a_relay_whose_lease_expired_still_marks_what_was_acknowledged(pool: PgPool) {
    let source = outbox(&pool, Retention::Keep(Duration::from_secs(3600))).await;
    enqueue_all(
        &pool,
        &[(Some("k"), "k-1"), (Some("k"), "k-2"), (Some("k"), "k-3")],
    )
    .await;
    let (slow, taken) = source
        .lease_pending(10, Duration::from_millis(500))
        .await
        .expect("lease A");
    tokio::time::sleep(Duration::from_millis(600)).await;
    // B took the batch over and is publishing it.
    let (lease_b, again) = source.lease_pending(10, LEASE).await.expect("lease B");
    assert_eq!(payloads(&again), ["k-1", "k-2", "k-3"]);
    // A's acknowledgement of k-1 arrives late: it is marked (the broker has
    // it). A's failure of k-2 and its release of k-3 (held) leave B's
    // lease alone.
    source
        .finish(
            &slow,
            &[taken[0].seq],
            &[PublishFailure::new(taken[1].seq, "late", LEASE)],
        )
        .await
        .expect("finish A");
    let rest: Vec<(i32, bool)> = sqlx::query_as(
        "SELECT o.attempts, EXISTS (SELECT 1 FROM dedup_outbox_leases l \
             WHERE o.seq = ANY(l.seqs) AND l.until > now()) \
         FROM dedup_outbox o WHERE o.sent_at IS NULL ORDER BY o.seq",
    )
    .fetch_all(&pool)
    .await
    .expect("k-2, k-3");
    assert_eq!(rest, [(0, true), (0, true)], "still B's");
    source
        .finish(&lease_b, &seqs(&again), &[])
        .await
        .expect("finish B");
    assert_eq!(source.pending().await.expect("pending"), 0);
}

#[sqlx::test(migrations = false)]
async fn notifications_that_piled_up_wake_a_relay_once(pool: PgPool) {
    let source = outbox(&pool, Retention::Delete).await;
    // The first look starts listening.
    let (lease, _) = source.lease_pending(10, LEASE).await.expect("lease");
    source.finish(&lease, &[], &[]).await.expect("finish");
    // 500 transactions, each notifying, while the relay is busy elsewhere.
    for n in 0..500 {
        enqueue_all(&pool, &[(Some("k"), &format!("e-{n}"))]).await;
    }
    // Ample time for the listener to have read every one of them.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    source.wait_for_events(Duration::from_secs(5)).await;
    assert!(started.elapsed() < Duration::from_secs(1), "woken");
    // One look takes them all; the notifications are spent with it.
    let (lease, records) = source.lease_pending(1000, LEASE).await.expect("lease");
    assert_eq!(records.len(), 500);
    let seqs: Vec<i64> = records.iter().map(|r| r.seq).collect();
    source.finish(&lease, &seqs, &[]).await.expect("finish");
    // Nothing new was enqueued: at most a straggler of the 500 wakes it
    // (read after the first wait), then it sleeps out its timeout. One
    // notification per wake would wake it about 500 times.
    let mut wakes = 0;
    loop {
        let started = Instant::now();
        source.wait_for_events(Duration::from_millis(500)).await;
        if started.elapsed() >= Duration::from_millis(450) {
            break;
        }
        wakes += 1;
        assert!(
            wakes <= 2,
            "woken again and again by notifications already looked at"
        );
    }
}

/// A relay's next batch, leased while its own batch before is in flight
/// (`lease_pending_after`), takes the later events of that batch's keys:
/// the relay sends them after it. Another relay's lease does not.
#[sqlx::test(migrations = false)]
async fn a_batch_leased_past_the_relays_own_batch_in_flight_takes_its_keys(pool: PgPool) {
    let source = outbox(&pool, Retention::Delete).await;
    enqueue_all(
        &pool,
        &[
            (Some("k"), "k-1"),
            (Some("k"), "k-2"),
            (Some("j"), "j-1"),
            (Some("k"), "k-3"),
        ],
    )
    .await;
    let (first, taken) = source.lease_pending(2, LEASE).await.expect("lease");
    assert_eq!(payloads(&taken), ["k-1", "k-2"]);
    // Another relay would overtake k-1 and k-2 with k-3: it gets j-1 only.
    let (other, others) = source.lease_pending(10, LEASE).await.expect("other");
    assert_eq!(payloads(&others), ["j-1"]);
    source.finish(&other, &[], &[]).await.expect("release");
    // The same relay, past its own batch in flight: k-3 too.
    let (next, after) = source
        .lease_pending_after(10, LEASE, &first)
        .await
        .expect("after")
        .expect("PostgreSQL leases past a batch in flight");
    assert_eq!(payloads(&after), ["j-1", "k-3"]);
    let (none, nothing) = source.lease_pending(10, LEASE).await.expect("third");
    assert!(nothing.is_empty(), "{:?}", payloads(&nothing));
    source.finish(&none, &[], &[]).await.expect("empty");
    source
        .finish(&first, &seqs(&taken), &[])
        .await
        .expect("first");
    source
        .finish(&next, &seqs(&after), &[])
        .await
        .expect("next");
    assert_eq!(source.pending().await.expect("pending"), 0);
}

/// Leasing waits for the lease lock in a READ COMMITTED transaction
/// whatever the server's default: under REPEATABLE READ its snapshot
/// would predate a lease committed while it waited, and it would lease
/// the same events again.
#[sqlx::test(migrations = false)]
async fn a_lease_sees_the_lease_committed_while_it_waited_under_repeatable_read(pool: PgPool) {
    let outbox = OutboxWriter::default();
    outbox.migrate(&pool).await.expect("migrate");
    enqueue_all(&pool, &[(Some("k"), "k-1"), (None, "n-1")]).await;
    let options = (*pool.connect_options())
        .clone()
        .options([("default_transaction_isolation", "repeatable read")]);
    let repeatable = sqlx::postgres::PgPoolOptions::new()
        .connect_with(options)
        .await
        .expect("pool");
    let source = outbox.reader(repeatable);
    // Another relay holds the lease lock...
    let mut other = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind("dedup outbox lease dedup_outbox")
        .execute(&mut *other)
        .await
        .expect("lock");
    let waiting = tokio::spawn(async move { source.lease_pending(10, LEASE).await });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waits: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event = 'advisory'",
        )
        .fetch_one(&pool)
        .await
        .expect("activity");
        if waits == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the lease never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...and leases every pending event while this one waits.
    sqlx::query(
        "INSERT INTO dedup_outbox_leases (id, until, seqs) \
         SELECT gen_random_uuid(), now() + interval '1 hour', array_agg(seq) FROM dedup_outbox",
    )
    .execute(&mut *other)
    .await
    .expect("other's lease");
    other.commit().await.expect("commit");
    let (_, records) = waiting.await.expect("task").expect("lease");
    assert!(records.is_empty(), "leased twice: {:?}", payloads(&records));
}
