//! A partition's worker under key-ordered concurrency
//! (`key_concurrency(n)`): up to `n` units run at once, each a transaction
//! of events of distinct ordering keys (or one lease-mode event); an event
//! waits while an earlier one of its key runs; the offset stored is always
//! the partition's first unfinished event's ([`Window`]).
//!
//! The units run in this task (their handler calls are tasks of their own,
//! see `Runtime::run_handler`), so a worker that is aborted at the shutdown
//! timeout drops them with everything else it holds.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use dedup_core::DedupStore;
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use rdkafka::message::{Message as _, OwnedMessage};

use crate::database::dead_letter as dead_letters;
use crate::database::route::{Pick, TopicRoutes};
use crate::pipeline::keyed::{Keys, OrderKey, Window, share};
use crate::retry::Jitter;

use super::state::Partition;
use super::worker::{Inbox, counted_out, run_unit};
use super::{Runtime, store_next};

/// What a worker keeps of a received event until it starts: its route's
/// index and the message.
type Held = (usize, OwnedMessage);

/// The events of a unit, by offset and ordering key.
type Unit = Vec<(i64, Keys<OrderKey>)>;

/// Runs the partition's messages under key-ordered concurrency until the
/// consumer stops, the partition is revoked or released, or a unit is
/// abandoned; then lets the running units end and returns.
pub(super) async fn worker<S: DedupStore>(
    shared: &Arc<Runtime<S>>,
    routes: &Arc<TopicRoutes<S>>,
    partition: &Arc<Partition>,
    mut inbox: Inbox,
) {
    let n = shared.settings.pipeline.key_concurrency;
    let batch_size = shared.settings.pipeline.batching.size;
    partition.redelivery_window.store(
        shared.settings.max_buffered_per_partition as i64,
        Ordering::Relaxed,
    );
    let mut window: Window<OrderKey, Held> = Window::default();
    let mut running = FuturesUnordered::new();
    // When each running unit started (`Stats::clock_ms`), by unit number:
    // the oldest is what health reports as the partition's busy time.
    let mut started_at: BTreeMap<u64, u64> = BTreeMap::new();
    let mut units = 0u64;
    // Per route, as in the serial worker: the offsets dead-lettered before,
    // read once, before the first unit.
    let mut dead_lettered: Option<Vec<Arc<HashSet<String>>>> = None;
    let mut jitter = Jitter::new(partition.partition as u64);
    let mut stopping = shared.stopping.subscribe();
    let mut revoked = partition.revoked.subscribe();
    let mut release = partition.release.subscribe();
    // Set on stop, revoke, release or an abandoned unit: no unit starts any
    // more, and the worker ends once the running ones have.
    let mut ending = false;
    // Takes a received message in; `false` if its offset is not above the
    // last one's (the fetch position moved back: a log truncation), which
    // the window cannot order: the consumer stops, to resume from what it
    // committed.
    let admit = |window: &mut Window<OrderKey, Held>, inbox: &mut Inbox, msg: OwnedMessage| {
        if let Some(last) = window.highest()
            && msg.offset() <= last
        {
            shared.fail(format!(
                "partition {}/{} went back from offset {last} to {} while running with \
                 key_concurrency (a log truncation?): stopping, to resume from the committed \
                 offset",
                partition.topic,
                partition.partition,
                msg.offset()
            ));
            return false;
        }
        match routes.pick(&msg) {
            Pick::Route(index) => {
                let key = routes.order_by.key_of(&msg);
                window.push(msg.offset(), Keys::one(key), (index, msg));
            }
            Pick::Ignore(index) => {
                // A type no handler takes, under OtherTypes::Skip: finished.
                routes.all()[index].record(&shared.stats).ignored();
                if let Some((next, passed)) = window.push_finished(msg.offset()) {
                    store_next(shared, partition, next);
                    counted_out(shared, partition, passed);
                }
                inbox.done(1);
                shared.stats.touch();
            }
        }
        true
    };
    loop {
        // Looked at here too: under load a unit finishes at every turn, and
        // the select below prefers those.
        if *stopping.borrow() || *revoked.borrow() || *release.borrow() {
            ending = true;
        }
        if !ending {
            // What is queued already joins before units start, so a
            // transaction can take several events.
            while let Ok(msg) = inbox.try_recv() {
                if !admit(&mut window, &mut inbox, msg) {
                    ending = true;
                    break;
                }
            }
        }
        while !ending && running.len() < n {
            let Some(&(index, _)) = window.first_ready() else {
                break;
            };
            let route = routes.all()[index].clone();
            if dead_lettered.is_none() {
                // Every route's, before the first unit starts: a unit that
                // dead-letters holds the partition's dead-letter gate,
                // which reading takes, and units move on only while this
                // loop is not waiting. Every event not yet finished is at
                // or above the lowest.
                let from = window.lowest().expect("an event is ready");
                let mut sets = Vec::with_capacity(routes.all().len());
                for route in routes.all() {
                    match dead_letters::recorded(shared, route, partition, from, &mut jitter).await
                    {
                        Some(ids) => sets.push(Arc::new(ids)),
                        // Stopped while the store was unreachable.
                        None => break,
                    }
                }
                if sets.len() < routes.all().len() {
                    ending = true;
                    break;
                }
                dead_lettered = Some(sets);
            }
            let max = match route.handler.batches() {
                Some(_) => share(window.ready(), n - running.len(), batch_size),
                None => 1,
            };
            // A unit is full at `batch_bytes` too, counted as a batch's are.
            let mut filling = shared.settings.pipeline.batching.start(false);
            if let Some((_, first)) = window.first_ready() {
                filling.took(first);
            }
            let (unit, messages): (Unit, Vec<OwnedMessage>) = window
                .take(max, |(i, m)| {
                    let fits = *i == index && !filling.bytes_full();
                    if fits {
                        filling.took(m);
                    }
                    fits
                })
                .into_iter()
                .map(|(offset, key, (_, msg))| ((offset, key), msg))
                .unzip();
            units += 1;
            started_at.insert(units, shared.stats.clock_ms());
            let known = dead_lettered.as_ref().expect("read above")[index].clone();
            let (shared, partition, id) = (shared.clone(), partition.clone(), units);
            let mut jitter = Jitter::new(partition.partition as u64 ^ (id << 20));
            running.push(async move {
                let finished =
                    run_unit(&shared, &route, &partition, &messages, &known, &mut jitter).await;
                (id, unit, finished)
            });
        }
        report(partition, &window, &started_at);
        if ending && running.is_empty() {
            break;
        }
        tokio::select! {
            biased;
            Some((id, unit, finished)) = running.next() => {
                started_at.remove(&id);
                for &(offset, key) in &unit[..finished] {
                    if let Some((next, passed)) = window.finish(offset, key) {
                        store_next(shared, partition, next);
                        counted_out(shared, partition, passed);
                    }
                }
                // Finished, or (stopped mid-unit) left for redelivery.
                inbox.done(unit.len());
                shared.stats.touch();
                if finished < unit.len() {
                    ending = true;
                }
            }
            _ = stopping.wait_for(|s| *s), if !ending => ending = true,
            _ = revoked.wait_for(|r| *r), if !ending => ending = true,
            _ = release.wait_for(|r| *r), if !ending => ending = true,
            msg = inbox.recv(), if !ending => match msg {
                Some(msg) => ending = !admit(&mut window, &mut inbox, msg),
                None => ending = true,
            },
        }
    }
    partition.keyed_running.store(0, Ordering::Relaxed);
    partition.keyed_waiting.store(0, Ordering::Relaxed);
    partition.busy_since_ms.store(u64::MAX, Ordering::Release);
}

/// What health and the gauges see of the partition: the oldest running
/// unit's start, the events running and those waiting behind their key.
fn report(partition: &Partition, window: &Window<OrderKey, Held>, started_at: &BTreeMap<u64, u64>) {
    let busy_since = started_at.values().next().copied().unwrap_or(u64::MAX);
    partition.busy_since_ms.store(busy_since, Ordering::Release);
    partition
        .keyed_running
        .store(window.started(), Ordering::Relaxed);
    partition
        .keyed_waiting
        .store(window.waiting(), Ordering::Relaxed);
}
