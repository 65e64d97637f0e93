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
    /// Not sent, or not to be marked: an earlier event of its key failed
    /// or went unsent (in this batch or the one before it).
    Held,
}

/// A topic and key, owned: a key whose later events must not be marked.
pub(super) type Key = (String, Vec<u8>);

/// A batch's sends once queued: the deliveries still to come in, and what
/// is known already.
pub(super) struct Sending {
    outcomes: Vec<Option<Sent>>,
    inflight: VecDeque<(usize, DeliveryFuture)>,
    /// Keys refused before sending (or whose delivery failed while the
    /// batch made room in the producer's queue): none of their later
    /// events was sent.
    unsent_keys: HashSet<Key>,
    /// The send window ran out before every record was queued.
    cut: bool,
    /// Each record's `send` span (feature `opentelemetry`), ended once
    /// the batch's acknowledgements are in.
    #[cfg(feature = "opentelemetry")]
    spans: Vec<opentelemetry::Context>,
}

impl Sending {
    /// Whether some records were not queued because the send window ran
    /// out: their keys' later events must not be sent before them.
    pub(super) fn cut(&self) -> bool {
        self.cut
    }

    /// Keys none of whose later events may be sent after this batch: one
    /// of theirs failed while the batch was queued.
    pub(super) fn unsent_keys(&self) -> &HashSet<Key> {
        &self.unsent_keys
    }
}

impl<S: OutboxSource> Relay<S> {
    /// Queues every record (they travel in the producer together) by
    /// `send_by`, except the later records of a key refused on the way.
    pub(super) async fn send(
        &self,
        records: &[OutboxRecord],
        send_by: tokio::time::Instant,
    ) -> Sending {
        let mut sending = Sending {
            outcomes: records.iter().map(|_| None).collect(),
            inflight: VecDeque::new(),
            unsent_keys: HashSet::new(),
            cut: false,
            #[cfg(feature = "opentelemetry")]
            spans: Vec::with_capacity(records.len()),
        };
        'records: for (i, record) in records.iter().enumerate() {
            if holds(&sending.unsent_keys, record) {
                sending.outcomes[i] = Some(Sent::Held);
                continue;
            }
            let headers = headers(record);
            #[cfg(feature = "opentelemetry")]
            let headers = {
                let cx = crate::otel::send(&record.topic, &record.headers);
                let headers = crate::otel::with_trace(headers, &cx);
                sending.spans.push(cx);
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
                    sending.cut = true;
                    break 'records;
                }
                match self.producer.send_result(future_record) {
                    Ok(delivery) => {
                        sending.inflight.push_back((i, delivery));
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        // Make room: wait for the oldest acknowledgement,
                        // no longer than the window (a batch before may
                        // be waiting to be marked behind these sends).
                        future_record = back;
                        let Some((_, oldest)) = sending.inflight.front_mut() else {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        };
                        let Ok(delivered) = tokio::time::timeout_at(send_by, oldest).await else {
                            continue; // the window ran out: cut at the top
                        };
                        if let Some((j, _)) = sending.inflight.pop_front() {
                            let sent = outcome(delivered);
                            if matches!(sent, Sent::Failed(_)) {
                                sending.unsent_keys.extend(key_of(&records[j]));
                            }
                            sending.outcomes[j] = Some(sent);
                        }
                    }
                    // Refused before sending (too large, unknown topic...).
                    Err((e, _)) => {
                        sending.unsent_keys.extend(key_of(record));
                        sending.outcomes[i] = Some(Sent::Failed(e.to_string()));
                        break;
                    }
                }
            }
        }
        sending
    }

    /// Waits for each acknowledgement of `sending` (the sends of
    /// `records`) and says what became of each record; returns too the
    /// keys whose later events must not be marked (one of theirs failed or
    /// was not marked). `held_back`: such keys of the batch before, whose
    /// events here are not marked either.
    pub(super) async fn settled(
        &self,
        records: &[OutboxRecord],
        sending: Sending,
        held_back: &HashSet<Key>,
    ) -> (Vec<Sent>, HashSet<Key>) {
        let Sending {
            mut outcomes,
            inflight,
            ..
        } = sending;
        for (j, delivery) in inflight {
            outcomes[j] = Some(settle(delivery).await);
        }
        // A delivery that failed after later records of its key were sent:
        // those may have reached the broker, but none is marked past the
        // failed one, so the key resumes from it.
        let mut unmarked = held_back.clone();
        let outcomes = records
            .iter()
            .zip(outcomes)
            .map(|(record, outcome)| {
                let outcome = outcome.unwrap_or(Sent::Held);
                if holds(&unmarked, record) {
                    return match outcome {
                        // Its own failure is still recorded.
                        Sent::Failed(reason) => Sent::Failed(reason),
                        _ => Sent::Held,
                    };
                }
                if !matches!(outcome, Sent::Acked) {
                    unmarked.extend(key_of(record));
                }
                outcome
            })
            .collect();
        (outcomes, unmarked)
    }
}

/// Whether `keys` holds the record's key (without copying it when `keys`
/// is empty, as it nearly always is).
fn holds(keys: &HashSet<Key>, record: &OutboxRecord) -> bool {
    !keys.is_empty() && key_of(record).is_some_and(|key| keys.contains(&key))
}

/// The key a record's order is kept by, if it has one: (topic, key).
pub(super) fn key_of(record: &OutboxRecord) -> Option<Key> {
    record
        .key
        .as_ref()
        .map(|key| (record.topic.clone(), key.clone()))
}

async fn settle(delivery: DeliveryFuture) -> Sent {
    outcome(delivery.await)
}

/// What a delivery's result says of its record.
fn outcome(delivered: <DeliveryFuture as std::future::Future>::Output) -> Sent {
    match delivered {
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
