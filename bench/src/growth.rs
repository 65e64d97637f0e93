//! `batched-full`: the `batched` mode on a claims table that already holds
//! `--claims` live claims (10,000,000 by default: a day at about 100
//! events/s with a 1-day TTL), to show what the claim path costs as the
//! table grows. The full table is its own (`bench_full_claims`), filled
//! once and kept between runs and rounds, so `batched` (on the empty
//! default table) and `batched-full` can run interleaved; each run first
//! deletes the claims the previous run wrote and vacuums.

use std::time::Instant;

use dedup_postgres::{PgConfig, PgStore};

use crate::BoxError;

/// The full table's name (written out in the statements below).
pub(crate) const FULL_TABLE: &str = "bench_full_claims";
/// The scope of the claims that fill it.
const FILLER: &str = "bench::filler";
/// Rows per fill statement.
const CHUNK: i64 = 500_000;

/// The store settings of `mode`: `batched-full` claims in the full table.
pub(crate) fn config(mode: &str) -> PgConfig {
    let config = PgConfig::default().with_max_connections(20);
    if mode == "batched-full" {
        config.with_table(FULL_TABLE)
    } else {
        config
    }
}

/// Makes the full table hold exactly `claims` live filler claims and
/// nothing else; returns its size on disk afterwards (bytes: heap,
/// indexes).
pub(crate) async fn prepare(store: &PgStore, claims: i64) -> Result<(i64, i64), BoxError> {
    let pool = store.pool();
    let others = sqlx::query("DELETE FROM bench_full_claims WHERE scope <> $1")
        .bind(FILLER)
        .execute(pool)
        .await?
        .rows_affected();
    // Live for an hour more at least, or filled again: a table kept from a
    // day before holds expired claims, which the run would not measure.
    let have: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM bench_full_claims WHERE expires_at > now() + interval '1 hour'",
    )
    .fetch_one(pool)
    .await?;
    if have != claims {
        sqlx::query("TRUNCATE bench_full_claims")
            .execute(pool)
            .await?;
        let started = Instant::now();
        let mut from = 0i64;
        while from < claims {
            let to = (from + CHUNK).min(claims);
            // Expiries spread over the day after the next two hours, as a
            // day's traffic at a steady rate with a 1-day TTL leaves them;
            // ids as the store makes them.
            sqlx::query(
                "INSERT INTO bench_full_claims (id, scope, key, claimed_at, expires_at) \
                 SELECT bench_full_claims_claim_id($1, 'filler-' || g), $1, 'filler-' || g, \
                     now() - interval '22 hours' + (g::float8 / $2) * interval '1 day', \
                     now() + interval '2 hours' + (g::float8 / $2) * interval '1 day' \
                 FROM generate_series($3::int8, $4::int8 - 1) g",
            )
            .bind(FILLER)
            .bind(claims as f64)
            .bind(from)
            .bind(to)
            .execute(pool)
            .await?;
            from = to;
            eprintln!(
                "  batched-full: {from} of {claims} claims written ({:.0} s)",
                started.elapsed().as_secs_f64()
            );
        }
    }
    if have != claims || others > 0 {
        sqlx::query("VACUUM ANALYZE bench_full_claims")
            .execute(pool)
            .await?;
    }
    size(store).await
}

/// The full table's heap and index bytes.
pub(crate) async fn size(store: &PgStore) -> Result<(i64, i64), BoxError> {
    Ok(sqlx::query_as(
        "SELECT pg_table_size('bench_full_claims'), pg_indexes_size('bench_full_claims')",
    )
    .fetch_one(store.pool())
    .await?)
}
