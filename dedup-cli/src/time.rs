//! Timestamps as RFC 3339 text (through `time`), durations as people read
//! them.

use time::OffsetDateTime;
use time::format_description::BorrowedFormatItem;
use time::macros::format_description;

/// `2026-11-30T08:01:02.345Z` for milliseconds since the Unix epoch (UTC).
pub(crate) fn rfc3339_millis(millis: i64) -> String {
    at_nanos(i128::from(millis) * 1_000_000, MILLIS)
}

/// `2026-11-30T08:01:02.345678Z` for a point in time (UTC), to the
/// microsecond.
pub(crate) fn rfc3339(at: std::time::SystemTime) -> String {
    let nanos = match at.duration_since(std::time::UNIX_EPOCH) {
        Ok(after) => i128::try_from(after.as_nanos()).unwrap_or(i128::MAX),
        Err(before) => -i128::try_from(before.duration().as_nanos()).unwrap_or(i128::MAX),
    };
    at_nanos(nanos, MICROS)
}

const MILLIS: &[BorrowedFormatItem<'static>] =
    format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
const MICROS: &[BorrowedFormatItem<'static>] =
    format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z");

/// `nanos` since the Unix epoch in `format`; out of the calendar's range
/// (past the year 9999), the nanoseconds themselves.
fn at_nanos(nanos: i128, format: &[BorrowedFormatItem<'_>]) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|at| at.format(format).ok())
        .unwrap_or_else(|| format!("{nanos}ns after 1970-01-01T00:00:00Z"))
}

/// A duration in seconds as `3h25m`, `12m4s`, `0.4s`.
pub(crate) fn human_seconds(seconds: f64) -> String {
    if seconds < 10.0 {
        return format!("{seconds:.1}s");
    }
    let s = seconds.round() as u64;
    let (d, h, m, s) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s}s"),
        (0, _, _) => format!("{h}h{m}m"),
        _ => format!("{d}d{h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_millis(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(
            rfc3339_millis(1_796_025_662_345),
            "2026-11-30T08:01:02.345Z"
        );
        assert_eq!(rfc3339_millis(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn formats_microseconds() {
        use std::time::{Duration, UNIX_EPOCH};
        let at = UNIX_EPOCH + Duration::from_micros(1_796_025_662_345_678);
        assert_eq!(rfc3339(at), "2026-11-30T08:01:02.345678Z");
        let before = UNIX_EPOCH - Duration::from_micros(1);
        assert_eq!(rfc3339(before), "1969-12-31T23:59:59.999999Z");
    }

    #[test]
    fn durations_read_like_ttls() {
        assert_eq!(human_seconds(0.4), "0.4s");
        assert_eq!(human_seconds(64.0), "1m4s");
        assert_eq!(human_seconds(3.0 * 3600.0 + 25.0 * 60.0), "3h25m");
        assert_eq!(human_seconds(2.0 * 86_400.0 + 3600.0), "2d1h");
    }
}
