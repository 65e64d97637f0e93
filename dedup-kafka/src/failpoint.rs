//! Test-only crash points, for the crash-recovery tests.

/// Test-only crash points: with the `failpoints` feature and
/// `DEDUP_FAILPOINT=<name>` (or `<name>:<n>`, the n-th time) set, the process
/// aborts there, as a crash would.
pub(crate) fn failpoint(name: &str) {
    #[cfg(feature = "failpoints")]
    {
        use std::sync::atomic::{AtomicU64, Ordering};

        static HITS: AtomicU64 = AtomicU64::new(0);
        let Ok(spec) = std::env::var("DEDUP_FAILPOINT") else {
            return;
        };
        let (point, nth) = match spec.split_once(':') {
            Some((point, n)) => (point, n.parse::<u64>().unwrap_or(1)),
            None => (spec.as_str(), 1),
        };
        if point == name && HITS.fetch_add(1, Ordering::SeqCst) + 1 >= nth {
            tracing::error!(failpoint = name, "failpoint: aborting the process");
            std::process::abort();
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Test-only failures: with the `failpoints` feature and
/// `DEDUP_FAILPOINT=<name>:<n>[:<k>]` set, `true` at the n-th pass and the
/// k - 1 after it (k = 1 by default), and the caller fails there as if the
/// environment had; the process goes on.
pub(crate) fn fails(name: &str) -> bool {
    #[cfg(feature = "failpoints")]
    {
        use std::sync::atomic::{AtomicU64, Ordering};

        static PASSES: AtomicU64 = AtomicU64::new(0);
        let Ok(spec) = std::env::var("DEDUP_FAILPOINT") else {
            return false;
        };
        let mut parts = spec.split(':');
        let point = parts.next().unwrap_or_default();
        let nth = parts
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(1);
        let times = parts
            .next()
            .and_then(|k| k.parse::<u64>().ok())
            .unwrap_or(1);
        if point != name {
            return false;
        }
        let pass = PASSES.fetch_add(1, Ordering::SeqCst) + 1;
        if pass >= nth && pass < nth + times {
            tracing::error!(failpoint = name, "failpoint: failing here once");
            return true;
        }
        false
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        false
    }
}
