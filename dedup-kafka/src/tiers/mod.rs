//! Retry tiers: a transiently failing event waits in a tier topic while
//! its partition moves on.
//!
//! After a few short attempts in place, an event whose handler keeps
//! failing transiently is produced to the route's next tier
//! (`<topic>.retry-<name>`) with headers saying why, when it is due, how
//! many attempts it has had and where it came from; the move is recorded in
//! the store like a dead letter (a claim per partition offset), so a
//! redelivery of the original neither moves it twice nor applies it. The
//! tier's consumer reads a record and, while it is not yet due, pauses that
//! partition at the broker until it is: a tier holding a million waiting
//! events costs no CPU. The last tier's failure dead-letters the event.
//! Failures that are the environment's (an outage, a timeout) never go to a
//! tier: they are waited out in place.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::message::{Message as _, OwnedMessage};

mod checks;
mod trust;

pub(crate) use checks::{check_topics, refuse_short_ttl};

pub(crate) use trust::{Claimed, FORGED, forged};
pub use trust::{RETRY_SIGNATURE_HEADER, TierKey};

use crate::Error;

/// Which tier a record is in (its name).
pub const RETRY_TIER_HEADER: &str = "dedup.retry.tier";
/// When a tier's record is due, in milliseconds since the Unix epoch.
pub const RETRY_DUE_HEADER: &str = "dedup.retry.due";
/// Attempts the event has had in all, across the origin and its tiers.
pub const RETRY_ATTEMPT_HEADER: &str = "dedup.retry.attempt";
/// Set on a copy `dedup retry release` sends back to the origin topic
/// (`<tier>/<partition>/<offset>`): the copy stands for its origin (its
/// `dedup.origin.*`), so it is applied before the later events of its key
/// that follow it under key hold-back, and lets its key go.
pub const RETRY_RELEASED_HEADER: &str = "dedup.retry.released";
/// The event's origin: its topic, partition, offset and timestamp (ms)
/// before its first move; kept as it moves on, and read back into a dead
/// letter's `dedup.original.*` so that `dedup dlq replay` sends it home.
pub const ORIGIN_HEADERS: [&str; 4] = [
    "dedup.origin.topic",
    "dedup.origin.partition",
    "dedup.origin.offset",
    "dedup.origin.timestamp",
];

/// How long a tier's records wait, and what they are called.
///
/// ```
/// use std::time::Duration;
/// use dedup_kafka::{RetryTier, RetryTiers};
///
/// // payments.retry-30s, payments.retry-5m, then payments.dlq.
/// let tiers = RetryTiers::new(["30s", "5m"]).unwrap();
/// // Named, with a topic of one's own ({topic}: the handled topic).
/// let named = RetryTiers::from_tiers([
///     RetryTier::new("soon", Duration::from_secs(10)),
///     RetryTier::new("later", Duration::from_secs(600)).topic("{topic}.later"),
/// ])
/// .unwrap()
/// .attempts_in_place(3);
/// # let _ = (tiers, named);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryTier {
    name: String,
    delay: Duration,
    topic: String,
}

impl RetryTier {
    /// A tier called `name` whose records wait `delay`, in topic
    /// `<topic>.retry-<name>` unless [`topic`](Self::topic) names another.
    pub fn new(name: impl Into<String>, delay: Duration) -> Self {
        RetryTier {
            name: name.into(),
            delay,
            topic: "{topic}.retry-{name}".to_owned(),
        }
    }

    /// The tier's topic; `{topic}` stands for the handled topic and
    /// `{name}` for the tier's name.
    pub fn topic(mut self, pattern: impl Into<String>) -> Self {
        self.topic = pattern.into();
        self
    }

    /// Its name (the `tier` label of its metrics, the `dedup.retry.tier`
    /// header).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long its records wait.
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Its topic for the handled topic `topic`.
    pub fn topic_for(&self, topic: &str) -> String {
        self.topic
            .replace("{topic}", topic)
            .replace("{name}", &self.name)
    }
}

/// Who reads a consumer's retry tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReadTiers {
    /// This consumer reads its topics and their tiers (the default): the
    /// tiers' routes are added for it.
    #[default]
    Here,
    /// This consumer moves events to the tiers; another process, built
    /// with [`Only`](Self::Only) and the same handlers, reads them.
    Elsewhere,
    /// This consumer reads only the tiers of its handled topics (the
    /// other process of [`Elsewhere`](Self::Elsewhere)).
    Only,
}

/// The retry tiers of a consumer's handled topics
/// ([`ConsumerBuilder::retry_tiers`](crate::ConsumerBuilder::retry_tiers)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryTiers {
    tiers: Vec<RetryTier>,
    /// `None`: the runtime's default.
    attempts: Option<u32>,
    read: ReadTiers,
    hold_keys: bool,
    key: Option<TierKey>,
    require_signatures: bool,
}

/// Attempts in place before an event moves on, by default, in the
/// database runtime: with the default back-off (100 ms doubling) about
/// 0.7 s of waits in all, during which the event's partition waits.
pub const DEFAULT_ATTEMPTS_IN_PLACE: u32 = 4;

/// The same in the Kafka-only runtime: one. Its batch spans every
/// partition the member reads and commits as one transaction, so an
/// attempt's back-off there holds all of them, not one partition.
pub const KAFKA_ONLY_ATTEMPTS_IN_PLACE: u32 = 1;

impl RetryTiers {
    /// Tiers named by their delays (`"30s"`, `"5m"`, `"1h"`), in the
    /// order an event goes through them.
    pub fn new<I>(delays: I) -> Result<Self, Error>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut tiers = Vec::new();
        for delay in delays {
            let name = delay.as_ref().trim();
            let parsed = dedup_core::Ttl::parse(name)
                .map_err(|e| Error::Config(format!("retry tier {name:?} is not a delay: {e}")))?;
            tiers.push(RetryTier::new(name, parsed.into()));
        }
        Self::from_tiers(tiers)
    }

    /// Tiers as given, in the order an event goes through them.
    pub fn from_tiers(tiers: impl IntoIterator<Item = RetryTier>) -> Result<Self, Error> {
        let tiers: Vec<RetryTier> = tiers.into_iter().collect();
        if tiers.is_empty() {
            return Err(Error::Config(
                "retry tiers: name at least one (e.g. [\"30s\", \"5m\"])".into(),
            ));
        }
        for (i, tier) in tiers.iter().enumerate() {
            let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
            if tier.name.is_empty() || !tier.name.chars().all(valid) {
                return Err(Error::Config(format!(
                    "retry tier name {:?}: use letters, digits, '.', '_' and '-' (it is part of \
                     a topic's name)",
                    tier.name
                )));
            }
            if tier.delay.is_zero() {
                return Err(Error::Config(format!(
                    "retry tier {:?} has no delay",
                    tier.name
                )));
            }
            if !tier.topic.contains("{topic}") {
                return Err(Error::Config(format!(
                    "retry tier {:?}: its topic {:?} must contain {{topic}} (each handled \
                     topic has its own tiers)",
                    tier.name, tier.topic
                )));
            }
            if tiers[..i].iter().any(|t| t.name == tier.name) {
                return Err(Error::Config(format!(
                    "two retry tiers are named {:?}",
                    tier.name
                )));
            }
        }
        Ok(RetryTiers {
            tiers,
            attempts: None,
            read: ReadTiers::Here,
            hold_keys: false,
            key: None,
            require_signatures: true,
        })
    }

    /// Attempts of a transiently failing event before it moves to the next
    /// tier (or, from the last, to the dead-letter topic), at the origin
    /// and in each tier (default [`DEFAULT_ATTEMPTS_IN_PLACE`], in the
    /// Kafka-only runtime [`KAFKA_ONLY_ATTEMPTS_IN_PLACE`]; at least 1).
    /// They wait the consumer's [`RetryPolicy`](crate::RetryPolicy)
    /// back-off.
    pub fn attempts_in_place(mut self, attempts: u32) -> Self {
        self.attempts = Some(attempts.max(1));
        self
    }

    /// Keeps each key's order (default: off). While an event of an
    /// ordering key (the record's key, or what
    /// [`order_by`](crate::ConsumerBuilder::order_by) names) waits in a
    /// tier, the later events of that key in its partition follow it into
    /// the tiers, without attempts, and are applied after it, in order; the
    /// other keys are not held back. What is in the tiers is recorded in
    /// the store, so the hold survives restarts. Off, a later event of the
    /// key is applied as soon as it comes, before the one waiting in a tier
    /// (as Spring Kafka's retry topics do).
    pub fn hold_keys(mut self, hold: bool) -> Self {
        self.hold_keys = hold;
        self
    }

    /// Whether a tier's record, or a copy released home, without a valid
    /// signature of the [`signing_key`](Self::signing_key) is dead-lettered
    /// (default: true). Set it false while a key is rolled out or changed:
    /// moves are signed, signatures are not checked (the other checks
    /// still are). Once every process signs with the key and the records
    /// moved before have left the tiers (the tiers' delays together after
    /// the last process was deployed), set it back.
    pub fn require_signatures(mut self, require: bool) -> Self {
        self.require_signatures = require;
        self
    }

    /// Signs the records moved to the tiers with `key`, and dead-letters a
    /// tier's record, or a copy released home, that does not carry its
    /// signature (default: none; see [`TierKey`]). Without a key, a
    /// record's tier headers are still read only when they fit where it
    /// was read (its origin on the tier's handled topic and partition, a
    /// released copy's on its own, earlier); with one, a producer without
    /// the key cannot release a held key or name another origin either.
    /// Records already in the tiers unsigned are dead-lettered once a key
    /// is set: set it while the tiers are empty, or replay those.
    pub fn signing_key(mut self, key: TierKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Who reads the tiers (default: this consumer).
    pub fn read(mut self, read: ReadTiers) -> Self {
        self.read = read;
        self
    }

    /// The tiers, in order.
    pub fn tiers(&self) -> &[RetryTier] {
        &self.tiers
    }

    pub(crate) fn holds_keys(&self) -> bool {
        self.hold_keys
    }

    pub(crate) fn reader(&self) -> ReadTiers {
        self.read
    }

    /// The tiers of handled topic `topic`, whose events `order_by` orders,
    /// with `attempts` in place unless set.
    pub(crate) fn of(
        &self,
        topic: &str,
        order_by: crate::OrderBy,
        attempts: u32,
    ) -> std::sync::Arc<TopicTiers> {
        std::sync::Arc::new(TopicTiers {
            origin: topic.to_owned(),
            hold_keys: self.hold_keys,
            order_by,
            attempts: self.attempts.unwrap_or(attempts),
            key: self.key.clone(),
            require_signatures: self.require_signatures,
            tiers: self
                .tiers
                .iter()
                .map(|t| TierTopic {
                    name: t.name.clone(),
                    topic: t.topic_for(topic),
                    delay: t.delay,
                    key: self.key.clone(),
                })
                .collect(),
        })
    }
}

/// The tiers of one handled topic.
#[derive(Debug)]
pub(crate) struct TopicTiers {
    /// The handled topic.
    pub(crate) origin: String,
    /// Whether later events of a key follow one in a tier.
    pub(crate) hold_keys: bool,
    /// What orders the handled topic's events (the key held).
    pub(crate) order_by: crate::OrderBy,
    pub(crate) attempts: u32,
    /// Signs the tiers' records.
    pub(crate) key: Option<TierKey>,
    /// Whether records without its signature are forged.
    pub(crate) require_signatures: bool,
    pub(crate) tiers: Vec<TierTopic>,
}

/// One tier of one handled topic.
#[derive(Debug)]
pub(crate) struct TierTopic {
    pub(crate) name: String,
    pub(crate) topic: String,
    pub(crate) delay: Duration,
    pub(crate) key: Option<TierKey>,
}

impl TopicTiers {
    /// What `msg` says it is, read from tier `at` (`None`: the handled
    /// topic): a tier's record, or a copy released home; `None` for an
    /// ordinary record. One reading for both runtimes.
    pub(crate) fn claimed(&self, at: Option<usize>, msg: &OwnedMessage) -> Option<Claimed<'_>> {
        match at {
            Some(at) => Some(Claimed::Tier {
                origin: &self.origin,
                tier: &self.tiers[at].name,
            }),
            None => released(msg).then_some(Claimed::Released),
        }
    }

    /// Why `msg`, read from tier `at`, has tier headers that are not its
    /// own (`trust::forged`, the signature checked if required), if it has
    /// such headers and they are not: it is then dead-lettered as itself.
    pub(crate) fn forged(&self, at: Option<usize>, msg: &OwnedMessage) -> Option<String> {
        let checking = self.key.as_ref().filter(|_| self.require_signatures);
        forged(msg, self.claimed(at, msg)?, checking)
    }

    /// Whether `msg`, read from tier `at`, is a tier's record or a released
    /// copy whose headers are its own: its `dedup.origin.*` and
    /// `dedup.retry.attempt` tell its story.
    pub(crate) fn trusts_origin(&self, at: Option<usize>, msg: &OwnedMessage) -> bool {
        self.claimed(at, msg).is_some() && self.forged(at, msg).is_none()
    }

    /// Whether `msg`, read from the handled topic, is a copy released home
    /// whose headers are its own: it stands for its origin.
    pub(crate) fn trusted_release(&self, msg: &OwnedMessage) -> bool {
        released(msg) && self.forged(None, msg).is_none()
    }
}

impl TierTopic {
    /// When a record moved to this tier now is due (ms since the epoch).
    pub(crate) fn due_from_now(&self) -> i64 {
        now_ms().saturating_add(self.delay.as_millis().min(i64::MAX as u128) as i64)
    }

    /// The move of `msg` to this tier, due at `due_ms`, after `attempts`
    /// where it was read (`from_headers`: a tier, or a released copy, whose
    /// `dedup.retry.attempt` counts those before).
    pub(crate) fn moved(
        &self,
        msg: &OwnedMessage,
        from_headers: bool,
        attempts: u32,
        due_ms: i64,
    ) -> Moved<'_> {
        Moved {
            tier: &self.name,
            due_ms,
            attempts: attempts_before(msg, from_headers).saturating_add(attempts),
            key: self.key.as_ref(),
        }
    }
}

/// A move to a retry tier.
pub(crate) struct Moved<'a> {
    /// The tier's name.
    pub(crate) tier: &'a str,
    /// When the moved record is due (ms since the Unix epoch).
    pub(crate) due_ms: i64,
    /// Attempts in all so far, across the origin and the tiers.
    pub(crate) attempts: u32,
    /// Signs the moved record, if the tiers have a key.
    pub(crate) key: Option<&'a TierKey>,
}

/// Where a route stands among its topic's tiers: the handled topic
/// (`at: None`) or one of its tiers.
#[derive(Debug, Clone)]
pub(crate) struct Place {
    pub(crate) tiers: std::sync::Arc<TopicTiers>,
    pub(crate) at: Option<usize>,
}

impl Place {
    /// Where a transiently failing event of this route goes next; `None`
    /// from the last tier (the dead-letter topic).
    pub(crate) fn next(&self) -> Option<&TierTopic> {
        self.tiers.tiers.get(self.at.map_or(0, |i| i + 1))
    }

    /// Whether the route reads a tier.
    pub(crate) fn is_tier(&self) -> bool {
        self.at.is_some()
    }
}

/// Where an event came from before any move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) timestamp: Option<i64>,
}

/// A header's value as text.
pub(crate) fn header<'m>(msg: &'m OwnedMessage, key: &str) -> Option<&'m str> {
    trust::last(msg.headers(), key).and_then(|v| std::str::from_utf8(v).ok())
}

/// `msg`'s origin: the message itself, or (`from_headers`: read from a
/// tier, or released from one) what its `dedup.origin.*` headers say (the
/// message itself if they are missing or unreadable).
pub(crate) fn origin_of(msg: &OwnedMessage, from_headers: bool) -> Origin {
    let own = || Origin {
        topic: msg.topic().to_owned(),
        partition: msg.partition(),
        offset: msg.offset(),
        timestamp: msg.timestamp().to_millis(),
    };
    if !from_headers {
        return own();
    }
    let [topic, partition, offset, timestamp] = ORIGIN_HEADERS;
    let read = || {
        Some(Origin {
            topic: header(msg, topic).filter(|t| !t.is_empty())?.to_owned(),
            partition: header(msg, partition)?.parse().ok()?,
            offset: header(msg, offset)?.parse().ok()?,
            timestamp: header(msg, timestamp).and_then(|t| t.parse().ok()),
        })
    };
    read().unwrap_or_else(own)
}

/// Whether `msg` is a copy `dedup retry release` sent home.
pub(crate) fn released(msg: &OwnedMessage) -> bool {
    header(msg, RETRY_RELEASED_HEADER).is_some()
}

/// Attempts `msg` had before it came to this route (`from_headers`: read
/// from a tier, or released from one; else 0).
pub(crate) fn attempts_before(msg: &OwnedMessage, from_headers: bool) -> u32 {
    match from_headers {
        true => header(msg, RETRY_ATTEMPT_HEADER)
            .and_then(|a| a.parse().ok())
            .unwrap_or(0),
        false => 0,
    }
}

/// Milliseconds since the Unix epoch, now.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// How long until a tier's record is due; zero if it is, or says no due
/// time. Never later than its tier's `delay` after the record was written
/// (its timestamp: the move's time): a later due time (a forged header, a
/// clock that jumped back) would only stall the tier's partition. The bound
/// is a fixed time, so reading the record again after a pause does not
/// move it; a record without a timestamp, or one ahead of this clock, is
/// refused (`trust::forged`) and due now.
pub(crate) fn due_in(msg: &OwnedMessage, delay: Duration) -> Duration {
    let Some(due) = header(msg, RETRY_DUE_HEADER).and_then(|d| d.parse::<i64>().ok()) else {
        return Duration::ZERO;
    };
    let delay_ms = delay.as_millis().min(i64::MAX as u128) as i64;
    // One without a timestamp is not the runtime's (`trust::forged`): due.
    let latest = msg
        .timestamp()
        .to_millis()
        .map_or(i64::MIN, |written| written.saturating_add(delay_ms));
    Duration::from_millis(due.min(latest).saturating_sub(now_ms()).max(0) as u64)
}

/// Waits shorter than this do not pause a tier's partition: the database
/// runtime sleeps them, the Kafka-only runtime runs the record that much
/// early.
pub(crate) const PAUSE_FROM: Duration = Duration::from_millis(200);

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders};

    /// A tier's record written (moved) now.
    fn message(headers: &[(&str, &str)]) -> OwnedMessage {
        message_at(now_ms(), headers)
    }

    /// A tier's record written at `written` (ms).
    fn message_at(written: i64, headers: &[(&str, &str)]) -> OwnedMessage {
        let mut owned = OwnedHeaders::new();
        for (key, value) in headers {
            owned = owned.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "payments.retry-30s".into(),
            rdkafka::Timestamp::CreateTime(written),
            3,
            17,
            Some(owned),
        )
    }

    #[test]
    fn tiers_are_named_by_their_delays_and_checked() {
        let tiers = RetryTiers::new(["30s", "5m", "1h"]).unwrap();
        let of = tiers.of(
            "payments",
            crate::OrderBy::default(),
            DEFAULT_ATTEMPTS_IN_PLACE,
        );
        let topics: Vec<(&str, &str, u64)> = of
            .tiers
            .iter()
            .map(|t| (t.name.as_str(), t.topic.as_str(), t.delay.as_secs()))
            .collect();
        assert_eq!(
            topics,
            [
                ("30s", "payments.retry-30s", 30),
                ("5m", "payments.retry-5m", 300),
                ("1h", "payments.retry-1h", 3600)
            ]
        );
        assert_eq!(of.attempts, DEFAULT_ATTEMPTS_IN_PLACE);
        let place = |at| Place {
            tiers: of.clone(),
            at,
        };
        assert_eq!(place(None).next().unwrap().name, "30s");
        assert_eq!(place(Some(1)).next().unwrap().name, "1h");
        assert!(place(Some(2)).next().is_none(), "the last goes to the DLQ");

        for bad in [&["soon"][..], &[][..], &["30s", "30s"][..], &["0s"][..]] {
            assert!(RetryTiers::new(bad).is_err(), "{bad:?}");
        }
        let slash = RetryTiers::from_tiers([RetryTier::new("a/b", Duration::from_secs(1))]);
        assert!(slash.is_err());
        let fixed = RetryTiers::from_tiers([
            RetryTier::new("x", Duration::from_secs(1)).topic("all-retries")
        ]);
        assert!(fixed.is_err(), "one topic for every handled topic");
        let own = RetryTier::new("later", Duration::from_secs(600)).topic("{topic}.{name}.q");
        assert_eq!(own.topic_for("orders"), "orders.later.q");
    }

    #[test]
    fn a_tiers_record_says_its_origin_attempts_and_due_time() {
        let moved = message(&[
            ("dedup.origin.topic", "payments"),
            ("dedup.origin.partition", "1"),
            ("dedup.origin.offset", "99"),
            ("dedup.origin.timestamp", "500"),
            (RETRY_ATTEMPT_HEADER, "4"),
            (RETRY_DUE_HEADER, &(now_ms() + 60_000).to_string()),
        ]);
        assert_eq!(
            origin_of(&moved, true),
            Origin {
                topic: "payments".into(),
                partition: 1,
                offset: 99,
                timestamp: Some(500)
            }
        );
        // Read at the origin (a dead letter replayed home), it is itself.
        assert_eq!(origin_of(&moved, false).offset, 17);
        assert_eq!(attempts_before(&moved, true), 4);
        assert_eq!(attempts_before(&moved, false), 0);
        let wait = due_in(&moved, Duration::from_secs(3600));
        assert!(wait > Duration::from_secs(58) && wait <= Duration::from_secs(60));

        let bare = message(&[(RETRY_DUE_HEADER, "not a time")]);
        assert_eq!(origin_of(&bare, true).topic, "payments.retry-30s");
        assert_eq!(
            due_in(&bare, Duration::MAX),
            Duration::ZERO,
            "unreadable: due now"
        );
        let past = message(&[(RETRY_DUE_HEADER, "5")]);
        assert_eq!(due_in(&past, Duration::MAX), Duration::ZERO);
        // Never later than the tier's delay after the record was written,
        // whatever its due time says, and read again later the bound stays.
        let a_day = (now_ms() + 86_400_000).to_string();
        let far = message(&[(RETRY_DUE_HEADER, &a_day)]);
        let wait = due_in(&far, Duration::from_secs(30));
        assert!(
            wait > Duration::from_secs(29) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
        let written_long_ago = message_at(now_ms() - 3_600_000, &[(RETRY_DUE_HEADER, &a_day)]);
        assert_eq!(
            due_in(&written_long_ago, Duration::from_secs(30)),
            Duration::ZERO
        );
    }
}
