//! Key hold-back for retry tiers (`RetryTiers::hold_keys`): while an event
//! of an ordering key waits in a retry tier, the later events of that key
//! (of the same origin partition) follow it into the tiers instead of being
//! applied before it, so each key's events are applied in their order.
//!
//! What is in the tiers is recorded in the store, per consumer group and
//! origin partition (a typed topic's handlers hold a key together), as
//! claims that are only ever added (the store has no delete):
//! `<key>.<origin offset>.in` when an event moves from its origin topic to a
//! tier (in the move record's transaction), `<key>.<origin offset>.out` when
//! a tier finishes it (applied, skipped, dead-lettered). A key is held
//! while one of its events is in and not out. Both live as long as the
//! handler's TTL.
//!
//! The origin partition's worker reads its partition's records once, when
//! it starts, and keeps them: only it puts events in, so a key it does not
//! know as held is not held; a key it knows as held is read again from the
//! store (a tier, maybe in another process, may have let it out). A tier's
//! worker reads the key's records from the store for each record it takes.

use std::collections::{BTreeSet, HashMap};

use dedup_core::{DedupKey, DedupStore};

use crate::database::partition::Runtime;
use crate::database::partition::state::Partition;
use crate::database::route::Route;
use crate::pipeline::keyed::OrderKey;
use crate::retry::Jitter;
use crate::tiers::Origin;

/// Per ordering key, the origin offsets of its events in the tiers.
pub(crate) type Held = HashMap<OrderKey, BTreeSet<i64>>;

/// Where a hold record of `origin`'s partition lives, with id `id`: per
/// consumer group and origin partition, so that a topic's handlers of
/// several event types hold a key together (as `key_concurrency` orders
/// it) and another group's holds are its own.
fn record(group: &str, origin: &Origin, id: String) -> DedupKey {
    let scope = dedup_core::ordered_scope(&format!(
        "hold/{group}/{}/{}",
        origin.topic, origin.partition
    ));
    DedupKey::new(scope, id).expect("never empty")
}

/// The record that `key`'s event at `origin` went into the tiers.
pub(crate) fn in_record(group: &str, origin: &Origin, key: OrderKey) -> DedupKey {
    record(
        group,
        origin,
        format!("{key:016x}.{:020}.in", origin.offset),
    )
}

/// The record that a tier finished `key`'s event at `origin`.
pub(crate) fn out_record(group: &str, origin: &Origin, key: OrderKey) -> DedupKey {
    record(
        group,
        origin,
        format!("{key:016x}.{:020}.out", origin.offset),
    )
}

/// What a list of record ids says is in the tiers; only `only`'s if given.
fn held_in(ids: &[String], only: Option<OrderKey>) -> Held {
    let mut ins: Held = HashMap::new();
    let mut outs: Held = HashMap::new();
    for id in ids {
        let mut parts = id.split('.');
        let (Some(key), Some(offset), Some(kind), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (Ok(key), Ok(offset)) = (u64::from_str_radix(key, 16), offset.parse::<i64>()) else {
            continue;
        };
        if only.is_some_and(|k| k != key) {
            continue;
        }
        match kind {
            "in" => ins.entry(key).or_default().insert(offset),
            "out" => outs.entry(key).or_default().insert(offset),
            _ => continue,
        };
    }
    for (key, out) in outs {
        if let Some(offsets) = ins.get_mut(&key) {
            offsets.retain(|o| !out.contains(o));
        }
    }
    ins.retain(|_, offsets| !offsets.is_empty());
    ins
}

/// The records read from the store from `from` on (waiting out the store);
/// `None` if the consumer stops or the partition is revoked meanwhile.
async fn read<S: DedupStore>(
    shared: &Runtime<S>,
    partition: &Partition,
    from: &DedupKey,
    only: Option<OrderKey>,
    jitter: &mut Jitter,
) -> Option<Held> {
    let ids = crate::database::dead_letter::recorded_from(shared, partition, from, jitter).await?;
    let mut ids: Vec<String> = ids.into_iter().collect();
    ids.sort_unstable();
    Some(held_in(&ids, only))
}

/// The origin offset of an event of `key` in the tiers before `origin`'s
/// (the latest such), if there is one: `msg`'s must then follow it. `None`
/// inside if the consumer stops or the partition is revoked while the
/// store is read.
pub(crate) async fn earlier<S: DedupStore>(
    shared: &Runtime<S>,
    route: &Route<S>,
    partition: &Partition,
    origin: &Origin,
    key: OrderKey,
    jitter: &mut Jitter,
) -> Option<Option<i64>> {
    let first_of_key = record(&shared.group, origin, format!("{key:016x}"));
    let before = |held: &Held| {
        held.get(&key)
            .and_then(|offsets| offsets.range(..origin.offset).next_back().copied())
    };
    if route.in_tier() {
        let held = read(shared, partition, &first_of_key, Some(key), jitter).await?;
        return Some(before(&held));
    }
    // The origin's worker: what it knows of the partition's holds, read
    // once at its first need (set only if no other unit set it meanwhile:
    // what that one added since is newer).
    let all = record(&shared.group, origin, "0".to_owned());
    let scope = all.scope();
    let loaded = lock(partition).contains_key(scope);
    if !loaded {
        let held = read(shared, partition, &all, None, jitter).await?;
        lock(partition).entry(scope.to_owned()).or_insert(held);
    }
    if lock(partition).get(scope).and_then(before).is_none() {
        return Some(None);
    }
    // Held as far as this worker knows: a tier may have let it out since.
    let now = read(shared, partition, &first_of_key, Some(key), jitter).await?;
    if let Some(holds) = lock(partition).get_mut(scope) {
        match now.get(&key) {
            Some(offsets) => holds.insert(key, offsets.clone()),
            None => holds.remove(&key),
        };
    }
    Some(before(&now))
}

/// The origin worker's holds, by the scope of their records.
fn lock(partition: &Partition) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
    partition.holds.lock().unwrap_or_else(|p| p.into_inner())
}

/// This worker put `key`'s event at `origin` into the tiers: `record`
/// (its `in` record) says so.
pub(crate) fn went_in(partition: &Partition, record: &DedupKey, key: OrderKey, origin: &Origin) {
    if let Some(holds) = lock(partition).get_mut(record.scope()) {
        holds.entry(key).or_default().insert(origin.offset);
    }
}

/// A tier finished `key`'s event at `origin`: records it, so the key is
/// no longer held by it. `false` if it could not be recorded (the
/// consumer stops): the event is then not finished.
pub(crate) async fn let_out<S: DedupStore>(
    shared: &Runtime<S>,
    route: &Route<S>,
    origin: &Origin,
    key: OrderKey,
    jitter: &mut Jitter,
) -> bool {
    let out = out_record(&shared.group, origin, key);
    crate::database::dead_letter::record_all(shared, route, &[out], true, jitter).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hold record's id is pinned: records an earlier version (or a
    /// build on another toolchain) wrote are read by this one.
    #[test]
    fn hold_records_name_the_key_by_a_fixed_hash() {
        let origin = Origin {
            topic: "payments".into(),
            partition: 2,
            offset: 41,
            timestamp: None,
        };
        let key = crate::pipeline::keyed::order_key(b"acct-1");
        assert_eq!(
            in_record("payments-v1", &origin, key).id(),
            "c7cec55bbc7c3c19.00000000000000000041.in"
        );
        assert_eq!(
            out_record("payments-v1", &origin, key).id(),
            "c7cec55bbc7c3c19.00000000000000000041.out"
        );
    }

    #[test]
    fn a_key_is_held_while_an_event_of_it_is_in_and_not_out() {
        let id = |key: u64, offset: i64, kind: &str| format!("{key:016x}.{offset:020}.{kind}");
        let ids = vec![
            id(7, 3, "in"),
            id(7, 3, "out"),
            id(7, 9, "in"),
            id(7, 12, "in"),
            id(9, 4, "in"),
            id(9, 4, "out"),
            id(11, 5, "out"),
            "garbage".to_owned(),
            "0000000000000007.x.in".to_owned(),
        ];
        let held = held_in(&ids, None);
        assert_eq!(
            held.get(&7).map(|o| o.iter().copied().collect::<Vec<_>>()),
            Some(vec![9, 12])
        );
        assert!(!held.contains_key(&9), "in and out: not held");
        assert!(!held.contains_key(&11), "out without in");
        let only = held_in(&ids, Some(9));
        assert!(only.is_empty());
        // Ids sort as (key, offset): a key's records are read from its first.
        let mut sorted = ids[..6].to_vec();
        sorted.sort();
        assert_eq!(sorted[0], id(7, 3, "in"));
    }
}
