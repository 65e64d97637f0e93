//! `dlq replay`: dead letters back to their topics, each original message
//! once, resumable, with a plan first.

use std::collections::{BTreeMap, HashMap, HashSet};

use rdkafka::consumer::{CommitMode, Consumer as _};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;

use crate::claims::Claims;
use crate::failpoint::failpoint;
use crate::kafka::{self, TIMEOUT};
use crate::{Database, Failure, Report};
use dedup_kafka::{DEAD_LETTER_HEADERS, REPLAY_COUNT_HEADER, REPLAYED_FROM_HEADER};

/// Which message a dead letter is a copy of (dedup-kafka reads its headers).
use super::{DeadLetter, Origin, Read, read, select::*};

/// The record a dead letter is replayed as: its key, payload and original
/// headers; dedup's dead-letter headers and any earlier replay's dropped;
/// this replay's added.
pub(crate) fn replay_headers(letter: &DeadLetter) -> OwnedHeaders {
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

    let producer: FutureProducer<dedup_kafka::TokenContext> = kafka::config(&args.kafka)?
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.max.bytes", "1048588")
        .create_with_context(dedup_kafka::TokenContext)
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
pub(crate) fn plan(
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
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A digest of a replay's plan, to tell whether a confirmed replay would
/// do what its dry run showed (the same process computes both).
pub(crate) fn digest(lines: &[String]) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::hash::DefaultHasher::new();
    lines.hash(&mut hasher);
    hasher.finish()
}

/// The options that decide what a replay sends, kept with its committed
/// offsets: a group resumed with other ones would skip records they leave
/// out or send ones they did not.
pub(crate) fn signature(args: &ReplayArgs) -> String {
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
pub(crate) fn default_group(args: &ReplayArgs) -> String {
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
pub(crate) fn target_of<'a>(letter: &'a DeadLetter, args: &'a ReplayArgs) -> Option<&'a str> {
    match (&args.to, &letter.origin) {
        (Some(to), _) => Some(to),
        (None, Some(o)) => Some(&o.topic),
        (None, None) => None,
    }
}

/// The offsets the replay's group committed, by partition.
pub(crate) fn committed_offsets(
    consumer: &kafka::KafkaConsumer,
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
pub(crate) async fn acknowledged(
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
pub(crate) fn commit(
    consumer: &kafka::KafkaConsumer,
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

pub(crate) fn name(decision: Decision) -> &'static str {
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

pub(crate) fn line(letter: &DeadLetter, decision: Decision, target: &str) -> String {
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
    pub(crate) topic: String,
    pub(crate) group: String,
    pub(crate) dry_run: bool,
    pub(crate) counts: BTreeMap<&'static str, usize>,
    pub(crate) lines: Vec<String>,
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
