//! A retry tier's partition waiting for its next record's due time.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::message::{Message as _, OwnedMessage};

use super::Runtime;
use super::state::Partition;
use crate::tiers::{PAUSE_FROM, due_in, now_ms};

/// Waits until `msg`, the next record of a tier's partition, is due: the
/// partition is paused at the broker meanwhile (nothing more is fetched of
/// it) and resumed after. `false` if the consumer stops or the partition
/// is revoked or released first.
pub(crate) async fn until_due<S>(
    shared: &Runtime<S>,
    partition: &Partition,
    msg: &OwnedMessage,
    delay: Duration,
) -> bool {
    let wait = due_in(msg, delay);
    if wait.is_zero() {
        return true;
    }
    // A short wait is slept: pausing would make librdkafka drop and fetch
    // again what it had fetched of the partition.
    if wait < PAUSE_FROM {
        return super::wait_unless_stopped(shared, partition, wait).await;
    }
    tracing::debug!(
        offset = msg.offset(),
        ?wait,
        "waiting until the tier's record is due"
    );
    partition.due_wait.store(true, Ordering::SeqCst);
    partition.due_at_ms.store(
        now_ms().saturating_add(wait.as_millis() as i64),
        Ordering::Relaxed,
    );
    // The consumer loop pauses and resumes it: only it calls librdkafka's
    // pause and resume, in the order they are asked for.
    let ask = |pace| {
        let _ = shared
            .drained
            .send((partition.topic.clone(), partition.partition, pace));
    };
    ask(super::Pace::WaitDue);
    let due = super::wait_unless_stopped(shared, partition, wait).await;
    partition.due_wait.store(false, Ordering::SeqCst);
    partition.due_at_ms.store(0, Ordering::Relaxed);
    // Resumed unless its queue is still over half its bound (then the
    // worker asks again once it has drained).
    ask(super::Pace::Drained);
    due
}
