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
