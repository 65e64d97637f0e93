//! Lease mode on MySQL and MariaDB ([`LeaseStore`]): a claim held while an
//! effect outside the database runs, under a token from a counter row that
//! fences a holder whose lease was taken over.

use std::sync::Arc;
use std::time::SystemTime;

use crate::{ClaimRow, MySqlStore, NOW_US, new_tag, store_error, take_over_if_expired};
use dedup_core::{Acquire, DedupKey, Fingerprint, LeaseStore, StoreError, Token, Ttl};
use dedup_sql::{held_or_done, sql, time_from_unix_micros, ttl_seconds};

/// Lease mode's statements.
pub(crate) struct LeaseStatements {
    acquire: Arc<str>,
    next_token: Arc<str>,
    set_token: Arc<str>,
    extend: Arc<str>,
    expiry: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
}

impl LeaseStatements {
    pub(crate) fn new(t: &str, tokens: &str) -> Self {
        let update = take_over_if_expired(&[("token", "NULL"), ("in_progress", "1")]);
        let held = "WHERE scope = ? AND id = ? AND token = ? AND in_progress = 1";
        LeaseStatements {
            acquire: format!(
                "INSERT INTO {t} (scope, id, claimed_at, expires_at, fingerprint, tag, in_progress) \
                 VALUES (?, ?, {NOW_US}, {NOW_US} + ? * 1000000, ?, ?, 1) {update}"
            )
            .into(),
            // The connection's LAST_INSERT_ID, returned in the statement's
            // own result: no second read, no other session's value.
            next_token: format!("UPDATE {tokens} SET last = LAST_INSERT_ID(last + 1)").into(),
            set_token: format!("UPDATE {t} SET token = ? WHERE scope = ? AND id = ?").into(),
            extend: format!("UPDATE {t} SET expires_at = {NOW_US} + ? * 1000000 {held}").into(),
            expiry: format!("SELECT expires_at FROM {t} WHERE scope = ? AND id = ?").into(),
            complete: format!(
                "UPDATE {t} SET expires_at = {NOW_US} + ? * 1000000, in_progress = 0 {held}"
            )
            .into(),
            release: format!("DELETE FROM {t} {held}").into(),
        }
    }
}

/// A token as BIGINT holds it (the counter starts at 1).
fn token_param(token: Token) -> i64 {
    i64::try_from(token).unwrap_or(i64::MAX)
}

impl LeaseStore for MySqlStore {
    async fn acquire(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        lease: Ttl,
    ) -> Result<Acquire, StoreError> {
        let statements = &self.handle.statements().lease;
        let mut tx = self.begin_tx().await?;
        let tag = new_tag();
        sqlx::query(sql(&statements.acquire))
            .bind(key.scope())
            .bind(key.id())
            .bind(ttl_seconds(lease))
            .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(tag)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        let (taken, claims, expires_us, age_us, kept, in_progress, token): ClaimRow =
            sqlx::query_as(sql(&self.handle.statements().claimed))
                .bind(key.scope())
                .bind(key.id())
                .fetch_one(&mut *tx)
                .await
                .map_err(store_error)?;
        if taken != tag {
            tx.rollback().await.map_err(store_error)?;
            return Ok(held_or_done((
                in_progress != 0,
                token,
                expires_us,
                age_us,
                kept,
            )));
        }
        // The counter moves only with a lease taken, and its row is locked
        // only from here to the commit.
        let token = sqlx::query(sql(&statements.next_token))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?
            .last_insert_id();
        sqlx::query(sql(&statements.set_token))
            .bind(token_param(token))
            .bind(key.scope())
            .bind(key.id())
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(Acquire::Acquired {
            token,
            reclaimed: claims > 1,
        })
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: Token,
        lease: Ttl,
    ) -> Result<Option<SystemTime>, StoreError> {
        let statements = &self.handle.statements().lease;
        let mut tx = self.begin_tx().await?;
        // sqlx asks for found rows: the count is of rows matched (held),
        // even one whose new expiry equals its old.
        let held = sqlx::query(sql(&statements.extend))
            .bind(ttl_seconds(lease))
            .bind(key.scope())
            .bind(key.id())
            .bind(token_param(token))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?
            .rows_affected();
        if held != 1 {
            tx.rollback().await.map_err(store_error)?;
            return Ok(None);
        }
        let expires: i64 = sqlx::query_scalar(sql(&statements.expiry))
            .bind(key.scope())
            .bind(key.id())
            .fetch_one(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(Some(time_from_unix_micros(expires)))
    }

    async fn complete(&self, key: &DedupKey, token: Token, ttl: Ttl) -> Result<bool, StoreError> {
        let done = sqlx::query(sql(&self.handle.statements().lease.complete))
            .bind(ttl_seconds(ttl))
            .bind(key.scope())
            .bind(key.id())
            .bind(token_param(token))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &DedupKey, token: Token) -> Result<bool, StoreError> {
        let released = sqlx::query(sql(&self.handle.statements().lease.release))
            .bind(key.scope())
            .bind(key.id())
            .bind(token_param(token))
            .execute(self.handle.pool())
            .await
            .map_err(store_error)?;
        Ok(released.rows_affected() == 1)
    }
}
