//! What a store's connection must not do to a batch: hold it for the
//! network.

use std::time::{Duration, Instant};

use crate::{Claim, DedupKey, DedupStore, Ttl};

/// A batch's transaction (begin, one claim of 200 keys, commit) is sent as
/// it is written: its median time over 21 rounds stays under 30 ms.
///
/// The runtime's default batch of 200 events with UUID ids makes a claim
/// statement of about 17 KiB, more than one TLS record (16 KiB), so it
/// leaves in two writes. With Nagle's algorithm on (`TCP_NODELAY` unset,
/// as sqlx 0.9.0 left it), the second waits for the server to acknowledge
/// the first, which the server delays by 40 ms on Linux: every
/// transaction then takes over 40 ms, against about a millisecond. Not a
/// speed target: the 40 ms is the kernel's fixed delay. Give it a store
/// connected over TLS, the way production connects.
pub async fn batch_transactions_are_not_held<S: DedupStore>(store: &S) {
    let ttl = Ttl::from_secs(3600).expect("an hour");
    let mut times = Vec::new();
    for _ in 0..21 {
        let keys: Vec<DedupKey> = (0..200)
            .map(|_| {
                let id = uuid::Uuid::new_v4().to_string();
                DedupKey::new("payments::record_payment", id).expect("key")
            })
            .collect();
        let started = Instant::now();
        let mut tx = store.begin().await.expect("begin");
        let claims = store
            .claim_many(&mut tx, &keys, &[], ttl)
            .await
            .expect("claim_many");
        store.commit(tx).await.expect("commit");
        times.push(started.elapsed());
        assert!(
            claims.iter().all(|c| matches!(c, Claim::Fresh)),
            "{claims:?}"
        );
    }
    times.sort();
    let median = times[times.len() / 2];
    assert!(
        median < Duration::from_millis(30),
        "a batch's transaction took {median:?} (median of 21; sorted: {times:?}): held for the \
         server's delayed acknowledgement (TCP_NODELAY unset on the connection)"
    );
}
