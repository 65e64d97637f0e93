//! How the kit delivers a pattern: each event's attempts through a store
//! that can crash between a transaction's body and its commit, under a
//! scope of the pattern's own.

use std::error::Error as StdError;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{
    Classification, DedupKey, DedupStore, Describe, DescribeExt as _, Error, Fingerprint, Handler,
    HandlerError, HandlerExt, Headers, KeyError, Outcome, StoreError, Ttl,
};

use super::{Delivery, Failure, Pattern, all};

/// How many times an event whose attempts fail with a retryable error is
/// tried before the kit gives up on it.
pub(super) const ATTEMPTS: usize = 20;

pub(super) struct Kit<'a, S> {
    pub(super) store: CrashingStore<S>,
    pub(super) events: &'a [Delivery],
    /// The events [`Pattern::Once`] dead-lettered, with why.
    pub(super) dead_letters: Mutex<Vec<(usize, String)>>,
}

impl<S: DedupStore> Kit<'_, S> {
    pub(super) async fn deliver<H>(&self, handler: &H, pattern: Pattern) -> Result<(), KeptFailing>
    where
        H: Handler<Tx = S::Tx>,
    {
        let n = self.events.len();
        let half = n / 2;
        let all = all(n);
        match pattern {
            Pattern::Once => self.each(handler, pattern, &all, false).await.map(drop),
            Pattern::AgainInOrder => {
                self.each(handler, pattern, &all, false).await?;
                self.each(handler, pattern, &all, false).await.map(drop)
            }
            Pattern::Interleaved => {
                self.each(handler, pattern, &all[..half], false).await?;
                let mut order = Vec::with_capacity(n + half);
                let mut redeliveries = all[..half].iter();
                for &i in &all[half..] {
                    order.extend(redeliveries.next());
                    order.push(i);
                }
                order.extend(redeliveries);
                self.each(handler, pattern, &order, false).await.map(drop)
            }
            Pattern::Concurrently => {
                let (a, b) = tokio::join!(
                    self.each(handler, pattern, &all, false),
                    self.each(handler, pattern, &all, false)
                );
                a.and(b).map(drop)
            }
            Pattern::CrashBeforeCommit => self.each(handler, pattern, &all, true).await.map(drop),
            Pattern::CrashAfterCommit => {
                self.each(handler, pattern, &all, false).await?;
                self.each(handler, pattern, &all[half..], false)
                    .await
                    .map(drop)
            }
            Pattern::Batch => {
                let twice: Vec<usize> = all.iter().flat_map(|&i| [i, i]).collect();
                self.batch(handler, pattern, &twice).await?;
                self.batch(handler, pattern, &all).await
            }
            Pattern::AfterTtl => unreachable!("delivered by check_idempotent itself"),
        }
    }

    /// Delivers `order` one message at a time, retrying what fails with a
    /// retryable error as the runtime would. With `crash`, each event's
    /// first commit becomes a rollback.
    pub(super) async fn each<H>(
        &self,
        handler: &H,
        pattern: Pattern,
        order: &[usize],
        crash: bool,
    ) -> Result<Vec<usize>, KeptFailing>
    where
        H: Handler<Tx = S::Tx>,
    {
        let mut skipped = Vec::new();
        for &i in order {
            let event = &self.events[i];
            if crash {
                *self.store.crash_next_commit.lock().expect("lock") = true;
            }
            let mut attempt = 0;
            loop {
                attempt += 1;
                let outcome = handler
                    .apply(&self.store, &event.payload, &event.record(i))
                    .await;
                match outcome {
                    Outcome::Failed(error) if error.is_retryable() => {
                        if attempt >= ATTEMPTS {
                            return Err(KeptFailing {
                                pattern,
                                event: i,
                                error,
                            });
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    // The event's own fault: the runtime dead-letters it.
                    Outcome::Failed(error) => {
                        if pattern == Pattern::Once {
                            let mut dead = self.dead_letters.lock().expect("lock");
                            dead.push((i, error.to_string()));
                        }
                        break;
                    }
                    Outcome::Applied { .. } => break,
                    Outcome::Skipped { .. } => {
                        skipped.push(i);
                        break;
                    }
                }
            }
            *self.store.crash_next_commit.lock().expect("lock") = false;
        }
        Ok(skipped)
    }

    /// Delivers `order` as one batch transaction, as the batched runtime
    /// does; if the batch fails, message by message, as the runtime replays
    /// it.
    pub(super) async fn batch<H>(
        &self,
        handler: &H,
        pattern: Pattern,
        order: &[usize],
    ) -> Result<(), KeptFailing>
    where
        H: Handler<Tx = S::Tx>,
    {
        let mut batch = Vec::with_capacity(order.len());
        let mut prepared = Vec::with_capacity(order.len());
        for &i in order {
            let event = &self.events[i];
            // An event that does not decode or has no key never enters a
            // batch: the runtime dead-letters it before.
            if let Ok(ready) = handler.prepare(&event.payload, &event.record(i)) {
                batch.push(ready);
                prepared.push(i);
            }
        }
        if handler.apply_batch(&self.store, batch).await.is_err() {
            return self
                .each(handler, pattern, &prepared, false)
                .await
                .map(drop);
        }
        Ok(())
    }
}

/// An event that kept failing: [`Failure::KeptFailing`] before a snapshot
/// type is in sight.
pub(super) struct KeptFailing {
    pub(super) pattern: Pattern,
    pub(super) event: usize,
    pub(super) error: Error,
}

impl<T> From<KeptFailing> for Failure<T> {
    fn from(
        KeptFailing {
            pattern,
            event,
            error,
        }: KeptFailing,
    ) -> Self {
        Failure::KeptFailing {
            pattern,
            event,
            error,
        }
    }
}

/// The user's store, whose next commit can be turned into a rollback: a
/// process that died after the handler's body, before the database commit.
#[derive(Clone)]
pub(super) struct CrashingStore<S> {
    pub(super) inner: S,
    pub(super) crash_next_commit: Arc<Mutex<bool>>,
}

/// What a crashed commit reports: the runtime retries it as the
/// environment's fault, as it would after a restart.
#[derive(Debug)]
pub(super) struct SimulatedCrash;

impl fmt::Display for SimulatedCrash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the test kit rolled the transaction back: a crash before the commit")
    }
}

impl StdError for SimulatedCrash {}

impl<S: DedupStore> DedupStore for CrashingStore<S> {
    type Tx = S::Tx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.inner.begin().await
    }

    async fn claim(
        &self,
        tx: &mut Self::Tx,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        ttl: Ttl,
    ) -> Result<crate::Claim, StoreError> {
        self.inner.claim(tx, key, fingerprint, ttl).await
    }

    async fn claim_many(
        &self,
        tx: &mut Self::Tx,
        keys: &[DedupKey],
        fingerprints: &[Option<Fingerprint>],
        ttl: Ttl,
    ) -> Result<Vec<crate::Claim>, StoreError> {
        self.inner.claim_many(tx, keys, fingerprints, ttl).await
    }

    async fn refresh_claims(
        &self,
        tx: &mut Self::Tx,
        keys: &[DedupKey],
        ttl: Ttl,
    ) -> Result<(), StoreError> {
        self.inner.refresh_claims(tx, keys, ttl).await
    }

    async fn live_ids_from(&self, from: &DedupKey) -> Result<Vec<String>, StoreError> {
        self.inner.live_ids_from(from).await
    }

    fn connections(&self) -> Option<usize> {
        self.inner.connections()
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        let crash = std::mem::take(&mut *self.crash_next_commit.lock().expect("lock"));
        if crash {
            self.inner.rollback(tx).await?;
            return Err(StoreError::environment(SimulatedCrash));
        }
        self.inner.commit(tx).await
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Classification {
        self.inner.classify(error)
    }

    fn error_code(&self, error: &(dyn StdError + 'static)) -> Option<String> {
        self.inner.error_code(error)
    }
}

/// The user's handler claiming in a scope of the run's and pattern's own,
/// optionally with another TTL.
pub(super) struct Scoped<H> {
    pub(super) inner: H,
    pub(super) scope: String,
    pub(super) ttl: Option<Ttl>,
}

impl<H: Handler + Clone> Scoped<H> {
    pub(super) fn new(inner: &H, run: &str, pattern: &str, ttl: Option<Ttl>) -> Self {
        Scoped {
            scope: format!("{}#test/{run}/{pattern}", inner.scope()),
            inner: inner.clone(),
            ttl,
        }
    }
}

impl<H: Handler> Describe for Scoped<H> {
    type Event = H::Event;

    fn scope(&self) -> &str {
        &self.scope
    }

    fn ttl(&self) -> Ttl {
        self.ttl.unwrap_or_else(|| self.inner.ttl())
    }

    fn key(&self, event: &Self::Event, headers: &dyn Headers) -> Result<String, KeyError> {
        self.inner.key(event, headers)
    }

    fn fingerprint(&self, event: &Self::Event, payload: &[u8]) -> Option<Fingerprint> {
        self.inner.fingerprint(event, payload)
    }

    fn decode(&self, payload: &[u8]) -> Result<Self::Event, Error> {
        self.inner.decode(payload)
    }

    fn decode_record(&self, payload: &[u8], headers: &dyn Headers) -> Result<Self::Event, Error> {
        self.inner.decode_record(payload, headers)
    }

    fn preparer(&self) -> Option<&dyn crate::decode::Prepare> {
        self.inner.preparer()
    }
}

impl<H: Handler> Handler for Scoped<H> {
    type Tx = H::Tx;

    fn takes_batches(&self) -> bool {
        self.inner.takes_batches()
    }

    async fn handle(&self, tx: &mut Self::Tx, event: Self::Event) -> Result<(), HandlerError> {
        self.inner.handle(tx, event).await
    }

    async fn handle_batch(
        &self,
        tx: &mut Self::Tx,
        events: Vec<Self::Event>,
    ) -> Result<(), HandlerError> {
        self.inner.handle_batch(tx, events).await
    }
}
