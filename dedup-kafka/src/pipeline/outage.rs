//! One event's part in an outage of the environment, as health and logs
//! see it: entered at the event's first failure of the environment, left
//! when it gets through or its wait is abandoned. While it waits the
//! consumer keeps polling (it stays in its group) and, in the database
//! runtime, the partition's buffer fills up to `max_buffered_per_partition`,
//! where its fetching pauses. (Pausing from a worker could race a rebalance
//! and pause a partition's next assignment with nothing left to resume it.)

use std::fmt;
use std::time::Duration;

use crate::stats::Stats;

/// Marks an event waiting out the environment in [`Stats`] until dropped.
pub(crate) struct Outage<'a> {
    stats: &'a Stats,
    entered: bool,
}

impl<'a> Outage<'a> {
    pub(crate) fn new(stats: &'a Stats) -> Self {
        Outage {
            stats,
            entered: false,
        }
    }

    /// The environment failed this event (logged once for the consumer, at
    /// the outage's start).
    pub(crate) fn enter(&mut self, error: &dyn fmt::Display) {
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

/// Why the consumer stops once an outage outlasted `max_outage`.
pub(crate) fn outlasted(
    failing_for: Duration,
    limit: Option<Duration>,
    error: &dyn fmt::Display,
) -> String {
    format!(
        "the environment has failed for {failing_for:?}, longer than max_outage ({:?}); nothing \
         was dead-lettered for it and the waiting message was not committed: {error}",
        limit.unwrap_or_default()
    )
}
