//! What health and the gauges report of the database runtime, refreshed
//! by its loop every second: the loop's turn, the assignment, paused and
//! long-running partitions, the messages in flight, key-ordered
//! concurrency's windows, and the retry tiers' due times.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use dedup_core::DedupStore;

use super::consumer::Consumer;
use crate::database::partition::state::lock;
use crate::metrics::ConsumerGauges;

impl<S: DedupStore> Consumer<S> {
    /// Refreshes what health and the gauges report: the loop's turn, the
    /// assignment, paused partitions, the longest-running partition, the
    /// messages in flight per topic.
    pub(super) fn refresh(&self, gauges: &ConsumerGauges) {
        let stats = &self.shared.stats;
        stats.polled();
        let (mut paused, mut oldest) = (0u64, std::time::Duration::ZERO);
        let mut in_flight: HashMap<&str, usize> =
            self.routes.keys().map(|t| (t.as_str(), 0)).collect();
        for p in lock(&self.partitions).values() {
            // Back-pressure only: a tier's partition waiting for a due
            // record is not behind.
            if p.paused.load(Ordering::Acquire) && !p.due_wait.load(Ordering::Acquire) {
                paused += 1;
            }
            match p.busy_since_ms.load(Ordering::Acquire) {
                u64::MAX => {}
                since => oldest = oldest.max(stats.age_of(since)),
            }
            if let Some(n) = in_flight.get_mut(p.topic.as_str()) {
                *n += p.queued.load(Ordering::Acquire);
            }
        }
        if self.shared.settings.pipeline.key_concurrency > 0 {
            self.refresh_keyed();
        }
        if self.routes.values().any(|r| r.in_tier()) {
            self.refresh_tiers();
        }
        gauges.report(stats, paused as usize, oldest);
        for (topic, n) in in_flight {
            crate::metrics::in_flight(topic, n);
        }
    }

    /// The key-ordered gauges of each assigned partition; those of a
    /// partition no longer assigned go to zero once.
    pub(super) fn refresh_keyed(&self) {
        let mut reported = self
            .keyed_reported
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut now = HashSet::new();
        for p in lock(&self.partitions).values() {
            crate::metrics::keyed(
                &p.topic,
                p.partition,
                p.keyed_running.load(Ordering::Relaxed),
                p.keyed_waiting.load(Ordering::Relaxed),
            );
            now.insert((p.topic.clone(), p.partition));
        }
        for (topic, partition) in reported.difference(&now) {
            crate::metrics::keyed(topic, *partition, 0, 0);
        }
        *reported = now;
    }

    /// How long each assigned retry tier's partition waits for its next
    /// record to be due (0 while it runs); a partition no longer assigned
    /// goes to zero once.
    pub(super) fn refresh_tiers(&self) {
        let mut reported = self
            .tiers_reported
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut now = HashSet::new();
        let clock = crate::tiers::now_ms();
        // Every assigned partition of a tier, also one no record came from.
        let Ok(assigned) = rdkafka::consumer::Consumer::assignment(&self.shared.kafka) else {
            return;
        };
        let partitions = lock(&self.partitions);
        for elem in assigned.elements() {
            if !self.routes.get(elem.topic()).is_some_and(|r| r.in_tier()) {
                continue;
            }
            let key = (elem.topic().to_owned(), elem.partition());
            let due_at = partitions
                .get(&key)
                .map_or(0, |p| p.due_at_ms.load(Ordering::Relaxed));
            let due_in = match due_at {
                0 => 0,
                at => at.saturating_sub(clock).max(0),
            };
            crate::metrics::tier_due(&key.0, key.1, due_in as f64 / 1000.0);
            now.insert(key);
        }
        drop(partitions);
        for (topic, partition) in reported.difference(&now) {
            crate::metrics::tier_due(topic, *partition, 0.0);
        }
        *reported = now;
    }
}
