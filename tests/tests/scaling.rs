//! Scaling out: members (processes) joining and leaving a group mid-stream
//! under each group protocol Kafka 4 users run (eager `range`,
//! `cooperative-sticky`, the KIP-848 `consumer` protocol), handovers on
//! revoke, settings from the environment, and the pool bounding how many
//! partitions run at once.

use dedup_tests::common;

use std::time::{Duration, Instant};

use dedup_core::idempotent;
use dedup_kafka::Consumer;
use dedup_postgres::{PgConfig, PgStore, PgTx};
use dedup_tests::{PaymentReceived, credit, payment, store, store_with};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use common::{brokers, create_topic, database_url, last_line, producer, unique};

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    credit(tx, &ev).await
}

/// `KAFKA_CFG_<NAME>` reaches librdkafka (here the KIP-848 protocol, through
/// the payments example); a setting librdkafka refuses names its variable
/// and never its value.
#[sqlx::test(migrations = false)]
async fn settings_from_the_environment_reach_librdkafka(pool: PgPool) {
    // Builds and runs the payments example: not beside a test that measures.
    let _alone = one_at_a_time().await;
    let topic = create_topic(2).await;
    let producer = producer();
    for i in 0..20 {
        let body = payment(uuid::Uuid::new_v4(), "acct", i);
        producer
            .send(
                FutureRecord::to(&topic).key("acct").payload(&body),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }
    let run = |env: &[(&str, &str)]| {
        let mut cmd = common::payments(&pool, &topic, &unique("g"));
        cmd.args(["--exit-when-idle", "2s"]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("run the payments example")
    };
    let ran = run(&[CONSUMER_PROTOCOL]);
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_eq!(last_line(&ran), "applied=20 skipped=0 dead_lettered=0");

    let refused = run(&[("KAFKA_CFG_SASL_PASWORD", "hunter2-secret")]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("KAFKA_CFG_SASL_PASWORD"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

/// Each partition running a transaction holds a connection: by default no
/// more partitions run at once than the pool has connections; set higher,
/// the setting stands (with a warning).
#[sqlx::test(migrations = false)]
async fn the_pool_bounds_how_many_partitions_run_at_once(pool: PgPool) {
    let small = PgStore::connect_with(
        &database_url(&pool),
        PgConfig::default().with_max_connections(3),
    )
    .await
    .expect("store");
    let _ = store_with(&pool, PgConfig::default()).await;
    let topic = create_topic(1).await;
    let fitted = Consumer::builder(small.clone())
        .group_id(unique("g"))
        .handle(&topic, record_payment)
        .build()
        .expect("consumer");
    assert_eq!(fitted.max_concurrent_partitions(), 3);
    let chosen = Consumer::builder(small)
        .group_id(unique("g"))
        .max_concurrent_partitions(8)
        .handle(&topic, record_payment)
        .build()
        .expect("consumer");
    assert_eq!(chosen.max_concurrent_partitions(), 8);
}

/// The group protocols, as a member's environment sets them: eager
/// (librdkafka's default), and the two incremental ones.
const EAGER: (&str, &str) = ("KAFKA_CFG_PARTITION_ASSIGNMENT_STRATEGY", "range");
const COOPERATIVE: (&str, &str) = (
    "KAFKA_CFG_PARTITION_ASSIGNMENT_STRATEGY",
    "cooperative-sticky",
);
const CONSUMER_PROTOCOL: (&str, &str) = ("KAFKA_CFG_GROUP_PROTOCOL", "consumer");

/// A member of a group as its own process (`src/bin/member.rs`): what a
/// deployment runs, on a multi-thread runtime, and what SIGKILL can kill.
struct Member {
    name: String,
    child: Option<std::process::Child>,
    /// Reads its log while it runs, if kept (see [`CAPTURE_LOG`]).
    log: Option<std::thread::JoinHandle<String>>,
}

/// What a member said when it stopped.
#[derive(Debug, Default)]
struct MemberStats {
    applied: u64,
    dead_lettered: u64,
    skipped: u64,
    redelivered: u64,
    assignments: u64,
    revoked: u64,
    /// Its log, if started with [`CAPTURE_LOG`].
    log: String,
}

/// In a member's environment: its log is kept (in memory, returned when it
/// stops) instead of shown.
const CAPTURE_LOG: (&str, &str) = ("MEMBER_CAPTURE_LOG", "1");

impl Member {
    /// Starts member `name` of `group` on `topic`, with `env` (e.g.
    /// `KAFKA_CFG_GROUP_PROTOCOL`).
    fn start(pool: &PgPool, topic: &str, group: &str, name: &str, env: &[(&str, &str)]) -> Self {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_member"));
        cmd.env("DATABASE_URL", database_url(pool))
            .env("KAFKA_BROKERS", brokers())
            .env("TOPIC", topic)
            .env("GROUP_ID", group)
            .env("MEMBER", name)
            .stdout(std::process::Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        if env.contains(&CAPTURE_LOG) {
            cmd.stderr(std::process::Stdio::piped());
        }
        let mut child = cmd.spawn().expect("start a member");
        // Read as it is written, so a full pipe never blocks the member.
        let log = child.stderr.take().map(|mut stderr| {
            std::thread::spawn(move || {
                let mut log = String::new();
                let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
                log
            })
        });
        Member {
            name: name.to_owned(),
            child: Some(child),
            log,
        }
    }

    /// SIGTERM, as a deployment stops it: it finishes, commits and leaves.
    async fn stop(mut self) -> MemberStats {
        let child = self.child.take().expect("running");
        let log = self.log.take();
        let name = self.name.clone();
        tokio::task::spawn_blocking(move || {
            let pid = child.id().to_string();
            let sent = std::process::Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .expect("kill");
            assert!(sent.success());
            let out = child.wait_with_output().expect("member output");
            assert!(
                out.status.success(),
                "member {name} failed: {:?}",
                out.status
            );
            let line = last_line(&out);
            let mut stats = MemberStats {
                log: log
                    .map(|l| l.join().expect("log reader"))
                    .unwrap_or_default(),
                ..MemberStats::default()
            };
            for field in line.split_whitespace() {
                let (k, v) = field.split_once('=').expect("k=v");
                let v = v.parse().expect("a count");
                match k {
                    "applied" => stats.applied = v,
                    "skipped" => stats.skipped = v,
                    "dead_lettered" => stats.dead_lettered = v,
                    "redelivered" => stats.redelivered = v,
                    "assignments" => stats.assignments = v,
                    "revoked" => stats.revoked = v,
                    _ => {}
                }
            }
            stats
        })
        .await
        .expect("join")
    }

    /// SIGKILL: no commit, no goodbye to the group.
    fn kill(mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Tests that run groups of member processes run one at a time: each
/// measures pauses that two of them side by side on two cores would
/// stretch.
async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ALONE.lock().await
}

/// The claims table and `applied`, which members write.
async fn member_tables(pool: &PgPool) {
    let _ = store(pool).await;
    sqlx::query(
        "CREATE TABLE applied (event_id text NOT NULL, partition int NOT NULL, \
         seq bigint NOT NULL, member text NOT NULL, sent_at timestamptz NOT NULL, \
         at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await
    .expect("create applied");
}

/// Event `seq` of `partition`, as members read it, stamped with when it
/// is sent.
fn numbered(id: uuid::Uuid, partition: i32, seq: i64) -> Vec<u8> {
    let sent_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64;
    serde_json::json!({
        "event_id": id, "partition": partition, "seq": seq, "sent_at_ms": sent_at_ms,
    })
    .to_string()
    .into_bytes()
}

/// A producer that knows all `partitions` of the newly created `topic`:
/// sending to a partition its metadata does not list yet fails.
async fn producer_for(topic: &str, partitions: usize) -> rdkafka::producer::FutureProducer {
    use rdkafka::producer::Producer as _;
    let producer = producer();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let known = producer
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()
            .and_then(|m| m.topics().first().map(|t| t.partitions().len()))
            .unwrap_or(0);
        if known == partitions {
            return producer;
        }
        assert!(Instant::now() < deadline, "{topic} has {known} partitions");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends `body` to `partition` of `topic`.
async fn send_to(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    partition: i32,
    body: &[u8],
) {
    producer
        .send(
            FutureRecord::<(), _>::to(topic)
                .partition(partition)
                .payload(body),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
}

/// Rows of `applied`, and distinct events among them.
async fn applied_rows(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM applied")
        .fetch_one(pool)
        .await
        .expect("applied")
}

/// Waits until `n` distinct events are applied (or `limit` passes).
async fn wait_applied(pool: &PgPool, n: i64, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let (_, distinct) = applied_rows(pool).await;
        if distinct >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "stuck at {distinct} of {n} applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The members' tables, and a topic of two partitions holding
/// `per_partition` numbered events each.
async fn two_partitions(pool: &PgPool, per_partition: i64) -> String {
    member_tables(pool).await;
    let topic = create_topic(2).await;
    let producer = producer_for(&topic, 2).await;
    for seq in 0..per_partition {
        for p in 0..2 {
            let body = numbered(uuid::Uuid::new_v4(), p, seq);
            send_to(&producer, &topic, p, &body).await;
        }
    }
    topic
}

/// Member A applies two partitions in slow batches (20 events of
/// `sleep_ms` each), committing offsets only on revoke; once it has applied
/// a batch's worth, member B joins and takes a partition. Once all
/// `2 x per_partition` events are in (each once), returns how many the two
/// counted as redelivered.
async fn hand_over(
    pool: &PgPool,
    protocol: (&str, &str),
    sleep_ms: &str,
    per_partition: i64,
    revoke_timeout_ms: &str,
) -> u64 {
    let _alone = one_at_a_time().await;
    let topic = two_partitions(pool, per_partition).await;
    let group = unique("g");
    let env = [
        protocol,
        ("HANDLER_SLEEP_MS", sleep_ms),
        ("BATCH_SIZE", "20"),
        ("COMMIT_INTERVAL_MS", "600000"),
        ("REVOKE_TIMEOUT_MS", revoke_timeout_ms),
    ];
    let total = 2 * per_partition;
    let a = Member::start(pool, &topic, &group, "a", &env);
    wait_applied(pool, 20, Duration::from_secs(60)).await;
    let b = Member::start(pool, &topic, &group, "b", &env);
    wait_applied(pool, total, Duration::from_secs(90)).await;
    let (a, b) = (a.stop().await, b.stop().await);
    let (rows, distinct) = applied_rows(pool).await;
    assert_eq!((rows, distinct), (total, total), "each event applied once");
    let by_b: i64 = sqlx::query_scalar("SELECT count(*) FROM applied WHERE member = 'b'")
        .fetch_one(pool)
        .await
        .expect("b's");
    assert!(by_b > 0, "b took a partition: {a:?} {b:?}");
    assert_eq!(a.applied + b.applied, total as u64, "{a:?} {b:?}");
    eprintln!("revoke timeout {revoke_timeout_ms} ms: a {a:?}, b {b:?}");
    a.redelivered + b.redelivered
}

/// On revoke, the revoked partitions' batches in flight (1 s each) finish
/// and their offsets are committed before the partitions go: the next owner
/// receives none of them again, under each group protocol.
async fn a_revoke_lets_batches_in_flight_finish(pool: &PgPool, protocol: (&str, &str)) {
    assert_eq!(hand_over(pool, protocol, "50", 250, "5000").await, 0);
}

#[sqlx::test(migrations = false)]
async fn a_revoke_lets_batches_in_flight_finish_and_commits_them_under_range(pool: PgPool) {
    a_revoke_lets_batches_in_flight_finish(&pool, EAGER).await;
}

#[sqlx::test(migrations = false)]
async fn a_revoke_lets_batches_in_flight_finish_and_commits_them_under_cooperative_sticky(
    pool: PgPool,
) {
    a_revoke_lets_batches_in_flight_finish(&pool, COOPERATIVE).await;
}

#[sqlx::test(migrations = false)]
async fn a_revoke_lets_batches_in_flight_finish_and_commits_them_under_the_consumer_protocol(
    pool: PgPool,
) {
    a_revoke_lets_batches_in_flight_finish(&pool, CONSUMER_PROTOCOL).await;
}

/// Past the revoke timeout (100 ms, batches of 5 s) the batches in flight
/// are abandoned: they commit after the handover, their offsets do
/// not, and the next owners skip them as redelivered duplicates, still
/// applying each event once. (Eager: both partitions are revoked.) 100
/// events a partition: after A's first batch, 20 s of work are left for B
/// to start and join in (with 60, 10 s, B once was still starting when A
/// had applied them all, on a loaded machine).
#[sqlx::test(migrations = false)]
async fn past_the_revoke_timeout_batches_are_abandoned_and_skipped_as_redelivered(pool: PgPool) {
    let redelivered = hand_over(&pool, EAGER, "250", 100, "100").await;
    assert!(redelivered > 0);
}

/// Four members join one by one and leave one by one (the second by
/// SIGKILL) while 20,000 events, 10% of them sent twice, stream through 6
/// partitions at about 400 a second: each event is applied exactly once.
/// Returns the redeliveries the members counted and the longest gaps
/// between consecutive applies of a partition: one that stayed with its
/// member, and one that moved.
async fn members_join_and_leave(pool: &PgPool, protocol: &[(&str, &str)]) -> Scaled {
    const EVENTS: i64 = 20_000;
    let _alone = one_at_a_time().await;
    member_tables(pool).await;
    let topic = create_topic(6).await;
    let group = unique("g");
    let id = |i: i64| uuid::Uuid::from_u128(i as u128);
    let feed = {
        let (producer, topic) = (producer_for(&topic, 6).await, topic.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(25));
            let mut i = 0;
            while i < EVENTS {
                tick.tick().await;
                let mut sent = Vec::new();
                for _ in 0..10 {
                    if i == EVENTS {
                        break;
                    }
                    // Event i goes to partition i % 6; every tenth sends an
                    // earlier one of its partition again.
                    let mut events = vec![i];
                    if i % 10 == 9 && i >= 30 {
                        events.push(i - 30);
                    }
                    for e in events {
                        let p = (e % 6) as i32;
                        let body = numbered(id(e), p, e / 6);
                        let record = FutureRecord::<(), _>::to(&topic)
                            .partition(p)
                            .payload(&body);
                        sent.push(
                            producer
                                .send_result(record)
                                .map_err(|(e, _)| e)
                                .expect("queued"),
                        );
                    }
                    i += 1;
                }
                for delivery in sent {
                    delivery
                        .await
                        .expect("delivered")
                        .map_err(|(e, _)| e)
                        .expect("produced");
                }
            }
        })
    };
    let mut env: Vec<(&str, &str)> = protocol.to_vec();
    env.push(("COMMIT_INTERVAL_MS", "1000"));
    let started = Instant::now();
    let limit = Duration::from_secs(180);
    let m1 = Member::start(pool, &topic, &group, "m1", &env);
    wait_applied(pool, 2_000, limit).await;
    let m2 = Member::start(pool, &topic, &group, "m2", &env);
    wait_applied(pool, 4_000, limit).await;
    let m3 = Member::start(pool, &topic, &group, "m3", &env);
    wait_applied(pool, 6_000, limit).await;
    let m4 = Member::start(pool, &topic, &group, "m4", &env);
    wait_applied(pool, 9_000, limit).await;
    m2.kill();
    let killed: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(pool)
        .await
        .expect("now");
    wait_applied(pool, 12_000, limit).await;
    let s3 = m3.stop().await;
    wait_applied(pool, 15_000, limit).await;
    let s4 = m4.stop().await;
    feed.await.expect("feed");
    wait_applied(pool, EVENTS, limit).await;
    // Settle: nothing more may be applied.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s1 = m1.stop().await;
    let took = started.elapsed();
    for s in [&s1, &s3, &s4] {
        assert_eq!(s.dead_lettered, 0, "{s:?}");
    }
    let (rows, distinct) = applied_rows(pool).await;
    assert_eq!(
        (rows, distinct),
        (EVENTS, EVENTS),
        "each event applied exactly once"
    );
    let by_member: Vec<(String, i64)> =
        sqlx::query_as("SELECT member, count(*) FROM applied GROUP BY member ORDER BY member")
            .fetch_all(pool)
            .await
            .expect("by member");
    assert_eq!(
        by_member.len(),
        4,
        "every member applied some: {by_member:?}"
    );
    // Pauses of each partition: how long an event waited to be applied
    // once it had been sent and the partition's previous event was applied
    // (so a stall of the feed is not taken for one of the members), split
    // by whether the partition stayed with its member across the pause.
    let (stayed, moved, handed_over): (f64, f64, f64) = sqlx::query_as(
        "SELECT coalesce(max(gap) FILTER (WHERE member = before), 0)::float8, \
                coalesce(max(gap) FILTER (WHERE member <> before), 0)::float8, \
                coalesce(max(gap) FILTER (WHERE member <> before \
                    AND NOT (before = 'm2' AND at > to_timestamp($1))), 0)::float8 \
         FROM (SELECT member, at, lag(member) OVER w AS before, \
                      extract(epoch FROM at - greatest(lag(at) OVER w, sent_at)) * 1000 AS gap \
               FROM applied WINDOW w AS (PARTITION BY partition ORDER BY at)) g",
    )
    .bind(killed)
    .fetch_one(pool)
    .await
    .expect("gaps");
    // How often a partition moved away from m1 (which stays throughout).
    let moved_from_first: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT member, lag(member) OVER w AS before \
               FROM applied WINDOW w AS (PARTITION BY partition ORDER BY at)) g \
         WHERE before = 'm1' AND member <> 'm1'",
    )
    .fetch_one(pool)
    .await
    .expect("moves");
    let scaled = Scaled {
        first_revoked: s1.revoked,
        moved_from_first: moved_from_first as u64,
        redelivered: s1.redelivered + s3.redelivered + s4.redelivered,
        stayed_gap_ms: stayed as u64,
        moved_gap_ms: moved as u64,
        handed_over_gap_ms: handed_over as u64,
    };
    eprintln!(
        "{protocol:?}: redelivered={} longest gap: stayed {} ms, moved {} ms (not from the \
         killed member: {} ms); m1: {} \
         partitions revoked, {} moved away; took {took:?}; applied by member {by_member:?}; \
         m1 {s1:?}, m3 {s3:?}, m4 {s4:?}",
        scaled.redelivered,
        scaled.stayed_gap_ms,
        scaled.moved_gap_ms,
        scaled.handed_over_gap_ms,
        scaled.first_revoked,
        scaled.moved_from_first
    );
    scaled
}

/// What a scale-out run measured.
#[derive(Debug)]
struct Scaled {
    /// Partitions revoked from the member that stays throughout.
    first_revoked: u64,
    /// How many of its partitions moved to another member.
    moved_from_first: u64,
    /// Duplicates skipped at the start of assignments, by the members that
    /// stopped gracefully (the killed one cannot say).
    redelivered: u64,
    /// The longest time a partition that stayed with its member went
    /// without an apply while events kept coming.
    stayed_gap_ms: u64,
    /// The longest handover of a partition from one member to another.
    moved_gap_ms: u64,
    /// The longest handover from a member that was not killed.
    handed_over_gap_ms: u64,
}

/// The classic protocols' session timeout: a killed member's partitions move
/// after 10 s (librdkafka's default: 45 s).
const CLASSIC_SESSION: (&str, &str) = ("KAFKA_CFG_SESSION_TIMEOUT_MS", "10000");

/// Eager: every rebalance revokes all of a member's partitions, also those
/// it gets back.
#[sqlx::test(migrations = false)]
async fn four_members_join_and_leave_under_eager_range(pool: PgPool) {
    let scaled = members_join_and_leave(&pool, &[EAGER, CLASSIC_SESSION]).await;
    assert!(scaled.first_revoked > scaled.moved_from_first, "{scaled:?}");
}

/// Incremental protocols: a rebalance revokes only the partitions that
/// move; the others keep being applied throughout.
fn kept_the_partitions_that_stayed(scaled: &Scaled) {
    assert_eq!(scaled.first_revoked, scaled.moved_from_first, "{scaled:?}");
    assert!(scaled.stayed_gap_ms < STAYED_GAP_LIMIT_MS, "{scaled:?}");
}

#[sqlx::test(migrations = false)]
async fn four_members_join_and_leave_under_cooperative_sticky(pool: PgPool) {
    let scaled = members_join_and_leave(&pool, &[COOPERATIVE, CLASSIC_SESSION]).await;
    kept_the_partitions_that_stayed(&scaled);
}

#[sqlx::test(migrations = false)]
async fn four_members_join_and_leave_under_the_consumer_protocol(pool: PgPool) {
    let scaled = members_join_and_leave(&pool, &[CONSUMER_PROTOCOL]).await;
    kept_the_partitions_that_stayed(&scaled);
}

/// The longest a partition that did not move may pause while events keep
/// coming (one every 15 ms): usually about 100 ms, but librdkafka (2.12)
/// pauses the fetchers of every assigned partition while an incremental
/// revoke is handled, and when all of a member's partitions were paused its
/// broker thread may see the resume only at its next one-second wake-up: up
/// to about a second (the member's buffered messages are applied
/// meanwhile). Plus a margin for a shared 2-core machine running four
/// members, a broker and PostgreSQL.
const STAYED_GAP_LIMIT_MS: u64 = 2_500;

/// Static membership (`group.instance.id`): a member restarted within the
/// session timeout gets its own partitions back, and the other member's
/// assignment never changes. Events keep coming throughout; each is applied
/// once.
async fn a_static_member_restarts_and_keeps_its_partitions(pool: &PgPool, protocol: (&str, &str)) {
    let _alone = one_at_a_time().await;
    member_tables(pool).await;
    let topic = create_topic(4).await;
    let group = unique("g");
    let producer = producer_for(&topic, 4).await;
    let stop_feed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let feed = {
        let (topic, stop) = (topic.clone(), stop_feed.clone());
        tokio::spawn(async move {
            let mut sent = 0_i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for p in 0..4 {
                    let body = numbered(uuid::Uuid::new_v4(), p, sent);
                    send_to(&producer, &topic, p, &body).await;
                }
                sent += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            sent * 4
        })
    };
    let mut env = vec![protocol];
    if protocol != CONSUMER_PROTOCOL {
        env.push(("KAFKA_CFG_SESSION_TIMEOUT_MS", "30000"));
    }
    let with_id = |id: &'static str| {
        let mut env = env.clone();
        env.push(("KAFKA_CFG_GROUP_INSTANCE_ID", id));
        env
    };
    let partitions_of = |member: &'static str| async move {
        sqlx::query_scalar::<_, i32>(
            "SELECT DISTINCT partition FROM applied WHERE member = $1 ORDER BY 1",
        )
        .bind(member)
        .fetch_all(pool)
        .await
        .expect("partitions")
    };
    let a = Member::start(pool, &topic, &group, "a1", &with_id("a"));
    wait_applied(pool, 100, Duration::from_secs(60)).await;
    let b = Member::start(pool, &topic, &group, "b", &with_id("b"));
    // Both hold two partitions once b's two have been applied by b.
    let deadline = Instant::now() + Duration::from_secs(60);
    while partitions_of("b").await.len() < 2 {
        assert!(Instant::now() < deadline, "b never got two partitions");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = a.stop().await;
    let a_had: Vec<i32> = sqlx::query_scalar(
        "SELECT DISTINCT partition FROM applied WHERE member = 'a1' \
         AND at > (SELECT max(at) FROM applied WHERE member = 'a1') - interval '1 second' \
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .expect("a1's last partitions");
    assert_eq!(a_had.len(), 2, "a1 held two partitions at the end");
    // Down longer than a heartbeat (the consumer protocol's: 5 s), so a
    // member that left would have had its partitions given to b; restarted
    // well within the session timeout (15 s and 30 s).
    tokio::time::sleep(Duration::from_secs(7)).await;
    let a = Member::start(pool, &topic, &group, "a2", &with_id("a"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while partitions_of("a2").await.len() < 2 {
        assert!(Instant::now() < deadline, "a2 never applied two partitions");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_feed.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = feed.await.expect("feed");
    wait_applied(pool, sent, Duration::from_secs(60)).await;
    let (again, other) = (a.stop().await, b.stop().await);
    assert_eq!(
        partitions_of("a2").await,
        a_had,
        "a got its partitions back"
    );
    // (A static leader that rejoins may start a rebalance under the classic
    // protocol: b then gets an empty incremental assignment, nothing more.)
    assert_eq!(other.revoked, 0, "b lost no partition: {other:?}");
    let b_had = partitions_of("b").await;
    assert_eq!(b_had.len(), 2, "b gained no partition");
    assert!(b_had.iter().all(|p| !a_had.contains(p)));
    let (rows, distinct) = applied_rows(pool).await;
    assert_eq!((rows, distinct), (sent, sent), "each event applied once");
    eprintln!("{protocol:?}: a1 {first:?}, a2 {again:?}, b {other:?}");
}

#[sqlx::test(migrations = false)]
async fn a_static_member_restarts_and_keeps_its_partitions_under_cooperative_sticky(pool: PgPool) {
    a_static_member_restarts_and_keeps_its_partitions(&pool, COOPERATIVE).await;
}

#[sqlx::test(migrations = false)]
async fn a_static_member_restarts_and_keeps_its_partitions_under_the_consumer_protocol(
    pool: PgPool,
) {
    a_static_member_restarts_and_keeps_its_partitions(&pool, CONSUMER_PROTOCOL).await;
}

/// The consumer loop does not turn while a revoke waits: a revoke timeout
/// that would outlast the liveness limit or the poll interval is refused,
/// naming the setting.
#[sqlx::test(migrations = false)]
async fn a_revoke_timeout_longer_than_liveness_allows_is_refused(pool: PgPool) {
    let store = store(&pool).await;
    let builder = |timeout| {
        Consumer::builder(store.clone())
            .group_id(unique("g"))
            .revoke_timeout(timeout)
            .handle("t", record_payment)
    };
    let err = builder(Duration::from_secs(15)).build().unwrap_err();
    assert!(err.to_string().contains("revoke_timeout"), "{err}");
    assert!(builder(Duration::from_secs(14)).build().is_ok());
    // Nor past the poll interval the group allows.
    let err = builder(Duration::from_secs(5))
        .set("max.poll.interval.ms", "5000")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("max.poll.interval.ms"), "{err}");
}

/// A partition waiting out a failure of the environment cannot finish in
/// time for a handover: its revoke gives it up at once instead of waiting
/// out the revoke timeout (the consumer loop does not turn meanwhile), and
/// once the database is back every event is applied once.
#[sqlx::test(migrations = false)]
async fn a_revoke_does_not_wait_for_a_partition_waiting_out_an_outage(pool: PgPool) {
    let _alone = one_at_a_time().await;
    let topic = two_partitions(&pool, 20).await;
    let group = unique("g");
    common::set_read_only(&pool, true).await;
    let env = [COOPERATIVE, ("REVOKE_TIMEOUT_MS", "10000"), CAPTURE_LOG];
    let a = Member::start(&pool, &topic, &group, "a", &env);
    // a has both partitions and waits out the read-only database.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let b = Member::start(&pool, &topic, &group, "b", &env);
    tokio::time::sleep(Duration::from_secs(8)).await;
    common::set_read_only(&pool, false).await;
    wait_applied(&pool, 40, Duration::from_secs(90)).await;
    let (a, b) = (a.stop().await, b.stop().await);
    assert_eq!(applied_rows(&pool).await, (40, 40), "each event once");
    assert_eq!(a.dead_lettered + b.dead_lettered, 0);
    // The rebalance's revoke (not the one of a's own shutdown) came while
    // a was still waiting out the outage, and did not wait for it.
    let lines: Vec<&str> = a.log.lines().collect();
    let revokes: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains("partitions revoked") && lines[i].contains("closing=false"))
        .collect();
    assert_eq!(revokes.len(), 1, "one rebalance revoke: {}", a.log);
    let revoke = lines[revokes[0]];
    assert!(revoke.contains("partitions=1"), "{revoke}");
    let outage_over = lines.iter().position(|l| l.contains("outage over"));
    assert!(
        outage_over.is_some_and(|over| over > revokes[0]),
        "the outage outlasted the revoke: {}",
        a.log
    );
    let waited = revoke
        .split("waited=")
        .nth(1)
        .and_then(|w| w.split_whitespace().next())
        .map(parse_duration)
        .expect("waited=");
    assert!(
        waited < Duration::from_secs(1),
        "the revoke waited {waited:?}"
    );
}

/// A `Debug`-printed duration as the log shows it (`2.1ms`, `35.9µs`, `1.2s`).
fn parse_duration(s: &str) -> Duration {
    let split = s
        .find(|c: char| c.is_alphabetic() || c == 'µ')
        .expect("a unit");
    let (n, unit) = s.split_at(split);
    let n: f64 = n.parse().expect("a number");
    Duration::from_secs_f64(match unit {
        "s" => n,
        "ms" => n / 1e3,
        "µs" => n / 1e6,
        "ns" => n / 1e9,
        other => panic!("unit {other}"),
    })
}

/// Through the broker's SASL_SSL listener (SCRAM-SHA-512 over TLS verified
/// against the test CA, nothing else reachable for the members: their only
/// bootstrap server is that listener), a member applying 2 x 400 events is
/// SIGKILLed; the next member, also over SASL_SSL, takes over from the
/// committed offsets: each event applied exactly once, and three malformed
/// events dead-lettered once each by the member's own (secured) producer.
#[sqlx::test(migrations = false)]
async fn exactly_once_over_sasl_ssl_under_a_kill(pool: PgPool) {
    let _alone = one_at_a_time().await;
    let topic = two_partitions(&pool, 400).await;
    let producer = producer_for(&topic, 2).await;
    for _ in 0..3 {
        send_to(&producer, &topic, 0, b"not an event").await;
    }
    let secured = common::secured_env();
    assert!(
        secured
            .iter()
            .any(|(k, v)| k == "KAFKA_CFG_SECURITY_PROTOCOL" && v == "SASL_SSL"),
        "{secured:?}"
    );
    let mut env: Vec<(&str, &str)> = secured
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env.extend([
        // Slow enough that the kill lands mid-stream on a loaded machine.
        ("HANDLER_SLEEP_MS", "5"),
        ("BATCH_SIZE", "20"),
        ("COMMIT_INTERVAL_MS", "500"),
        // The killed member's partitions move after 6 s, not 45.
        ("KAFKA_CFG_SESSION_TIMEOUT_MS", "6000"),
    ]);
    let group = unique("g");
    let a = Member::start(&pool, &topic, &group, "a", &env);
    wait_applied(&pool, 150, Duration::from_secs(60)).await;
    a.kill();
    let b = Member::start(&pool, &topic, &group, "b", &env);
    wait_applied(&pool, 800, Duration::from_secs(120)).await;
    let dead = common::read_exactly(&brokers(), &format!("{topic}.dlq"), 3).await;
    let b = b.stop().await;
    let (rows, distinct) = applied_rows(&pool).await;
    assert_eq!((rows, distinct), (800, 800), "each event applied once");
    assert!(
        b.applied > 0 && b.applied < 800,
        "b took over from a: {b:?}"
    );
    for record in &dead {
        assert_eq!(common::header(record, "dedup.error.kind"), Some("decode"));
        assert_eq!(
            common::header(record, "dedup.original.topic"),
            Some(topic.as_str())
        );
    }
}

/// What a member that cannot start says: its log and error, once it exits
/// (within 30 s, or the test fails: it must never hang).
async fn refused_member(pool: &PgPool, topic: &str, group: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_member"));
    cmd.env("DATABASE_URL", database_url(pool))
        .env("TOPIC", topic)
        .env("GROUP_ID", group)
        .env("MEMBER", "refused")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("start a member");
    let pid = child.id();
    let mut waited = tokio::task::spawn_blocking(move || child.wait_with_output());
    let out = match tokio::time::timeout(Duration::from_secs(30), &mut waited).await {
        Ok(out) => out.expect("join").expect("member output"),
        Err(_) => {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            let out = waited.await.expect("join").expect("member output");
            panic!(
                "the member neither started nor stopped within 30 s; it said: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    assert!(!out.status.success(), "the member ran");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A wrong SASL password, a CA that did not sign the broker's certificate
/// and an expired client certificate (mutual TLS): each stops the member at
/// start with one error naming what to check (never the password), within
/// seconds; nothing is consumed, and a member with a valid client
/// certificate then applies every event once over mutual TLS.
#[sqlx::test(migrations = false)]
async fn a_wrong_password_or_ca_stops_the_start_with_a_clear_error(pool: PgPool) {
    let _alone = one_at_a_time().await;
    let topic = two_partitions(&pool, 20).await;
    let group = unique("g");
    let secured = common::secured_env();
    let env: Vec<(&str, &str)> = secured
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let with = |key: &'static str, value: &'static str| {
        let mut changed: Vec<(&str, &str)> =
            env.iter().filter(|(k, _)| *k != key).copied().collect();
        changed.push((key, value));
        changed
    };

    let said = refused_member(
        &pool,
        &topic,
        &group,
        &with("KAFKA_CFG_SASL_PASSWORD", "not-the-password"),
    )
    .await;
    assert!(said.contains("refused this client's credentials"), "{said}");
    assert!(said.contains("SCRAM-SHA-512"), "{said}");
    assert!(
        !said.contains("not-the-password"),
        "the password in the log: {said}"
    );

    let other_ca = format!("{}/other-ca.pem", tls_dir());
    let other_ca: &'static str = Box::leak(other_ca.into_boxed_str());
    let said = refused_member(
        &pool,
        &topic,
        &group,
        &with("KAFKA_CFG_SSL_CA_LOCATION", other_ca),
    )
    .await;
    assert!(
        said.contains("could not verify the brokers' certificate"),
        "{said}"
    );
    assert!(said.contains("certificate verify failed"), "{said}");

    // Mutual TLS (the listener that requires a client certificate): one
    // that has expired is refused by the broker.
    let tls = tls_dir();
    let mtls = |cert: &str| -> Vec<(&'static str, String)> {
        vec![
            ("KAFKA_BROKERS", "127.0.0.1:9097".to_owned()),
            ("KAFKA_CFG_SECURITY_PROTOCOL", "SSL".to_owned()),
            ("KAFKA_CFG_SSL_CA_LOCATION", format!("{tls}/ca.pem")),
            (
                "KAFKA_CFG_SSL_CERTIFICATE_LOCATION",
                format!("{tls}/{cert}.pem"),
            ),
            ("KAFKA_CFG_SSL_KEY_LOCATION", format!("{tls}/{cert}.key")),
        ]
    };
    let expired = mtls("expired");
    let expired: Vec<(&str, &str)> = expired.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let said = refused_member(&pool, &topic, &group, &expired).await;
    assert!(
        said.contains("TLS handshake with the brokers failed"),
        "{said}"
    );
    assert!(said.contains("client certificate"), "{said}");
    assert!(said.contains("SSL alert"), "the brokers' own word: {said}");

    // Nothing was consumed; a member with a valid client certificate then
    // applies every event once over mutual TLS.
    assert_eq!(applied_rows(&pool).await, (0, 0));
    let valid = mtls("client");
    let valid: Vec<(&str, &str)> = valid.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let member = Member::start(&pool, &topic, &group, "a", &valid);
    wait_applied(&pool, 40, Duration::from_secs(60)).await;
    member.stop().await;
    assert_eq!(applied_rows(&pool).await, (40, 40));
}

/// The certificates scripts/tls.sh made.
fn tls_dir() -> String {
    std::env::var("DEDUP_TLS_DIR").unwrap_or_else(|_| "/var/tmp/dedup-tls".into())
}
