//! The outbox relay on the stores without notifications, end to end: a
//! real MariaDB server (a database of the test's own) or an SQLite file,
//! and the real broker. Two relays publish every committed event, each
//! key's in order, and nothing of a rolled-back transaction; a relay that
//! waits picks up an event enqueued later by polling.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use dedup_core::{OutboxMessage, OutboxSource};
use dedup_kafka::Relay;
use dedup_tests::common;
use rdkafka::Message as _;

use common::{brokers, create_topic, header, mysql_database};

const KEYS: u64 = 4;
const PER_KEY: u64 = 15;

fn numbered(topic: &str, key: u64, n: u64) -> OutboxMessage {
    OutboxMessage::bytes(topic, serde_json::json!({ "key": key, "n": n }).to_string())
        .with_key(format!("k{key}"))
}

/// Runs two relays of `source` until `wait` says the outbox is empty and
/// `late` (enqueued once they idle) is published; checks what `topic` got.
async fn two_relays_publish_in_order<S, E>(source: S, topic: &str, enqueue: E)
where
    S: OutboxSource + Clone,
    E: AsyncFn(Vec<OutboxMessage>, bool),
{
    for n in 0..PER_KEY {
        let batch = (0..KEYS).map(|k| numbered(topic, k, n)).collect();
        enqueue(batch, true).await;
    }
    enqueue(vec![numbered(topic, 0, 999)], false).await;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let relay = Relay::builder(source.clone())
                .brokers(brokers())
                .batch_size(7)
                .poll_interval(Duration::from_secs(30))
                .build()
                .expect("relay");
            let mut stopped = stopped.clone();
            tokio::spawn(relay.run_until(async move {
                let _ = stopped.wait_for(|s| *s).await;
            }))
        })
        .collect();
    let backlog_empty = async || {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (pending, _) = source.backlog().await.expect("backlog").expect("told");
            if pending == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "{pending} still pending");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    backlog_empty().await;
    // Both relays now wait (up to their 30 s poll interval): an event
    // enqueued now is found by polling, within about 250 ms.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let enqueued_at = Instant::now();
    enqueue(vec![numbered(topic, 1, PER_KEY)], true).await;
    backlog_empty().await;
    let latency = enqueued_at.elapsed();
    eprintln!("outbox: an event enqueued while the relays waited was in Kafka after {latency:?}");
    assert!(
        latency < Duration::from_secs(5),
        "published after {latency:?}"
    );
    let _ = stop.send(true);
    for relay in relays {
        relay.await.expect("task").expect("relay ran");
    }

    let total = (KEYS * PER_KEY + 1) as usize;
    let messages = common::read_exactly(&brokers(), topic, total).await;
    let mut ids = HashSet::new();
    let mut by_key: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut ordered: Vec<_> = messages.iter().collect();
    ordered.sort_by_key(|m| (m.partition(), m.offset()));
    for msg in ordered {
        assert!(
            ids.insert(header(msg, "event-id").expect("event-id").to_owned()),
            "one copy of each event"
        );
        let value: serde_json::Value =
            serde_json::from_slice(msg.payload().expect("payload")).expect("json");
        by_key
            .entry(value["key"].as_u64().expect("key"))
            .or_default()
            .push(value["n"].as_u64().expect("n"));
    }
    for key in 0..KEYS {
        let mut expected: Vec<u64> = (0..PER_KEY).collect();
        if key == 1 {
            expected.push(PER_KEY);
        }
        assert_eq!(
            by_key[&key], expected,
            "key {key} in enqueue order, nothing rolled back"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_outbox_two_relays_publish_each_key_in_order() {
    let (_, pool) = mysql_database().await;
    let writer = dedup_mysql::OutboxWriter::default();
    writer.migrate(&pool).await.expect("migrate");
    let topic = create_topic(3).await;
    let enqueue = async |messages: Vec<OutboxMessage>, commit: bool| {
        let mut tx = pool.begin().await.expect("begin");
        for message in messages {
            writer.enqueue(&mut tx, message).await.expect("enqueue");
        }
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
    };
    two_relays_publish_in_order(writer.reader(pool.clone()), &topic, enqueue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_outbox_two_relays_publish_each_key_in_order() {
    let path = std::env::temp_dir().join(format!("dedup-outbox-{}.db", uuid::Uuid::new_v4()));
    let store = dedup_sqlite::SqliteStore::open(&path).await.expect("open");
    let writer = dedup_sqlite::OutboxWriter::default();
    writer.migrate(store.pool()).await.expect("migrate");
    let topic = create_topic(3).await;
    let enqueue = async |messages: Vec<OutboxMessage>, commit: bool| {
        let mut tx = store
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .expect("begin");
        for message in messages {
            writer.enqueue(&mut tx, message).await.expect("enqueue");
        }
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
    };
    two_relays_publish_in_order(store.outbox_reader(), &topic, enqueue).await;
}
