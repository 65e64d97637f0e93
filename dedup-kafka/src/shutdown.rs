//! The default shutdown condition.

use std::future::Future;

/// Completes on SIGINT or SIGTERM: the shutdown [`Consumer::run`](crate::Consumer::run)
/// waits for, to combine with a condition of your own in
/// [`run_until`](crate::Consumer::run_until).
///
/// The handlers are installed when this is called (inside a Tokio runtime;
/// outside one, when it is first awaited), not when a consumer first looks
/// at it: a SIGTERM that comes while the consumer starts (its checks of the
/// brokers, a restore) is kept until its loop does, and it then stops as
/// it would later. Before, such a signal met the default action and killed
/// the process.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        let installed = tokio::runtime::Handle::try_current()
            .is_ok()
            .then(unix::Signals::install);
        async move {
            let mut signals = installed.unwrap_or_else(unix::Signals::install);
            signals.recv().await;
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(unix)]
mod unix {
    use tokio::signal::unix::{Signal, SignalKind, signal};

    /// SIGTERM's and SIGINT's handlers.
    pub(super) struct Signals {
        term: Signal,
        int: Signal,
    }

    impl Signals {
        pub(super) fn install() -> Self {
            Signals {
                term: signal(SignalKind::terminate()).expect("install SIGTERM handler"),
                int: signal(SignalKind::interrupt()).expect("install SIGINT handler"),
            }
        }

        pub(super) async fn recv(&mut self) {
            tokio::select! {
                _ = self.term.recv() => {}
                _ = self.int.recv() => {}
            }
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A SIGTERM before the condition is first awaited (a consumer still
    /// starting) is kept for it: the process is not killed (this test's
    /// process would die of it), and the condition completes.
    #[tokio::test]
    async fn a_sigterm_before_the_first_wait_is_kept_for_it() {
        let stop = shutdown_signal();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success());
        tokio::time::timeout(Duration::from_secs(10), stop)
            .await
            .expect("the SIGTERM sent before the first wait completes it");
    }
}
