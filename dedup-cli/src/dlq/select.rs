//! What `dlq replay` takes: its options, the records it selects, and the
//! event id it reads from a dead letter (for --check-claims and the console).

use std::collections::HashMap;

use clap::Args;
use dedup_core::Ttl;
use rdkafka::message::{Headers as _, Message as _};

use crate::{Database, Failure, KafkaArgs};

/// Which message a dead letter is a copy of (dedup-kafka reads its headers).
use super::DeadLetter;

/// `dlq replay`'s options.
#[derive(Args)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    pub(crate) kafka: KafkaArgs,
    /// The dead-letter topic.
    pub(crate) topic: String,
    /// Produce to this topic instead of each record's
    /// `dedup.original.topic` (partitioned by key).
    #[arg(long)]
    pub(crate) to: Option<String>,
    /// The replay's consumer group on the dead-letter topic: it commits as it
    /// goes, so an interrupted replay resumes (default
    /// `dedup-replay.<topic>`, plus the filters given).
    #[arg(long)]
    pub(crate) group: Option<String>,
    /// Only records of this `dedup.error.kind` (decode, key, handler, store,
    /// panic).
    #[arg(long)]
    pub(crate) kind: Option<String>,
    /// Only records dead-lettered within this long, e.g. `2h`.
    #[arg(long)]
    pub(crate) since: Option<Ttl>,
    /// Only records whose original partition is this one.
    #[arg(long)]
    pub(crate) partition: Option<i32>,
    /// Skip records whose event already holds a live claim (applied through
    /// another copy or path). Needs --scope and --key (or --key-field or
    /// --key-header).
    #[arg(long, requires = "scope")]
    pub(crate) check_claims: bool,
    /// The handler's scope, for --check-claims.
    #[arg(long)]
    pub(crate) scope: Option<String>,
    /// Where the handler takes the event id from, as its
    /// `#[idempotent(key = ..)]` says: fields of the JSON payload and
    /// `header:<name>`, several separated by `,` for a composite key
    /// (`"tenant_id, header:event-id"`).
    #[arg(long, conflicts_with_all = ["key_field", "key_header"])]
    pub(crate) key: Option<String>,
    /// Where the handler takes the event id from: a field of the JSON
    /// payload (`event_id`, `meta.event_id`).
    #[arg(long, conflicts_with = "key_header")]
    pub(crate) key_field: Option<String>,
    /// Where the handler takes the event id from: a header.
    #[arg(long)]
    pub(crate) key_header: Option<String>,
    /// PostgreSQL URL, for --check-claims.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub(crate) database_url: Option<String>,
    /// The claims table, for --check-claims.
    #[arg(long, default_value = "dedup_claims")]
    pub(crate) table: String,
    /// Leave out records whose dedup headers are missing or malformed
    /// (reported, and committed past) instead of refusing to replay.
    #[arg(long)]
    pub(crate) skip_invalid: bool,
    /// Print what would be replayed; send and commit nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Records produced between two commits of the replay's progress.
    #[arg(long, default_value_t = 100, hide = true)]
    pub(crate) commit_every: usize,
    /// A replay confirmed after its dry run (the console): the dry run's
    /// view, which the replay must find again or send nothing.
    #[arg(skip)]
    pub(crate) pinned: Option<Pinned>,
}

/// What a dry run saw: where it read each partition to, its clock, and a
/// digest of its plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pinned {
    pub(crate) ends: HashMap<i32, i64>,
    pub(crate) now_ms: i64,
    pub(crate) plan: u64,
}

impl Pinned {
    /// As a form keeps it: `now_ms;plan;partition:end,...`.
    pub(crate) fn text(&self) -> String {
        let mut ends: Vec<_> = self.ends.iter().collect();
        ends.sort();
        let ends: Vec<String> = ends.iter().map(|(p, e)| format!("{p}:{e}")).collect();
        format!("{};{:x};{}", self.now_ms, self.plan, ends.join(","))
    }

    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut parts = text.splitn(3, ';');
        let now_ms = parts.next()?.parse().ok()?;
        let plan = u64::from_str_radix(parts.next()?, 16).ok()?;
        let ends = parts
            .next()?
            .split(',')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (p, e) = pair.split_once(':')?;
                Some((p.parse().ok()?, e.parse().ok()?))
            })
            .collect::<Option<_>>()?;
        Some(Pinned { ends, now_ms, plan })
    }
}

/// A replay chosen outside the command line (the console): which dead
/// letters, and the claims to check.
pub(crate) struct Selection {
    pub(crate) kind: Option<String>,
    pub(crate) partition: Option<i32>,
    pub(crate) since: Option<Ttl>,
    /// The handler's scope (each letter's own `dedup.handler` if none)
    /// and where it takes the event id from, to skip what already holds a
    /// live claim (`--check-claims`).
    pub(crate) check_claims: Option<(Option<String>, String)>,
    /// Leave out records whose dedup headers cannot be read.
    pub(crate) skip_invalid: bool,
    /// The dry run this replay was confirmed after.
    pub(crate) pinned: Option<Pinned>,
}

impl ReplayArgs {
    /// `dlq replay` of `topic` with `selection`, as its flags would say;
    /// a selection that checks claims needs `db`.
    pub(crate) fn chosen(
        kafka: KafkaArgs,
        topic: String,
        selection: Selection,
        db: Option<&Database>,
        dry_run: bool,
    ) -> Self {
        let check_claims = selection.check_claims.is_some();
        let (scope, key) = selection.check_claims.unzip();
        ReplayArgs {
            kafka,
            topic,
            to: None,
            group: None,
            kind: selection.kind,
            since: selection.since,
            partition: selection.partition,
            check_claims,
            scope: scope.flatten(),
            key,
            key_field: None,
            key_header: None,
            database_url: db.map(|db| db.database_url.clone()),
            table: db.map_or_else(|| "dedup_claims".to_owned(), |db| db.table.clone()),
            skip_invalid: selection.skip_invalid,
            dry_run,
            commit_every: 100,
            pinned: selection.pinned,
        }
    }
}

/// What a replay does with one dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Below the group's committed offset: replayed by an earlier run.
    Done,
    Replay,
    /// Another record of the same original message was replayed or decided.
    Copy,
    /// Its event holds a live claim: applied already.
    Applied,
    /// Left out by --kind, --since or --partition.
    Filtered,
    /// Its payload was cut to fit the dead-letter topic: replaying it would
    /// send a different event. The original is in its topic.
    Truncated,
    /// Its dedup headers are missing or malformed (with --skip-invalid).
    Invalid,
}

/// One part of the event id: a field path of the JSON payload, or a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyPart {
    Field(String),
    Header(String),
}

/// The parts of the event id from --key, --key-field or --key-header.
pub(crate) fn key_parts(args: &ReplayArgs) -> Result<Vec<KeyPart>, Failure> {
    if let Some(field) = &args.key_field {
        return Ok(vec![KeyPart::Field(field.clone())]);
    }
    if let Some(header) = &args.key_header {
        return Ok(vec![KeyPart::Header(header.clone())]);
    }
    let Some(spec) = &args.key else {
        return Ok(Vec::new());
    };
    parse_key(spec)
}

/// The parts of an event id as `#[idempotent(key = ..)]` names them:
/// fields of the JSON payload and `header:<name>`, separated by `,`.
pub(crate) fn parse_key(spec: &str) -> Result<Vec<KeyPart>, Failure> {
    spec.split(',')
        .map(str::trim)
        .map(|part| match part.strip_prefix("header:").map(str::trim) {
            _ if part.is_empty() => Err(Failure::new(format!(
                "--key {spec:?} has an empty part; separate the parts with `,`, as in \
                 \"tenant_id, event_id\""
            ))),
            Some("") => Err(Failure::new("--key: `header:` needs a header name")),
            Some(header) => Ok(KeyPart::Header(header.to_owned())),
            None => Ok(KeyPart::Field(part.to_owned())),
        })
        .collect()
}

/// The event id as the handler takes it, if the record has every part.
pub(crate) fn event_id(letter: &DeadLetter, parts: &[KeyPart]) -> Option<String> {
    let values = parts
        .iter()
        .map(|part| part_value(letter, part).filter(|v| !v.is_empty()))
        .collect::<Option<Vec<_>>>()?;
    Some(dedup_core::composite_id(values.iter().map(String::as_str)))
}

pub(crate) fn part_value(letter: &DeadLetter, part: &KeyPart) -> Option<String> {
    let path = match part {
        KeyPart::Header(header) => {
            let value = letter
                .msg
                .headers()?
                .iter()
                .filter(|h| h.key == header)
                .last()?
                .value?;
            return std::str::from_utf8(value).ok().map(str::to_owned);
        }
        KeyPart::Field(path) => path,
    };
    let mut value: serde_json::Value = serde_json::from_slice(letter.msg.payload()?).ok()?;
    for part in path.split('.') {
        value = value.get_mut(part)?.take();
    }
    match value {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Null => None,
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use rdkafka::Timestamp;
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        replay: ReplayArgs,
    }

    fn parts(args: &[&str]) -> Result<Vec<KeyPart>, Failure> {
        let cli = Cli::try_parse_from([&["replay", "t.dlq"][..], args].concat()).expect("parsed");
        key_parts(&cli.replay)
    }

    fn letter(payload: &str, tenant: Option<&str>) -> DeadLetter {
        let mut headers = OwnedHeaders::new();
        if let Some(tenant) = tenant {
            headers = headers.insert(Header {
                key: "tenant",
                value: Some(tenant),
            });
        }
        DeadLetter::parse(OwnedMessage::new(
            Some(payload.as_bytes().to_vec()),
            None,
            "t.dlq".into(),
            Timestamp::NotAvailable,
            0,
            0,
            Some(headers),
        ))
    }

    #[test]
    fn a_composite_key_is_read_as_the_handler_claims_it() {
        let key = parts(&["--key", "header:tenant, meta.event_id"]).unwrap();
        assert_eq!(
            key,
            [
                KeyPart::Header("tenant".into()),
                KeyPart::Field("meta.event_id".into())
            ]
        );
        let body = r#"{"meta":{"event_id":"b,c"}}"#;
        assert_eq!(
            event_id(&letter(body, Some("a")), &key).as_deref(),
            Some(r"a,b\,c")
        );
        assert_eq!(event_id(&letter(body, None), &key), None, "no tenant");
        let empty = r#"{"meta":{"event_id":""}}"#;
        assert_eq!(event_id(&letter(empty, Some("a")), &key), None);

        let one = parts(&["--key-field", "meta.event_id"]).unwrap();
        assert_eq!(event_id(&letter(body, None), &one).as_deref(), Some("b,c"));
        assert_eq!(
            parts(&["--key", "event_id"]).unwrap(),
            [KeyPart::Field("event_id".into())]
        );
        assert!(parts(&["--key", "a,,b"]).is_err());
        assert!(parts(&["--key", "a, header:"]).is_err());
        assert!(parts(&[]).unwrap().is_empty());
    }
}
