//! What became of a message, recorded once: each outcome updates the
//! counters of [`Stats`] and the route's metrics together, and a retry's
//! metric label is read from the pipeline's [`Fault`] in one place. Both
//! runtimes record through it, so `dedup_messages_total` and
//! `dedup_retries_total` mean the same in both (vector's `internal_events`
//! is the model: one event, every sink).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::decision::Fault;
use crate::metrics::{RetryReason, RouteMetrics};
use crate::stats::Stats;

/// A route's sinks: the consumer's counters and the route's metrics.
#[derive(Clone, Copy)]
pub(crate) struct Record<'a> {
    pub(crate) stats: &'a Stats,
    pub(crate) metrics: &'a RouteMetrics,
}

impl Record<'_> {
    /// One event applied; `reclaimed` if it took over an expired claim.
    pub(crate) fn applied(&self, reclaimed: bool) {
        self.stats.applied.fetch_add(1, Ordering::Relaxed);
        self.metrics.applied(reclaimed);
    }

    /// One duplicate skipped, `age` after its claim was taken.
    pub(crate) fn skipped(&self, age: Duration) {
        self.stats.skipped.fetch_add(1, Ordering::Relaxed);
        self.metrics.skipped(age);
    }

    /// The duplicate just skipped was a redelivery after a handover
    /// (counted in [`skipped`](Self::skipped) too).
    pub(crate) fn redelivered(&self) {
        self.stats.redelivered.fetch_add(1, Ordering::Relaxed);
        self.metrics.redelivered();
    }

    /// A duplicate whose content differs from its claim's: skipped
    /// (`on_fingerprint_mismatch(Skip)`), or dead-lettered (counted then by
    /// [`dead_lettered`](Self::dead_lettered)).
    pub(crate) fn fingerprint_mismatch(&self, skipped: bool) {
        if skipped {
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
        }
        self.metrics.fingerprint_mismatch(skipped);
    }

    /// Lease mode: an effect finished after a newer holder took its claim
    /// over; skipped (the newer holder finishes the event).
    pub(crate) fn lease_lost(&self) {
        self.stats.skipped.fetch_add(1, Ordering::Relaxed);
        self.metrics.lease_lost();
    }

    /// A message of an event type no handler of its topic takes, skipped
    /// (`OtherTypes::Skip`).
    pub(crate) fn ignored(&self) {
        self.stats.ignored.fetch_add(1, Ordering::Relaxed);
        self.metrics.ignored();
    }

    /// One message dead-lettered.
    pub(crate) fn dead_lettered(&self) {
        self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        self.metrics.dead_lettered();
    }

    /// One message moved to retry tier `tier`.
    pub(crate) fn moved(&self, tier: &str) {
        self.stats.moved.fetch_add(1, Ordering::Relaxed);
        self.metrics.moved(tier);
    }

    /// A redelivered message moved to a retry tier before, skipped.
    pub(crate) fn already_moved(&self) {
        self.stats.already_moved.fetch_add(1, Ordering::Relaxed);
        self.metrics.already_moved();
    }

    /// An attempt that failed with `error`, of `fault`, is retried.
    pub(crate) fn retried(&self, fault: Fault, error: &dedup_core::Error) {
        self.retried_because(RetryReason::of(fault, error));
    }

    /// An attempt is retried for `reason`.
    pub(crate) fn retried_because(&self, reason: RetryReason) {
        self.stats.retries.fetch_add(1, Ordering::Relaxed);
        self.metrics.retried(reason);
    }
}

impl RetryReason {
    /// The label of a retry after a failure of `fault` (`error`).
    pub(crate) fn of(fault: Fault, error: &dedup_core::Error) -> RetryReason {
        match fault {
            Fault::TimedOut => RetryReason::Timeout,
            Fault::Environment => RetryReason::Environment,
            Fault::Transient if error.kind() == "handler" => RetryReason::Handler,
            _ => RetryReason::Contention,
        }
    }
}
