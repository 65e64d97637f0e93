//! The consumer's counters.

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Counters of a running consumer.
#[derive(Debug)]
pub struct Stats {
    pub(crate) applied: AtomicU64,
    pub(crate) skipped: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) batch_replays: AtomicU64,
    pub(crate) outages: AtomicU64,
    pub(crate) assignments: AtomicU64,
    pub(crate) already_dead_lettered: AtomicU64,
    pub(crate) redelivered: AtomicU64,
    pub(crate) revoked_partitions: AtomicU64,
    pub(crate) ignored: AtomicU64,
    pub(crate) moved: AtomicU64,
    pub(crate) already_moved: AtomicU64,
    /// Partitions waiting out a failure of the environment right now.
    waiting_out: AtomicU64,
    /// When the current outage began, in milliseconds since `started`.
    outage_since_ms: AtomicU64,
    started: Instant,
    /// Milliseconds since `started` of the last assignment, message received
    /// or message finished; `u64::MAX` until the first assignment.
    last_activity_ms: AtomicU64,
    /// Messages handed to partition workers and not yet finished or given
    /// up; while any are, the consumer is not idle however long they take.
    in_flight: AtomicI64,
    /// What health reports, kept by the consumer loop's refresh.
    pub(crate) health: HealthState,
}

/// The state behind [`Stats::health`].
#[derive(Debug, Default)]
pub(crate) struct HealthState {
    /// Milliseconds since `started` of the consumer loop's last turn.
    pub(crate) last_poll_ms: AtomicU64,
    pub(crate) running: AtomicBool,
    pub(crate) assigned: AtomicU64,
    pub(crate) paused: AtomicU64,
    pub(crate) oldest_in_flight_ms: AtomicU64,
    pub(crate) store_answered: AtomicBool,
    pub(crate) fatal: Mutex<Option<String>>,
}

/// How long the consumer loop may go without a turn before the consumer
/// counts as not live (it is stuck, and its group will soon drop it).
pub const LIVE_POLL_LIMIT: Duration = Duration::from_secs(30);

/// What a health probe needs to know of a consumer; see
/// [`is_live`](Health::is_live) and [`is_ready`](Health::is_ready).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Health {
    /// The consumer is running (`run`/`run_until` started and has not
    /// returned).
    pub running: bool,
    /// Partitions assigned to this member now.
    pub assigned_partitions: u64,
    /// Whether it has received an assignment from its group (possibly
    /// empty: a group with more members than partitions).
    pub joined: bool,
    /// How long since the consumer loop last turned (it turns at least
    /// once a second while running).
    #[serde(rename = "since_last_poll_seconds", serialize_with = "seconds")]
    pub since_last_poll: Duration,
    /// How long the longest-running partition has been on its current
    /// message or batch: a stuck message shows here long before lag does.
    #[serde(rename = "oldest_in_flight_seconds", serialize_with = "seconds")]
    pub oldest_in_flight: Duration,
    /// Partitions whose fetching is paused for back-pressure.
    pub paused_partitions: u64,
    /// Whether the store or broker is being waited out.
    pub outage: bool,
    /// Whether the store has answered since start.
    pub store_answered: bool,
    /// Why the consumer stopped, if it stopped with an error.
    pub fatal: Option<String>,
}

impl Health {
    /// For a liveness probe: running, no fatal error, and the consumer
    /// loop turned within [`LIVE_POLL_LIMIT`]. Not live: restart it.
    pub fn is_live(&self) -> bool {
        self.running && self.fatal.is_none() && self.since_last_poll < LIVE_POLL_LIMIT
    }

    /// For a readiness probe: live, joined its group, the store answered,
    /// and no outage is being waited out.
    pub fn is_ready(&self) -> bool {
        self.is_live() && self.joined && self.store_answered && !self.outage
    }
}

/// A duration as seconds, the unit of every duration dedup reports.
pub(crate) fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// A point-in-time copy of [`Stats`]; `Display` prints
/// `applied=N skipped=N dead_lettered=N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Messages whose effect was applied (claims taken and committed).
    pub applied: u64,
    /// Messages skipped as duplicates within the TTL.
    pub skipped: u64,
    /// Messages sent to a dead-letter topic.
    pub dead_lettered: u64,
    /// Retries of transient failures.
    pub retries: u64,
    /// Batches committed as one transaction (the Kafka-only consumer
    /// counts each transaction of a batch it splits because its records go
    /// one at a time).
    pub batches: u64,
    /// Batches rolled back and replayed message by message.
    pub batch_replays: u64,
    /// Outages of the environment (the database or broker unreachable,
    /// read-only, full...) waited out, counted once however many partitions
    /// waited.
    pub outages: u64,
    /// Partition assignments received from the group (1 for a consumer that
    /// joined once and never left; more after rebalances, or after it was
    /// dropped from its group and rejoined).
    pub assignments: u64,
    /// Redelivered messages skipped because they were dead-lettered before
    /// (a crash or a rebalance came between the dead letter and its offset
    /// commit): neither dead-lettered again nor applied.
    pub already_dead_lettered: u64,
    /// Duplicates skipped at the start of a partition's assignment, before
    /// its first applied event: messages a previous owner (another member,
    /// or this process before a restart) finished without committing their
    /// offsets, received again after the handover. Counted in `skipped` too.
    /// (A producer's duplicate that happens to come first after an
    /// assignment counts here as well.)
    pub redelivered: u64,
    /// Partitions taken from this member by rebalances (not counting its
    /// own shutdown). An eager rebalance revokes every partition and
    /// assigns most back; an incremental one (`cooperative-sticky`, the
    /// consumer protocol) revokes only those that move.
    pub revoked_partitions: u64,
    /// Messages of an event type no handler of their topic takes, skipped
    /// as `OtherTypes::Skip` says (not counted in `skipped`, which counts
    /// duplicates).
    pub ignored: u64,
    /// Messages moved to a retry tier (each move counted: an event moved
    /// through two tiers counts twice). Not counted in `dead_lettered`.
    pub moved: u64,
    /// Redelivered messages skipped because they were moved to a retry tier
    /// before (a crash or a rebalance came between the move and its offset
    /// commit): neither moved again nor applied here.
    pub already_moved: u64,
}

impl fmt::Display for StatsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "applied={} skipped={} dead_lettered={}",
            self.applied, self.skipped, self.dead_lettered
        )
    }
}

impl Stats {
    pub(crate) fn new() -> Self {
        Stats {
            applied: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batch_replays: AtomicU64::new(0),
            outages: AtomicU64::new(0),
            assignments: AtomicU64::new(0),
            already_dead_lettered: AtomicU64::new(0),
            redelivered: AtomicU64::new(0),
            revoked_partitions: AtomicU64::new(0),
            ignored: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            already_moved: AtomicU64::new(0),
            waiting_out: AtomicU64::new(0),
            outage_since_ms: AtomicU64::new(0),
            started: Instant::now(),
            last_activity_ms: AtomicU64::new(u64::MAX),
            in_flight: AtomicI64::new(0),
            health: HealthState::default(),
        }
    }

    /// The consumer's health now, for liveness and readiness probes.
    pub fn health(&self) -> Health {
        let h = &self.health;
        let stamp = |ms: &AtomicU64| Duration::from_millis(ms.load(Ordering::Acquire));
        Health {
            running: h.running.load(Ordering::Acquire),
            assigned_partitions: h.assigned.load(Ordering::Acquire),
            joined: self.assignments.load(Ordering::Acquire) > 0,
            since_last_poll: self.since(h.last_poll_ms.load(Ordering::Acquire)),
            oldest_in_flight: stamp(&h.oldest_in_flight_ms),
            paused_partitions: h.paused.load(Ordering::Acquire),
            outage: self.waiting_out() > 0,
            store_answered: h.store_answered.load(Ordering::Acquire),
            fatal: h.fatal.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }

    /// The consumer loop turned.
    pub(crate) fn polled(&self) {
        self.health
            .last_poll_ms
            .store(self.now_ms(), Ordering::Release);
    }

    /// The store answered a request.
    pub(crate) fn store_answered(&self) {
        self.health.store_answered.store(true, Ordering::Release);
    }

    /// Milliseconds since this consumer was created: the clock of the
    /// partitions' busy stamps.
    pub(crate) fn clock_ms(&self) -> u64 {
        self.now_ms()
    }

    /// How long ago a stamp of [`clock_ms`](Self::clock_ms) was.
    pub(crate) fn age_of(&self, stamp_ms: u64) -> Duration {
        self.since(stamp_ms)
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            applied: self.applied.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            batch_replays: self.batch_replays.load(Ordering::Relaxed),
            outages: self.outages.load(Ordering::Relaxed),
            assignments: self.assignments.load(Ordering::Relaxed),
            already_dead_lettered: self.already_dead_lettered.load(Ordering::Relaxed),
            redelivered: self.redelivered.load(Ordering::Relaxed),
            revoked_partitions: self.revoked_partitions.load(Ordering::Relaxed),
            ignored: self.ignored.load(Ordering::Relaxed),
            moved: self.moved.load(Ordering::Relaxed),
            already_moved: self.already_moved.load(Ordering::Relaxed),
        }
    }

    /// How many partitions are waiting out a failure of the environment
    /// right now (0 when all is well): worth a health check and an alert.
    pub fn waiting_out(&self) -> u64 {
        self.waiting_out.load(Ordering::Acquire)
    }

    /// A partition starts waiting out a failure of the environment. The
    /// first one logs the outage's start (once, not once per partition or
    /// attempt).
    pub(crate) fn enter_outage(&self, error: &dyn fmt::Display) {
        if self.waiting_out.fetch_add(1, Ordering::AcqRel) == 0 {
            self.outage_since_ms.store(self.now_ms(), Ordering::Release);
            self.outages.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                %error,
                "the environment failed (not the events' fault): pausing the partitions it \
                 affects and retrying until it answers; nothing is dead-lettered for it"
            );
        }
    }

    /// A partition got through (or stopped waiting). The last one logs the
    /// outage's end.
    pub(crate) fn leave_outage(&self) {
        if self.waiting_out.fetch_sub(1, Ordering::AcqRel) == 1 {
            let lasted = self.since(self.outage_since_ms.load(Ordering::Acquire));
            tracing::info!(?lasted, "the environment answers again: outage over");
        }
    }

    /// How long since a message was last received or finished, or since
    /// partitions were assigned. Zero until the first assignment: joining a
    /// group can take a while (a crashed member is waited for until its
    /// session times out), and that is not idleness. Zero, too, while any
    /// received message is unfinished: a long batch or a message being
    /// retried is work, not idleness.
    pub fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return Duration::ZERO;
        }
        match self.last_activity_ms.load(Ordering::Relaxed) {
            u64::MAX => Duration::ZERO,
            last => self.since(last),
        }
    }

    /// Milliseconds since `started`: how the stamps above are kept.
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// How long ago a stamp taken with [`now_ms`](Self::now_ms) was.
    fn since(&self, stamp_ms: u64) -> Duration {
        self.started
            .elapsed()
            .saturating_sub(Duration::from_millis(stamp_ms))
    }

    /// Messages received and not yet finished (applied, skipped or
    /// dead-lettered) nor given up for redelivery. A count that stays above
    /// zero while nothing is applied is a stuck partition (a message being
    /// retried, or a dead-letter topic that refuses it).
    pub fn in_flight(&self) -> u64 {
        u64::try_from(self.in_flight.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// `n` messages handed to workers (negative: finished or given up).
    pub(crate) fn add_in_flight(&self, n: i64) {
        let before = self.in_flight.fetch_add(n, Ordering::AcqRel);
        debug_assert!(before + n >= 0, "more messages counted out than in");
    }

    /// Activity now: idleness counts from here.
    pub(crate) fn touch(&self) {
        let now = self.now_ms();
        let _ = self
            .last_activity_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                (last == u64::MAX || last < now).then_some(now)
            });
    }
}

/// Counters of a running relay.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub(crate) published: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) running: AtomicBool,
    /// When the relay's loop last turned.
    pub(crate) last_turn: Mutex<Option<Instant>>,
    /// How long the loop may go without a turn and still be live.
    pub(crate) live_limit: Duration,
    /// Rounds in a row that published nothing of what they took, or could
    /// not read the outbox.
    pub(crate) failing_rounds: AtomicU32,
    /// Whether the last round could not read the outbox.
    pub(crate) store_failing: AtomicBool,
    pub(crate) store_answered: AtomicBool,
    pub(crate) fatal: Mutex<Option<String>>,
}

/// What a health probe needs to know of a relay; see
/// [`is_live`](Self::is_live) and [`is_ready`](Self::is_ready).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RelayHealth {
    /// `run`/`run_until` started and has not returned.
    pub running: bool,
    /// How long since the relay's loop last turned.
    #[serde(rename = "since_last_turn_seconds", serialize_with = "seconds")]
    pub since_last_turn: Duration,
    /// The longest the loop may take between turns while healthy (its
    /// timeouts and waits added up).
    #[serde(rename = "live_limit_seconds", serialize_with = "seconds")]
    pub live_limit: Duration,
    /// Rounds in a row in which nothing got through: the broker refuses
    /// or is down, only events that fail are pending (a poison event
    /// holds its key back; other keys go on), or the outbox is so slow
    /// that a batch's send window ran out before its first send.
    pub failing_rounds: u32,
    /// The last round could not read the outbox: the store is being
    /// waited out.
    pub outage: bool,
    /// Whether the outbox has answered since start.
    pub store_answered: bool,
    /// Why the relay stopped, if it stopped with an error.
    pub fatal: Option<String>,
}

impl RelayHealth {
    /// For a liveness probe: running, no fatal error, and the loop turned
    /// within its [`live_limit`](Self::live_limit). Not live: restart it.
    pub fn is_live(&self) -> bool {
        self.running && self.fatal.is_none() && self.since_last_turn < self.live_limit
    }

    /// For a readiness probe: live, the outbox answered, and its last round
    /// could read it. A broker that refuses the relay shows in
    /// [`failing_rounds`](Self::failing_rounds), not here: a poison event
    /// fails rounds the same way, and taking the relay out would not help.
    pub fn is_ready(&self) -> bool {
        self.is_live() && self.store_answered && !self.outage
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStatsSnapshot {
    /// Events the broker acknowledged and the outbox marked sent.
    pub published: u64,
    /// Publish attempts that failed (the events stay pending).
    pub failed: u64,
    /// Batches finished (each one lease and one marking transaction).
    pub batches: u64,
}

impl RelayStats {
    /// The counters now.
    pub fn snapshot(&self) -> RelayStatsSnapshot {
        RelayStatsSnapshot {
            published: self.published.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
        }
    }

    /// The relay's health now, for liveness and readiness probes.
    pub fn health(&self) -> RelayHealth {
        let last_turn = *self.last_turn.lock().unwrap_or_else(|p| p.into_inner());
        RelayHealth {
            running: self.running.load(Ordering::Acquire),
            since_last_turn: last_turn.map_or(Duration::ZERO, |at| at.elapsed()),
            live_limit: self.live_limit,
            failing_rounds: self.failing_rounds.load(Ordering::Acquire),
            outage: self.store_failing.load(Ordering::Acquire),
            store_answered: self.store_answered.load(Ordering::Acquire),
            fatal: self.fatal.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }

    pub(crate) fn turned(&self) {
        *self.last_turn.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }
}

impl fmt::Display for RelayStatsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "published={} failed={} batches={}",
            self.published, self.failed, self.batches
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unfinished_messages_are_not_idleness() {
        let stats = Stats::new();
        assert_eq!(stats.idle_for(), Duration::ZERO, "no assignment yet");
        stats.touch();
        stats.add_in_flight(3);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(stats.idle_for(), Duration::ZERO, "three in flight");
        stats.add_in_flight(-3);
        assert!(stats.idle_for() >= Duration::from_millis(30));
    }
}
