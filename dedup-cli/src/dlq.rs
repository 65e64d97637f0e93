//! `dedup dlq`: what a dead-letter topic holds, and putting it back.

use std::collections::{BTreeMap, HashMap, HashSet};

use clap::Args;
use dedup_core::Ttl;
use rdkafka::consumer::{CommitMode, Consumer as _};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;

use crate::claims::Claims;
use crate::failpoint::failpoint;
use crate::kafka::{self, TIMEOUT};
use crate::time::rfc3339_millis;
use crate::{Database, Failure, KafkaArgs, Report};
use dedup_kafka::{
    DEAD_LETTER_HEADERS, DeadLetterHeaders, OriginalMessage, REPLAY_COUNT_HEADER,
    REPLAYED_FROM_HEADER,
};

/// Which message a dead letter is a copy of (dedup-kafka reads its headers).
type Origin = OriginalMessage;

/// A dead letter and what its headers say.
pub(crate) struct DeadLetter {
    pub(crate) msg: OwnedMessage,
    pub(crate) origin: Option<Origin>,
    pub(crate) kind: Option<String>,
    pub(crate) handler: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) truncated: bool,
    pub(crate) replays: u32,
    /// Why its dedup headers cannot be read (not UTF-8, not a number,
    /// incomplete), if they cannot.
    pub(crate) malformed: Option<String>,
}

impl DeadLetter {
    /// Reads the dedup headers; a malformed one is noted, not fatal: it
    /// matters only if the record is to be replayed.
    pub(crate) fn parse(msg: OwnedMessage) -> Self {
        // A malformed header leaves what could be read (the kind, the
        // reason) for the eye, never an origin to replay to.
        let (read, malformed) = match DeadLetterHeaders::read(msg.headers()) {
            Ok(read) => (read, None),
            Err(why) => (why.partial().clone(), Some(why.to_string())),
        };
        DeadLetter {
            msg,
            origin: read.origin,
            kind: read.kind,
            handler: read.handler,
            error: read.error,
            truncated: read.truncated,
            replays: read.replays,
            malformed,
        }
    }

    pub(crate) fn at(&self) -> String {
        format!(
            "{}/{}/{}",
            self.msg.topic(),
            self.msg.partition(),
            self.msg.offset()
        )
    }

    pub(crate) fn millis(&self) -> Option<i64> {
        self.msg.timestamp().to_millis()
    }
}

/// A bounded, printable preview of bytes.
pub(crate) fn preview(bytes: Option<&[u8]>, max: usize) -> String {
    let Some(bytes) = bytes else {
        return "(none)".to_owned();
    };
    let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(max)]);
    let mut out: String = shown.chars().flat_map(char::escape_debug).collect();
    if bytes.len() > max {
        out.push_str(&format!("... ({} bytes)", bytes.len()));
    }
    out
}

/// What a read of a dead-letter topic found: its letters, partition by
/// partition in offset order, and where each partition's read ended.
struct Read {
    letters: Vec<DeadLetter>,
    consumer: rdkafka::consumer::BaseConsumer,
    ends: HashMap<i32, i64>,
}

/// Reads every dead letter of `topic` with `group`: to each partition's
/// end as of now, or (`until`) to where an earlier read ended.
fn read(
    kafka: &KafkaArgs,
    topic: &str,
    group: &str,
    until: Option<&HashMap<i32, i64>>,
) -> Result<Read, Failure> {
    let consumer = kafka::consumer(kafka, group)?;
    let (records, ends) = kafka::read_between(&consumer, topic, &HashMap::new(), until)?;
    let letters = records.into_iter().map(DeadLetter::parse).collect();
    Ok(Read {
        letters,
        consumer,
        ends,
    })
}

/// `dlq inspect`.
pub(crate) async fn inspect(
    kafka: &KafkaArgs,
    topic: &str,
    show: usize,
) -> Result<InspectReport, Failure> {
    let (kafka, topic) = (kafka.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let group = format!("dedup-inspect-{}", uuid::Uuid::new_v4().simple());
        let read = read(&kafka, &topic, &group, None)?;
        Ok(InspectReport::new(topic, read.letters, show))
    })
    .await
    .map_err(|e| Failure::new(format!("reading failed: {e}")))?
}

/// `dlq inspect`'s counts.
pub(crate) struct InspectReport {
    topic: String,
    records: usize,
    by_kind: BTreeMap<String, usize>,
    by_origin: BTreeMap<String, usize>,
    by_handler: BTreeMap<String, usize>,
    distinct: usize,
    copies: usize,
    without_headers: usize,
    malformed: usize,
    first: Option<i64>,
    last: Option<i64>,
    shown: Vec<serde_json::Value>,
}

impl InspectReport {
    fn new(topic: String, letters: Vec<DeadLetter>, show: usize) -> Self {
        let mut report = InspectReport {
            topic,
            records: letters.len(),
            by_kind: BTreeMap::new(),
            by_origin: BTreeMap::new(),
            by_handler: BTreeMap::new(),
            distinct: 0,
            copies: 0,
            without_headers: 0,
            malformed: 0,
            first: None,
            last: None,
            shown: Vec::new(),
        };
        let mut seen = HashSet::new();
        let none = || "(none)".to_owned();
        for letter in &letters {
            *report
                .by_kind
                .entry(letter.kind.clone().unwrap_or_else(none))
                .or_default() += 1;
            *report
                .by_handler
                .entry(letter.handler.clone().unwrap_or_else(none))
                .or_default() += 1;
            match &letter.origin {
                Some(origin) => {
                    *report
                        .by_origin
                        .entry(format!("{}/{}", origin.topic, origin.partition))
                        .or_default() += 1;
                    if seen.insert(origin.clone()) {
                        report.distinct += 1;
                    } else {
                        report.copies += 1;
                    }
                }
                None if letter.malformed.is_some() => report.malformed += 1,
                None => report.without_headers += 1,
            }
            if let Some(ms) = letter.millis() {
                report.first = Some(report.first.map_or(ms, |f| f.min(ms)));
                report.last = Some(report.last.map_or(ms, |l| l.max(ms)));
            }
        }
        report.shown = letters.iter().take(show).map(shown).collect();
        report
    }
}

/// One record as `--show` prints it.
fn shown(letter: &DeadLetter) -> serde_json::Value {
    let headers: Vec<_> = letter
        .msg
        .headers()
        .map(|hs| {
            hs.iter()
                .map(|h| json!([h.key, preview(h.value, 200)]))
                .collect()
        })
        .unwrap_or_default();
    json!({
        "at": letter.at(),
        "timestamp": letter.millis().map(rfc3339_millis),
        "kind": letter.kind,
        "error": letter.error,
        "original": letter.origin.as_ref().map(ToString::to_string),
        "malformed": letter.malformed,
        "key": preview(letter.msg.key(), 100),
        "payload": preview(letter.msg.payload(), 200),
        "headers": headers,
    })
}

fn counts(map: &BTreeMap<String, usize>) -> String {
    map.iter()
        .map(|(k, n)| format!("{k}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl Report for InspectReport {
    fn text(&self) -> String {
        let mut out = format!(
            "{}: {} dead letters, {} distinct original messages, {} copies",
            self.topic, self.records, self.distinct, self.copies
        );
        if self.without_headers > 0 {
            out.push_str(&format!(", {} without dedup headers", self.without_headers));
        }
        if self.malformed > 0 {
            out.push_str(&format!(
                ", {} with malformed dedup headers",
                self.malformed
            ));
        }
        out.push('\n');
        if let (Some(first), Some(last)) = (self.first, self.last) {
            out.push_str(&format!(
                "  from {} to {}\n",
                rfc3339_millis(first),
                rfc3339_millis(last)
            ));
        }
        out.push_str(&format!("  by kind:      {}\n", counts(&self.by_kind)));
        out.push_str(&format!("  by original:  {}\n", counts(&self.by_origin)));
        out.push_str(&format!("  by handler:   {}\n", counts(&self.by_handler)));
        for record in &self.shown {
            out.push_str(&format!("\n{:#}\n", record));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "topic": self.topic,
            "records": self.records,
            "distinct": self.distinct,
            "copies": self.copies,
            "without_headers": self.without_headers,
            "malformed": self.malformed,
            "first": self.first.map(rfc3339_millis),
            "last": self.last.map(rfc3339_millis),
            "by_kind": self.by_kind,
            "by_original": self.by_origin,
            "by_handler": self.by_handler,
            "shown": self.shown,
        })
    }
}

/// `dlq replay`'s options.
#[derive(Args)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// The dead-letter topic.
    topic: String,
    /// Produce to this topic instead of each record's
    /// `dedup.original.topic` (partitioned by key).
    #[arg(long)]
    to: Option<String>,
    /// The replay's consumer group on the dead-letter topic: it commits as it
    /// goes, so an interrupted replay resumes (default
    /// `dedup-replay.<topic>`, plus the filters given).
    #[arg(long)]
    group: Option<String>,
    /// Only records of this `dedup.error.kind` (decode, key, handler, store,
    /// panic).
    #[arg(long)]
    kind: Option<String>,
    /// Only records dead-lettered within this long, e.g. `2h`.
    #[arg(long)]
    since: Option<Ttl>,
    /// Only records whose original partition is this one.
    #[arg(long)]
    partition: Option<i32>,
    /// Skip records whose event already holds a live claim (applied through
    /// another copy or path). Needs --scope and --key (or --key-field or
    /// --key-header).
    #[arg(long, requires = "scope")]
    check_claims: bool,
    /// The handler's scope, for --check-claims.
    #[arg(long)]
    scope: Option<String>,
    /// Where the handler takes the event id from, as its
    /// `#[idempotent(key = ..)]` says: fields of the JSON payload and
    /// `header:<name>`, several separated by `,` for a composite key
    /// (`"tenant_id, header:event-id"`).
    #[arg(long, conflicts_with_all = ["key_field", "key_header"])]
    key: Option<String>,
    /// Where the handler takes the event id from: a field of the JSON
    /// payload (`event_id`, `meta.event_id`).
    #[arg(long, conflicts_with = "key_header")]
    key_field: Option<String>,
    /// Where the handler takes the event id from: a header.
    #[arg(long)]
    key_header: Option<String>,
    /// PostgreSQL URL, for --check-claims.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The claims table, for --check-claims.
    #[arg(long, default_value = "dedup_claims")]
    table: String,
    /// Leave out records whose dedup headers are missing or malformed
    /// (reported, and committed past) instead of refusing to replay.
    #[arg(long)]
    skip_invalid: bool,
    /// Print what would be replayed; send and commit nothing.
    #[arg(long)]
    dry_run: bool,
    /// Records produced between two commits of the replay's progress.
    #[arg(long, default_value_t = 100, hide = true)]
    commit_every: usize,
    /// A replay confirmed after its dry run (the console): the dry run's
    /// view, which the replay must find again or send nothing.
    #[arg(skip)]
    pinned: Option<Pinned>,
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
enum Decision {
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
fn key_parts(args: &ReplayArgs) -> Result<Vec<KeyPart>, Failure> {
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

fn part_value(letter: &DeadLetter, part: &KeyPart) -> Option<String> {
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

/// The record a dead letter is replayed as: its key, payload and original
/// headers; dedup's dead-letter headers and any earlier replay's dropped;
/// this replay's added.
fn replay_headers(letter: &DeadLetter) -> OwnedHeaders {
    let mut out = OwnedHeaders::new();
    if let Some(headers) = letter.msg.headers() {
        let dropped = |key: &str| {
            DEAD_LETTER_HEADERS.contains(&key)
                || key == REPLAY_COUNT_HEADER
                || key == REPLAYED_FROM_HEADER
        };
        for h in headers.iter().filter(|h| !dropped(h.key)) {
            out = out.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
    }
    let count = (letter.replays + 1).to_string();
    let from = letter.at();
    out.insert(Header {
        key: REPLAY_COUNT_HEADER,
        value: Some(count.as_bytes()),
    })
    .insert(Header {
        key: REPLAYED_FROM_HEADER,
        value: Some(from.as_bytes()),
    })
}

/// `dlq replay`.
pub(crate) async fn replay(args: &ReplayArgs) -> Result<ReplayReport, Failure> {
    let key_parts = key_parts(args)?;
    if args.check_claims && key_parts.is_empty() {
        return Err(Failure::new(
            "--check-claims needs where the handler takes its event id from: --key as in its \
             #[idempotent(key = ..)] (\"event_id\", \"tenant_id, header:event-id\"), or \
             --key-field (a JSON field) or --key-header",
        ));
    }
    let claims = if args.check_claims {
        let url = args.database_url.clone().ok_or_else(|| {
            Failure::new("--check-claims needs the database: --database-url or DATABASE_URL")
        })?;
        let db = Database {
            database_url: url,
            table: args.table.clone(),
        };
        Some(Claims::connect(&db).await?)
    } else {
        None
    };
    let group = args.group.clone().unwrap_or_else(|| default_group(args));
    let (kafka_args, topic) = (args.kafka.clone(), args.topic.clone());
    let read_group = group.clone();
    let until = args.pinned.as_ref().map(|p| p.ends.clone());
    let (
        Read {
            letters,
            consumer,
            ends,
        },
        committed,
    ) = tokio::task::spawn_blocking(move || {
        let read = read(&kafka_args, &topic, &read_group, until.as_ref())?;
        let committed = committed_offsets(&read.consumer, &topic)?;
        Ok::<_, Failure>((read, committed))
    })
    .await
    .map_err(|e| Failure::new(format!("reading failed: {e}")))??;

    // Everything is checked before anything is sent.
    let signature = signature(args);
    if let Some((p, (_, used))) = committed.iter().find(|(_, (_, used))| *used != signature) {
        return Err(Failure::new(format!(
            "group {group:?} replayed {:?} with other options before (partition {p}: {used:?}; \
             now {signature:?}): run with those, or name another --group. Nothing was sent.",
            args.topic
        )));
    }
    let committed: HashMap<i32, i64> = committed.into_iter().map(|(p, (o, _))| (p, o)).collect();
    // One clock for the plan and for what a confirmation repeats.
    let now = args.pinned.as_ref().map_or_else(now_ms, |p| p.now_ms);
    let mut plan = plan(&letters, &committed, args, now)?;
    if let Some(claims) = &claims {
        for (letter, decision) in letters.iter().zip(plan.iter_mut()) {
            // A reused id's live claim is another event's: it says nothing
            // of whether this one was applied. Without --scope (the
            // console), each letter's own handler's.
            if *decision == Decision::Replay
                && letter.kind.as_deref() != Some("fingerprint_mismatch")
                && let Some(scope) = args
                    .scope
                    .as_deref()
                    .or(letter.handler.as_deref())
                    .filter(|s| !s.is_empty())
                && let Some(id) = event_id(letter, &key_parts)
                && claims.is_live(&Claims::key(scope, &id)?).await?
            {
                *decision = Decision::Applied;
            }
        }
    }

    let producer: FutureProducer = kafka::config(&args.kafka)?
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.max.bytes", "1048588")
        .create()
        .map_err(|e| kafka::refused("producer", &e))?;
    // Every target exists before anything is sent; its partition count
    // says whether the original partition can be kept.
    let mut targets: HashMap<String, usize> = HashMap::new();
    for (letter, decision) in letters.iter().zip(&plan) {
        if *decision != Decision::Replay {
            continue;
        }
        let target = target_of(letter, args).expect("planned with a target");
        if !targets.contains_key(target) {
            let count = kafka::partitions(&consumer, target)?.len();
            targets.insert(target.to_owned(), count);
        }
    }

    let mut report = ReplayReport {
        topic: args.topic.clone(),
        group,
        dry_run: args.dry_run,
        counts: BTreeMap::new(),
        lines: Vec::new(),
        pinned: Pinned {
            ends,
            now_ms: now,
            plan: 0,
        },
    };
    for (letter, decision) in letters.iter().zip(&plan) {
        *report.counts.entry(name(*decision)).or_default() += 1;
        if *decision != Decision::Done {
            report.lines.push(line(
                letter,
                *decision,
                target_of(letter, args).unwrap_or("?"),
            ));
        }
    }
    report.pinned.plan = digest(&report.lines);
    if let Some(pinned) = &args.pinned
        && *pinned != report.pinned
    {
        return Err(Failure::new(
            "the dead letters or their claims changed since the dry run (another replay ran, \
             or a claim was taken): nothing was sent; run the dry run again",
        ));
    }
    if args.dry_run {
        return Ok(report);
    }

    let to_send = plan.iter().filter(|d| **d == Decision::Replay).count();
    let bar = indicatif::ProgressBar::new(to_send as u64);
    let mut pending = Vec::new();
    let mut progress: HashMap<i32, i64> = HashMap::new();
    for (letter, decision) in letters.iter().zip(&plan) {
        if *decision == Decision::Done {
            continue;
        }
        if *decision == Decision::Replay {
            let target = target_of(letter, args).expect("planned with a target");
            let partition = match (&args.to, &letter.origin) {
                (None, Some(o)) if (o.partition as usize) < targets[target] => Some(o.partition),
                _ => None,
            };
            let mut record = FutureRecord::<[u8], [u8]>::to(target).headers(replay_headers(letter));
            if let Some(key) = letter.msg.key() {
                record = record.key(key);
            }
            if let Some(payload) = letter.msg.payload() {
                record = record.payload(payload);
            }
            if let Some(p) = partition {
                record = record.partition(p);
            }
            let delivery = producer
                .send_result(record)
                .map_err(|(e, _)| Failure::new(format!("producing to {target}: {e}")))?;
            pending.push(delivery);
        }
        progress.insert(letter.msg.partition(), letter.msg.offset() + 1);
        if pending.len() >= args.commit_every.max(1) {
            acknowledged(&mut pending, &bar).await?;
            failpoint("replay-before-commit");
            commit(&consumer, &args.topic, &progress, &signature)?;
        }
    }
    acknowledged(&mut pending, &bar).await?;
    commit(&consumer, &args.topic, &progress, &signature)?;
    bar.finish_and_clear();
    Ok(report)
}

/// What the dead letters above the group's committed offsets become, before
/// claims are checked: every record that cannot be replayed is an error
/// (nothing is sent) unless `--skip-invalid`; among the copies of one
/// original message, the first whole one is replayed.
fn plan(
    letters: &[DeadLetter],
    committed: &HashMap<i32, i64>,
    args: &ReplayArgs,
    now_ms: i64,
) -> Result<Vec<Decision>, Failure> {
    let filtered = |letter: &DeadLetter| {
        args.kind
            .as_ref()
            .is_some_and(|k| letter.kind.as_ref() != Some(k))
            || args
                .partition
                .is_some_and(|p| letter.origin.as_ref().map(|o| o.partition) != Some(p))
            || args.since.is_some_and(|since| {
                letter
                    .millis()
                    .is_none_or(|ms| now_ms - ms > since.as_duration().as_millis() as i64)
            })
    };
    let mut plan = Vec::with_capacity(letters.len());
    for letter in letters {
        let done = committed
            .get(&letter.msg.partition())
            .is_some_and(|&c| letter.msg.offset() < c);
        let unplaceable = match (&letter.malformed, &letter.origin, &args.to) {
            (Some(why), _, _) => Some(why.clone()),
            (None, None, None) => Some(
                "it has no dedup.original.* headers, so its topic is unknown (is this a \
                 dead-letter topic of dedup? --to names a target)"
                    .to_owned(),
            ),
            _ => None,
        };
        plan.push(match unplaceable {
            _ if done => Decision::Done,
            Some(_) if args.skip_invalid => Decision::Invalid,
            Some(why) => {
                return Err(Failure::new(format!(
                    "record {}: {why}. Pass --skip-invalid to leave such records out (they are \
                     reported and committed past). Nothing was sent.",
                    letter.at()
                )));
            }
            None if filtered(letter) => Decision::Filtered,
            None if letter.truncated => Decision::Truncated,
            None => Decision::Replay,
        });
    }
    // One replay per original message: the first whole copy (an earlier
    // run's counts, if it replayed one), every other one a copy.
    let mut chosen: HashMap<&Origin, bool> = HashMap::new();
    for (letter, decision) in letters.iter().zip(&plan) {
        if let Some(origin) = &letter.origin
            && !letter.truncated
            && (*decision == Decision::Replay
                || (*decision == Decision::Done && letter.malformed.is_none() && !filtered(letter)))
        {
            // Any copy replayed by an earlier run counts, wherever it is read.
            *chosen.entry(origin).or_default() |= *decision == Decision::Done;
        }
    }
    let mut replayed = HashSet::new();
    for (letter, decision) in letters.iter().zip(plan.iter_mut()) {
        let Some(origin) = &letter.origin else {
            continue;
        };
        if !matches!(*decision, Decision::Replay | Decision::Truncated) {
            continue;
        }
        let earlier_run = chosen.get(origin) == Some(&true);
        if earlier_run || replayed.contains(origin) {
            *decision = Decision::Copy;
        } else if *decision == Decision::Truncated && chosen.contains_key(origin) {
            // A whole copy comes later: that one is replayed.
            *decision = Decision::Copy;
        } else {
            replayed.insert(origin);
        }
    }
    Ok(plan)
}

/// The wall clock in milliseconds since the Unix epoch.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A digest of a replay's plan, to tell whether a confirmed replay would
/// do what its dry run showed (the same process computes both).
fn digest(lines: &[String]) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::hash::DefaultHasher::new();
    lines.hash(&mut hasher);
    hasher.finish()
}

/// The options that decide what a replay sends, kept with its committed
/// offsets: a group resumed with other ones would skip records they leave
/// out or send ones they did not.
fn signature(args: &ReplayArgs) -> String {
    format!(
        "dedup-replay/1 kind={} partition={} since={} to={}",
        args.kind.as_deref().unwrap_or("*"),
        args.partition
            .map_or_else(|| "*".to_owned(), |p| p.to_string()),
        args.since.map_or_else(|| "*".to_owned(), |s| s.to_string()),
        args.to.as_deref().unwrap_or("*"),
    )
}

/// The replay's group: one per dead-letter topic and set of filters, since
/// a filtered replay commits past the records it leaves out. (The same
/// record replayed under two filter sets is sent twice; the consumer skips
/// the second within the TTL.)
fn default_group(args: &ReplayArgs) -> String {
    let mut group = format!("dedup-replay.{}", args.topic);
    if let Some(kind) = &args.kind {
        group.push_str(&format!(".kind-{kind}"));
    }
    if let Some(p) = args.partition {
        group.push_str(&format!(".partition-{p}"));
    }
    if let Some(since) = args.since {
        group.push_str(&format!(".since-{since}"));
    }
    group
}

/// Where a dead letter is replayed to (`None` for an invalid one).
fn target_of<'a>(letter: &'a DeadLetter, args: &'a ReplayArgs) -> Option<&'a str> {
    match (&args.to, &letter.origin) {
        (Some(to), _) => Some(to),
        (None, Some(o)) => Some(&o.topic),
        (None, None) => None,
    }
}

/// The offsets the replay's group committed, by partition.
pub(crate) fn committed_offsets(
    consumer: &rdkafka::consumer::BaseConsumer,
    topic: &str,
) -> Result<HashMap<i32, (i64, String)>, Failure> {
    let mut tpl = TopicPartitionList::new();
    for p in kafka::partitions(consumer, topic)? {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, TIMEOUT)
        .map_err(|e| Failure::new(format!("reading the group's committed offsets: {e}")))?;
    Ok(committed
        .elements_for_topic(topic)
        .into_iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), (o, e.metadata().to_owned()))),
            _ => None,
        })
        .collect())
}

/// Waits for every record sent to be acknowledged.
async fn acknowledged(
    pending: &mut Vec<rdkafka::producer::DeliveryFuture>,
    bar: &indicatif::ProgressBar,
) -> Result<(), Failure> {
    for delivery in pending.drain(..) {
        delivery
            .await
            .map_err(|_| Failure::new("the producer was closed before acknowledging"))?
            .map_err(|(e, _)| {
                Failure::new(format!(
                    "the broker refused a replayed record ({e}); run the replay again: it \
                     resumes after the last commit"
                ))
            })?;
        bar.inc(1);
    }
    Ok(())
}

/// Commits the replay's progress on the dead-letter topic.
fn commit(
    consumer: &rdkafka::consumer::BaseConsumer,
    topic: &str,
    progress: &HashMap<i32, i64>,
    signature: &str,
) -> Result<(), Failure> {
    if progress.is_empty() {
        return Ok(());
    }
    let mut tpl = TopicPartitionList::new();
    for (&p, &next) in progress {
        tpl.add_partition_offset(topic, p, Offset::Offset(next))
            .map_err(|e| Failure::new(e.to_string()))?;
        if let Some(mut elem) = tpl.find_partition(topic, p) {
            elem.set_metadata(signature);
        }
    }
    consumer.commit(&tpl, CommitMode::Sync).map_err(|e| {
        Failure::new(format!(
            "committing the replay's progress failed ({e}); what was sent is applied once \
             (the consumer skips duplicates within the TTL): run the replay again"
        ))
    })
}

fn name(decision: Decision) -> &'static str {
    match decision {
        Decision::Done => "already_replayed",
        Decision::Replay => "replayed",
        Decision::Copy => "skipped_copies",
        Decision::Applied => "skipped_applied",
        Decision::Filtered => "skipped_filtered",
        Decision::Truncated => "skipped_truncated",
        Decision::Invalid => "skipped_invalid",
    }
}

fn line(letter: &DeadLetter, decision: Decision, target: &str) -> String {
    let original = letter
        .origin
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_else(|| "?".to_owned());
    match decision {
        Decision::Replay => format!("{} -> {target} (original {original})", letter.at()),
        Decision::Truncated => format!(
            "{}: payload cut in the dead letter; not replayed (the original is at {original})",
            letter.at()
        ),
        Decision::Invalid => format!(
            "{}: {}; left out",
            letter.at(),
            letter
                .malformed
                .as_deref()
                .unwrap_or("no dedup.original.* headers")
        ),
        other => format!("{}: {} (original {original})", letter.at(), name(other)),
    }
}

/// `dlq replay`'s summary.
pub(crate) struct ReplayReport {
    topic: String,
    group: String,
    dry_run: bool,
    counts: BTreeMap<&'static str, usize>,
    lines: Vec<String>,
    /// What this run saw, for a replay confirmed after it.
    pub(crate) pinned: Pinned,
}

impl ReplayReport {
    fn count(&self, decision: Decision) -> usize {
        self.counts.get(name(decision)).copied().unwrap_or(0)
    }
}

impl Report for ReplayReport {
    fn text(&self) -> String {
        let mut out = String::new();
        if self.dry_run {
            out.push_str("dry run: nothing sent, nothing committed\n");
            for line in &self.lines {
                out.push_str(&format!("  {line}\n"));
            }
        }
        let verb = if self.dry_run {
            "would_replay"
        } else {
            "replayed"
        };
        out.push_str(&format!(
            "{verb}={} skipped_applied={} skipped_copies={} skipped_filtered={} \
             skipped_truncated={} skipped_invalid={} already_replayed={}\n",
            self.count(Decision::Replay),
            self.count(Decision::Applied),
            self.count(Decision::Copy),
            self.count(Decision::Filtered),
            self.count(Decision::Truncated),
            self.count(Decision::Invalid),
            self.count(Decision::Done),
        ));
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "topic": self.topic,
            "group": self.group,
            "dry_run": self.dry_run,
            "replayed": if self.dry_run { 0 } else { self.count(Decision::Replay) },
            "would_replay": self.count(Decision::Replay),
            "skipped_applied": self.count(Decision::Applied),
            "skipped_copies": self.count(Decision::Copy),
            "skipped_filtered": self.count(Decision::Filtered),
            "skipped_truncated": self.count(Decision::Truncated),
            "skipped_invalid": self.count(Decision::Invalid),
            "already_replayed": self.count(Decision::Done),
            "records": self.lines,
        })
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
