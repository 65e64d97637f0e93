//! Whether a record's tier headers are its own.
//!
//! A tier's record (and a copy `dedup retry release` sends home) steers
//! what the runtime does beyond itself: its `dedup.origin.*` name the event
//! whose key hold-back lets go when it finishes, and the place a dead
//! letter's replay sends it; its `dedup.retry.due` how long its partition
//! waits. Anyone who may produce to a topic could write such headers, so
//! they are read only when they can be the runtime's own:
//!
//! - a tier's record names an origin on this tier's handled topic, in the
//!   same partition (a move keeps its partition), and this tier;
//! - a released copy names an earlier offset of its own topic and
//!   partition (the CLI sends it to where its event came from);
//! - with a [`TierKey`], both carry `dedup.retry.signature`, an HMAC of
//!   those headers, the record's key and its payload.
//!
//! A record that fails these is the message's fault: it is dead-lettered
//! with the reason as itself (its own topic, partition and offset), and
//! releases nothing.

use hmac::{Hmac, KeyInit as _, Mac as _};
use rdkafka::message::{Headers, Message as _, OwnedMessage};
use sha2::Sha256;

use super::{
    ORIGIN_HEADERS, RETRY_ATTEMPT_HEADER, RETRY_DUE_HEADER, RETRY_RELEASED_HEADER,
    RETRY_TIER_HEADER,
};
use crate::Error;

/// The HMAC-SHA-256 (hex) of a tier's record or released copy, under the
/// consumer's [`TierKey`]: of its `dedup.origin.*` and `dedup.retry.*`
/// headers, its key and its payload.
pub const RETRY_SIGNATURE_HEADER: &str = "dedup.retry.signature";

/// The dead-letter kind of a record whose tier headers are not its own.
pub(crate) const FORGED: &str = "forged_tier_headers";

/// The headers a signature covers, in this order.
const SIGNED: [&str; 8] = [
    ORIGIN_HEADERS[0],
    ORIGIN_HEADERS[1],
    ORIGIN_HEADERS[2],
    ORIGIN_HEADERS[3],
    RETRY_TIER_HEADER,
    RETRY_DUE_HEADER,
    RETRY_ATTEMPT_HEADER,
    RETRY_RELEASED_HEADER,
];

/// A secret that signs the records the runtime moves to its retry tiers
/// ([`RetryTiers::signing_key`](crate::RetryTiers::signing_key)), and that
/// `dedup retry release` signs its copies with: a record on a tier, or a
/// released copy, without a valid signature is then dead-lettered instead
/// of read as the runtime's own. Give every process of the group (and the
/// operator's CLI) the same key. Its `Debug` never shows it.
///
/// ```
/// let key = dedup_kafka::TierKey::new("a secret of at least 16 bytes").unwrap();
/// assert_eq!(format!("{key:?}"), "TierKey(..)");
/// assert!(dedup_kafka::TierKey::new("short").is_err());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct TierKey(std::sync::Arc<[u8]>);

/// The shortest key taken: 128 bits.
const MIN_KEY_BYTES: usize = 16;

impl TierKey {
    /// A key of `secret`'s bytes (at least 16; 32 random bytes, written
    /// as hex or base64, make a good one).
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, Error> {
        let secret = secret.as_ref();
        if secret.len() < MIN_KEY_BYTES {
            return Err(Error::Config(format!(
                "the retry tiers' signing key has {} bytes: give it at least {MIN_KEY_BYTES} \
                 (32 random bytes, as hex or base64, make a good one)",
                secret.len()
            )));
        }
        Ok(TierKey(secret.into()))
    }

    /// The key held in file `path`: its bytes, less the line ending a
    /// text editor or `echo` leaves at its end. The error names the file,
    /// never its contents.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let mut bytes = std::fs::read(path).map_err(|e| {
            Error::Config(format!(
                "reading the retry tiers' signing key from {}: {e}",
                path.display()
            ))
        })?;
        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            bytes.pop();
        }
        Self::new(bytes).map_err(|e| {
            Error::Config(format!(
                "{} (in {})",
                e.into_config_message(),
                path.display()
            ))
        })
    }

    /// The signature (hex) of a record with `key`, `payload` and `headers`,
    /// for [`RETRY_SIGNATURE_HEADER`].
    pub fn sign<H: Headers>(
        &self,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<&H>,
    ) -> String {
        let mac = self.mac(key, payload, headers).finalize().into_bytes();
        mac.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `msg` carries this key's signature of itself (in
    /// [`RETRY_SIGNATURE_HEADER`]).
    pub fn verifies(&self, msg: &OwnedMessage) -> bool {
        let Some(hex) = last(msg.headers(), RETRY_SIGNATURE_HEADER) else {
            return false;
        };
        let Some(given) = from_hex(hex) else {
            return false;
        };
        // Compared in constant time.
        self.mac(msg.key(), msg.payload(), msg.headers())
            .verify_slice(&given)
            .is_ok()
    }

    fn mac<H: Headers>(
        &self,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<&H>,
    ) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(b"dedup.retry.signature/1");
        let fields = SIGNED.iter().map(|name| last(headers, name));
        for field in fields.chain([key, payload]) {
            // Present or not, then length-prefixed: no two records sign
            // the same bytes.
            match field {
                None => mac.update(&[0]),
                Some(bytes) => {
                    mac.update(&[1]);
                    mac.update(&(bytes.len() as u64).to_be_bytes());
                    mac.update(bytes);
                }
            }
        }
        mac
    }
}

impl std::fmt::Debug for TierKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TierKey(..)")
    }
}

/// The last value of header `name` (as a consumer reads a repeated one).
pub(super) fn last<'h, H: Headers>(headers: Option<&'h H>, name: &str) -> Option<&'h [u8]> {
    let headers = headers?;
    (0..headers.count())
        .rev()
        .map(|i| headers.get(i))
        .find(|h| h.key == name)
        .and_then(|h| h.value)
}

fn from_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) || !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    hex.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

/// How far a tier's record's timestamp (its move's time, on the moving
/// process's clock) may be ahead of the reader's clock: its due time is
/// bounded by it (`tiers::due_in`).
const MAX_AHEAD_MS: i64 = 5 * 60 * 1000;

/// Why a tier record's timestamp (the bound on its due time) cannot be the
/// runtime's, if it cannot: none (the runtime's moves always carry one), or
/// more than [`MAX_AHEAD_MS`] ahead of this clock. Without this a record
/// could put its due time out of reach for ever (`tiers::due_in`).
fn stamp_refused(msg: &OwnedMessage) -> Option<String> {
    let Some(written) = msg.timestamp().to_millis() else {
        return Some("it has no timestamp (the runtime's moves always carry one)".to_owned());
    };
    let ahead = written - super::now_ms();
    (ahead > MAX_AHEAD_MS).then(|| {
        format!(
            "its timestamp is {} s ahead of this consumer's clock (more than {} s: a forged \
             one, or the moving process's clock is that far off)",
            ahead / 1000,
            MAX_AHEAD_MS / 1000
        )
    })
}

/// What a record with tier headers says it is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Claimed<'a> {
    /// A record read from tier `tier` of handled topic `origin`.
    Tier { origin: &'a str, tier: &'a str },
    /// A copy released home (`dedup.retry.released`) on a topic with tiers.
    Released,
}

/// Why `msg`'s tier headers are not its own, if they are not (see the
/// module's doc).
pub(crate) fn forged(
    msg: &OwnedMessage,
    claimed: Claimed<'_>,
    key: Option<&TierKey>,
) -> Option<String> {
    let text = |name| super::header(msg, name);
    let [topic, partition, offset, _] = ORIGIN_HEADERS;
    let origin = (|| {
        Some((
            text(topic).filter(|t| !t.is_empty())?,
            text(partition)?.parse::<i32>().ok()?,
            text(offset)?.parse::<i64>().ok().filter(|o| *o >= 0)?,
        ))
    })();
    let Some((from, from_partition, from_offset)) = origin else {
        return Some("its dedup.origin.* headers are missing or unreadable".to_owned());
    };
    let named = format!("{from}/{from_partition}/{from_offset}");
    let wrong = match claimed {
        Claimed::Tier { origin, tier } => {
            if from != origin || from_partition != msg.partition() {
                Some(format!(
                    "its dedup.origin.* name {named}, not partition {} of {origin:?}, whose \
                     retry tier {:?} it was read from",
                    msg.partition(),
                    msg.topic()
                ))
            } else if let Some(why) = stamp_refused(msg) {
                Some(why)
            } else if text(RETRY_TIER_HEADER) != Some(tier) {
                Some(format!(
                    "its {RETRY_TIER_HEADER} is {:?}, not {tier:?}, the tier it was read from",
                    text(RETRY_TIER_HEADER).unwrap_or_default()
                ))
            } else {
                None
            }
        }
        Claimed::Released => (from != msg.topic()
            || from_partition != msg.partition()
            || from_offset >= msg.offset())
        .then(|| {
            format!(
                "it says it was released home from a retry tier, but its dedup.origin.* name \
                 {named}, not an earlier offset of {}/{}",
                msg.topic(),
                msg.partition()
            )
        }),
    };
    if wrong.is_some() {
        return wrong;
    }
    match key {
        Some(key) if !key.verifies(msg) => Some(format!(
            "its {RETRY_SIGNATURE_HEADER} is missing or does not match the consumer's tier key \
             (it names {named})"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter_format::{DeadLetter, headers};
    use crate::tiers::Moved;
    use crate::tiers::Origin;
    use rdkafka::message::{Header, OwnedHeaders};

    fn record(topic: &str, partition: i32, offset: i64, headers: OwnedHeaders) -> OwnedMessage {
        OwnedMessage::new(
            Some(br#"{"event_id":"e1"}"#.to_vec()),
            Some(b"acct-1".to_vec()),
            topic.into(),
            rdkafka::Timestamp::CreateTime(1_000),
            partition,
            offset,
            Some(headers),
        )
    }

    /// `msg`'s headers, with `name` set to `value` (or left out).
    fn with(msg: &OwnedMessage, name: &str, value: Option<&str>) -> OwnedHeaders {
        let mut out = OwnedHeaders::new();
        for h in msg
            .headers()
            .expect("headers")
            .iter()
            .filter(|h| h.key != name)
        {
            out = out.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
        if let Some(value) = value {
            out = out.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        out
    }

    /// The record the runtime moves `original` (payments/2/41) to tier
    /// "30s" with, as read back from that tier at offset 7.
    fn moved(original: &OwnedMessage, key: Option<&TierKey>) -> OwnedMessage {
        let why = DeadLetter {
            topic: "payments.retry-30s",
            kind: "handler",
            message: "503".into(),
            attempts: 2,
            handler: "h",
            schema_id: None,
            origin: Origin {
                topic: "payments".into(),
                partition: 2,
                offset: 41,
                timestamp: Some(1_000),
            },
            moved: Some(Moved {
                tier: "30s",
                due_ms: 5_000,
                attempts: 2,
                key,
            }),
        };
        record("payments.retry-30s", 2, 7, headers(original, &why, None))
    }

    fn key() -> TierKey {
        TierKey::new("0123456789abcdef-a-test-key").expect("key")
    }

    const TIER: Claimed<'static> = Claimed::Tier {
        origin: "payments",
        tier: "30s",
    };

    #[test]
    fn a_record_the_runtime_moved_is_its_own_and_signed() {
        let original = record("payments", 2, 41, OwnedHeaders::new());
        let key = key();
        let signed = moved(&original, Some(&key));
        assert!(key.verifies(&signed));
        assert_eq!(forged(&signed, TIER, Some(&key)), None);
        // Unsigned, it passes only without a key.
        let unsigned = moved(&original, None);
        assert_eq!(forged(&unsigned, TIER, None), None);
        let why = forged(&unsigned, TIER, Some(&key)).expect("unsigned");
        assert!(why.contains("dedup.retry.signature"), "{why}");
        // Another key's signature is no signature.
        let other = TierKey::new("another key of sixteen+ bytes").expect("key");
        assert!(!other.verifies(&signed));
    }

    /// Every header that steers the runtime, the key and the payload are
    /// signed: changing any one breaks the signature.
    #[test]
    fn a_signature_covers_what_steers_the_runtime() {
        let original = record("payments", 2, 41, OwnedHeaders::new());
        let key = key();
        let signed = moved(&original, Some(&key));
        for name in SIGNED {
            let changed = record("payments.retry-30s", 2, 7, with(&signed, name, Some("9")));
            assert!(!key.verifies(&changed), "{name} changed");
        }
        let dropped = record(
            "payments.retry-30s",
            2,
            7,
            with(&signed, ORIGIN_HEADERS[3], None),
        );
        assert!(!key.verifies(&dropped), "a header left out");
        let other_payload = OwnedMessage::new(
            Some(br#"{"event_id":"e2"}"#.to_vec()),
            Some(b"acct-1".to_vec()),
            "payments.retry-30s".into(),
            rdkafka::Timestamp::CreateTime(1_000),
            2,
            7,
            signed.headers().cloned(),
        );
        assert!(!key.verifies(&other_payload), "another payload");
        let other_key = OwnedMessage::new(
            signed.payload().map(<[u8]>::to_vec),
            Some(b"acct-2".to_vec()),
            "payments.retry-30s".into(),
            rdkafka::Timestamp::CreateTime(1_000),
            2,
            7,
            signed.headers().cloned(),
        );
        assert!(!key.verifies(&other_key), "another record key");
        let garbage = record(
            "payments.retry-30s",
            2,
            7,
            with(&signed, RETRY_SIGNATURE_HEADER, Some("zz")),
        );
        assert!(!key.verifies(&garbage));
    }

    /// Without a key, tier headers are read only where they fit: a tier's
    /// record names its own handled topic, partition and tier; a released
    /// copy an earlier offset of its own partition.
    #[test]
    fn tier_headers_that_do_not_fit_where_they_were_read_are_forged() {
        let original = record("payments", 2, 41, OwnedHeaders::new());
        let good = moved(&original, None);
        let elsewhere = Claimed::Tier {
            origin: "orders",
            tier: "30s",
        };
        let why = forged(&good, elsewhere, None).expect("another topic's tier");
        assert!(
            why.contains("payments/2/41") && why.contains("\"orders\""),
            "{why}"
        );
        let other_tier = Claimed::Tier {
            origin: "payments",
            tier: "5m",
        };
        assert!(
            forged(&good, other_tier, None)
                .expect("another tier")
                .contains("\"5m\"")
        );
        let moved_partition = record("payments.retry-30s", 3, 7, with(&good, "x", None));
        assert!(
            forged(&moved_partition, TIER, None).is_some(),
            "another partition"
        );
        let ahead = OwnedMessage::new(
            good.payload().map(<[u8]>::to_vec),
            None,
            "payments.retry-30s".into(),
            rdkafka::Timestamp::CreateTime(super::super::now_ms() + 3_600_000),
            2,
            7,
            good.headers().cloned(),
        );
        let why = forged(&ahead, TIER, None).expect("written an hour from now");
        assert!(why.contains("ahead of this consumer's clock"), "{why}");
        let unstamped = OwnedMessage::new(
            good.payload().map(<[u8]>::to_vec),
            None,
            "payments.retry-30s".into(),
            rdkafka::Timestamp::NotAvailable,
            2,
            7,
            good.headers().cloned(),
        );
        let why = forged(&unstamped, TIER, None).expect("no timestamp");
        assert!(why.contains("no timestamp"), "{why}");
        let bare = record("payments.retry-30s", 2, 7, OwnedHeaders::new());
        let why = forged(&bare, TIER, None).expect("no origin");
        assert!(why.contains("missing"), "{why}");

        // Released home: payments/2, after offset 41.
        let released = |partition, offset| {
            let headers = with(&good, RETRY_RELEASED_HEADER, Some("payments.retry-30s/2/7"));
            record("payments", partition, offset, headers)
        };
        assert_eq!(forged(&released(2, 90), Claimed::Released, None), None);
        assert!(
            forged(&released(2, 41), Claimed::Released, None).is_some(),
            "not earlier"
        );
        assert!(
            forged(&released(1, 90), Claimed::Released, None).is_some(),
            "another partition"
        );
        let key = key();
        assert!(
            forged(&released(2, 90), Claimed::Released, Some(&key)).is_some(),
            "unsigned, with a key"
        );
    }

    /// While a key is rolled out, moves are signed and signatures not
    /// required; the other checks still hold.
    #[test]
    fn signatures_can_be_made_before_they_are_required() {
        let original = record("payments", 2, 41, OwnedHeaders::new());
        let tiers = |require| {
            crate::RetryTiers::new(["30s"])
                .expect("tiers")
                .signing_key(key())
                .require_signatures(require)
                .of("payments", crate::OrderBy::default(), 1)
        };
        let unsigned = moved(&original, None);
        assert!(tiers(true).forged(Some(0), &unsigned).is_some());
        assert_eq!(tiers(false).forged(Some(0), &unsigned), None);
        let elsewhere = crate::RetryTiers::new(["30s"])
            .expect("tiers")
            .require_signatures(false)
            .of("orders", crate::OrderBy::default(), 1);
        assert!(elsewhere.forged(Some(0), &unsigned).is_some());
        let signed = moved(&original, tiers(false).tiers[0].key.as_ref());
        assert_eq!(
            tiers(true).forged(Some(0), &signed),
            None,
            "signed by the moves"
        );
    }

    #[test]
    fn a_key_is_long_enough_read_from_a_file_and_never_shown() {
        assert!(TierKey::new([7u8; 15]).is_err());
        let dir = std::env::temp_dir().join(format!("tier-key-{}", std::process::id()));
        std::fs::write(&dir, "0123456789abcdef-a-test-key\n").expect("write");
        let read = TierKey::from_file(&dir).expect("read");
        std::fs::remove_file(&dir).expect("remove");
        assert_eq!(read, key(), "the line ending is not part of it");
        assert_eq!(format!("{:?}", read), "TierKey(..)");
        let missing = TierKey::from_file("/nonexistent/tier.key")
            .unwrap_err()
            .to_string();
        assert!(missing.contains("/nonexistent/tier.key"), "{missing}");
    }
}
