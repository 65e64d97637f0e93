//! Dead-lettering a message once (or moving it to a retry tier once, the
//! same way): the dead letter is produced, then recorded
//! in the store (a claim per partition offset), so that a redelivery of the
//! message (a crash or a rebalance before its offset was committed) is
//! skipped instead of being dead-lettered again or, once the cause is gone,
//! applied.
//!
//! No store transaction is held while a dead letter is produced (a slow
//! broker must not hold SQLite's write lock or a pool connection). Within
//! one process, a partition's dead-lettering and the reading of its records
//! by its next worker take turns through a per-partition gate, so a
//! partition revoked and assigned back never starts before its old worker
//! has recorded what it dead-lettered.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use dedup_core::{DedupKey, DedupStore};
use rdkafka::message::{Message as _, OwnedMessage};

use crate::database::partition::state::Partition;
use crate::database::partition::{Runtime, wait_unless_stopped};
use crate::database::route::{Before, Route};
use crate::dead_letter_format::{self, DeadLetter};
use crate::failpoint::failpoint;
use crate::pipeline::attempt::timed_out;
use crate::pipeline::decision::{Decision, Fault};
use crate::pipeline::outage::Retrying;
use crate::retry::Jitter;

/// Dead-letters `msg` once, or (`why.moved`) moves it to a retry tier
/// once: unless the store says either was done already, produces it, then
/// records it. A move the broker refuses as too large dead-letters it
/// instead. `false` if the message was not finished (the consumer stops,
/// or the partition was revoked before its dead letter was produced): its
/// offset is not stored.
pub(crate) async fn dead_letter<S: DedupStore>(
    shared: &Runtime<S>,
    route: &Route<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    mut why: DeadLetter<'_>,
    jitter: &mut Jitter,
) -> bool {
    let gate = shared.dead_letter_gate(&partition.topic, partition.partition);
    let _turn = gate.lock().await;
    // Revoked: the next owner dead-letters it (once it has read the records).
    if partition.is_revoked() {
        return false;
    }
    // A move's record sorts right after the dead letter's: one read finds
    // either.
    match recorded_from(shared, partition, &route.dead_letter_record(msg), jitter).await {
        None => return false,
        Some(ids) => {
            if let Some(before) = route.finished_before(&ids, msg) {
                skip(shared, route, msg, before);
                return true;
            }
        }
    }
    match produce(shared, partition, msg, &why, jitter).await {
        Sent::Acknowledged => {}
        Sent::No => return false,
        Sent::TooLarge => {
            let tier = why.moved.take().map(|m| m.tier).unwrap_or_default();
            why.message = format!(
                "it could not be moved to retry tier {tier:?}, being too large for {:?}; it \
                 failed with: {}",
                why.topic, why.message
            );
            why.topic = &route.dead_letter_topic;
            if !matches!(
                produce(shared, partition, msg, &why, jitter).await,
                Sent::Acknowledged
            ) {
                return false;
            }
        }
    }
    let mut records = Vec::with_capacity(2);
    match &why.moved {
        Some(moved) => {
            route.record(&shared.stats).moved(moved.tier);
            records.push(route.moved_record(msg));
            // Under key hold-back, an event leaving its origin topic holds
            // its key, in the same transaction.
            if !route.in_tier()
                && let Some(key) = route.hold_key(msg)
            {
                let held = crate::database::hold::in_record(&shared.group, &why.origin, key);
                crate::database::hold::went_in(partition, &held, key, &why.origin);
                records.push(held);
            }
        }
        None => {
            route.record(&shared.stats).dead_lettered();
            records.push(route.dead_letter_record(msg));
            // Dead-lettered from a tier: it no longer holds its key (one
            // whose tier headers are forged never held one).
            if route.in_tier()
                && why.kind != crate::tiers::FORGED
                && let Some(key) = route.hold_key(msg)
            {
                records.push(crate::database::hold::out_record(
                    &shared.group,
                    &why.origin,
                    key,
                ));
            }
        }
    }
    // Under key hold-back an unrecorded move would let the key's next
    // events pass it: it is not finished (its redelivery moves it again,
    // and its claim makes the second copy a skip).
    let holds = records.len() > 1;
    if !record_all(shared, route, &records, holds, jitter).await && holds {
        return false;
    }
    match why.moved {
        Some(_) => failpoint("after-move"),
        None => failpoint("after-dead-letter"),
    }
    true
}

/// Counts and logs a redelivered message that was dead-lettered or moved
/// to a retry tier before.
pub(crate) fn skip<S: 'static>(
    shared: &Runtime<S>,
    route: &Route<S>,
    msg: &OwnedMessage,
    before: Before,
) {
    match before {
        Before::DeadLettered => {
            shared
                .stats
                .already_dead_lettered
                .fetch_add(1, Ordering::Relaxed);
            route.metrics().already_dead_lettered();
            tracing::info!(
                offset = msg.offset(),
                outcome = "already_dead_lettered",
                "dead-lettered before; skipped"
            );
        }
        Before::Moved => {
            route.record(&shared.stats).already_moved();
            tracing::info!(
                offset = msg.offset(),
                outcome = "already_moved",
                "moved to a retry tier before; skipped"
            );
        }
    }
}

/// The records of the partition's messages dead-lettered within their
/// handler's TTL, from offset `from` on: read once, before a worker's first
/// message (after any dead letter of the partition in flight in this
/// process is recorded). `None` if the consumer stops or the partition is
/// revoked while the store is unreachable.
pub(crate) async fn recorded<S: DedupStore>(
    shared: &Runtime<S>,
    route: &Route<S>,
    partition: &Partition,
    from: i64,
    jitter: &mut Jitter,
) -> Option<HashSet<String>> {
    drop(
        shared
            .dead_letter_gate(&partition.topic, partition.partition)
            .lock()
            .await,
    );
    let first = route.dead_letter_records_from(&partition.topic, partition.partition, from);
    recorded_from(shared, partition, &first, jitter).await
}

/// The live record ids from `first` on, waiting out the store.
pub(crate) async fn recorded_from<S: DedupStore>(
    shared: &Runtime<S>,
    partition: &Partition,
    first: &DedupKey,
    jitter: &mut Jitter,
) -> Option<HashSet<String>> {
    let limit = shared.settings.pipeline.attempt_timeout;
    let mut retrying = Retrying::new(&shared.stats, shared.settings.pipeline.retry);
    loop {
        let error = match tokio::time::timeout(limit, shared.store.live_ids_from(first)).await {
            Ok(Ok(ids)) => {
                shared.stats.store_answered();
                return Some(ids.into_iter().collect());
            }
            Ok(Err(e)) => e,
            Err(_) => timed_out(limit),
        };
        // A read no event can fail: whatever stops it is the environment's.
        let wait = match retrying.environment_failed(&error, jitter.next()) {
            Ok(wait) => wait,
            Err(why) => {
                shared.fail(why);
                return None;
            }
        };
        if !wait_unless_stopped(shared, partition, wait).await {
            return None;
        }
    }
}

/// Records a dead letter the broker acknowledged, in a short transaction of
/// its own, waiting out the store (also after a revoke: the next owner
/// needs the record). Given up only when the consumer stops, or for a
/// refusal no retry helps: then a redelivery may dead-letter it again.
///
/// With `needed` (key hold-back's records are among them: without them a
/// key would be let go, or passed, unrecorded), a refusal stops the
/// consumer with its reason instead: the caller leaves the event
/// unfinished.
pub(crate) async fn record_all<S: DedupStore>(
    shared: &Runtime<S>,
    route: &Route<S>,
    records: &[DedupKey],
    needed: bool,
    jitter: &mut Jitter,
) -> bool {
    let policy = shared.settings.pipeline.retry;
    let limit = shared.settings.pipeline.attempt_timeout;
    let ttl = route.handler.ttl();
    let mut retrying = Retrying::new(&shared.stats, policy);
    loop {
        let attempt = async {
            let mut tx = shared.store.begin().await?;
            for record in records {
                if let Err(e) = shared.store.claim(&mut tx, record, None, ttl).await {
                    let _ = shared.store.rollback(tx).await;
                    return Err(e);
                }
            }
            shared.store.commit(tx).await
        };
        let (error, fault) = match tokio::time::timeout(limit, attempt).await {
            Ok(Ok(())) => return true,
            Ok(Err(e)) => {
                let fault = Fault::from_class(e.classification());
                (e, fault)
            }
            Err(_) => (timed_out(limit), Fault::TimedOut),
        };
        let wait = match retrying.failed(fault, &error, jitter.next()) {
            Decision::Retry(wait) | Decision::WaitOut(wait) => wait,
            Decision::Stop { failing_for } => {
                shared.fail(retrying.outlasted(failing_for, &error));
                return false;
            }
            Decision::DeadLetter if needed => {
                shared.fail(format!(
                    "the store refuses to record what is in the retry tiers ({error}): \
                     stopping, so that no key held back is let go or passed unrecorded"
                ));
                return false;
            }
            Decision::DeadLetter => {
                tracing::warn!(
                    %error,
                    "the dead letter cannot be recorded in the store; a redelivery of this \
                     message may dead-letter it again"
                );
                return false;
            }
        };
        let mut stopping = shared.stopping.subscribe();
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stopping.wait_for(|s| *s) => {
                tracing::warn!(
                    "stopping before the dead letter was recorded; a redelivery of this \
                     message may dead-letter it again"
                );
                return false;
            }
        }
    }
}

/// How a produce ended.
enum Sent {
    /// The broker acknowledged it.
    Acknowledged,
    /// The consumer stops, the partition was revoked, or the topic cannot
    /// be written: not finished.
    No,
    /// A move to a retry tier too large for the broker (a move is never
    /// cut): dead-letter it instead.
    TooLarge,
}

/// Produces the dead letter, retrying until the broker acknowledges it: a
/// message is never dropped because its dead letter could not be written.
/// A broker that cannot take it is an outage like any other (health shows
/// it, `max_outage` bounds it). `false` if the consumer stops, the
/// partition is revoked, or the topic cannot be written at all or for
/// longer than `max_outage` (then the consumer is stopping with an error).
async fn produce<S>(
    shared: &Runtime<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    why: &DeadLetter<'_>,
    jitter: &mut Jitter,
) -> Sent {
    let mut attempt = 0;
    // The payload kept: whole, then cut, then none, as long as the broker
    // refuses the record as too large (the original stays in its topic).
    let mut keep = None;
    // Since when the topic has looked unwritable: a topic can look unknown
    // or unauthorized for a while (a broker restarted with an empty cache, a
    // grant still spreading), so only a lasting refusal stops the consumer.
    let mut unwritable_since: Option<std::time::Instant> = None;
    let mut retrying = Retrying::new(&shared.stats, shared.settings.pipeline.retry);
    loop {
        attempt += 1;
        match dead_letter_format::send(
            &shared.producer,
            msg,
            why,
            shared.settings.dead_letter_timeout,
            keep,
        )
        .await
        {
            Ok(()) => {
                match &why.moved {
                    Some(moved) => tracing::warn!(
                        outcome = "moved",
                        tier = moved.tier,
                        topic = why.topic,
                        kind = why.kind,
                        attempts = moved.attempts,
                        error = %why.message,
                    ),
                    None => tracing::warn!(
                        outcome = "dead_lettered",
                        dead_letter_topic = why.topic,
                        kind = why.kind,
                        error = %why.message,
                    ),
                }
                return Sent::Acknowledged;
            }
            Err(e) if dead_letter_format::is_too_large(&e) && why.moved.is_some() => {
                return Sent::TooLarge;
            }
            Err(e) if dead_letter_format::is_missing_partition(&e) && why.moved.is_some() => {
                shared.fail(format!(
                    "the retry tier's topic {:?} has no partition {} ({e}): give it as many \
                     partitions as {:?} (a move keeps its origin's partition)",
                    why.topic, why.origin.partition, why.origin.topic
                ));
                return Sent::No;
            }
            Err(e) if dead_letter_format::is_too_large(&e) && keep != Some(0) => {
                keep = Some(match keep {
                    None => dead_letter_format::TRUNCATED_PAYLOAD_BYTES,
                    Some(_) => 0,
                });
                tracing::warn!(error = %e, keep, "the dead letter is too large for the broker; sending it with its payload cut");
            }
            Err(e) if dead_letter_format::is_too_large(&e) => {
                shared.fail(format!(
                    "a dead letter for {:?} is too large even without its payload (its key and \
                     headers exceed the topic's max.message.bytes): raise the limit of {:?}",
                    why.topic, why.topic
                ));
                return Sent::No;
            }
            Err(e) if dead_letter_format::is_unwritable(&e) => {
                let since = *unwritable_since.get_or_insert_with(std::time::Instant::now);
                let lasting = since.elapsed() >= dead_letter_format::UNWRITABLE_FOR && attempt >= 3;
                if dead_letter_format::is_invalid(&e) || lasting {
                    shared.fail(match why.moved {
                        Some(_) => format!(
                            "the retry tier's topic {:?} cannot be written ({e}): create it (as \
                             many partitions as its handled topic), or grant the consumer's \
                             principal Write on it",
                            why.topic
                        ),
                        None => format!(
                            "the dead-letter topic {:?} cannot be written ({e}): create it, or \
                             grant the consumer's principal Write on it, or name another with \
                             dead_letter_topic()",
                            why.topic
                        ),
                    });
                    return Sent::No;
                }
                let Some(wait) = broker_failed(shared, &mut retrying, &e, jitter) else {
                    return Sent::No;
                };
                tracing::error!(error = %e, ?wait, topic = why.topic, "the dead-letter or retry topic cannot be written; retrying");
                if !wait_unless_stopped(shared, partition, wait).await {
                    return Sent::No;
                }
            }
            Err(e) => {
                let Some(wait) = broker_failed(shared, &mut retrying, &e, jitter) else {
                    return Sent::No;
                };
                tracing::error!(error = %e, ?wait, topic = why.topic, "producing the dead letter or move failed; retrying");
                if !wait_unless_stopped(shared, partition, wait).await {
                    return Sent::No;
                }
            }
        }
    }
}

/// A produce the broker failed, waited out as the environment's fault: the
/// wait before the next try, or `None` once it outlasted `max_outage` (the
/// consumer is then stopping with an error).
fn broker_failed<S>(
    shared: &Runtime<S>,
    retrying: &mut Retrying<'_>,
    error: &rdkafka::error::KafkaError,
    jitter: &mut Jitter,
) -> Option<std::time::Duration> {
    match retrying.environment_failed(error, jitter.next()) {
        Ok(wait) => Some(wait),
        Err(why) => {
            shared.fail(why);
            None
        }
    }
}
