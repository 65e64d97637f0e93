//! The claims of one input partition, kept in memory and in a compacted
//! changelog topic: what was applied, on the partition's stream time.
//!
//! A claim is keyed by a 16-byte digest of its scope and id. It holds when
//! it was taken and when it expires, both in the partition's stream time
//! (never the clock of one host), and the fingerprint. The changelog keeps
//! a transaction's claims of a partition in one record (`changelog`),
//! tombstoned once every claim in it has expired; an earlier version's
//! records, one per claim keyed by its digest, are still read, and
//! tombstoned by that digest.
//!
//! A partition's stream time at a record is the greatest timestamp of the
//! records up to and including it (a record stamped ahead of the wall clock
//! counts as stamped now). Claims are judged on it, not on the record's own
//! timestamp, so a record stamped out of order meets the same decision
//! whatever batch it falls in: a claim the sweep removed has expired for
//! every later record too. Stream time is committed with each partition's
//! offset (its metadata, as Kafka Streams keeps its partition time), so a
//! restart or a new owner resumes it exactly.

use std::collections::{HashMap, HashSet};

use dedup_core::{DedupKey, Fingerprint};
use sha2::{Digest as _, Sha256};

use super::changelog::{Key, RecordKey};

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

/// Format 1's version, the value's first byte.
const FORMAT: u8 = 1;

/// Reads back a changelog value of format 1 (one claim: format, claimed_at,
/// expires_at as big-endian i64 ms, 0 or 1 then the fingerprint, then the
/// readable key, not read back); `Err` names what is wrong with it.
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
    /// The changelog's claim records not yet tombstoned, with the latest
    /// expiry of their claims.
    records: HashMap<RecordKey, i64>,
    /// The claims restored from records of format 1 (one per claim, keyed
    /// by its digest), tombstoned by their digest once expired.
    legacy: HashSet<ClaimDigest>,
    /// The stream time (ms) at the last committed record of this
    /// partition, which expires claims.
    pub(crate) stream_time: i64,
    /// The stream time at which expired claims are next looked for.
    next_sweep: i64,
}

/// What a sweep takes away: the expired claims, from memory once its
/// transaction commits, and the changelog keys that transaction
/// tombstones (claim records whose every claim has expired, and expired
/// claims of format 1).
#[derive(Debug, Default)]
pub(crate) struct Sweep {
    pub(crate) expired: Vec<ClaimDigest>,
    pub(crate) tombstones: Vec<Key>,
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

    /// A committed claim.
    pub(crate) fn put(&mut self, digest: ClaimDigest, entry: Entry) {
        self.stream_time = self.stream_time.max(entry.claimed_at);
        self.claims.insert(digest, entry);
    }

    /// A committed claim record, whose claims were [`put`](Self::put).
    pub(crate) fn recorded(&mut self, key: RecordKey, expires_at: i64) {
        self.records.insert(key, expires_at);
    }

    /// Applies a changelog record, read in a restore (`value` `None`: a
    /// tombstone); `Err` names what is wrong with its value.
    pub(crate) fn restore(&mut self, key: Key, value: Option<&[u8]>) -> Result<(), String> {
        match (key, value) {
            (Key::Claim(digest), None) => {
                self.claims.remove(&digest);
                self.legacy.remove(&digest);
            }
            (Key::Claim(digest), Some(value)) => {
                self.put(digest, decode(value)?);
                self.legacy.insert(digest);
            }
            (Key::Record(key), None) => {
                self.records.remove(&key);
            }
            (Key::Record(key), Some(value)) => {
                let mut expires_at = i64::MIN;
                for (digest, entry) in super::changelog::decode(value)? {
                    expires_at = expires_at.max(entry.expires_at);
                    self.put(digest, entry);
                }
                self.recorded(key, expires_at);
            }
        }
        Ok(())
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

    /// What a sweep at stream time `now` takes away, if one is due: one
    /// sweep per `every` ms of stream time, so a large store is not scanned
    /// for every batch. Claims `staged` (taken again in the transaction)
    /// stay. Every other expired claim goes, but at most `most` tombstones
    /// (`false`: more are left for the next sweep, with the claims of
    /// format 1 they are for). The caller tombstones the sweep's keys in
    /// its transaction and, once it commits, has them
    /// [`swept_away`](Self::swept_away) and says it [`swept`](Self::swept).
    pub(crate) fn sweep(
        &self,
        now: i64,
        staged: impl Fn(&ClaimDigest) -> bool,
        most: usize,
    ) -> (Sweep, bool) {
        if now < self.next_sweep {
            return (Sweep::default(), true);
        }
        let mut tombstones: Vec<Key> = self
            .records
            .iter()
            .filter(|(_, expires_at)| **expires_at <= now)
            .map(|(k, _)| Key::Record(*k))
            .collect();
        let mut expired = Vec::new();
        let mut whole = true;
        for (d, e) in &self.claims {
            if e.expires_at > now || staged(d) {
                continue;
            }
            if self.legacy.contains(d) {
                if tombstones.len() >= most {
                    whole = false;
                    continue;
                }
                tombstones.push(Key::Claim(*d));
            }
            expired.push(*d);
        }
        if tombstones.len() > most {
            whole = false;
            tombstones.truncate(most);
        }
        (
            Sweep {
                expired,
                tombstones,
            },
            whole,
        )
    }

    /// Forgets the claims expired at stream time `now` that need no
    /// tombstone: after a restore, the claims of records tombstoned since
    /// (the log's head, not yet compacted, still holds them).
    pub(crate) fn forget_expired(&mut self, now: i64) {
        let legacy = &self.legacy;
        self.claims
            .retain(|d, e| e.expires_at > now || legacy.contains(d));
    }

    /// A sweep's transaction committed: its claims and records are gone.
    pub(crate) fn swept_away(&mut self, sweep: Sweep) {
        for digest in &sweep.expired {
            self.claims.remove(digest);
            self.legacy.remove(digest);
        }
        for key in sweep.tombstones {
            if let Key::Record(key) = key {
                self.records.remove(&key);
            }
        }
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
    use super::super::changelog::{Keys, legacy_value, records};
    use super::*;

    fn key(id: &str) -> DedupKey {
        DedupKey::new("enrich", id).unwrap()
    }

    #[test]
    fn a_format_1_value_reads_back_with_and_without_a_fingerprint() {
        for fingerprint in [None, Some(Fingerprint::of_payload(b"x"))] {
            let entry = Entry {
                claimed_at: 1_700_000_000_123,
                expires_at: 1_700_086_400_123,
                fingerprint,
            };
            let value = legacy_value(&entry, &key("e-1"));
            assert_eq!(decode(&value), Ok(entry));
        }
    }

    #[test]
    fn a_broken_value_is_refused_not_guessed() {
        let value = legacy_value(
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

    fn entry(expires_at: i64) -> Entry {
        Entry {
            claimed_at: 0,
            expires_at,
            fingerprint: None,
        }
    }

    #[test]
    fn sweeps_find_expired_claims_once_per_interval_of_stream_time() {
        let mut claims = PartitionClaims::default();
        for (i, expires_at) in [(1, 2_000), (2, 3_000), (3, 9_000)] {
            claims.put(digest(&key(&i.to_string())), entry(expires_at));
        }
        let none = |_: &ClaimDigest| false;
        let (due, whole) = claims.sweep(2_500, none, 10);
        assert_eq!((due.expired.len(), whole), (1, true));
        assert_eq!(
            claims.sweep(2_500, none, 10).0.expired,
            due.expired,
            "judging again is the same"
        );
        claims.swept(2_500, 1_000);
        assert!(
            claims.sweep(3_000, none, 10).0.expired.is_empty(),
            "not due yet"
        );
        let (due, _) = claims.sweep(3_500, none, 10);
        assert_eq!(
            due.expired.len(),
            2,
            "the first is still there until removed"
        );
        assert!(due.tombstones.is_empty(), "no record to tombstone");
        let (limited, whole) = claims.sweep(3_500, none, 1);
        assert_eq!(
            (limited.expired.len(), whole),
            (2, true),
            "claims that need no tombstone are not limited"
        );
        claims.swept_away(due);
        claims.swept(3_500, 1_000);
        assert_eq!(claims.len(), 1);
    }

    /// A record is tombstoned once its last claim has expired; a claim of
    /// format 1 by its digest, once it has.
    #[test]
    fn a_sweep_tombstones_records_whose_claims_all_expired_and_old_claims_by_digest() {
        let keys = Keys::new();
        let (a, b, c) = (key("a"), key("b"), key("c"));
        let (da, db, dc) = (digest(&a), digest(&b), digest(&c));
        let (ea, eb) = (entry(2_000), entry(5_000));
        let made = records([(0, &da, &ea, &a), (0, &db, &eb, &b)], &keys);
        let mut claims = PartitionClaims::default();
        for record in &made {
            claims
                .restore(Key::Record(record.key), Some(&record.value))
                .expect("a record");
        }
        claims
            .restore(Key::Claim(dc), Some(&legacy_value(&entry(2_500), &c)))
            .expect("format 1");
        assert!(claims.live(&da, 1_999).is_some() && claims.live(&dc, 2_499).is_some());
        let none = |_: &ClaimDigest| false;
        let (limited, whole) = claims.sweep(3_000, none, 0);
        assert_eq!(
            (limited.expired, limited.tombstones, whole),
            (vec![da], vec![], false),
            "c stays until its tombstone can go"
        );
        let (due, _) = claims.sweep(3_000, none, 10);
        assert_eq!(due.expired.len(), 2, "a and c");
        assert_eq!(
            due.tombstones,
            [Key::Claim(dc)],
            "b keeps the record alive; c goes by its digest"
        );
        claims.swept_away(due);
        claims.swept(3_000, 1);
        let (due, _) = claims.sweep(5_000, none, 10);
        assert_eq!(due.expired, [db]);
        assert_eq!(due.tombstones, [Key::Record(made[0].key)]);
        // A claim taken again in the sweep's own transaction stays.
        let staged = |d: &ClaimDigest| *d == db;
        assert!(claims.sweep(5_000, staged, 10).0.expired.is_empty());
        claims.swept_away(due);
        assert_eq!(claims.len(), 0);
        // A restore that meets the tombstones holds nothing either.
        let mut restored = PartitionClaims::default();
        restored
            .restore(Key::Record(made[0].key), Some(&made[0].value))
            .expect("a record");
        restored
            .restore(Key::Record(made[0].key), None)
            .expect("its tombstone");
        assert_eq!(restored.sweep(i64::MAX, none, 10).0.tombstones, []);
        // Once its stream time is known, a restore forgets them.
        restored.forget_expired(5_000);
        assert_eq!(restored.len(), 0);
        assert!(restored.restore(Key::Claim(dc), Some(&[3])).is_err());
    }
}
