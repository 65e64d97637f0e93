//! What the SQL outboxes share: their settings, the headers' column, the
//! events a finished batch leaves unsettled, the writer and reader
//! ([`shell`]) and, for stores that cannot notify, polling ([`polled`]).

pub mod polled;
mod shell;
pub use shell::{Outbox, OutboxReader, OutboxStore, OutboxWriter};

use std::collections::HashSet;
use std::time::Duration;

use dedup_core::outbox::{OutboxRecord, PublishFailure, Retention};

/// Settings of an SQL store's outbox writer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxConfig {
    /// The outbox table (default `dedup_outbox`), validated and quoted as
    /// the store's dedup table is (PostgreSQL relays also `LISTEN` on a
    /// channel of this name).
    pub table: String,
    /// What happens to published rows (default: kept for one hour).
    pub retention: Retention,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            table: "dedup_outbox".to_owned(),
            retention: Retention::Keep(Duration::from_secs(3600)),
        }
    }
}

impl OutboxConfig {
    /// Sets the outbox table name.
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets what happens to published rows.
    pub fn with_retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }
}

/// Headers as one byte string, for a database without arrays: for each,
/// the name's length (4 bytes, big-endian), the name, the value's length,
/// the value.
pub fn encode_headers(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        for part in [name.as_bytes(), value] {
            let len = u32::try_from(part.len()).expect("a header part under 4 GiB");
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

/// The headers [`encode_headers`] wrote; `None` if `bytes` is not such an
/// encoding.
pub fn decode_headers(mut bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    fn part<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
        let (len, rest) = bytes.split_first_chunk::<4>()?;
        let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
        let (part, rest) = (rest.get(..len)?, rest.get(len..)?);
        *bytes = rest;
        Some(part)
    }
    let mut headers = Vec::new();
    while !bytes.is_empty() {
        let name = String::from_utf8(part(&mut bytes)?.to_vec()).ok()?;
        headers.push((name, part(&mut bytes)?.to_vec()));
    }
    Some(headers)
}

/// A batch an SQL outbox leased: its id and its events' sequence numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlLease {
    id: i64,
    seqs: Vec<i64>,
}

impl SqlLease {
    /// Lease `id` of the events `seqs`.
    pub fn new(id: i64, seqs: Vec<i64>) -> Self {
        SqlLease { id, seqs }
    }

    /// A new random lease id.
    pub fn new_id() -> i64 {
        i64::from_ne_bytes(uuid::Uuid::new_v4().as_u64_pair().0.to_ne_bytes())
    }

    /// The lease's id, as the rows it holds carry it.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The sequence numbers of its events.
    pub fn seqs(&self) -> &[i64] {
        &self.seqs
    }
}

/// A row of an SQL outbox (sequence number, event id, topic, key, payload,
/// headers as [`encode_headers`] wrote them, failed attempts) as the relay
/// reads it.
pub type OutboxRow = (i64, String, String, Option<Vec<u8>>, Vec<u8>, Vec<u8>, i64);

/// An [`OutboxRow`] as the relay's record.
pub fn outbox_record(
    (seq, event_id, topic, key, payload, headers, attempts): OutboxRow,
) -> OutboxRecord {
    OutboxRecord::new(seq, event_id, topic, payload)
        .with_key(key)
        // Only the store writes the column.
        .with_headers(decode_headers(&headers).unwrap_or_default())
        .with_attempts(u32::try_from(attempts).unwrap_or(0))
}

/// `d` in whole milliseconds, as the SQL outboxes bind durations.
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// `seqs` as a JSON array, for `json_each` or `JSON_TABLE`.
pub fn json_seqs(seqs: &[i64]) -> String {
    let items: Vec<String> = seqs.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(","))
}

/// The events of a leased batch (`leased`) that were neither published
/// nor failed: released, to be offered again at once.
pub fn unsettled(leased: &[i64], published: &[i64], failed: &[PublishFailure]) -> Vec<i64> {
    let settled: HashSet<i64> = published
        .iter()
        .copied()
        .chain(failed.iter().map(|f| f.seq))
        .collect();
    leased
        .iter()
        .copied()
        .filter(|seq| !settled.contains(seq))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_garbage_is_refused() {
        for headers in [
            vec![],
            vec![("a".to_owned(), vec![])],
            vec![
                ("trace".to_owned(), b"abc".to_vec()),
                ("bin".to_owned(), vec![0, 255, 1]),
                ("".to_owned(), vec![7; 300]),
            ],
        ] {
            assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
        }
        assert_eq!(decode_headers(&[0, 0, 0, 5, b'a']), None, "cut short");
        assert_eq!(
            decode_headers(&[0, 0, 0, 1, 0xff, 0, 0, 0, 0]),
            None,
            "not UTF-8"
        );
    }

    #[test]
    fn unsettled_is_what_was_neither_published_nor_failed() {
        let failed = [PublishFailure::new(3, "x", Duration::ZERO)];
        assert_eq!(unsettled(&[1, 2, 3, 4], &[2], &failed), [1, 4]);
    }
}
