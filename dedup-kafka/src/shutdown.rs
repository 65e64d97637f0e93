//! The default shutdown condition.

/// Completes on SIGINT or SIGTERM: the shutdown [`Consumer::run`](crate::Consumer::run)
/// waits for, to combine with a condition of your own in
/// [`run_until`](crate::Consumer::run_until).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
