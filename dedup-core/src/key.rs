//! What a claim is made on: a scope and an event id.

use std::fmt;

use sha2::{Digest, Sha256};

/// Longest scope or id stored as written; longer ones are stored as a digest.
pub const MAX_KEY_BYTES: usize = 255;

/// Why an event yields no usable dedup key. Always permanent: retrying the
/// same event cannot produce a key, so the runtime dead-letters it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The event id is the empty string.
    #[error("the event id is empty, so the event cannot be deduplicated")]
    Empty,
    /// The scope is the empty string.
    #[error("the dedup scope is empty")]
    EmptyScope,
    /// The key field is absent (`None`) in the event.
    #[error("the event has no value in its key field `{field}`")]
    MissingField {
        /// The field path from `#[idempotent(key = "...")]`.
        field: &'static str,
    },
    /// The key header is absent from the message.
    #[error("the message has no `{header}` header to take its event id from")]
    MissingHeader {
        /// The header name.
        header: String,
    },
    /// One part of a composite key (`key = "tenant_id, event_id"`) is the
    /// empty string.
    #[error("the key part `{part}` is empty, so the event cannot be deduplicated")]
    EmptyPart {
        /// The part as written in `#[idempotent(key = "...")]`.
        part: &'static str,
    },
    /// The key header is not UTF-8 text.
    #[error("the `{header}` header is not valid UTF-8")]
    HeaderNotUtf8 {
        /// The header name.
        header: String,
    },
}

/// The identity of one claim: which handler claims (`scope`) which event
/// (`id`).
///
/// Two handlers that consume the same event have different scopes, so neither
/// can take the other's claim. Parts longer than [`MAX_KEY_BYTES`] bytes are
/// replaced by `sha256:<64 hex digits>` of their bytes: stable across
/// processes and versions, never truncated (two long ids with a common prefix
/// stay distinct). So are parts that contain a NUL character (no database
/// text column holds one) and parts that are themselves written like a
/// digest, so that no id can be taken for another id's digest.
///
/// ```
/// use dedup_core::DedupKey;
///
/// let key = DedupKey::new("payments::record", "9b2c...")?;
/// assert_eq!(key.id(), "9b2c...");
///
/// let long = DedupKey::new("payments::record", "x".repeat(300))?;
/// assert!(long.id().starts_with("sha256:"));
/// assert_eq!(long.id().len(), 71);
///
/// // An id written like a digest is digested too: the two never meet.
/// let digest = long.id().to_owned();
/// assert_ne!(DedupKey::new("payments::record", digest)?.id(), long.id());
///
/// assert!(DedupKey::new("payments::record", "").is_err());
/// # Ok::<(), dedup_core::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DedupKey {
    scope: String,
    id: String,
}

impl DedupKey {
    /// Builds a key; empty parts are rejected, long parts digested.
    pub fn new(scope: impl Into<String>, id: impl Into<String>) -> Result<Self, KeyError> {
        let (scope, id) = (scope.into(), id.into());
        if scope.is_empty() {
            return Err(KeyError::EmptyScope);
        }
        if id.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(DedupKey {
            scope: bounded(scope),
            id: bounded(id),
        })
    }

    /// The scope as stored.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The event id as stored.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// The event id of a composite key: its parts in order, each with `\` and
/// `,` escaped by a `\`, joined by `,`.
///
/// The encoding can be undone, so two different lists of parts never give
/// the same id: `("a,b", "c")` and `("a", "b,c")` stay apart, as do
/// `("a:b", "c")` and `("a", "b:c")`. A one-part key is not encoded at all:
/// `#[idempotent(key = "event_id")]` stores the id as it is. This is what
/// `#[idempotent(key = "tenant_id, event_id")]` claims, and what the `dedup`
/// CLI computes from a repeated `--key`.
///
/// ```
/// use dedup_core::composite_id;
///
/// assert_eq!(composite_id(["tenant-a", "evt-1"]), "tenant-a,evt-1");
/// assert_eq!(composite_id(["a,b", "c"]), r"a\,b,c");
/// assert_eq!(composite_id(["a", "b,c"]), r"a,b\,c");
/// assert_eq!(composite_id([r"a\", "b"]), r"a\\,b");
/// assert_eq!(composite_id(["evt-1"]), "evt-1");
/// ```
pub fn composite_id<'a>(parts: impl IntoIterator<Item = &'a str>) -> String {
    let mut parts = parts.into_iter().peekable();
    let mut out = String::new();
    let Some(first) = parts.next() else {
        return out;
    };
    if parts.peek().is_none() {
        out.push_str(first);
        return out;
    }
    for (i, part) in std::iter::once(first).chain(parts).enumerate() {
        if i > 0 {
            out.push(',');
        }
        for c in part.chars() {
            if matches!(c, '\\' | ',') {
                out.push('\\');
            }
            out.push(c);
        }
    }
    out
}

const DIGEST_PREFIX: &str = "sha256:";

/// Whether `part` has the exact shape of a stored digest.
fn looks_like_a_digest(part: &str) -> bool {
    part.strip_prefix(DIGEST_PREFIX).is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

fn bounded(part: String) -> String {
    if part.len() <= MAX_KEY_BYTES && !part.contains('\0') && !looks_like_a_digest(&part) {
        return part;
    }
    digest_of(&part)
}

/// `sha256:<64 hex digits>` of `part`'s bytes: how long parts are stored.
pub(crate) fn digest_of(part: &str) -> String {
    let digest = Sha256::digest(part.as_bytes());
    let mut out = String::with_capacity(DIGEST_PREFIX.len() + 64);
    out.push_str(DIGEST_PREFIX);
    for byte in digest {
        out.push(char::from_digit(u32::from(byte >> 4), 16).expect("nibble"));
        out.push(char::from_digit(u32::from(byte & 0xf), 16).expect("nibble"));
    }
    out
}

impl fmt::Debug for DedupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DedupKey({self})")
    }
}

impl fmt::Display for DedupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_stable_and_lowercase_hex() {
        // sha256("a" * 256), computed independently (Python hashlib).
        let key = DedupKey::new("s", "a".repeat(256)).unwrap();
        assert_eq!(
            key.id(),
            "sha256:02d7160d77e18c6447be80c2e355c7ed4388545271702c50253b0914c65ce5fe"
        );
    }

    #[test]
    fn an_id_written_as_a_digest_never_equals_a_digest() {
        let long = DedupKey::new("s", "a".repeat(256)).unwrap();
        let forged = DedupKey::new("s", long.id()).unwrap();
        assert!(forged.id().starts_with("sha256:"));
        assert_ne!(forged.id(), long.id());
        // Other ids stay as written, even with the prefix.
        assert_eq!(DedupKey::new("s", "sha256:1").unwrap().id(), "sha256:1");
        assert_eq!(DedupKey::new("s", "x-sha256:1").unwrap().id(), "x-sha256:1");
    }

    #[test]
    fn nul_characters_are_digested_not_stored() {
        let key = DedupKey::new("s\0", "a\0").unwrap();
        assert!(key.scope().starts_with("sha256:") && key.id().starts_with("sha256:"));
        assert_ne!(key.id(), DedupKey::new("s", "a\0\0").unwrap().id());
    }

    #[test]
    fn boundary_is_255_bytes_not_chars() {
        let at = "é".repeat(127) + "x"; // 255 bytes
        assert_eq!(DedupKey::new("s", at.clone()).unwrap().id(), at);
        let over = "é".repeat(128); // 256 bytes, 128 chars
        assert!(
            DedupKey::new("s", over)
                .unwrap()
                .id()
                .starts_with("sha256:")
        );
    }

    #[test]
    fn common_prefix_stays_distinct() {
        let prefix = "p".repeat(300);
        let a = DedupKey::new("s", format!("{prefix}a")).unwrap();
        let b = DedupKey::new("s", format!("{prefix}b")).unwrap();
        assert_ne!(a, b);
    }

    /// Splits an id made by [`composite_id`] back into its parts.
    fn split(id: &str) -> Vec<String> {
        let mut parts = vec![String::new()];
        let mut chars = id.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => parts
                    .last_mut()
                    .unwrap()
                    .push(chars.next().expect("escaped")),
                ',' => parts.push(String::new()),
                c => parts.last_mut().unwrap().push(c),
            }
        }
        parts
    }

    #[test]
    fn composite_ids_split_back_into_their_parts() {
        let alphabet = ["", "a", ",", "\\", ":", "\\,", ",\\", "é"];
        let mut seen = std::collections::HashMap::new();
        for a in alphabet {
            for b in alphabet {
                for c in alphabet {
                    let x = format!("{a}{b}");
                    for parts in [vec![x.as_str(), c], vec![a, b, c], vec![c, x.as_str()]] {
                        let id = composite_id(parts.iter().copied());
                        let parts: Vec<String> = parts.iter().map(|p| p.to_string()).collect();
                        assert_eq!(split(&id), parts, "{id:?}");
                        if let Some(other) = seen.insert(id.clone(), parts.clone()) {
                            assert_eq!(other, parts, "{id:?} is two lists of parts");
                        }
                    }
                }
            }
        }
        assert_eq!(composite_id(["a:b", "c"]), "a:b,c");
        assert_ne!(composite_id(["a:b", "c"]), composite_id(["a", "b:c"]));
        assert_eq!(composite_id(std::iter::empty()), "");
    }

    #[test]
    fn long_scopes_are_digested_too() {
        let key = DedupKey::new("m".repeat(400), "1").unwrap();
        assert!(key.scope().starts_with("sha256:"));
        assert_eq!(DedupKey::new("", "1"), Err(KeyError::EmptyScope));
    }
}
