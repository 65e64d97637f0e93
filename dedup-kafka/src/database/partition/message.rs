//! One message run to a final state, with its retries: applied, skipped,
//! dead-lettered, moved to a retry tier, or abandoned at a stop. Its
//! attempts are driven by the pipeline's one driver
//! (`pipeline::attempts`); what an attempt's outcome means in the database
//! runtime (a lease held elsewhere, a lease lost, a fingerprint skipped)
//! is here.

use std::sync::Arc;
use std::time::Duration;

use dedup_core::{DedupStore, Outcome};
use rdkafka::message::{Message as _, OwnedMessage};

use crate::config::OnFingerprintMismatch;
use crate::database::dead_letter::dead_letter;
use crate::database::route::Route;
use crate::failpoint::failpoint;
use crate::metrics::RetryReason;
use crate::pipeline::attempts::{Attempts, Next, Tried};
use crate::pipeline::decision::Fault;
use crate::pipeline::meta_of;
use crate::retry::Jitter;

use super::state::Partition;
use super::{Runtime, wait_unless_stopped};

/// Runs one message to a final state. Returns `false` if it was abandoned
/// (shutdown or revoke during a retry wait): then its offset is not stored.
///
/// Under key hold-back (`RetryTiers::hold_keys`), a message whose key
/// waits in a retry tier follows it there at once, and a tier that
/// finishes a message lets its key go.
pub(super) async fn process<S: DedupStore>(
    shared: &Arc<Runtime<S>>,
    route: &Arc<Route<S>>,
    partition: &Partition,
    msg: &OwnedMessage,
    jitter: &mut Jitter,
) -> bool {
    // What decoding needs (a registry's schema) fetched first: an outage of
    // it is waited out here, never a message's fault.
    let payload = msg.payload().unwrap_or_default();
    if !crate::database::ready::ready(shared, route, partition, payload, jitter).await {
        return false;
    }
    // Tier headers that are not its own: the message's fault, dead-lettered
    // as itself, releasing nothing.
    if let Some(message) = route.forged(msg) {
        let why = route.dead_letter(msg, crate::tiers::FORGED, message, 1);
        return dead_letter(shared, route, partition, msg, why, jitter).await;
    }
    let Some(key) = route.hold_key(msg) else {
        return !matches!(
            attempts(shared, route, partition, msg, jitter).await,
            Ended::Abandoned
        );
    };
    let origin = route.origin(msg);
    match crate::database::hold::earlier(shared, route, partition, &origin, key, jitter).await {
        None => return false,
        Some(Some(earlier)) => {
            let why = route.follow(msg, earlier);
            return dead_letter(shared, route, partition, msg, why, jitter).await;
        }
        Some(None) => {}
    }
    match attempts(shared, route, partition, msg, jitter).await {
        Ended::Abandoned => false,
        Ended::Elsewhere => true,
        // A tier's record, or a copy released from one, lets its key go;
        // until that is recorded it is not finished (a redelivery is
        // skipped by its claim and lets the key go then).
        Ended::Here if route.in_tier() || route.released(msg) => {
            crate::database::hold::let_out(shared, route, &origin, key, jitter).await
        }
        Ended::Here => true,
    }
}

/// How a message's attempts ended.
enum Ended {
    /// Applied, or skipped as finished before.
    Here,
    /// Dead-lettered or moved to a retry tier.
    Elsewhere,
    /// Abandoned (shutdown, revoke): its offset is not stored.
    Abandoned,
}

/// Runs one message's attempts to a final state.
async fn attempts<S: DedupStore>(
    shared: &Arc<Runtime<S>>,
    route: &Arc<Route<S>>,
    partition: &Partition,
    msg: &OwnedMessage,
    jitter: &mut Jitter,
) -> Ended {
    let headers = Arc::new(meta_of(msg));
    let payload: Arc<[u8]> = msg.payload().unwrap_or_default().into();
    // With retry tiers, few attempts before the event moves on.
    let policy = route.in_place(shared.settings.pipeline.retry);
    let mut attempts = Attempts::new(&shared.stats, policy, route.record(&shared.stats));
    // Looks at another holder's lease (lease mode), for the back-off.
    let mut lease_waits = 0;
    loop {
        let attempt = attempts.start();
        // The permit is held while the handler runs, not while backing off,
        // so retrying partitions do not keep the others waiting. A panicking
        // handler fails this message instead of killing the partition.
        let joined = {
            let (task_route, payload, headers) = (route.clone(), payload.clone(), headers.clone());
            shared
                .run_handler(tracing::Span::current(), route, move |store| async move {
                    task_route.handler.apply(&*store, &payload, &*headers).await
                })
                .await
        };
        // A frozen database makes attempts hang rather than fail: the
        // environment's fault, waited out, never dead-lettered. Until the
        // abandoned attempt's rollback reaches the database it holds the
        // claim's lock: the lock timeouts that follow are contention,
        // waited out too.
        let tried = match Tried::of(joined.map(Ok)) {
            Tried::Done(outcome) => settle(
                shared,
                route,
                partition,
                msg,
                outcome,
                attempt,
                &mut lease_waits,
                policy,
                jitter,
            ),
            Tried::Failed(e, fault) => Tried::Failed(e, fault),
            Tried::Later(wait) => Tried::Later(wait),
        };
        match attempts.ended(tried, jitter, None) {
            Next::Done(()) => return Ended::Here,
            Next::Wait(wait) => {
                if !wait_unless_stopped(shared, partition, wait).await {
                    return Ended::Abandoned;
                }
            }
            Next::GiveUp(up) => {
                // A transient failure goes to the next retry tier, if any;
                // the event's own fault to the dead letters.
                let why = match up.onward {
                    true => route.onward(msg, up.kind, up.message, up.attempts),
                    false => route.dead_letter(msg, up.kind, up.message, up.attempts),
                };
                return match dead_letter(shared, route, partition, msg, why, jitter).await {
                    true => Ended::Elsewhere,
                    false => Ended::Abandoned,
                };
            }
            Next::Stop(why) => {
                // This message stays uncommitted for the next run.
                shared.fail(why);
                return Ended::Abandoned;
            }
        }
    }
}

/// What an attempt that returned `outcome` came to: applied or skipped
/// (recorded here), a lease another holder has (attempted again before
/// the lease ends), or a failure.
#[allow(clippy::too_many_arguments)]
fn settle<S: DedupStore>(
    shared: &Arc<Runtime<S>>,
    route: &Arc<Route<S>>,
    partition: &Partition,
    msg: &OwnedMessage,
    outcome: Outcome,
    attempt: u32,
    lease_waits: &mut u32,
    policy: crate::retry::RetryPolicy,
    jitter: &mut Jitter,
) -> Tried<()> {
    match outcome {
        Outcome::Applied { reclaimed } => {
            shared.stats.store_answered();
            partition.applied(msg.offset());
            route.record(&shared.stats).applied(reclaimed);
            tracing::info!(outcome = "applied", reclaimed, attempt);
            failpoint("after-commit");
            Tried::Done(())
        }
        Outcome::Skipped { age, .. } => {
            shared.stats.store_answered();
            if partition.redelivery(msg.offset()) {
                route.record(&shared.stats).redelivered();
            }
            route.record(&shared.stats).skipped(age);
            tracing::info!(outcome = "skipped", "duplicate within the TTL");
            Tried::Done(())
        }
        Outcome::Failed(dedup_core::Error::LeaseHeld {
            key,
            expires_at,
            token,
        }) => {
            // Lease mode: another holder's effect may be under way. Not the
            // event's fault and bounded by the lease: look again with
            // back-off, never later than the lease's end, without using up
            // attempts or counting as an outage.
            *lease_waits += 1;
            route
                .record(&shared.stats)
                .retried_because(RetryReason::LeaseHeld);
            let until_expiry = expires_at
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default();
            let wait = policy
                .backoff(*lease_waits, jitter.next())
                .min(until_expiry + Duration::from_millis(50))
                .max(Duration::from_millis(20));
            if *lease_waits == 1 {
                tracing::info!(outcome = "waiting", %key, token, ?until_expiry, "another holder's lease covers this event");
            }
            Tried::Later(wait)
        }
        Outcome::Failed(dedup_core::Error::LeaseLost { key, token }) => {
            // The effect ran, but its lease had expired and a newer holder
            // took the claim over: that holder finishes the event.
            shared.stats.store_answered();
            route.record(&shared.stats).lease_lost();
            tracing::warn!(outcome = "skipped", %key, token, "the lease was taken over before the effect completed: extend long effects (lease.extend()) or lengthen the lease");
            Tried::Done(())
        }
        Outcome::Failed(e @ dedup_core::Error::FingerprintMismatch { .. })
            if skips_mismatch(shared, route, &e) =>
        {
            shared.stats.store_answered();
            Tried::Done(())
        }
        Outcome::Failed(e) => {
            let fault = Fault::of(&e);
            Tried::Failed(e, fault)
        }
    }
}

/// Counts a duplicate whose content differs from its claim's and says
/// whether it is skipped (`on_fingerprint_mismatch(Skip)`, logged with its
/// key) rather than dead-lettered (the default).
pub(super) fn skips_mismatch<S: 'static>(
    shared: &Runtime<S>,
    route: &Route<S>,
    error: &dedup_core::Error,
) -> bool {
    let skip = shared.settings.pipeline.on_fingerprint_mismatch == OnFingerprintMismatch::Skip;
    route.record(&shared.stats).fingerprint_mismatch(skip);
    if skip {
        tracing::warn!(outcome = "skipped", kind = error.kind(), error = %error, "skipped as on_fingerprint_mismatch says");
    }
    skip
}

/// The span a message is processed in; the core records its dedup key.
pub(super) fn message_span(msg: &OwnedMessage) -> tracing::Span {
    tracing::info_span!(
        "message",
        topic = msg.topic(),
        partition = msg.partition(),
        offset = msg.offset(),
        dedup.key = tracing::field::Empty,
    )
}
