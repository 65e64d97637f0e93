//! What `#[idempotent]` generates and the runtime calls.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use crate::{Claim, DedupKey, DedupStore, Error, Fingerprint, HandlerError, KeyError, Meta, Ttl};

/// Read access to a message's headers, so keys can come from a header.
pub trait Headers {
    /// The value of the header `name`; the last one if it repeats.
    fn get(&self, name: &str) -> Option<&[u8]>;

    /// The whole record's metadata, where there is a record: the runtime
    /// passes a [`Meta`], which handlers that take `meta: &Meta` keep. `None`
    /// (the default) for bare headers, such as `&()` in a test.
    fn meta(&self) -> Option<&Meta> {
        None
    }
}

impl Headers for () {
    fn get(&self, _: &str) -> Option<&[u8]> {
        None
    }
}

impl<K: AsRef<str>, V: AsRef<[u8]>> Headers for [(K, V)] {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .rev()
            .find(|(k, _)| k.as_ref() == name)
            .map(|(_, v)| v.as_ref())
    }
}

impl<K: AsRef<str>, V: AsRef<[u8]>> Headers for Vec<(K, V)> {
    fn get(&self, name: &str) -> Option<&[u8]> {
        Headers::get(self.as_slice(), name)
    }
}

/// How one event ended.
#[derive(Debug)]
#[must_use]
pub enum Outcome {
    /// The claim was taken and the handler's effect committed with it.
    Applied {
        /// `true` when an expired claim was taken over (a redelivery after
        /// the TTL, applied again by design).
        reclaimed: bool,
    },
    /// A live claim existed: the event was applied before, within the TTL,
    /// and nothing was done.
    Skipped {
        /// When the existing claim expires.
        expires_at: SystemTime,
        /// How long after the claim was taken this duplicate came (store
        /// clock).
        age: Duration,
    },
    /// Nothing was committed; [`Error::is_retryable`] says whether to retry
    /// or dead-letter.
    Failed(Error),
}

impl Outcome {
    /// A short stable name (`applied`, `skipped`, `failed`) for logs and
    /// metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Applied { .. } => "applied",
            Outcome::Skipped { .. } => "skipped",
            Outcome::Failed(_) => "failed",
        }
    }
}

/// What an idempotent handler says of its events, whatever its effect:
/// the event type, the scope and TTL of its claims, and how a payload
/// becomes an event, its key and its fingerprint. `#[idempotent]` generates
/// it; the effect traits build on it: [`Handler`] (the body writes through
/// a transaction: the store's, or a Kafka transaction's [`Outputs`]) and
/// [`LeaseHandler`](crate::LeaseHandler) (the body runs under a lease).
///
/// [`Outputs`]: https://docs.rs/dedup-kafka/latest/dedup_kafka/struct.Outputs.html
pub trait Describe: Send + Sync + 'static {
    /// The decoded event: whatever [`decode`](Describe::decode) makes of a
    /// payload.
    type Event: Send + 'static;

    /// Which handler claims: two handlers of one event never share claims.
    fn scope(&self) -> &str;

    /// How long a claim lives.
    fn ttl(&self) -> Ttl;

    /// Extracts the event id from the decoded event or the headers.
    fn key(&self, event: &Self::Event, headers: &dyn Headers) -> Result<String, KeyError>;

    /// What the claim remembers of the event's content
    /// (`#[idempotent(fingerprint)]`): a duplicate whose fingerprint differs
    /// from its claim's is a reused id, not skipped but failed with
    /// [`Error::FingerprintMismatch`]. `None` (the default): no check.
    fn fingerprint(&self, event: &Self::Event, payload: &[u8]) -> Option<Fingerprint> {
        let _ = (event, payload);
        None
    }

    /// Decodes a payload into the event; a payload it refuses is
    /// [`Error::Decode`], the event's own fault (dead-lettered, never
    /// retried). `#[idempotent]` generates it from its `format` (JSON by
    /// default: [`decode::json`](crate::decode::json)) or `decode` option; a
    /// hand-written handler writes
    /// `fn decode(&self, p: &[u8]) -> Result<Self::Event, Error> { dedup_core::decode::json(p) }`.
    /// It runs synchronously on the consumer's worker: it must not block or
    /// depend on the environment.
    fn decode(&self, payload: &[u8]) -> Result<Self::Event, Error>;

    /// Decodes a message: its payload, with what the runtime knows of its
    /// record (its headers, and its [`Meta`] through
    /// [`Headers::meta`]). What the runtime calls. By default
    /// [`decode`](Describe::decode) of the payload; a handler that takes
    /// `meta: &Meta` keeps the record's metadata with its event. A wrapper
    /// of another handler forwards it.
    fn decode_record(&self, payload: &[u8], headers: &dyn Headers) -> Result<Self::Event, Error> {
        let _ = headers;
        self.decode(payload)
    }

    /// What decoding needs fetched first, if anything (a schema registry's
    /// writer's schemas: see [`Prepare`](crate::decode::Prepare)). `None`
    /// (the default): payloads decode as they are. A wrapper of another
    /// handler forwards it.
    fn preparer(&self) -> Option<&dyn crate::decode::Prepare> {
        None
    }
}

/// What every handler's description gives, the same for all of them:
/// implemented for every [`Describe`] and never by hand (the blanket
/// implementation forbids it), so no handler can change which key an event
/// claims.
pub trait DescribeExt: Describe {
    /// The full dedup key of an event: its [`scope`](Describe::scope) plus
    /// [`key`](Describe::key).
    fn dedup_key(&self, event: &Self::Event, headers: &dyn Headers) -> Result<DedupKey, KeyError> {
        DedupKey::new(self.scope(), self.key(event, headers)?)
    }

    /// Decodes a message and takes what its claim needs: the dedup key and
    /// the [`fingerprint`](Describe::fingerprint). The first step of every
    /// effect (a transaction's, a lease's, a Kafka transaction's), and how a
    /// batch's events are made.
    #[allow(clippy::type_complexity)]
    fn prepare(
        &self,
        payload: &[u8],
        headers: &dyn Headers,
    ) -> Result<(DedupKey, Option<Fingerprint>, Self::Event), Error> {
        let event = self.decode_record(payload, headers)?;
        let key = self.dedup_key(&event, headers)?;
        let fingerprint = self.fingerprint(&event, payload);
        Ok((key, fingerprint, event))
    }
}

impl<D: Describe + ?Sized> DescribeExt for D {}

/// An idempotent event handler whose effect is written through a
/// transaction: usually generated by `#[idempotent]`.
///
/// On top of what it [describes](Describe) of its events, it has the body;
/// [`HandlerExt`] builds the claim -> apply -> commit protocol from these
/// parts.
pub trait Handler: Describe {
    /// The transaction type the body writes through: the store's
    /// [`DedupStore::Tx`].
    type Tx: Send + 'static;

    /// The handler body: writes the effect through `tx`. It must not commit.
    fn handle(
        &self,
        tx: &mut Self::Tx,
        event: Self::Event,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Whether [`handle_batch`](Handler::handle_batch) is the body for a
    /// batch (`true`, the default), or the batch may as well be run as one
    /// [`handle`](Handler::handle) per event, in order (`false`, what
    /// `#[idempotent]` says of a handler without `batch`). A runtime that
    /// runs each event in its own context (a trace span) does so only for a
    /// handler that says `false`; any other gets its `handle_batch` called,
    /// as always. A wrapper forwards it.
    fn takes_batches(&self) -> bool {
        true
    }

    /// The body for several claimed events of one batch, in partition order,
    /// inside one transaction. By default one [`handle`](Handler::handle)
    /// per event; handlers declared with `#[idempotent(batch, ...)]` receive
    /// them all at once and can write them with one statement.
    fn handle_batch(
        &self,
        tx: &mut Self::Tx,
        events: Vec<Self::Event>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        async move {
            for event in events {
                self.handle(tx, event).await?;
            }
            Ok(())
        }
    }
}

/// The claim -> apply -> commit protocol, built from a [`Handler`]'s parts and
/// the same for every handler: implemented for every `Handler` and never by
/// hand (the blanket implementation forbids it), so no handler can change
/// what "applied once" means. The runtime calls these; tests may too.
pub trait HandlerExt: Handler {
    /// This handler with another TTL, chosen at run time (from config or an
    /// environment variable) instead of the macro's.
    ///
    /// ```
    /// # use dedup_core::{Describe, HandlerError, HandlerExt, MemoryTx, Ttl, idempotent};
    /// # #[derive(serde::Deserialize)] struct Ev { event_id: String }
    /// #[idempotent(key = "event_id", ttl = "4h")]
    /// async fn handle(_tx: &mut MemoryTx, _ev: Ev) -> Result<(), HandlerError> { Ok(()) }
    ///
    /// let ttl: Ttl = std::env::var("DEDUP_TTL").as_deref().unwrap_or("1d").parse()?;
    /// assert_eq!(handle.with_ttl(ttl).ttl().to_string(), "1d");
    /// # Ok::<(), dedup_core::TtlError>(())
    /// ```
    fn with_ttl(self, ttl: Ttl) -> WithTtl<Self>
    where
        Self: Sized,
    {
        WithTtl { inner: self, ttl }
    }

    /// Processes one message: decode -> key -> begin -> claim -> body ->
    /// commit.
    ///
    /// A duplicate is rolled back untouched and reported as
    /// [`Outcome::Skipped`]; a body error rolls back both the claim and the
    /// effect, so the next attempt starts clean. The outcome is final only
    /// once this returns: a commit that fails reports `Failed` with a
    /// retryable error, and a retry of an event whose commit did reach the
    /// database finds its claim and is skipped.
    fn apply<S>(
        &self,
        store: &S,
        payload: &[u8],
        headers: &(dyn Headers + Sync),
    ) -> impl Future<Output = Outcome> + Send
    where
        S: DedupStore<Tx = Self::Tx>,
    {
        async move {
            let (key, fingerprint, event) = match self.prepare(payload, headers) {
                Ok(ok) => ok,
                Err(e) => return Outcome::Failed(e),
            };
            match claim_and_run(self, store, &key, fingerprint, event).await {
                Ok(outcome) => outcome,
                Err(e) => Outcome::Failed(e),
            }
        }
    }
    /// Applies a batch of decoded events in ONE transaction: one
    /// [`claim_many`](DedupStore::claim_many) for all their keys,
    /// the body for each claimed event in order, one commit.
    ///
    /// Each event comes with its key and its
    /// [`fingerprint`](Describe::fingerprint).
    ///
    /// Returns one outcome per event: `Applied`, `Skipped` (the same key
    /// twice in a batch is applied once), or `Failed` with
    /// [`Error::FingerprintMismatch`] for a duplicate whose content differs
    /// from its claim's (neither applied nor skipped: the caller
    /// dead-letters it; the rest of the batch commits). If any body fails,
    /// or the store does, the whole batch is rolled back and the error
    /// returned: nothing of it was applied, and the caller replays it
    /// message by message so a poison message is isolated and everything
    /// else still applies once.
    fn apply_batch<S>(
        &self,
        store: &S,
        batch: Vec<(DedupKey, Option<Fingerprint>, Self::Event)>,
    ) -> impl Future<Output = Result<Vec<Outcome>, Error>> + Send
    where
        S: DedupStore<Tx = Self::Tx>,
    {
        async move {
            if batch.is_empty() {
                return Ok(Vec::new());
            }
            let mut keys = Vec::with_capacity(batch.len());
            let mut fingerprints = Vec::with_capacity(batch.len());
            let mut events = Vec::with_capacity(batch.len());
            for (key, fingerprint, event) in batch {
                keys.push(key);
                fingerprints.push(fingerprint);
                events.push(event);
            }
            let started = Instant::now();
            let mut tx = store.begin().await?;
            let claims = match store
                .claim_many(&mut tx, &keys, &fingerprints, self.ttl())
                .await
            {
                Ok(claims) => claims,
                Err(e) => {
                    rollback_quietly(store, tx, &keys[0]).await;
                    return Err(e.into());
                }
            };
            let mut outcomes = Vec::with_capacity(claims.len());
            let mut fresh = Vec::with_capacity(claims.len());
            let mut claimed = Vec::with_capacity(claims.len());
            for (i, (claim, event)) in claims.into_iter().zip(events).enumerate() {
                let key = &keys[i];
                match claim {
                    Claim::Duplicate {
                        expires_at,
                        age,
                        fingerprint: claimed,
                    } => outcomes.push(
                        match mismatch(key, claimed, fingerprints.get(i).copied().flatten()) {
                            Some(e) => Outcome::Failed(e),
                            None => Outcome::Skipped { expires_at, age },
                        },
                    ),
                    Claim::Fresh | Claim::Reclaimed => {
                        outcomes.push(Outcome::Applied {
                            reclaimed: claim == Claim::Reclaimed,
                        });
                        fresh.push(event);
                        claimed.push(key.clone());
                    }
                }
            }
            if !fresh.is_empty()
                && let Err(e) = self.handle_batch(&mut tx, fresh).await
            {
                tracing::debug!(first_key = %keys[0], "a handler failed inside a batch; rolling the batch back");
                rollback_quietly(store, tx, &keys[0]).await;
                return Err(e.into_error(store));
            }
            commit_claims(store, tx, &claimed, self.ttl(), started).await?;
            Ok(outcomes)
        }
    }
}

impl<H: Handler + ?Sized> HandlerExt for H {}

async fn claim_and_run<H, S>(
    handler: &H,
    store: &S,
    key: &DedupKey,
    fingerprint: Option<Fingerprint>,
    event: H::Event,
) -> Result<Outcome, Error>
where
    H: Handler + ?Sized,
    S: DedupStore<Tx = H::Tx>,
{
    tracing::Span::current().record("dedup.key", tracing::field::display(key));
    let started = Instant::now();
    let mut tx = store.begin().await?;
    let claim = match store.claim(&mut tx, key, fingerprint, handler.ttl()).await {
        Ok(claim) => claim,
        Err(e) => {
            rollback_quietly(store, tx, key).await;
            return Err(e.into());
        }
    };
    let reclaimed = match claim {
        Claim::Duplicate {
            expires_at,
            age,
            fingerprint: claimed,
        } => {
            rollback_quietly(store, tx, key).await;
            if let Some(e) = mismatch(key, claimed, fingerprint) {
                return Err(e);
            }
            tracing::debug!(%key, ?age, "duplicate within TTL, skipped");
            return Ok(Outcome::Skipped { expires_at, age });
        }
        Claim::Fresh => false,
        Claim::Reclaimed => true,
    };
    if let Err(e) = handler.handle(&mut tx, event).await {
        rollback_quietly(store, tx, key).await;
        return Err(e.into_error(store));
    }
    commit_claims(store, tx, std::slice::from_ref(key), handler.ttl(), started).await?;
    Ok(Outcome::Applied { reclaimed })
}

/// A duplicate's fingerprint against its claim's: a mismatch when both
/// have one and they differ. A claim taken without one (before the handler
/// kept fingerprints, or by a handler that keeps none) matches any event.
pub(crate) fn mismatch(
    key: &DedupKey,
    claimed: Option<Fingerprint>,
    given: Option<Fingerprint>,
) -> Option<Error> {
    match (claimed, given) {
        (Some(claimed), Some(given)) if claimed != given => Some(Error::FingerprintMismatch {
            key: key.clone(),
            claimed,
            given,
        }),
        _ => None,
    }
}

/// Commits `tx`. If it ran for half its TTL or more since it began (a slow
/// handler, a long batch), its claims' TTL restarts first, on the store's
/// clock: a claim counted from the start of the transaction could commit
/// already expired, and the next duplicate would be applied again. (Under
/// half the TTL, the claims commit with at least half of it left.)
async fn commit_claims<S: DedupStore>(
    store: &S,
    mut tx: S::Tx,
    claimed: &[DedupKey],
    ttl: Ttl,
    started: Instant,
) -> Result<(), Error> {
    if !claimed.is_empty() && started.elapsed() >= ttl.as_duration() / 2 {
        tracing::debug!(elapsed = ?started.elapsed(), %ttl, "a long transaction: restarting its claims' TTL");
        if let Err(e) = store.refresh_claims(&mut tx, claimed, ttl).await {
            rollback_quietly(store, tx, &claimed[0]).await;
            return Err(e.into());
        }
    }
    store.commit(tx).await?;
    Ok(())
}

/// Rolls back after a failure that is already being reported. A failed
/// rollback releases the claim all the same (the database discards the
/// transaction when its connection is dropped), so it is logged, not raised.
async fn rollback_quietly<S: DedupStore>(store: &S, tx: S::Tx, key: &DedupKey) {
    if let Err(e) = store.rollback(tx).await {
        tracing::warn!(%key, error = %e, "rollback failed");
    }
}

/// A handler with its TTL replaced; see [`HandlerExt::with_ttl`].
#[derive(Debug, Clone, Copy)]
pub struct WithTtl<H> {
    inner: H,
    ttl: Ttl,
}

impl<H: Handler> Describe for WithTtl<H> {
    type Event = H::Event;

    fn scope(&self) -> &str {
        self.inner.scope()
    }

    fn ttl(&self) -> Ttl {
        self.ttl
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

impl<H: Handler> Handler for WithTtl<H> {
    type Tx = H::Tx;

    fn takes_batches(&self) -> bool {
        self.inner.takes_batches()
    }

    fn handle(
        &self,
        tx: &mut Self::Tx,
        event: Self::Event,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        self.inner.handle(tx, event)
    }

    fn handle_batch(
        &self,
        tx: &mut Self::Tx,
        events: Vec<Self::Event>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        self.inner.handle_batch(tx, events)
    }
}
