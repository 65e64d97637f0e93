//! The conformance cases of fingerprints: kept with a claim, single or in a
//! batch, and told apart from a claim without one.

use std::time::Duration;

use super::{HOUR, key, ttl};
use crate::{Claim, DedupKey, DedupStore, Fingerprint, Ttl};

/// Claims `key` with `fingerprint` in a transaction of its own and commits
/// it.
async fn claim_with<S: DedupStore>(
    store: &S,
    key: &DedupKey,
    fingerprint: Option<Fingerprint>,
    ttl: Ttl,
) -> Claim {
    let mut tx = store.begin().await.expect("begin");
    let claim = store
        .claim(&mut tx, key, fingerprint, ttl)
        .await
        .expect("claim");
    store.commit(tx).await.expect("commit");
    claim
}

/// The fingerprint a duplicate reports, panicking if it is no duplicate.
fn kept(claim: Claim) -> Option<Fingerprint> {
    match claim {
        Claim::Duplicate { fingerprint, .. } => fingerprint,
        other => panic!("expected a duplicate, got {other:?}"),
    }
}

/// A claim keeps the fingerprint it was taken with and a duplicate returns
/// it, whatever fingerprint the duplicate has; a claim taken without one
/// returns none; a take-over after the TTL replaces it.
pub async fn fingerprints_are_kept_with_the_claim<S: DedupStore>(store: S) {
    let [a, b, c] = [b"a", b"b", b"c"].map(|p| Some(Fingerprint::of_payload(p)));
    let k = key("fingerprint", "kept");
    assert_eq!(claim_with(&store, &k, a, ttl(HOUR)).await, Claim::Fresh);
    assert_eq!(kept(claim_with(&store, &k, b, ttl(HOUR)).await), a);
    assert_eq!(kept(claim_with(&store, &k, None, ttl(HOUR)).await), a);

    let none = key("fingerprint", "none");
    claim_with(&store, &none, None, ttl(HOUR)).await;
    assert_eq!(kept(claim_with(&store, &none, b, ttl(HOUR)).await), None);

    let expiring = key("fingerprint", "expiring");
    claim_with(&store, &expiring, a, ttl(1)).await;
    let cleared = key("fingerprint", "cleared");
    claim_with(&store, &cleared, a, ttl(1)).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        claim_with(&store, &expiring, c, ttl(HOUR)).await,
        Claim::Reclaimed
    );
    assert_eq!(
        kept(claim_with(&store, &expiring, a, ttl(HOUR)).await),
        c,
        "the take-over's fingerprint"
    );
    assert_eq!(
        claim_with(&store, &cleared, None, ttl(HOUR)).await,
        Claim::Reclaimed
    );
    assert_eq!(
        kept(claim_with(&store, &cleared, a, ttl(HOUR)).await),
        None,
        "a take-over without a fingerprint keeps none"
    );
}

/// A batch keeps each key's fingerprint; a live claim's duplicate reports
/// the claim's; a key given twice reports, at its repeat, the fingerprint
/// given at its first position; an empty list of fingerprints keeps none.
pub async fn batch_claims_keep_fingerprints<S: DedupStore>(store: S) {
    let [fa, fb, fx, fl] = [b"a", b"b", b"x", b"l"].map(|p| Some(Fingerprint::of_payload(p)));
    let [a, b, live, plain] = ["a", "b", "live", "plain"].map(|id| key("batch-fingerprint", id));
    claim_with(&store, &live, fl, ttl(HOUR)).await;

    let keys = [a.clone(), b.clone(), a.clone(), live.clone()];
    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, &keys, &[fa, None, fx, fb], ttl(HOUR))
        .await
        .expect("claim_many");
    store.commit(tx).await.expect("commit");
    assert_eq!(claims[0], Claim::Fresh);
    assert_eq!(claims[1], Claim::Fresh);
    assert_eq!(kept(claims[2]), fa, "the repeat meets its first position");
    assert_eq!(kept(claims[3]), fl, "the live claim's fingerprint");
    assert_eq!(kept(claim_with(&store, &a, fx, ttl(HOUR)).await), fa);
    assert_eq!(kept(claim_with(&store, &b, fx, ttl(HOUR)).await), None);

    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, std::slice::from_ref(&plain), &[], ttl(HOUR))
        .await
        .expect("claim_many");
    store.commit(tx).await.expect("commit");
    assert_eq!(claims, [Claim::Fresh]);
    assert_eq!(kept(claim_with(&store, &plain, fa, ttl(HOUR)).await), None);
}
