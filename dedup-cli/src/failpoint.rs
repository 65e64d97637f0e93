//! Test-only crash points: with the `failpoints` feature and
//! `DEDUP_FAILPOINT=<name>` set, the process aborts there, as a crash would.

pub(crate) fn failpoint(name: &str) {
    #[cfg(feature = "failpoints")]
    if std::env::var("DEDUP_FAILPOINT").is_ok_and(|point| point == name) {
        eprintln!("failpoint {name}: aborting the process");
        std::process::abort();
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Test-only failures: with the `failpoints` feature and
/// `DEDUP_FAILPOINT=<name>:<n>[:<k>]` set, `true` from the n-th pass for k
/// passes (k = 1 by default): the caller does as if it had failed there.
pub(crate) fn fails(name: &str) -> bool {
    #[cfg(feature = "failpoints")]
    {
        use std::sync::atomic::{AtomicU64, Ordering};

        static PASSES: AtomicU64 = AtomicU64::new(0);
        let Ok(spec) = std::env::var("DEDUP_FAILPOINT") else {
            return false;
        };
        let mut parts = spec.split(':');
        if parts.next() != Some(name) {
            return false;
        }
        let mut number = |default| parts.next().and_then(|n| n.parse().ok()).unwrap_or(default);
        let (nth, times): (u64, u64) = (number(1), number(1));
        let pass = PASSES.fetch_add(1, Ordering::SeqCst) + 1;
        pass >= nth && pass < nth + times
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        false
    }
}
