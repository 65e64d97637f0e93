#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
pub mod decode;
mod error;
mod fingerprint;
mod handler;
mod key;
mod lease;
mod memory;
mod meta;
pub mod outbox;
mod outbox_memory;
mod purge;
mod store;
#[cfg(feature = "opentelemetry")]
pub mod trace;
mod ttl;

#[cfg(feature = "test-util")]
pub mod conformance;
#[cfg(feature = "test-util")]
pub mod testing;

pub use error::{BoxError, Classification, Error, HandlerError, Result, StoreError};
pub use fingerprint::Fingerprint;
pub use handler::{Describe, DescribeExt, Handler, HandlerExt, Headers, Outcome, WithTtl};
pub use key::{DedupKey, KeyError, MAX_KEY_BYTES, composite_id};
pub use lease::{Acquire, Lease, LeaseError, LeaseHandler, LeaseHandlerExt, LeaseStore, Token};
pub use memory::{MemoryStore, MemoryTx};
pub use meta::{Meta, WithMeta};
pub use outbox::{OutboxMessage, OutboxRecord, OutboxSource, PublishFailure, Retention};
pub use outbox_memory::{MemoryLease, MemoryOutbox};
pub use purge::{PurgeConfig, Purger};
pub use store::{Claim, DedupStore, ORDERED_SCOPE_PREFIX, PurgeExpired, ordered_scope};
pub use ttl::{Ttl, TtlError, TtlErrorKind};

/// Marks an async fn as an idempotent event handler; see the crate docs.
pub use dedup_macros::idempotent;

/// Not public API: what `#[idempotent]` expands to. May change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::{
        DedupKey, Describe, Error, Fingerprint, Handler, HandlerError, Headers, KeyError, Lease,
        LeaseHandler, Meta, Ttl, WithMeta,
    };
    pub use std::clone::Clone;
    pub use std::concat;
    pub use std::module_path;
    pub use std::option::Option::{self, Some};
    pub use std::result::Result::{self, Err, Ok};
    pub use std::string::String;
    pub use std::vec;
    pub use std::vec::Vec;

    /// `format = "json"`, the default.
    pub use crate::decode::json as decode_json;

    /// `decode = path`: the function's error becomes a decode error.
    pub fn decode_with<T, E: Into<crate::BoxError>>(
        payload: &[u8],
        decode: impl FnOnce(&[u8]) -> Result<T, E>,
    ) -> Result<T, crate::Error> {
        crate::decode::with(payload, decode)
    }

    /// `format = "protobuf"`.
    #[cfg(feature = "protobuf")]
    pub use crate::decode::protobuf as decode_protobuf;

    /// What `format = "protobuf"` asks of an event when dedup-core is built
    /// without the feature: never implemented, so the handler does not
    /// compile, with this message.
    #[cfg(not(feature = "protobuf"))]
    #[diagnostic::on_unimplemented(
        message = "`format = \"protobuf\"` needs dedup-core's `protobuf` feature",
        label = "decoded as Protobuf",
        note = "enable it: dedup-core = {{ version = \"0.1\", features = [\"protobuf\"] }}"
    )]
    pub trait ProtobufFeatureDisabled {}

    /// `format = "protobuf"` without the feature: see
    /// [`ProtobufFeatureDisabled`].
    #[cfg(not(feature = "protobuf"))]
    pub fn decode_protobuf<T: ProtobufFeatureDisabled>(_payload: &[u8]) -> Result<T, crate::Error> {
        unreachable!("ProtobufFeatureDisabled has no implementation")
    }

    /// Turns a key field into the event id: anything `Display`, or an
    /// `Option` of it (`None` is a missing key). Chosen by autoref
    /// specialization: `(&&field).dedup_key_string(path)`.
    pub trait KeyFromDisplay {
        fn dedup_key_string(&self, field: &'static str) -> Result<String, KeyError>;
    }

    impl<T: std::fmt::Display + ?Sized> KeyFromDisplay for &&T {
        fn dedup_key_string(&self, _field: &'static str) -> Result<String, KeyError> {
            Ok(self.to_string())
        }
    }

    /// The `Option` arm of [`KeyFromDisplay`].
    pub trait KeyFromOption {
        fn dedup_key_string(&self, field: &'static str) -> Result<String, KeyError>;
    }

    impl<T: std::fmt::Display> KeyFromOption for &Option<T> {
        fn dedup_key_string(&self, field: &'static str) -> Result<String, KeyError> {
            match self {
                Some(v) => Ok(v.to_string()),
                None => Err(KeyError::MissingField { field }),
            }
        }
    }

    /// Turns a fingerprint field into its text: anything `Display`, or an
    /// `Option` of it (`None` hashes apart from every text). Chosen like
    /// [`KeyFromDisplay`].
    pub trait FingerprintFromDisplay {
        fn fingerprint_part(&self) -> Option<String>;
    }

    impl<T: std::fmt::Display + ?Sized> FingerprintFromDisplay for &&T {
        fn fingerprint_part(&self) -> Option<String> {
            Some(self.to_string())
        }
    }

    /// The `Option` arm of [`FingerprintFromDisplay`].
    pub trait FingerprintFromOption {
        fn fingerprint_part(&self) -> Option<String>;
    }

    impl<T: std::fmt::Display> FingerprintFromOption for &Option<T> {
        fn fingerprint_part(&self) -> Option<String> {
            self.as_ref().map(T::to_string)
        }
    }

    /// The event id from header `name`.
    pub fn key_from_header(headers: &dyn Headers, name: &str) -> Result<String, KeyError> {
        let value = headers.get(name).ok_or_else(|| KeyError::MissingHeader {
            header: name.to_owned(),
        })?;
        std::str::from_utf8(value)
            .map(str::to_owned)
            .map_err(|_| KeyError::HeaderNotUtf8 {
                header: name.to_owned(),
            })
    }

    /// The event id of a composite key from its `(part as written, value)`
    /// pairs; an empty value is a key error naming its part.
    pub fn composite_key(parts: &[(&'static str, String)]) -> Result<String, KeyError> {
        if let Some((part, _)) = parts.iter().find(|(_, value)| value.is_empty()) {
            return Err(KeyError::EmptyPart { part });
        }
        Ok(crate::composite_id(
            parts.iter().map(|(_, value)| value.as_str()),
        ))
    }

    /// The TTL the macro checked at compile time.
    pub const fn ttl_from_secs(secs: u64) -> Ttl {
        match Ttl::from_secs(secs) {
            Some(ttl) => ttl,
            None => panic!("#[idempotent] emitted an out-of-range TTL"),
        }
    }
}
