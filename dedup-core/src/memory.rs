//! The reference in-memory store.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;

use crate::lease::{Acquire, LeaseStore, Token};
use crate::{Claim, DedupKey, DedupStore, Fingerprint, PurgeExpired, StoreError, Ttl};

/// An in-memory [`DedupStore`]: the reference implementation of the claim
/// contract, for unit tests, docs and single-process experiments. Claims live
/// as long as the process; nothing is durable.
///
/// It keeps the contract exactly: claims are visible to other transactions
/// only on commit, a second claimer of an uncommitted key waits (up to the
/// lock timeout, 5 s by default, then fails with a retryable error), and
/// rollback or dropping a [`MemoryTx`] releases its claims. Its clock is the
/// process's system clock plus an offset that [`advance`](MemoryStore::advance)
/// moves, so tests can expire claims without sleeping.
///
/// ```
/// use dedup_core::{Claim, DedupKey, DedupStore, MemoryStore, Ttl};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let key = DedupKey::new("docs", "evt-1")?;
/// let ttl: Ttl = "1h".parse()?;
///
/// let mut tx = store.begin().await?;
/// assert_eq!(store.claim(&mut tx, &key, None, ttl).await?, Claim::Fresh);
/// store.commit(tx).await?;
///
/// let mut tx = store.begin().await?;
/// assert!(!store.claim(&mut tx, &key, None, ttl).await?.is_claimed());
/// store.rollback(tx).await?;
///
/// store.advance(ttl.as_duration());
/// let mut tx = store.begin().await?;
/// assert_eq!(store.claim(&mut tx, &key, None, ttl).await?, Claim::Reclaimed);
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    /// Woken whenever a transaction ends, so waiting claimers look again.
    released: Notify,
}

#[derive(Default)]
struct State {
    rows: HashMap<DedupKey, Row>,
    next_tx: u64,
    clock_offset: Duration,
    lock_timeout: Option<Duration>,
    /// The last lease token given.
    last_token: Token,
}

struct Row {
    claimed_at: SystemTime,
    expires_at: SystemTime,
    fingerprint: Option<Fingerprint>,
    /// Lease mode: the holder's token, and whether its effect is still in
    /// progress (`expires_at` is then the lease's end).
    token: Option<Token>,
    in_progress: bool,
    /// The transaction holding an uncommitted write to this row.
    writer: Option<u64>,
    /// The committed row the writer replaced, restored on rollback.
    before: Option<Committed>,
}

/// A committed claim's values, kept while a transaction takes it over.
#[derive(Clone, Copy)]
struct Committed {
    claimed_at: SystemTime,
    expires_at: SystemTime,
    fingerprint: Option<Fingerprint>,
    token: Option<Token>,
    in_progress: bool,
}

const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a claim waits for another transaction's uncommitted claim
    /// of the same key before failing with a retryable error.
    pub fn with_lock_timeout(self, timeout: Duration) -> Self {
        self.lock().lock_timeout = Some(timeout);
        self
    }

    /// Moves the store's clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.lock().clock_offset += by;
    }

    /// The store's clock.
    pub fn now(&self) -> SystemTime {
        SystemTime::now() + self.lock().clock_offset
    }

    /// Number of committed claims, live or expired.
    pub fn len(&self) -> usize {
        self.lock()
            .rows
            .values()
            .filter(|r| r.writer.is_none() || r.before.is_some())
            .count()
    }

    /// Whether the store holds no committed claim.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the map consistent (every
        // mutation is a single insert or remove), so poisoning is ignored.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn finish(&self, tx: &mut MemoryTx, commit: bool) {
        let mut state = self.lock();
        for key in tx.written.drain(..) {
            let Some(row) = state.rows.get_mut(&key) else {
                continue;
            };
            if row.writer != Some(tx.id) {
                continue;
            }
            match (commit, row.before) {
                (true, _) => {
                    row.writer = None;
                    row.before = None;
                }
                (false, Some(before)) => {
                    *row = Row {
                        claimed_at: before.claimed_at,
                        expires_at: before.expires_at,
                        fingerprint: before.fingerprint,
                        token: before.token,
                        in_progress: before.in_progress,
                        writer: None,
                        before: None,
                    };
                }
                (false, None) => {
                    state.rows.remove(&key);
                }
            }
        }
        drop(state);
        tx.open = false;
        self.inner.released.notify_waiters();
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("claims", &self.lock().rows.len())
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("timed out waiting for another transaction's claim on {0}")]
struct LockTimeout(DedupKey);

/// A [`MemoryStore`] transaction. Dropping it without commit rolls it back.
///
/// Handler bodies can stage in-memory effects with
/// [`on_commit`](MemoryTx::on_commit), which run only if the transaction
/// commits: the same all-or-nothing a database gives.
pub struct MemoryTx {
    id: u64,
    store: MemoryStore,
    written: Vec<DedupKey>,
    on_commit: Vec<Box<dyn FnOnce() + Send>>,
    open: bool,
}

impl MemoryTx {
    /// Runs `effect` when (and only if) this transaction commits.
    pub fn on_commit(&mut self, effect: impl FnOnce() + Send + 'static) {
        self.on_commit.push(Box::new(effect));
    }
}

impl fmt::Debug for MemoryTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTx")
            .field("id", &self.id)
            .field("claims", &self.written.len())
            .finish()
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        if self.open {
            let store = self.store.clone();
            store.finish(self, false);
        }
    }
}

impl DedupStore for MemoryStore {
    type Tx = MemoryTx;

    async fn begin(&self) -> Result<MemoryTx, StoreError> {
        let mut state = self.lock();
        state.next_tx += 1;
        Ok(MemoryTx {
            id: state.next_tx,
            store: self.clone(),
            written: Vec::new(),
            on_commit: Vec::new(),
            open: true,
        })
    }

    /// Claims `key` for `tx` or waits for the transaction holding it.
    async fn claim(
        &self,
        tx: &mut MemoryTx,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        ttl: Ttl,
    ) -> Result<Claim, StoreError> {
        let timeout = self.lock().lock_timeout.unwrap_or(DEFAULT_LOCK_TIMEOUT);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let released = self.inner.released.notified();
            tokio::pin!(released);
            {
                let mut state = self.lock();
                let now = SystemTime::now() + state.clock_offset;
                let fresh_row = |before| Row {
                    claimed_at: now,
                    expires_at: now + ttl.as_duration(),
                    fingerprint,
                    token: None,
                    in_progress: false,
                    writer: Some(tx.id),
                    before,
                };
                match state.rows.get_mut(key) {
                    None => {
                        state.rows.insert(key.clone(), fresh_row(None));
                        tx.written.push(key.clone());
                        return Ok(Claim::Fresh);
                    }
                    Some(row) if row.writer == Some(tx.id) || row.writer.is_none() => {
                        if row.expires_at > now {
                            return Ok(Claim::Duplicate {
                                expires_at: row.expires_at,
                                age: now.duration_since(row.claimed_at).unwrap_or_default(),
                                fingerprint: row.fingerprint,
                            });
                        }
                        let before = if row.writer.is_none() {
                            tx.written.push(key.clone());
                            Some(Committed {
                                claimed_at: row.claimed_at,
                                expires_at: row.expires_at,
                                fingerprint: row.fingerprint,
                                token: row.token,
                                in_progress: row.in_progress,
                            })
                        } else {
                            row.before
                        };
                        *row = fresh_row(before);
                        return Ok(Claim::Reclaimed);
                    }
                    Some(_) => {
                        // Held by another open transaction: register for its
                        // end before unlocking, so the wake-up cannot be missed.
                        released.as_mut().enable();
                    }
                }
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                return Err(
                    StoreError::contention(LockTimeout(key.clone())).with_code("lock_timeout")
                );
            }
        }
    }

    async fn claim_many(
        &self,
        tx: &mut MemoryTx,
        keys: &[DedupKey],
        fingerprints: &[Option<Fingerprint>],
        ttl: Ttl,
    ) -> Result<Vec<Claim>, StoreError> {
        // Within one transaction a repeated key meets its own fresh claim and
        // is a duplicate, exactly as the contract asks.
        let mut claims = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            let fingerprint = fingerprints.get(i).copied().flatten();
            claims.push(self.claim(tx, key, fingerprint, ttl).await?);
        }
        Ok(claims)
    }

    async fn refresh_claims(
        &self,
        tx: &mut MemoryTx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        let mut state = self.lock();
        let now = SystemTime::now() + state.clock_offset;
        for key in keys {
            if let Some(row) = state.rows.get_mut(key)
                && row.writer == Some(tx.id)
            {
                row.expires_at = now + ttl.as_duration();
            }
        }
        Ok(())
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        let state = self.lock();
        let now = SystemTime::now() + state.clock_offset;
        let mut ids: Vec<String> = state
            .rows
            .iter()
            .filter(|(key, _)| key.scope() == from.scope() && key.id() >= from.id())
            .filter_map(|(key, row)| {
                // What other transactions see: the committed version.
                let expires_at = match (row.writer, row.before) {
                    (None, _) => row.expires_at,
                    (Some(_), Some(before)) => before.expires_at,
                    (Some(_), None) => return None,
                };
                (expires_at > now).then(|| key.id().to_owned())
            })
            .collect();
        ids.sort_unstable();
        Ok(ids)
    }

    async fn commit(&self, mut tx: MemoryTx) -> Result<(), StoreError> {
        self.finish(&mut tx, true);
        for effect in tx.on_commit.drain(..) {
            effect();
        }
        Ok(())
    }

    async fn rollback(&self, mut tx: MemoryTx) -> Result<(), StoreError> {
        self.finish(&mut tx, false);
        Ok(())
    }
}

impl LeaseStore for MemoryStore {
    async fn acquire(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        lease: Ttl,
    ) -> Result<Acquire, StoreError> {
        let mut state = self.lock();
        let now = SystemTime::now() + state.clock_offset;
        let reclaimed = match state.rows.get(key) {
            None => false,
            Some(row) if row.writer.is_none() && row.expires_at <= now => true,
            // A transaction's uncommitted claim counts as held until it ends.
            Some(row) if row.writer.is_some() || row.in_progress => {
                return Ok(Acquire::Held {
                    expires_at: row.expires_at,
                    token: row.token.unwrap_or_default(),
                });
            }
            Some(row) => {
                return Ok(Acquire::Done {
                    expires_at: row.expires_at,
                    age: now.duration_since(row.claimed_at).unwrap_or_default(),
                    fingerprint: row.fingerprint,
                });
            }
        };
        state.last_token += 1;
        let token = state.last_token;
        state.rows.insert(
            key.clone(),
            Row {
                claimed_at: now,
                expires_at: now + lease.as_duration(),
                fingerprint,
                token: Some(token),
                in_progress: true,
                writer: None,
                before: None,
            },
        );
        Ok(Acquire::Acquired { token, reclaimed })
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: Token,
        lease: Ttl,
    ) -> Result<Option<SystemTime>, StoreError> {
        let mut state = self.lock();
        let now = SystemTime::now() + state.clock_offset;
        Ok(held_by(&mut state, key, token).map(|row| {
            row.expires_at = now + lease.as_duration();
            row.expires_at
        }))
    }

    async fn complete(&self, key: &DedupKey, token: Token, ttl: Ttl) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let now = SystemTime::now() + state.clock_offset;
        Ok(held_by(&mut state, key, token)
            .map(|row| {
                row.expires_at = now + ttl.as_duration();
                row.in_progress = false;
            })
            .is_some())
    }

    async fn release(&self, key: &DedupKey, token: Token) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let held = held_by(&mut state, key, token).is_some();
        if held {
            state.rows.remove(key);
        }
        Ok(held)
    }
}

/// `key`'s claim if it is a lease in progress under `token`.
fn held_by<'s>(state: &'s mut State, key: &DedupKey, token: Token) -> Option<&'s mut Row> {
    state
        .rows
        .get_mut(key)
        .filter(|row| row.writer.is_none() && row.in_progress && row.token == Some(token))
}

impl PurgeExpired for MemoryStore {
    async fn purge_expired(&self, limit: u32) -> Result<u64, StoreError> {
        let mut state = self.lock();
        let now = SystemTime::now() + state.clock_offset;
        let expired: Vec<DedupKey> = state
            .rows
            .iter()
            // An expired lease in progress stays: its holder may still
            // complete it.
            .filter(|(_, row)| row.writer.is_none() && !row.in_progress && row.expires_at <= now)
            .map(|(key, _)| key.clone())
            .take(limit as usize)
            .collect();
        for key in &expired {
            state.rows.remove(key);
        }
        Ok(expired.len() as u64)
    }
}
