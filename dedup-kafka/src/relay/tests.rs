//! The relay against outboxes that misbehave: a statement that never
//! answers, and a producer that failed fatally (librdkafka's mock cluster
//! refusing it a producer id, as a broker denying the principal would).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{OutboxRecord, OutboxSource, PublishFailure};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use super::Relay;

/// An outbox of scripted events, by default one that is never marked (each
/// lease offers it again). With `hang_first`, the first lease never
/// answers (a frozen database); with `first_short`, it offers only the
/// first event, as a lease does while another relay holds the key of the
/// others; each lease takes `slow`. `leases` counts them, shared with the
/// test.
struct Stub {
    pending: Mutex<BTreeSet<i64>>,
    marks: bool,
    hang_first: bool,
    first_short: bool,
    /// How long each lease takes.
    slow: Duration,
    leases: Arc<AtomicU32>,
}

impl Default for Stub {
    fn default() -> Self {
        Stub {
            pending: Mutex::new(BTreeSet::from([1])),
            marks: false,
            hang_first: false,
            first_short: false,
            slow: Duration::ZERO,
            leases: Arc::default(),
        }
    }
}

impl OutboxSource for Stub {
    type Lease = ();

    async fn lease_pending(
        &self,
        limit: usize,
        _lease_for: Duration,
    ) -> Result<((), Vec<OutboxRecord>), StoreError> {
        let first = self.leases.fetch_add(1, Ordering::SeqCst) == 0;
        if first && self.hang_first {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.slow).await;
        let take = if first && self.first_short { 1 } else { limit };
        let pending = self.pending.lock().expect("pending");
        let records = pending
            .iter()
            .take(take)
            .map(|&seq| OutboxRecord::new(seq, format!("e-{seq}"), "out".into(), b"{}".to_vec()))
            .collect();
        Ok(((), records))
    }

    async fn finish(
        &self,
        _: &(),
        published: &[i64],
        _: &[PublishFailure],
    ) -> Result<(), StoreError> {
        if self.marks {
            let mut pending = self.pending.lock().expect("pending");
            for seq in published {
                pending.remove(seq);
            }
        }
        Ok(())
    }

    async fn wait_for_events(&self, timeout: Duration) {
        tokio::time::sleep(timeout).await;
    }

    async fn purge_sent(&self, _limit: u32) -> Result<u64, StoreError> {
        Ok(0)
    }
}

#[tokio::test]
async fn a_lease_that_never_answers_is_given_up_and_the_relay_goes_on() {
    let leases = Arc::new(AtomicU32::new(0));
    let source = Stub {
        hang_first: true,
        leases: leases.clone(),
        ..Stub::default()
    };
    let mock = MockCluster::<DefaultProducerContext>::new(1).expect("mock cluster");
    let relay = Relay::builder(source)
        .brokers(mock.bootstrap_servers())
        .store_timeout(Duration::from_millis(300))
        .delivery_timeout(Duration::from_secs(5))
        .poll_interval(Duration::from_millis(50))
        .build()
        .expect("relay");
    let stats = relay.stats();
    let stopped = async move {
        while stats.snapshot().published == 0 || leases.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let ran = tokio::time::timeout(Duration::from_secs(30), relay.run_until(stopped))
        .await
        .expect("the relay must not hang on a lease that never answers")
        .expect("ran");
    assert!(ran.published >= 1, "{ran}");
}

#[tokio::test]
async fn a_producer_that_failed_fatally_stops_the_relay_with_an_error() {
    let mock = MockCluster::<DefaultProducerContext>::new(1).expect("mock cluster");
    mock.request_errors(
        RDKafkaApiKey::InitProducerId,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_CLUSTER_AUTHORIZATION_FAILED; 10],
    );
    let relay = Relay::builder(Stub::default())
        .brokers(mock.bootstrap_servers())
        .delivery_timeout(Duration::from_secs(2))
        .retry(
            crate::RetryPolicy::default()
                .with_backoff(Duration::from_millis(50), Duration::from_millis(200)),
        )
        .build()
        .expect("relay");
    let ran = tokio::time::timeout(
        Duration::from_secs(30),
        relay.run_until(std::future::pending()),
    )
    .await
    .expect("a relay whose producer failed fatally must stop, not retry for ever");
    let err = ran.expect_err("a fatal producer error is the relay's error");
    assert!(
        err.to_string()
            .contains("fatal error of the relay's producer"),
        "{err}"
    );
}

/// Relays of a store that cannot notify (MySQL, SQLite) both took short
/// batches, each held back by the other's keys, and both waited out their
/// poll interval with the outbox full: a short batch is not a drained
/// outbox, only an empty one is.
#[tokio::test]
async fn a_short_batch_is_followed_by_another_look_not_by_the_poll_interval() {
    let source = Stub {
        pending: Mutex::new((1..=3).collect()),
        marks: true,
        first_short: true,
        ..Stub::default()
    };
    let mock = MockCluster::<DefaultProducerContext>::new(1).expect("mock cluster");
    let relay = Relay::builder(source)
        .brokers(mock.bootstrap_servers())
        .batch_size(7)
        .poll_interval(Duration::from_secs(60))
        .build()
        .expect("relay");
    let stats = relay.stats();
    let stopped = async move {
        while stats.snapshot().published < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let ran = tokio::time::timeout(Duration::from_secs(15), relay.run_until(stopped))
        .await
        .expect("the events held back from the first batch wait for the 60 s poll interval")
        .expect("ran");
    assert_eq!(ran.published, 3, "{ran}");
}

/// A lease slower than the batch's send window (a loaded database): no
/// send starts, the event goes back, and the relay must not lease it again
/// at once, round after round, while it reports itself healthy: it backs
/// off and counts the rounds as failing.
#[tokio::test]
async fn a_lease_slower_than_the_send_window_is_a_failing_round_backed_off() {
    let leases = Arc::new(AtomicU32::new(0));
    let source = Stub {
        slow: Duration::from_millis(700),
        leases: leases.clone(),
        ..Stub::default()
    };
    let mock = MockCluster::<DefaultProducerContext>::new(1).expect("mock cluster");
    // A send window of (3 s - 2 s) / 2 = 0.5 s from the lease's start.
    let relay = Relay::builder(source)
        .brokers(mock.bootstrap_servers())
        .delivery_timeout(Duration::from_secs(2))
        .lease_timeout(Duration::from_secs(3))
        .retry(
            crate::RetryPolicy::default()
                .with_backoff(Duration::from_secs(2), Duration::from_secs(2)),
        )
        .build()
        .expect("relay");
    let stats = relay.stats();
    let watched = stats.clone();
    let stopped = async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while watched.health().failing_rounds == 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let ran = tokio::time::timeout(Duration::from_secs(30), relay.run_until(stopped))
        .await
        .expect("stopped")
        .expect("ran");
    assert_eq!(ran.published, 0, "{ran}");
    assert!(
        stats.health().failing_rounds >= 1,
        "a round that took an event and settled none is failing: {:?}",
        stats.health()
    );
    assert!(
        leases.load(Ordering::SeqCst) <= 2,
        "backed off, not leased again at once: {} leases",
        leases.load(Ordering::SeqCst)
    );
}
