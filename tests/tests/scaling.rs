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
