//! Lease mode: claims for effects outside the store's transactions.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crate::{
    DedupKey, DedupStore, Describe, DescribeExt as _, Error, Fingerprint, HandlerError, Headers,
    Outcome, StoreError, Ttl,
};

/// The fencing token of a lease, drawn from a counter that only grows
/// (never reused, not even after the claim is purged): a holder that takes
/// an expired lease over has a greater token than the one it replaces, so
/// an outside system that keeps the highest token it has seen for a key
/// can refuse a stale holder's late write.
pub type Token = u64;

/// The result of taking a lease on a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquire {
    /// This caller holds the lease until `expires_at` (store clock) unless
    /// it extends it: run the effect.
    Acquired {
        /// The lease's fencing token.
        token: Token,
        /// `true` when an expired claim was taken over: an expired lease
        /// (its holder crashed or stalled) or a done claim past its TTL.
        reclaimed: bool,
    },
    /// Another holder's lease is live: the effect may be under way. Try
    /// again later; it ends done (a duplicate) or expired (taken over).
    Held {
        /// When the lease expires unless extended, on the store's clock.
        expires_at: SystemTime,
        /// The holder's token.
        token: Token,
    },
    /// The effect is done and its claim live: a duplicate.
    Done {
        /// When the claim expires.
        expires_at: SystemTime,
        /// How long ago the claim was taken.
        age: Duration,
        /// The fingerprint the claim keeps.
        fingerprint: Option<Fingerprint>,
    },
}

/// Claims whose effect lies outside the store (an HTTP call, an email):
/// each step is its own short committed transaction, fenced by a token.
///
/// # The lease contract
///
/// - [`acquire`](LeaseStore::acquire) is atomic, on the store's clock: no
///   claim, or an expired one (a lease or a done claim) → a new lease,
///   *in progress*, expiring `lease` from now, with a new token from a
///   counter that only grows (a take-over's is greater than the token it
///   replaces); a live lease → [`Acquire::Held`]; a
///   live done claim → [`Acquire::Done`]. Two acquirers never both hold.
/// - [`extend`](LeaseStore::extend), [`complete`](LeaseStore::complete) and
///   [`release`](LeaseStore::release) act only while the claim is still in
///   progress under the caller's token; otherwise they change nothing and
///   say so (`None` / `false`): a newer holder took over (or the claim is
///   gone), and the caller's result must not overwrite it.
/// - `complete` turns the lease into a done claim that lives for the TTL;
///   `release` deletes it, so the next attempt acquires at once.
/// - An expired lease that nobody took over still completes under its
///   token: only a newer holder fences an older one. So the purge
///   ([`PurgeExpired`](crate::PurgeExpired)) leaves leases in progress
///   alone; the next delivery of their event takes them over.
pub trait LeaseStore: DedupStore + Clone {
    /// Takes a lease on `key` (see the contract above), keeping
    /// `fingerprint` with it.
    fn acquire(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        lease: Ttl,
    ) -> impl Future<Output = Result<Acquire, StoreError>> + Send;

    /// Restarts the lease's expiry from the store's clock now; `None` if
    /// `token` no longer holds it.
    fn extend(
        &self,
        key: &DedupKey,
        token: Token,
        lease: Ttl,
    ) -> impl Future<Output = Result<Option<SystemTime>, StoreError>> + Send;

    /// Marks the effect done: the claim lives for `ttl` from now and makes
    /// every later delivery a duplicate. `false` if `token` no longer holds
    /// it.
    fn complete(
        &self,
        key: &DedupKey,
        token: Token,
        ttl: Ttl,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Gives the lease up after a failed effect, so a retry acquires at
    /// once. `false` if `token` no longer holds it.
    fn release(
        &self,
        key: &DedupKey,
        token: Token,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a [`Lease`] needs of its store, with the store's type erased.
trait Extend: Send + Sync {
    fn extend<'a>(
        &'a self,
        key: &'a DedupKey,
        token: Token,
        lease: Ttl,
    ) -> BoxFuture<'a, Result<Option<SystemTime>, StoreError>>;
}

impl<S: LeaseStore> Extend for S {
    fn extend<'a>(
        &'a self,
        key: &'a DedupKey,
        token: Token,
        lease: Ttl,
    ) -> BoxFuture<'a, Result<Option<SystemTime>, StoreError>> {
        Box::pin(LeaseStore::extend(self, key, token, lease))
    }
}

/// A held lease, as a lease-mode handler body receives it
/// (`#[idempotent(lease = "30s")]`).
///
/// Pass [`idempotency_key`](Lease::idempotency_key) (stable for the event)
/// and, where it fences, [`token`](Lease::token) to the outside system: if
/// it accepts an idempotency key or fences by token, the effect happens
/// once; otherwise a holder that stalls past its lease may overlap with the
/// next one.
pub struct Lease {
    key: DedupKey,
    token: Token,
    duration: Ttl,
    /// When the lease ends by this process's clock, counted from before
    /// the store was asked, so never later than the store's expiry.
    deadline: Mutex<Instant>,
    lost: AtomicBool,
    store: Box<dyn Extend>,
}

/// Why [`Lease::extend`] could not extend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// Another holder took the claim over: stop the effect, its result
    /// will not be recorded.
    #[error("the lease on {key} was lost: a newer holder took it over")]
    Lost {
        /// The claim.
        key: DedupKey,
    },
    /// The store could not be asked.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Lease {
    pub(crate) fn new<S: LeaseStore>(
        store: S,
        key: DedupKey,
        token: Token,
        duration: Ttl,
        asked_at: Instant,
    ) -> Self {
        Lease {
            key,
            token,
            duration,
            deadline: Mutex::new(asked_at + duration.as_duration()),
            lost: AtomicBool::new(false),
            store: Box::new(store),
        }
    }

    /// The fencing token: greater than every earlier holder's.
    pub fn token(&self) -> Token {
        self.token
    }

    /// The claim's key.
    pub fn key(&self) -> &DedupKey {
        &self.key
    }

    /// An idempotency key for the outside system: `<scope>/<event id>`
    /// (a `/` or `%` in the scope escaped as `%2F`, `%25`, so no two claims
    /// share a key), the same for every attempt, release and take-over of
    /// this event, so a call that went through but whose reply was lost is
    /// recognised as the same request when it is made again. (The fencing
    /// token, which changes with each holder, is [`token`](Lease::token):
    /// pass it too where the outside system fences stale holders.)
    pub fn idempotency_key(&self) -> String {
        let scope = self.key.scope().replace('%', "%25").replace('/', "%2F");
        format!("{scope}/{}", self.key.id())
    }

    /// How long the lease has left by this process's clock (zero once
    /// lost).
    pub fn remaining(&self) -> Duration {
        if self.taken_over() {
            return Duration::ZERO;
        }
        let deadline = *self.deadline.lock().unwrap_or_else(|p| p.into_inner());
        deadline.saturating_duration_since(Instant::now())
    }

    /// Whether the lease may have passed to another holder: its time ran
    /// out without an extension, or an extension found a newer holder. A
    /// body that sees it should stop before its effect, if it can.
    pub fn is_lost(&self) -> bool {
        self.remaining().is_zero()
    }

    /// Whether an [`extend`](Lease::extend) found a newer holder.
    fn taken_over(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    /// Renews the lease for its full duration from now, for effects that
    /// take longer than one lease. A body that gets
    /// [`LeaseError::Lost`] should stop and may return it with `?`: the
    /// message is then finished as taken over, not failed.
    pub async fn extend(&self) -> Result<(), LeaseError> {
        let asked_at = Instant::now();
        match self
            .store
            .extend(&self.key, self.token, self.duration)
            .await?
        {
            Some(_) => {
                *self.deadline.lock().unwrap_or_else(|p| p.into_inner()) =
                    asked_at + self.duration.as_duration();
                Ok(())
            }
            None => {
                self.lost.store(true, Ordering::Relaxed);
                Err(LeaseError::Lost {
                    key: self.key.clone(),
                })
            }
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("remaining", &self.remaining())
            .finish()
    }
}

/// An idempotent handler in lease mode (`#[idempotent(lease = "30s")]`):
/// its effect is outside the store (an HTTP call, an email), so its body
/// takes a [`Lease`] instead of a transaction. [`LeaseHandlerExt`] builds
/// the acquire -> effect -> complete protocol from these parts.
pub trait LeaseHandler: Describe {
    /// How long a lease lasts unless the body extends it: a holder that
    /// crashes blocks its event's redeliveries this long. (Its
    /// [`ttl`](Describe::ttl) is how long a done claim lives: redeliveries
    /// within it are skipped.)
    fn lease(&self) -> Ttl;

    /// The body: performs the effect under `lease`.
    fn handle(
        &self,
        lease: &Lease,
        event: Self::Event,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// The acquire -> effect -> complete protocol, the same for every
/// [`LeaseHandler`] (implemented for all of them, never by hand).
pub trait LeaseHandlerExt: LeaseHandler {
    /// Processes one message: decode -> key -> acquire -> body -> complete.
    ///
    /// - Another holder's live lease: [`Error::LeaseHeld`] (retry after
    ///   its `expires_at`: it ends done or expired);
    /// - a done claim: `Skipped`, or [`Error::FingerprintMismatch`];
    /// - acquired: the body runs; on success the claim is completed
    ///   (`Applied`), unless a newer holder took it over meanwhile
    ///   ([`Error::LeaseLost`]: that holder finishes the event); on failure
    ///   the lease is released and the body's error returned.
    fn apply_leased<S>(
        &self,
        store: &S,
        payload: &[u8],
        headers: &(dyn Headers + Sync),
    ) -> impl Future<Output = Outcome> + Send
    where
        S: LeaseStore,
    {
        async move {
            match apply_leased(self, store, payload, headers).await {
                Ok(outcome) => outcome,
                Err(e) => Outcome::Failed(e),
            }
        }
    }
}

impl<H: LeaseHandler + ?Sized> LeaseHandlerExt for H {}

async fn apply_leased<H, S>(
    handler: &H,
    store: &S,
    payload: &[u8],
    headers: &(dyn Headers + Sync),
) -> Result<Outcome, Error>
where
    H: LeaseHandler + ?Sized,
    S: LeaseStore,
{
    let (key, fingerprint, event) = handler.prepare(payload, headers)?;
    tracing::Span::current().record("dedup.key", tracing::field::display(&key));
    let asked_at = Instant::now();
    let (token, reclaimed) = match store.acquire(&key, fingerprint, handler.lease()).await? {
        Acquire::Acquired { token, reclaimed } => (token, reclaimed),
        Acquire::Held { expires_at, token } => {
            return Err(Error::LeaseHeld {
                key,
                expires_at,
                token,
            });
        }
        Acquire::Done {
            expires_at,
            age,
            fingerprint: claimed,
        } => {
            if let Some(e) = crate::handler::mismatch(&key, claimed, fingerprint) {
                return Err(e);
            }
            return Ok(Outcome::Skipped { expires_at, age });
        }
    };
    let lease = Lease::new(store.clone(), key.clone(), token, handler.lease(), asked_at);
    if let Err(e) = handler.handle(&lease, event).await {
        // The body stopped because `extend` found a newer holder (and
        // passed that on with `?`): the newer holder finishes the event.
        if lease.taken_over() {
            return Err(Error::LeaseLost { key, token });
        }
        // A release that fails leaves the lease to expire: the retry waits
        // for it, then takes it over.
        if let Err(release) = store.release(&key, token).await {
            tracing::warn!(%key, token, error = %release, "releasing the lease failed; it expires on its own");
        }
        return Err(e.into_error(store));
    }
    complete(store, &lease, handler.ttl()).await?;
    Ok(Outcome::Applied { reclaimed })
}

/// Completes `lease` after its effect. A failure the store may get past is
/// retried while the lease lasts: giving up leaves the effect done but the
/// claim in progress, and once the lease expires the event's next delivery
/// takes it over and runs the effect again.
async fn complete<S: LeaseStore>(store: &S, lease: &Lease, ttl: Ttl) -> Result<(), Error> {
    let mut wait = Duration::from_millis(50);
    loop {
        match store.complete(lease.key(), lease.token(), ttl).await {
            Ok(true) => return Ok(()),
            Ok(false) => {
                return Err(Error::LeaseLost {
                    key: lease.key().clone(),
                    token: lease.token(),
                });
            }
            Err(e) if e.is_retryable() && lease.remaining() > wait => {
                tracing::warn!(key = %lease.key(), error = %e, ?wait, "completing the lease failed; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
