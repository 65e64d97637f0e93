//! Errors, each of which knows whether retrying can help.

use std::error::Error as StdError;
use std::fmt;

use crate::KeyError;

/// A boxed error from a backend or a handler body.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// `Result` with dedup's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why one event could not be finished.
///
/// [`is_retryable`](Error::is_retryable) tells the runtime what to do with
/// it: retry with back-off, or dead-letter the event at once.
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
    /// The handler body returned an error; the transaction was rolled back.
    #[error("handler failed: {source}")]
    Handler {
        /// Whether the handler or the store classified the error as transient.
        retryable: bool,
        /// The handler's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Whether running the same event again may succeed.
    ///
    /// Decode and key errors never are; store errors are when the backend
    /// classified them so (serialization failure, deadlock, lock timeout,
    /// lost connection); handler errors as the handler or the store said.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Decode(_) | Error::Key(_) => false,
            Error::Store(e) => e.is_retryable(),
            Error::Handler { retryable, .. } => *retryable,
        }
    }

    /// A short stable name for the kind of failure (`decode`, `key`, `store`,
    /// `handler`), for metrics labels and dead-letter headers.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Decode(_) => "decode",
            Error::Key(_) => "key",
            Error::Store(_) => "store",
            Error::Handler { .. } => "handler",
        }
    }
}

/// A failure of the dedup store, classified by the backend from error codes
/// (never from message text).
#[derive(Debug, thiserror::Error)]
#[error("dedup store error{}: {source}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
pub struct StoreError {
    retryable: bool,
    code: Option<String>,
    #[source]
    source: BoxError,
}

impl StoreError {
    /// An error that a retry may get past (a lost connection, a deadlock).
    pub fn transient(source: impl Into<BoxError>) -> Self {
        StoreError {
            retryable: true,
            code: None,
            source: source.into(),
        }
    }

    /// An error that a retry will meet again (a missing table, bad SQL).
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        StoreError {
            retryable: false,
            code: None,
            source: source.into(),
        }
    }

    /// Attaches the backend's error code (a SQLSTATE, say) for logs.
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// Whether a retry may succeed.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The backend's error code, if it gave one.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }
}

/// Whether a later attempt can get past an error: the runtime retries
/// transient failures with back-off and dead-letters permanent ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Classification {
    /// A later attempt may succeed (a timeout, a lost connection, a
    /// serialization failure): retry.
    Transient,
    /// Every attempt will fail the same way (bad data, a bug): do not retry.
    Permanent,
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

    /// Transient or not, an unknown classification counting as permanent.
    pub fn is_transient(self) -> bool {
        self == Classification::Transient
    }
}

/// The error type of handler bodies: `?` converts any error into it, and the
/// handler may say whether a retry can help.
///
/// Errors converted with `?` are *unclassified*: when the runtime applies the
/// handler, the store classifies them (a database error by its SQLSTATE:
/// serialization failure, deadlock, lock timeout and lost connections are
/// transient); anything the store does not recognise is permanent. Say so
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
    /// `classify` (the store's judgement of the error chain), else permanent.
    pub(crate) fn into_error(
        self,
        classify: impl FnOnce(&(dyn StdError + 'static)) -> Classification,
    ) -> Error {
        let retryable = self
            .classification
            .or_else(|| classify(&*self.source))
            .is_transient();
        Error::Handler {
            retryable,
            source: self.source,
        }
    }
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
        let err = HandlerError::transient(io()).into_error(|_| Classification::Permanent);
        assert!(err.is_retryable());
        let err = HandlerError::from(io()).into_error(|_| Classification::Transient);
        assert!(err.is_retryable());
        let err = HandlerError::from(io()).into_error(|_| Classification::Unknown);
        assert!(!err.is_retryable(), "unknown errors default to permanent");
        assert_eq!(err.kind(), "handler");
    }
}
