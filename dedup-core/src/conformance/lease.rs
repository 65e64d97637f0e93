//! The conformance cases of leases ([`LeaseStore`]): one holder, done once
//! completed, taken over once expired (its holder fenced), kept while
//! extended.

use std::time::{Duration, SystemTime};

use super::{HOUR, claim_committed, key, ttl};
use crate::{Acquire, DedupKey, Fingerprint, LeaseStore, PurgeExpired, Token, Ttl};

/// Takes a lease, panicking unless it is acquired; returns its token.
async fn acquired<S: LeaseStore>(store: &S, key: &DedupKey, lease: Ttl) -> (Token, bool) {
    match store.acquire(key, None, lease).await.expect("acquire") {
        Acquire::Acquired { token, reclaimed } => (token, reclaimed),
        other => panic!("{key:?}: expected to acquire, got {other:?}"),
    }
}

/// One holder at a time: a live lease is `Held` by its token, also for N
/// acquirers racing on a fresh key (exactly one wins).
pub async fn a_lease_has_one_holder<S: LeaseStore>(store: S) {
    let k = key("lease", "one");
    let (token, reclaimed) = acquired(&store, &k, ttl(HOUR)).await;
    assert!(!reclaimed);
    match store.acquire(&k, None, ttl(HOUR)).await.expect("acquire") {
        Acquire::Held { token: held, .. } => assert_eq!(held, token),
        other => panic!("a live lease must be held, got {other:?}"),
    }
    let race = key("lease", "race");
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (store, race) = (store.clone(), race.clone());
            tokio::spawn(async move { store.acquire(&race, None, ttl(HOUR)).await })
        })
        .collect();
    let mut winners = 0;
    for task in tasks {
        match task.await.expect("task").expect("acquire") {
            Acquire::Acquired { .. } => winners += 1,
            Acquire::Held { .. } => {}
            other => panic!("nothing was done yet: {other:?}"),
        }
    }
    assert_eq!(winners, 1, "exactly one of 16 racing acquirers holds");
}

/// A completed lease is done: later acquirers get `Done` with its
/// fingerprint, for the TTL; completing or releasing it again does nothing.
pub async fn a_completed_lease_is_done<S: LeaseStore>(store: S) {
    let k = key("lease", "done");
    let fingerprint = Some(Fingerprint::of_payload(b"charge"));
    let token = match store
        .acquire(&k, fingerprint, ttl(60))
        .await
        .expect("acquire")
    {
        Acquire::Acquired { token, .. } => token,
        other => panic!("{other:?}"),
    };
    assert!(
        store
            .complete(&k, token, ttl(HOUR))
            .await
            .expect("complete")
    );
    match store.acquire(&k, None, ttl(60)).await.expect("acquire") {
        Acquire::Done {
            expires_at,
            fingerprint: kept,
            ..
        } => {
            assert_eq!(kept, fingerprint);
            let left = expires_at
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            assert!(
                left > Duration::from_secs(HOUR - 60),
                "the TTL, not the lease: {left:?}"
            );
        }
        other => panic!("a completed lease must be done, got {other:?}"),
    }
    assert!(
        !store
            .complete(&k, token, ttl(HOUR))
            .await
            .expect("complete")
    );
    assert!(!store.release(&k, token).await.expect("release"));
    assert_eq!(
        store.extend(&k, token, ttl(60)).await.expect("extend"),
        None
    );
    assert!(
        !claim_committed(&store, &k, ttl(HOUR)).await.is_claimed(),
        "a done claim is a duplicate for transactions too"
    );
}

/// An expired lease is taken over with a greater token, and the stale
/// holder is fenced: it can neither extend, complete nor release. A
/// released lease is acquired again at once. Tokens keep growing after the
/// claims that held them are purged.
pub async fn an_expired_lease_is_taken_over_and_its_holder_fenced<S: LeaseStore + PurgeExpired>(
    store: S,
) {
    let k = key("lease", "expired");
    let (stale, _) = acquired(&store, &k, ttl(1)).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (token, reclaimed) = acquired(&store, &k, ttl(HOUR)).await;
    assert!(reclaimed && token > stale, "{stale} then {token}");
    assert_eq!(
        store.extend(&k, stale, ttl(60)).await.expect("extend"),
        None
    );
    assert!(
        !store
            .complete(&k, stale, ttl(HOUR))
            .await
            .expect("complete")
    );
    assert!(!store.release(&k, stale).await.expect("release"));
    assert!(
        store
            .extend(&k, token, ttl(60))
            .await
            .expect("extend")
            .is_some(),
        "the new holder's lease"
    );
    assert!(store.release(&k, token).await.expect("release"));
    let (again, reclaimed) = acquired(&store, &k, ttl(60)).await;
    assert!(!reclaimed && again > token, "released, so acquired afresh");

    // Done for a second, then purged: the next token is still greater.
    assert!(store.complete(&k, again, ttl(1)).await.expect("complete"));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    while store.purge_expired(100).await.expect("purge") > 0 {}
    let (after_purge, reclaimed) = acquired(&store, &k, ttl(60)).await;
    assert!(
        !reclaimed && after_purge > again,
        "{again} then {after_purge}"
    );
}

/// An extended lease outlives its first expiry; a lease that expired but
/// was not taken over still completes under its token, also after a purge
/// ran (the purge leaves leases in progress alone).
pub async fn an_extended_lease_stays_held<S: LeaseStore + PurgeExpired>(store: S) {
    let k = key("lease", "extended");
    let (token, _) = acquired(&store, &k, ttl(1)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        store
            .extend(&k, token, ttl(3))
            .await
            .expect("extend")
            .is_some()
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        matches!(
            store.acquire(&k, None, ttl(1)).await.expect("acquire"),
            Acquire::Held { .. }
        ),
        "extended past its first second"
    );

    let late = key("lease", "late");
    let (token, _) = acquired(&store, &late, ttl(1)).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    while store.purge_expired(100).await.expect("purge") > 0 {}
    assert!(
        store
            .complete(&late, token, ttl(HOUR))
            .await
            .expect("complete"),
        "only a newer holder fences"
    );
    assert!(matches!(
        store.acquire(&late, None, ttl(1)).await.expect("acquire"),
        Acquire::Done { .. }
    ));
}
