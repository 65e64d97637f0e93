//! A background task that keeps the dedup table bounded.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::PurgeExpired;

/// How often and in what batch size the purger deletes expired claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeConfig {
    /// Pause between purge rounds (default 60 s).
    pub interval: Duration,
    /// Most claims deleted per statement (default 1000, at least 1: 0
    /// counts as 1); a round repeats batches until one comes back short.
    pub batch_size: u32,
}

impl Default for PurgeConfig {
    fn default() -> Self {
        PurgeConfig {
            interval: Duration::from_secs(60),
            batch_size: 1000,
        }
    }
}

impl PurgeConfig {
    /// Sets the pause between rounds.
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Sets the batch size (at least 1).
    pub fn with_batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }
}

/// The running purger; [`stop`](Purger::stop) ends it after its current
/// batch, and dropping the handle aborts it.
#[derive(Debug)]
pub struct Purger {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl Purger {
    /// Starts purging `store` in the background on the current tokio runtime.
    pub fn spawn<P: PurgeExpired + Clone>(store: P, config: PurgeConfig) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            loop {
                purge_round(&store, config.batch_size).await;
                // Either a stop signal (or a dropped handle) or the next round.
                if tokio::time::timeout(config.interval, stopped.changed())
                    .await
                    .is_ok()
                {
                    return;
                }
            }
        });
        Purger {
            stop,
            task: Some(task),
        }
    }

    /// Stops the purger and waits for its current batch to finish.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Purger {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Deletes expired claims batch by batch until a batch comes back short;
/// returns the total. Errors are logged and end the round: the next round
/// tries again. A `batch_size` of 0 counts as 1.
pub(crate) async fn purge_round<P: PurgeExpired>(store: &P, batch_size: u32) -> u64 {
    // Clamped here, not only in the setter: the field is public, and a batch
    // of 0 always "comes back full", so the round would never end.
    let batch_size = batch_size.max(1);
    let mut total = 0;
    loop {
        match store.purge_expired(batch_size).await {
            Ok(n) => {
                total += n;
                metrics::counter!("dedup_claims_purged_total").increment(n);
                if n < u64::from(batch_size) {
                    break;
                }
                // Let the consumer's own transactions in between batches.
                tokio::task::yield_now().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "purging expired claims failed; retrying next round");
                break;
            }
        }
    }
    if total > 0 {
        tracing::info!(purged = total, "purged expired claims");
    }
    total
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{DedupKey, DedupStore, MemoryStore, Ttl};

    #[tokio::test]
    async fn a_zero_batch_size_still_ends_the_round() {
        let store = MemoryStore::new();
        let ttl = Ttl::from_secs(1).unwrap();
        for key in ["a", "b", "c"] {
            let mut tx = store.begin().await.unwrap();
            let key = DedupKey::new("purge", key).unwrap();
            store.claim(&mut tx, &key, None, ttl).await.unwrap();
            store.commit(tx).await.unwrap();
        }
        store.advance(Duration::from_secs(2));
        // As a user outside the builder can: the field is public.
        let config = PurgeConfig {
            batch_size: 0,
            ..PurgeConfig::default()
        };
        let purged = tokio::time::timeout(
            Duration::from_secs(10),
            purge_round(&store, config.batch_size),
        )
        .await
        .expect("a round with batch_size 0 never ended");
        assert_eq!(purged, 3);
        assert!(store.is_empty());
    }
}
