//! What an operator asks of a store, whichever it is: one claim, the claims
//! per scope, the outbox's backlog. Each SQL backend answers through its own
//! `admin` module (`dedup_postgres::admin`, `dedup_mysql::admin`,
//! `dedup_sqlite::admin`), which owns its SQL; the operator tool and the
//! console know only these types and traits.

use std::future::Future;
use std::time::{Duration, SystemTime};

use crate::{DedupKey, Fingerprint, StoreError};

/// One claim as stored, with the store's clock when it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRecord {
    /// When it was taken (or last refreshed).
    pub claimed_at: SystemTime,
    /// When it expires; a lease in progress: when the lease ends.
    pub expires_at: SystemTime,
    /// The store's clock when the claim was read.
    pub now: SystemTime,
    /// The fingerprint of the event's content it keeps, if any.
    pub fingerprint: Option<Fingerprint>,
    /// A lease whose effect is still in progress.
    pub in_progress: bool,
}

impl ClaimRecord {
    /// A record read from a store.
    pub fn new(claimed_at: SystemTime, expires_at: SystemTime, now: SystemTime) -> Self {
        ClaimRecord {
            claimed_at,
            expires_at,
            now,
            fingerprint: None,
            in_progress: false,
        }
    }

    /// Sets the fingerprint it keeps.
    pub fn with_fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// Sets whether a lease is in progress.
    pub fn with_in_progress(mut self, in_progress: bool) -> Self {
        self.in_progress = in_progress;
        self
    }

    /// Whether it was live when read: a redelivery would be skipped.
    pub fn live(&self) -> bool {
        self.expires_at > self.now
    }

    /// Seconds from the read until its expiry (negative: since).
    pub fn expires_in_seconds(&self) -> f64 {
        match self.expires_at.duration_since(self.now) {
            Ok(left) => left.as_secs_f64(),
            Err(past) => -past.duration().as_secs_f64(),
        }
    }
}

/// The claims of one scope (one handler).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeSummary {
    /// The handler's scope.
    pub scope: String,
    /// Claims stored, live or expired.
    pub rows: u64,
    /// Of them, live.
    pub live: u64,
    /// The earliest expiry.
    pub oldest_expiry: SystemTime,
    /// The latest expiry.
    pub newest_expiry: SystemTime,
}

impl ScopeSummary {
    /// A scope's summary as read from a store.
    pub fn new(
        scope: String,
        rows: u64,
        live: u64,
        oldest_expiry: SystemTime,
        newest_expiry: SystemTime,
    ) -> Self {
        ScopeSummary {
            scope,
            rows,
            live,
            oldest_expiry,
            newest_expiry,
        }
    }
}

/// A claims table on disk, where the store can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableSize {
    /// The rows.
    pub table_bytes: u64,
    /// The indexes.
    pub index_bytes: u64,
    /// Everything, TOAST and the like included.
    pub total_bytes: u64,
}

impl TableSize {
    /// A table's size.
    pub fn new(table_bytes: u64, index_bytes: u64, total_bytes: u64) -> Self {
        TableSize {
            table_bytes,
            index_bytes,
            total_bytes,
        }
    }
}

/// The pending events of one topic in an outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicBacklog {
    /// The Kafka topic.
    pub topic: String,
    /// Events not yet published.
    pub pending: u64,
    /// How long the oldest has waited, on the store's clock.
    pub oldest_age: Duration,
    /// Pending events that failed at least once.
    pub failing: u64,
    /// Pending events a relay holds now (being published).
    pub leased: u64,
    /// Pending events whose lease ran out unfinished (their relay stopped
    /// or died): the next relay to look publishes them again.
    pub lease_expired: u64,
    /// The newest failure's reason.
    pub last_error: Option<String>,
}

impl TopicBacklog {
    /// A topic's backlog as read from a store; no failures or leases.
    pub fn new(topic: String, pending: u64, oldest_age: Duration) -> Self {
        TopicBacklog {
            topic,
            pending,
            oldest_age,
            failing: 0,
            leased: 0,
            lease_expired: 0,
            last_error: None,
        }
    }

    /// Sets the failing events and the newest failure's reason.
    pub fn with_failing(mut self, failing: u64, last_error: Option<String>) -> Self {
        self.failing = failing;
        self.last_error = last_error;
        self
    }

    /// Sets the leased events, held and expired.
    pub fn with_leases(mut self, leased: u64, lease_expired: u64) -> Self {
        self.leased = leased;
        self.lease_expired = lease_expired;
        self
    }
}

/// A claims table as an operator sees it.
pub trait ClaimsAdmin: Send + Sync {
    /// The claim of `key`, if one is stored (live or expired).
    fn claim(
        &self,
        key: &DedupKey,
    ) -> impl Future<Output = Result<Option<ClaimRecord>, StoreError>> + Send;

    /// Deletes the claim of `key`, so that its event is applied again when
    /// delivered again; returns what was deleted. A claim an open
    /// transaction holds is waited for (a few seconds, then an error).
    fn release(
        &self,
        key: &DedupKey,
    ) -> impl Future<Output = Result<Option<ClaimRecord>, StoreError>> + Send;

    /// The claims per scope, in scope order.
    fn scopes(&self) -> impl Future<Output = Result<Vec<ScopeSummary>, StoreError>> + Send;

    /// The table's size on disk, where the store can tell.
    fn size(&self) -> impl Future<Output = Result<Option<TableSize>, StoreError>> + Send;

    /// How many claims have expired (and wait for the purge).
    fn expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes at most `limit` expired claims; returns how many went.
    fn purge(&self, limit: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// An outbox table as an operator sees it.
pub trait OutboxAdmin: Send + Sync {
    /// The pending events per topic, in topic order.
    fn backlog_by_topic(
        &self,
    ) -> impl Future<Output = Result<Vec<TopicBacklog>, StoreError>> + Send;
}
