//! Lease mode on PostgreSQL ([`LeaseStore`]): a claim held while an effect
//! outside the database runs, under a token from a sequence that fences a
//! holder whose lease was taken over.

use std::sync::Arc;
use std::time::SystemTime;

use dedup_core::{Acquire, DedupKey, Fingerprint, LeaseStore, StoreError, Token, Ttl};
use dedup_sql::{LeaseRow, TableName, held_or_done, sql, time_from_unix_micros, ttl_seconds};

use crate::{AGE_MICROS, EXPIRES_MICROS, PgStore, claim_id, store_error};

/// Lease mode's statements, each run as its own transaction.
pub(crate) struct LeaseStatements {
    acquire: Arc<str>,
    state: Arc<str>,
    extend: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
}

impl LeaseStatements {
    pub(crate) fn new(table: &TableName) -> Self {
        let t = table.quoted();
        // Validation admits no `'`: the quoted name is a safe literal.
        let tokens = table.quoted_with_suffix("_tokens");
        // The same create-or-take-over-if-expired as a claim, in progress
        // and under a new token from the sequence.
        let acquire = format!(
            "INSERT INTO {t} AS c \
                 (id, scope, key, claimed_at, expires_at, fingerprint, token, in_progress) \
             VALUES ($1, $2, $3, now(), now() + $4 * interval '1 second', $5, \
                 nextval('{tokens}'), true) \
             ON CONFLICT (id) DO UPDATE \
             SET claimed_at = EXCLUDED.claimed_at, expires_at = EXCLUDED.expires_at, \
                 fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token, in_progress = true \
             WHERE c.expires_at <= now() \
             RETURNING c.token, (c.xmax = 0) AS fresh"
        );
        let state = format!(
            "SELECT in_progress, coalesce(token, 0), {EXPIRES_MICROS}, {AGE_MICROS}, fingerprint \
             FROM {t} WHERE id = $1"
        );
        let held = "WHERE id = $1 AND token = $2 AND in_progress";
        LeaseStatements {
            acquire: acquire.into(),
            state: state.into(),
            extend: format!(
                "UPDATE {t} SET expires_at = now() + $3 * interval '1 second' {held} \
                 RETURNING {EXPIRES_MICROS}"
            )
            .into(),
            complete: format!(
                "UPDATE {t} SET expires_at = now() + $3 * interval '1 second', \
                     in_progress = false {held}"
            )
            .into(),
            release: format!("DELETE FROM {t} {held}").into(),
        }
    }
}

/// A token as PostgreSQL's `bigint` holds it (the sequence starts at 1).
fn token_param(token: Token) -> i64 {
    i64::try_from(token).unwrap_or(i64::MAX)
}

impl LeaseStore for PgStore {
    async fn acquire(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        lease: Ttl,
    ) -> Result<Acquire, StoreError> {
        let id = claim_id(key);
        let statements = &self.handle.statements().lease;
        // A claim that vanishes between the two statements (purged at its
        // expiry) is acquired on the next round.
        loop {
            let row: Option<(i64, bool)> = sqlx::query_as(sql(&statements.acquire))
                .bind(id)
                .bind(key.scope())
                .bind(key.id())
                .bind(ttl_seconds(lease))
                .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                .fetch_optional(self.handle.pool())
                .await
                .map_err(store_error)?;
            if let Some((token, fresh)) = row {
                return Ok(Acquire::Acquired {
                    token: token.unsigned_abs(),
                    reclaimed: !fresh,
                });
            }
            let row: Option<LeaseRow> = sqlx::query_as(sql(&statements.state))
                .bind(id)
                .fetch_optional(self.handle.pool())
                .await
                .map_err(store_error)?;
            match row {
                Some(row) => return Ok(held_or_done(row)),
                None => continue,
            }
        }
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: Token,
        lease: Ttl,
    ) -> Result<Option<SystemTime>, StoreError> {
        let expires: Option<i64> = sqlx::query_scalar(sql(&self.handle.statements().lease.extend))
            .bind(claim_id(key))
            .bind(token_param(token))
            .bind(ttl_seconds(lease))
            .fetch_optional(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(expires.map(time_from_unix_micros))
    }

    async fn complete(&self, key: &DedupKey, token: Token, ttl: Ttl) -> Result<bool, StoreError> {
        let done = sqlx::query(sql(&self.handle.statements().lease.complete))
            .bind(claim_id(key))
            .bind(token_param(token))
            .bind(ttl_seconds(ttl))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &DedupKey, token: Token) -> Result<bool, StoreError> {
        let released = sqlx::query(sql(&self.handle.statements().lease.release))
            .bind(claim_id(key))
            .bind(token_param(token))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(released.rows_affected() == 1)
    }
}
