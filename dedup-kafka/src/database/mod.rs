//! The database runtime: each event claimed in the transaction of its
//! effect, its offset committed after that transaction commits.
//!
//! - [`builder`]: `ConsumerBuilder`, its settings checked at `build()`;
//! - [`handle`]: which handler takes which topic (`handle`, `handle_type`...);
//! - [`consumer`]: `Consumer`, its poll loop, commits and start-up checks;
//!   `gauges`: what health and the gauges report, refreshed by that loop;
//! - [`route`]: a topic's routes (its handlers, by event type) and what a
//!   route does with a failure (dead letters, moves, its tiers);
//! - [`effect`]: a route's handler behind one interface, by its effect;
//! - [`partition`]: the partition workers (batches, key-ordered units,
//!   retries, dead letters, offsets);
//! - [`handover`]: handing a revoked partition's work over;
//! - [`dead_letter`]: dead letters and moves to a retry tier, recorded in
//!   the store;
//! - [`hold`]: key hold-back's records for retry tiers;
//! - [`ready`]: a decoder made ready for a message (a schema registry's
//!   writer's schema fetched), its outage waited out.
//!
//! It imports `pipeline/` and the shared root, never the Kafka-only
//! runtime (`transactional/`); `scripts/architecture.py` checks it.

pub(crate) mod builder;
pub(crate) mod consumer;
pub(crate) mod dead_letter;
pub(crate) mod effect;
mod gauges;
pub(crate) mod handle;
pub(crate) mod handover;
pub(crate) mod hold;
pub(crate) mod partition;
pub(crate) mod ready;
pub(crate) mod route;
