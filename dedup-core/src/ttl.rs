//! How long a claim lives.

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;
use std::time::Duration;

pub use dedup_ttl::{TtlError, TtlErrorKind};

/// How long a claim protects an event id from being applied again.
///
/// Written in one grammar everywhere: in `#[idempotent(ttl = "4h")]` (checked
/// when the crate compiles), in config files and in environment variables:
/// `90s`, `15m`, `4h`, `7d`, and compounds such as `1h30m`, largest unit first.
/// Whole seconds, positive, at most 100 years. `Display` writes the canonical
/// form, which parses back to the same value.
///
/// ```
/// use dedup_core::Ttl;
///
/// let ttl: Ttl = "1h30m".parse()?;
/// assert_eq!(ttl.as_secs(), 5400);
/// assert_eq!(ttl.to_string(), "1h30m");
/// assert_eq!("90m".parse::<Ttl>()?, ttl);
///
/// let err = "1.5h".parse::<Ttl>().unwrap_err();
/// assert!(err.to_string().contains("fractions are not supported"));
/// # Ok::<(), dedup_core::TtlError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ttl(NonZeroU64);

impl Ttl {
    /// A TTL of `secs` seconds; `None` for zero or more than 100 years.
    pub const fn from_secs(secs: u64) -> Option<Self> {
        if secs > dedup_ttl::MAX_SECS {
            return None;
        }
        match NonZeroU64::new(secs) {
            Some(n) => Some(Ttl(n)),
            None => None,
        }
    }

    /// Parses the TTL grammar (same as [`str::parse`]).
    pub fn parse(input: &str) -> Result<Self, TtlError> {
        dedup_ttl::parse_secs(input)
            .map(|secs| Ttl(NonZeroU64::new(secs).expect("grammar rejects zero")))
    }

    /// The TTL in whole seconds.
    pub const fn as_secs(self) -> u64 {
        self.0.get()
    }

    /// The TTL as a [`Duration`].
    pub const fn as_duration(self) -> Duration {
        Duration::from_secs(self.0.get())
    }
}

impl FromStr for Ttl {
    type Err = TtlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ttl::parse(s)
    }
}

impl fmt::Display for Ttl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        dedup_ttl::format_secs(self.as_secs(), f)
    }
}

impl fmt::Debug for Ttl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Ttl({self})")
    }
}

impl From<Ttl> for Duration {
    fn from(ttl: Ttl) -> Duration {
        ttl.as_duration()
    }
}

impl<'de> serde::Deserialize<'de> for Ttl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Ttl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_secs_matches_the_grammar_bounds() {
        assert_eq!(Ttl::from_secs(0), None);
        assert_eq!(Ttl::from_secs(14_400), Some("4h".parse().unwrap()));
        assert_eq!(Ttl::from_secs(dedup_ttl::MAX_SECS + 1), None);
    }

    #[test]
    fn deserializes_from_config_strings() {
        #[derive(serde::Deserialize)]
        struct Config {
            ttl: Ttl,
        }
        let c: Config = serde_json::from_str(r#"{"ttl":"7d"}"#).unwrap();
        assert_eq!(c.ttl.as_duration(), Duration::from_secs(7 * 86_400));
        let err = serde_json::from_str::<Config>(r#"{"ttl":"7 days"}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("invalid TTL \"7 days\""), "{err}");
        assert_eq!(serde_json::to_string(&c.ttl).unwrap(), "\"7d\"");
    }
}
