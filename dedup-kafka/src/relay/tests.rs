//! The relay against outboxes that misbehave: a statement that never
//! answers, and a producer that failed fatally (librdkafka's mock cluster
//! refusing it a producer id, as a broker denying the principal would).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dedup_core::StoreError;
use dedup_core::outbox::{OutboxRecord, OutboxSource, PublishFailure};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use super::Relay;

/// An outbox of one event that is never marked: each lease offers it again.
/// With `hang_first`, the first lease never answers (a frozen database).
/// `leases` counts them, shared with the test.
#[derive(Default)]
struct Stub {
    hang_first: bool,
    leases: Arc<AtomicU32>,
}

impl OutboxSource for Stub {
    type Lease = ();

    async fn lease_pending(
        &self,
        _limit: usize,
        _lease_for: Duration,
    ) -> Result<((), Vec<OutboxRecord>), StoreError> {
        if self.leases.fetch_add(1, Ordering::SeqCst) == 0 && self.hang_first {
            std::future::pending::<()>().await;
        }
        let record = OutboxRecord::new(1, "e-1".into(), "out".into(), b"{}".to_vec());
        Ok(((), vec![record]))
    }

    async fn finish(&self, _: &(), _: &[i64], _: &[PublishFailure]) -> Result<(), StoreError> {
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
