//! The claims of one input partition, kept in memory and in a compacted
//! changelog topic: what was applied, on the partition's stream time.
//!
//! A claim is keyed by a 16-byte digest of its scope and id (the changelog
//! record's key too, so compaction keeps one record per claim). Its value
//! holds when it was taken and when it expires, both in the partition's
//! stream time (never the clock of one host), and the fingerprint. A null
//! value (a tombstone) removes it.
//!
//! A partition's stream time at a record is the greatest timestamp of the
//! records up to and including it (a record stamped ahead of the wall clock
//! counts as stamped now). Claims are judged on it, not on the record's own
//! timestamp, so a record stamped out of order meets the same decision
//! whatever batch it falls in: a claim the sweep tombstoned has expired for
//! every later record too. Stream time is committed with each partition's
//! offset (its metadata, as Kafka Streams keeps its partition time), so a
//! restart or a new owner resumes it exactly.

use std::collections::HashMap;

use dedup_core::{DedupKey, Fingerprint};
use sha2::{Digest as _, Sha256};

/// A claim's key: the first 16 bytes of SHA-256 over scope, NUL, id.
pub(crate) type ClaimDigest = [u8; 16];

/// The digest of `key`.
pub(crate) fn digest(key: &DedupKey) -> ClaimDigest {
    let mut hasher = Sha256::new();
    hasher.update(key.scope().as_bytes());
    hasher.update([0]);
    hasher.update(key.id().as_bytes());
    let mut out = [0; 16];
    out.copy_from_slice(&hasher.finalize()[..16]);
    out
}

/// One claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The stream time (ms) at the input record that took it.
    pub(crate) claimed_at: i64,
    /// `claimed_at` + the handler's TTL: a record of the same key met
    /// before stream time reaches it is a duplicate.
    pub(crate) expires_at: i64,
    pub(crate) fingerprint: Option<Fingerprint>,
}

impl Entry {
    /// Whether a record met at stream time `at` (ms) falls within this
    /// claim.
    pub(crate) fn covers(&self, at: i64) -> bool {
        at < self.expires_at
    }
}

/// The changelog format's version, the value's first byte.
const FORMAT: u8 = 1;

/// A changelog value: format, claimed_at, expires_at (big-endian i64 ms),
/// 0 or 1 then the fingerprint, then the readable key for an operator
/// (`scope/id`; not read back).
pub(crate) fn encode(entry: &Entry, key: &DedupKey) -> Vec<u8> {
    let readable = key.to_string();
    let mut out = Vec::with_capacity(1 + 16 + 17 + readable.len());
    out.push(FORMAT);
    out.extend_from_slice(&entry.claimed_at.to_be_bytes());
    out.extend_from_slice(&entry.expires_at.to_be_bytes());
    match entry.fingerprint {
        Some(fp) => {
            out.push(1);
            out.extend_from_slice(fp.as_bytes());
        }
        None => out.push(0),
    }
    out.extend_from_slice(readable.as_bytes());
    out
}

/// Reads a changelog value back; `Err` names what is wrong with it.
pub(crate) fn decode(value: &[u8]) -> Result<Entry, String> {
    let fixed = |at: usize| -> Result<i64, String> {
        let bytes = value
            .get(at..at + 8)
            .ok_or_else(|| format!("a claim record of {} bytes is cut short", value.len()))?;
        Ok(i64::from_be_bytes(bytes.try_into().expect("8 bytes")))
    };
    match value.first() {
        Some(&FORMAT) => {}
        Some(other) => return Err(format!("unknown claim record format {other}")),
        None => return Err("an empty claim record".into()),
    }
    let claimed_at = fixed(1)?;
    let expires_at = fixed(9)?;
    let fingerprint = match value.get(17) {
        Some(0) => None,
        Some(1) => {
            let bytes = value
                .get(18..34)
                .ok_or("a claim record's fingerprint is cut short")?;
            Some(Fingerprint::from_bytes(bytes.try_into().expect("16 bytes")))
        }
        _ => return Err("a claim record without its fingerprint flag".into()),
    };
    Ok(Entry {
        claimed_at,
        expires_at,
        fingerprint,
    })
}

/// The prefix of the offset-commit metadata that carries a partition's
/// stream time.
const STREAM_TIME: &str = "dedup-stream-time:";

/// The offset-commit metadata that carries stream time `at` (ms).
pub(crate) fn stream_time_metadata(at: i64) -> String {
    format!("{STREAM_TIME}{at}")
}

/// The stream time carried by offset-commit metadata, if it carries one
/// (offsets committed by an earlier version, or reset by a tool, do not).
pub(crate) fn stream_time_of(metadata: &str) -> Option<i64> {
    metadata.strip_prefix(STREAM_TIME)?.parse().ok()
}

/// Each record's stream time in its partition, in order: `records` are
/// (partition, timestamp ms), `start` a partition's stream time before them,
/// and a timestamp past `wall` (the wall clock, read once for the batch)
/// counts as `wall`. Every record counts, whatever becomes of it, so the
/// times depend on the input alone.
pub(crate) fn stream_times(
    records: impl IntoIterator<Item = (i32, i64)>,
    start: impl Fn(i32) -> i64,
    wall: i64,
) -> Vec<i64> {
    let mut running: HashMap<i32, i64> = HashMap::new();
    records
        .into_iter()
        .map(|(p, at)| {
            let now = running.entry(p).or_insert_with(|| start(p));
            *now = (*now).max(at.min(wall));
            *now
        })
        .collect()
}

/// The claims of one input partition.
#[derive(Debug, Default)]
pub(crate) struct PartitionClaims {
    claims: HashMap<ClaimDigest, Entry>,
    /// The stream time (ms) at the last committed record of this
    /// partition, which expires claims.
    pub(crate) stream_time: i64,
    /// The stream time at which expired claims are next looked for.
    next_sweep: i64,
}

impl PartitionClaims {
    /// The live claim of `digest` for a record stamped `at`, if any.
    pub(crate) fn live(&self, digest: &ClaimDigest, at: i64) -> Option<&Entry> {
        self.claims.get(digest).filter(|e| e.covers(at))
    }

    /// Whether a claim of `digest` is held, live or expired.
    pub(crate) fn holds(&self, digest: &ClaimDigest) -> bool {
        self.claims.contains_key(digest)
    }

    /// Applies a changelog record (restore), or a committed claim.
    pub(crate) fn put(&mut self, digest: ClaimDigest, entry: Entry) {
        self.stream_time = self.stream_time.max(entry.claimed_at);
        self.claims.insert(digest, entry);
    }

    /// Applies a tombstone.
    pub(crate) fn remove(&mut self, digest: &ClaimDigest) {
        self.claims.remove(digest);
    }

    /// Moves stream time forward to `at` (a committed record's stream time,
    /// or the one its offset's metadata carries).
    pub(crate) fn advance(&mut self, at: i64) {
        self.stream_time = self.stream_time.max(at);
    }

    /// How many claims are held.
    pub(crate) fn len(&self) -> usize {
        self.claims.len()
    }

    /// The claims expired at stream time `now`, if a sweep is due: one
    /// sweep per `every` ms of stream time, so a large store is not scanned
    /// for every batch. The caller tombstones them in its transaction and,
    /// once it commits, [`remove`](Self::remove)s them and says it
    /// [`swept`](Self::swept).
    pub(crate) fn expired(&self, now: i64) -> Vec<ClaimDigest> {
        if now < self.next_sweep {
            return Vec::new();
        }
        self.claims
            .iter()
            .filter(|(_, e)| e.expires_at <= now)
            .map(|(d, _)| *d)
            .collect()
    }

    /// A sweep at stream time `now` committed (if one was due): the next
    /// is due `every` ms later.
    pub(crate) fn swept(&mut self, now: i64, every: i64) {
        if now >= self.next_sweep {
            self.next_sweep = now.saturating_add(every.max(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> DedupKey {
        DedupKey::new("enrich", id).unwrap()
    }

    #[test]
    fn a_value_reads_back_with_and_without_a_fingerprint() {
        for fingerprint in [None, Some(Fingerprint::of_payload(b"x"))] {
            let entry = Entry {
                claimed_at: 1_700_000_000_123,
                expires_at: 1_700_086_400_123,
                fingerprint,
            };
            let value = encode(&entry, &key("e-1"));
            assert_eq!(decode(&value), Ok(entry));
            assert!(String::from_utf8_lossy(&value).contains("e-1"), "readable");
        }
    }

    #[test]
    fn a_broken_value_is_refused_not_guessed() {
        let value = encode(
            &Entry {
                claimed_at: 1,
                expires_at: 2,
                fingerprint: Some(Fingerprint::of_payload(b"x")),
            },
            &key("e"),
        );
        assert!(decode(&[]).is_err());
        assert!(decode(&[9]).is_err());
        assert!(decode(&value[..10]).is_err());
        assert!(decode(&value[..25]).is_err());
    }

    #[test]
    fn digests_keep_scope_and_id_apart() {
        let a = DedupKey::new("ab", "c").unwrap();
        let b = DedupKey::new("a", "bc").unwrap();
        assert_ne!(digest(&a), digest(&b));
        assert_eq!(digest(&a), digest(&DedupKey::new("ab", "c").unwrap()));
    }

    #[test]
    fn a_claim_covers_records_stamped_before_its_expiry() {
        let mut claims = PartitionClaims::default();
        let d = digest(&key("e"));
        claims.put(
            d,
            Entry {
                claimed_at: 1_000,
                expires_at: 5_000,
                fingerprint: None,
            },
        );
        assert!(claims.live(&d, 4_999).is_some());
        assert!(claims.live(&d, 5_000).is_none(), "expired at its expiry");
        assert_eq!(claims.stream_time, 1_000);
    }

    #[test]
    fn stream_time_is_the_greatest_timestamp_so_far_never_past_the_wall_clock() {
        let records = [(0, 100), (1, 50), (0, 80), (0, 300), (1, 40), (0, 9_999)];
        let start = |p| if p == 1 { 60 } else { 0 };
        assert_eq!(
            stream_times(records, start, 1_000),
            [100, 60, 100, 300, 60, 1_000]
        );
        assert_eq!(stream_time_of(&stream_time_metadata(-5)), Some(-5));
        assert_eq!(
            stream_time_of(&stream_time_metadata(1_700_000_000_123)),
            Some(1_700_000_000_123)
        );
        assert_eq!(stream_time_of(""), None, "an earlier version's commit");
        assert_eq!(stream_time_of("other"), None);
    }

    #[test]
    fn sweeps_find_expired_claims_once_per_interval_of_stream_time() {
        let mut claims = PartitionClaims::default();
        for (i, expires_at) in [(1, 2_000), (2, 3_000), (3, 9_000)] {
            claims.put(
                digest(&key(&i.to_string())),
                Entry {
                    claimed_at: 0,
                    expires_at,
                    fingerprint: None,
                },
            );
        }
        let due = claims.expired(2_500);
        assert_eq!(due.len(), 1);
        assert_eq!(claims.expired(2_500), due, "judging again is the same");
        claims.swept(2_500, 1_000);
        assert!(claims.expired(3_000).is_empty(), "not due yet");
        let due = claims.expired(3_500);
        assert_eq!(due.len(), 2, "the first is still there until removed");
        for d in due {
            claims.remove(&d);
        }
        claims.swept(3_500, 1_000);
        assert_eq!(claims.len(), 1);
    }
}
