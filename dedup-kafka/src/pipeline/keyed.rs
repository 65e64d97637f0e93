//! Key-ordered concurrency's bookkeeping for one partition, with no I/O:
//! which events may start (never two of one ordering key, each key's in
//! offset order), which wait behind their key, and the offset below which
//! every event is finished, the only one that may be committed.
//!
//! Events that finished out of order above an unfinished one are not
//! committed: after a crash they are redelivered and their claims make
//! them skips. The window of events received and not yet below the
//! committed offset is what the runtime bounds (`max_buffered_per_partition`),
//! so a slow key holds the others back only once that window is full.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;

/// An event's ordering key, hashed: two keys that collide are ordered as
/// one (less concurrency, never less order).
pub(crate) type OrderKey = u64;

/// The ordering key of `bytes` (a record key, a header's or a field's
/// value). Key hold-back stores it in its records (`hold.rs`), which
/// outlive a deploy: so it is a specified hash of the raw bytes, the same
/// in every build, toolchain and platform (FNV-1a, 64 bits, over the bytes
/// and one `0xff`: the value those records have held since they were
/// introduced), never std's `Hash`, whose output std does not promise.
pub(crate) fn order_key(bytes: &[u8]) -> OrderKey {
    fnv1a(bytes, &[])
}

/// FNV-1a (64 bits) of `key`, a `0xff` separator and `payload`: no UTF-8
/// text holds `0xff`, so a text key's bytes cannot slide into the payload.
pub(crate) fn fnv1a(key: &[u8], payload: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET_BASIS;
    for &byte in key.iter().chain(&[0xff]).chain(payload) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(PRIME);
    }
    hash
}

/// What orders an event: at most two keys (the database runtime's
/// ordering key; the Kafka-only runtime's ordering key and claim). It
/// starts once no earlier unfinished event shares one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Keys<K>([Option<K>; 2]);

impl<K: Copy + Eq> Keys<K> {
    /// Ordered by `key` alone, or (`None`) by nothing.
    pub(crate) fn one(key: Option<K>) -> Self {
        Keys([key, None])
    }

    /// Ordered by both (one, when they are equal).
    pub(crate) fn two(first: Option<K>, second: Option<K>) -> Self {
        match (first, second) {
            (Some(a), Some(b)) if a == b => Keys([first, None]),
            _ => Keys([first, second]),
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = K> + '_ {
        self.0.iter().flatten().copied()
    }
}

/// One partition's events under key-ordered concurrency. `M` is what the
/// runtime keeps of an event until it starts (the message, its route);
/// `K`, what orders it ([`Keys`]).
pub(crate) struct Window<K, M> {
    /// Every event received and not yet passed by the committed offset, in
    /// offset order, and whether it is finished.
    pending: VecDeque<(i64, bool)>,
    /// Each key of an unfinished event, with the offsets of its unfinished
    /// events in offset order: the first one holds it.
    queues: HashMap<K, VecDeque<i64>>,
    /// Events free to start, by offset: the lowest go first, so the
    /// committed offset moves on as soon as it can.
    ready: BTreeMap<i64, (Keys<K>, M)>,
    /// Events waiting behind an earlier event of one of their keys, with
    /// how many of their keys an earlier event holds.
    waiting: HashMap<i64, (Keys<K>, M, usize)>,
    /// Events started and not finished.
    started: usize,
}

/// An event taken to start: its offset and its keys, which stay taken
/// until it finishes.
pub(crate) type Started<K, M> = (i64, Keys<K>, M);

impl<K, M> Default for Window<K, M> {
    fn default() -> Self {
        Window {
            pending: VecDeque::new(),
            queues: HashMap::new(),
            ready: BTreeMap::new(),
            waiting: HashMap::new(),
            started: 0,
        }
    }
}

impl<K: Copy + Eq + Hash, M> Window<K, M> {
    /// A received event, above every one before it (the caller checks:
    /// [`Window::highest`]). One without keys is ordered with nothing.
    pub(crate) fn push(&mut self, offset: i64, keys: Keys<K>, event: M) {
        debug_assert!(self.pending.back().is_none_or(|(o, _)| *o < offset));
        self.pending.push_back((offset, false));
        let mut held = 0;
        for key in keys.iter() {
            let queue = self.queues.entry(key).or_default();
            if !queue.is_empty() {
                held += 1;
            }
            queue.push_back(offset);
        }
        if held == 0 {
            self.ready.insert(offset, (keys, event));
        } else {
            self.waiting.insert(offset, (keys, event, held));
        }
    }

    /// A received event that needs no processing (a type skipped): it is
    /// finished as it arrives. Returns what [`Window::finish`] returns.
    pub(crate) fn push_finished(&mut self, offset: i64) -> Option<(i64, usize)> {
        self.pending.push_back((offset, true));
        self.advance()
    }

    /// The first event free to start.
    pub(crate) fn first_ready(&self) -> Option<&M> {
        self.ready.values().next().map(|(_, m)| m)
    }

    /// Takes the first event free to start and, after it, up to `max - 1`
    /// more for which `same` holds, in offset order (events of distinct
    /// keys: one transaction may take them all). `same` is asked of each
    /// later event in turn, and may count what it lets in.
    pub(crate) fn take(
        &mut self,
        max: usize,
        mut same: impl FnMut(&M) -> bool,
    ) -> Vec<Started<K, M>> {
        let mut offsets = Vec::new();
        for (offset, (_, m)) in &self.ready {
            if offsets.len() == max.max(1) {
                break;
            }
            if offsets.is_empty() || same(m) {
                offsets.push(*offset);
            }
        }
        let taken: Vec<Started<K, M>> = offsets
            .into_iter()
            .map(|o| {
                let (keys, m) = self.ready.remove(&o).expect("listed above");
                (o, keys, m)
            })
            .collect();
        self.started += taken.len();
        taken
    }

    /// A started event is finished (applied, skipped or dead-lettered): the
    /// next event of each of its keys may start, once its other key is
    /// free too. Returns, when it moved, the offset to commit now
    /// (everything below it is finished) and how many events it passed.
    pub(crate) fn finish(&mut self, offset: i64, keys: Keys<K>) -> Option<(i64, usize)> {
        self.started -= 1;
        if let Ok(i) = self.pending.binary_search_by_key(&offset, |(o, _)| *o) {
            self.pending[i].1 = true;
        }
        for key in keys.iter() {
            let Some(queue) = self.queues.get_mut(&key) else {
                continue;
            };
            // A started event held each of its keys.
            debug_assert_eq!(queue.front(), Some(&offset));
            queue.pop_front();
            let Some(&next) = queue.front() else {
                self.queues.remove(&key);
                continue;
            };
            if let Some((_, _, held)) = self.waiting.get_mut(&next) {
                *held -= 1;
                if *held == 0 {
                    let (keys, m, _) = self.waiting.remove(&next).expect("looked up above");
                    self.ready.insert(next, (keys, m));
                }
            }
        }
        self.advance()
    }

    /// Drops the finished events at the front: the offset after the last
    /// one, and how many.
    fn advance(&mut self) -> Option<(i64, usize)> {
        let mut passed = 0;
        let mut next = None;
        while let Some(&(offset, true)) = self.pending.front() {
            self.pending.pop_front();
            passed += 1;
            next = Some(offset + 1);
        }
        next.map(|n| (n, passed))
    }

    /// The highest offset received and not yet passed, if any.
    pub(crate) fn highest(&self) -> Option<i64> {
        self.pending.back().map(|(o, _)| *o)
    }

    /// The lowest offset not yet finished (or passed), if any.
    pub(crate) fn lowest(&self) -> Option<i64> {
        self.pending.front().map(|(o, _)| *o)
    }

    /// Events free to start.
    pub(crate) fn ready(&self) -> usize {
        self.ready.len()
    }

    /// Events waiting behind an earlier event of one of their keys.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Events started and not finished.
    pub(crate) fn started(&self) -> usize {
        self.started
    }
}

/// How many events one transaction takes when `ready` events are free to
/// start and `free` more transactions may: the ready spread evenly over
/// them (a slow statement then holds up few others), at most `batch`.
pub(crate) fn share(ready: usize, free: usize, batch: usize) -> usize {
    ready.div_ceil(free.max(1)).clamp(1, batch.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offsets<K>(started: &[Started<K, &'static str>]) -> Vec<i64> {
        started.iter().map(|(o, _, _)| *o).collect()
    }

    /// Pinned: hold records written by any earlier version store these
    /// values, and a later one must find them (FNV-1a's published vectors
    /// for "" and "a" are 0xcbf29ce484222325 and 0xaf63dc4c8601ec8c; the
    /// same without the separator, checked by hand).
    #[test]
    fn ordering_keys_are_a_fixed_hash_of_the_raw_bytes() {
        assert_eq!(order_key(b""), 0xaf64_724c_8602_eb6e);
        assert_eq!(order_key(b"acct-1"), 0xc7ce_c55b_bc7c_3c19);
        assert_ne!(fnv1a(b"ab", b"c"), fnv1a(b"a", b"bc"));
        // No length prefix, no platform word: the bytes alone.
        assert_ne!(order_key(b"a"), order_key(b"a\0"));
    }

    #[test]
    fn a_key_runs_one_event_at_a_time_in_offset_order() {
        let mut w = Window::default();
        let (a, b) = (
            Keys::one(Some(order_key(b"a"))),
            Keys::one(Some(order_key(b"b"))),
        );
        let none = Keys::one(None);
        w.push(10, a, "a1");
        w.push(11, b, "b1");
        w.push(12, a, "a2");
        w.push(13, a, "a3");
        w.push(14, none, "n");
        assert_eq!(w.waiting(), 2);
        let first = w.take(10, |_| true);
        assert_eq!(offsets(&first), [10, 11, 14], "a's later events wait");
        assert!(w.take(10, |_| true).is_empty());
        // a1 finishes: a2 (and only a2) is free; 10 is committed.
        assert_eq!(w.finish(10, a), Some((11, 1)));
        assert_eq!(offsets(&w.take(10, |_| true)), [12]);
        assert_eq!(w.waiting(), 1);
        // b1 and the keyless one finish while a2 runs: nothing passes 12.
        assert_eq!(w.finish(14, none), None);
        assert_eq!(w.finish(11, b), Some((12, 1)));
        assert_eq!(w.finish(12, a), Some((13, 1)), "13 is not finished");
        assert_eq!(offsets(&w.take(10, |_| true)), [13]);
        assert_eq!(w.finish(13, a), Some((15, 2)), "13 and 14 pass at once");
        assert_eq!(w.lowest(), None);
        assert_eq!((w.started(), w.waiting(), w.ready()), (0, 0, 0));
    }

    /// The committed offset never passes an unfinished event, whatever
    /// order events finish in: checked against every order of a few.
    #[test]
    fn the_committed_offset_is_always_the_first_unfinished_event() {
        let keys = [0u8, 1, 0, 2, 1, 3];
        // Every interleaving the window allows, by a seeded shuffle of what
        // is ready at each step.
        for seed in 0..500u64 {
            let mut w = Window::default();
            for (i, k) in keys.iter().enumerate() {
                w.push(i as i64, Keys::one(Some(order_key(&[*k]))), i);
            }
            let mut finished = vec![false; keys.len()];
            let mut running: Vec<Started<OrderKey, usize>> = Vec::new();
            let mut committed = 0;
            let mut rng = seed.wrapping_mul(6364136223846793005) | 1;
            loop {
                running.extend(w.take(usize::MAX, |_| true));
                if running.is_empty() {
                    break;
                }
                for (_, k, _) in &running {
                    assert_eq!(
                        running.iter().filter(|(_, k2, _)| k2 == k).count(),
                        1,
                        "two events of one key at once"
                    );
                }
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let (offset, key, _) = running.swap_remove(rng as usize % running.len());
                let earlier = keys[..offset as usize]
                    .iter()
                    .enumerate()
                    .filter(|(_, k)| Keys::one(Some(order_key(&[**k]))) == key);
                for (j, _) in earlier {
                    assert!(
                        finished[j],
                        "an event of a key started before an earlier one"
                    );
                }
                finished[offset as usize] = true;
                if let Some((next, _)) = w.finish(offset, key) {
                    committed = next;
                }
                let first_unfinished = finished.iter().position(|f| !f).unwrap_or(keys.len());
                assert_eq!(committed, first_unfinished as i64);
            }
            assert_eq!(committed, keys.len() as i64);
        }
    }

    #[test]
    fn a_transaction_takes_only_events_it_can_run_together() {
        let mut w = Window::default();
        for (i, route) in ["x", "y", "x", "x"].into_iter().enumerate() {
            w.push(i as i64, Keys::one(Some(i as u64)), route);
        }
        let x = w.take(3, |r| *r == "x");
        assert_eq!(
            offsets(&x),
            [0, 2, 3],
            "y stays for a transaction of its own"
        );
        assert_eq!(offsets(&w.take(3, |r| *r == "y")), [1]);
    }

    /// `same` may count what it lets in (the bytes of a unit, capped as a
    /// batch's are): once it says no, nothing more of that run joins.
    #[test]
    fn a_transaction_stops_taking_when_told_it_is_full() {
        let mut w = Window::default();
        for (i, event) in ["aaaa", "bbbb", "cccc", "dddd"].into_iter().enumerate() {
            w.push(i as i64, Keys::one(Some(i as u64)), event);
        }
        // The first (4 bytes) is taken as it comes; up to 10 bytes in all.
        let mut bytes = 4;
        let unit = w.take(10, |e| {
            let fits = bytes < 10;
            if fits {
                bytes += e.len();
            }
            fits
        });
        assert_eq!(offsets(&unit), [0, 1, 2], "12 bytes: full");
        assert_eq!(offsets(&w.take(10, |_| true)), [3]);
    }

    /// The Kafka-only runtime orders by key and by claim: an event starts
    /// once both are free, and one key given twice holds once.
    #[test]
    fn an_event_of_two_keys_waits_for_both() {
        let mut w: Window<u8, &str> = Window::default();
        w.push(0, Keys::two(Some(1), Some(10)), "key 1, claim 10");
        w.push(1, Keys::two(Some(2), Some(20)), "key 2, claim 20");
        w.push(2, Keys::two(Some(2), Some(10)), "behind both");
        w.push(3, Keys::two(Some(3), Some(3)), "one key, given twice");
        assert_eq!(offsets(&w.take(10, |_| true)), [0, 1, 3]);
        assert_eq!(w.waiting(), 1);
        w.finish(1, Keys::two(Some(2), Some(20)));
        assert!(w.take(10, |_| true).is_empty(), "claim 10 is still held");
        w.finish(3, Keys::two(Some(3), Some(3)));
        w.finish(0, Keys::two(Some(1), Some(10)));
        assert_eq!(offsets(&w.take(10, |_| true)), [2]);
        assert_eq!(
            w.finish(2, Keys::two(Some(2), Some(10))),
            Some((4, 2)),
            "2 and 3 pass"
        );
        assert_eq!((w.started(), w.waiting(), w.ready()), (0, 0, 0));
    }

    #[test]
    fn ready_events_are_spread_over_the_free_transactions() {
        assert_eq!(share(1000, 32, 200), 32);
        assert_eq!(share(32, 32, 200), 1);
        assert_eq!(share(5, 32, 200), 1);
        assert_eq!(share(1000, 1, 200), 200);
        assert_eq!(share(0, 0, 0), 1);
    }

    #[test]
    fn skipped_events_pass_with_the_rest() {
        let mut w = Window::default();
        w.push(0, Keys::one(Some(1u64)), ());
        assert_eq!(w.push_finished(1), None);
        let started = w.take(1, |_| true);
        assert_eq!(started.len(), 1);
        assert_eq!(w.finish(0, Keys::one(Some(1))), Some((2, 2)));
    }
}
