//! The MySQL backend end to end (real Kafka, a real MariaDB server): the
//! `payments_mysql` example applies each payment once across a crash
//! between its database commit and its offset commit, and dead-letters the
//! event it cannot read.

use std::collections::BTreeMap;
use std::time::Duration;

use dedup_tests::common;

use common::{brokers, create_topic, example, header, last_line, mysql_database, producer};
use rdkafka::Message as _;
use rdkafka::producer::FutureRecord;

/// Runs the example on `topic` until idle, into the database at `url`,
/// killed at `failpoint` if given (the crashed member holds its
/// partitions until its session times out: kept short).
fn run_payments(
    url: &str,
    topic: &str,
    group: &str,
    failpoint: Option<&str>,
) -> std::process::Output {
    let mut cmd = std::process::Command::new(example("payments_mysql"));
    cmd.env("DATABASE_URL", url)
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", topic)
        .env("GROUP_ID", group)
        .env("KAFKA_SESSION_TIMEOUT_MS", "6000")
        .args(["--exit-when-idle", "3s"]);
    match failpoint {
        Some(f) => cmd.env("DEDUP_FAILPOINT", f),
        None => cmd.env_remove("DEDUP_FAILPOINT"),
    };
    cmd.output().expect("run the payments_mysql example")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_apply_once_across_a_crash_after_the_database_commit() {
    let (url, pool) = mysql_database().await;
    let topic = create_topic(3).await;
    let group = common::unique("payments-mysql");
    let producer = producer();
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    // 30 payments to 3 accounts, each sent twice, and one that is not JSON.
    for i in 0..30_i64 {
        let account = format!("acct-{}", i % 3);
        let payload = serde_json::json!({
            "event_id": uuid::Uuid::new_v4(),
            "account_id": account,
            "amount_cents": 100 + i,
        })
        .to_string();
        *expected.entry(account.clone()).or_default() += 100 + i;
        for _ in 0..2 {
            producer
                .send(
                    FutureRecord::to(&topic).key(&account).payload(&payload),
                    Duration::from_secs(10),
                )
                .await
                .expect("produce");
        }
    }
    producer
        .send(
            FutureRecord::to(&topic).key("acct-0").payload("{not json"),
            Duration::from_secs(10),
        )
        .await
        .expect("produce");

    // Aborted after its 5th database commit, before that offset commit.
    let (crash_url, crash_topic, crash_group) = (url.clone(), topic.clone(), group.clone());
    let crashed = tokio::task::spawn_blocking(move || {
        run_payments(
            &crash_url,
            &crash_topic,
            &crash_group,
            Some("after-commit:5"),
        )
    })
    .await
    .expect("join");
    assert!(
        !crashed.status.success(),
        "the failpoint aborts the process"
    );
    let (run_url, run_topic, run_group) = (url.clone(), topic.clone(), group.clone());
    let output =
        tokio::task::spawn_blocking(move || run_payments(&run_url, &run_topic, &run_group, None))
            .await
            .expect("join");
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = last_line(&output);
    assert!(
        summary.starts_with("applied=") && summary.contains(" skipped="),
        "{summary}"
    );

    let balances: BTreeMap<String, i64> =
        sqlx::query_as("SELECT id, balance FROM accounts ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("balances")
            .into_iter()
            .collect();
    assert_eq!(balances, expected, "each payment credited exactly once");
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(DISTINCT event_id) FROM ledger")
            .fetch_one(&pool)
            .await
            .expect("ledger");
    assert_eq!((rows, distinct), (30, 30), "one ledger row per payment");
    let claims: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dedup_claims WHERE scope = ?")
        .bind("payments::record_payment")
        .fetch_one(&pool)
        .await
        .expect("claims");
    assert_eq!(claims, 30, "one claim per payment");

    let dead = common::read_exactly(&brokers(), &format!("{topic}.dlq"), 1).await;
    assert_eq!(
        dead[0].payload(),
        Some(&b"{not json"[..]),
        "kept as it came"
    );
    assert_eq!(header(&dead[0], "dedup.error.kind"), Some("decode"));
}
