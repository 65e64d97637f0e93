//! Scaling out: members joining and leaving a group mid-stream under each
//! group protocol Kafka 4 users run (eager `range`, `cooperative-sticky`,
//! the KIP-848 `consumer` protocol), settings from the environment, and the
//! pool bounding how many partitions run at once.

mod common;

use std::time::{Duration, Instant};

use dedup_core::idempotent;
use dedup_kafka::Consumer;
use dedup_postgres::{PgConfig, PgStore, PgTx};
use dedup_tests::{PaymentReceived, credit, payment, store, store_with, total_balance};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use common::{brokers, create_topic, database_url, last_line, producer, unique};

/// Slow enough that members join and leave while the stream flows.
#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: PaymentReceived) -> Result<(), sqlx::Error> {
    tokio::time::sleep(Duration::from_millis(2)).await;
    credit(tx, &ev).await
}

/// Three members join one by one while 3,000 payments (10% sent twice)
/// stream through 6 partitions, then two leave one by one: every payment is
/// applied exactly once, none dead-lettered.
async fn members_come_and_go(pool: PgPool, protocol: &[(&str, &str)]) {
    let store = store(&pool).await;
    let topic = create_topic(6).await;
    let group = unique("g");
    let builder = || {
        let mut b = Consumer::builder(store.clone())
            .brokers(brokers())
            .group_id(&group)
            .batch_size(20)
            .commit_interval(Duration::from_millis(200))
            .handle(&topic, record_payment);
        for (k, v) in protocol {
            b = b.set(*k, *v);
        }
        b
    };
    let producer = producer();
    let mut expected = 0;
    let mut records = Vec::new();
    for i in 0..3000_i64 {
        let account = format!("acct-{}", i % 60);
        let body = payment(uuid::Uuid::new_v4(), &account, 1 + i % 7);
        expected += 1 + i % 7;
        if i % 10 == 0 {
            records.push((account.clone(), body.clone()));
        }
        records.push((account, body));
    }
    let feed = {
        let (producer, topic) = (producer.clone(), topic.clone());
        tokio::spawn(async move {
            for chunk in records.chunks(300) {
                for (key, body) in chunk {
                    producer
                        .send(
                            FutureRecord::to(&topic).key(key).payload(body),
                            Duration::from_secs(10),
                        )
                        .await
                        .map_err(|(e, _)| e)
                        .expect("produced");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let applied = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM dedup_claims")
            .fetch_one(&pool)
            .await
            .expect("claims")
    };
    let wait_for = |n: i64| async move {
        let deadline = Instant::now() + Duration::from_secs(120);
        while applied().await < n {
            assert!(Instant::now() < deadline, "stuck below {n} applied");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let first = common::start(builder());
    wait_for(300).await;
    let second = common::start(builder());
    wait_for(900).await;
    let third = common::start(builder());
    wait_for(1500).await;
    let second_stats = second.stop().await;
    wait_for(2100).await;
    let third_stats = third.stop().await;
    feed.await.expect("feed");
    wait_for(3000).await;
    // Settle: nothing more may be applied.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first_stats = first.stop().await;
    let dead = first_stats.dead_lettered + second_stats.dead_lettered + third_stats.dead_lettered;
    assert_eq!(dead, 0, "{first_stats:?} {second_stats:?} {third_stats:?}");
    assert!(
        second_stats.applied > 0 && third_stats.applied > 0,
        "the members that joined took partitions: {second_stats:?} {third_stats:?}"
    );
    assert_eq!(applied().await, 3000);
    assert_eq!(
        total_balance(&pool).await,
        expected,
        "every payment applied exactly once"
    );
}

#[sqlx::test(migrations = false)]
async fn members_come_and_go_under_eager_range(pool: PgPool) {
    members_come_and_go(pool, &[("partition.assignment.strategy", "range")]).await;
}

#[sqlx::test(migrations = false)]
async fn members_come_and_go_under_cooperative_sticky(pool: PgPool) {
    members_come_and_go(
        pool,
        &[("partition.assignment.strategy", "cooperative-sticky")],
    )
    .await;
}

#[sqlx::test(migrations = false)]
async fn members_come_and_go_under_the_consumer_protocol(pool: PgPool) {
    members_come_and_go(pool, &[("group.protocol", "consumer")]).await;
}

/// `KAFKA_CFG_<NAME>` reaches librdkafka (here the KIP-848 protocol, through
/// the payments example); a setting librdkafka refuses names its variable
/// and never its value.
#[sqlx::test(migrations = false)]
async fn settings_from_the_environment_reach_librdkafka(pool: PgPool) {
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
    let ran = run(&[("KAFKA_CFG_GROUP_PROTOCOL", "consumer")]);
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

/// A member of a group as its own process (`src/bin/member.rs`): what a
/// deployment runs, on a multi-thread runtime, and what SIGKILL can kill.
struct Member {
    name: String,
    child: Option<std::process::Child>,
}

/// What a member said when it stopped.
#[derive(Debug, Default)]
struct MemberStats {
    applied: u64,
    skipped: u64,
    redelivered: u64,
    assignments: u64,
}

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
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start a member");
        Member {
            name: name.to_owned(),
            child: Some(child),
        }
    }

    /// SIGTERM, as a deployment stops it: it finishes, commits and leaves.
    async fn stop(mut self) -> MemberStats {
        let child = self.child.take().expect("running");
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
            let mut stats = MemberStats::default();
            for field in line.split_whitespace() {
                let (k, v) = field.split_once('=').expect("k=v");
                let v = v.parse().expect("a count");
                match k {
                    "applied" => stats.applied = v,
                    "skipped" => stats.skipped = v,
                    "redelivered" => stats.redelivered = v,
                    "assignments" => stats.assignments = v,
                    _ => {}
                }
            }
            stats
        })
        .await
        .expect("join")
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

/// The claims table and `applied`, which members write.
async fn member_tables(pool: &PgPool) {
    let _ = store(pool).await;
    sqlx::query(
        "CREATE TABLE applied (event_id text NOT NULL, partition int NOT NULL, \
         seq bigint NOT NULL, member text NOT NULL, \
         at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await
    .expect("create applied");
}

/// Event `seq` of `partition`, as members read it.
fn numbered(id: uuid::Uuid, partition: i32, seq: i64) -> Vec<u8> {
    serde_json::json!({ "event_id": id, "partition": partition, "seq": seq })
        .to_string()
        .into_bytes()
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
    member_tables(pool).await;
    let topic = create_topic(2).await;
    let group = unique("g");
    let producer = producer();
    for seq in 0..per_partition {
        for p in 0..2 {
            send_to(
                &producer,
                &topic,
                p,
                &numbered(uuid::Uuid::new_v4(), p, seq),
            )
            .await;
        }
    }
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

/// On revoke, the revoked partitions' batches in flight finish and their
/// offsets are committed before the partitions go: the next owner receives
/// none of them again, under each group protocol.
#[sqlx::test(migrations = false)]
async fn a_revoke_lets_batches_in_flight_finish_and_commits_them_under_range(pool: PgPool) {
    let redelivered = hand_over(
        &pool,
        ("KAFKA_CFG_PARTITION_ASSIGNMENT_STRATEGY", "range"),
        "50",
        150,
        "5000",
    )
    .await;
    assert_eq!(redelivered, 0);
}

#[sqlx::test(migrations = false)]
async fn a_revoke_lets_batches_in_flight_finish_and_commits_them_under_cooperative_sticky(
    pool: PgPool,
) {
    let redelivered = hand_over(
        &pool,
        (
            "KAFKA_CFG_PARTITION_ASSIGNMENT_STRATEGY",
            "cooperative-sticky",
        ),
        "50",
        150,
        "5000",
    )
    .await;
    assert_eq!(redelivered, 0);
}

#[sqlx::test(migrations = false)]
async fn a_revoke_lets_batches_in_flight_finish_and_commits_them_under_the_consumer_protocol(
    pool: PgPool,
) {
    let redelivered = hand_over(
        &pool,
        ("KAFKA_CFG_GROUP_PROTOCOL", "consumer"),
        "50",
        150,
        "5000",
    )
    .await;
    assert_eq!(redelivered, 0);
}

/// Past the revoke timeout (100 ms, batches of 5 s) the batches in flight
/// are abandoned: they commit after the handover, their offsets do
/// not, and the next owners skip them as redelivered duplicates, still
/// applying each event once. (Eager: both partitions are revoked.)
#[sqlx::test(migrations = false)]
async fn past_the_revoke_timeout_batches_are_abandoned_and_skipped_as_redelivered(pool: PgPool) {
    let redelivered = hand_over(
        &pool,
        ("KAFKA_CFG_PARTITION_ASSIGNMENT_STRATEGY", "range"),
        "250",
        60,
        "100",
    )
    .await;
    assert!(redelivered > 0);
}
