//! The one TTL grammar of dedup.
//!
//! ```
//! assert_eq!(dedup_ttl::parse_secs("1h30m"), Ok(5_400));
//! assert_eq!(dedup_ttl::parse_secs("4h"), Ok(4 * 3_600));
//! assert!(dedup_ttl::parse_secs("30m1h").is_err()); // largest unit first
//! assert!(dedup_ttl::parse_secs("0s").is_err()); // a claim must live
//! ```
//!
//! `dedup-core` re-exports it as `Ttl`, and the `#[idempotent]` macro parses
//! its `ttl = "..."` option with the same code at compile time, so a string
//! that builds is exactly a string that a config file or an environment
//! variable accepts at run time. It lives in its own dependency-free crate
//! because the macro crate cannot depend on `dedup-core` (which re-exports the
//! macro).
//!
//! Grammar: one or more `<number><unit>` parts, units `d`, `h`, `m`, `s`, each
//! at most once and from largest to smallest: `90s`, `15m`, `4h`, `7d`,
//! `1h30m`, `2d12h`. No whitespace, signs or fractions. The total must be
//! positive and at most [`MAX_SECS`] (100 years).

use std::fmt;

/// The largest TTL accepted: 36 500 days (100 years). Anything longer is
/// certainly a typo, and far-future timestamps overflow some databases.
pub const MAX_SECS: u64 = 36_500 * DAY;

const MINUTE: u64 = 60;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;

/// Units from largest to smallest; a TTL lists them in this order.
const UNITS: [(char, u64); 4] = [('d', DAY), ('h', HOUR), ('m', MINUTE), ('s', 1)];

/// Why a TTL string was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TtlErrorKind {
    /// The string is empty.
    Empty,
    /// The string starts with `-`.
    Negative,
    /// The parts add up to zero.
    Zero,
    /// A number is followed by something that is not a known unit.
    UnknownUnit(String),
    /// A number has no unit after it.
    MissingUnit,
    /// A unit has no number before it.
    MissingNumber,
    /// A unit appears twice, or after a smaller one (`30m1h`).
    UnitOrder(char),
    /// The total exceeds [`MAX_SECS`].
    Overflow,
    /// A character that has no place in a TTL (whitespace, `.`, `+`, ...).
    UnexpectedChar(char),
}

/// A TTL string that does not follow the grammar, with the input it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TtlError {
    input: String,
    kind: TtlErrorKind,
}

impl TtlError {
    /// What was wrong.
    pub fn kind(&self) -> &TtlErrorKind {
        &self.kind
    }

    /// The rejected input.
    pub fn input(&self) -> &str {
        &self.input
    }
}

impl fmt::Display for TtlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid TTL {:?}: ", self.input)?;
        match &self.kind {
            TtlErrorKind::Empty => f.write_str("it is empty"),
            TtlErrorKind::Negative => f.write_str("a TTL cannot be negative"),
            TtlErrorKind::Zero => f.write_str("a TTL must be longer than zero"),
            TtlErrorKind::UnknownUnit(u) => write!(f, "unknown unit {u:?}"),
            TtlErrorKind::MissingUnit => f.write_str("a number needs a unit after it"),
            TtlErrorKind::MissingNumber => f.write_str("a unit needs a number before it"),
            TtlErrorKind::UnitOrder(u) => write!(
                f,
                "unit '{u}' is repeated or out of order (write units once, largest first)"
            ),
            TtlErrorKind::Overflow => f.write_str("longer than the maximum of 36500d"),
            TtlErrorKind::UnexpectedChar('.') => {
                f.write_str("fractions are not supported (write 1h30m, not 1.5h)")
            }
            TtlErrorKind::UnexpectedChar(c) if c.is_whitespace() => {
                f.write_str("whitespace is not allowed")
            }
            TtlErrorKind::UnexpectedChar(c) => write!(f, "unexpected character {c:?}"),
        }?;
        f.write_str("; expected parts like 90s, 15m, 4h, 7d or 1h30m (units d, h, m, s)")
    }
}

impl std::error::Error for TtlError {}

/// Parses a TTL into whole seconds.
///
/// ```
/// assert_eq!(dedup_ttl::parse_secs("1h30m"), Ok(5400));
/// assert!(dedup_ttl::parse_secs("0s").is_err());
/// ```
pub fn parse_secs(input: &str) -> Result<u64, TtlError> {
    let err = |kind| TtlError {
        input: input.to_owned(),
        kind,
    };
    if input.is_empty() {
        return Err(err(TtlErrorKind::Empty));
    }
    if input.starts_with('-') {
        return Err(err(TtlErrorKind::Negative));
    }
    let mut total: u64 = 0;
    // Index into UNITS of the smallest unit used so far: the next one must be smaller.
    let mut next_unit = 0;
    let mut rest = input;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (number, after) = rest.split_at(digits);
        let letters = after.chars().take_while(char::is_ascii_alphabetic).count();
        let (unit, after) = after.split_at(letters);
        if number.is_empty() {
            return Err(err(match unit.chars().next().or(rest.chars().next()) {
                Some(c) if c.is_ascii_alphabetic() => TtlErrorKind::MissingNumber,
                Some(c) => TtlErrorKind::UnexpectedChar(c),
                None => TtlErrorKind::Empty,
            }));
        }
        if unit.is_empty() {
            return Err(err(match after.chars().next() {
                Some(c) => TtlErrorKind::UnexpectedChar(c),
                None => TtlErrorKind::MissingUnit,
            }));
        }
        let Some(pos) = UNITS
            .iter()
            .position(|(u, _)| unit.len() == 1 && unit.starts_with(*u))
        else {
            return Err(err(TtlErrorKind::UnknownUnit(unit.to_owned())));
        };
        if pos < next_unit {
            return Err(err(TtlErrorKind::UnitOrder(UNITS[pos].0)));
        }
        next_unit = pos + 1;
        let secs = number
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(UNITS[pos].1))
            .and_then(|s| s.checked_add(total))
            .filter(|t| *t <= MAX_SECS)
            .ok_or_else(|| err(TtlErrorKind::Overflow))?;
        total = secs;
        rest = after;
    }
    if total == 0 {
        return Err(err(TtlErrorKind::Zero));
    }
    Ok(total)
}

/// Writes seconds in the grammar's canonical form (`5400` -> `1h30m`), which
/// [`parse_secs`] reads back to the same number.
pub fn format_secs(secs: u64, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    if secs == 0 {
        return f.write_str("0s");
    }
    let mut rest = secs;
    for (unit, size) in UNITS {
        if rest >= size {
            write!(f, "{}{unit}", rest / size)?;
            rest %= size;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Show(u64);
    impl fmt::Display for Show {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            format_secs(self.0, f)
        }
    }

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse_secs("90s"), Ok(90));
        assert_eq!(parse_secs("15m"), Ok(900));
        assert_eq!(parse_secs("4h"), Ok(4 * 3600));
        assert_eq!(parse_secs("7d"), Ok(7 * 86400));
        assert_eq!(parse_secs("1h30m"), Ok(5400));
        assert_eq!(
            parse_secs("2d12h30m15s"),
            Ok(2 * 86400 + 12 * 3600 + 30 * 60 + 15)
        );
        assert_eq!(parse_secs("0h1s"), Ok(1));
        assert_eq!(parse_secs("36500d"), Ok(MAX_SECS));
    }

    #[test]
    fn rejects_with_a_reason() {
        let kind = |s: &str| parse_secs(s).unwrap_err().kind().clone();
        assert_eq!(kind(""), TtlErrorKind::Empty);
        assert_eq!(kind("-5m"), TtlErrorKind::Negative);
        assert_eq!(kind("0s"), TtlErrorKind::Zero);
        assert_eq!(kind("0h0m"), TtlErrorKind::Zero);
        assert_eq!(kind("4x"), TtlErrorKind::UnknownUnit("x".into()));
        assert_eq!(kind("4H"), TtlErrorKind::UnknownUnit("H".into()));
        assert_eq!(kind("4hours"), TtlErrorKind::UnknownUnit("hours".into()));
        assert_eq!(kind("4ms"), TtlErrorKind::UnknownUnit("ms".into()));
        assert_eq!(kind("10"), TtlErrorKind::MissingUnit);
        assert_eq!(kind("h"), TtlErrorKind::MissingNumber);
        assert_eq!(kind("1h1h"), TtlErrorKind::UnitOrder('h'));
        assert_eq!(kind("30m1h"), TtlErrorKind::UnitOrder('h'));
        assert_eq!(kind("36501d"), TtlErrorKind::Overflow);
        assert_eq!(kind("99999999999999999999999s"), TtlErrorKind::Overflow);
        assert_eq!(kind("1.5h"), TtlErrorKind::UnexpectedChar('.'));
        assert_eq!(kind("1h 30m"), TtlErrorKind::UnexpectedChar(' '));
        assert_eq!(kind("+4h"), TtlErrorKind::UnexpectedChar('+'));
        assert_eq!(kind("four hours"), TtlErrorKind::MissingNumber);
    }

    #[test]
    fn messages_name_the_input_and_the_fix() {
        let msg = parse_secs("1.5h").unwrap_err().to_string();
        assert!(
            msg.starts_with("invalid TTL \"1.5h\": fractions are not supported"),
            "{msg}"
        );
        assert!(msg.contains("1h30m"), "{msg}");
        let msg = parse_secs("4x").unwrap_err().to_string();
        assert!(msg.contains("unknown unit \"x\""), "{msg}");
    }

    #[test]
    fn display_round_trips() {
        for secs in [
            1, 59, 60, 61, 90, 3599, 3600, 5400, 86399, 86400, 90061, MAX_SECS,
        ] {
            let shown = Show(secs).to_string();
            assert_eq!(parse_secs(&shown), Ok(secs), "{secs} shown as {shown}");
        }
        assert_eq!(Show(5400).to_string(), "1h30m");
        assert_eq!(Show(90).to_string(), "1m30s");
        assert_eq!(Show(7 * 86400).to_string(), "7d");
    }
}
