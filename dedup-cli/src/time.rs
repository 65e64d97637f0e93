//! Timestamps as RFC 3339 text, without a date-time crate.

/// `2026-11-30T08:01:02.345Z` for milliseconds since the Unix epoch (UTC).
pub(crate) fn rfc3339_millis(millis: i64) -> String {
    let (secs, ms) = (millis.div_euclid(1000), millis.rem_euclid(1000));
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `2026-11-30T08:01:02.345678Z` for a point in time (UTC), to the
/// microsecond.
pub(crate) fn rfc3339(at: std::time::SystemTime) -> String {
    let micros: i64 = match at.duration_since(std::time::UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
        Err(before) => -i64::try_from(before.duration().as_micros()).unwrap_or(i64::MAX),
    };
    let millis = rfc3339_millis(micros.div_euclid(1000));
    // `...SS.mmmZ` and the remaining microseconds.
    format!(
        "{}{:03}Z",
        &millis[..millis.len() - 1],
        micros.rem_euclid(1000)
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
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
