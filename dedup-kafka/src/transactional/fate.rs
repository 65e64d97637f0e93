//! Each message's fate: decoded, keyed, judged against the claims, and run
//! (contained, with retries) into its outputs.
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;

use dedup_core::{DedupKey, DescribeExt as _, Handler};
use rdkafka::message::{Message as _, OwnedMessage};

use super::outputs::{OutputRecord, Outputs};

use super::TransactionalConsumer;
use super::batch::With;
use super::claims::{self, ClaimDigest, Entry, PartitionClaims};
use crate::Error;
use crate::config::OnFingerprintMismatch;
use crate::pipeline::attempt;
use crate::pipeline::attempts::{Attempts, Next, Tried};
use crate::pipeline::keyed::{Keys, OrderKey, Window};
use crate::pipeline::{error_chain, meta_of};
use crate::retry::Jitter;

/// The claims a batch takes, by partition and digest, on top of the
/// partitions' committed ones.
pub(super) type Staged = HashMap<(i32, ClaimDigest), Entry>;

/// What became of one message of a batch.
#[derive(Clone)]
pub(super) enum Fate {
    Applied {
        outputs: Vec<OutputRecord>,
        digest: ClaimDigest,
        entry: Entry,
        key: DedupKey,
        /// It took over an expired claim of its key.
        reclaimed: bool,
    },
    /// A duplicate of the claim `digest` (the batch's or a committed one),
    /// `age` after it in stream time; `mismatch` if its fingerprint differs
    /// from the claim's (skipped as `on_fingerprint_mismatch(Skip)` says).
    Skipped {
        digest: ClaimDigest,
        age: Duration,
        mismatch: bool,
    },
    Dead {
        kind: &'static str,
        message: String,
        attempts: u32,
        /// How much of the payload to keep (`None`: all), once the broker
        /// refused the whole.
        keep: Option<usize>,
    },
    /// Failing transiently after its `attempts` here: sent on to retry
    /// tier `tier` (its index among the tiers), due at `due_ms`, in the
    /// batch's transaction with its offset.
    Moved {
        tier: usize,
        kind: &'static str,
        message: String,
        attempts: u32,
        due_ms: i64,
    },
}

/// Longest a batch is judged without yielding. A handler that never waits
/// runs on the consumer's task ([`attempt::Start::HereFirst`]), and the run
/// loop's polls while a batch runs (the group, liveness, the stop) get a
/// turn only when the batch yields.
const YIELD_EVERY: Duration = Duration::from_millis(20);

/// When the judging last yielded.
struct Turns(Instant);

impl Turns {
    fn new() -> Self {
        Self(Instant::now())
    }

    /// Yields once [`YIELD_EVERY`] has passed since the last time.
    async fn now_and_then(&mut self) {
        if self.0.elapsed() >= YIELD_EVERY {
            tokio::task::yield_now().await;
            self.0 = Instant::now();
        }
    }
}

/// What a message is judged in order with under key-ordered concurrency:
/// its ordering key and its claim, each in its partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum OrderedBy {
    Key(i32, OrderKey),
    Claim(i32, ClaimDigest),
}

/// The claim a message is ordered by, if any.
fn claim_of(keys: Keys<OrderedBy>) -> Option<ClaimDigest> {
    keys.iter().find_map(|k| match k {
        OrderedBy::Claim(_, digest) => Some(digest),
        OrderedBy::Key(..) => None,
    })
}

/// A message decoded and keyed, for [`TransactionalConsumer::judge`].
pub(super) struct Prepared<E> {
    key: DedupKey,
    pub(super) digest: ClaimDigest,
    fingerprint: Option<dedup_core::Fingerprint>,
    event: E,
    headers: dedup_core::Meta,
}

/// Why a batch's judging ended before its transaction.
pub(super) enum Halt {
    /// The consumer cannot go on.
    Fatal(Error),
    /// The consumer stops: the batch is left uncommitted.
    Stopped,
    /// The group rebalanced: the batch is dropped and runs again.
    Rebalanced,
}

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    /// Each message's fate, in order, and the claims they take: `forced`
    /// fates stand, the rest are judged around them, each at its stream
    /// time (`times`, one per message).
    pub(super) async fn fates(
        &self,
        batch: &[OwnedMessage],
        times: &[i64],
        states: &HashMap<i32, PartitionClaims>,
        forced: &HashMap<usize, Fate>,
        jitter: &mut Jitter,
        with: &With<'_>,
    ) -> Result<(Vec<Fate>, Staged), Halt> {
        self.ready(batch, forced, jitter, with).await?;
        if self.pipeline.key_concurrency > 1 {
            return self.fates_at_once(batch, times, states, forced, with).await;
        }
        let mut fates = Vec::with_capacity(batch.len());
        // Claims taken in this batch, on top of the partitions' committed ones.
        let mut staged = Staged::new();
        let mut turns = Turns::new();
        for (i, (msg, &at)) in batch.iter().zip(times).enumerate() {
            turns.now_and_then().await;
            let fate = match forced.get(&i) {
                Some(fate) => fate.clone(),
                None => {
                    let fate = self.fate(msg, at, states, &staged, jitter, with);
                    self.in_span(msg, fate).await?
                }
            };
            if let Fate::Applied { digest, entry, .. } = &fate {
                staged.insert((msg.partition(), *digest), *entry);
            }
            fates.push(fate);
        }
        Ok((fates, staged))
    }

    /// `judging` in `msg`'s own span (feature `opentelemetry`), so its
    /// attempts' outputs carry its trace on.
    fn in_span<F: std::future::Future>(
        &self,
        msg: &OwnedMessage,
        judging: F,
    ) -> impl std::future::Future<Output = F::Output> {
        #[cfg(feature = "opentelemetry")]
        let judging = opentelemetry::context::FutureExt::with_context(
            judging,
            crate::otel::process(
                msg,
                self.consumer_config.get("group.id").unwrap_or_default(),
            ),
        );
        #[cfg(not(feature = "opentelemetry"))]
        let _ = msg;
        judging
    }

    /// [`fates`](Self::fates) under key-ordered concurrency: up to
    /// `key_concurrency` messages judged at once. A message waits while an
    /// earlier one of its ordering key (in its partition) or of its claim
    /// (its event id) is not judged yet, so each key's run in offset order
    /// and a claim's duplicates are judged after it, against the claim it
    /// staged, as one after another would. Messages whose fate needs no
    /// handler (forced, or undecodable) wait for nothing and hold nothing.
    async fn fates_at_once(
        &self,
        batch: &[OwnedMessage],
        times: &[i64],
        states: &HashMap<i32, PartitionClaims>,
        forced: &HashMap<usize, Fate>,
        with: &With<'_>,
    ) -> Result<(Vec<Fate>, Staged), Halt> {
        let n = batch.len();
        let mut fates: Vec<Option<Fate>> = vec![None; n];
        // The messages to judge, each waiting for the earlier ones of its
        // key and its claim: the database runtime's window, over the batch.
        let mut window = Window::default();
        // What each message is ordered by, until it is judged.
        let mut order: Vec<Keys<OrderedBy>> = Vec::with_capacity(n);
        // The claims applied, by claim and index: a message sees the
        // latest one before it, as when judged one after another.
        let mut applied: HashMap<(i32, ClaimDigest), BTreeMap<usize, Entry>> = HashMap::new();
        for (i, msg) in batch.iter().enumerate() {
            let p = msg.partition();
            let key = self.order_by.key_of(msg).map(|k| OrderedBy::Key(p, k));
            match forced.get(&i) {
                Some(fate) => {
                    if let Fate::Applied { digest, entry, .. } = fate {
                        applied.entry((p, *digest)).or_default().insert(i, *entry);
                    }
                    fates[i] = Some(fate.clone());
                    order.push(Keys::one(None));
                }
                None => match self.prepare(msg) {
                    Ok(ready) => {
                        let keys = Keys::two(key, Some(OrderedBy::Claim(p, ready.digest)));
                        order.push(keys);
                        window.push(i as i64, keys, ready);
                    }
                    Err(dead) => {
                        fates[i] = Some(dead);
                        order.push(Keys::one(None));
                    }
                },
            }
        }
        let mut running = FuturesUnordered::new();
        let mut turns = Turns::new();
        loop {
            turns.now_and_then().await;
            // In offset order, each message free to start: nothing of its
            // key or claim running, nor waiting before it.
            let free = self.pipeline.key_concurrency.saturating_sub(running.len());
            let started = match free {
                0 => Vec::new(),
                free => window.take(free, |_| true),
            };
            for (i, _, ready) in started {
                let i = usize::try_from(i).expect("an index");
                let mut view = Staged::new();
                let claim = (batch[i].partition(), ready.digest);
                if let Some((_, entry)) =
                    applied.get(&claim).and_then(|by| by.range(..i).next_back())
                {
                    view.insert(claim, *entry);
                }
                let (msg, at) = (&batch[i], times[i]);
                let judging = async move {
                    let mut jitter = Jitter::new(i as u64);
                    let fate = self
                        .judge(msg, ready, at, states, &view, &mut jitter, with)
                        .await;
                    (i, fate)
                };
                running.push(self.in_span(msg, judging));
            }
            let Some((i, fate)) = running.next().await else {
                break;
            };
            let fate = match fate {
                Ok(fate) => fate,
                // The batch is dropped. Unless the consumer cannot go on,
                // the others end first (one waiting to retry returns at
                // once on a stop or a rebalance, one running within its
                // attempt timeout), so none runs on beside the batch's
                // next run. Their outputs were never sent.
                Err(halt) => {
                    if !matches!(halt, Halt::Fatal(_)) {
                        while running.next().await.is_some() {}
                    }
                    return Err(halt);
                }
            };
            if let (Fate::Applied { entry, .. }, Some(digest)) = (&fate, claim_of(order[i])) {
                applied
                    .entry((batch[i].partition(), digest))
                    .or_default()
                    .insert(i, *entry);
            }
            window.finish(i as i64, order[i]);
            fates[i] = Some(fate);
        }
        let staged = applied
            .into_iter()
            .filter_map(|(c, by)| by.into_values().next_back().map(|e| (c, e)))
            .collect();
        let fates = fates
            .into_iter()
            .map(|f| f.expect("every message judged"))
            .collect();
        Ok((fates, staged))
    }

    /// What becomes of `msg`, met at stream time `at`: decoded and keyed,
    /// claimed unless a live claim covers it, and run (with retries) into
    /// its outputs. Its
    /// attempts run contained ([`attempt::run`]) and their failures are
    /// judged as the database runtime's are ([`Retrying`]). It halts when an
    /// outage outlasted `max_outage` (the consumer stops with an error), or
    /// when the consumer stops while it waits to retry.
    pub(super) async fn fate(
        &self,
        msg: &OwnedMessage,
        at: i64,
        states: &HashMap<i32, PartitionClaims>,
        staged: &Staged,
        jitter: &mut Jitter,
        with: &With<'_>,
    ) -> Result<Fate, Halt> {
        match self.prepare(msg) {
            Ok(prepared) => {
                self.judge(msg, prepared, at, states, staged, jitter, with)
                    .await
            }
            Err(dead) => Ok(dead),
        }
    }

    /// `msg` decoded and keyed, or the fate of one that cannot be.
    // The fate is what the caller wants in either case, not an error to box.
    #[allow(clippy::result_large_err)]
    pub(super) fn prepare(&self, msg: &OwnedMessage) -> Result<Prepared<H::Event>, Fate> {
        // Tier headers that are not its own: the message's fault.
        if let Some(why) = self.forged(msg) {
            return Err(dead(crate::tiers::FORGED, why, 1));
        }
        let payload = msg.payload().unwrap_or_default();
        let headers = meta_of(msg);
        match attempt::contained(|| self.handler.prepare(payload, &headers)) {
            Ok(Ok((key, fingerprint, event))) => Ok(Prepared {
                digest: claims::digest(&key),
                key,
                fingerprint,
                event,
                headers,
            }),
            Ok(Err(e)) => Err(dead(e.kind(), error_chain(&e), 1)),
            Err(said) => Err(dead("panic", unprepared_panic(&said), 1)),
        }
    }

    /// [`fate`](Self::fate) of a message prepared.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn judge(
        &self,
        msg: &OwnedMessage,
        prepared: Prepared<H::Event>,
        at: i64,
        states: &HashMap<i32, PartitionClaims>,
        staged: &Staged,
        jitter: &mut Jitter,
        with: &With<'_>,
    ) -> Result<Fate, Halt> {
        let payload = msg.payload().unwrap_or_default();
        let Prepared {
            key,
            fingerprint,
            event,
            headers,
            digest,
        } = prepared;
        let live = staged
            .get(&(msg.partition(), digest))
            .filter(|e| e.covers(at))
            .or_else(|| {
                states
                    .get(&msg.partition())
                    .and_then(|s| s.live(&digest, at))
            });
        if let Some(claim) = live {
            let mut mismatch = false;
            if let (Some(kept), Some(ours)) = (claim.fingerprint, fingerprint)
                && kept != ours
            {
                mismatch = true;
                tracing::warn!(key = %key, "a duplicate's fingerprint differs from its claim's: the id was reused for other content");
                if self.pipeline.on_fingerprint_mismatch == OnFingerprintMismatch::DeadLetter {
                    return Ok(dead(
                        "fingerprint_mismatch",
                        format!(
                            "event id {key} was claimed with fingerprint {kept} and came again with {ours}"
                        ),
                        1,
                    ));
                }
            }
            let age = u64::try_from(at.saturating_sub(claim.claimed_at)).unwrap_or(0);
            return Ok(Fate::Skipped {
                digest,
                age: Duration::from_millis(age),
                mismatch,
            });
        }
        // An expired committed claim of its key, taken over if it is
        // applied (not one staged by this batch: a refusal can undo that).
        let reclaimed = states
            .get(&msg.partition())
            .is_some_and(|s| s.holds(&digest));
        let mut event = Some(event);
        let mut attempts = Attempts::new(&self.stats, self.in_place(), self.record());
        loop {
            let attempt = attempts.start();
            let ev = match event.take() {
                Some(ev) => ev,
                // It decoded once; decoding is pure.
                None => {
                    match attempt::contained(|| self.handler.decode_record(payload, &headers)) {
                        Ok(Ok(ev)) => ev,
                        Ok(Err(e)) => return Ok(dead(e.kind(), error_chain(&e), attempt)),
                        Err(said) => return Ok(dead("panic", unprepared_panic(&said), attempt)),
                    }
                }
            };
            let handler = self.handler.clone();
            // Its outputs are only records in memory until the batch's
            // transaction: left to finish if the consumer is dropped, as
            // before (a handler's own outside calls are its business). A
            // handler that only computes its outputs never waits: run here,
            // it costs no task of its own (a task per event was a tenth of
            // the consumer's CPU, mostly waking the other worker thread).
            let ran = attempt::run(
                tracing::Span::current(),
                self.pipeline.attempt_timeout,
                false,
                attempt::Start::HereFirst,
                async move {
                    let mut out = Outputs::default();
                    let result = handler.handle(&mut out, ev).await;
                    result.map(|()| out).map_err(|e| e.into_unstored_error())
                },
            )
            .await;
            let wait = match attempts.ended(Tried::of(ran), jitter, Some(&key)) {
                Next::Done(out) => {
                    let ttl = i64::try_from(self.handler.ttl().as_duration().as_millis())
                        .unwrap_or(i64::MAX);
                    return Ok(Fate::Applied {
                        outputs: out.into_records(),
                        digest,
                        entry: Entry {
                            claimed_at: at,
                            expires_at: at.saturating_add(ttl),
                            fingerprint,
                        },
                        key,
                        reclaimed,
                    });
                }
                // A transient failure goes to the next retry tier, if any;
                // the event's own fault to the dead letters.
                Next::GiveUp(up) => {
                    return Ok(match (up.onward, self.next_tier(msg)) {
                        (true, Some((tier, next))) => Fate::Moved {
                            tier,
                            kind: up.kind,
                            message: up.message,
                            attempts: up.attempts,
                            due_ms: next.due_from_now(),
                        },
                        _ => dead(up.kind, up.message, up.attempts),
                    });
                }
                Next::Stop(why) => return Err(Halt::Fatal(Error::Fatal(why))),
                Next::Wait(wait) => wait,
            };
            let mut stopping = with.stopping.clone();
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = stopping.wait_for(|s| *s) => return Err(Halt::Stopped),
                () = with.busy.rebalance() => return Err(Halt::Rebalanced),
            }
        }
    }
}

/// The fates of `all` that stand when message `refused`'s fate changes
/// after a refusal: all but its own and, if it had taken a claim, those of
/// the later messages of its partition that relied on that claim (skipped
/// as its duplicates, or dead-lettered for a fingerprint that differs from
/// it). Those are judged again; no handler runs twice for the others.
pub(super) fn independent_of(
    batch: &[OwnedMessage],
    all: Vec<Fate>,
    refused: usize,
) -> HashMap<usize, Fate> {
    let claim = match &all[refused] {
        Fate::Applied { digest, .. } => Some(*digest),
        _ => None,
    };
    let partition = batch[refused].partition();
    all.into_iter()
        .enumerate()
        .filter(|(j, fate)| {
            let relied = claim.is_some()
                && *j > refused
                && batch[*j].partition() == partition
                && match fate {
                    Fate::Skipped { digest, .. } => Some(*digest) == claim,
                    Fate::Dead { kind, .. } => *kind == "fingerprint_mismatch",
                    Fate::Applied { .. } | Fate::Moved { .. } => false,
                };
            *j != refused && !relied
        })
        .collect()
}

/// Why a message that panicked before its handler ran is dead-lettered.
pub(super) fn unprepared_panic(said: &str) -> String {
    format!("decoding the event or reading its key panicked: {said}")
}

pub(super) fn dead(kind: &'static str, message: String, attempts: u32) -> Fate {
    Fate::Dead {
        kind,
        message,
        attempts,
        keep: None,
    }
}

/// The record's timestamp in ms; the wall clock for a record without one.
pub(super) fn timestamp(msg: &OwnedMessage) -> i64 {
    msg.timestamp().to_millis().unwrap_or_else(now_ms)
}

/// The wall clock, in ms since the epoch.
pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use rdkafka::Timestamp;

    use super::*;

    fn message(partition: i32, offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            None,
            None,
            "in".into(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    fn applied(id: &str) -> Fate {
        let key = DedupKey::new("t", id).expect("key");
        Fate::Applied {
            outputs: Vec::new(),
            digest: claims::digest(&key),
            entry: Entry {
                claimed_at: 0,
                expires_at: 1,
                fingerprint: None,
            },
            key,
            reclaimed: false,
        }
    }

    fn skipped(id: &str) -> Fate {
        Fate::Skipped {
            digest: claims::digest(&DedupKey::new("t", id).expect("key")),
            age: Duration::ZERO,
            mismatch: false,
        }
    }

    /// An output refused dead-letters its event: what relied on its claim
    /// (later duplicates in its partition, fingerprint mismatches) is
    /// judged again, everything else stands (no handler runs twice).
    #[test]
    fn a_refusal_rejudges_only_what_relied_on_the_refused_claim() {
        let batch: Vec<OwnedMessage> = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (0, 5)]
            .into_iter()
            .map(|(p, o)| message(p, o))
            .collect();
        let fates = vec![
            skipped("a"),
            applied("a"),
            applied("b"),
            skipped("a"),
            dead("fingerprint_mismatch", String::new(), 1),
            skipped("a"),
            skipped("b"),
        ];
        let mut stand: Vec<usize> = independent_of(&batch, fates.clone(), 1)
            .into_keys()
            .collect();
        stand.sort_unstable();
        // 0 came before the refused one, 2 and 6 rely on "b", 5 is another
        // partition's.
        assert_eq!(stand, [0, 2, 5, 6]);
        // A dead letter refused (cut) changes no claim: only its own fate.
        let mut stand: Vec<usize> = independent_of(&batch, fates, 4).into_keys().collect();
        stand.sort_unstable();
        assert_eq!(stand, [0, 1, 2, 3, 5, 6]);
    }
}
