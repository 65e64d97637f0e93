//! The consumer group: rebalances mid-stream, shutdown and SIGTERM, a crash between the database commit and the offset commit, a fenced static member, back-pressure.

use super::*;

#[sqlx::test(migrations = false)]
async fn a_rebalance_mid_stream_applies_every_event_exactly_once(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(4).await;
    let group = unique("g");
    let producer = producer();
    let mut expected = 0;
    let mut events = Vec::new();
    for i in 0..240 {
        let account = format!("acct-{}", i % 8);
        let event = payment(uuid::Uuid::new_v4(), &account, i + 1);
        expected += i + 1;
        events.push((account, event));
    }
    // Every 6th event again, as a retrying producer would.
    let duplicates: Vec<_> = events.iter().step_by(6).cloned().collect();
    for (account, event) in events.iter().chain(&duplicates) {
        produce(&producer, &topic, account, event, None).await;
    }

    // A small buffer makes partitions pause and resume around the rebalance.
    let builder = || {
        consumer(&store, &group)
            .max_buffered_per_partition(4)
            .handle(&topic, record_payment_slowly)
    };
    let first = start(builder());
    first
        .wait_for("the first consumer under way", |s| s.applied >= 30)
        .await;
    let second = start(builder());
    let deadline = Instant::now() + Duration::from_secs(90);
    while first.stats.snapshot().applied + second.stats.snapshot().applied < 240 {
        assert!(
            Instant::now() < deadline,
            "not every event was applied: {} + {}",
            first.stats.snapshot(),
            second.stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (a, b) = (first.stop().await, second.stop().await);
    assert!(
        b.applied + b.skipped > 0,
        "the second consumer got partitions: {a} / {b}"
    );
    assert_eq!(
        a.applied + b.applied,
        240,
        "each distinct event applied exactly once: {a} / {b}"
    );
    assert_eq!(balance(&pool).await, expected);
}

#[sqlx::test(migrations = false)]
async fn shutdown_commits_what_finished(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(2).await;
    let group = unique("g");
    let producer = producer();
    for i in 0..60 {
        produce(
            &producer,
            &topic,
            &format!("k{}", i % 4),
            &payment(uuid::Uuid::new_v4(), "a", 1),
            None,
        )
        .await;
    }

    // Stop mid-stream.
    // Small batches, so that the stop lands between them.
    let running = start(
        consumer(&store, &group)
            .batch_size(4)
            .handle(&topic, record_payment_slowly),
    );
    running.wait_for("some applied", |s| s.applied >= 20).await;
    let first = running.stop().await;
    assert!(
        first.applied < 60,
        "the stop should land mid-stream: {first}"
    );

    // The restart reprocesses nothing that finished: no duplicates to skip.
    let second = drain(
        consumer(&store, &group)
            .batch_size(4)
            .handle(&topic, record_payment_slowly),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        second.skipped, 0,
        "a finished message was delivered again: {first} then {second}"
    );
    assert_eq!(first.applied + second.applied, 60);
    assert_eq!(balance(&pool).await, 60);
}

#[sqlx::test(migrations = false)]
async fn a_crash_between_database_commit_and_offset_commit_is_skipped_on_restart(pool: PgPool) {
    let topic = create_topic(1).await;
    let group = unique("g");
    produce(
        &producer(),
        &topic,
        "acct",
        &payment(uuid::Uuid::new_v4(), "acct", 500),
        None,
    )
    .await;
    let run = |failpoint| run_payments(&pool, &topic, &group, failpoint);

    // The process dies right after the database commit, before any offset commit.
    let crashed = run(Some("after-commit"));
    assert!(
        !crashed.status.success(),
        "the failpoint must kill the process"
    );
    assert_eq!(
        balance(&pool).await,
        500,
        "the effect committed before the crash"
    );

    // The restarted consumer gets the message again and skips it.
    let restarted = run(None);
    assert!(
        restarted.status.success(),
        "{}",
        String::from_utf8_lossy(&restarted.stderr)
    );
    assert_eq!(
        last_line(&restarted),
        "applied=0 skipped=1 dead_lettered=0",
        "{}",
        String::from_utf8_lossy(&restarted.stdout)
    );
    assert_eq!(
        balance(&pool).await,
        500,
        "applied exactly once across the crash"
    );
}

#[sqlx::test(migrations = false)]
async fn the_orders_example_shuts_down_gracefully_on_sigterm(pool: PgPool) {
    let topic = create_topic(1).await;
    let producer = producer();
    let ids: Vec<String> = (0..3).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    let events = [
        (&ids[0], "created", 1),
        (&ids[1], "paid", 2),
        (&ids[1], "paid", 2),
        (&ids[2], "shipped", 3),
    ];
    for (id, status, version) in events {
        let event = serde_json::json!({ "event_id": id, "order_id": "o-1", "status": status, "version": version });
        produce(&producer, &topic, "o-1", event.to_string().as_bytes(), None).await;
    }

    let log_path = std::env::temp_dir().join(format!("{topic}.orders.log"));
    let child = Command::new(example("orders"))
        .env("DATABASE_URL", database_url(&pool))
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", &topic)
        .env("GROUP_ID", unique("g"))
        .stdout(std::process::Stdio::piped())
        // Logs to a file, not a pipe nobody drains while waiting for the exit.
        .stderr(std::fs::File::create(&log_path).expect("log file"))
        .spawn()
        .expect("start orders");
    let mut child = KillOnDrop(Some(child));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let row: Option<(String, i32)> =
            sqlx::query_as("SELECT status, updates FROM orders WHERE id = 'o-1'")
                .fetch_optional(&pool)
                .await
                .unwrap_or(None);
        if let Some((status, 3)) = row {
            assert_eq!(status, "shipped");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the orders example did not apply the events"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let pid = child.0.as_ref().expect("running").id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    while child
        .0
        .as_mut()
        .expect("running")
        .try_wait()
        .expect("wait")
        .is_none()
    {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "the orders example did not exit after SIGTERM:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let output = child
        .0
        .take()
        .expect("exited")
        .wait_with_output()
        .expect("orders output");
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        output.status.success(),
        "SIGTERM must end in exit 0:\n{log}"
    );
    assert_eq!(last_line(&output), "applied=3 skipped=1 dead_lettered=0");
}

/// A fatal client error stops the consumer with an error instead of leaving
/// it running deaf: two instances with one `group.instance.id` (static
/// membership), the older one fenced by the broker.
#[sqlx::test(migrations = false)]
async fn a_fenced_static_member_stops_with_an_error(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    let instance = unique("instance");
    let member = |store: &PgStore| {
        consumer(store, &group)
            .set("group.instance.id", &instance)
            .handle(&topic, record_payment)
            .build()
            .expect("consumer")
    };
    let first = member(&store);
    let first_stats = first.stats();
    let first = tokio::spawn(first.run_until(std::future::pending()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while first_stats.idle_for() == Duration::ZERO {
        assert!(Instant::now() < deadline, "the first member never joined");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second =
        tokio::spawn(member(&store).run_until(tokio::time::sleep(Duration::from_secs(40))));
    let fenced = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the fenced member must stop within 30 s")
        .expect("task");
    let err = fenced.expect_err("fenced is an error");
    assert!(err.to_string().contains("fatal"), "{err}");
    second.abort();
}

/// With the smallest buffer, fetching pauses and resumes for nearly every
/// message; a worker that drains between the dispatcher's send and its
/// pause must not leave the partition paused for good.
#[sqlx::test(migrations = false)]
async fn a_tiny_buffer_pauses_and_resumes_without_stalling(pool: PgPool) {
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let records = (0..300).map(|_| ("k".to_owned(), payment(uuid::Uuid::new_v4(), "a", 1)));
    produce_all(&producer, &topic, records).await;
    let running = start(
        consumer(&store, &unique("g"))
            .max_buffered_per_partition(2)
            .batch_size(1)
            // Each resume fetches again: do not wait long for data there.
            .set("fetch.wait.max.ms", "10")
            .handle(&topic, record_payment),
    );
    running
        .wait_for("every event applied", |s| s.applied == 300)
        .await;
    running.stop().await;
    assert_eq!(balance(&pool).await, 300);
}

/// librdkafka drops a partition's resume that reaches the partition after
/// a newer request of its own thread (around an assignment), and returns
/// Ok all the same: a partition paused for back-pressure then stayed
/// paused for good, nothing left to resume it. The payments example, its
/// first resume dropped (failpoint `resume-lost`), still applies every
/// event of a backlog through a small buffer: the consumer resumes, every
/// second, what should run.
#[sqlx::test(migrations = false)]
async fn a_resume_librdkafka_drops_does_not_stall_the_partition(pool: PgPool) {
    let topic = create_topic(1).await;
    let producer = producer();
    let records = (0..200).map(|_| ("k".to_owned(), payment(uuid::Uuid::new_v4(), "a", 1)));
    produce_all(&producer, &topic, records).await;
    let output = common::payments(&pool, &topic, &unique("g"))
        .args(["--exit-when-idle", "5s"])
        .env("DEDUP_MAX_BUFFERED", "4")
        .env("DEDUP_FAILPOINT", "resume-lost:1")
        .output()
        .expect("run the payments example");
    let log = String::from_utf8_lossy(&output.stderr);
    let tail: Vec<&str> = log.lines().rev().take(20).collect();
    assert!(output.status.success(), "{tail:?}");
    assert!(
        log.contains("failpoint: failing here once"),
        "a resume was dropped: {tail:?}"
    );
    assert_eq!(
        common::last_line(&output),
        "applied=200 skipped=0 dead_lettered=0",
        "{tail:?}"
    );
    assert_eq!(balance(&pool).await, 200);
}

/// A backlog fills the buffer of every partition, so every partition of
/// the broker is paused at once; a resume must fetch again at once, not
/// when librdkafka's idle fetcher next looks (up to a second: a resume does
/// not wake it). 20,000 events through a buffer of 250 are 160 pause-resume
/// cycles: over a minute before the runtime woke the fetcher, a few
/// seconds after.
#[sqlx::test(migrations = false)]
async fn a_paused_partition_fetches_again_as_soon_as_it_resumes(pool: PgPool) {
    const EVENTS: i64 = 20_000;
    let store = store(&pool).await;
    let topic = create_topic(1).await;
    let producer = producer();
    let records = (0..EVENTS).map(|_| ("k".to_owned(), payment(uuid::Uuid::new_v4(), "a", 1)));
    produce_all(&producer, &topic, records).await;
    let started = Instant::now();
    let running = start(
        consumer(&store, &unique("g"))
            .max_buffered_per_partition(250)
            .handle(&topic, record_payment),
    );
    running
        .wait_for("every event applied", |s| s.applied == EVENTS as u64)
        .await;
    let took = started.elapsed();
    eprintln!("{EVENTS} events through a buffer of 250: {took:?}");
    running.stop().await;
    assert_eq!(balance(&pool).await, EVENTS);
    assert!(
        took < Duration::from_secs(30),
        "160 pause-resume cycles took {took:?}: a resumed partition waited for the idle fetcher"
    );
}
