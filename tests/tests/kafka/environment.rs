//! A bad environment is waited out, never the message's fault: lost connections, a read-only or stopped database, a frozen backend, a hanging attempt, a broker killed, and `max_outage`.

use super::*;

/// The first call in a database kills its own connection (SQLSTATE 57P01,
/// as a failover or a restart would); later calls succeed. The gate is a
/// sequence because sequences do not roll back.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_losing_connection_once(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT CASE WHEN nextval('connection_loss_gate') = 1 THEN pg_terminate_backend(pg_backend_pid()) END")
        .execute(&mut **tx)
        .await?;
    credit(tx, &ev).await
}

#[sqlx::test(migrations = false)]
async fn a_lost_database_connection_is_retried_and_applied_once(pool: PgPool) {
    let store = store(&pool).await;
    sqlx::query("CREATE SEQUENCE connection_loss_gate")
        .execute(&pool)
        .await
        .unwrap();
    let topic = create_topic(1).await;
    produce(
        &producer(),
        &topic,
        "a",
        &payment(uuid::Uuid::new_v4(), "a", 77),
        None,
    )
    .await;

    let running =
        start(consumer(&store, &unique("g")).handle(&topic, record_payment_losing_connection_once));
    running
        .wait_for("applied after a retry", |s| s.applied == 1)
        .await;
    let stats = running.stop().await;
    assert!(
        stats.retries >= 1,
        "the lost connection must have been retried: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0);
    assert_eq!(balance(&pool).await, 77);
}

/// Fails transiently, forever, for the account "stuck".
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_stuck_account(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), dedup_core::HandlerError> {
    if ev.account_id == "stuck" {
        return Err(dedup_core::HandlerError::transient(
            "the downstream ledger timed out",
        ));
    }
    credit(tx, &ev).await?;
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn a_retrying_partition_does_not_stall_the_others(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(2).await;
    let producer = producer();
    let send = |partition: i32, payload: Vec<u8>| {
        let (producer, topic) = (producer.clone(), topic.clone());
        async move {
            let record = FutureRecord::<str, [u8]>::to(&topic)
                .partition(partition)
                .payload(&payload);
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)
                .expect("produced");
        }
    };
    send(0, payment(uuid::Uuid::new_v4(), "stuck", 1)).await;
    send(0, payment(uuid::Uuid::new_v4(), "after-stuck", 1)).await;

    let retry = RetryPolicy::default()
        .with_max_attempts(12)
        .with_backoff(Duration::from_millis(1000), Duration::from_millis(1500));
    let running = start(
        consumer(&store, &unique("g"))
            // One handler at a time: backing off must not hold the slot.
            .max_concurrent_partitions(1)
            .retry(retry)
            .handle(&topic, record_payment_stuck_account),
    );
    // Partition 0 is in its retry loop (8 to 16 s of back-off in all) when
    // partition 1's messages arrive; they must not wait for it.
    running
        .wait_for("partition 0 retrying", |s| s.retries >= 1)
        .await;
    for _ in 0..20 {
        send(1, payment(uuid::Uuid::new_v4(), "flowing", 1)).await;
    }
    running
        .wait_for("partition 1 applied", |s| s.applied >= 20)
        .await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "partition 1 finished while partition 0 was still retrying: {during}"
    );

    // Partition 0 keeps its order: the stuck message is dead-lettered after
    // its attempts, then the one behind it is applied.
    running
        .wait_for("stuck message dead-lettered", |s| {
            s.dead_lettered == 1 && s.applied == 21
        })
        .await;
    running.stop().await;
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(header(&dead[0], "dedup.attempts"), Some("12"));
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("handler"));
    assert_eq!(balance(&pool).await, 21);
}

/// A database that turns read-only (SQLSTATE 25006) is the environment's
/// fault, not the events': they wait, none is dead-lettered, and once the
/// database is writable again every one is applied once.
#[sqlx::test(migrations = false)]
async fn a_read_only_database_is_waited_out_not_dead_lettered(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let running = start(
        consumer(&store, &unique("g"))
            .retry(
                RetryPolicy::default()
                    .with_backoff(Duration::from_millis(20), Duration::from_millis(200))
                    .with_outage_backoff(Duration::from_secs(1)),
            )
            .handle(&topic, record_payment),
    );
    let producer = producer();
    let send = |cents| {
        let event = payment(uuid::Uuid::new_v4(), "acct", cents);
        let producer = producer.clone();
        let topic = topic.clone();
        async move { produce(&producer, &topic, "acct", &event, None).await }
    };
    send(1).await;
    running
        .wait_for("the first event", |s| s.applied == 1)
        .await;

    common::set_read_only(&pool, true).await;
    for _ in 0..20 {
        send(10).await;
    }
    running
        .wait_for("the read-only database to be retried", |s| s.retries >= 3)
        .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "read-only is not the events' fault: {during}"
    );
    assert_eq!(during.applied, 1, "{during}");
    assert_eq!(running.stats.waiting_out(), 1, "its one partition waits");

    common::set_read_only(&pool, false).await;
    running
        .wait_for("every event applied after the outage", |s| s.applied == 21)
        .await;
    assert_eq!(running.stats.waiting_out(), 0);
    let after = running.stop().await;
    assert_eq!(after.dead_lettered, 0, "{after}");
    assert_eq!(after.outages, 1, "one outage, counted once");
    assert_eq!(balance(&pool).await, 201, "each event applied exactly once");
}

/// With `max_outage` set, an outage that outlasts it stops the consumer with
/// an error instead of waiting for ever: nothing is dead-lettered, nothing
/// committed past the waiting event, and the next run applies it once.
#[sqlx::test(migrations = false)]
async fn an_outage_longer_than_max_outage_stops_the_consumer_and_loses_nothing(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    common::set_read_only(&pool, true).await;
    let event = payment(uuid::Uuid::new_v4(), "acct", 5);
    produce(&producer(), &topic, "acct", &event, None).await;
    let impatient = consumer(&store, &group)
        .retry(
            RetryPolicy::default()
                .with_outage_backoff(Duration::from_millis(500))
                .with_max_outage(Duration::from_secs(3)),
        )
        .handle(&topic, record_payment)
        .build()
        .expect("consumer");
    let during = stops_after_max_outage(impatient, Duration::from_secs(3)).await;
    assert_eq!(during.dead_lettered, 0, "{during:?}");
    assert_eq!(during.applied, 0, "{during:?}");

    common::set_read_only(&pool, false).await;
    let after = drain(
        consumer(&store, &group).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        after.applied, 1,
        "the waiting event was not committed: {after:?}"
    );
    assert_eq!(balance(&pool).await, 5, "applied once");
}

/// Runs `consumer` until it stops, which it must do with an error naming
/// `max_outage`, not before `max_outage` has passed; what it had done.
async fn stops_after_max_outage(
    consumer: Consumer<PgStore>,
    max_outage: Duration,
) -> dedup_kafka::StatsSnapshot {
    let stats = consumer.stats();
    let started = Instant::now();
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run_until(std::future::pending()),
    )
    .await
    .expect("the consumer must stop once the outage outlasts max_outage");
    let err = ran.expect_err("an outage past max_outage is an error");
    assert!(err.to_string().contains("max_outage"), "{err}");
    assert!(
        started.elapsed() >= max_outage,
        "not before max_outage: {:?}",
        started.elapsed()
    );
    stats.snapshot()
}

/// A broker that cannot take a dead letter is an outage like the
/// database's: with `max_outage` set the consumer stops with an error
/// instead of retrying for ever, the poison message's offset is not
/// committed, and the next run dead-letters it once.
#[sqlx::test(migrations = false)]
async fn a_dead_letter_the_broker_cannot_take_is_bounded_by_max_outage(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    produce(&producer(), &topic, "k", b"not json", None).await;
    let impatient = consumer(&store, &group)
        .retry(
            RetryPolicy::default()
                .with_outage_backoff(Duration::from_millis(300))
                .with_max_outage(Duration::from_secs(3)),
        )
        // The dead-letter producer's broker is not there.
        .dead_letter_producer_set("bootstrap.servers", "127.0.0.1:1")
        .dead_letter_timeout(Duration::from_millis(500))
        .handle(&topic, record_payment)
        .build()
        .expect("consumer");
    let during = stops_after_max_outage(impatient, Duration::from_secs(3)).await;
    assert_eq!(during.dead_lettered, 0, "{during:?}");

    let after = drain(
        consumer(&store, &group).handle(&topic, record_payment),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        after.dead_lettered, 1,
        "the poison was not committed: {after:?}"
    );
    let dead = read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(dead[0].payload(), Some(&b"not json"[..]));
}

/// The backend the first attempt ran on, frozen by that attempt itself.
static FROZEN_BACKEND: std::sync::Mutex<Option<i32>> = std::sync::Mutex::new(None);

/// Freezes the transaction's database backend (`kill -STOP`) unless
/// `frozen` holds one already, as a database host that vanishes without
/// closing its connections does: the transaction's next statement hangs.
async fn freeze_backend_once(
    tx: &mut PgTx,
    frozen: &std::sync::Mutex<Option<i32>>,
) -> Result<(), sqlx::Error> {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await?;
    let first = {
        let mut frozen = frozen.lock().unwrap();
        frozen.is_none().then(|| *frozen = Some(pid)).is_some()
    };
    if first {
        signal_backend("-STOP", pid);
    }
    Ok(())
}

fn signal_backend(signal: &str, pid: i32) {
    let sent = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(sent.success(), "kill {signal} {pid}");
}

/// Thaws the backend `.0` froze however the test ends, so that it never
/// outlives the test holding its database.
struct Thaw(&'static std::sync::Mutex<Option<i32>>);

impl Thaw {
    /// Thaws it now.
    fn now(&self) {
        let pid = self.0.lock().unwrap().expect("frozen");
        signal_backend("-CONT", pid);
    }
}

impl Drop for Thaw {
    fn drop(&mut self) {
        let frozen = *self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pid) = frozen {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
        }
    }
}

/// Freezes its own database backend on the first attempt; the statement
/// after it hangs.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_on_a_backend_that_hangs(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    freeze_backend_once(tx, &FROZEN_BACKEND).await?;
    credit(tx, &ev).await
}

/// An attempt that hangs (its database backend frozen) is abandoned after
/// the attempt timeout and retried; once the backend thaws, the event is
/// applied exactly once.
#[sqlx::test(migrations = false)]
async fn a_hanging_attempt_is_abandoned_and_retried(pool: PgPool) {
    let thaw = Thaw(&FROZEN_BACKEND);
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    produce(
        &producer,
        &topic,
        "k",
        &payment(uuid::Uuid::new_v4(), "a", 9),
        None,
    )
    .await;
    let running = start(
        consumer(&store, &unique("g"))
            .attempt_timeout(Duration::from_secs(2))
            // Few attempts: the abandoned attempt's lock timeouts must not
            // use them up.
            .retry(
                RetryPolicy::default()
                    .with_max_attempts(2)
                    .with_backoff(Duration::from_millis(200), Duration::from_secs(1))
                    .with_outage_backoff(Duration::from_secs(1)),
            )
            .handle(&topic, record_payment_on_a_backend_that_hangs),
    );
    running
        .wait_for("the hanging attempt retried", |s| s.retries >= 1)
        .await;
    // Frozen well past the attempt timeout, the lock timeout (5 s) and the
    // two attempts: waited out, not dead-lettered.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(running.stats.snapshot().dead_lettered, 0);
    thaw.now();
    running.wait_for("applied", |s| s.applied == 1).await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.dead_lettered), (1, 0), "{stats}");
    assert_eq!(balance(&pool).await, 9, "applied exactly once");
}

/// The backend a batch's attempt ran on, frozen mid-batch by that attempt.
static FROZEN_BATCH_BACKEND: std::sync::Mutex<Option<i32>> = std::sync::Mutex::new(None);

/// Credits the payment; the first time it meets the account `freeze`, it
/// freezes its own database backend (`kill -STOP`) after crediting: the
/// batch's claims, taken before any body ran, stay locked by a backend that
/// answers nothing, and the batch's next statement hangs.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment_freezing_its_batch(
    tx: &mut PgTx,
    ev: PaymentReceived,
) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await?;
    if ev.account_id == "freeze" {
        freeze_backend_once(tx, &FROZEN_BATCH_BACKEND).await?;
    }
    Ok(())
}

/// A database backend frozen while it holds a whole batch's claim locks,
/// for much longer than the attempt timeout: the batch is abandoned and
/// replayed message by message, and every replayed claim meets the frozen
/// transaction's lock. That is contention, not the events' fault: nothing
/// is dead-lettered however long it lasts (with a lock timeout of 200 ms
/// and 3 attempts, the old rule dead-lettered the batch's events within a
/// second), and once the backend thaws every event is applied exactly once.
#[sqlx::test(migrations = false)]
async fn a_frozen_backend_holding_a_batchs_claims_dead_letters_nothing(pool: PgPool) {
    let thaw = Thaw(&FROZEN_BATCH_BACKEND);
    const EVENTS: i64 = 20;
    let store = dedup_tests::store_with(
        &pool,
        dedup_postgres::PgConfig::default().with_lock_timeout(Duration::from_millis(200)),
    )
    .await;
    let topic = create_topic(1).await;
    let records = (0..EVENTS).map(|i| {
        let account = if i == 5 {
            "freeze".to_owned()
        } else {
            format!("acct-{i}")
        };
        (account.clone(), payment(uuid::Uuid::new_v4(), &account, 1))
    });
    produce_all(&producer(), &topic, records).await;
    let running = start(
        consumer(&store, &unique("g"))
            .attempt_timeout(Duration::from_secs(2))
            // The idle partition's first batch waits for all 20.
            .batch_linger(Duration::from_secs(2))
            // Few, short attempts: were lock timeouts counted against them,
            // the replayed events would be dead-lettered at once.
            .retry(
                RetryPolicy::default()
                    .with_max_attempts(3)
                    .with_backoff(Duration::from_millis(50), Duration::from_millis(200))
                    .with_outage_backoff(Duration::from_secs(1)),
            )
            .handle(&topic, record_payment_freezing_its_batch),
    );
    running
        .wait_for("the frozen batch replayed and retried", |s| {
            s.batch_replays >= 1 && s.retries >= 5
        })
        .await;
    // Frozen for 10 s: five attempt timeouts, fifty lock timeouts.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "contention is waited out: {during}"
    );
    thaw.now();
    running
        .wait_for("every event finished", |s| {
            s.applied + s.skipped == EVENTS as u64
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats}");
    assert_eq!(
        balance(&pool).await,
        EVENTS,
        "each event applied exactly once: {stats}"
    );
}

/// A broker killed with SIGKILL mid-stream and started again: the consumer
/// rides it out, and every event is applied exactly once (nothing lost,
/// nothing doubled), none dead-lettered.
#[sqlx::test(migrations = false)]
async fn a_broker_killed_mid_stream_loses_and_doubles_nothing(pool: PgPool) {
    let broker = common::OwnBroker::start("kill-test", 9194).await;
    let store = store(&pool).await;
    let topic = common::create_topic_with(&broker.address, 2, &[]).await;
    let producer = common::producer_on(&broker.address);
    let records = (0..1000).map(|i| {
        let account = format!("acct-{}", i % 10);
        let payload = payment(uuid::Uuid::new_v4(), &account, 1);
        (account, payload)
    });
    produce_all(&producer, &topic, records).await;
    let running = start(
        consumer(&store, &unique("g"))
            .brokers(&broker.address)
            .batch_size(20)
            .handle(&topic, record_payment_slowly),
    );
    running
        .wait_for("part of the stream applied", |s| s.applied >= 100)
        .await;
    broker.run("kill").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.run("start").await;
    running
        .wait_for("every event applied after the broker's return", |s| {
            s.applied == 1000
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats}");
    assert_eq!(stats.applied, 1000, "{stats}");
    assert_eq!(
        balance(&pool).await,
        1000,
        "each event applied exactly once"
    );
}

/// A payment numbered within its account, so the order of applying shows.
#[derive(Debug, serde::Deserialize)]
struct NumberedPayment {
    event_id: String,
    account_id: String,
    seq: i64,
}

/// Records each payment as a row; `n` is the order of applying.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_numbered(tx: &mut PgTx, ev: NumberedPayment) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO applied (account, seq) VALUES ($1, $2)")
        .bind(&ev.account_id)
        .bind(ev.seq)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// PostgreSQL stopped for 60 s while 2,000 events stream through 4
/// partitions: the consumer waits it out without leaving its group, and once
/// the database is back every event is applied exactly once, in order within
/// its partition, and none is dead-lettered. The database is a cluster of
/// the test's own, so the tests beside it never notice.
#[tokio::test]
async fn a_database_stopped_for_a_minute_is_waited_out_in_order() {
    const ACCOUNTS: i64 = 20;
    const EVENTS: i64 = 2000;
    let pg = common::OwnPostgres::start("outage-kafka", 5442).await;
    // The pool as a service would make it: default settings.
    let pool = PgPool::connect(&pg.url).await.expect("own database");
    let store = store(&pool).await;
    sqlx::query(
        "CREATE TABLE applied (n bigserial PRIMARY KEY, account text NOT NULL, seq bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("create applied");
    let topic = create_topic(4).await;
    let producer = producer();
    let events = |range: std::ops::Range<i64>| {
        range.map(|i| {
            let account = format!("acct-{}", i % ACCOUNTS);
            let payload = serde_json::json!({
                "event_id": uuid::Uuid::new_v4(),
                "account_id": account,
                "seq": i / ACCOUNTS + 1,
            });
            (account, payload.to_string().into_bytes())
        })
    };
    produce_all(&producer, &topic, events(0..800)).await;
    let running = start(
        consumer(&store, &unique("g"))
            .retry(
                RetryPolicy::default()
                    .with_backoff(Duration::from_millis(20), Duration::from_millis(200))
                    .with_outage_backoff(Duration::from_secs(5)),
            )
            .batch_size(20)
            // An attempt that hangs on the vanished database (rather than
            // failing) is abandoned and waited out well within the minute.
            .attempt_timeout(Duration::from_secs(15))
            .handle(&topic, record_numbered),
    );
    running
        .wait_for("part of the stream applied", |s| s.applied >= 200)
        .await;

    pg.run("stop").await;
    let stopped = Instant::now();
    // The rest of the stream arrives while the database is down.
    produce_all(&producer, &topic, events(800..EVENTS)).await;
    tokio::time::sleep(Duration::from_secs(60).saturating_sub(stopped.elapsed())).await;
    let during = running.stats.snapshot();
    assert_eq!(
        during.dead_lettered, 0,
        "an outage is not the events' fault: {during:?}"
    );
    assert!(during.outages >= 1, "the outage is seen: {during:?}");
    assert!(
        running.stats.waiting_out() >= 1,
        "waiting it out: {during:?}"
    );
    assert!(during.applied < EVENTS as u64, "{during:?}");

    pg.run("start").await;
    running
        .wait_for("every event applied after the database's return", |s| {
            s.applied == EVENTS as u64
        })
        .await;
    assert_eq!(running.stats.waiting_out(), 0, "the outage is over");
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(stats.applied, EVENTS as u64, "{stats:?}");
    assert_eq!(
        stats.assignments, 1,
        "the consumer stayed in its group throughout: {stats:?}"
    );

    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT (account, seq)) FROM applied")
            .fetch_one(&pool)
            .await
            .expect("counts");
    assert_eq!(
        (rows, distinct),
        (EVENTS, EVENTS),
        "each event applied exactly once"
    );
    // Each account is one key, so one partition: its events in order.
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY account ORDER BY n) AS prev \
         FROM applied) t WHERE seq <> coalesce(prev, 0) + 1",
    )
    .fetch_one(&pool)
    .await
    .expect("order");
    assert_eq!(out_of_order, 0, "applied in order within each partition");
    pool.close().await;
}
