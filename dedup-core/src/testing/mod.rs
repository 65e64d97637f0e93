//! "What if this runs twice?": a test kit that proves a handler's effect
//! happens once under the deliveries Kafka really makes (feature
//! `test-util`).
//!
//! [`assert_idempotent`] applies your events once and reads the effect with
//! your `snapshot` closure (balances, rows, calls made). Then it starts
//! over, from an empty effect (your `reset` closure) and fresh claims, under
//! each [`Pattern`] of redelivery, and after each the snapshot must equal
//! the first; if not, it fails with the pattern and both snapshots.
//!
//! - Two patterns find the handler bugs a claim cannot cover.
//!   [`Pattern::CrashBeforeCommit`] catches an effect written outside the
//!   transaction (another connection, a service, process memory): the body
//!   ran, the transaction rolled back, and the retry runs it again.
//!   [`Pattern::Batch`] catches a batch body that does not do what the
//!   one-event body does.
//! - The others (the events again in order, redeliveries interleaved with
//!   first deliveries, two consumers at once, a crash between the database
//!   commit and the offset commit) check what the handler gets from the
//!   claim and its store: each redelivery is skipped before the body runs,
//!   whatever its timing. They pass for any handler on a correct store.
//!
//! It also delivers the events again after their TTL (1 s, waited out in
//! real time), which applies them again by design:
//! [`Report::after_ttl`] shows what that does to your effect. It fails if
//! the claims do not expire, so a guarded effect's unchanged `after_ttl`
//! means the guard held. Give it a few events: with one, "interleaved" is
//! just "once".
//!
//! It works with any [`DedupStore`]: [`MemoryStore`](crate::MemoryStore),
//! and SQLite or PostgreSQL (a `#[sqlx::test]` database) through their
//! stores. Each pattern claims in a scope of its own (`<scope>#test/<run>/<pattern>`),
//! so the store's claims need no reset; `reset` empties your effect only.
//!
//! ```
//! use std::collections::BTreeMap;
//! use std::sync::{Arc, Mutex};
//! use dedup_core::testing::{Delivery, assert_idempotent};
//! use dedup_core::{HandlerError, MemoryStore, MemoryTx, idempotent};
//!
//! #[derive(serde::Deserialize)]
//! struct Paid { event_id: String, account: String, cents: i64 }
//!
//! /// The "database" of this example: balances, changed only on commit.
//! static BALANCES: Mutex<BTreeMap<String, i64>> = Mutex::new(BTreeMap::new());
//!
//! #[idempotent(key = "event_id", ttl = "4h")]
//! async fn credit(tx: &mut MemoryTx, ev: Paid) -> Result<(), HandlerError> {
//!     tx.on_commit(move || *BALANCES.lock().unwrap().entry(ev.account).or_default() += ev.cents);
//!     Ok(())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let events: Vec<Delivery> = (0..4)
//!     .map(|i| Delivery::json(&serde_json::json!({"event_id": format!("e{i}"), "account": "a", "cents": 10})))
//!     .collect();
//! let report = assert_idempotent(
//!     &credit,
//!     &MemoryStore::new(),
//!     &events,
//!     async |_store| BALANCES.lock().unwrap().clear(),
//!     async |_store| BALANCES.lock().unwrap().clone(),
//! )
//! .await;
//! assert_eq!(report.once["a"], 40);
//! // A redelivery after the TTL is applied again: the trade-off of a TTL.
//! assert_eq!(report.after_ttl["a"], 80);
//! # }
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{DedupStore, Error, Handler, Ttl};

mod kit;

use kit::{CrashingStore, Kit, Scoped};

/// One message as Kafka would deliver it: a payload and its headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delivery {
    /// The record's value.
    pub payload: Vec<u8>,
    /// The record's headers, in order.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Delivery {
    /// A message whose payload is `event` as JSON.
    pub fn json(event: &impl serde::Serialize) -> Self {
        Delivery::bytes(serde_json::to_vec(event).expect("the event serializes to JSON"))
    }

    /// A message with this payload (Protobuf, a framed record, anything).
    pub fn bytes(payload: impl Into<Vec<u8>>) -> Self {
        Delivery {
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// The message with one more header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The record a handler that takes `meta: &Meta` sees: topic
    /// `dedup-test`, partition 0, the event's index as its offset (a
    /// redelivery keeps it), and these headers.
    fn record(&self, index: usize) -> crate::Meta {
        let offset = i64::try_from(index).unwrap_or(i64::MAX);
        self.headers.iter().fold(
            crate::Meta::new("dedup-test", 0, offset),
            |meta, (name, value)| meta.with_header(name.clone(), value.clone()),
        )
    }
}

/// A way Kafka and a crashing consumer deliver the same events again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Pattern {
    /// Each event once, in order: the reference every other pattern must
    /// match.
    Once,
    /// Every event, then every event again, in order (a consumer that
    /// restarts from an old offset, a producer that retried).
    AgainInOrder,
    /// The first half once, then the second half's first deliveries
    /// interleaved with redeliveries of the first half (a rebalance that
    /// hands a partition over mid-way).
    Interleaved,
    /// Two consumers delivering every event at the same time (a zombie
    /// member and its successor).
    Concurrently,
    /// Each event's first attempt reaches the end of its body, then its
    /// transaction rolls back as if the process died before the database
    /// commit; the event is delivered again. An effect written outside the
    /// transaction shows twice.
    CrashBeforeCommit,
    /// Every event applied and committed, then the process dies before the
    /// offset commit: everything after the last committed offset (the second
    /// half) is delivered again.
    CrashAfterCommit,
    /// Every event delivered twice over inside one batch transaction, and
    /// the batch again (the runtime's batched path, `handle_batch`).
    Batch,
    /// Each event once with a 1 s TTL, then again once the claims expired:
    /// applied again, by design. Reported in [`Report::after_ttl`], never
    /// compared.
    AfterTtl,
}

impl Pattern {
    /// The patterns whose snapshot must equal [`Pattern::Once`]'s.
    pub const REDELIVERIES: [Pattern; 6] = [
        Pattern::AgainInOrder,
        Pattern::Interleaved,
        Pattern::Concurrently,
        Pattern::CrashBeforeCommit,
        Pattern::CrashAfterCommit,
        Pattern::Batch,
    ];

    /// A short stable name: `again_in_order`, `crash_before_commit`, ...
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Once => "once",
            Pattern::AgainInOrder => "again_in_order",
            Pattern::Interleaved => "interleaved",
            Pattern::Concurrently => "concurrently",
            Pattern::CrashBeforeCommit => "crash_before_commit",
            Pattern::CrashAfterCommit => "crash_after_commit",
            Pattern::Batch => "batch",
            Pattern::AfterTtl => "after_ttl",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Pattern::Once => "each event once, in order",
            Pattern::AgainInOrder => "every event, then every event again",
            Pattern::Interleaved => {
                "the second half's first deliveries interleaved with redeliveries of the first half"
            }
            Pattern::Concurrently => "two consumers delivering every event at the same time",
            Pattern::CrashBeforeCommit => {
                "each event's first transaction rolled back after its body (a crash before the commit), then delivered again"
            }
            Pattern::CrashAfterCommit => {
                "a crash after the database commit, before the offset commit: the uncommitted half delivered again"
            }
            Pattern::Batch => {
                "every event twice inside one batch transaction, then the batch again"
            }
            Pattern::AfterTtl => "each event again after its claim expired",
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`check_idempotent`] saw when every pattern matched.
#[derive(Debug, Clone, PartialEq)]
pub struct Report<T> {
    /// The snapshot after each event once: what every pattern matched.
    pub once: T,
    /// The snapshot after each event once, then again after its TTL: applied
    /// again, by design (a TTL bounds the table, and a redelivery later than
    /// it is new to the store). Equal to [`once`](Report::once) only if the
    /// effect itself is idempotent (an upsert, a version guard).
    pub after_ttl: T,
    /// The events that were not applied but dead-lettered (they do not
    /// decode, have no key, or the handler failed them permanently): their
    /// positions and why. They change nothing under any pattern.
    pub dead_lettered: Vec<(usize, String)>,
}

impl<T: PartialEq> Report<T> {
    /// Whether a redelivery after the TTL changed the effect.
    pub fn applied_again_after_ttl(&self) -> bool {
        self.after_ttl != self.once
    }
}

/// Why [`check_idempotent`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Failure<T> {
    /// A pattern's snapshot differs from the reference: the effect did not
    /// happen exactly once.
    Differs {
        /// The pattern that broke it.
        pattern: Pattern,
        /// The snapshot after each event once.
        once: T,
        /// The snapshot after the pattern.
        got: T,
    },
    /// No event applied: every one was dead-lettered, so nothing was tested
    /// (often an event type that does not match the payloads).
    NothingApplied {
        /// Why the first event was dead-lettered; `None`: there were no
        /// events.
        first: Option<String>,
    },
    /// Events delivered again after their 1 s TTL were still skipped 30 s
    /// later: the store's clock did not move (a store that does not expire
    /// claims on the wall clock), so `after_ttl` would say nothing.
    NotExpired {
        /// Their positions.
        events: Vec<usize>,
    },
    /// An event kept failing with a retryable error.
    KeptFailing {
        /// The pattern it was delivered under.
        pattern: Pattern,
        /// Its position in the events.
        event: usize,
        /// The last error.
        error: Error,
    },
}

impl<T: fmt::Debug> fmt::Display for Failure<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Differs { pattern, once, got } => write!(
                f,
                "not idempotent under `{pattern}` ({}):\n  each event once: {once:?}\n  {pattern}: {got:?}",
                pattern.describe()
            ),
            Failure::NothingApplied { first: None } => {
                f.write_str("no events to deliver: nothing was tested")
            }
            Failure::NothingApplied { first: Some(why) } => write!(
                f,
                "no event applied, every one was dead-lettered, so nothing was tested; the first: {why}"
            ),
            Failure::NotExpired { events } => write!(
                f,
                "events {events:?} were still skipped as duplicates 30 s after their 1 s TTL: the store's claims did not expire"
            ),
            Failure::KeptFailing {
                pattern,
                event,
                error,
            } => write!(
                f,
                "under `{pattern}`, event {event} kept failing with a retryable error: {error}"
            ),
        }
    }
}

impl<T: fmt::Debug> StdError for Failure<T> {}

/// Checks that `handler`'s effect happens once under every [`Pattern`] and
/// panics with the pattern and both snapshots if not; see the
/// [module docs](self). Returns the [`Report`].
///
/// `reset` empties the effect (not the claims: each pattern claims in a
/// scope of its own); `snapshot` reads it. The handler and the store are
/// cloned (a generated handler is a unit struct; a store is a handle on its
/// pool).
pub async fn assert_idempotent<H, S, T>(
    handler: &H,
    store: &S,
    events: &[Delivery],
    reset: impl AsyncFn(&S),
    snapshot: impl AsyncFn(&S) -> T,
) -> Report<T>
where
    H: Handler + Clone,
    S: DedupStore<Tx = H::Tx> + Clone,
    T: PartialEq + fmt::Debug,
{
    match check_idempotent(handler, store, events, reset, snapshot).await {
        Ok(report) => report,
        Err(failure) => panic!("{failure}"),
    }
}

/// [`assert_idempotent`] without the panic.
pub async fn check_idempotent<H, S, T>(
    handler: &H,
    store: &S,
    events: &[Delivery],
    reset: impl AsyncFn(&S),
    snapshot: impl AsyncFn(&S) -> T,
) -> Result<Report<T>, Failure<T>>
where
    H: Handler + Clone,
    S: DedupStore<Tx = H::Tx> + Clone,
    T: PartialEq + fmt::Debug,
{
    let run = run_id();
    let kit = Kit {
        store: CrashingStore {
            inner: store.clone(),
            crash_next_commit: Arc::new(Mutex::new(false)),
        },
        events,
        dead_letters: Mutex::new(Vec::new()),
    };

    reset(store).await;
    kit.deliver(
        &Scoped::new(handler, &run, Pattern::Once.name(), None),
        Pattern::Once,
    )
    .await?;
    let once = snapshot(store).await;
    let dead_lettered = std::mem::take(&mut *kit.dead_letters.lock().expect("lock"));
    if dead_lettered.len() == events.len() {
        return Err(Failure::NothingApplied {
            first: dead_lettered.into_iter().next().map(|(_, why)| why),
        });
    }
    for pattern in Pattern::REDELIVERIES {
        reset(store).await;
        kit.deliver(&Scoped::new(handler, &run, pattern.name(), None), pattern)
            .await?;
        let got = snapshot(store).await;
        if got != once {
            return Err(Failure::Differs { pattern, once, got });
        }
    }

    // After the TTL: the shortest TTL there is, waited out in real time
    // (not tokio's clock, which a paused test runtime would jump) until the
    // store's clock says every claim expired: each event must apply again.
    reset(store).await;
    let ttl = Ttl::from_secs(1).expect("1 s is a TTL");
    let scoped = Scoped::new(handler, &run, Pattern::AfterTtl.name(), Some(ttl));
    kit.each(&scoped, Pattern::AfterTtl, &all(events.len()), false)
        .await?;
    let dead: Vec<usize> = dead_lettered.iter().map(|(i, _)| *i).collect();
    let mut pending: Vec<usize> = all(events.len())
        .into_iter()
        .filter(|i| !dead.contains(i))
        .collect();
    let mut wait = ttl.as_duration() + Duration::from_millis(200);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !pending.is_empty() {
        if std::time::Instant::now() > deadline {
            return Err(Failure::NotExpired { events: pending });
        }
        real_sleep(wait).await;
        wait = Duration::from_millis(200);
        pending = kit
            .each(&scoped, Pattern::AfterTtl, &pending, false)
            .await?;
    }
    let after_ttl = snapshot(store).await;
    Ok(Report {
        once,
        after_ttl,
        dead_lettered,
    })
}

fn all(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// Sleeps on the wall clock, which the stores' clocks follow.
async fn real_sleep(duration: Duration) {
    let slept = tokio::task::spawn_blocking(move || std::thread::sleep(duration)).await;
    slept.expect("a sleeping thread does not panic");
}

/// A run's own scopes: unique per process and call, so the claims of an
/// earlier run (in a database that outlives the test) never match.
fn run_id() -> String {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!(
        "{nanos:x}.{}.{}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    )
}
