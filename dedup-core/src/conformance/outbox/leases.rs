//! The outbox conformance cases of leases: a lease holds its events and
//! keys until it expires, marks what was acknowledged even after, and
//! concurrent leases and relays never share an event nor split a key.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use super::*;
use crate::outbox::{OutboxSource, PublishFailure, Retention};

/// A lease holds its events and their keys until it expires, with no
/// transaction left open; a relay that died holding one is taken over from
/// the key's first event once it expires.
pub async fn a_lease_holds_its_events_and_keys_until_it_expires<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let outbox = make(Retention::default()).await;
    let (dead, alive) = (outbox.reader(), outbox.reader());
    outbox
        .enqueue(
            events(&[(Some("k"), "k-1"), (Some("k"), "k-2"), (Some("k"), "k-3")]),
            true,
        )
        .await;
    let lease_for = Duration::from_millis(1500);
    let leased_at = Instant::now();
    let (_never_finished, taken) = dead.lease_pending(2, lease_for).await.expect("lease A");
    assert_eq!(payloads(&taken), ["k-1", "k-2"]);

    let (lease, none) = alive.lease_pending(10, LONG).await.expect("lease B");
    assert!(none.is_empty(), "{:?}", payloads(&none));
    alive.finish(&lease, &[], &[]).await.expect("finish");

    tokio::time::sleep(
        (lease_for + Duration::from_millis(300)).saturating_sub(leased_at.elapsed()),
    )
    .await;
    let (lease, records) = alive.lease_pending(10, LONG).await.expect("lease B");
    assert_eq!(payloads(&records), ["k-1", "k-2", "k-3"]);
    alive
        .finish(&lease, &[records[0].seq], &[])
        .await
        .expect("finish");
    let rest = drain(&alive).await;
    assert_eq!(payloads(&rest), ["k-2", "k-3"]);
}

/// A relay whose lease expired and went to another still marks what the
/// broker acknowledged; its failures and releases leave the other relay's
/// lease alone.
pub async fn an_expired_lease_still_marks_what_was_acknowledged<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let outbox = make(Retention::default()).await;
    let (slow, other, third) = (outbox.reader(), outbox.reader(), outbox.reader());
    outbox
        .enqueue(
            events(&[(Some("k"), "k-1"), (Some("k"), "k-2"), (Some("k"), "k-3")]),
            true,
        )
        .await;
    let (lease_a, taken) = slow
        .lease_pending(10, Duration::from_millis(500))
        .await
        .expect("lease A");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (lease_b, again) = other.lease_pending(10, LONG).await.expect("lease B");
    assert_eq!(payloads(&again), ["k-1", "k-2", "k-3"]);
    slow.finish(
        &lease_a,
        &[taken[0].seq],
        &[PublishFailure::new(taken[1].seq, "late", LONG)],
    )
    .await
    .expect("finish A");
    // k-2 and k-3 are still B's: a third relay gets nothing.
    let (lease, none) = third.lease_pending(10, LONG).await.expect("lease C");
    assert!(none.is_empty(), "{:?}", payloads(&none));
    third.finish(&lease, &[], &[]).await.expect("finish C");
    other
        .finish(&lease_b, &seqs(&again), &[])
        .await
        .expect("finish B");
    if let Some(n) = pending(&other).await {
        assert_eq!(n, 0);
    }
    let (_, none) = third.lease_pending(10, LONG).await.expect("lease C");
    assert!(none.is_empty(), "{:?}", payloads(&none));
}

/// Relays leasing at the same moment never share an event, and never
/// split a key between them.
pub async fn concurrent_leases_never_share_an_event_nor_split_a_key<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let outbox = make(Retention::Delete).await;
    let mut list = Vec::new();
    for n in 0..6 {
        for k in 0..30 {
            list.push((format!("k{k}"), format!("k{k}-{n}")));
        }
    }
    let borrowed: Vec<(Option<&str>, &str)> = list
        .iter()
        .map(|(k, p)| (Some(k.as_str()), p.as_str()))
        .collect();
    outbox.enqueue(events(&borrowed), true).await;
    let readers: Vec<X::Source> = (0..6).map(|_| outbox.reader()).collect();
    for round in 0..4 {
        let tasks: Vec<_> = readers
            .iter()
            .map(|r| {
                let r = r.clone();
                tokio::spawn(async move { r.lease_pending(20, LONG).await })
            })
            .collect();
        let mut batches = Vec::new();
        for task in tasks {
            batches.push(task.await.expect("task").expect("lease"));
        }
        let mut owner_of_key: HashMap<Vec<u8>, usize> = HashMap::new();
        let mut seen = HashSet::new();
        for (relay, (_, records)) in batches.iter().enumerate() {
            for record in records {
                assert!(
                    seen.insert(record.seq),
                    "round {round}: {} leased twice",
                    record.seq
                );
                let key = record.key.clone().expect("key");
                let owner = *owner_of_key.entry(key.clone()).or_insert(relay);
                assert_eq!(
                    owner,
                    relay,
                    "round {round}: {} split between relays",
                    String::from_utf8_lossy(&key)
                );
            }
        }
        for (reader, (lease, records)) in readers.iter().zip(&batches) {
            reader
                .finish(lease, &seqs(records), &[])
                .await
                .expect("finish");
        }
    }
}

/// Several relays draining one outbox at once, each publishing what it
/// leased: every event is published once, and each key's events in the
/// order they were enqueued.
pub async fn concurrent_relays_publish_each_key_in_order<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    const KEYS: usize = 8;
    const PER_KEY: usize = 25;
    let outbox = make(Retention::Delete).await;
    // Enqueued in several transactions, keys interleaved.
    for n in 0..PER_KEY {
        let list: Vec<(String, String)> = (0..KEYS)
            .map(|k| (format!("k{k}"), format!("{n}")))
            .collect();
        let borrowed: Vec<(Option<&str>, &str)> = list
            .iter()
            .map(|(k, p)| (Some(k.as_str()), p.as_str()))
            .collect();
        outbox.enqueue(events(&borrowed), true).await;
    }
    let published = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(Vec<u8>, usize)>::new()));
    let relays: Vec<_> = (0..4)
        .map(|_| {
            let (reader, published) = (outbox.reader(), published.clone());
            tokio::spawn(async move {
                let mut idle = 0;
                while idle < 20 {
                    let (lease, records) = reader.lease_pending(7, LONG).await.expect("lease");
                    if records.is_empty() {
                        idle += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    } else {
                        idle = 0;
                    }
                    // Published in lease order, as the relay does.
                    published
                        .lock()
                        .expect("lock")
                        .extend(records.iter().map(|r| {
                            let n = String::from_utf8_lossy(&r.payload).parse().expect("n");
                            (r.key.clone().expect("key"), n)
                        }));
                    reader
                        .finish(&lease, &seqs(&records), &[])
                        .await
                        .expect("finish");
                }
            })
        })
        .collect();
    for relay in relays {
        relay.await.expect("relay");
    }
    let published = published.lock().expect("lock").clone();
    assert_eq!(published.len(), KEYS * PER_KEY, "each event published once");
    let mut by_key: HashMap<Vec<u8>, Vec<usize>> = HashMap::new();
    for (key, n) in published {
        by_key.entry(key).or_default().push(n);
    }
    for (key, ns) in by_key {
        assert_eq!(
            ns,
            (0..PER_KEY).collect::<Vec<_>>(),
            "{} out of order",
            String::from_utf8_lossy(&key)
        );
    }
}
