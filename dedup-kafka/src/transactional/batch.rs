//! A batch: its transactions (one, or several when records go one at a
//! time), the sweep of expired claims, and its rewind after an abort.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::time::Instant;

use dedup_core::Handler;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;

use super::outputs::Outputs;

use super::TransactionalConsumer;
use super::busy::Busy;
use super::changelog;
use super::claims::{self, PartitionClaims, Sweep};
use super::fate::{Fate, Halt, Staged, independent_of, now_ms};
use super::lanes::{Lane, Membership, Topics};
use super::transact::Attempt;
use crate::Error;
use crate::dead_letter_format;
use crate::metrics::RetryReason;
use crate::retry::Jitter;

/// What a batch runs with: the consumer, the stop signal, and what it
/// shares with the run loop while it runs.
#[derive(Clone, Copy)]
pub(super) struct With<'a> {
    pub(super) consumer: &'a StreamConsumer<Membership>,
    pub(super) stopping: &'a watch::Receiver<bool>,
    pub(super) busy: &'a Busy,
}

/// What became of the messages a batch's transaction was given.
pub(super) enum Processed {
    /// The first `taken` committed; the rest, with the fates judged for
    /// them, go in the next transaction.
    Committed { taken: usize, rest: Piece },
    /// None committed: the batch was dropped (rewound to its first
    /// offsets), or the consumer stops.
    Dropped,
}

/// What is left of a batch after an earlier transaction of it: the fates
/// judged for its messages, by index in what is left (no handler runs
/// twice), and the wall clock the batch's stream times are capped by (read
/// once for the batch, so every transaction of it judges at the same times).
pub(super) struct Piece {
    fates: HashMap<usize, Fate>,
    wall: i64,
}

/// Most records one transaction sends one at a time (to find the one a
/// broker refuses): each waits for its acknowledgement, so a few thousand
/// would outlast the transaction's timeout.
pub(super) const ALONE_PER_TRANSACTION: usize = 200;

/// Most tombstones one transaction writes per partition.
pub(super) const MAX_TOMBSTONES: usize = 10_000;

/// Aborted transactions of a batch retried before its partitions are
/// rewound.
pub(super) const IN_PLACE_RETRIES: u32 = 3;

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    /// Runs one batch in as few transactions as it takes (one, unless
    /// records go one at a time: see [`split_at`](Self::split_at)).
    pub(super) async fn run_batch(
        &self,
        with: &With<'_>,
        states: &mut HashMap<i32, PartitionClaims>,
        batch: &[OwnedMessage],
        jitter: &mut Jitter,
        isolate: &mut BTreeSet<String>,
    ) -> Result<(), Error> {
        let mut rest = batch;
        let mut piece = Piece {
            fates: HashMap::new(),
            wall: now_ms(),
        };
        while !rest.is_empty() {
            match self
                .process(with, states, rest, jitter, piece, isolate)
                .await?
            {
                Processed::Committed { taken, rest: left } => {
                    rest = &rest[taken..];
                    piece = left;
                    // No transaction is open: the group sees the member
                    // before the next piece (after the last one, the batch
                    // is over and the run loop polls next anyway: a poll
                    // here would pause partitions for nothing).
                    with.busy.open();
                    if !rest.is_empty() {
                        self.stats.polled();
                        with.busy.poll(with.consumer).await;
                    }
                }
                Processed::Dropped => return Ok(()),
            }
        }
        isolate.clear();
        Ok(())
    }

    /// Runs one transaction of a batch (`batch` is what is left of it):
    /// each message's fate, then one transaction with everything the
    /// messages it takes produce and their offsets. A drop (a rewind, a
    /// rebalance) takes all of `batch` back.
    pub(super) async fn process(
        &self,
        with: &With<'_>,
        states: &mut HashMap<i32, PartitionClaims>,
        batch: &[OwnedMessage],
        jitter: &mut Jitter,
        piece: Piece,
        isolate: &mut BTreeSet<String>,
    ) -> Result<Processed, Error> {
        let With { consumer, busy, .. } = *with;
        // One transaction's attempt, for dedup_handler_duration_seconds:
        // its handlers and its transaction.
        let started = Instant::now();
        let mut first: BTreeMap<Lane, i64> = BTreeMap::new();
        for msg in batch {
            let f = first.entry(self.topics.lane(msg)).or_insert(msg.offset());
            *f = (*f).min(msg.offset());
        }
        // Fates that a refused record decided, or that the batch's earlier
        // transaction judged; the others are judged again around them (a
        // later duplicate of a refused event is not one).
        let mut forced: HashMap<usize, Fate> = HashMap::new();
        // Fates judged before (by the batch's earlier transaction, or before
        // a refusal): kept unless a refusal changed the claim they relied on.
        let Piece {
            fates: mut reused,
            wall,
        } = piece;
        // Each message's stream time, from its partition's committed one
        // (a later transaction of the batch starts where the earlier ended).
        let times = claims::stream_times(
            batch.iter().map(|m| (m.partition(), self.stream_stamp(m))),
            |p| states.get(&p).map_or(0, |s| s.stream_time),
            wall,
        );
        let times = &times[..];
        // Aborted transactions retried with the batch in hand (what the
        // refusals decided kept): a producer recovering from an aborted
        // transaction (an epoch bump) fails the first records of the next.
        let mut in_place = 0u32;
        let mut sweeps: BTreeMap<i32, (i64, bool)> = BTreeMap::new();
        // The fates under the current `forced`: judged again only when a
        // refusal changes it (retried transactions reuse them).
        let mut judged: Option<(Vec<Fate>, Staged)> = None;
        let (fates, claimed, tombstones, newest, rest) = loop {
            busy.open();
            if judged.is_none() {
                let mut given = reused.clone();
                given.extend(forced.clone());
                let judging = Instant::now();
                let result = self.fates(batch, times, states, &given, jitter, with).await;
                tracing::debug!(
                    messages = batch.len(),
                    judge_ms = super::transact::ms(judging.elapsed()),
                    "batch judged"
                );
                judged = match result {
                    Ok(judged) => Some(judged),
                    Err(Halt::Fatal(e)) => return Err(e),
                    // Nothing of the batch was sent: it runs again from the
                    // committed offsets after the restart.
                    Err(Halt::Stopped) => {
                        tracing::info!(
                            "stopping while a message waits to be retried; its batch is left uncommitted"
                        );
                        return Ok(Processed::Dropped);
                    }
                    Err(Halt::Rebalanced) => {
                        busy.close();
                        tracing::info!(
                            "the group rebalanced while a message waited to be retried: the batch is dropped and runs again from its first offsets"
                        );
                        busy.rewind(consumer, &first)?;
                        return Ok(Processed::Dropped);
                    }
                };
            }
            let (all, staged) = judged.as_ref().expect("judged above");
            // The messages this transaction takes: all, unless records go
            // one at a time (then as many as fit in its timeout).
            let take = self.split_at(all, isolate).unwrap_or(all.len());
            let fates = &all[..take];
            // Each partition's stream time after the messages taken,
            // committed with its offset.
            let mut newest: BTreeMap<i32, i64> = BTreeMap::new();
            for (msg, &at) in batch[..take].iter().zip(times) {
                let n = newest.entry(msg.partition()).or_insert(at);
                *n = (*n).max(at);
            }
            let offsets = next_offsets(&self.topics, &batch[..take], &newest)?;
            let mut tombstones: BTreeMap<i32, Sweep> = BTreeMap::new();
            // Per partition of the batch: the sweep's stream time, and
            // whether it takes all it found (at most MAX_TOMBSTONES
            // tombstones per transaction, of records and of format-1
            // claims together; the rest in the next batches).
            sweeps.clear();
            // Tombstones sent one at a time count against the transaction's
            // timeout too.
            let most = if isolate.contains(&self.changelog) {
                ALONE_PER_TRANSACTION
            } else {
                MAX_TOMBSTONES
            };
            for (&p, state) in states.iter() {
                if !first.keys().any(|lane| lane.partition == p) {
                    continue;
                }
                let now = sweep_time(
                    state
                        .stream_time
                        .max(newest.get(&p).copied().unwrap_or(i64::MIN)),
                );
                let (sweep, whole) = state.sweep(now, |d| staged.contains_key(&(p, *d)), most);
                sweeps.insert(p, (now, whole));
                if !sweep.expired.is_empty() || !sweep.tombstones.is_empty() {
                    tombstones.insert(p, sweep);
                }
            }
            // The claims the transaction takes, a record per partition.
            let claimed = changelog::records(
                batch[..take]
                    .iter()
                    .zip(fates)
                    .filter_map(|(msg, fate)| match fate {
                        Fate::Applied {
                            digest, entry, key, ..
                        } => Some((msg.partition(), digest, entry, key)),
                        _ => None,
                    }),
                &self.record_keys,
            );
            busy.close();
            if busy.rebalanced(consumer.context()) {
                tracing::info!(
                    "the group rebalanced while the batch ran: it is dropped before its transaction and runs again from its first offsets"
                );
                busy.rewind(consumer, &first)?;
                return Ok(Processed::Dropped);
            }
            match self
                .transact(
                    with,
                    batch,
                    fates,
                    (&claimed, &tombstones),
                    &offsets,
                    isolate,
                )
                .await?
            {
                Attempt::Committed => {
                    consumer.context().committed(&offsets);
                    let (mut fates, _) = judged.take().expect("judged above");
                    let rest = fates.split_off(take);
                    break (fates, claimed, tombstones, newest, rest);
                }
                Attempt::Refused(i, fate) => {
                    let (all, _) = judged.take().expect("judged above");
                    reused = independent_of(batch, all, i);
                    forced.insert(i, fate);
                }
                Attempt::Ambiguous(topic) => {
                    isolate.insert(topic);
                }
                Attempt::Rewind {
                    why,
                    unwritable,
                    lost,
                } => {
                    if lost || in_place >= IN_PLACE_RETRIES {
                        self.rewind(consumer, busy, &first, &why, unwritable, jitter)
                            .await?;
                        return Ok(Processed::Dropped);
                    }
                    in_place += 1;
                    self.record().retried_because(RetryReason::Environment);
                    let wait = self.pipeline.retry.backoff(in_place, jitter.next());
                    tracing::warn!(why, ?wait, "transaction aborted; running the batch again");
                    busy.open();
                    tokio::time::sleep(wait).await;
                }
            }
        };
        *self
            .unwritable_since
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        self.rewinds.store(0, Ordering::Relaxed);
        // Committed: what the partitions now hold, and what became of each
        // message.
        let record = self.record();
        record.metrics.attempt(started.elapsed());
        record.metrics.batch(fates.len());
        for (msg, fate) in batch.iter().zip(fates) {
            match fate {
                Fate::Applied {
                    digest,
                    entry,
                    reclaimed,
                    ..
                } => {
                    record.applied(reclaimed);
                    if let Some(state) = states.get_mut(&msg.partition()) {
                        state.put(digest, entry);
                    }
                }
                Fate::Skipped { mismatch: true, .. } => record.fingerprint_mismatch(true),
                Fate::Skipped { age, .. } => record.skipped(age),
                Fate::Moved { tier, .. } => record.moved(&self.tier(tier).name),
                Fate::Dead { kind, .. } => {
                    if kind == "fingerprint_mismatch" {
                        record.fingerprint_mismatch(false);
                    }
                    record.dead_lettered();
                }
            }
        }
        for (&p, state) in states.iter_mut() {
            if let Some(&at) = newest.get(&p) {
                state.advance(at);
            }
            if let Some(&(now, true)) = sweeps.get(&p) {
                state.swept(now, self.sweep_every());
            }
        }
        for record in claimed {
            if let Some(state) = states.get_mut(&record.partition) {
                state.recorded(record.key, record.expires_at);
            }
        }
        for (p, sweep) in tombstones {
            if let Some(state) = states.get_mut(&p) {
                state.swept_away(sweep);
            }
        }
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        Ok(Processed::Committed {
            taken: batch.len() - rest.len(),
            rest: Piece {
                fates: rest.into_iter().enumerate().collect(),
                wall,
            },
        })
    }

    /// How many of the batch's first messages one transaction takes while
    /// records to `isolate` topics go one at a time (each waits for its
    /// acknowledgement): as many as send at most [`ALONE_PER_TRANSACTION`]
    /// such records, at least one message, so the transaction ends within
    /// its timeout. `None`: all of them.
    pub(super) fn split_at(&self, fates: &[Fate], isolate: &BTreeSet<String>) -> Option<usize> {
        if isolate.is_empty() {
            return None;
        }
        let changelog = usize::from(isolate.contains(&self.changelog));
        let mut alone = 0;
        for (i, fate) in fates.iter().enumerate() {
            alone += match fate {
                Fate::Applied { outputs, .. } => {
                    outputs
                        .iter()
                        .filter(|o| isolate.contains(&o.topic))
                        .count()
                        + changelog
                }
                Fate::Dead { .. } => usize::from(isolate.contains(&self.dead_letter_topic)),
                Fate::Moved { tier, .. } => usize::from(isolate.contains(&self.tier(*tier).topic)),
                Fate::Skipped { .. } => 0,
            };
            if alone > ALONE_PER_TRANSACTION && i > 0 {
                return Some(i);
            }
        }
        None
    }

    /// Stream time between sweeps for expired claims: a tenth of the TTL,
    /// at least a second.
    pub(super) fn sweep_every(&self) -> i64 {
        (self.handler.ttl().as_duration().as_millis() as i64 / 10).max(1_000)
    }

    /// After an aborted transaction: the batch's partitions go back to their
    /// first offsets, so the batch runs again (or its partitions' next owner
    /// runs it). A partition still assigned that cannot be rewound stops the
    /// consumer: going on would commit past the batch.
    pub(super) async fn rewind(
        &self,
        consumer: &StreamConsumer<Membership>,
        busy: &Busy,
        first: &BTreeMap<Lane, i64>,
        why: &str,
        unwritable: bool,
        jitter: &mut Jitter,
    ) -> Result<(), Error> {
        let failures = self.rewinds.fetch_add(1, Ordering::Relaxed) + 1;
        self.record().retried_because(RetryReason::Environment);
        if unwritable {
            let since = *self
                .unwritable_since
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(Instant::now);
            if since.elapsed() >= dead_letter_format::UNWRITABLE_FOR && failures >= 3 {
                return Err(Error::Fatal(format!(
                    "a topic of the transaction cannot be written ({why}) for {:?}: create it or \
                     grant the producer's principal Write on it",
                    since.elapsed()
                )));
            }
        }
        let wait = self.pipeline.retry.outage_backoff(failures, jitter.next());
        tracing::warn!(
            why,
            ?wait,
            "transaction aborted; the batch runs again from its first offsets"
        );
        busy.rewind(consumer, first)?;
        busy.open();
        tokio::time::sleep(wait).await;
        Ok(())
    }
}

/// The offsets to commit after `messages`: each partition's next (of the
/// input or a retry tier), with its stream time (`stream_times`, shared by
/// a partition of the input and the same of its tiers) in the offset's
/// metadata.
pub(super) fn next_offsets(
    topics: &Topics,
    messages: &[OwnedMessage],
    stream_times: &BTreeMap<i32, i64>,
) -> Result<TopicPartitionList, Error> {
    let mut next: BTreeMap<Lane, i64> = BTreeMap::new();
    for msg in messages {
        let n = next.entry(topics.lane(msg)).or_insert(msg.offset() + 1);
        *n = (*n).max(msg.offset() + 1);
    }
    let mut offsets = TopicPartitionList::new();
    for (lane, o) in next {
        let mut elem = offsets.add_partition(topics.name(lane), lane.partition);
        elem.set_offset(Offset::Offset(o))?;
        if let Some(&at) = stream_times.get(&lane.partition) {
            elem.set_metadata(claims::stream_time_metadata(at));
        }
    }
    Ok(offsets)
}

/// The stream time up to which claims may be tombstoned: never past the
/// wall clock, so a record stamped in the future cannot expire the claims
/// of everything before it.
pub(super) fn sweep_time(stream_time: i64) -> i64 {
    stream_time.min(now_ms())
}
