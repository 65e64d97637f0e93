//! The conformance suite every [`DedupStore`] backend runs.
//!
//! Each function takes a fresh, empty store and panics on a violation of the
//! claim contract. A backend proves itself by calling every one of them, each
//! in its own test (own database or schema: they run in parallel);
//! [`conformance_tests!`](crate::conformance_tests) writes those tests:
//!
//! ```
//! dedup_core::conformance_tests!(
//!     #[tokio::test(flavor = "multi_thread")]
//!     || dedup_core::MemoryStore::new()
//! );
//! # fn main() {}
//! ```
//!
//! Expiry is tested with a 1 s TTL and real sleeps, because a database's
//! clock cannot be moved from outside.

mod fingerprint;
mod lease;
pub mod outbox;
pub mod transport;

pub use fingerprint::*;
pub use lease::*;

use std::time::{Duration, SystemTime};

use crate::{Claim, DedupKey, DedupStore, ORDERED_SCOPE_PREFIX, PurgeExpired, Ttl};

fn ttl(secs: u64) -> Ttl {
    Ttl::from_secs(secs).expect("positive")
}

fn key(scope: &str, id: &str) -> DedupKey {
    DedupKey::new(scope, id).expect("non-empty")
}

const HOUR: u64 = 3600;

/// Claims `key` in a transaction of its own and commits it.
async fn claim_committed<S: DedupStore>(store: &S, key: &DedupKey, ttl: Ttl) -> Claim {
    let mut tx = store.begin().await.expect("begin");
    let claim = store.claim(&mut tx, key, None, ttl).await.expect("claim");
    store.commit(tx).await.expect("commit");
    claim
}

/// N tasks race to claim one key, each holding its transaction open for a
/// moment: exactly one wins, every other one sees a duplicate.
pub async fn exclusive_under_concurrency<S: DedupStore + Clone>(store: S) {
    const TASKS: usize = 16;
    let k = key("conformance", "race");
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (store, k) = (store.clone(), k.clone());
            tokio::spawn(async move {
                let mut tx = store.begin().await.expect("begin");
                let claim = store
                    .claim(&mut tx, &k, None, ttl(HOUR))
                    .await
                    .expect("claim");
                tokio::time::sleep(Duration::from_millis(20)).await;
                store.commit(tx).await.expect("commit");
                claim
            })
        })
        .collect();
    let mut winners = 0;
    for task in tasks {
        match task.await.expect("task") {
            Claim::Fresh => winners += 1,
            Claim::Duplicate { .. } => {}
            Claim::Reclaimed => panic!("nothing had expired, yet a claim was reclaimed"),
        }
    }
    assert_eq!(
        winners, 1,
        "exactly one of {TASKS} concurrent claimers must win"
    );
}

/// A committed claim makes the same key a duplicate within the TTL, and
/// reports when the live claim expires (about now + TTL on the store's clock)
/// and how long ago it was taken (the duplicate's lateness).
pub async fn duplicate_within_ttl<S: DedupStore>(store: S) {
    let k = key("conformance", "dup");
    let before = SystemTime::now();
    assert_eq!(claim_committed(&store, &k, ttl(HOUR)).await, Claim::Fresh);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waited = before.elapsed().unwrap_or_default();
    match claim_committed(&store, &k, ttl(HOUR)).await {
        Claim::Duplicate {
            expires_at, age, ..
        } => {
            let lo = before + Duration::from_secs(HOUR - 60);
            let hi = SystemTime::now() + Duration::from_secs(HOUR + 60);
            assert!(
                expires_at > lo && expires_at < hi,
                "expires_at {expires_at:?} should be about an hour from now"
            );
            // At least the 300 ms slept; at most the whole wait and a
            // second of clock granularity.
            assert!(
                age >= Duration::from_millis(250) && age <= waited + Duration::from_secs(2),
                "the duplicate came {age:?} after the claim, expected about {waited:?}"
            );
        }
        other => panic!("second claim within the TTL must be a duplicate, got {other:?}"),
    }
}

/// After the TTL the claim is taken over (`Reclaimed`), and the takeover is
/// itself a live claim.
pub async fn reclaim_after_expiry<S: DedupStore>(store: S) {
    let k = key("conformance", "expiry");
    assert_eq!(claim_committed(&store, &k, ttl(1)).await, Claim::Fresh);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        claim_committed(&store, &k, ttl(HOUR)).await,
        Claim::Reclaimed,
        "an expired claim must be taken over"
    );
    assert!(
        !claim_committed(&store, &k, ttl(HOUR)).await.is_claimed(),
        "the takeover must be live for its new TTL"
    );
}

/// Refreshing a claim inside its transaction restarts its TTL from the
/// store's clock: a transaction that ran for most of its TTL does not commit
/// a claim that is already (nearly) expired.
pub async fn refresh_restarts_the_ttl<S: DedupStore>(store: S) {
    let k = key("conformance", "refresh");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        store.claim(&mut tx, &k, None, ttl(3)).await.expect("claim"),
        Claim::Fresh
    );
    // A slow handler.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    store
        .refresh_claims(&mut tx, std::slice::from_ref(&k), ttl(3))
        .await
        .expect("refresh");
    store.commit(tx).await.expect("commit");
    // Past the claim's first expiry (3 s), well within the refreshed one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let again = claim_committed(&store, &k, ttl(HOUR)).await;
    assert!(
        !again.is_claimed(),
        "the refreshed claim must still be live, got {again:?}"
    );
}

/// `live_ids_from` lists the committed, live ids of one scope from an id
/// on, in order: not another scope's, not an uncommitted or rolled-back
/// claim's, not an expired one's.
pub async fn live_ids_from_lists_committed_live_ids<S: DedupStore>(store: S) {
    let offset = |n: u64| format!("{n:020}");
    // Scopes as the runtime names them: the only ones it reads in order.
    let ids = format!("{ORDERED_SCOPE_PREFIX}conformance/ids/0");
    let other = format!("{ORDERED_SCOPE_PREFIX}conformance/ids/1");
    for n in [3, 7, 12, 100] {
        claim_committed(&store, &key(&ids, &offset(n)), ttl(HOUR)).await;
    }
    claim_committed(&store, &key(&ids, &offset(9)), ttl(1)).await;
    claim_committed(&store, &key(&other, &offset(8)), ttl(HOUR)).await;
    let mut rolled_back = store.begin().await.expect("begin");
    store
        .claim(&mut rolled_back, &key(&ids, &offset(10)), None, ttl(HOUR))
        .await
        .expect("claim");
    store.rollback(rolled_back).await.expect("rollback");
    let mut open = store.begin().await.expect("begin");
    store
        .claim(&mut open, &key(&ids, &offset(11)), None, ttl(HOUR))
        .await
        .expect("claim");
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let live = store
        .live_ids_from(&key(&ids, &offset(7)))
        .await
        .expect("live ids");
    assert_eq!(
        live,
        [offset(7), offset(12), offset(100)],
        "committed, live, in scope, from 7 on, in numeric order"
    );
    store.rollback(open).await.expect("rollback");

    // Any other scope is answered too (a store may scan for it).
    let plain = "conformance-plain-ids";
    for n in [5, 6] {
        claim_committed(&store, &key(plain, &offset(n)), ttl(HOUR)).await;
    }
    let live = store
        .live_ids_from(&key(plain, &offset(6)))
        .await
        .expect("live ids of another scope");
    assert_eq!(live, [offset(6)], "any scope, from 6 on");
}

/// The same id in two scopes is two independent claims.
pub async fn scope_isolation<S: DedupStore>(store: S) {
    let a = key("handler-a", "evt-1");
    let b = key("handler-b", "evt-1");
    assert_eq!(claim_committed(&store, &a, ttl(HOUR)).await, Claim::Fresh);
    assert_eq!(claim_committed(&store, &b, ttl(HOUR)).await, Claim::Fresh);
    assert!(!claim_committed(&store, &a, ttl(HOUR)).await.is_claimed());
    // Where the scope ends is part of the key: a store that joins the two
    // (or digests them joined) must not let these stand for each other.
    for (scope, id) in [
        ("ab", "c"),
        ("a", "bc"),
        ("a:b", "c"),
        ("a", "b:c"),
        ("2:ab", "c"),
    ] {
        assert_eq!(
            claim_committed(&store, &key(scope, id), ttl(HOUR)).await,
            Claim::Fresh,
            "({scope:?}, {id:?}) is a claim of its own"
        );
    }
}

/// Rollback releases the claim: the next claim is `Fresh`, not a duplicate.
/// So does dropping a transaction without committing it.
pub async fn rollback_releases_the_claim<S: DedupStore>(store: S) {
    let k = key("conformance", "rollback");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        store
            .claim(&mut tx, &k, None, ttl(HOUR))
            .await
            .expect("claim"),
        Claim::Fresh
    );
    store.rollback(tx).await.expect("rollback");
    assert_eq!(
        claim_committed(&store, &k, ttl(HOUR)).await,
        Claim::Fresh,
        "a rolled-back claim must leave no trace"
    );

    let k = key("conformance", "dropped");
    {
        let mut tx = store.begin().await.expect("begin");
        store
            .claim(&mut tx, &k, None, ttl(HOUR))
            .await
            .expect("claim");
    }
    // Backends may release a dropped transaction asynchronously.
    let mut last = None;
    for _ in 0..50 {
        let mut tx = store.begin().await.expect("begin");
        match store.claim(&mut tx, &k, None, ttl(HOUR)).await {
            Ok(Claim::Fresh) => return,
            other => last = Some(format!("{other:?}")),
        }
        store.rollback(tx).await.expect("rollback");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("a dropped transaction must release its claim, last saw {last:?}");
}

/// Checks that `second` waits while `first` holds its claims, ends `first`
/// (commit or rollback), and returns what `second` then got.
async fn after_first_ends<S: DedupStore, T>(
    store: &S,
    first: S::Tx,
    first_commits: bool,
    second: tokio::task::JoinHandle<T>,
) -> T {
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second claimer must wait for the first transaction"
    );
    if first_commits {
        store.commit(first).await.expect("commit");
    } else {
        store.rollback(first).await.expect("rollback");
    }
    second.await.expect("task")
}

/// A second transaction claiming a key whose first claim is uncommitted
/// waits for the first: it claims the key if the first rolls back, and sees a
/// duplicate if the first commits.
pub async fn second_claimer_waits_for_the_first<S: DedupStore + Clone>(store: S) {
    for first_commits in [false, true] {
        let k = key(
            "conformance",
            if first_commits {
                "wait-commit"
            } else {
                "wait-rollback"
            },
        );
        let mut first = store.begin().await.expect("begin");
        assert_eq!(
            store
                .claim(&mut first, &k, None, ttl(HOUR))
                .await
                .expect("claim"),
            Claim::Fresh
        );

        let second = tokio::spawn({
            let (store, k) = (store.clone(), k.clone());
            async move {
                let mut tx = store.begin().await.expect("begin");
                let claim = store
                    .claim(&mut tx, &k, None, ttl(HOUR))
                    .await
                    .expect("claim");
                store.commit(tx).await.expect("commit");
                claim
            }
        });
        let claim = after_first_ends(&store, first, first_commits, second).await;
        if first_commits {
            assert!(
                matches!(claim, Claim::Duplicate { .. }),
                "first committed, got {claim:?}"
            );
        } else {
            assert_eq!(
                claim,
                Claim::Fresh,
                "first rolled back, the second must claim"
            );
        }
    }
}

/// A batch claim meeting a key another transaction claimed and has not
/// committed waits for it: the key is claimed if that transaction rolls
/// back, and is a duplicate, with that claim's expiry, if it commits. The
/// batch's other keys are answered as usual.
pub async fn batch_claimer_waits_for_the_first<S: DedupStore + Clone>(store: S) {
    for first_commits in [false, true] {
        let outcome = if first_commits { "commit" } else { "rollback" };
        let k = key("batch-wait", outcome);
        let live = key("batch-wait", &format!("live-{outcome}"));
        let new = key("batch-wait", &format!("new-{outcome}"));
        claim_committed(&store, &live, ttl(HOUR)).await;
        let mut first = store.begin().await.expect("begin");
        assert_eq!(
            store
                .claim(&mut first, &k, None, ttl(HOUR))
                .await
                .expect("claim"),
            Claim::Fresh
        );

        let second = tokio::spawn({
            let store = store.clone();
            let keys = [new.clone(), k.clone(), live.clone()];
            async move {
                let mut tx = store.begin().await.expect("begin");
                let claims = store
                    .claim_many(&mut tx, &keys, &[], ttl(HOUR))
                    .await
                    .expect("claim_many");
                store.commit(tx).await.expect("commit");
                claims
            }
        });
        let claims = after_first_ends(&store, first, first_commits, second).await;
        assert_eq!(claims[0], Claim::Fresh, "{outcome}: {claims:?}");
        let in_half_an_hour = SystemTime::now() + Duration::from_secs(HOUR / 2);
        let live_claim = |claim: &Claim| match claim {
            Claim::Duplicate { expires_at, .. } => *expires_at > in_half_an_hour,
            _ => false,
        };
        assert!(
            live_claim(&claims[2]),
            "{outcome}: a live claim, with its expiry: {claims:?}"
        );
        if first_commits {
            assert!(
                live_claim(&claims[1]),
                "first committed: a duplicate with the first's expiry, got {claims:?}"
            );
        } else {
            assert_eq!(
                claims[1],
                Claim::Fresh,
                "first rolled back, the batch must claim"
            );
        }
    }
}

/// A batch claim: one outcome per key in order; a key given twice is claimed
/// once; live and expired claims are reported as for single claims; the
/// claims commit with the transaction.
pub async fn batch_claims<S: DedupStore>(store: S) {
    let [a, b, c, live, expired] = ["a", "b", "c", "live", "expired"].map(|id| key("batch", id));
    claim_committed(&store, &live, ttl(HOUR)).await;
    claim_committed(&store, &expired, ttl(1)).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let keys = [
        a.clone(),
        b.clone(),
        a.clone(),
        live.clone(),
        expired.clone(),
        c.clone(),
        b.clone(),
    ];
    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, &keys, &[], ttl(HOUR))
        .await
        .expect("claim_many");
    store.commit(tx).await.expect("commit");

    let shape: Vec<&str> = claims
        .iter()
        .map(|c| match c {
            Claim::Fresh => "fresh",
            Claim::Reclaimed => "reclaimed",
            Claim::Duplicate { .. } => "duplicate",
        })
        .collect();
    assert_eq!(
        shape,
        [
            "fresh",
            "fresh",
            "duplicate",
            "duplicate",
            "reclaimed",
            "fresh",
            "duplicate"
        ],
        "outcomes of {keys:?}"
    );
    for k in [&a, &b, &c, &expired] {
        assert!(
            !claim_committed(&store, k, ttl(HOUR)).await.is_claimed(),
            "{k:?} must be claimed by the batch"
        );
    }

    let mut tx = store.begin().await.expect("begin");
    assert!(
        store
            .claim_many(&mut tx, &[], &[], ttl(HOUR))
            .await
            .expect("empty batch")
            .is_empty()
    );
    store.rollback(tx).await.expect("rollback");
}

/// A batch that rolls back releases every key it claimed.
pub async fn batch_rollback_releases_every_claim<S: DedupStore>(store: S) {
    let keys: Vec<DedupKey> = (0..50)
        .map(|i| key("batch-rollback", &i.to_string()))
        .collect();
    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, &keys, &[], ttl(HOUR))
        .await
        .expect("claim_many");
    assert!(claims.iter().all(|c| *c == Claim::Fresh));
    store.rollback(tx).await.expect("rollback");

    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, &keys, &[], ttl(HOUR))
        .await
        .expect("claim_many");
    assert!(
        claims.iter().all(|c| *c == Claim::Fresh),
        "rolled-back batch left claims: {claims:?}"
    );
    store.rollback(tx).await.expect("rollback");
}

/// Ids longer than the limit are stored as digests: distinct long ids with a
/// common prefix stay distinct, the same long id is a duplicate.
pub async fn long_keys_are_digested<S: DedupStore>(store: S) {
    let prefix = "k".repeat(1000);
    let a = key("long", &format!("{prefix}-a"));
    let b = key("long", &format!("{prefix}-b"));
    assert!(a.id().starts_with("sha256:") && a.id().len() == 71);
    assert_eq!(claim_committed(&store, &a, ttl(HOUR)).await, Claim::Fresh);
    assert_eq!(claim_committed(&store, &b, ttl(HOUR)).await, Claim::Fresh);
    let again = key("long", &format!("{prefix}-a"));
    assert!(
        !claim_committed(&store, &again, ttl(HOUR))
            .await
            .is_claimed()
    );
}

/// Purging deletes expired claims only, in bounded batches, and a purged
/// key can be claimed afresh.
pub async fn purge_removes_only_expired<S: DedupStore + PurgeExpired>(store: S) {
    for i in 0..5 {
        claim_committed(&store, &key("purge", &format!("old-{i}")), ttl(1)).await;
    }
    for i in 0..3 {
        claim_committed(&store, &key("purge", &format!("live-{i}")), ttl(HOUR)).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;

    assert_eq!(
        store.purge_expired(2).await.expect("purge"),
        2,
        "bounded by the limit"
    );
    assert_eq!(
        crate::purge::purge_round(&store, 2).await,
        3,
        "the rest of the expired claims"
    );
    assert_eq!(
        store.purge_expired(100).await.expect("purge"),
        0,
        "live claims stay"
    );

    for i in 0..3 {
        let live = key("purge", &format!("live-{i}"));
        assert!(
            !claim_committed(&store, &live, ttl(HOUR)).await.is_claimed(),
            "{live:?} was purged"
        );
    }
    assert_eq!(
        claim_committed(&store, &key("purge", "old-0"), ttl(HOUR)).await,
        Claim::Fresh
    );
}

/// Expands to one test per conformance case, so a backend runs every case
/// (including cases added later) without listing them.
///
/// Give the test attribute, the test function's parameters, and an
/// expression that makes a fresh store from them (it may `.await`):
///
/// ```text
/// dedup_core::conformance_tests!(#[sqlx::test(migrations = false)] |pool: PgPool| {
///     let store = PgStore::from_pool(pool);
///     store.migrate().await.unwrap();
///     store
/// });
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (@cases [$($attrs:tt)*] [$($params:tt)*] $make:expr) => {
        $crate::conformance_tests!(@each [$($attrs)*] [$($params)*] $make;
            exclusive_under_concurrency,
            duplicate_within_ttl,
            reclaim_after_expiry,
            refresh_restarts_the_ttl,
            scope_isolation,
            rollback_releases_the_claim,
            second_claimer_waits_for_the_first,
            batch_claimer_waits_for_the_first,
            batch_claims,
            batch_rollback_releases_every_claim,
            long_keys_are_digested,
            fingerprints_are_kept_with_the_claim,
            batch_claims_keep_fingerprints,
            a_lease_has_one_holder,
            a_completed_lease_is_done,
            an_expired_lease_is_taken_over_and_its_holder_fenced,
            an_extended_lease_stays_held,
            live_ids_from_lists_committed_live_ids,
            purge_removes_only_expired
        );
    };
    // One case at a time: the attributes repeat once per case.
    (@each [$($attrs:tt)*] [$($params:tt)*] $make:expr; $case:ident $(, $rest:ident)*) => {
        $($attrs)*
        async fn $case($($params)*) {
            $crate::conformance::$case($make).await;
        }
        $crate::conformance_tests!(@each [$($attrs)*] [$($params)*] $make; $($rest),*);
    };
    (@each [$($attrs:tt)*] [$($params:tt)*] $make:expr;) => {};
    ($(#[$attr:meta])* || $make:expr) => {
        $crate::conformance_tests!(@cases [$(#[$attr])*] [] $make);
    };
    ($(#[$attr:meta])* |$($arg:ident : $ty:ty),* $(,)?| $make:expr) => {
        $crate::conformance_tests!(@cases [$(#[$attr])*] [$($arg: $ty),*] $make);
    };
}
