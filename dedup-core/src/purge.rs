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
    /// Most claims deleted per statement (default 1000); a round repeats
    /// batches until one comes back short.
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
/// tries again.
pub async fn purge_round<P: PurgeExpired>(store: &P, batch_size: u32) -> u64 {
    let mut total = 0;
    loop {
        match store.purge_expired(batch_size).await {
            Ok(n) => {
                total += n;
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
