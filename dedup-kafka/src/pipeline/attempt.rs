//! Running user code (a handler's attempt) where neither a panic nor a hang
//! can take the runtime with it: the attempt is its own task, joined with a
//! time limit.

use std::future::Future;
use std::time::Duration;

use tracing::Instrument;

/// How an attempt ended.
#[derive(Debug)]
pub(crate) enum Ran<T> {
    /// It returned.
    Done(T),
    /// It panicked; what the panic said.
    Panicked(String),
    /// It outlived the attempt timeout and was abandoned (its future
    /// dropped: a store transaction in it rolls back once its connection
    /// notices).
    TimedOut(Duration),
}

/// An attempt that outlived the attempt timeout.
#[derive(Debug, thiserror::Error)]
#[error(
    "the attempt did not finish within {0:?} (a database or a downstream that hangs) and was \
     abandoned; waiting it out: the claim tells whether its commit went through"
)]
pub(crate) struct AttemptTimedOut(pub(crate) Duration);

/// An attempt that outlived `limit`, as the store error its retries and
/// health report: the environment's fault, code `attempt_timeout`.
pub(crate) fn timed_out(limit: Duration) -> dedup_core::StoreError {
    dedup_core::StoreError::environment(AttemptTimedOut(limit)).with_code("attempt_timeout")
}

/// How long an abandoned attempt gets to stop.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// Runs `attempt` as its own task in `span`, for at most `limit`. If this
/// future is dropped first (a worker aborted at the shutdown timeout), the
/// task is aborted when `abort_on_drop` (a transaction: it rolls back, and
/// its event is redelivered) and otherwise left to finish (a lease's call,
/// whose completion is what keeps its effect from being done again).
pub(crate) async fn run<F>(
    span: tracing::Span,
    limit: Duration,
    abort_on_drop: bool,
    attempt: F,
) -> Ran<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    // The attempt runs in the trace context of its message (feature
    // `opentelemetry`), so what the handler writes carries it.
    #[cfg(feature = "opentelemetry")]
    let attempt = opentelemetry::context::FutureExt::with_current_context(attempt);
    let mut task = Attempt {
        task: tokio::spawn(attempt.instrument(span)),
        abort_on_drop,
    };
    let task = &mut task.task;
    match tokio::time::timeout(limit, &mut *task).await {
        Ok(Ok(out)) => Ran::Done(out),
        Ok(Err(joined)) => match joined.try_into_panic() {
            Ok(panic) => Ran::Panicked(panic_message(&*panic)),
            // Cancelled, by the runtime shutting down (nobody else aborts
            // it before the limit): not the event's fault.
            Err(_) => Ran::TimedOut(limit),
        },
        Err(_) => {
            task.abort();
            // A handler that blocks without yielding cannot be stopped: go on
            // without it (a claim lock keeps it from doubling; a Kafka
            // transaction it might write to is not open until it returns).
            if tokio::time::timeout(ABORT_GRACE, task).await.is_err() {
                tracing::warn!(
                    ?limit,
                    "an abandoned attempt did not stop (a handler that blocks its thread); going on without it"
                );
            }
            Ran::TimedOut(limit)
        }
    }
}

/// An attempt's task, aborted if whoever waits for it is dropped and
/// `abort_on_drop` says so (see [`run`]).
struct Attempt<T> {
    task: tokio::task::JoinHandle<T>,
    abort_on_drop: bool,
}

impl<T> Drop for Attempt<T> {
    fn drop(&mut self) {
        if self.abort_on_drop {
            self.task.abort();
        }
    }
}

/// A panic in a handler's attempt, as the error its dead letter reports
/// (kind `panic`: [`Fault::Panic`](super::decision::Fault::Panic)).
pub(crate) fn panicked(said: &str) -> dedup_core::Error {
    dedup_core::Error::Handler {
        classification: dedup_core::Classification::Permanent,
        code: None,
        source: format!("the handler panicked: {said}").into(),
    }
}

/// What a panic said, if it said it with a string.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".to_owned())
}

/// Runs synchronous user code (a decode, a key's `Display`) where a panic
/// fails this message instead of the worker.
pub(crate) fn contained<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| panic_message(&*p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_is_an_outcome_not_an_unwind() {
        let ran = run(tracing::Span::none(), Duration::from_secs(5), true, async {
            if true {
                panic!("bad amount");
            }
        })
        .await;
        assert!(
            matches!(&ran, Ran::Panicked(said) if said == "bad amount"),
            "{ran:?}"
        );
        let ran = contained(|| -> u8 { panic!("{}", String::from("formatted")) });
        assert_eq!(ran, Err("formatted".to_owned()));
    }

    #[tokio::test]
    async fn a_hang_is_abandoned_at_the_limit() {
        let started = std::time::Instant::now();
        let ran = run(
            tracing::Span::none(),
            Duration::from_millis(100),
            true,
            std::future::pending::<()>(),
        )
        .await;
        assert!(matches!(ran, Ran::TimedOut(_)), "{ran:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let ran = run(tracing::Span::none(), Duration::from_secs(5), true, async {
            7
        })
        .await;
        assert!(matches!(ran, Ran::Done(7)), "{ran:?}");
    }
}
