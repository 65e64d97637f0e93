//! How transient failures are retried.

use std::time::Duration;

/// Exponential back-off with jitter for retryable failures.
///
/// Attempt `n` (1-based) that fails with a retryable error waits about
/// `initial * multiplier^(n-1)`, capped at `max_backoff`, with up to half of
/// it taken off at random so that consumers that failed together do not
/// retry together. After `max_attempts` transient failures the event is
/// dead-lettered; contention (another transaction's lock) is retried with
/// the same back-off for as long as it lasts, and the environment's
/// failures with `max_outage_backoff`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts in all, the first included, for transient failures that
    /// may be the event's (a handler's `transient(..)` error, a store code
    /// no rule knows), before it is dead-lettered (default 8; 0 counts as
    /// 1). Contention does not use them up.
    pub max_attempts: u32,
    /// Wait after the first failure (default 100 ms).
    pub initial_backoff: Duration,
    /// Longest wait between attempts (default 10 s; never below
    /// `initial_backoff`).
    pub max_backoff: Duration,
    /// Growth factor between waits (default 2).
    pub multiplier: f64,
    /// Longest wait between attempts while the environment fails (the
    /// database or broker unreachable, read-only, full...): such failures
    /// are retried without limit, never dead-lettered (default 30 s).
    pub max_outage_backoff: Duration,
    /// How long a partition may wait out such a failure before the consumer
    /// gives up and stops with an error (`None`, the default: for as long as
    /// it takes). The waiting message is neither dead-lettered nor
    /// committed: the next run starts from it.
    pub max_outage: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 8,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            multiplier: 2.0,
            max_outage_backoff: Duration::from_secs(30),
            max_outage: None,
        }
    }
}

impl RetryPolicy {
    /// Sets the number of attempts (at least 1).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Sets the first wait and the cap.
    pub fn with_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// Sets the longest wait between attempts during an outage.
    pub fn with_outage_backoff(mut self, max: Duration) -> Self {
        self.max_outage_backoff = max;
        self
    }

    /// Stops the consumer with an error once a partition has waited out a
    /// failure of the environment for longer than `limit`, instead of
    /// waiting for as long as it takes: for a deployment that would rather
    /// restart, or alert through its supervisor. Nothing is dead-lettered
    /// for it.
    pub fn with_max_outage(mut self, limit: Duration) -> Self {
        self.max_outage = Some(limit);
        self
    }

    /// The wait after a message's `n`th failure of the environment:
    /// the same curve as [`backoff`](Self::backoff), capped at
    /// `max_outage_backoff` instead (never below the initial wait).
    pub(crate) fn outage_backoff(&self, n: u32, random: f64) -> Duration {
        let cap = self.max_outage_backoff.max(self.initial_backoff);
        RetryPolicy {
            max_backoff: cap,
            ..*self
        }
        .backoff(n, random)
    }

    /// Attempts in all, at least 1. The fields are public, so the clamps of
    /// the setters are applied again where the values are used.
    pub(crate) fn attempts(&self) -> u32 {
        self.max_attempts.max(1)
    }

    /// The wait after failed attempt `attempt` (1-based), given a random
    /// number in `[0, 1)` for the jitter.
    pub(crate) fn backoff(&self, attempt: u32, random: f64) -> Duration {
        let exp = self
            .multiplier
            .max(1.0)
            .powi(attempt.saturating_sub(1).min(64) as i32);
        let full = self.initial_backoff.as_secs_f64() * exp;
        let cap = self.max_backoff.max(self.initial_backoff);
        let capped = full.min(cap.as_secs_f64());
        Duration::from_secs_f64(capped * (1.0 - 0.5 * random.clamp(0.0, 1.0)))
    }
}

/// A small xorshift generator for jitter: no dependency, no cryptography
/// needed.
pub(crate) struct Jitter(u64);

impl Jitter {
    pub(crate) fn new(seed: u64) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Jitter((seed ^ nanos) | 1)
    }

    pub(crate) fn next(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_exponentially_up_to_the_cap() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(1, 0.0), Duration::from_millis(100));
        assert_eq!(p.backoff(2, 0.0), Duration::from_millis(200));
        assert_eq!(p.backoff(4, 0.0), Duration::from_millis(800));
        assert_eq!(p.backoff(30, 0.0), Duration::from_secs(10));
        assert_eq!(p.backoff(1000, 0.0), Duration::from_secs(10));
    }

    #[test]
    fn fields_set_directly_are_clamped_where_used() {
        let p = RetryPolicy {
            max_attempts: 0,
            initial_backoff: Duration::from_secs(2),
            max_backoff: Duration::from_millis(1),
            multiplier: -3.0,
            max_outage_backoff: Duration::ZERO,
            max_outage: None,
        };
        assert_eq!(p.attempts(), 1);
        assert_eq!(p.outage_backoff(5, 0.0), Duration::from_secs(2));
        assert_eq!(p.backoff(1, 0.0), Duration::from_secs(2));
        assert_eq!(p.backoff(9, 0.0), Duration::from_secs(2));
    }

    #[test]
    fn outages_back_off_up_to_their_own_cap() {
        let p = RetryPolicy::default();
        assert_eq!(p.outage_backoff(1, 0.0), Duration::from_millis(100));
        assert_eq!(p.outage_backoff(8, 0.0), Duration::from_millis(12_800));
        assert_eq!(p.outage_backoff(1000, 0.0), Duration::from_secs(30));
    }

    #[test]
    fn jitter_takes_off_at_most_half() {
        let p = RetryPolicy::default();
        let mut j = Jitter::new(7);
        for _ in 0..1000 {
            let d = p.backoff(3, j.next());
            assert!(
                d > Duration::from_millis(200) && d <= Duration::from_millis(400),
                "{d:?}"
            );
        }
    }
}
