//! Errors, each of which knows whether retrying can help.

use std::error::Error as StdError;
use std::fmt;

use crate::{DedupKey, Fingerprint, KeyError};

/// A boxed error from a backend or a handler body.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// `Result` with dedup's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why one event could not be finished.
///
/// [`classification`](Error::classification) tells the runtime what to do
/// with it: dead-letter the event at once (its own fault), retry it a
/// bounded number of times (transient), retry it as long as another
/// transaction holds what it needs (contention), or wait the environment
/// out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The payload is not a valid encoding of the handler's event type.
    #[error("cannot decode the event: {0}")]
    Decode(#[source] BoxError),
    /// The event has no usable dedup key.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The dedup store failed (begin, claim, commit or rollback).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A duplicate whose content differs from its claim's: the producer
    /// reused the id of another event (`#[idempotent(fingerprint)]`). The
    /// event's fault: neither applied nor skipped silently.
    // The fingerprints stay out of the message: a fingerprint of a few
    // chosen fields (an amount) can be guessed back from it.
    #[error("event id {key} was claimed by an event with other content: the producer reused an id")]
    FingerprintMismatch {
        /// The claim.
        key: DedupKey,
        /// The fingerprint the claim keeps.
        claimed: Fingerprint,
        /// This event's.
        given: Fingerprint,
    },
    /// Lease mode: another holder's lease on the event is live, so its
    /// effect may be under way. Retry after `expires_at`: by then the claim
    /// is done (a duplicate) or expired (taken over). Never the event's
    /// fault: never dead-lettered for it.
    #[error("the lease on {key} is held by token {token}: waiting for it to complete or expire")]
    LeaseHeld {
        /// The claim.
        key: DedupKey,
        /// When the lease ends unless its holder extends it (store clock).
        expires_at: std::time::SystemTime,
        /// The holder's token.
        token: crate::Token,
    },
    /// Lease mode: the body finished, but a newer holder had taken the
    /// claim over (the lease expired first), so this completion was
    /// refused; the newer holder finishes the event.
    #[error("the lease on {key} (token {token}) was taken over before its effect completed")]
    LeaseLost {
        /// The claim.
        key: DedupKey,
        /// This holder's token.
        token: crate::Token,
    },
    /// The topic carries several event types, each routed to its own
    /// handler, and this event's type has none (or the event says none):
    /// the event's fault, dead-lettered unless the consumer is told to skip
    /// other types.
    #[error("no handler for event type {} on topic {topic:?}{}", event_type.as_deref().map_or_else(|| "(none given)".to_owned(), |t| format!("{t:?}")), if known.is_empty() { String::new() } else { format!(" (handled: {})", known.join(", ")) })]
    Unrouted {
        /// The topic.
        topic: String,
        /// The event's type as the message gives it, if it gives one.
        event_type: Option<String>,
        /// The types the topic's handlers take.
        known: Vec<String>,
    },
    /// The handler body returned an error; the transaction was rolled back.
    #[error("handler failed{}: {source}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Handler {
        /// How the handler or, failing that, the store classified the error
        /// (never [`Classification::Unknown`]: unknown counts as permanent).
        classification: Classification,
        /// The store's code for the error (a SQLSTATE, say), if it has one.
        code: Option<String>,
        /// The handler's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Whose fault the failure is. Decode and key errors are the event's
    /// ([`Permanent`](Classification::Permanent)); store errors as the
    /// backend classified them from their codes; handler errors as the
    /// handler or the store said.
    pub fn classification(&self) -> Classification {
        match self {
            Error::Decode(_)
            | Error::Key(_)
            | Error::FingerprintMismatch { .. }
            | Error::Unrouted { .. } => Classification::Permanent,
            // Retried by a runtime that knows leases until the holder is
            // done; a lost lease is no failure of the event at all.
            Error::LeaseHeld { .. } | Error::LeaseLost { .. } => Classification::Transient,
            Error::Store(e) => e.classification(),
            Error::Handler { classification, .. } => *classification,
        }
    }

    /// Whether running the same event again may succeed: transient
    /// failures, contention and the environment's failures.
    pub fn is_retryable(&self) -> bool {
        self.classification().is_retryable()
    }

    /// A short stable name for the kind of failure (`decode`, `key`,
    /// `fingerprint_mismatch`, `store`, `handler`), for metrics labels and
    /// dead-letter headers.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Decode(_) => "decode",
            Error::Key(_) => "key",
            Error::FingerprintMismatch { .. } => "fingerprint_mismatch",
            Error::LeaseHeld { .. } => "lease_held",
            Error::LeaseLost { .. } => "lease_lost",
            Error::Store(_) => "store",
            Error::Unrouted { .. } => "unrouted",
            Error::Handler { .. } => "handler",
        }
    }
}

/// A failure of the dedup store, classified by the backend from error codes
/// (never from message text).
#[derive(Debug, thiserror::Error)]
#[error("dedup store error{}: {source}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
pub struct StoreError {
    classification: Classification,
    code: Option<String>,
    #[source]
    source: BoxError,
}

impl StoreError {
    /// An error that a retry may get past: retried a bounded number of
    /// times, then dead-lettered.
    pub fn transient(source: impl Into<BoxError>) -> Self {
        Self::classified(Classification::Transient, source)
    }

    /// Contention with another transaction (a deadlock, a serialization
    /// failure, a lock timeout): retried as long as it lasts, never
    /// dead-lettered for it.
    pub fn contention(source: impl Into<BoxError>) -> Self {
        Self::classified(Classification::Contention, source)
    }

    /// An error of the store's environment (unreachable, read-only, full,
    /// timing out, a permission or a table missing): not the event's fault,
    /// waited out however long it lasts.
    pub fn environment(source: impl Into<BoxError>) -> Self {
        Self::classified(Classification::Environment, source)
    }

    /// An error that every attempt at this event will meet (its data was
    /// rejected).
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self::classified(Classification::Permanent, source)
    }

    /// An error of the given classification ([`Unknown`](Classification::Unknown)
    /// counts as permanent).
    pub fn classified(classification: Classification, source: impl Into<BoxError>) -> Self {
        StoreError {
            classification: classification.or_else(|| Classification::Permanent),
            code: None,
            source: source.into(),
        }
    }

    /// Attaches the backend's error code (a SQLSTATE, say) for logs.
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// Whose fault the failure is.
    pub fn classification(&self) -> Classification {
        self.classification
    }

    /// Whether a retry may succeed.
    pub fn is_retryable(&self) -> bool {
        self.classification.is_retryable()
    }

    /// The backend's error code, if it gave one.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }
}

/// Whose fault a failure is, which decides what the runtime does with the
/// event: dead-letter it at once, retry it a bounded number of times, or
/// wait the environment out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Classification {
    /// The event's own fault: it cannot be decoded, has no key, the handler
    /// said so, or the database rejected its data (a data exception, an
    /// integrity violation). Every attempt fails the same way: dead-letter.
    Permanent,
    /// A failure the handler called transient, or a store error no rule
    /// knows to be contention or the environment's: a later attempt may
    /// succeed (a downstream timeout). Retried a bounded number of times,
    /// then dead-lettered.
    Transient,
    /// Contention with another transaction: a serialization failure, a
    /// deadlock, a lock timeout on a row (a claim) another transaction
    /// holds: another consumer, a handover, or an abandoned attempt of our
    /// own whose backend has not yet noticed. The holder will commit or
    /// roll back, so it is retried with capped back-off for as long as it
    /// lasts, and a good event is never dead-lettered for it.
    Contention,
    /// The environment's fault, never the event's: the database or broker is
    /// unreachable, read-only, full, timing out, or a permission or table is
    /// missing. The partition waits, retrying without limit, until it
    /// answers; the event is never dead-lettered for it.
    Environment,
    /// Not classified here: whoever judges next decides (the store, from the
    /// error's codes; in the end, permanent).
    Unknown,
}

impl Classification {
    /// `self`, or `next()` when `self` is [`Unknown`](Self::Unknown).
    pub fn or_else(self, next: impl FnOnce() -> Classification) -> Classification {
        match self {
            Classification::Unknown => next(),
            known => known,
        }
    }

    /// Whether a retry may succeed: transient failures, contention and the
    /// environment's failures.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Classification::Transient | Classification::Contention | Classification::Environment
        )
    }
}

/// The error type of handler bodies: `?` converts any error into it, and the
/// handler may say whether a retry can help.
///
/// Errors converted with `?` are *unclassified*: when the runtime applies the
/// handler, the store classifies them by their codes (the database rejected
/// the event's data: permanent; contention: transient; a database that is
/// unreachable, read-only, full or refusing: the environment's, waited
/// out); anything the store does not recognise is permanent. Say so
/// explicitly with [`HandlerError::transient`] or
/// [`HandlerError::permanent`] when you know better.
///
/// ```
/// use dedup_core::HandlerError;
///
/// fn parse_amount(s: &str) -> Result<i64, HandlerError> {
///     let n: i64 = s.parse()?; // unclassified: permanent unless the store knows it
///     if n < 0 {
///         return Err(HandlerError::permanent(format!("negative amount {n}")));
///     }
///     Ok(n)
/// }
/// use dedup_core::Classification;
/// assert!(parse_amount("12").is_ok());
/// assert_eq!(parse_amount("-1").unwrap_err().classification(), Classification::Permanent);
/// assert_eq!(parse_amount("x").unwrap_err().classification(), Classification::Unknown);
/// ```
pub struct HandlerError {
    classification: Classification,
    source: BoxError,
}

impl HandlerError {
    /// A failure that a later attempt may get past (a downstream service
    /// timed out, say): the runtime retries with back-off.
    pub fn transient(source: impl Into<BoxError>) -> Self {
        HandlerError {
            classification: Classification::Transient,
            source: source.into(),
        }
    }

    /// A failure that every attempt will meet: the event is dead-lettered.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        HandlerError {
            classification: Classification::Permanent,
            source: source.into(),
        }
    }

    /// How the handler classified the error; [`Classification::Unknown`]
    /// when it came through `?` and is left to the store to classify.
    pub fn classification(&self) -> Classification {
        self.classification
    }

    /// The underlying error.
    pub fn source(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }

    /// Resolves the classification: the handler's own if it gave one, else
    /// the store's judgement of the error chain, else permanent; and the
    /// store's error code, if the error carries one.
    pub(crate) fn into_error<S: crate::DedupStore + ?Sized>(self, store: &S) -> Error {
        let classification = self
            .classification
            .or_else(|| store_error_in(&*self.source))
            .or_else(|| store.classify(&*self.source))
            .or_else(|| Classification::Permanent);
        Error::Handler {
            classification,
            code: store.error_code(&*self.source),
            source: self.source,
        }
    }
}

impl HandlerError {
    /// Resolves the classification where no store judges the error (a
    /// Kafka-only handler): the handler's own if it gave one, else that of
    /// a dedup [`StoreError`] in its chain, else permanent, as with a
    /// store that recognises nothing.
    pub fn into_unstored_error(self) -> Error {
        let classification = self
            .classification
            .or_else(|| store_error_in(&*self.source))
            .or_else(|| Classification::Permanent);
        Error::Handler {
            classification,
            code: None,
            source: self.source,
        }
    }
}

/// The classification of a dedup [`StoreError`] in an error's chain (a
/// body that passed on `lease.extend()`'s failure with `?`), if any.
fn store_error_in(error: &(dyn StdError + 'static)) -> Classification {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(store) = e.downcast_ref::<StoreError>() {
            return store.classification();
        }
        next = e.source();
    }
    Classification::Unknown
}

impl<E: StdError + Send + Sync + 'static> From<E> for HandlerError {
    fn from(e: E) -> Self {
        HandlerError {
            classification: Classification::Unknown,
            source: Box::new(e),
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("classification", &self.classification)
            .field("source", &self.source)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_classification_prefers_the_handler() {
        let io = || std::io::Error::other("boom");
        let store = crate::MemoryStore::new();
        let err = HandlerError::transient(io()).into_error(&store);
        assert!(err.is_retryable());
        let err = HandlerError::permanent(io()).into_error(&store);
        assert!(!err.is_retryable());
        let err = HandlerError::from(io()).into_error(&store);
        assert!(!err.is_retryable(), "unknown errors default to permanent");
        assert_eq!(err.kind(), "handler");
    }
}
