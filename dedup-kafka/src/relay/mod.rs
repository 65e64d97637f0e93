//! The outbox relay: publishes what an [`OutboxSource`] holds, in order,
//! with the idempotent producer, and marks it sent only once acknowledged.

use crate::oauth::TokenContext;
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dedup_core::outbox::{OutboxSource, PublishFailure};
use rdkafka::producer::{FutureProducer, Producer as _};

use crate::Error;
use crate::failpoint::failpoint;
use crate::metrics::RelayMetrics;
use crate::pipeline::fatal_error;
use crate::retry::{Jitter, RetryPolicy};
use crate::stats::{RelayStats, RelayStatsSnapshot};

mod builder;
mod publish;

pub use builder::RelayBuilder;

use publish::{Key, Sent};

/// Sent rows deleted per purge statement: bounded, so a large backlog of
/// them never holds one long transaction; a purge takes as many as it needs.
const PURGE_BATCH: u32 = 10_000;

/// How often the relay reads its backlog for the gauges.
pub(super) const BACKLOG_INTERVAL: Duration = Duration::from_secs(5);

/// Publishes an outbox's events to Kafka: the other half of exactly-once
/// along a chain of services.
///
/// Each round leases a batch of pending events (other relays skip them;
/// one short statement, no transaction stays open), sends them all with the
/// idempotent producer, waits for the broker's acknowledgements, then marks
/// the acknowledged ones sent in a new short transaction. A relay that dies
/// in between leaves them pending, leased until the lease expires
/// ([`RelayBuilder::lease_timeout`]), and they are sent again: at least
/// once, each copy carrying the same `event-id` header for consumers to
/// deduplicate on (`#[idempotent(key = "header:event-id")]`).
///
/// Order: events of one topic and key are published in outbox order, also
/// with several relays (a relay never takes an event while an earlier one
/// of its key is pending elsewhere). When an event fails, it backs off
/// (the retry policy, by its attempts) and the later events of its key wait
/// with it; other keys go on, so a poison event stalls only its own key.
/// When nothing in a batch gets through (the broker is down) the relay
/// itself backs off too.
pub struct Relay<S> {
    source: S,
    producer: FutureProducer<TokenContext>,
    /// The producer's settings, for the start-up check of access.
    access: rdkafka::ClientConfig,
    /// The OAUTHBEARER tokens' keeper its producer asks, if a provider is set.
    #[allow(dead_code)]
    tokens: Option<crate::oauth::Tokens>,
    batch_size: usize,
    poll_interval: Duration,
    retry: RetryPolicy,
    purge_interval: Duration,
    store_timeout: Duration,
    lease: Duration,
    /// How long after leasing a batch its sends may be queued.
    send_window: Duration,
    stats: Arc<RelayStats>,
    #[cfg(feature = "http")]
    http: Option<crate::http::HttpEndpoints>,
}

impl<S> fmt::Debug for Relay<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("stats", &self.stats.snapshot())
            .finish_non_exhaustive()
    }
}

/// What one turn did: the size of the batch it leased, and what the
/// batches it finished published and failed.
#[derive(Default)]
struct Round {
    taken: usize,
    /// The lease was taken while a batch was in flight, whose keys may
    /// have held events back: a short batch does not mean the outbox is
    /// drained.
    past_in_flight: bool,
    published: usize,
    failed: usize,
}

impl Round {
    /// Adds what a finished batch did (its error, if it had one and none
    /// came before).
    fn add(
        &mut self,
        done: Result<Round, dedup_core::StoreError>,
        error: &mut Option<dedup_core::StoreError>,
    ) {
        match done {
            Ok(done) => {
                self.published += done.published;
                self.failed += done.failed;
            }
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
}

/// A batch leased and sent, its acknowledgements still to come.
struct InFlight<L> {
    lease: L,
    records: Vec<dedup_core::OutboxRecord>,
    sending: publish::Sending,
    leased_at: tokio::time::Instant,
    /// Keys the batch before did not mark: none of their events here is
    /// marked either.
    held_back: HashSet<Key>,
}

impl<S: OutboxSource> Relay<S> {
    /// Starts building a relay over `source`.
    pub fn builder(source: S) -> RelayBuilder<S> {
        RelayBuilder::new(source)
    }

    /// Live counters, to read while it runs.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Where [`RelayBuilder::serve_http`] serves the relay's metrics and
    /// health while it runs (the port chosen, if it asked for port 0).
    #[cfg(feature = "http")]
    pub fn http_addr(&self) -> Option<std::net::SocketAddr> {
        self.http
            .as_ref()
            .map(crate::http::HttpEndpoints::local_addr)
    }

    /// Runs until SIGINT or SIGTERM.
    pub async fn run(self) -> Result<RelayStatsSnapshot, Error> {
        self.run_until(crate::shutdown_signal()).await
    }

    /// Runs until `shutdown` completes. A batch in flight is finished
    /// first (bounded by the delivery and store timeouts), so nothing is
    /// published without being marked unless the process dies. An error
    /// when the producer failed fatally (librdkafka says it cannot be used
    /// any more, e.g. fenced or out of sequence): every send would fail, so
    /// the relay stops instead of retrying for ever; what it had not marked
    /// stays pending for the next relay.
    pub async fn run_until(
        #[cfg_attr(not(feature = "http"), allow(unused_mut))] mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<RelayStatsSnapshot, Error> {
        #[cfg(feature = "http")]
        let _server = self
            .http
            .take()
            .map(|http| http.relay("relay", self.stats.clone()).spawn());
        self.stats.running.store(true, Ordering::Release);
        self.stats.turned();
        // Credentials and TLS the brokers refuse are named at start.
        let worked = match crate::access::check(&self.access, "relay", &Default::default()).await {
            Ok(()) => self.work(shutdown).await,
            Err(e) => Err(e),
        };
        self.stats.running.store(false, Ordering::Release);
        if let Err(e) = &worked {
            *self.stats.fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
        worked
    }

    /// The relay's loop, until `shutdown`.
    async fn work(&self, shutdown: impl Future<Output = ()>) -> Result<RelayStatsSnapshot, Error> {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let work = async {
            let mut jitter = Jitter::new(self.batch_size as u64);
            let mut failures: u32 = 0;
            let mut last_purge = tokio::time::Instant::now();
            // A purge is under way: its last batch came back full, so more
            // rows are past their retention. One batch per turn, between
            // publishing rounds, until a batch comes back short.
            let mut purging = false;
            let metrics = RelayMetrics::new();
            let mut last_backlog: Option<tokio::time::Instant> = None;
            // A full batch left in flight by the last turn (see `round`).
            let mut carried: Option<InFlight<S::Lease>> = None;
            while !*stop_rx.borrow() {
                self.stats.turned();
                if last_backlog.is_none_or(|at| at.elapsed() >= BACKLOG_INTERVAL) {
                    last_backlog = Some(tokio::time::Instant::now());
                    // Bounded: a slow count must not hold publishing up.
                    match tokio::time::timeout(BACKLOG_INTERVAL, self.source.backlog()).await {
                        Ok(Ok(Some((pending, oldest)))) => metrics.backlog(pending, oldest),
                        Ok(Ok(None)) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "outbox relay: reading the backlog failed")
                        }
                        Err(_) => tracing::debug!("outbox relay: reading the backlog timed out"),
                    }
                }
                if purging || last_purge.elapsed() >= self.purge_interval {
                    if !purging {
                        last_purge = tokio::time::Instant::now();
                    }
                    // A batch in flight is finished first: its lease runs
                    // on while the purge does.
                    if let Some(batch) = carried.take() {
                        let (done, _) = self.complete(batch, &mut jitter, &metrics, &stop_rx).await;
                        if let Err(e) = done {
                            tracing::warn!(error = %e, "outbox relay: marking a batch failed");
                        }
                    }
                    let purge = self.source.purge_sent(PURGE_BATCH);
                    purging = match tokio::time::timeout(self.store_timeout, purge).await {
                        Ok(Ok(purged)) => purged >= u64::from(PURGE_BATCH),
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "outbox relay: purging sent events failed");
                            false
                        }
                        Err(_) => {
                            tracing::warn!(
                                store_timeout = ?self.store_timeout,
                                "outbox relay: purging sent events took longer than store_timeout"
                            );
                            false
                        }
                    };
                }
                let round = self
                    .round(&mut jitter, &metrics, &stop_rx, &mut carried)
                    .await;
                if let Some(fatal) = fatal_error("relay's producer", self.producer.client()) {
                    return Err(fatal);
                }
                self.stats
                    .store_failing
                    .store(round.is_err(), Ordering::Release);
                if round.is_ok() {
                    self.stats.store_answered.store(true, Ordering::Release);
                }
                let wait = match round {
                    // Nothing got through: the broker is likely down, or
                    // (events taken and none settled, none in flight) the
                    // sends were cut before the first because the lease
                    // took the whole send window, and the events went
                    // back: looking again at once would lease them again
                    // for nothing while the store is slow.
                    Ok(round)
                        if round.published == 0
                            && (round.failed > 0 || (round.taken > 0 && carried.is_none())) =>
                    {
                        failures += 1;
                        Some(self.retry.backoff(failures, jitter.next()))
                    }
                    Ok(round) => {
                        failures = 0;
                        // Only an empty lease means there is nothing to
                        // take. A short one may be short of events another
                        // relay's batch held back (their key's earlier
                        // events were its): that relay marks them, which
                        // wakes nobody on a store that cannot notify, so
                        // this relay looks again instead of waiting.
                        if round.taken > 0 || round.past_in_flight || purging {
                            continue; // more may be waiting, or more to purge
                        }
                        None
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(error = %e, "outbox relay: reading the outbox failed");
                        Some(self.retry.backoff(failures, jitter.next()))
                    }
                };
                self.stats.failing_rounds.store(failures, Ordering::Release);
                match wait {
                    Some(backoff) => until_stopped(tokio::time::sleep(backoff), &stop_rx).await,
                    None => {
                        let events = self.source.wait_for_events(self.poll_interval);
                        until_stopped(events, &stop_rx).await;
                    }
                }
            }
            // Stopping: the batch in flight is finished.
            if let Some(batch) = carried.take() {
                let (done, _) = self.complete(batch, &mut jitter, &metrics, &stop_rx).await;
                if let Err(e) = done {
                    tracing::warn!(error = %e, "outbox relay: marking the last batch failed");
                }
            }
            Ok(())
        };
        // The round in progress finishes; only the waits are cut short.
        tokio::pin!(work);
        tokio::pin!(shutdown);
        let worked = tokio::select! {
            worked = &mut work => worked,
            () = &mut shutdown => {
                let _ = stop_tx.send(true);
                work.await
            }
        };
        worked.map(|()| self.stats.snapshot())
    }

    /// One turn: lease a batch and queue its sends; meanwhile the batch
    /// the turn before left in flight (`carried`) gets its
    /// acknowledgements, and is marked once this one's sends are queued.
    /// A full batch with nothing failed so far is left in flight for the
    /// next turn, so the database's work (this lease, that marking)
    /// overlaps the broker's; any other batch is finished in this turn,
    /// so nothing is in flight while the relay waits.
    async fn round(
        &self,
        jitter: &mut Jitter,
        metrics: &RelayMetrics,
        stop: &tokio::sync::watch::Receiver<bool>,
        carried: &mut Option<InFlight<S::Lease>>,
    ) -> Result<Round, dedup_core::StoreError> {
        let mut round = Round::default();
        let mut error = None;
        let mut before = carried.take();
        // The batch in flight is marked after this lease and these sends
        // (each bounded: the store timeout, the send window): if that could
        // take it past its lease, it is finished first, or another relay
        // would take it over and publish it again.
        if let Some(batch) = before.take_if(|batch| {
            batch.leased_at.elapsed() + self.store_timeout + self.send_window >= self.lease
        }) {
            let (done, _) = self.complete(batch, jitter, metrics, stop).await;
            round.add(done, &mut error);
        }
        let mut leased_at = tokio::time::Instant::now();
        let timed_out = || {
            dedup_core::StoreError::environment(format!(
                "leasing pending events took longer than store_timeout ({:?})",
                self.store_timeout
            ))
        };
        let mut leased = Ok(None);
        // Once the relay is stopping, nothing new is leased: the batch in
        // flight is finished and the turn ends.
        let stopping = *stop.borrow();
        if let Some(batch) = before.as_ref().filter(|_| !stopping) {
            let leasing =
                self.source
                    .lease_pending_after(self.batch_size, self.lease, &batch.lease);
            leased = tokio::time::timeout(self.store_timeout, leasing)
                .await
                .unwrap_or_else(|_| Err(timed_out()));
        }
        // The source cannot lease past a batch in flight: it is finished
        // first.
        if matches!(leased, Ok(None))
            && let Some(batch) = before.take()
        {
            let (done, _) = self.complete(batch, jitter, metrics, stop).await;
            round.add(done, &mut error);
        }
        round.past_in_flight = before.is_some();
        if before.is_none() && matches!(leased, Ok(None)) && !stopping {
            leased_at = tokio::time::Instant::now();
            let leasing = self.source.lease_pending(self.batch_size, self.lease);
            leased = tokio::time::timeout(self.store_timeout, leasing)
                .await
                .unwrap_or_else(|_| Err(timed_out()))
                .map(Some);
        }
        let next = match leased {
            Ok(Some((lease, records))) if !records.is_empty() => {
                // What is not sent within the window waits for a later
                // round. (The batch before sent every event: only such a
                // batch is left in flight.)
                let sending = self.send(&records, leased_at + self.send_window).await;
                Some(InFlight {
                    lease,
                    records,
                    sending,
                    leased_at,
                    held_back: HashSet::new(),
                })
            }
            Ok(_) => None,
            Err(e) => {
                error = Some(e);
                None
            }
        };
        round.taken = next.as_ref().map_or(0, |batch| batch.records.len());
        let mut unmarked = HashSet::new();
        if let Some(batch) = before {
            let (done, keys) = self.complete(batch, jitter, metrics, stop).await;
            round.add(done, &mut error);
            unmarked = keys;
        }
        if let Some(mut batch) = next {
            // Its events of keys the batch before did not mark are not
            // marked either.
            batch.held_back = unmarked;
            // Left in flight only if all went well: a batch that did not
            // send some of its events (the window ran out, or the producer
            // refused one) must be finished before anything is leased past
            // them, and a failure means the broker may be down (the relay
            // backs off with nothing in flight).
            if round.taken == self.batch_size
                && error.is_none()
                && round.failed == 0
                && !batch.sending.cut()
                && batch.sending.unsent_keys().is_empty()
                && !*stop.borrow()
            {
                *carried = Some(batch);
            } else {
                let (done, _) = self.complete(batch, jitter, metrics, stop).await;
                round.add(done, &mut error);
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(round),
        }
    }

    /// Finishes a batch in flight: waits for its acknowledgements, marks
    /// what they acknowledged and records what failed. Returns what it did
    /// and the keys whose events the next batch must not mark (one of
    /// theirs failed or was not marked here).
    async fn complete(
        &self,
        batch: InFlight<S::Lease>,
        jitter: &mut Jitter,
        metrics: &RelayMetrics,
        stop: &tokio::sync::watch::Receiver<bool>,
    ) -> (Result<Round, dedup_core::StoreError>, HashSet<Key>) {
        let InFlight {
            lease,
            records,
            sending,
            leased_at,
            held_back,
        } = batch;
        let (outcomes, unmarked) = self.settled(&records, sending, &held_back).await;
        failpoint("relay-after-publish");
        let mut published = Vec::with_capacity(records.len());
        let mut failed = Vec::new();
        for (record, outcome) in records.iter().zip(outcomes) {
            match outcome {
                Sent::Acked => published.push(record.seq),
                Sent::Failed(reason) => {
                    let attempts = record.attempts.saturating_add(1);
                    let retry_after = self.retry.backoff(attempts, jitter.next());
                    tracing::warn!(
                        seq = record.seq,
                        event_id = %record.event_id,
                        topic = %record.topic,
                        attempts,
                        ?retry_after,
                        error = %reason,
                        "outbox relay: publishing failed; the event and its key's later ones wait"
                    );
                    failed.push(PublishFailure::new(record.seq, reason, retry_after));
                }
                Sent::Held => {}
            }
        }
        if let Err(e) = self
            .finish(&lease, &published, &failed, leased_at, jitter, stop)
            .await
        {
            // Nothing of it is marked: none of its keys' events in the
            // next batch is either (nor of the keys held back from it).
            let unmarked = records
                .iter()
                .filter_map(publish::key_of)
                .chain(held_back)
                .collect();
            return (Err(e), unmarked);
        }
        let round = Round {
            taken: records.len(),
            published: published.len(),
            failed: failed.len(),
            ..Round::default()
        };
        self.stats
            .published
            .fetch_add(round.published as u64, Ordering::Relaxed);
        self.stats
            .failed
            .fetch_add(round.failed as u64, Ordering::Relaxed);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        metrics.round(round.published, round.failed);
        tracing::debug!(
            published = round.published,
            failed = round.failed,
            "outbox relay: batch done"
        );
        (Ok(round), unmarked)
    }

    /// Marks the batch, retrying while its lease lasts: events the broker
    /// acknowledged and the outbox forgot would be published again. Past
    /// the lease (or at shutdown) it gives up; the batch is then published
    /// again once the lease expires.
    async fn finish(
        &self,
        lease: &S::Lease,
        published: &[i64],
        failed: &[PublishFailure],
        leased_at: tokio::time::Instant,
        jitter: &mut Jitter,
        stop: &tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), dedup_core::StoreError> {
        let mut attempts: u32 = 0;
        loop {
            let limit = self.store_timeout;
            let marking = self.source.finish(lease, published, failed);
            let error = match tokio::time::timeout(limit, marking).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => e,
                Err(_) => dedup_core::StoreError::environment(format!(
                    "marking the batch took longer than store_timeout ({limit:?})"
                )),
            };
            attempts += 1;
            let backoff = self.retry.backoff(attempts, jitter.next());
            if *stop.borrow() || leased_at.elapsed() + backoff >= self.lease {
                return Err(error);
            }
            tracing::warn!(
                error = %error,
                published = published.len(),
                ?backoff,
                "outbox relay: marking a published batch failed; retrying while its lease lasts"
            );
            until_stopped(tokio::time::sleep(backoff), stop).await;
        }
    }
}

/// Waits for `wait`, cut short when the relay is told to stop.
async fn until_stopped(wait: impl Future<Output = ()>, stop: &tokio::sync::watch::Receiver<bool>) {
    let mut stopping = stop.clone();
    tokio::select! {
        () = wait => {}
        _ = stopping.wait_for(|s| *s) => {}
    }
}

#[cfg(test)]
mod tests;
