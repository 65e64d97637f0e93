//! A batch's claims on PostgreSQL: which exist (a read), the absent ones
//! inserted plainly, and the `ON CONFLICT` upsert only for expired claims
//! and for ids another transaction took since the read.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use dedup_core::{Claim, DedupKey, Fingerprint, StoreError, Ttl};
use dedup_sql::{
    BatchClaims, Taken, age_from_micros, fingerprint_from, sql, time_from_unix_micros, ttl_seconds,
};
use sqlx::Postgres;
use sqlx::postgres::{PgArguments, PgRow};
use uuid::Uuid;

use crate::{PgTx, Statements, claim_id, store_error};

/// A batch's claims, each statement over the whole batch: which claims
/// exist (a read: the live ones are the batch's duplicates, nothing written
/// or locked for them); the expired ones taken over through the upsert of
/// [`claim`](dedup_core::DedupStore::claim); the absent ones inserted
/// plainly, in a savepoint; the upsert again only for absent ones another
/// transaction took since the read; and a read of the claims the upserts
/// found live. The upsert for every key wrote a confirmation record per
/// row (speculative insertion) and locked each duplicate's row (a record,
/// and often a page image): 700-712 WAL bytes per event in the batched
/// benchmark, 482-484 this way.
///
/// Expired claims go first so that a batch holds, while it inserts, only
/// rows that every batch seeing them expired locks before its own insert:
/// two batches racing for the same keys then meet on those rows, not in a
/// cycle. A cycle needs a key to change between the two batches' reads
/// (another transaction's claim, a purge, a release); PostgreSQL ends it
/// (`40P01`) and the batch is retried as contention.
pub(crate) async fn claim_many(
    statements: &Statements,
    tx: &mut PgTx,
    keys: &[DedupKey],
    fingerprints: &[Option<Fingerprint>],
    ttl: Ttl,
) -> Result<Vec<Claim>, StoreError> {
    let mut batch = BatchClaims::new(keys, fingerprints);
    if batch.distinct().is_empty() {
        return Ok(Vec::new());
    }
    let keys_by_id: HashMap<Uuid, &DedupKey> = batch
        .distinct()
        .iter()
        .map(|&key| (claim_id(key), key))
        .collect();
    let all: Vec<Uuid> = keys_by_id.keys().copied().collect();
    let existing = read_claims(tx, &statements.expiry_many, &all).await?;
    let mut absent: HashSet<Uuid> = keys_by_id.keys().copied().collect();
    let mut expired = Vec::new();
    for claim in existing {
        absent.remove(&claim.id);
        match keys_by_id.get(&claim.id) {
            Some(key) if claim.live => claim.record(&mut batch, key),
            Some(_) => expired.push(claim.id),
            None => {}
        }
    }
    let mut claimer = Claimer {
        statements,
        keys_by_id: &keys_by_id,
        ttl: ttl_seconds(ttl),
        live: Vec::new(),
    };
    claimer.upsert(tx, &mut batch, &expired).await?;
    let absent: Vec<Uuid> = absent.into_iter().collect();
    let left = claimer.insert(tx, &mut batch, &absent).await?;
    claimer.upsert(tx, &mut batch, &left).await?;
    // Keys the upserts did not return hold live claims: read their expiry
    // in a new statement, which sees claims that committed while we waited.
    if !claimer.live.is_empty() {
        for claim in read_claims(tx, &statements.expiry_many, &claimer.live).await? {
            if let Some(key) = keys_by_id.get(&claim.id) {
                claim.record(&mut batch, key);
            }
        }
    }
    Ok(batch.finish())
}

/// The writing statements of one batch claim.
struct Claimer<'s, 'k> {
    statements: &'s Statements,
    keys_by_id: &'s HashMap<Uuid, &'k DedupKey>,
    /// The TTL in seconds (`$4`).
    ttl: i64,
    /// Ids the upsert found held by a live claim.
    live: Vec<Uuid>,
}

impl Claimer<'_, '_> {
    /// Inserts the claims of `ids` plainly, in a savepoint, and returns
    /// the ids it did not insert: all of them if another transaction took
    /// one since the read (a unique violation, rolled back to the
    /// savepoint), or if `id` is not the table's unique key.
    async fn insert(
        &self,
        tx: &mut PgTx,
        batch: &mut BatchClaims<'_>,
        ids: &[Uuid],
    ) -> Result<Vec<Uuid>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = ClaimRows::of(batch, self.keys_by_id, ids);
        savepoint(tx, "SAVEPOINT dedup_claim").await?;
        let inserted = rows
            .bind(sqlx::query(sql(&self.statements.insert_many)), self.ttl)
            .fetch_all(&mut **tx)
            .await;
        let inserted = match inserted {
            Ok(inserted) => inserted,
            Err(e) if is_unique_violation(&e) => {
                savepoint(
                    tx,
                    "ROLLBACK TO SAVEPOINT dedup_claim; RELEASE SAVEPOINT dedup_claim",
                )
                .await?;
                return Ok(ids.to_vec());
            }
            Err(e) => return Err(store_error(e)),
        };
        savepoint(tx, "RELEASE SAVEPOINT dedup_claim").await?;
        self.taken(batch, &inserted, ids)
    }

    /// Claims `ids` with the upsert: each is created, taken over if
    /// expired, or (no row returned) kept in `live` to be read.
    async fn upsert(
        &mut self,
        tx: &mut PgTx,
        batch: &mut BatchClaims<'_>,
        ids: &[Uuid],
    ) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let rows = ClaimRows::of(batch, self.keys_by_id, ids);
        let taken = rows
            .bind(sqlx::query(sql(&self.statements.claim_many)), self.ttl)
            .fetch_all(&mut **tx)
            .await
            .map_err(store_error)?;
        let left = self.taken(batch, &taken, ids)?;
        self.live.extend(left);
        Ok(())
    }

    /// Records the claims a writing statement returned (`id`, `fresh`,
    /// `expires_us`) and returns the ids of `ids` it did not return.
    fn taken(
        &self,
        batch: &mut BatchClaims<'_>,
        rows: &[PgRow],
        ids: &[Uuid],
    ) -> Result<Vec<Uuid>, StoreError> {
        let mut left: HashSet<Uuid> = ids.iter().copied().collect();
        for row in rows {
            let (id, fresh, expires_us): (Uuid, bool, i64) =
                sqlx::FromRow::from_row(row).map_err(store_error)?;
            if let Some(key) = self.keys_by_id.get(&id) {
                left.remove(&id);
                let taken = if fresh {
                    Taken::Fresh
                } else {
                    Taken::Reclaimed
                };
                let expires_at = time_from_unix_micros(expires_us);
                batch.claimed(key.scope(), key.id(), taken, expires_at);
            }
        }
        Ok(left.into_iter().collect())
    }
}

/// A savepoint statement of the batch's insert.
async fn savepoint(tx: &mut PgTx, statement: &'static str) -> Result<(), StoreError> {
    sqlx::raw_sql(statement)
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
    Ok(())
}

/// A claim row as the batch's reads return it.
struct ClaimRead {
    id: Uuid,
    expires_us: i64,
    age_us: i64,
    fingerprint: Option<Vec<u8>>,
    live: bool,
}

impl ClaimRead {
    /// Answers `key` with this claim: a live claim (a duplicate).
    fn record(self, batch: &mut BatchClaims<'_>, key: &DedupKey) {
        batch.live(
            key.scope(),
            key.id(),
            time_from_unix_micros(self.expires_us),
            age_from_micros(self.age_us),
            fingerprint_from(self.fingerprint),
        );
    }
}

/// The claims of `ids` that exist (`expiry_many`).
async fn read_claims(
    tx: &mut PgTx,
    statement: &Arc<str>,
    ids: &[Uuid],
) -> Result<Vec<ClaimRead>, StoreError> {
    let rows = sqlx::query(sql(statement))
        .bind(ids)
        .fetch_all(&mut **tx)
        .await
        .map_err(store_error)?;
    rows.iter()
        .map(|row| {
            let (id, expires_us, age_us, fingerprint, live) = sqlx::FromRow::from_row(row)?;
            Ok(ClaimRead {
                id,
                expires_us,
                age_us,
                fingerprint,
                live,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(store_error)
}

/// The columns of the claims a batch writes, as the arrays its insert and
/// upsert unnest (`$1`, `$2`, `$3`, `$5`; `$4` is the TTL).
struct ClaimRows<'k> {
    ids: Vec<Uuid>,
    scopes: Vec<&'k str>,
    keys: Vec<&'k str>,
    /// None where no key keeps a fingerprint (a NULL array).
    fingerprints: Option<Vec<Option<Vec<u8>>>>,
}

impl<'k> ClaimRows<'k> {
    fn of(batch: &BatchClaims<'_>, keys_by_id: &HashMap<Uuid, &'k DedupKey>, ids: &[Uuid]) -> Self {
        let keys: Vec<&'k DedupKey> = ids.iter().map(|id| keys_by_id[id]).collect();
        let kept: Vec<Option<Fingerprint>> =
            keys.iter().map(|key| batch.fingerprint(key)).collect();
        ClaimRows {
            ids: ids.to_vec(),
            scopes: keys.iter().map(|key| key.scope()).collect(),
            keys: keys.iter().map(|key| key.id()).collect(),
            fingerprints: kept.iter().any(Option::is_some).then(|| {
                kept.iter()
                    .map(|f| f.as_ref().map(|f| f.as_bytes().to_vec()))
                    .collect()
            }),
        }
    }

    fn bind<'q>(
        &'q self,
        query: sqlx::query::Query<'q, Postgres, PgArguments>,
        ttl: i64,
    ) -> sqlx::query::Query<'q, Postgres, PgArguments> {
        query
            .bind(&self.ids)
            .bind(&self.scopes)
            .bind(&self.keys)
            .bind(ttl)
            .bind(&self.fingerprints)
    }
}

/// A unique violation (`23505`): a claim inserted by another transaction
/// since the batch read its rows.
fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "23505")
}
