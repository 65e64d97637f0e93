//! What every SQL backend does with a batch claim's rows, and the value
//! conversions the statements share.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_core::{Claim, DedupKey, Ttl};

/// The bookkeeping of a batch claim, the same for every SQL backend: one
/// row per distinct key goes into the claim statement (ON CONFLICT cannot
/// touch a row twice in one statement), the rows it returns are the claims
/// taken, the keys it does not return are live duplicates whose expiry is
/// read separately, and a key given twice is answered at its repeats from
/// its first position.
///
/// ```
/// use dedup_sql::BatchClaims;
/// use dedup_core::{Claim, DedupKey};
/// use std::time::{Duration, SystemTime};
///
/// let keys = [DedupKey::new("s", "a")?, DedupKey::new("s", "b")?, DedupKey::new("s", "a")?];
/// let mut batch = BatchClaims::new(&keys);
/// assert_eq!(batch.distinct().len(), 2);
/// let t = SystemTime::now();
/// batch.claimed("s", "a", true, t); // the statement returned a (fresh), not b
/// assert_eq!(batch.unclaimed().len(), 1);
/// let age = Duration::from_secs(90);
/// batch.live("s", "b", t, age); // b's live claim, read afterwards
/// let claims = batch.finish();
/// assert_eq!(claims[0], Claim::Fresh);
/// assert_eq!(claims[1], Claim::Duplicate { expires_at: t, age });
/// let repeat = Claim::Duplicate { expires_at: t, age: Duration::ZERO };
/// assert_eq!(claims[2], repeat, "a repeat of a, claimed just now");
/// # Ok::<(), dedup_core::KeyError>(())
/// ```
#[derive(Debug)]
pub struct BatchClaims<'k> {
    keys: &'k [DedupKey],
    /// Index into `distinct` of each distinct (scope, id).
    index: HashMap<(&'k str, &'k str), usize>,
    distinct: Vec<&'k DedupKey>,
    /// Per distinct key: `Some(true)` fresh, `Some(false)` reclaimed.
    taken: Vec<Option<bool>>,
    expires_at: Vec<Option<SystemTime>>,
    /// Per distinct key read as live: its claim's age.
    ages: Vec<Option<Duration>>,
}

impl<'k> BatchClaims<'k> {
    /// Starts a batch claim of `keys`, in their order.
    pub fn new(keys: &'k [DedupKey]) -> Self {
        let mut index = HashMap::with_capacity(keys.len());
        let mut distinct = Vec::with_capacity(keys.len());
        for key in keys {
            index.entry((key.scope(), key.id())).or_insert_with(|| {
                distinct.push(key);
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
        }
    }

    /// The distinct keys, in first-seen order: what the claim statement gets.
    pub fn distinct(&self) -> &[&'k DedupKey] {
        &self.distinct
    }

    /// Records a row the claim statement returned: the claim was taken.
    pub fn claimed(&mut self, scope: &str, id: &str, fresh: bool, expires_at: SystemTime) {
        if let Some(&i) = self.index.get(&(scope, id)) {
            self.taken[i] = Some(fresh);
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

    /// Records the expiry and age of a live claim.
    pub fn live(&mut self, scope: &str, id: &str, expires_at: SystemTime, age: Duration) {
        if let Some(&i) = self.index.get(&(scope, id)) {
            self.expires_at[i] = Some(expires_at);
            self.ages[i] = Some(age);
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
                    (Some(true), false) => Claim::Fresh,
                    (Some(false), false) => Claim::Reclaimed,
                    _ => Claim::Duplicate { expires_at, age },
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

/// A TTL as the signed seconds SQL parameters take. A TTL is at most 100
/// years, far inside `i64`.
pub fn ttl_seconds(ttl: Ttl) -> i64 {
    i64::try_from(ttl.as_secs()).expect("a TTL fits in i64 seconds")
}
