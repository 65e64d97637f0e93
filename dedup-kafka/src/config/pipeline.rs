//! What both runtimes' builders set alike, beside `ClientSettings` (how
//! their clients reach Kafka): one set of pipeline settings with one
//! meaning per setter, and the checks `build()` makes of them in both.

use std::time::Duration;

use super::OnFingerprintMismatch;
use crate::pipeline::ingest::Batching;
use crate::retry::RetryPolicy;
use crate::{Error, OrderBy, RetryTiers, TtlCheck};

/// How a runtime moves messages through its handler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PipelineSettings {
    /// How batches are gathered.
    pub(crate) batching: Batching,
    /// How failures are retried.
    pub(crate) retry: RetryPolicy,
    /// Handler calls of one partition (the database runtime) or one batch
    /// (the Kafka-only runtime) at once under key-ordered concurrency. 0:
    /// one after another, in offset order. In the database runtime any
    /// other value, 1 included, runs the keyed worker (units of events of
    /// distinct keys, `order_by` allowed); in the Kafka-only runtime 1 is
    /// the same as 0.
    pub(crate) key_concurrency: usize,
    /// Longest one attempt may take (at least 1 ms).
    pub(crate) attempt_timeout: Duration,
    /// What to do when a TTL is shorter than its topic's retention.
    pub(crate) ttl_check: TtlCheck,
    /// What a duplicate whose fingerprint differs from its claim's gets.
    pub(crate) on_fingerprint_mismatch: OnFingerprintMismatch,
}

impl PipelineSettings {
    /// The defaults, with the runtime's own batch size and linger.
    pub(crate) fn with_batches(size: usize, linger: Duration) -> Self {
        PipelineSettings {
            batching: Batching {
                size,
                bytes: crate::pipeline::ingest::BATCH_BYTES,
                linger,
            },
            retry: RetryPolicy::default(),
            key_concurrency: 0,
            attempt_timeout: Duration::from_secs(60),
            ttl_check: TtlCheck::Warn,
            on_fingerprint_mismatch: OnFingerprintMismatch::DeadLetter,
        }
    }

    /// Most messages in a batch (at least 1).
    pub(crate) fn set_batch_size(&mut self, n: usize) {
        self.batching.size = n.max(1);
    }

    /// Longest one attempt may take (at least 1 ms: a zero limit would
    /// abandon every attempt).
    pub(crate) fn set_attempt_timeout(&mut self, timeout: Duration) {
        self.attempt_timeout = timeout.max(Duration::from_millis(1));
    }

    /// Refuses an ordering set for `what` (`order_by("orders", ..)`)
    /// without key-ordered concurrency, where it would order nothing:
    /// `serial` says what runs instead.
    pub(crate) fn refuse_idle_order(
        &self,
        order: &OrderBy,
        what: &str,
        serial: &str,
    ) -> Result<(), Error> {
        if self.key_concurrency == 0 && *order != OrderBy::default() {
            return Err(Error::Config(format!(
                "{what} orders events only under key_concurrency(n): set it, or drop order_by \
                 ({serial})"
            )));
        }
        Ok(())
    }
}

/// Retry tiers as a builder holds them until `build()`: none, the tiers,
/// or why the delays given cannot be tiers.
#[derive(Debug, Default)]
pub(crate) struct TierSetting(Option<Result<RetryTiers, String>>);

impl TierSetting {
    /// Tiers of these delays (`"30s"`, `"5m"`), checked at `build()`.
    pub(crate) fn set_delays<I>(&mut self, delays: I)
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        self.0 = Some(RetryTiers::new(delays).map_err(Error::into_config_message));
    }

    /// These tiers.
    pub(crate) fn set(&mut self, tiers: RetryTiers) {
        self.0 = Some(Ok(tiers));
    }

    /// The tiers, if any; an error naming a bad delay.
    pub(crate) fn built(self) -> Result<Option<RetryTiers>, Error> {
        self.0.transpose().map_err(Error::Config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A setter means the same in both runtimes' builders: the floors are
    /// here, and so is the refusal of an ordering nothing uses.
    #[test]
    fn the_setters_floor_what_cannot_be_zero_and_idle_ordering_is_refused() {
        let mut s = PipelineSettings::with_batches(200, Duration::from_millis(5));
        s.set_batch_size(0);
        s.set_attempt_timeout(Duration::ZERO);
        assert_eq!(s.batching.size, 1);
        assert_eq!(s.attempt_timeout, Duration::from_millis(1));
        let by_field = OrderBy::field("account_id");
        let err = s
            .refuse_idle_order(&by_field, "order_by(\"orders\", ..)", "one at a time")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("order_by(\"orders\", ..) orders events only under key_concurrency"),
            "{err}"
        );
        assert!(
            s.refuse_idle_order(&OrderBy::default(), "order_by", "-")
                .is_ok()
        );
        s.key_concurrency = 4;
        assert!(s.refuse_idle_order(&by_field, "order_by", "-").is_ok());
        let mut tiers = TierSetting::default();
        tiers.set_delays(["30s", "soon"]);
        assert!(tiers.built().is_err(), "a bad delay is reported at build");
        assert!(TierSetting::default().built().unwrap().is_none());
    }
}
