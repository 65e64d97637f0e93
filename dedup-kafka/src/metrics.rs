//! What the runtime records through the `metrics` facade. Recording is free
//! until the application installs a recorder (Prometheus, StatsD,
//! OpenTelemetry...). The names and labels are part of the API (the book's
//! chapter "Metrics and health"); no label ever holds an event key.

use std::sync::atomic::Ordering;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

use crate::stats::Stats;

/// The handles of one route (a topic and its handler), registered on first
/// use: after the application has installed its recorder.
pub(crate) struct RouteMetrics {
    applied: Counter,
    reclaimed: Counter,
    skipped: Counter,
    dead_lettered: Counter,
    already_dead_lettered: Counter,
    moved: Counter,
    already_moved: Counter,
    /// The route's topic and handler, for the per-tier counters.
    labels: (String, String),
    redelivered: Counter,
    fingerprint_mismatch: Counter,
    retry_environment: Counter,
    retry_contention: Counter,
    retry_handler: Counter,
    retry_timeout: Counter,
    retry_lease_held: Counter,
    lease_lost: Counter,
    ignored: Counter,
    handler_duration: Histogram,
    batch_size: Histogram,
    duplicate_age: Histogram,
}

/// Why an attempt is retried, for `dedup_retries_total{reason}`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RetryReason {
    /// The database or broker failed: waited out.
    Environment,
    /// Contention in the store (lock timeout, serialization failure,
    /// deadlock) or an error not known to be the environment's.
    Contention,
    /// The handler said `transient(..)`.
    Handler,
    /// The attempt outlived `attempt_timeout`.
    Timeout,
    /// Lease mode: another holder's lease on the event is live.
    LeaseHeld,
}

impl RouteMetrics {
    pub(crate) fn new(topic: &str, handler: &str) -> Self {
        let (topic, handler) = (topic.to_owned(), handler.to_owned());
        let messages = |outcome: &'static str| counter!("dedup_messages_total", "topic" => topic.clone(), "handler" => handler.clone(), "outcome" => outcome);
        let retries = |reason: &'static str| counter!("dedup_retries_total", "topic" => topic.clone(), "handler" => handler.clone(), "reason" => reason);
        RouteMetrics {
            applied: messages("applied"),
            reclaimed: messages("reclaimed"),
            skipped: messages("skipped"),
            dead_lettered: messages("dead_lettered"),
            already_dead_lettered: messages("already_dead_lettered"),
            moved: messages("moved"),
            already_moved: messages("already_moved"),
            labels: (topic.clone(), handler.clone()),
            redelivered: messages("redelivered"),
            fingerprint_mismatch: messages("fingerprint_mismatch"),
            retry_environment: retries("environment"),
            retry_contention: retries("contention"),
            retry_handler: retries("handler"),
            retry_timeout: retries("timeout"),
            retry_lease_held: retries("lease_held"),
            lease_lost: messages("lease_lost"),
            ignored: messages("ignored"),
            handler_duration: histogram!("dedup_handler_duration_seconds", "topic" => topic.clone(), "handler" => handler.clone()),
            batch_size: histogram!("dedup_batch_size", "topic" => topic.clone()),
            duplicate_age: histogram!("dedup_duplicate_age_seconds", "topic" => topic, "handler" => handler),
        }
    }

    /// A message of an event type no handler takes, skipped
    /// (`OtherTypes::Skip`).
    pub(crate) fn ignored(&self) {
        self.ignored.increment(1);
    }

    /// One event applied; `reclaimed` if it took over an expired claim (it
    /// counts as applied too).
    pub(crate) fn applied(&self, reclaimed: bool) {
        self.applied.increment(1);
        if reclaimed {
            self.reclaimed.increment(1);
        }
    }

    /// One duplicate skipped, `age` after its claim was taken.
    pub(crate) fn skipped(&self, age: Duration) {
        self.skipped.increment(1);
        self.duplicate_age.record(age.as_secs_f64());
    }

    pub(crate) fn dead_lettered(&self) {
        self.dead_lettered.increment(1);
    }

    /// One of the duplicates skipped was a redelivery after a handover.
    pub(crate) fn redelivered(&self) {
        self.redelivered.increment(1);
    }

    /// A duplicate whose content differs from its claim's; counted as
    /// dead-lettered or (`skipped`) skipped too, as the consumer is set. Its
    /// age is left out of the duplicates' ages: it is no redelivery.
    pub(crate) fn fingerprint_mismatch(&self, skipped: bool) {
        self.fingerprint_mismatch.increment(1);
        if skipped {
            self.skipped.increment(1);
        }
    }

    /// Lease mode: an effect finished after a newer holder took its claim
    /// over; counted as skipped too (the newer holder finishes the event).
    pub(crate) fn lease_lost(&self) {
        self.lease_lost.increment(1);
        self.skipped.increment(1);
    }

    /// One message moved to retry tier `tier`: counted as an outcome of its
    /// route and in `dedup_retry_moved_total{topic, handler, tier}`.
    pub(crate) fn moved(&self, tier: &str) {
        self.moved.increment(1);
        self.moved_series(tier).increment(1);
    }

    /// `dedup_retry_moved_total{topic, handler, tier}`.
    pub(crate) fn moved_series(&self, tier: &str) -> Counter {
        let (topic, handler) = self.labels.clone();
        counter!("dedup_retry_moved_total", "topic" => topic, "handler" => handler, "tier" => tier.to_owned())
    }

    pub(crate) fn already_moved(&self) {
        self.already_moved.increment(1);
    }

    pub(crate) fn already_dead_lettered(&self) {
        self.already_dead_lettered.increment(1);
    }

    pub(crate) fn retried(&self, reason: RetryReason) {
        match reason {
            RetryReason::Environment => &self.retry_environment,
            RetryReason::Contention => &self.retry_contention,
            RetryReason::Handler => &self.retry_handler,
            RetryReason::Timeout => &self.retry_timeout,
            RetryReason::LeaseHeld => &self.retry_lease_held,
        }
        .increment(1);
    }

    /// One transaction (a message's or a batch's attempt) took `took`.
    pub(crate) fn attempt(&self, took: Duration) {
        self.handler_duration.record(took.as_secs_f64());
    }

    pub(crate) fn batch(&self, size: usize) {
        self.batch_size.record(size as f64);
    }
}

/// The consumer-wide gauges, set by the consumer's periodic refresh, by
/// group (two consumers in one process do not overwrite each other's).
pub(crate) struct ConsumerGauges {
    paused_partitions: Gauge,
    outage: Gauge,
    oldest_in_flight: Gauge,
}

impl ConsumerGauges {
    pub(crate) fn new(group: &str) -> Self {
        ConsumerGauges {
            paused_partitions: gauge!("dedup_paused_partitions", "group" => group.to_owned()),
            outage: gauge!("dedup_outage", "group" => group.to_owned()),
            oldest_in_flight: gauge!("dedup_oldest_in_flight_seconds", "group" => group.to_owned()),
        }
    }

    /// Reports the partitions paused and the oldest message in flight, in
    /// health (`stats`) and in the gauges, with whether an outage is waited
    /// out: what both runtimes' loops refresh.
    pub(crate) fn report(&self, stats: &Stats, paused: usize, oldest_in_flight: Duration) {
        let health = &stats.health;
        health.paused.store(paused as u64, Ordering::Release);
        health
            .oldest_in_flight_ms
            .store(oldest_in_flight.as_millis() as u64, Ordering::Release);
        self.paused_partitions.set(paused as f64);
        let outage = stats.waiting_out() > 0;
        self.outage.set(if outage { 1.0 } else { 0.0 });
        self.oldest_in_flight.set(oldest_in_flight.as_secs_f64());
    }
}

/// Messages received and not yet finished, per topic.
pub(crate) fn in_flight(topic: &str, messages: usize) {
    gauge!("dedup_in_flight", "topic" => topic.to_owned()).set(messages as f64);
}

/// Under key-ordered concurrency, a partition's events running and those
/// waiting behind an earlier event of their ordering key.
pub(crate) fn keyed(topic: &str, partition: i32, running: usize, waiting: usize) {
    let labels = [
        ("topic", topic.to_owned()),
        ("partition", partition.to_string()),
    ];
    gauge!("dedup_key_running", &labels).set(running as f64);
    gauge!("dedup_key_waiting", &labels).set(waiting as f64);
}

/// How long a retry tier's partition waits, paused, for its next record
/// to be due (0 while it runs).
pub(crate) fn tier_due(topic: &str, partition: i32, seconds: f64) {
    gauge!("dedup_retry_due_seconds", "topic" => topic.to_owned(), "partition" => partition.to_string())
        .set(seconds);
}

/// Messages behind the partition's high watermark, from librdkafka's
/// statistics.
pub(crate) fn consumer_lag(topic: &str, partition: i32, lag: i64) {
    gauge!("dedup_consumer_lag", "topic" => topic.to_owned(), "partition" => partition.to_string())
        .set(lag as f64);
}

/// The outbox relay's handles.
pub(crate) struct RelayMetrics {
    published: Counter,
    failures: Counter,
    pending: Gauge,
    oldest_pending: Gauge,
}

impl RelayMetrics {
    pub(crate) fn new() -> Self {
        RelayMetrics {
            published: counter!("dedup_outbox_published_total"),
            failures: counter!("dedup_outbox_publish_failures_total"),
            pending: gauge!("dedup_outbox_pending"),
            oldest_pending: gauge!("dedup_outbox_oldest_pending_seconds"),
        }
    }

    pub(crate) fn round(&self, published: usize, failed: usize) {
        self.published.increment(published as u64);
        self.failures.increment(failed as u64);
    }

    pub(crate) fn backlog(&self, pending: u64, oldest: Duration) {
        self.pending.set(pending as f64);
        self.oldest_pending.set(oldest.as_secs_f64());
    }
}
