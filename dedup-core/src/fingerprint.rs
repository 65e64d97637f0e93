//! What a claim remembers of its event's content.

use std::fmt;

use sha2::{Digest, Sha256};

/// A 16-byte digest of an event's content, kept with its claim
/// (`#[idempotent(fingerprint)]`): a duplicate whose fingerprint differs
/// reuses the id of another event, a producer bug, and is not skipped
/// silently.
///
/// The first 16 bytes of SHA-256: of the payload's bytes
/// ([`of_payload`](Fingerprint::of_payload)), or of chosen fields
/// ([`of_parts`](Fingerprint::of_parts)), so that a re-sent event with a
/// new timestamp still matches.
///
/// ```
/// use dedup_core::Fingerprint;
///
/// let a = Fingerprint::of_parts([Some("acct-1"), Some("250")]);
/// assert_eq!(a, Fingerprint::of_parts([Some("acct-1"), Some("250")]));
/// assert_ne!(a, Fingerprint::of_parts([Some("acct-1"), Some("2500")]));
/// // No value and an empty one differ, as do the parts' boundaries.
/// assert_ne!(Fingerprint::of_parts([None]), Fingerprint::of_parts([Some("")]));
/// assert_ne!(
///     Fingerprint::of_parts([Some("ab"), Some("c")]),
///     Fingerprint::of_parts([Some("a"), Some("bc")]),
/// );
/// assert_eq!(a.to_string().len(), 32, "hex");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 16]);

impl Fingerprint {
    /// The fingerprint of a whole payload, byte for byte.
    pub fn of_payload(payload: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"payload:");
        hasher.update(payload);
        Self::from_digest(hasher)
    }

    /// The fingerprint of some values of the event, in order; `None` (a
    /// field without a value) differs from every text, the empty one too.
    pub fn of_parts<'a>(parts: impl IntoIterator<Item = Option<&'a str>>) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"parts:");
        for part in parts {
            match part {
                // Length-prefixed, so no two lists of parts hash alike.
                Some(text) => {
                    hasher.update(b"+");
                    hasher.update((text.len() as u64).to_be_bytes());
                    hasher.update(text.as_bytes());
                }
                None => hasher.update(b"-"),
            }
        }
        Self::from_digest(hasher)
    }

    fn from_digest(hasher: Sha256) -> Self {
        let digest = hasher.finalize();
        let mut bytes = [0; 16];
        bytes.copy_from_slice(&digest[..16]);
        Fingerprint(bytes)
    }

    /// A fingerprint as a store kept it.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Fingerprint(bytes)
    }

    /// The 16 bytes a store keeps.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_stable() {
        // Fingerprints are stored: the same content must give the same
        // bytes in every version. Pinned values, computed with Python hashlib.
        assert_eq!(
            Fingerprint::of_payload(br#"{"a":1}"#).to_string(),
            "a63ce74ce1b57f63771c071ff2b80abb"
        );
        assert_eq!(
            Fingerprint::of_parts([Some("acct-1"), None]).to_string(),
            "9d422f9ade9fc79d9270607c8fe532da"
        );
    }

    #[test]
    fn a_payload_and_its_parts_never_meet() {
        assert_ne!(
            Fingerprint::of_payload(b""),
            Fingerprint::of_parts(std::iter::empty())
        );
    }
}
