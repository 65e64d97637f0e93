//! The conformance suite every [`OutboxSource`] runs.
//!
//! Each function takes a maker of fresh, empty outboxes (given the
//! [`Retention`] the case needs) and panics on a violation of the outbox
//! contract. [`outbox_conformance_tests!`](crate::outbox_conformance_tests)
//! writes one test per case, so a backend cannot miss one:
//!
//! ```
//! use dedup_core::conformance::outbox::OutboxFixture;
//! use dedup_core::{DedupStore, MemoryOutbox, MemoryStore, OutboxMessage};
//!
//! struct Memory(MemoryStore, MemoryOutbox);
//!
//! impl OutboxFixture for Memory {
//!     type Source = MemoryOutbox;
//!     fn reader(&self) -> MemoryOutbox {
//!         self.1.reader()
//!     }
//!     async fn enqueue(&self, messages: Vec<OutboxMessage>, commit: bool) -> Vec<String> {
//!         let mut tx = self.0.begin().await.unwrap();
//!         let ids = messages.into_iter().map(|m| self.1.enqueue(&mut tx, m)).collect();
//!         if commit { self.0.commit(tx).await.unwrap() } else { self.0.rollback(tx).await.unwrap() }
//!         ids
//!     }
//! }
//!
//! dedup_core::outbox_conformance_tests!(
//!     #[tokio::test(flavor = "multi_thread")]
//!     |retention| Memory(MemoryStore::new(), MemoryOutbox::new(retention))
//! );
//! # fn main() {}
//! ```
//!
//! Leases, back-offs and retention are tested with real sleeps of about a
//! second, because a database's clock cannot be moved from outside.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::outbox::{OutboxMessage, OutboxRecord, OutboxSource, PublishFailure, Retention};

mod leases;

pub use leases::*;

/// An outbox under test: its readers, and a way to enqueue into it.
pub trait OutboxFixture: Send + Sync + 'static {
    /// What a relay reads.
    type Source: OutboxSource + Clone;

    /// A reader of the outbox, as one relay holds it; each call may be
    /// another relay's.
    fn reader(&self) -> Self::Source;

    /// Enqueues `messages`, in order, in one transaction that commits (or,
    /// with `commit` false, rolls back); returns their event ids.
    fn enqueue(
        &self,
        messages: Vec<OutboxMessage>,
        commit: bool,
    ) -> impl Future<Output = Vec<String>> + Send;
}

/// Long enough never to expire within a case, unless the case says so.
const LONG: Duration = Duration::from_secs(600);

/// One event per `(key, payload)` on topic `t`.
fn events(list: &[(Option<&str>, &str)]) -> Vec<OutboxMessage> {
    list.iter()
        .map(|(key, payload)| {
            let message = OutboxMessage::bytes("t", payload.as_bytes());
            match key {
                Some(key) => message.with_key(*key),
                None => message,
            }
        })
        .collect()
}

fn payloads(records: &[OutboxRecord]) -> Vec<String> {
    records
        .iter()
        .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
        .collect()
}

fn seqs(records: &[OutboxRecord]) -> Vec<i64> {
    records.iter().map(|r| r.seq).collect()
}

/// How many events wait, if the source can tell.
async fn pending<S: OutboxSource>(source: &S) -> Option<u64> {
    source
        .backlog()
        .await
        .expect("backlog")
        .map(|(pending, _)| pending)
}

/// Leases everything available and publishes it.
async fn drain<S: OutboxSource>(source: &S) -> Vec<OutboxRecord> {
    let (lease, records) = source.lease_pending(1000, LONG).await.expect("lease");
    source
        .finish(&lease, &seqs(&records), &[])
        .await
        .expect("finish");
    records
}

/// Enqueued events come back in order with everything they were given
/// (topic, key, payload, headers in order, the chosen or a generated
/// event id, no attempts); a rolled-back transaction enqueued nothing;
/// published events are no longer pending.
pub async fn committed_events_come_in_order_with_their_fields<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let outbox = make(Retention::Delete).await;
    let source = outbox.reader();
    let ids = outbox
        .enqueue(
            vec![
                OutboxMessage::bytes("orders", "x")
                    .with_key("k")
                    .with_event_id("order-7:shipped")
                    .with_header("trace", "abc")
                    .with_header("bin", vec![0_u8, 255, 1]),
                OutboxMessage::bytes("payments", vec![0_u8, 1, 2]),
            ],
            true,
        )
        .await;
    assert_eq!(ids[0], "order-7:shipped");
    assert!(
        !ids[1].is_empty() && ids[1] != ids[0],
        "a generated id: {ids:?}"
    );
    outbox
        .enqueue(events(&[(Some("k"), "rolled back")]), false)
        .await;
    if let Some(n) = pending(&source).await {
        assert_eq!(n, 2, "the rolled-back event is not pending");
    }
    if let Some((_, oldest)) = source.backlog().await.expect("backlog") {
        assert!(
            oldest < LONG,
            "the lag of events enqueued just now: {oldest:?}"
        );
    }

    let (lease, records) = source.lease_pending(10, LONG).await.expect("lease");
    assert_eq!(records.len(), 2, "{records:?}");
    assert!(records[0].seq < records[1].seq, "in enqueue order");
    let first = &records[0];
    assert_eq!(
        (
            first.topic.as_str(),
            first.key.as_deref(),
            &first.payload[..]
        ),
        ("orders", Some(&b"k"[..]), &b"x"[..])
    );
    assert_eq!(first.event_id, "order-7:shipped");
    assert_eq!(
        first.headers,
        [
            ("trace".to_owned(), b"abc".to_vec()),
            ("bin".to_owned(), vec![0, 255, 1])
        ]
    );
    assert_eq!(first.attempts, 0);
    let second = &records[1];
    assert_eq!(
        (
            second.topic.as_str(),
            second.key.as_deref(),
            &second.payload[..]
        ),
        ("payments", None, &[0_u8, 1, 2][..])
    );
    assert_eq!(second.event_id, ids[1]);
    assert!(second.headers.is_empty());
    source
        .finish(&lease, &seqs(&records), &[])
        .await
        .expect("finish");
    let (_, none) = source.lease_pending(10, LONG).await.expect("lease");
    assert!(none.is_empty(), "published: {:?}", payloads(&none));
    if let Some(backlog) = source.backlog().await.expect("backlog") {
        assert_eq!(backlog, (0, Duration::ZERO));
    }
}

/// A second relay skips the events a first one holds and never overtakes
/// them: it gets no later event of their keys, but every other key's
/// events and those without a key. A failed event stays pending with its
/// attempt counted; events left unfinished are offered again at once.
pub async fn a_second_reader_skips_held_events_and_never_overtakes_their_keys<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let outbox = make(Retention::Delete).await;
    let (a, b) = (outbox.reader(), outbox.reader());
    outbox
        .enqueue(
            events(&[
                (Some("k1"), "k1-1"),
                (Some("k2"), "k2-1"),
                (Some("k1"), "k1-2"),
                (Some("k3"), "k3-1"),
                (None, "no key"),
                (Some("k2"), "k2-2"),
                (Some("k3"), "k3-2"),
            ]),
            true,
        )
        .await;
    let (lease_a, held) = a.lease_pending(2, LONG).await.expect("lease A");
    assert_eq!(payloads(&held), ["k1-1", "k2-1"]);
    let (lease_b, taken) = b.lease_pending(100, LONG).await.expect("lease B");
    assert_eq!(payloads(&taken), ["k3-1", "no key", "k3-2"]);
    b.finish(&lease_b, &seqs(&taken), &[])
        .await
        .expect("finish B");
    a.finish(
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
    let (lease, rest) = b.lease_pending(100, LONG).await.expect("lease again");
    assert_eq!(payloads(&rest), ["k2-1", "k1-2", "k2-2"]);
    assert_eq!(rest[0].attempts, 1, "the failure was counted");
    b.finish(&lease, &[], &[]).await.expect("release");
    let again = drain(&a).await;
    assert_eq!(
        payloads(&again),
        ["k2-1", "k1-2", "k2-2"],
        "offered at once"
    );
    if let Some(n) = pending(&a).await {
        assert_eq!(n, 0);
    }
}

/// An event that failed backs off: it and every later event of its key
/// are held back until the back-off is over, while other keys go on (one
/// poison event cannot stall the outbox); then the key comes back in
/// order.
pub async fn a_failed_event_holds_back_its_key_and_nothing_else<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let outbox = make(Retention::Delete).await;
    let source = outbox.reader();
    outbox
        .enqueue(
            events(&[
                (Some("k1"), "poison"),
                (Some("k1"), "k1-2"),
                (Some("k1"), "k1-3"),
                (Some("k2"), "k2-1"),
            ]),
            true,
        )
        .await;
    let (lease, records) = source.lease_pending(3, LONG).await.expect("lease");
    assert_eq!(payloads(&records), ["poison", "k1-2", "k1-3"]);
    let backoff = Duration::from_millis(1500);
    let failed_at = Instant::now();
    source
        .finish(
            &lease,
            &[],
            &[PublishFailure::new(
                records[0].seq,
                "Message size too large",
                backoff,
            )],
        )
        .await
        .expect("finish");

    let (lease, records) = source.lease_pending(3, LONG).await.expect("lease");
    assert_eq!(payloads(&records), ["k2-1"], "past the whole key to k2");
    source
        .finish(&lease, &seqs(&records), &[])
        .await
        .expect("finish");
    if let Some(n) = pending(&source).await {
        assert_eq!(n, 3, "k1 waits");
    }

    tokio::time::sleep((backoff + Duration::from_millis(300)).saturating_sub(failed_at.elapsed()))
        .await;
    let (lease, records) = source.lease_pending(10, LONG).await.expect("lease");
    assert_eq!(payloads(&records), ["poison", "k1-2", "k1-3"], "in order");
    assert_eq!(records[0].attempts, 1);
    source.finish(&lease, &[], &[]).await.expect("finish");
}

/// Under [`Retention::Keep`], published events are purged once their
/// retention has passed, at most `limit` per call; never before. Under
/// [`Retention::Delete`] nothing is left to purge.
pub async fn kept_events_are_purged_after_their_retention<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let keep = Duration::from_millis(1500);
    let outbox = make(Retention::Keep(keep)).await;
    let source = outbox.reader();
    outbox
        .enqueue(
            events(&[(Some("k"), "a"), (Some("k"), "b"), (None, "c")]),
            true,
        )
        .await;
    let published_at = Instant::now();
    drain(&source).await;
    assert_eq!(source.purge_sent(100).await.expect("purge"), 0, "not yet");
    tokio::time::sleep((keep + Duration::from_millis(500)).saturating_sub(published_at.elapsed()))
        .await;
    assert_eq!(source.purge_sent(2).await.expect("purge"), 2, "bounded");
    assert_eq!(source.purge_sent(100).await.expect("purge"), 1);
    assert_eq!(source.purge_sent(100).await.expect("purge"), 0);

    let outbox = make(Retention::Delete).await;
    let source = outbox.reader();
    outbox.enqueue(events(&[(Some("k"), "a")]), true).await;
    drain(&source).await;
    assert_eq!(source.purge_sent(100).await.expect("purge"), 0);
}

/// A relay waiting for events wakes when a transaction that enqueued
/// commits (by a notification or by polling), well before its timeout.
pub async fn a_waiting_reader_wakes_when_events_are_enqueued<F, Fut, X>(make: F)
where
    F: Fn(Retention) -> Fut,
    Fut: Future<Output = X>,
    X: OutboxFixture,
{
    let outbox = std::sync::Arc::new(make(Retention::Delete).await);
    let source = outbox.reader();
    let (lease, none) = source.lease_pending(10, LONG).await.expect("lease");
    assert!(none.is_empty());
    source.finish(&lease, &[], &[]).await.expect("finish");
    let writer = {
        let outbox = outbox.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            outbox
                .enqueue(events(&[(Some("k"), "wake up")]), true)
                .await;
        })
    };
    let started = Instant::now();
    source.wait_for_events(Duration::from_secs(60)).await;
    let waited = started.elapsed();
    writer.await.expect("writer");
    assert!(
        waited < Duration::from_secs(5),
        "woken, not the 60 s timeout: {waited:?}"
    );
    let records = drain(&source).await;
    assert_eq!(payloads(&records), ["wake up"]);
}

/// Writes one test per case of the outbox conformance suite: attributes,
/// then `|retention| fixture`, an expression (which may `.await`) giving a
/// fresh, empty [`OutboxFixture`] whose published events follow
/// `retention`. Arguments the test attribute passes (a `#[sqlx::test]`
/// pool) follow the retention, `|retention, pool: PgPool|`; each is cloned
/// for each outbox a case makes.
#[macro_export]
macro_rules! outbox_conformance_tests {
    (@each [$($attrs:tt)*] [$retention:ident $(, $arg:ident : $ty:ty)*] $make:expr;
        $case:ident $(, $rest:ident)*) => {
        $($attrs)*
        async fn $case($($arg: $ty),*) {
            $crate::conformance::outbox::$case(|$retention: $crate::outbox::Retention| {
                $(let $arg = ::std::clone::Clone::clone(&$arg);)*
                async move { $make }
            })
            .await;
        }
        $crate::outbox_conformance_tests!(@each [$($attrs)*] [$retention $(, $arg: $ty)*] $make;
            $($rest),*);
    };
    (@each [$($attrs:tt)*] [$($params:tt)*] $make:expr;) => {};
    ($(#[$attr:meta])* |$retention:ident $(, $arg:ident : $ty:ty)* $(,)?| $make:expr) => {
        $crate::outbox_conformance_tests!(@each [$(#[$attr])*] [$retention $(, $arg: $ty)*] $make;
            committed_events_come_in_order_with_their_fields,
            a_second_reader_skips_held_events_and_never_overtakes_their_keys,
            a_failed_event_holds_back_its_key_and_nothing_else,
            a_lease_holds_its_events_and_keys_until_it_expires,
            an_expired_lease_still_marks_what_was_acknowledged,
            concurrent_leases_never_share_an_event_nor_split_a_key,
            concurrent_relays_publish_each_key_in_order,
            kept_events_are_purged_after_their_retention,
            a_waiting_reader_wakes_when_events_are_enqueued
        );
    };
}
