//! A batch's sends: every record queued, each acknowledgement awaited, and
//! a key's later records held behind its failed one.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use dedup_core::outbox::{EVENT_ID_HEADER, OutboxRecord, OutboxSource};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureRecord};

use super::Relay;

/// What became of one record of a batch.
pub(super) enum Sent {
    /// Acknowledged by the broker.
    Acked,
    /// Failed, with the reason.
    Failed(String),
    /// Not sent: an earlier event of its key failed in this batch.
    Held,
}

impl<S: OutboxSource> Relay<S> {
    /// Sends every record (they queue in the producer together) and waits
    /// for each acknowledgement. After a failure of a key, that key's later
    /// records in the batch are not marked, so none is marked past an
    /// unsent earlier one.
    pub(super) async fn publish(
        &self,
        records: &[OutboxRecord],
        send_by: tokio::time::Instant,
    ) -> Vec<Sent> {
        let mut outcomes: Vec<Option<Sent>> = records.iter().map(|_| None).collect();
        // Keys with a failure known so far: their later records are not sent.
        let mut failed_keys: HashSet<(&str, &[u8])> = HashSet::new();
        let mut inflight: VecDeque<(usize, DeliveryFuture)> = VecDeque::new();
        // Each record's `send` span (feature `opentelemetry`), ended with
        // the batch, once its acknowledgements are in.
        #[cfg(feature = "opentelemetry")]
        let mut spans = Vec::with_capacity(records.len());
        'records: for (i, record) in records.iter().enumerate() {
            if key_of(record).is_some_and(|k| failed_keys.contains(&k)) {
                outcomes[i] = Some(Sent::Held);
                continue;
            }
            let headers = headers(record);
            #[cfg(feature = "opentelemetry")]
            let headers = {
                let cx = crate::otel::send(&record.topic, &record.headers);
                let headers = crate::otel::with_trace(headers, &cx);
                spans.push(cx);
                headers
            };
            let mut future_record = FutureRecord::to(&record.topic)
                .payload(&record.payload)
                .headers(headers);
            if let Some(key) = &record.key {
                future_record = future_record.key(key);
            }
            loop {
                if tokio::time::Instant::now() >= send_by {
                    // Neither this record nor any later one is sent (they
                    // stay unset: held, so none is marked past it).
                    tracing::warn!(
                        sent = i,
                        held = records.len() - i,
                        "outbox relay: the batch's sends ran past half its lease; the rest waits"
                    );
                    break 'records;
                }
                match self.producer.send_result(future_record) {
                    Ok(delivery) => {
                        inflight.push_back((i, delivery));
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        // Make room: wait for the oldest acknowledgement.
                        future_record = back;
                        match inflight.pop_front() {
                            Some((j, delivery)) => {
                                let sent = settle(delivery).await;
                                if matches!(sent, Sent::Failed(_)) {
                                    failed_keys.extend(key_of(&records[j]));
                                }
                                outcomes[j] = Some(sent);
                            }
                            None => tokio::time::sleep(Duration::from_millis(10)).await,
                        }
                    }
                    // Refused before sending (too large, unknown topic...).
                    Err((e, _)) => {
                        failed_keys.extend(key_of(record));
                        outcomes[i] = Some(Sent::Failed(e.to_string()));
                        break;
                    }
                }
            }
        }
        for (j, delivery) in inflight {
            outcomes[j] = Some(settle(delivery).await);
        }
        // A delivery that failed after later records of its key were sent:
        // those may have reached the broker, but none is marked past the
        // failed one, so the key resumes from it.
        let mut failed_keys: HashSet<(&str, &[u8])> = HashSet::new();
        records
            .iter()
            .zip(outcomes)
            .map(|(record, outcome)| {
                let outcome = outcome.unwrap_or(Sent::Held);
                let Some(key) = key_of(record) else {
                    return outcome;
                };
                if failed_keys.contains(&key) {
                    return match outcome {
                        // Its own failure is still recorded.
                        Sent::Failed(reason) => Sent::Failed(reason),
                        _ => Sent::Held,
                    };
                }
                if matches!(outcome, Sent::Failed(_)) {
                    failed_keys.insert(key);
                }
                outcome
            })
            .collect()
    }
}

/// The key a record's order is kept by, if it has one: (topic, key).
fn key_of(record: &OutboxRecord) -> Option<(&str, &[u8])> {
    record
        .key
        .as_deref()
        .map(|key| (record.topic.as_str(), key))
}

async fn settle(delivery: DeliveryFuture) -> Sent {
    match delivery.await {
        Ok(Ok(_)) => Sent::Acked,
        Ok(Err((e, _))) => Sent::Failed(e.to_string()),
        Err(_) => Sent::Failed("the producer dropped the message".to_owned()),
    }
}

/// The record's headers, then `event-id` (consumers read the last value
/// of a repeated header, so the outbox's id wins).
fn headers(record: &OutboxRecord) -> OwnedHeaders {
    let mut out = OwnedHeaders::new_with_capacity(record.headers.len() + 1);
    for (name, value) in &record.headers {
        out = out.insert(Header {
            key: name,
            value: Some(value),
        });
    }
    out.insert(Header {
        key: EVENT_ID_HEADER,
        value: Some(&record.event_id),
    })
}
