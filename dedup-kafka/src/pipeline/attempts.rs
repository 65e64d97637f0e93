//! One event's attempts, driven the same way by both runtimes: each ended
//! attempt goes in ([`Tried`]), what follows comes out ([`Next`]): done,
//! wait and attempt again, give the event up (to the next retry tier or the
//! dead letters), or stop the consumer. The runtimes only run the attempts
//! and the waits; the decision, the retry counters, the outage in health
//! and the logs are here, so a failure means the same in both.

use std::time::Duration;

use super::attempt::{self, Ran};
use super::decision::{Decision, Fault};
use super::error_chain;
use super::outage::Retrying;
use super::outcome::Record;
use crate::retry::{Jitter, RetryPolicy};
use crate::stats::Stats;

/// What one attempt came to.
#[derive(Debug)]
pub(crate) enum Tried<T> {
    /// It finished the event: `T` says how.
    Done(T),
    /// It failed with this error, of this fault.
    Failed(dedup_core::Error, Fault),
    /// It could not run yet (another holder's lease covers the event): not
    /// a failure; attempt again after the wait.
    Later(Duration),
}

impl<T> Tried<T> {
    /// An attempt run by [`attempt::run`] that returns a result: a panic
    /// and a hang are failures of their own faults.
    pub(crate) fn of(ran: Ran<Result<T, dedup_core::Error>>) -> Self {
        match ran {
            Ran::Done(Ok(done)) => Tried::Done(done),
            Ran::Done(Err(e)) => {
                let fault = Fault::of(&e);
                Tried::Failed(e, fault)
            }
            Ran::Panicked(said) => Tried::Failed(attempt::panicked(&said), Fault::Panic),
            Ran::TimedOut(limit) => Tried::Failed(
                dedup_core::Error::Store(attempt::timed_out(limit)),
                Fault::TimedOut,
            ),
        }
    }
}

/// What follows an attempt.
#[derive(Debug)]
pub(crate) enum Next<T> {
    /// The event is finished.
    Done(T),
    /// Wait this long (cut short by a stop, a revoke, a rebalance), then
    /// attempt again.
    Wait(Duration),
    /// The event leaves its partition.
    GiveUp(GiveUp),
    /// The environment failed longer than `max_outage`: the consumer stops
    /// with this message, the event uncommitted.
    Stop(String),
}

/// An event given up: why, after how many attempts, and where it goes.
#[derive(Debug)]
pub(crate) struct GiveUp {
    /// The dead letter's kind.
    pub(crate) kind: &'static str,
    /// The error and its sources.
    pub(crate) message: String,
    /// Attempts made.
    pub(crate) attempts: u32,
    /// A transient failure whose attempts here are spent: to the next
    /// retry tier, if there is one. Otherwise (the event's own fault, a
    /// panic) to the dead letters.
    pub(crate) onward: bool,
}

/// One event's attempts: counted, judged, recorded.
pub(crate) struct Attempts<'a> {
    retrying: Retrying<'a>,
    record: Record<'a>,
    made: u32,
}

impl<'a> Attempts<'a> {
    /// The attempts of one event under `policy`, recorded in `record`.
    pub(crate) fn new(stats: &'a Stats, policy: RetryPolicy, record: Record<'a>) -> Self {
        Attempts {
            retrying: Retrying::new(stats, policy),
            record,
            made: 0,
        }
    }

    /// Counts an attempt about to start; returns its number (from 1).
    pub(crate) fn start(&mut self) -> u32 {
        self.made += 1;
        self.made
    }

    /// What follows the attempt just made, which came to `tried`; `key`,
    /// the event's ordering key where no span around the attempt says it,
    /// goes into the retry's log line.
    pub(crate) fn ended<T>(
        &mut self,
        tried: Tried<T>,
        jitter: &mut Jitter,
        key: Option<&dyn std::fmt::Display>,
    ) -> Next<T> {
        let attempt = self.made;
        let (error, fault) = match tried {
            Tried::Done(done) => return Next::Done(done),
            Tried::Later(wait) => return Next::Wait(wait),
            Tried::Failed(error, fault) => (error, fault),
        };
        let wait = match self.retrying.failed(fault, &error, jitter.next()) {
            Decision::DeadLetter => {
                return Next::GiveUp(GiveUp {
                    kind: fault.kind(&error),
                    message: error_chain(&error),
                    attempts: attempt,
                    onward: fault == Fault::Transient,
                });
            }
            Decision::Stop { failing_for } => {
                return Next::Stop(self.retrying.outlasted(failing_for, &error));
            }
            Decision::Retry(wait) => {
                tracing::warn!(outcome = "retry", key = key.map(tracing::field::display), attempt, ?wait, kind = error.kind(), error = %error, "the attempt failed; retrying");
                wait
            }
            Decision::WaitOut(wait) => {
                // Logged once at the outage's start and end (Stats).
                tracing::debug!(outcome = "waiting", key = key.map(tracing::field::display), attempt, ?wait, kind = error.kind(), error = %error);
                wait
            }
        };
        self.record.retried(fault, &error);
        Next::Wait(wait)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::metrics::RouteMetrics;

    fn error(class: dedup_core::Classification) -> dedup_core::Error {
        dedup_core::Error::Handler {
            classification: class,
            code: None,
            source: "no".into(),
        }
    }

    /// The same failures lead to the same steps whichever runtime drives
    /// them: retried to the limit then given up onward (transient), given
    /// up at once (the event's fault, a panic), waited out (the
    /// environment, a hang), and stopped past `max_outage`.
    #[test]
    fn failures_lead_where_the_policy_says() {
        use dedup_core::Classification::{Environment, Permanent, Transient};
        let stats = Stats::new();
        let metrics = RouteMetrics::new("orders", "orders");
        let record = Record {
            stats: &stats,
            metrics: &metrics,
        };
        let policy = RetryPolicy::default().with_max_attempts(3);
        let mut jitter = Jitter::new(7);

        let mut attempts = Attempts::new(&stats, policy, record);
        let mut steps = Vec::new();
        loop {
            let n = attempts.start();
            match attempts.ended::<()>(
                Tried::Failed(error(Transient), Fault::Transient),
                &mut jitter,
                None,
            ) {
                Next::Wait(_) => steps.push(n),
                Next::GiveUp(up) => {
                    assert!(up.onward, "transient goes onward");
                    assert_eq!((up.kind, up.attempts), ("handler", 3));
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(steps, [1, 2], "two retries, then given up");
        assert_eq!(stats.retries.load(Ordering::Relaxed), 2);

        let mut attempts = Attempts::new(&stats, policy, record);
        attempts.start();
        let next = attempts.ended::<()>(
            Tried::Failed(error(Permanent), Fault::Event),
            &mut jitter,
            None,
        );
        assert!(
            matches!(
                next,
                Next::GiveUp(GiveUp {
                    onward: false,
                    attempts: 1,
                    ..
                })
            ),
            "{next:?}"
        );
        let next = Tried::<()>::of(Ran::Panicked("bad".into()));
        let next = attempts.ended(next, &mut jitter, None);
        assert!(
            matches!(
                next,
                Next::GiveUp(GiveUp {
                    kind: "panic",
                    onward: false,
                    ..
                })
            ),
            "{next:?}"
        );

        // The environment's fault and a hang are waited out, past
        // max_attempts, and recorded as retries.
        let before = stats.retries.load(Ordering::Relaxed);
        let mut attempts = Attempts::new(&stats, policy, record);
        for _ in 0..5 {
            attempts.start();
            let next = attempts.ended::<()>(
                Tried::Failed(error(Environment), Fault::Environment),
                &mut jitter,
                None,
            );
            assert!(matches!(next, Next::Wait(_)), "{next:?}");
            attempts.start();
            let next = attempts.ended(
                Tried::<()>::of(Ran::TimedOut(Duration::from_secs(1))),
                &mut jitter,
                None,
            );
            assert!(matches!(next, Next::Wait(_)), "{next:?}");
        }
        assert_eq!(stats.retries.load(Ordering::Relaxed), before + 10);

        // Past max_outage: stop, saying so.
        let policy = policy.with_max_outage(Duration::ZERO);
        let mut attempts = Attempts::new(&stats, policy, record);
        attempts.start();
        attempts.ended::<()>(
            Tried::Failed(error(Environment), Fault::Environment),
            &mut jitter,
            None,
        );
        std::thread::sleep(Duration::from_millis(5));
        attempts.start();
        let next = attempts.ended::<()>(
            Tried::Failed(error(Environment), Fault::Environment),
            &mut jitter,
            None,
        );
        assert!(
            matches!(&next, Next::Stop(why) if why.contains("max_outage")),
            "{next:?}"
        );

        // Done and Later pass through, counting nothing.
        let before = stats.retries.load(Ordering::Relaxed);
        assert!(matches!(
            attempts.ended(Tried::Done(7), &mut jitter, None),
            Next::Done(7)
        ));
        let later =
            attempts.ended::<()>(Tried::Later(Duration::from_millis(20)), &mut jitter, None);
        assert!(matches!(later, Next::Wait(w) if w == Duration::from_millis(20)));
        assert_eq!(stats.retries.load(Ordering::Relaxed), before);
    }
}
