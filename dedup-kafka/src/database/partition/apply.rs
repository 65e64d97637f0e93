//! What a worker does with a batch of its messages: one transaction (its
//! messages replayed one by one if it fails, `message.rs`), and the dead
//! letters of those that cannot be prepared.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use dedup_core::{DedupStore, Outcome};
use rdkafka::message::{Message as _, OwnedMessage};
use tracing::Instrument;

use crate::database::dead_letter::{self as dead_letters, dead_letter};
use crate::database::effect::ErasedHandler;
use crate::database::route::{Before, Route};
use crate::failpoint::failpoint;
use crate::metrics::RetryReason;
use crate::pipeline::attempt::{self, AttemptTimedOut, Ran};
use crate::pipeline::decision::Fault;
use crate::pipeline::{error_chain, meta_of};
use crate::retry::Jitter;

use super::Runtime;
use super::message::{message_span, process, skips_mismatch};
use super::state::Partition;

/// Runs a batch of one partition's messages in one transaction (one claim
/// statement, one commit). If a message cannot be decoded or keyed, or any
/// handler or the store fails, nothing of the batch is committed and it is
/// replayed message by message, so the poison message is isolated (retried
/// or dead-lettered) and every other one is still applied exactly once.
/// Returns how many messages, from the first, are finished.
pub(super) async fn process_batch<S: DedupStore>(
    shared: &Arc<Runtime<S>>,
    route: &Arc<Route<S>>,
    handler: &Arc<dyn ErasedHandler<S>>,
    partition: &Partition,
    batch: &[OwnedMessage],
    dead_lettered: &HashSet<String>,
    jitter: &mut Jitter,
) -> usize {
    let span = tracing::info_span!(
        "batch",
        topic = batch[0].topic(),
        partition = batch[0].partition(),
        first_offset = batch[0].offset(),
        last_offset = batch[batch.len() - 1].offset(),
        size = batch.len(),
    );
    // Decoding and keys are known before any transaction: a message that
    // fails them is the event's fault and is dead-lettered, and the rest
    // still go as one batch (no replay at per-message speed). The batch
    // commits first, then the bad ones are dead-lettered in offset order: a
    // stop or a crash in between leaves the bad ones to be dead-lettered by
    // their redelivery, once, and the good ones to be skipped.
    let mut members = Vec::with_capacity(batch.len());
    let mut prepared = Vec::with_capacity(batch.len());
    let mut bad = Vec::new();
    // Under key hold-back: the keys of the batch that follow an event in a
    // tier, with the origin offset of their last follower so far.
    let mut following: HashMap<crate::pipeline::keyed::OrderKey, i64> = HashMap::new();
    // Each message's own span (feature `opentelemetry`), continuing its
    // trace: its event is prepared, run, dead-lettered or replayed in it.
    #[cfg(feature = "opentelemetry")]
    let contexts: Vec<opentelemetry::Context> = batch
        .iter()
        .map(|msg| crate::otel::process(msg, &shared.group))
        .collect();
    for (i, msg) in batch.iter().enumerate() {
        // What decoding needs (a registry's schema) fetched first: an outage
        // of it holds the batch, and is never a message's fault.
        let payload = msg.payload().unwrap_or_default();
        if !crate::database::ready::ready(shared, route, partition, payload, jitter).await {
            return 0;
        }
        if let Some(before) = route.finished_before(dead_lettered, msg) {
            bad.push((i, Unprepared::Before(before)));
            continue;
        }
        // Tier headers that are not its own: the message's fault.
        if let Some(why) = route.forged(msg) {
            bad.push((i, Unprepared::Forged(why)));
            continue;
        }
        // Under key hold-back, a copy released from a tier goes alone (it
        // lets its key go), and an event whose key waits in a tier follows
        // it.
        if route.hold_key(msg).is_some() && route.released(msg) {
            bad.push((i, Unprepared::Alone));
            continue;
        }
        if let Some(key) = route.hold_key(msg) {
            let origin = route.origin(msg);
            // Once an event of a key follows one in a tier, the key's later
            // events in this batch follow it too: its `in` record is
            // written only after the batch, and the store may say the key
            // free meanwhile (a tier let its earlier events out).
            if let Some(&earlier) = following.get(&key) {
                following.insert(key, origin.offset);
                bad.push((i, Unprepared::Follow(earlier)));
                continue;
            }
            match crate::database::hold::earlier(shared, route, partition, &origin, key, jitter)
                .await
            {
                None => return 0,
                Some(Some(earlier)) => {
                    following.insert(key, origin.offset);
                    bad.push((i, Unprepared::Follow(earlier)));
                    continue;
                }
                Some(None) => {}
            }
        }
        let headers = meta_of(msg);
        // User code (a Deserialize impl, a key's Display, a custom decode):
        // a panic fails this message, never the worker, which would drop
        // everything it buffered.
        #[cfg(feature = "opentelemetry")]
        let _current = contexts[i].clone().attach();
        match attempt::contained(|| handler.prepare(payload, &headers)) {
            Ok(Ok(ready)) => {
                members.push(i);
                prepared.push(ready);
            }
            // Not the event's fault (a decoder a wrapper left unready):
            // its own attempts wait it out, never a dead letter.
            Ok(Err(e)) if e.is_retryable() => bad.push((i, Unprepared::Alone)),
            Ok(Err(e)) => bad.push((i, Unprepared::Error(e))),
            Err(said) => bad.push((
                i,
                Unprepared::Panic(format!(
                    "decoding the event or reading its key panicked: {said}"
                )),
            )),
        }
    }
    // A batch that failed for a reason of the environment (a timeout, an
    // outage, contention, a transient error) is tried again, message by
    // message: a retry, counted as the Kafka-only runtime counts its
    // retried attempts. One that failed for an event's fault (a panic, a
    // permanent error) is split to isolate it, not retried.
    let mut retried = None;
    // Failed for an event's fault or a transient one: the failing events
    // are found by halving the batch (a few transactions for one poison
    // event in a large batch, not one per event), the others still applied
    // in batches.
    let mut split = false;
    let committed = if prepared.is_empty() {
        Ok(Vec::new())
    } else {
        route.metrics().batch(prepared.len());
        let joined = {
            let handler = handler.clone();
            let running = shared.run_handler(span.clone(), route, move |store| async move {
                handler.apply_batch(&*store, prepared).await
            });
            // The transaction runs in the batch's span, linked to its
            // messages' (each event's body runs in its own).
            #[cfg(feature = "opentelemetry")]
            let running = crate::otel::within(
                running,
                &crate::otel::batch(batch, &contexts, &shared.group),
            );
            running.await
        };
        match joined {
            Ran::Done(result) => result.map_err(|e| {
                let fault = Fault::of(&e);
                if matches!(
                    fault,
                    Fault::Transient | Fault::Contention | Fault::Environment
                ) {
                    retried = Some(RetryReason::of(fault, &e));
                }
                split = matches!(fault, Fault::Transient | Fault::Event);
                e.to_string()
            }),
            Ran::Panicked(said) => {
                split = true;
                Err(format!("the handler panicked: {said}"))
            }
            Ran::TimedOut(limit) => {
                retried = Some(RetryReason::Timeout);
                Err(AttemptTimedOut(limit).to_string())
            }
        }
    };
    match committed {
        Ok(outcomes) => {
            if !outcomes.is_empty() {
                let _enter = span.enter();
                let (mut applied, mut skipped) = (0, 0);
                for (&i, outcome) in members.iter().zip(outcomes) {
                    let name = outcome.name();
                    tracing::debug!(offset = batch[i].offset(), outcome = name);
                    match outcome {
                        Outcome::Applied { reclaimed } => {
                            applied += 1;
                            partition.applied(batch[i].offset());
                            route.record(&shared.stats).applied(reclaimed);
                            failpoint("after-commit");
                        }
                        Outcome::Skipped { age, .. } => {
                            skipped += 1;
                            if partition.redelivery(batch[i].offset()) {
                                route.record(&shared.stats).redelivered();
                            }
                            route.record(&shared.stats).skipped(age);
                        }
                        // Neither applied nor skipped: dead-lettered after
                        // the commit, in offset order with the others.
                        Outcome::Failed(e @ dedup_core::Error::FingerprintMismatch { .. }) => {
                            let _enter = message_span(&batch[i]).entered();
                            if skips_mismatch(shared, route, &e) {
                                skipped += 1;
                            } else {
                                bad.push((i, Unprepared::Error(e)));
                            }
                        }
                        Outcome::Failed(_) => {
                            // A committed batch has no other failure; were
                            // there one, its message is finished all the same.
                            debug_assert!(false, "a failure in a committed batch");
                            skipped += 1;
                            shared.stats.skipped.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                bad.sort_by_key(|(i, _)| *i);
                shared.stats.store_answered();
                shared.stats.batches.fetch_add(1, Ordering::Relaxed);
                tracing::info!(outcome = "committed", applied, skipped);
            }
            for (i, e) in bad {
                let msg = &batch[i];
                let dead = dead_letter_unprepared(shared, route, partition, msg, &e, jitter);
                #[cfg(feature = "opentelemetry")]
                let dead = crate::otel::within(dead, &contexts[i]);
                if !dead.await {
                    // Everything before it is finished: applied, or dead-lettered.
                    return i;
                }
            }
            batch.len()
        }
        Err(why) if split && batch.len() > 2 => {
            shared.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            if let Some(reason) = retried {
                route.record(&shared.stats).retried_because(reason);
            }
            span.in_scope(|| tracing::warn!(error = %why, "batch rolled back; running each half as a batch of its own"));
            let mid = batch.len() / 2;
            let first = Box::pin(process_batch(
                shared,
                route,
                handler,
                partition,
                &batch[..mid],
                dead_lettered,
                jitter,
            ))
            .await;
            if first < mid {
                return first;
            }
            let second = Box::pin(process_batch(
                shared,
                route,
                handler,
                partition,
                &batch[mid..],
                dead_lettered,
                jitter,
            ))
            .await;
            mid + second
        }
        Err(why) => {
            shared.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            if let Some(reason) = retried {
                route.record(&shared.stats).retried_because(reason);
            }
            span.in_scope(|| tracing::warn!(error = %why, "batch rolled back; replaying it message by message"));
            // In offset order: each good one on its own, each bad one to the
            // dead-letter topic.
            let mut bad = bad.into_iter().peekable();
            for (i, msg) in batch.iter().enumerate() {
                let finished = match bad.next_if(|(b, _)| *b == i) {
                    Some((_, e)) => {
                        let dead =
                            dead_letter_unprepared(shared, route, partition, msg, &e, jitter);
                        #[cfg(feature = "opentelemetry")]
                        let dead = crate::otel::within(dead, &contexts[i]);
                        dead.await
                    }
                    None => {
                        let replay = process(shared, route, partition, msg, jitter)
                            .instrument(message_span(msg));
                        #[cfg(feature = "opentelemetry")]
                        let replay = crate::otel::within(replay, &contexts[i]);
                        replay.await
                    }
                };
                if !finished {
                    return i;
                }
            }
            batch.len()
        }
    }
}

/// Why a message of a batch could not be prepared.
enum Unprepared {
    /// It cannot be decoded or has no key, or (found by the batch's claim)
    /// its content differs from its claim's.
    Error(dedup_core::Error),
    /// Decoding it or reading its key panicked.
    Panic(String),
    /// It was dead-lettered or moved to a retry tier before (a
    /// redelivery): skipped.
    Before(Before),
    /// An earlier event of its key (at this origin offset) waits in a
    /// retry tier: it follows (key hold-back).
    Follow(i64),
    /// A copy released from a tier, under key hold-back: run on its own,
    /// in offset order with the others, so that it lets its key go.
    Alone,
    /// Its tier headers are not its own (`Route::forged`), for this reason.
    Forged(String),
}

/// Finishes a message that was not prepared for its batch: dead-letters
/// it, skips it, moves it behind its key, or runs it alone.
async fn dead_letter_unprepared<S: DedupStore>(
    shared: &Arc<Runtime<S>>,
    route: &Arc<Route<S>>,
    partition: &Partition,
    msg: &OwnedMessage,
    unprepared: &Unprepared,
    jitter: &mut Jitter,
) -> bool {
    let (kind, message) = match unprepared {
        Unprepared::Error(e) => (e.kind(), error_chain(e)),
        Unprepared::Panic(message) => ("panic", message.clone()),
        Unprepared::Forged(message) => (crate::tiers::FORGED, message.clone()),
        Unprepared::Before(before) => {
            dead_letters::skip(shared, route, msg, *before);
            return true;
        }
        Unprepared::Follow(earlier) => {
            let why = route.follow(msg, *earlier);
            return dead_letter(shared, route, partition, msg, why, jitter)
                .instrument(message_span(msg))
                .await;
        }
        Unprepared::Alone => {
            return process(shared, route, partition, msg, jitter)
                .instrument(message_span(msg))
                .await;
        }
    };
    let why = route.dead_letter(msg, kind, message, 1);
    dead_letter(shared, route, partition, msg, why, jitter)
        .instrument(message_span(msg))
        .await
}
