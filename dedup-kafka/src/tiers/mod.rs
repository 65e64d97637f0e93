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

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::message::{Headers as _, Message as _, OwnedMessage};

mod trust;

pub(crate) use trust::{Claimed, FORGED, forged};
pub use trust::{RETRY_SIGNATURE_HEADER, TierKey};

use crate::Error;
use crate::partition::Runtime;
use crate::partition::state::Partition;

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
    /// Signs and checks the tiers' records.
    pub(crate) key: Option<TierKey>,
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
    ) -> crate::dlq::Moved<'_> {
        crate::dlq::Moved {
            tier: &self.name,
            due_ms,
            attempts: attempts_before(msg, from_headers).saturating_add(attempts),
            key: self.key.as_ref(),
        }
    }
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
/// time. Never longer than its tier's `delay`: a record moved there was due
/// at most that long after its move, so a later due time (a forged header,
/// or a clock that jumped back) would only stall the tier's partition.
pub(crate) fn due_in(msg: &OwnedMessage, delay: Duration) -> Duration {
    let Some(due) = header(msg, RETRY_DUE_HEADER).and_then(|d| d.parse::<i64>().ok()) else {
        return Duration::ZERO;
    };
    Duration::from_millis(due.saturating_sub(now_ms()).max(0) as u64).min(delay)
}

/// The start-up check: each retry tier's topic exists with at least as
/// many partitions as its handled topic (a move keeps its origin's
/// partition), exactly as many if `exact` (the Kafka-only runtime reads a
/// tier's partition with its input's). A handled topic that cannot be read
/// is left to the consumer; a broker that does not answer is only warned
/// about.
pub(crate) async fn check_topics(
    admin: &rdkafka::ClientConfig,
    tiers: Vec<std::sync::Arc<TopicTiers>>,
    exact: bool,
) -> Result<(), Error> {
    if tiers.is_empty() {
        return Ok(());
    }
    let admin = admin.clone();
    let counted = tokio::task::spawn_blocking(move || {
        let client: rdkafka::consumer::BaseConsumer = admin.create()?;
        let mut out = Vec::new();
        for topic in &tiers {
            let count = |name: &str| -> Result<usize, rdkafka::error::KafkaError> {
                let metadata = rdkafka::consumer::Consumer::fetch_metadata(
                    &client,
                    Some(name),
                    Duration::from_secs(10),
                )?;
                let Some(topic) = metadata.topics().iter().find(|t| t.name() == name) else {
                    return Ok(0);
                };
                match topic.error() {
                    None => Ok(topic.partitions().len()),
                    Some(
                        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
                    ) => Ok(0),
                    // Not authorized, no leader yet...: not known to be missing.
                    Some(e) => Err(rdkafka::error::KafkaError::MetadataFetch(e.into())),
                }
            };
            let origin = count(&topic.origin)?;
            for tier in &topic.tiers {
                out.push((
                    topic.origin.clone(),
                    origin,
                    tier.topic.clone(),
                    count(&tier.topic)?,
                ));
            }
        }
        Ok::<_, rdkafka::error::KafkaError>(out)
    })
    .await
    .map_err(|e| Error::Fatal(format!("checking the retry tiers' topics: {e}")))?;
    let counted = match counted {
        Ok(counted) => counted,
        Err(e) => {
            tracing::warn!(error = %e, "cannot check the retry tiers' topics");
            return Ok(());
        }
    };
    for (origin, partitions, tier, has) in counted {
        if partitions == 0 {
            continue;
        }
        if has < partitions || (exact && has != partitions) {
            let what = match has {
                0 => "does not exist".to_owned(),
                n => format!("has {n} partitions"),
            };
            let why = match exact {
                true => "a tier's partition is read with its input partition",
                false => "a move keeps its origin's partition",
            };
            return Err(Error::Config(format!(
                "the retry tier's topic {tier:?} {what}: create it with {partitions} \
                 partitions, as many as {origin:?} ({why})"
            )));
        }
    }
    Ok(())
}

/// Refuses handler `scope`'s TTL when it is not longer than an event's way
/// through its topic's tiers: the tiers' delays together, and under key
/// hold-back one more round of the last tier (an event that follows
/// another may wait a round there after the one it follows finishes).
/// Its claim (and its hold record) would then expire while the event
/// waits in a tier: a duplicate applied at the origin meanwhile would have
/// lapsed when the tier's copy is applied, which is applied again, and a
/// lapsed hold would let the key's later events pass it.
pub(crate) fn refuse_short_ttl(
    scope: &str,
    ttl: dedup_core::Ttl,
    tiers: &TopicTiers,
) -> Result<(), Error> {
    let mut legs: Vec<Duration> = tiers.tiers.iter().map(|t| t.delay).collect();
    if tiers.hold_keys
        && let Some(last) = legs.last().copied()
    {
        legs.push(last);
    }
    let path: Duration = legs.iter().sum();
    if ttl.as_duration() > path {
        return Ok(());
    }
    let sum = legs
        .iter()
        .map(|d| shown(*d))
        .collect::<Vec<_>>()
        .join(" + ");
    let hold = match tiers.hold_keys {
        true => ", the last counted twice under key hold-back",
        false => "",
    };
    Err(Error::Config(format!(
        "handler {scope:?} of {:?}: its TTL {ttl} is not longer than the way through its retry \
         tiers ({sum} = {}{hold}): a claim would expire while its event waits in a tier, and \
         a duplicate could be applied twice; give the TTL more than {} or shorten the tiers",
        tiers.origin,
        shown(path),
        shown(path),
    )))
}

/// A delay in the TTL grammar (`1h5m30s`) where it is whole seconds.
fn shown(delay: Duration) -> String {
    match dedup_core::Ttl::from_secs(delay.as_secs()) {
        Some(ttl) if delay.subsec_nanos() == 0 => ttl.to_string(),
        _ => format!("{delay:?}"),
    }
}

/// Waits shorter than this do not pause a tier's partition: the database
/// runtime sleeps them, the Kafka-only runtime runs the record that much
/// early.
pub(crate) const PAUSE_FROM: Duration = Duration::from_millis(200);

/// Waits until `msg`, the next record of a tier's partition, is due: the
/// partition is paused at the broker meanwhile (nothing more is fetched of
/// it) and resumed after. `false` if the consumer stops or the partition
/// is revoked or released first.
pub(crate) async fn until_due<S>(
    shared: &Runtime<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    delay: Duration,
) -> bool {
    let wait = due_in(msg, delay);
    if wait.is_zero() {
        return true;
    }
    // A short wait is slept: pausing would make librdkafka drop and fetch
    // again what it had fetched of the partition.
    if wait < PAUSE_FROM {
        return crate::partition::wait_unless_stopped(shared, partition, wait).await;
    }
    tracing::debug!(
        offset = msg.offset(),
        ?wait,
        "waiting until the tier's record is due"
    );
    partition.due_wait.store(true, Ordering::SeqCst);
    partition.due_at_ms.store(
        now_ms().saturating_add(wait.as_millis() as i64),
        Ordering::Relaxed,
    );
    // The consumer loop pauses and resumes it: only it calls librdkafka's
    // pause and resume, in the order they are asked for.
    let ask = |pace| {
        let _ = shared
            .drained
            .send((partition.topic.clone(), partition.partition, pace));
    };
    ask(crate::partition::Pace::WaitDue);
    let due = crate::partition::wait_unless_stopped(shared, partition, wait).await;
    partition.due_wait.store(false, Ordering::SeqCst);
    partition.due_at_ms.store(0, Ordering::Relaxed);
    // Resumed unless its queue is still over half its bound (then the
    // worker asks again once it has drained).
    ask(crate::partition::Pace::Drained);
    due
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders};

    fn message(headers: &[(&str, &str)]) -> OwnedMessage {
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
            rdkafka::Timestamp::CreateTime(1_000),
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

    /// A TTL the tiers' way can outlive is refused, with the sum in the
    /// error; under key hold-back the last tier counts twice.
    #[test]
    fn a_ttl_not_longer_than_the_tiers_way_is_refused() {
        let ttl = |s: &str| dedup_core::Ttl::parse(s).unwrap();
        let tiers = RetryTiers::new(["30s", "5m", "1h"]).unwrap();
        let of = tiers.of("payments", crate::OrderBy::default(), 1);
        let err = refuse_short_ttl("pay", ttl("1h"), &of)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("TTL 1h is not longer") && err.contains("30s + 5m + 1h = 1h5m30s"),
            "{err}"
        );
        assert!(
            refuse_short_ttl("pay", ttl("1h5m30s"), &of).is_err(),
            "equal"
        );
        assert!(refuse_short_ttl("pay", ttl("1h5m31s"), &of).is_ok());
        let held = tiers
            .hold_keys(true)
            .of("payments", crate::OrderBy::default(), 1);
        let err = refuse_short_ttl("pay", ttl("2h"), &held)
            .unwrap_err()
            .to_string();
        assert!(err.contains("30s + 5m + 1h + 1h = 2h5m30s"), "{err}");
        assert!(refuse_short_ttl("pay", ttl("3h"), &held).is_ok());
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
        let far = message(&[(RETRY_DUE_HEADER, &(now_ms() + 86_400_000).to_string())]);
        assert_eq!(
            due_in(&far, Duration::from_secs(30)),
            Duration::from_secs(30),
            "never longer than the tier's delay"
        );
    }
}
