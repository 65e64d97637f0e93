//! An event's retries as the runtime lives them: its failures judged by
//! the pipeline's decision, and its part in an outage as health and logs
//! see it (entered at the first wait that is an outage, left when the
//! event gets through or its wait is abandoned). While it waits, both
//! runtimes keep polling, so they stay in their groups: the database
//! runtime's partition buffer fills up to `max_buffered_per_partition`,
//! where its fetching pauses (pausing from a worker could race a rebalance
//! and pause a partition's next assignment with nothing left to resume
//! it); the Kafka-only runtime pauses each partition that delivers while
//! its batch runs (`transactional/busy.rs`).

use std::fmt;
use std::time::Duration;

use super::decision::{Decision, Fault, Tries};
use crate::retry::RetryPolicy;
use crate::stats::Stats;

/// One event's failures, judged by the pipeline's decision, and its part
/// in an outage: every runtime path that retries an event goes through one,
/// so "waited out" always shows in health the same way.
pub(crate) struct Retrying<'a> {
    tries: Tries,
    outage: Outage<'a>,
    policy: RetryPolicy,
}

impl<'a> Retrying<'a> {
    pub(crate) fn new(stats: &'a Stats, policy: RetryPolicy) -> Self {
        Retrying {
            tries: Tries::default(),
            outage: Outage::new(stats),
            policy,
        }
    }

    /// Counts a failure of `fault` (`error`) and decides what follows; a
    /// wait that is an outage marks the event as waiting it out.
    pub(crate) fn failed(
        &mut self,
        fault: Fault,
        error: &dyn fmt::Display,
        random: f64,
    ) -> Decision {
        let decision = self.tries.failed(fault, &self.policy, random);
        if matches!(decision, Decision::WaitOut(_)) {
            self.outage.enter(error);
        }
        decision
    }

    /// Counts a failure no event can cause (a read of the store, a restore
    /// of claims): the wait before the next try, or why the consumer stops
    /// (`max_outage` outlasted).
    pub(crate) fn environment_failed(
        &mut self,
        error: &dyn fmt::Display,
        random: f64,
    ) -> Result<Duration, String> {
        match self.failed(Fault::Environment, error, random) {
            Decision::Stop { failing_for } => Err(self.outlasted(failing_for, error)),
            Decision::Retry(wait) | Decision::WaitOut(wait) => Ok(wait),
            Decision::DeadLetter => unreachable!("the environment's fault is never the event's"),
        }
    }

    /// Why the consumer stops after [`Decision::Stop`].
    pub(crate) fn outlasted(&self, failing_for: Duration, error: &dyn fmt::Display) -> String {
        format!(
            "the environment has failed for {failing_for:?}, longer than max_outage ({:?}); \
             nothing was dead-lettered for it and the waiting message was not committed: {error}",
            self.policy.max_outage.unwrap_or_default()
        )
    }
}

/// Marks an event waiting out the environment in [`Stats`] until dropped.
struct Outage<'a> {
    stats: &'a Stats,
    entered: bool,
}

impl<'a> Outage<'a> {
    fn new(stats: &'a Stats) -> Self {
        Outage {
            stats,
            entered: false,
        }
    }

    /// The environment failed this event (logged once for the consumer, at
    /// the outage's start).
    fn enter(&mut self, error: &dyn fmt::Display) {
        if !self.entered {
            self.entered = true;
            self.stats.enter_outage(error);
        }
    }
}

impl Drop for Outage<'_> {
    fn drop(&mut self) {
        if self.entered {
            self.stats.leave_outage();
        }
    }
}

/// Why one try to make a decoder ready for a payload failed
/// ([`prepare_once`]).
pub(crate) enum NotReady {
    /// The environment's: waited out.
    Outage(String),
    /// The configuration's: the consumer stops with this reason.
    Configuration(String),
}

/// One try, within `limit`, to make `preparer` ready for `payload` (a
/// schema registry's writer's schema fetched), its failure sorted by
/// whose fault it is: never the message's. Both runtimes wait out the
/// outages and stop on the rest.
pub(crate) async fn prepare_once(
    preparer: &dyn dedup_core::decode::Prepare,
    payload: &[u8],
    limit: Duration,
    handler: &str,
) -> Result<(), NotReady> {
    use dedup_core::decode::Unready;
    let outage = match tokio::time::timeout(limit, preparer.prepare(payload)).await {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(Unready::Configuration(e))) => {
            return Err(NotReady::Configuration(format!(
                "the decoder of {handler} cannot read its messages: {e}"
            )));
        }
        Ok(Err(other)) => other.to_string(),
        Err(_) => crate::pipeline::attempt::timed_out(limit).to_string(),
    };
    tracing::warn!(handler, error = %outage, "waiting for what decoding needs (a schema registry?)");
    Err(NotReady::Outage(outage))
}
