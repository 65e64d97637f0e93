//! The reference in-memory outbox.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::MemoryTx;
use crate::StoreError;
use crate::outbox::{OutboxMessage, OutboxRecord, OutboxSource, PublishFailure, Retention};

/// An in-memory outbox: the reference implementation of [`OutboxSource`],
/// for unit tests, docs and single-process experiments. Nothing is durable.
///
/// [`enqueue`](MemoryOutbox::enqueue) writes inside a [`MemoryTx`]: the
/// event exists once that transaction commits, and never if it rolls back,
/// as with a database's outbox. A relay waiting for events is woken by each
/// commit that enqueued.
///
/// ```
/// use dedup_core::{DedupStore, MemoryOutbox, MemoryStore, OutboxMessage, OutboxSource};
/// use std::time::Duration;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let outbox = MemoryOutbox::default();
/// let mut tx = store.begin().await?;
/// let id = outbox.enqueue(&mut tx, OutboxMessage::bytes("payments", "paid").with_key("a"));
/// store.commit(tx).await?;
///
/// let (lease, records) = outbox.lease_pending(10, Duration::from_secs(30)).await?;
/// assert_eq!(records[0].event_id, id);
/// outbox.finish(&lease, &[records[0].seq], &[]).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryOutbox {
    shared: Arc<Shared>,
    /// The version this handle last leased at: a wait returns once the
    /// outbox moved past it.
    seen: Arc<AtomicU64>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Bumped by every commit that enqueued and every finish that
    /// published or released events, so waiting relays look again.
    version: tokio::sync::watch::Sender<u64>,
}

#[derive(Default)]
struct State {
    retention: Retention,
    rows: Vec<Row>,
    next_seq: i64,
    next_lease: u64,
}

struct Row {
    record: OutboxRecord,
    enqueued_at: Instant,
    sent_at: Option<Instant>,
    last_error: Option<String>,
    next_attempt_at: Option<Instant>,
    lease: Option<(u64, Instant)>,
}

impl Row {
    /// Published and kept, or otherwise not to be offered.
    fn pending(&self) -> bool {
        self.sent_at.is_none()
    }

    /// Pending but not to be offered now: backing off after a failure, or
    /// leased to a relay whose lease has not expired.
    fn held(&self, now: Instant) -> bool {
        self.next_attempt_at.is_some_and(|at| at > now)
            || self.lease.is_some_and(|(_, until)| until > now)
    }
}

/// A batch leased from a [`MemoryOutbox`].
#[derive(Debug)]
pub struct MemoryLease {
    id: u64,
    seqs: Vec<i64>,
}

impl fmt::Debug for MemoryOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("MemoryOutbox")
            .field("retention", &state.retention)
            .field("rows", &state.rows.len())
            .finish()
    }
}

impl MemoryOutbox {
    /// An empty outbox whose published events are kept or deleted as
    /// `retention` says.
    pub fn new(retention: Retention) -> Self {
        let outbox = MemoryOutbox::default();
        outbox.state().retention = retention;
        outbox
    }

    /// Another relay's handle on the same outbox: it shares the events,
    /// and waits for new ones on its own.
    pub fn reader(&self) -> Self {
        MemoryOutbox {
            shared: self.shared.clone(),
            seen: Arc::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves rows consistent
        // (each change is one assignment), so keep going.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Writes `message` into the outbox when `tx` commits, and returns its
    /// event id: the one set on the message, or a new random UUID.
    pub fn enqueue(&self, tx: &mut MemoryTx, message: OutboxMessage) -> String {
        let event_id = message
            .event_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let outbox = self.clone();
        let id = event_id.clone();
        tx.on_commit(move || {
            let mut state = outbox.state();
            state.next_seq += 1;
            let record = OutboxRecord::new(state.next_seq, id, message.topic, message.payload)
                .with_key(message.key)
                .with_headers(message.headers);
            state.rows.push(Row {
                record,
                enqueued_at: Instant::now(),
                sent_at: None,
                last_error: None,
                next_attempt_at: None,
                lease: None,
            });
            drop(state);
            outbox.shared.version.send_modify(|v| *v += 1);
        });
        event_id
    }

    /// How many events wait to be published.
    pub fn pending(&self) -> usize {
        self.state().rows.iter().filter(|r| r.pending()).count()
    }

    /// The reason of the last failed attempt to publish event `seq`.
    pub fn last_error(&self, seq: i64) -> Option<String> {
        let state = self.state();
        let row = state.rows.iter().find(|r| r.record.seq == seq)?;
        row.last_error.clone()
    }
}

impl OutboxSource for MemoryOutbox {
    type Lease = MemoryLease;

    async fn lease_pending(
        &self,
        limit: usize,
        lease_for: Duration,
    ) -> Result<(MemoryLease, Vec<OutboxRecord>), StoreError> {
        let now = Instant::now();
        let mut state = self.state();
        self.seen
            .store(*self.shared.version.borrow(), Ordering::Release);
        state.next_lease += 1;
        let id = state.next_lease;
        // Keys with an earlier pending event held elsewhere (or backing
        // off): none of their later events may overtake it.
        let mut held_keys: HashSet<(String, Vec<u8>)> = HashSet::new();
        let mut records = Vec::new();
        for row in state.rows.iter_mut().filter(|r| r.pending()) {
            if records.len() >= limit {
                break;
            }
            let key = row
                .record
                .key
                .clone()
                .map(|k| (row.record.topic.clone(), k));
            if key.as_ref().is_some_and(|k| held_keys.contains(k)) {
                continue;
            }
            if row.held(now) {
                held_keys.extend(key);
                continue;
            }
            row.lease = Some((id, now + lease_for));
            records.push(row.record.clone());
        }
        let seqs = records.iter().map(|r| r.seq).collect();
        Ok((MemoryLease { id, seqs }, records))
    }

    async fn finish(
        &self,
        lease: &MemoryLease,
        published: &[i64],
        failed: &[PublishFailure],
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut state = self.state();
        let published: HashSet<i64> = published.iter().copied().collect();
        let failed: HashMap<i64, &PublishFailure> = failed.iter().map(|f| (f.seq, f)).collect();
        let ours = |row: &Row| row.lease.is_some_and(|(id, _)| id == lease.id);
        let mut released = false;
        for row in &mut state.rows {
            let seq = row.record.seq;
            if published.contains(&seq) {
                // Right whoever holds the lease now: the broker has it.
                if row.sent_at.is_none() {
                    row.sent_at = Some(now);
                    row.lease = None;
                    released = true;
                }
            } else if let Some(failure) = failed.get(&seq) {
                if ours(row) {
                    row.record.attempts += 1;
                    row.last_error = Some(failure.reason.clone());
                    row.next_attempt_at = Some(now + failure.retry_after);
                    row.lease = None;
                }
            } else if lease.seqs.contains(&seq) && ours(row) {
                row.lease = None;
                released = true;
            }
        }
        if state.retention == Retention::Delete {
            state.rows.retain(Row::pending);
        }
        drop(state);
        if released {
            self.shared.version.send_modify(|v| *v += 1);
        }
        Ok(())
    }

    async fn wait_for_events(&self, timeout: Duration) {
        let mut changes = self.shared.version.subscribe();
        let seen = self.seen.load(Ordering::Acquire);
        let _ = tokio::time::timeout(timeout, changes.wait_for(|v| *v != seen)).await;
    }

    async fn purge_sent(&self, limit: u32) -> Result<u64, StoreError> {
        let mut state = self.state();
        let Retention::Keep(keep) = state.retention else {
            return Ok(0);
        };
        let now = Instant::now();
        let mut expired: Vec<(Instant, i64)> = state
            .rows
            .iter()
            .filter_map(|r| Some((r.sent_at?, r.record.seq)))
            .filter(|(sent, _)| now.saturating_duration_since(*sent) > keep)
            .collect();
        expired.sort_unstable();
        expired.truncate(limit as usize);
        let gone: HashSet<i64> = expired.into_iter().map(|(_, seq)| seq).collect();
        state.rows.retain(|r| !gone.contains(&r.record.seq));
        Ok(gone.len() as u64)
    }

    async fn backlog(&self) -> Result<Option<(u64, Duration)>, StoreError> {
        let state = self.state();
        let pending = state.rows.iter().filter(|r| r.pending());
        let oldest = pending.clone().map(|r| r.enqueued_at).min();
        Ok(Some((
            pending.count() as u64,
            oldest.map_or(Duration::ZERO, |at| at.elapsed()),
        )))
    }
}
