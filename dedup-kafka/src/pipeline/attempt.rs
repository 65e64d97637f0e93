//! Running user code (a handler's attempt) where neither a panic nor a hang
//! can take the runtime with it: the attempt is its own task, joined with a
//! time limit, started there or, when it rarely waits at all, on the
//! caller's task until it first waits ([`Start`]).

use std::future::Future;
use std::task::{Context, Poll, Waker};
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

impl<T> Ran<T> {
    /// What it returned, through `f`.
    pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U) -> Ran<U> {
        match self {
            Ran::Done(out) => Ran::Done(f(out)),
            Ran::Panicked(said) => Ran::Panicked(said),
            Ran::TimedOut(limit) => Ran::TimedOut(limit),
        }
    }
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

/// Where an attempt starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// On a task of its own.
    OwnTask,
    /// On the caller's task, moving to a task of its own only if it waits:
    /// an attempt that finishes without waiting (a Kafka-only handler that
    /// only writes its outputs to memory) costs neither a task, nor a
    /// timer, nor waking another worker thread. A panic in that first run
    /// is contained all the same. What the caller gives up: the time limit
    /// counts from the first wait (a handler that computes or blocks its
    /// thread without awaiting holds the caller until it returns; on a task
    /// of its own it would hold a worker thread instead, and be abandoned,
    /// still running, at the limit).
    HereFirst,
}

/// Runs `attempt` in `span`, started as `start` says, as its own task for
/// at most `limit`. If this future is dropped first (a worker aborted at
/// the shutdown timeout), the task is aborted when `abort_on_drop` (a
/// transaction: it rolls back, and its event is redelivered) and otherwise
/// left to finish (a lease's call, whose completion is what keeps its
/// effect from being done again).
pub(crate) async fn run<F>(
    span: tracing::Span,
    limit: Duration,
    abort_on_drop: bool,
    start: Start,
    attempt: F,
) -> Ran<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let attempt = traced(span, attempt);
    let task = match start {
        Start::OwnTask => tokio::spawn(attempt),
        Start::HereFirst => {
            let mut attempt = Box::pin(attempt);
            // Polled with a waker that does nothing: if it waits, the task
            // it moves to polls it again at once, and a future answers only
            // the waker of its latest poll.
            let mut cx = Context::from_waker(Waker::noop());
            match contained(|| Future::poll(attempt.as_mut(), &mut cx)) {
                Ok(Poll::Ready(out)) => return Ran::Done(out),
                Ok(Poll::Pending) => tokio::spawn(attempt),
                Err(said) => return Ran::Panicked(said),
            }
        }
    };
    joined(task, limit, abort_on_drop).await
}

/// `attempt` in `span` and, with feature `opentelemetry`, in the trace
/// context of its message, so what the handler writes carries it.
fn traced<F: Future>(span: tracing::Span, attempt: F) -> impl Future<Output = F::Output> {
    #[cfg(feature = "opentelemetry")]
    let attempt = opentelemetry::context::FutureExt::with_current_context(attempt);
    attempt.instrument(span)
}

/// The attempt running as `task`, joined for at most `limit` (see [`run`]).
async fn joined<T>(
    task: tokio::task::JoinHandle<T>,
    limit: Duration,
    abort_on_drop: bool,
) -> Ran<T> {
    let mut task = Attempt {
        task,
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
        let ran = run(
            tracing::Span::none(),
            Duration::from_secs(5),
            true,
            Start::OwnTask,
            async {
                if true {
                    panic!("bad amount");
                }
            },
        )
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
            Start::OwnTask,
            std::future::pending::<()>(),
        )
        .await;
        assert!(matches!(ran, Ran::TimedOut(_)), "{ran:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let ran = run(
            tracing::Span::none(),
            Duration::from_secs(5),
            true,
            Start::OwnTask,
            async { 7 },
        )
        .await;
        assert!(matches!(ran, Ran::Done(7)), "{ran:?}");
    }

    /// An attempt that never waits runs on the caller's task; one that
    /// waits moves to a task of its own and is joined there, with the time
    /// limit and the containment of [`run`].
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_attempt_runs_here_until_it_waits() {
        // The test's own body is no task: it runs in one.
        tokio::spawn(async {
            let here = tokio::task::id();
            let none = tracing::Span::none;
            let limit = Duration::from_secs(5);
            let ran = run(none(), limit, false, Start::HereFirst, async {
                tokio::task::id()
            })
            .await;
            assert!(matches!(ran, Ran::Done(id) if id == here), "{ran:?}");
            // Its part after the wait runs on a task of its own.
            let ran = run(none(), limit, false, Start::HereFirst, async {
                let before = tokio::task::id();
                tokio::time::sleep(Duration::from_millis(10)).await;
                (before, tokio::task::id())
            })
            .await;
            assert!(
                matches!(ran, Ran::Done((before, after)) if before == here && after != here),
                "{ran:?}"
            );
            // A panic before the first wait, and one after it, are outcomes.
            let ran = run(none(), limit, false, Start::HereFirst, async {
                if true {
                    panic!("bad amount");
                }
            })
            .await;
            assert!(
                matches!(&ran, Ran::Panicked(s) if s == "bad amount"),
                "{ran:?}"
            );
            let ran = run(none(), limit, false, Start::HereFirst, async {
                tokio::task::yield_now().await;
                if true {
                    panic!("bad currency");
                }
            })
            .await;
            assert!(
                matches!(&ran, Ran::Panicked(s) if s == "bad currency"),
                "{ran:?}"
            );
            // A hang after its first wait is abandoned at the limit.
            let started = std::time::Instant::now();
            let short = Duration::from_millis(100);
            let ran = run(
                none(),
                short,
                true,
                Start::HereFirst,
                std::future::pending::<()>(),
            )
            .await;
            assert!(matches!(ran, Ran::TimedOut(_)), "{ran:?}");
            assert!(started.elapsed() < Duration::from_secs(5));
        })
        .await
        .expect("the test's task");
    }
}
