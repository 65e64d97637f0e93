//! Dead-lettering a message exactly once: the dead letter is produced, then
//! recorded in the store (a claim per offset), so that a redelivery of the
//! message (a crash or a rebalance before its offset was committed) is
//! skipped instead of being dead-lettered again or, once the cause is gone,
//! applied.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use dedup_core::{Classification, DedupKey, DedupStore, StoreError, Ttl};
use rdkafka::message::{Message as _, OwnedMessage};

use crate::dlq::{self, DeadLetter};
use crate::failpoint::failpoint;
use crate::partition::{AttemptTimedOut, Outage, Partition, Shared, wait_unless_stopped};
use crate::retry::Jitter;
use crate::route::Route;

/// Dead-letters `msg` once. The record is claimed before the dead letter is
/// produced and committed after the broker acknowledges it, so a second
/// owner of the partition dead-lettering the same message meanwhile waits
/// for it and then skips. `false` if the message was not finished (the
/// consumer stops or the partition is revoked first): its offset is not
/// stored.
pub(crate) async fn dead_letter<S: DedupStore>(
    shared: &Shared<S>,
    route: &Route<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    why: DeadLetter<'_>,
    jitter: &mut Jitter,
) -> bool {
    let record = route.dead_letter_record(msg.topic(), msg.partition(), msg.offset());
    let ttl = route.handler.ttl();
    let held = match take_record(shared, partition, &record, ttl, jitter).await {
        Taken::Held(tx) => Some(tx),
        Taken::Already => {
            skip(shared, msg);
            return true;
        }
        Taken::Unrecordable => None,
        Taken::Stopped => return false,
    };
    if !produce(shared, partition, msg, &why, jitter).await {
        if let Some(tx) = held {
            let _ = shared.store.rollback(tx).await;
        }
        return false;
    }
    shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
    if let Some(tx) = held {
        commit_record(shared, partition, tx, &record, ttl, jitter).await;
    }
    failpoint("after-dead-letter");
    true
}

/// Counts and logs a redelivered message that was dead-lettered before.
pub(crate) fn skip<S>(shared: &Shared<S>, msg: &OwnedMessage) {
    shared
        .stats
        .already_dead_lettered
        .fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        offset = msg.offset(),
        outcome = "already_dead_lettered",
        "dead-lettered before; skipped"
    );
}

/// The offsets of the partition, from `from` on, that were dead-lettered
/// within their handler's TTL: read once, before a worker's first message.
/// The store is waited out like any failure of the environment; `None` if
/// the consumer stops or the partition is revoked meanwhile.
pub(crate) async fn recorded<S: DedupStore>(
    shared: &Shared<S>,
    route: &Route<S>,
    partition: &Partition,
    from: i64,
    jitter: &mut Jitter,
) -> Option<BTreeSet<i64>> {
    let first = route.dead_letter_record(&partition.topic, partition.partition, from);
    let limit = shared.settings.attempt_timeout;
    let mut outage = Outage::new(shared);
    loop {
        let error = match tokio::time::timeout(limit, shared.store.live_ids_from(&first)).await {
            Ok(Ok(ids)) => return Some(ids.iter().filter_map(|id| id.parse().ok()).collect()),
            Ok(Err(e)) => e,
            Err(_) => timed_out(limit),
        };
        let wait = outage.failed(
            &dedup_core::Error::Store(error),
            &shared.settings.retry,
            jitter,
        )?;
        if !wait_unless_stopped(shared, partition, wait).await {
            return None;
        }
    }
}

fn timed_out(limit: std::time::Duration) -> StoreError {
    StoreError::environment(AttemptTimedOut(limit)).with_code("attempt_timeout")
}

/// The record's claim, taken or not.
enum Taken<Tx> {
    /// Taken in this open transaction: commit it once the dead letter is
    /// acknowledged.
    Held(Tx),
    /// Recorded already: the message was dead-lettered before.
    Already,
    /// The store refuses it for a reason no retry helps: dead-letter
    /// without a record (a redelivery may dead-letter it again).
    Unrecordable,
    /// The consumer stops or the partition was revoked.
    Stopped,
}

/// Claims `record` in a new transaction, waiting out the store.
async fn take_record<S: DedupStore>(
    shared: &Shared<S>,
    partition: &Partition,
    record: &DedupKey,
    ttl: Ttl,
    jitter: &mut Jitter,
) -> Taken<S::Tx> {
    let policy = shared.settings.retry;
    let limit = shared.settings.attempt_timeout;
    let mut outage = Outage::new(shared);
    let mut contended = 0;
    loop {
        let attempt = async {
            let mut tx = shared.store.begin().await?;
            match shared.store.claim(&mut tx, record, ttl).await {
                Ok(claim) => Ok((tx, claim)),
                Err(e) => {
                    let _ = shared.store.rollback(tx).await;
                    Err(e)
                }
            }
        };
        let error = match tokio::time::timeout(limit, attempt).await {
            Ok(Ok((tx, claim))) if claim.is_claimed() => return Taken::Held(tx),
            Ok(Ok((tx, _))) => {
                let _ = shared.store.rollback(tx).await;
                return Taken::Already;
            }
            Ok(Err(e)) => e,
            Err(_) => timed_out(limit),
        };
        let wait = match error.classification() {
            Classification::Environment => {
                match outage.failed(&dedup_core::Error::Store(error), &policy, jitter) {
                    Some(wait) => wait,
                    None => return Taken::Stopped,
                }
            }
            // Another owner of the partition holds the record uncommitted
            // while it dead-letters the same message: wait for it.
            Classification::Transient if contended + 1 < policy.attempts() => {
                contended += 1;
                policy.backoff(contended, jitter.next())
            }
            _ => {
                tracing::warn!(
                    %error,
                    "the dead letter cannot be recorded in the store; a redelivery of this \
                     message may dead-letter it again"
                );
                return Taken::Unrecordable;
            }
        };
        if !wait_unless_stopped(shared, partition, wait).await {
            return Taken::Stopped;
        }
    }
}

/// Commits the record of an acknowledged dead letter. If the commit fails
/// (the store went away meanwhile), the record is taken again in a
/// transaction of its own, waiting out the store; given up only when the
/// consumer stops or the partition is revoked first.
async fn commit_record<S: DedupStore>(
    shared: &Shared<S>,
    partition: &Partition,
    tx: S::Tx,
    record: &DedupKey,
    ttl: Ttl,
    jitter: &mut Jitter,
) {
    let limit = shared.settings.attempt_timeout;
    let mut tx = tx;
    loop {
        let error = match tokio::time::timeout(limit, shared.store.commit(tx)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => timed_out(limit),
        };
        tracing::debug!(%error, "recording the dead letter failed; recording it again");
        tx = match take_record(shared, partition, record, ttl, jitter).await {
            Taken::Held(tx) => tx,
            // The lost commit went through after all.
            Taken::Already => return,
            Taken::Unrecordable | Taken::Stopped => {
                tracing::warn!(
                    "the dead letter was produced but not recorded; a redelivery of this \
                     message may dead-letter it again"
                );
                return;
            }
        };
    }
}

/// Produces the dead letter, retrying until the broker acknowledges it: a
/// message is never dropped because its dead letter could not be written.
/// `false` if the consumer stops, the partition is revoked, or the topic
/// cannot be written at all (then the consumer is stopping with an error).
async fn produce<S>(
    shared: &Shared<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    why: &DeadLetter<'_>,
    jitter: &mut Jitter,
) -> bool {
    let mut attempt = 0;
    // The payload kept: whole, then cut, then none, as long as the broker
    // refuses the record as too large (the original stays in its topic).
    let mut keep = None;
    // Since when the topic has looked unwritable: a topic can look unknown
    // or unauthorized for a while (a broker restarted with an empty cache, a
    // grant still spreading), so only a lasting refusal stops the consumer.
    let mut unwritable_since: Option<std::time::Instant> = None;
    loop {
        attempt += 1;
        match dlq::send(
            &shared.producer,
            msg,
            why,
            shared.settings.dead_letter_timeout,
            keep,
        )
        .await
        {
            Ok(()) => {
                tracing::warn!(
                    outcome = "dead_lettered",
                    dead_letter_topic = why.topic,
                    kind = why.kind,
                    error = %why.message,
                );
                return true;
            }
            Err(e) if dlq::is_too_large(&e) && keep != Some(0) => {
                keep = Some(match keep {
                    None => dlq::TRUNCATED_PAYLOAD_BYTES,
                    Some(_) => 0,
                });
                tracing::warn!(error = %e, keep, "the dead letter is too large for the broker; sending it with its payload cut");
            }
            Err(e) if dlq::is_too_large(&e) => {
                shared.fail(format!(
                    "a dead letter for {:?} is too large even without its payload (its key and \
                     headers exceed the topic's max.message.bytes): raise the limit of {:?}",
                    why.topic, why.topic
                ));
                return false;
            }
            Err(e) if dlq::is_unwritable(&e) => {
                let since = *unwritable_since.get_or_insert_with(std::time::Instant::now);
                let lasting = since.elapsed() >= dlq::UNWRITABLE_FOR && attempt >= 3;
                if dlq::is_invalid(&e) || lasting {
                    shared.fail(format!(
                        "the dead-letter topic {:?} cannot be written ({e}): create it, or grant \
                         the consumer's principal Write on it, or name another with \
                         dead_letter_topic()",
                        why.topic
                    ));
                    return false;
                }
                let wait = shared.settings.retry.backoff(attempt, jitter.next());
                tracing::error!(error = %e, ?wait, topic = why.topic, "the dead-letter topic cannot be written; retrying");
                if !wait_unless_stopped(shared, partition, wait).await {
                    return false;
                }
            }
            Err(e) => {
                let wait = shared.settings.retry.backoff(attempt, jitter.next());
                tracing::error!(error = %e, ?wait, "producing the dead letter failed; retrying");
                if !wait_unless_stopped(shared, partition, wait).await {
                    return false;
                }
            }
        }
    }
}
