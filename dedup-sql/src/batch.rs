//! What every SQL backend does with a batch claim's rows, and the value
//! conversions the statements share.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_core::{Acquire, Claim, DedupKey, Fingerprint, Ttl};

/// How the claim statement took a claim it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// No claim existed.
    Fresh,
    /// An expired claim existed and was taken over.
    Reclaimed,
}

impl From<Taken> for Claim {
    fn from(taken: Taken) -> Claim {
        match taken {
            Taken::Fresh => Claim::Fresh,
            Taken::Reclaimed => Claim::Reclaimed,
        }
    }
}

/// The bookkeeping of a batch claim, the same for every SQL backend: one
/// row per distinct key goes into the claim statement (ON CONFLICT cannot
/// touch a row twice in one statement), the rows it returns are the claims
/// taken, the keys it does not return are live duplicates whose expiry is
/// read separately (with the fingerprint they keep), and a key given twice
/// is answered at its repeats from its first position.
///
/// ```
/// use dedup_sql::{BatchClaims, Taken};
/// use dedup_core::{Claim, DedupKey, Fingerprint};
/// use std::time::{Duration, SystemTime};
///
/// let keys = [DedupKey::new("s", "a")?, DedupKey::new("s", "b")?, DedupKey::new("s", "a")?];
/// let fingerprint = Some(Fingerprint::of_payload(b"a"));
/// let mut batch = BatchClaims::new(&keys, &[fingerprint, None, None]);
/// assert_eq!(batch.distinct().len(), 2);
/// assert_eq!(batch.fingerprint(batch.distinct()[0]), fingerprint);
/// let t = SystemTime::now();
/// batch.claimed("s", "a", Taken::Fresh, t); // the statement returned a, not b
/// assert_eq!(batch.unclaimed().len(), 1);
/// let age = Duration::from_secs(90);
/// batch.live("s", "b", t, age, None); // b's live claim, read afterwards
/// let claims = batch.finish();
/// assert_eq!(claims[0], Claim::Fresh);
/// assert_eq!(claims[1], Claim::Duplicate { expires_at: t, age, fingerprint: None });
/// let repeat = Claim::Duplicate { expires_at: t, age: Duration::ZERO, fingerprint };
/// assert_eq!(claims[2], repeat, "a repeat of a, claimed just now");
/// # Ok::<(), dedup_core::KeyError>(())
/// ```
#[derive(Debug)]
pub struct BatchClaims<'k> {
    keys: &'k [DedupKey],
    /// Index into `distinct` of each distinct (scope, id).
    index: HashMap<(&'k str, &'k str), usize>,
    distinct: Vec<&'k DedupKey>,
    /// Per distinct key: how the statement took its claim, if it did.
    taken: Vec<Option<Taken>>,
    expires_at: Vec<Option<SystemTime>>,
    /// Per distinct key read as live: its claim's age.
    ages: Vec<Option<Duration>>,
    /// Per distinct key: the fingerprint given at its first position, then
    /// the one its live claim keeps, if read as live.
    fingerprints: Vec<Option<Fingerprint>>,
}

impl<'k> BatchClaims<'k> {
    /// Starts a batch claim of `keys`, in their order, with their
    /// `fingerprints` (empty, or one per key).
    pub fn new(keys: &'k [DedupKey], fingerprints: &[Option<Fingerprint>]) -> Self {
        let mut index = HashMap::with_capacity(keys.len());
        let mut distinct = Vec::with_capacity(keys.len());
        let mut first_fingerprints = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            index.entry((key.scope(), key.id())).or_insert_with(|| {
                distinct.push(key);
                first_fingerprints.push(fingerprints.get(i).copied().flatten());
                distinct.len() - 1
            });
        }
        let n = distinct.len();
        BatchClaims {
            keys,
            index,
            distinct,
            taken: vec![None; n],
            expires_at: vec![None; n],
            ages: vec![None; n],
            fingerprints: first_fingerprints,
        }
    }

    /// The fingerprint a distinct key's claim is to keep: the one given at
    /// its first position.
    pub fn fingerprint(&self, key: &DedupKey) -> Option<Fingerprint> {
        let i = self.index.get(&(key.scope(), key.id()))?;
        self.fingerprints[*i]
    }

    /// The distinct keys, in first-seen order: what the claim statement gets.
    pub fn distinct(&self) -> &[&'k DedupKey] {
        &self.distinct
    }

    /// Records a row the claim statement returned: the claim was taken.
    pub fn claimed(&mut self, scope: &str, id: &str, taken: Taken, expires_at: SystemTime) {
        if let Some(&i) = self.index.get(&(scope, id)) {
            self.taken[i] = Some(taken);
            self.expires_at[i] = Some(expires_at);
        }
    }

    /// The distinct keys the statement did not return: live claims of
    /// other transactions, whose expiry is to be read.
    pub fn unclaimed(&self) -> Vec<&'k DedupKey> {
        self.distinct
            .iter()
            .zip(&self.taken)
            .filter(|(_, taken)| taken.is_none())
            .map(|(key, _)| *key)
            .collect()
    }

    /// Records the expiry, age and fingerprint of a live claim.
    pub fn live(
        &mut self,
        scope: &str,
        id: &str,
        expires_at: SystemTime,
        age: Duration,
        fingerprint: Option<Fingerprint>,
    ) {
        if let Some(&i) = self.index.get(&(scope, id)) {
            self.expires_at[i] = Some(expires_at);
            self.ages[i] = Some(age);
            self.fingerprints[i] = fingerprint;
        }
    }

    /// One claim per key, in the order given. A live claim whose expiry
    /// could not be read (it vanished in between, purged at its expiry) is
    /// reported as expiring now.
    pub fn finish(self) -> Vec<Claim> {
        let mut answered = vec![false; self.distinct.len()];
        self.keys
            .iter()
            .map(|key| {
                let i = self.index[&(key.scope(), key.id())];
                let expires_at = self.expires_at[i].unwrap_or_else(SystemTime::now);
                // A repeat of a key this batch claimed: claimed just now.
                let age = self.ages[i].unwrap_or_default();
                match (self.taken[i], std::mem::replace(&mut answered[i], true)) {
                    (Some(taken), false) => taken.into(),
                    _ => Claim::Duplicate {
                        expires_at,
                        age,
                        fingerprint: self.fingerprints[i],
                    },
                }
            })
            .collect()
    }
}

/// A time the database gave as microseconds since the Unix epoch (how the
/// SQL backends read `expires_at` without a date-time crate).
pub fn time_from_unix_micros(us: i64) -> SystemTime {
    let magnitude = Duration::from_micros(us.unsigned_abs());
    if us >= 0 {
        UNIX_EPOCH + magnitude
    } else {
        UNIX_EPOCH - magnitude
    }
}

/// A claim's age the database gave in microseconds (0 if negative: the
/// duplicate's transaction began before the claim's, whose `now()` is its
/// start).
pub fn age_from_micros(us: i64) -> Duration {
    Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

/// A fingerprint as a claims table keeps it: 16 bytes, or NULL (none). A
/// value of another length, which no version of dedup writes, counts as
/// none rather than failing every duplicate of the claim.
pub fn fingerprint_from(bytes: Option<Vec<u8>>) -> Option<Fingerprint> {
    let bytes: [u8; 16] = bytes?.try_into().ok()?;
    Some(Fingerprint::from_bytes(bytes))
}

/// The duplicate a live claim's row reads as: `(expires_at, age)` in
/// microseconds and its fingerprint. No row: the claim vanished between the
/// claim statement and this read (purged at its expiry), reported as
/// expiring now.
pub fn live_claim(row: Option<(i64, i64, Option<Vec<u8>>)>) -> Claim {
    match row {
        Some((expires_us, age_us, kept)) => Claim::Duplicate {
            expires_at: time_from_unix_micros(expires_us),
            age: age_from_micros(age_us),
            fingerprint: fingerprint_from(kept),
        },
        None => Claim::Duplicate {
            expires_at: SystemTime::now(),
            age: Duration::ZERO,
            fingerprint: None,
        },
    }
}

/// A claim's row as lease mode reads it when it cannot acquire:
/// `in_progress`, its token, `expires_at` and age in microseconds, its
/// fingerprint.
pub type LeaseRow = (bool, i64, i64, i64, Option<Vec<u8>>);

/// What a live claim means to an acquirer: another holder's lease in
/// progress, or a done claim (a duplicate).
pub fn held_or_done((in_progress, token, expires_us, age_us, kept): LeaseRow) -> Acquire {
    if in_progress {
        Acquire::Held {
            expires_at: time_from_unix_micros(expires_us),
            token: token.unsigned_abs(),
        }
    } else {
        Acquire::Done {
            expires_at: time_from_unix_micros(expires_us),
            age: age_from_micros(age_us),
            fingerprint: fingerprint_from(kept),
        }
    }
}

/// A TTL as the signed seconds SQL parameters take. A TTL is at most 100
/// years, far inside `i64`.
pub fn ttl_seconds(ttl: Ttl) -> i64 {
    i64::try_from(ttl.as_secs()).expect("a TTL fits in i64 seconds")
}
