//! The changelog's records: what one transaction claimed on one partition,
//! in one record (or a few, for a large batch), and the format of one
//! claim per record that earlier versions wrote, still read.
//!
//! A claim record's key is 17 bytes, `b` and 16 bytes unique to the record
//! (a nonce of the consumer instance and a counter), so compaction never
//! folds two of them together; its value is format 2: the byte 2, then
//! each claim as its 16-byte digest, claimed_at and expires_at (big-endian
//! i64 ms), 0 or 1 then the fingerprint, and the readable key for an
//! operator (`scope/id`, after its length as a big-endian u16; not read
//! back). Once stream time passes every expiry in a record, the sweep
//! tombstones the record's key.
//!
//! Format 1 (before): a record per claim, keyed by its 16-byte digest
//! (see `claims::decode`); a restore still reads them, and the sweep
//! tombstones each by its digest once its claim has expired.
//!
//! One record per transaction and partition instead of one per claim
//! halves the records a batch produces (an output and a claim per event
//! were two), with them the producer's work per event and the broker's.

use std::hash::BuildHasher as _;
use std::sync::atomic::{AtomicU64, Ordering};

use dedup_core::DedupKey;
use sha2::{Digest as _, Sha256};

use super::claims::{ClaimDigest, Entry};

/// A claim record's key.
pub(crate) type RecordKey = [u8; 17];

/// The first byte of a claim record's key.
const RECORD: u8 = b'b';

/// The format of a claim record's value, its first byte.
const FORMAT: u8 = 2;

/// A record's value grows to about this many bytes before the next claims
/// go to another record: far below a topic's default `max.message.bytes`
/// (1 MiB), whatever its claims' keys.
const RECORD_BYTES: usize = 64 * 1024;

/// What a changelog record's key names.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Key {
    /// One claim, format 1.
    Claim(ClaimDigest),
    /// A record of claims, format 2.
    Record(RecordKey),
}

impl Key {
    /// What `bytes`, a changelog record's key, names; `None` if nothing.
    pub(crate) fn of(bytes: &[u8]) -> Option<Self> {
        if let Ok(digest) = <ClaimDigest>::try_from(bytes) {
            return Some(Key::Claim(digest));
        }
        match <RecordKey>::try_from(bytes) {
            Ok(key) if key[0] == RECORD => Some(Key::Record(key)),
            _ => None,
        }
    }

    /// The key's bytes, as the changelog keeps them.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Key::Claim(digest) => digest,
            Key::Record(key) => key,
        }
    }
}

/// Makes claim record keys: a nonce of this instance (random, the wall
/// clock and the process id, hashed), then a counter.
#[derive(Debug)]
pub(crate) struct Keys {
    nonce: [u8; 8],
    next: AtomicU64,
}

impl Keys {
    pub(crate) fn new() -> Self {
        let mut hasher = Sha256::new();
        hasher.update(std::hash::RandomState::new().hash_one(0u8).to_be_bytes());
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        hasher.update(since_epoch.as_nanos().to_be_bytes());
        hasher.update(std::process::id().to_be_bytes());
        let mut nonce = [0; 8];
        nonce.copy_from_slice(&hasher.finalize()[..8]);
        Keys {
            nonce,
            next: AtomicU64::new(0),
        }
    }

    fn next(&self) -> RecordKey {
        let mut key = [0; 17];
        key[0] = RECORD;
        key[1..9].copy_from_slice(&self.nonce);
        key[9..].copy_from_slice(&self.next.fetch_add(1, Ordering::Relaxed).to_be_bytes());
        key
    }
}

/// One claim record of a transaction.
#[derive(Debug)]
pub(crate) struct ClaimRecord {
    pub(crate) partition: i32,
    pub(crate) key: RecordKey,
    pub(crate) value: Vec<u8>,
    /// The latest expiry of its claims: the record is tombstoned once
    /// stream time reaches it.
    pub(crate) expires_at: i64,
}

/// The records of `claims` (partition, digest, entry, key), in order: the
/// claims of a partition in one record, or more past [`RECORD_BYTES`].
pub(crate) fn records<'a>(
    claims: impl IntoIterator<Item = (i32, &'a ClaimDigest, &'a Entry, &'a DedupKey)>,
    keys: &Keys,
) -> Vec<ClaimRecord> {
    let mut out: Vec<ClaimRecord> = Vec::new();
    // Each partition's open record, by its index in `out`.
    let mut open: Vec<(i32, usize)> = Vec::new();
    for (partition, digest, entry, key) in claims {
        let at = match open.iter().find(|(p, _)| *p == partition) {
            Some(&(_, i)) if out[i].value.len() < RECORD_BYTES => i,
            _ => {
                out.push(ClaimRecord {
                    partition,
                    key: keys.next(),
                    value: vec![FORMAT],
                    expires_at: i64::MIN,
                });
                let i = out.len() - 1;
                open.retain(|(p, _)| *p != partition);
                open.push((partition, i));
                i
            }
        };
        let record = &mut out[at];
        record.expires_at = record.expires_at.max(entry.expires_at);
        encode_claim(&mut record.value, digest, entry, key);
    }
    out
}

fn encode_claim(out: &mut Vec<u8>, digest: &ClaimDigest, entry: &Entry, key: &DedupKey) {
    out.extend_from_slice(digest);
    encode_entry(out, entry);
    let (scope, id) = (key.scope().as_bytes(), key.id().as_bytes());
    // Each part is at most MAX_KEY_BYTES (255): the length fits.
    let len = u16::try_from(scope.len() + 1 + id.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(scope);
    out.push(b'/');
    out.extend_from_slice(id);
}

/// claimed_at, expires_at, then 0 or 1 and the fingerprint: a claim's
/// entry, in both formats.
fn encode_entry(out: &mut Vec<u8>, entry: &Entry) {
    out.extend_from_slice(&entry.claimed_at.to_be_bytes());
    out.extend_from_slice(&entry.expires_at.to_be_bytes());
    match entry.fingerprint {
        Some(fp) => {
            out.push(1);
            out.extend_from_slice(fp.as_bytes());
        }
        None => out.push(0),
    }
}

/// A claim record's value read back: its claims, in order; `Err` names what
/// is wrong with it.
pub(crate) fn decode(value: &[u8]) -> Result<Vec<(ClaimDigest, Entry)>, String> {
    match value.first() {
        Some(&FORMAT) => {}
        Some(other) => return Err(format!("unknown claim record format {other}")),
        None => return Err("an empty claim record".into()),
    }
    let mut cursor = Cursor { value, at: 1 };
    let mut out = Vec::new();
    loop {
        let digest: ClaimDigest = cursor.take()?;
        let claimed_at = i64::from_be_bytes(cursor.take()?);
        let expires_at = i64::from_be_bytes(cursor.take()?);
        let fingerprint = match cursor.take::<1>()? {
            [0] => None,
            [1] => Some(dedup_core::Fingerprint::from_bytes(cursor.take()?)),
            [other] => return Err(format!("a claim's fingerprint flag is {other}")),
        };
        let readable = u16::from_be_bytes(cursor.take()?);
        cursor.skip(usize::from(readable))?;
        out.push((
            digest,
            Entry {
                claimed_at,
                expires_at,
                fingerprint,
            },
        ));
        if cursor.at == value.len() {
            return Ok(out);
        }
    }
}

/// Reads a claim record's value.
struct Cursor<'a> {
    value: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let bytes = self
            .value
            .get(self.at..self.at + N)
            .ok_or_else(|| self.cut())?;
        self.at += N;
        Ok(bytes.try_into().expect("N bytes"))
    }

    fn skip(&mut self, n: usize) -> Result<(), String> {
        if self.at + n > self.value.len() {
            return Err(self.cut());
        }
        self.at += n;
        Ok(())
    }

    fn cut(&self) -> String {
        format!("a claim record of {} bytes is cut short", self.value.len())
    }
}

/// Format 1's value of one claim (a restore reads it with
/// `claims::decode`): what an earlier version wrote, for the tests that
/// show it is still read.
#[cfg(test)]
pub(crate) fn legacy_value(entry: &Entry, key: &DedupKey) -> Vec<u8> {
    let mut out = vec![1];
    encode_entry(&mut out, entry);
    out.extend_from_slice(key.to_string().as_bytes());
    let _ = super::claims::decode(&out).expect("format 1");
    out
}

#[cfg(test)]
mod tests {
    use dedup_core::Fingerprint;

    use super::super::claims;

    use super::*;

    fn key(id: &str) -> DedupKey {
        DedupKey::new("enrich", id).unwrap()
    }

    fn entry(claimed_at: i64, fingerprint: Option<Fingerprint>) -> Entry {
        Entry {
            claimed_at,
            expires_at: claimed_at + 1_000,
            fingerprint,
        }
    }

    #[test]
    fn a_transactions_claims_make_one_record_per_partition_that_reads_back() {
        let keys = Keys::new();
        let claims: Vec<(i32, DedupKey, Entry)> = vec![
            (0, key("a"), entry(10, None)),
            (1, key("b"), entry(20, Some(Fingerprint::of_payload(b"b")))),
            (0, key("c"), entry(30, Some(Fingerprint::of_payload(b"c")))),
        ];
        let digests: Vec<ClaimDigest> = claims.iter().map(|(_, k, _)| claims::digest(k)).collect();
        let made = records(
            claims
                .iter()
                .zip(&digests)
                .map(|((p, k, e), d)| (*p, d, e, k)),
            &keys,
        );
        assert_eq!(made.len(), 2);
        assert_eq!(made[0].partition, 0);
        assert_eq!(made[0].expires_at, 1_030, "the latest expiry of its claims");
        assert_eq!(
            decode(&made[0].value),
            Ok(vec![(digests[0], claims[0].2), (digests[2], claims[2].2)])
        );
        assert_eq!(decode(&made[1].value), Ok(vec![(digests[1], claims[1].2)]));
        assert!(
            String::from_utf8_lossy(&made[0].value).contains("enrich/c"),
            "readable"
        );
        assert_ne!(made[0].key, made[1].key);
        assert_eq!(Key::of(&made[0].key), Some(Key::Record(made[0].key)));
        assert_eq!(Key::of(&digests[0]), Some(Key::Claim(digests[0])));
        assert_eq!(Key::of(b"something else"), None);
    }

    #[test]
    fn a_large_batch_splits_into_records_of_bounded_size() {
        let keys = Keys::new();
        let ids: Vec<DedupKey> = (0..5_000).map(|i| key(&format!("event-{i:08}"))).collect();
        let digests: Vec<ClaimDigest> = ids.iter().map(claims::digest).collect();
        let e = entry(1, None);
        let made = records(ids.iter().zip(&digests).map(|(k, d)| (3, d, &e, k)), &keys);
        assert!(made.len() > 1, "{} records", made.len());
        assert!(made.iter().all(|r| r.value.len() < RECORD_BYTES + 600));
        let back: Vec<ClaimDigest> = made
            .iter()
            .flat_map(|r| decode(&r.value).expect("decodes"))
            .map(|(d, _)| d)
            .collect();
        assert_eq!(back, digests, "every claim once, in order");
    }

    #[test]
    fn keys_differ_between_instances_and_records() {
        let (a, b) = (Keys::new(), Keys::new());
        let (a1, a2, b1) = (a.next(), a.next(), b.next());
        assert_ne!(a1, a2);
        assert_ne!(a1, b1, "another instance's nonce");
    }

    #[test]
    fn a_broken_record_is_refused_not_guessed() {
        let keys = Keys::new();
        let d = claims::digest(&key("a"));
        let e = entry(5, Some(Fingerprint::of_payload(b"x")));
        let value = records([(0, &d, &e, &key("a"))], &keys).remove(0).value;
        assert!(decode(&value).is_ok());
        assert!(decode(&[]).is_err());
        assert!(decode(&[2]).is_err(), "no claim");
        assert!(decode(&[1]).is_err(), "format 1 is a claim's own record");
        for cut in [10, 30, 40, value.len() - 1] {
            assert!(decode(&value[..cut]).is_err(), "cut at {cut}");
        }
        let mut flag = value.clone();
        flag[33] = 7;
        assert!(decode(&flag).is_err());
    }
}
