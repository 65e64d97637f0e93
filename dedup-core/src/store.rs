//! The storage contract every backend implements.

use std::error::Error as StdError;
use std::future::Future;
use std::time::{Duration, SystemTime};

use crate::{Classification, DedupKey, Fingerprint, StoreError, Ttl};

/// The prefix of every scope the runtime reads in key order
/// ([`DedupStore::live_ids_from`]): its dead-letter records,
/// `dedup.dead-letter/<handler scope>/<topic>/<partition>`.
pub const ORDERED_SCOPE_PREFIX: &str = "dedup.dead-letter/";

/// The scope [`ORDERED_SCOPE_PREFIX`]`rest`, kept under that prefix however
/// long `rest` is: when the whole would be digested as a key part (longer
/// than [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES), or holding a NUL), `rest` alone is
/// digested instead, so a store still reads the scope in key order.
///
/// ```
/// use dedup_core::{DedupKey, ORDERED_SCOPE_PREFIX, ordered_scope};
///
/// let long = ordered_scope(&format!("handler/{}/0", "t".repeat(249)));
/// assert!(long.starts_with(ORDERED_SCOPE_PREFIX));
/// assert_eq!(DedupKey::new(long.as_str(), "1")?.scope(), long, "stored as is");
/// assert_eq!(ordered_scope("handler/t/0"), "dedup.dead-letter/handler/t/0");
/// # Ok::<(), dedup_core::KeyError>(())
/// ```
pub fn ordered_scope(rest: &str) -> String {
    let whole = format!("{ORDERED_SCOPE_PREFIX}{rest}");
    if DedupKey::new(whole.as_str(), "-").is_ok_and(|key| key.scope() == whole) {
        return whole;
    }
    format!("{ORDERED_SCOPE_PREFIX}{}", crate::key::digest_of(rest))
}

/// The result of claiming a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// No claim existed: this transaction now holds it.
    Fresh,
    /// An expired claim existed and this transaction took it over: the event
    /// is treated as new (a redelivery after the TTL).
    Reclaimed,
    /// A live claim exists: the event was already applied within the TTL.
    Duplicate {
        /// When the existing claim expires, on the store's clock.
        expires_at: SystemTime,
        /// How long ago the existing claim was taken, on the store's clock
        /// (PostgreSQL: between the two transactions' starts): how late this duplicate came. Its distribution
        /// is the redelivery window a TTL must cover.
        age: Duration,
        /// The fingerprint the existing claim keeps, if it was taken with
        /// one: the caller compares it with its event's.
        fingerprint: Option<Fingerprint>,
    },
}

impl Claim {
    /// Whether this transaction holds the claim (`Fresh` or `Reclaimed`) and
    /// so should apply the event.
    pub fn is_claimed(&self) -> bool {
        !matches!(self, Claim::Duplicate { .. })
    }
}

/// A dedup store: the one atomic operation idempotency rests on.
///
/// # The claim contract
///
/// [`claim`](DedupStore::claim) is an atomic **create-if-absent-or-expired**
/// of the row `(scope, id)`, judged on **the store's own clock** (the database
/// server's `now()`, never the consumer host's):
///
/// - no row: create it with `expires_at = now + ttl` and return
///   [`Claim::Fresh`];
/// - a row with `expires_at <= now`: take it over (new `expires_at`) and
///   return [`Claim::Reclaimed`];
/// - a live row: leave it and return [`Claim::Duplicate`].
///
/// The claim belongs to the caller's transaction: other transactions see it
/// only once that transaction commits, and a rollback (or dropping the
/// transaction) releases it as if it never happened. A second transaction
/// that claims a key whose claim is still uncommitted **waits** for the first
/// to finish, then gets `Duplicate` (committed) or claims it (rolled back);
/// a backend bounds that wait and fails with a retryable [`StoreError`]
/// rather than hang.
///
/// Because the effect of the handler is written in the same transaction,
/// "claimed and applied" commit together or not at all.
///
/// A claim keeps the [`Fingerprint`] it is taken with (`None`: none), and
/// a take-over replaces it; a [`Claim::Duplicate`] returns the one the live
/// claim keeps, read in the same round trip as its expiry. The store only
/// keeps and returns it: comparing is the caller's.
pub trait DedupStore: Send + Sync + 'static {
    /// The store's transaction; handler bodies write their effect through it.
    type Tx: Send + 'static;

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Claims one key inside `tx` (see the contract above), keeping
    /// `fingerprint` with the claim if it is taken.
    fn claim(
        &self,
        tx: &mut Self::Tx,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Claims many keys inside `tx` in a few statements whatever their
    /// number (not one per key), returning one outcome per key in the order
    /// given.
    ///
    /// `fingerprints` is empty (none kept) or holds one per key.
    ///
    /// A key given more than once is claimed at its first position; its later
    /// positions are `Duplicate` (carrying the new claim's expiry and
    /// fingerprint), so each event in a batch is applied at most once.
    fn claim_many(
        &self,
        tx: &mut Self::Tx,
        keys: &[DedupKey],
        fingerprints: &[Option<Fingerprint>],
        ttl: Ttl,
    ) -> impl Future<Output = Result<Vec<Claim>, StoreError>> + Send;

    /// Restarts the TTL of claims that `tx` took, from the store's clock now:
    /// `expires_at = now + ttl`. The protocol calls it before committing a
    /// transaction that ran for half its TTL or more, so that a slow handler
    /// does not commit a claim already (nearly) expired, which the next
    /// duplicate would take over and apply again. The default does nothing:
    /// claims keep the expiry they got when claimed.
    fn refresh_claims(
        &self,
        tx: &mut Self::Tx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (tx, keys, ttl);
        std::future::ready(Ok(()))
    }

    /// The ids of the committed, live claims (on the store's clock) of
    /// `from`'s scope whose ids sort at or after `from`'s id, in ascending
    /// order. Ids that start with a number of a fixed width of ASCII digits
    /// sort by that number in every store. The runtime reads with it, once
    /// per assigned partition, the records of the messages it has already
    /// dead-lettered (ids `<offset, 20 digits>.<fingerprint>`), so a
    /// redelivery neither dead-letters them again nor applies them.
    ///
    /// The runtime calls it only for scopes that start with
    /// [`ORDERED_SCOPE_PREFIX`]: a store may keep its claims in key order for
    /// those scopes alone (an index on every claim costs every claim) and
    /// answer others by a slower scan.
    fn live_ids_from(
        &self,
        from: &DedupKey,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// How many transactions the store can hold open at once (a pool's
    /// size), if it has such a bound: the runtime runs no more partitions at
    /// once than this by default. `None` (the default): no bound known.
    fn connections(&self) -> Option<usize> {
        None
    }

    /// Commits `tx`: its claims and the handler's effects become visible.
    fn commit(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls `tx` back, releasing its claims.
    fn rollback(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Classifies an error that a handler body returned through `?`:
    /// [`Contention`](Classification::Contention),
    /// [`Transient`](Classification::Transient) or
    /// [`Environment`](Classification::Environment) if the store recognises
    /// it as an error a retry can help (a database error whose code says so),
    /// [`Permanent`](Classification::Permanent) if it recognises it
    /// otherwise, [`Unknown`](Classification::Unknown) if it is not the
    /// store's error at all.
    fn classify(&self, error: &(dyn StdError + 'static)) -> Classification {
        let _ = error;
        Classification::Unknown
    }

    /// The store's code for an error a handler body returned (a SQLSTATE,
    /// say), if it is the store's error and has one: it goes into the
    /// dead letter's reason so an operator sees which rule was broken.
    fn error_code(&self, error: &(dyn StdError + 'static)) -> Option<String> {
        let _ = error;
        None
    }
}

/// Deleting expired claims, so the table stays about `rate x TTL` rows.
pub trait PurgeExpired: Send + Sync + 'static {
    /// Deletes at most `limit` claims that expired on the store's clock
    /// (never a lease still in progress: see [`LeaseStore`](crate::LeaseStore)) and
    /// returns how many it deleted. Bounded so that purging never holds long
    /// locks beside a running consumer; call again while it returns `limit`.
    fn purge_expired(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;
}
