//! Whose fault a failed attempt is, and what follows from it: the one
//! failure policy of both runtimes.
//!
//! | fault | what follows |
//! |---|---|
//! | the event's (decode, key, permanent, an unclassified error) | dead-letter at once |
//! | a panic in user code | dead-letter at once (kind `panic`) |
//! | transient (the handler said so, an unknown store code) | retry with back-off, dead-letter after `max_attempts` |
//! | contention (a lock, a deadlock, a serialization failure) | retry with back-off; never dead-letter: past `max_attempts` it is waited out as the environment's |
//! | the environment's (unreachable, read-only, full, refusing) | wait out with capped back-off; stop once longer than `max_outage` |
//! | the attempt outlived `attempt_timeout` | as the environment's |
//!
//! Contention that outlasts the attempts (a lock held by a backend that
//! froze, a forgotten `idle in transaction` session, a handler that locks
//! its own rows through a second connection) is an outage: health shows
//! it, it is logged at its start and end, and `max_outage` bounds it.

use std::time::{Duration, Instant};

use dedup_core::Classification;

use crate::retry::RetryPolicy;

/// Whose fault a failed attempt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The event's own: it cannot be decoded or keyed, the handler or the
    /// store said permanent, or nobody classified the error.
    Event,
    /// User code panicked.
    Panic,
    /// A failure a later attempt may get past, bounded by the policy.
    Transient,
    /// Another transaction holds what the attempt needs.
    Contention,
    /// The database or broker is unreachable, read-only, full, refusing.
    Environment,
    /// The attempt hung past the attempt timeout and was abandoned.
    TimedOut,
}

impl Fault {
    /// The fault of a classified error; an unclassified one is the event's.
    pub(crate) fn of(error: &dedup_core::Error) -> Fault {
        Fault::from_class(error.classification())
    }

    pub(crate) fn from_class(class: Classification) -> Fault {
        match class {
            Classification::Transient => Fault::Transient,
            Classification::Contention => Fault::Contention,
            Classification::Environment => Fault::Environment,
            _ => Fault::Event,
        }
    }

    /// The dead-letter kind of a failure of this fault with `error`.
    pub(crate) fn kind(self, error: &dedup_core::Error) -> &'static str {
        match self {
            Fault::Panic => "panic",
            _ => error.kind(),
        }
    }
}

/// What the runtime does after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Decision {
    /// Try again after the wait (it may be the event's fault: bounded, or
    /// contention: unbounded).
    Retry(Duration),
    /// Not the event's fault: an outage (health shows it); wait, then try
    /// again, however long it lasts.
    WaitOut(Duration),
    /// Dead-letter the event and move on.
    DeadLetter,
    /// The environment has failed longer than `max_outage`: the consumer
    /// stops with an error, the event uncommitted.
    Stop {
        /// How long the environment has failed.
        failing_for: Duration,
    },
}

/// The failures of one event so far, by kind, this one included.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Tally {
    /// Transient failures (bounded by `max_attempts`).
    pub(crate) transient: u32,
    /// Attempts that met contention.
    pub(crate) contended: u32,
    /// Attempts waited out as an outage: the environment's failures, and
    /// contention past `max_attempts`.
    pub(crate) outage: u32,
    /// How long since the event's first attempt waited out as an outage.
    pub(crate) failing_for: Duration,
}

/// What follows the failure `fault`, given the event's `tally` (which
/// counts it already) and `policy`; `random` in `[0, 1]` jitters the wait.
pub(crate) fn decide(fault: Fault, tally: &Tally, policy: &RetryPolicy, random: f64) -> Decision {
    match fault {
        Fault::Event | Fault::Panic => Decision::DeadLetter,
        Fault::Transient if tally.transient < policy.attempts() => {
            Decision::Retry(policy.backoff(tally.transient, random))
        }
        Fault::Transient => Decision::DeadLetter,
        Fault::Contention if tally.contended < policy.attempts() => {
            Decision::Retry(policy.backoff(tally.contended, random))
        }
        Fault::Contention | Fault::Environment | Fault::TimedOut => {
            let wait = policy.outage_backoff(tally.outage, random);
            match policy.max_outage {
                None => Decision::WaitOut(wait),
                Some(limit) if tally.failing_for > limit => Decision::Stop {
                    failing_for: tally.failing_for,
                },
                // The attempt just past the limit is the last one.
                Some(limit) => Decision::WaitOut(
                    wait.min(limit.saturating_sub(tally.failing_for) + Duration::from_millis(1)),
                ),
            }
        }
    }
}

/// One event's failures as its attempts go: counts each and decides.
#[derive(Debug, Default)]
pub(crate) struct Tries {
    tally: Tally,
    outage_since: Option<Instant>,
}

impl Tries {
    /// Counts a failure of `fault` and decides what follows.
    pub(crate) fn failed(&mut self, fault: Fault, policy: &RetryPolicy, random: f64) -> Decision {
        let outage = match fault {
            Fault::Transient => {
                self.tally.transient += 1;
                false
            }
            Fault::Contention => {
                self.tally.contended += 1;
                self.tally.contended >= policy.attempts()
            }
            Fault::Environment | Fault::TimedOut => true,
            Fault::Event | Fault::Panic => false,
        };
        if outage {
            let since = *self.outage_since.get_or_insert_with(Instant::now);
            self.tally.outage += 1;
            self.tally.failing_for = since.elapsed();
        }
        decide(fault, &self.tally, policy, random)
    }

    /// The failures so far.
    #[cfg(test)]
    pub(crate) fn tally(&self) -> &Tally {
        &self.tally
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn policy() -> RetryPolicy {
        RetryPolicy::default()
            .with_max_attempts(3)
            .with_backoff(MS(100), MS(400))
            .with_outage_backoff(MS(1_000))
    }

    fn tally(transient: u32, contended: u32, outage: u32, failing_for: u64) -> Tally {
        Tally {
            transient,
            contended,
            outage,
            failing_for: MS(failing_for),
        }
    }

    /// Every row of the failure table, at its edges. Both runtimes call
    /// `decide`, so this is the table for both.
    #[test]
    fn the_failure_table() {
        let bounded = policy().with_max_outage(MS(10_000));
        use Decision::*;
        use Fault::*;
        #[rustfmt::skip]
        let rows: [(&str, Fault, Tally, RetryPolicy, Decision); 19] = [
            ("the event's fault: at once", Event, tally(0, 0, 0, 0), policy(), DeadLetter),
            ("the event's fault, even mid-outage", Event, tally(0, 0, 5, 9_000), bounded, DeadLetter),
            ("a panic: at once", Panic, tally(0, 0, 0, 0), policy(), DeadLetter),
            ("transient, first failure", Transient, tally(1, 0, 0, 0), policy(), Retry(MS(100))),
            ("transient, second", Transient, tally(2, 0, 0, 0), policy(), Retry(MS(200))),
            ("transient, out of attempts", Transient, tally(3, 0, 0, 0), policy(), DeadLetter),
            ("transient, contention does not use attempts up", Transient, tally(1, 50, 0, 0), policy(), Retry(MS(100))),
            ("contention, first", Contention, tally(0, 1, 0, 0), policy(), Retry(MS(100))),
            ("contention, second", Contention, tally(0, 2, 0, 0), policy(), Retry(MS(200))),
            ("contention after transient failures ran out", Contention, tally(3, 1, 0, 0), policy(), Retry(MS(100))),
            ("contention past the attempts: an outage, never dead-lettered", Contention, tally(0, 3, 1, 0), policy(), WaitOut(MS(100))),
            ("lasting contention, capped at the outage back-off", Contention, tally(0, 1_000, 998, 600_000), policy(), WaitOut(MS(1_000))),
            ("lasting contention, past max_outage: stop", Contention, tally(0, 40, 38, 10_001), bounded, Stop { failing_for: MS(10_001) }),
            ("environment, first", Environment, tally(0, 0, 1, 0), policy(), WaitOut(MS(100))),
            ("environment, capped at the outage back-off", Environment, tally(0, 0, 100, 600_000), policy(), WaitOut(MS(1_000))),
            ("environment, the last wait ends at max_outage", Environment, tally(0, 0, 9, 9_500), bounded, WaitOut(MS(501))),
            ("environment, past max_outage: stop", Environment, tally(0, 0, 10, 10_001), bounded, Stop { failing_for: MS(10_001) }),
            ("a timed-out attempt is the environment's", TimedOut, tally(0, 0, 1, 0), policy(), WaitOut(MS(100))),
            ("a timed-out attempt, past max_outage", TimedOut, tally(0, 0, 3, 10_001), bounded, Stop { failing_for: MS(10_001) }),
        ];
        for (what, fault, tally, policy, expected) in rows {
            assert_eq!(decide(fault, &tally, &policy, 0.0), expected, "{what}");
        }
    }

    #[test]
    fn classifications_map_to_faults() {
        use Classification::*;
        assert_eq!(Fault::from_class(Permanent), Fault::Event);
        assert_eq!(Fault::from_class(Unknown), Fault::Event);
        assert_eq!(Fault::from_class(Transient), Fault::Transient);
        assert_eq!(Fault::from_class(Contention), Fault::Contention);
        assert_eq!(Fault::from_class(Environment), Fault::Environment);
    }

    #[test]
    fn tries_count_each_kind_apart() {
        let policy = policy();
        let mut tries = Tries::default();
        for n in 1..=20 {
            let decision = tries.failed(Fault::Contention, &policy, 0.0);
            if n < policy.attempts() {
                assert!(matches!(decision, Decision::Retry(_)), "{n}: {decision:?}");
            } else {
                assert!(
                    matches!(decision, Decision::WaitOut(_)),
                    "{n}: {decision:?}"
                );
            }
        }
        assert!(matches!(
            tries.failed(Fault::Transient, &policy, 0.0),
            Decision::Retry(_)
        ));
        assert!(matches!(
            tries.failed(Fault::TimedOut, &policy, 0.0),
            Decision::WaitOut(_)
        ));
        assert_eq!(
            (
                tries.tally().transient,
                tries.tally().contended,
                tries.tally().outage
            ),
            // Contention from the third on, and the timeout, waited out.
            (1, 20, 19)
        );
    }
}
