//! Purging large tables (expired claims, sent outbox events) under the
//! plans PostgreSQL may choose for the purge statements: the generic plan
//! it caches for a prepared statement after five runs (made without the
//! LIMIT's value: it guesses a tenth of the table), and plans made from
//! statistics gathered when the table looked nothing like now. A batch
//! must read about what it deletes, whatever the plan. Each case has its
//! own database.

use std::time::Duration;

use dedup_core::{Claim, DedupKey, DedupStore, OutboxSource, PurgeExpired, Ttl};
use dedup_postgres::{OutboxConfig, OutboxWriter, PgStore, Retention};
use sqlx::PgPool;

mod common;
use common::{assert_reads_are_counted, fill_and_analyze, generic_plan_pool, rows_read};

/// Ten purge batches of 1,000 through `purge`: every batch full, and all
/// ten together reading fewer than `limit` rows of `table` (which holds
/// `held`); then the control that such reads are counted at all.
async fn ten_batches_read_less_than<F, Fut>(
    pool: &PgPool,
    table: &str,
    count_all: &'static str,
    (limit, held): (i64, i64),
    mut purge: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    let before = rows_read(pool, table).await;
    let mut purged = 0;
    for _ in 0..10 {
        purged += purge().await;
    }
    let read = rows_read(pool, table).await - before;
    assert_eq!(purged, 10_000, "ten full batches of {table}");
    assert!(
        read < limit,
        "10 purge batches of 1,000 read {read} rows (the table holds {held})"
    );
    assert_reads_are_counted(pool, table, count_all).await;
}

/// The purge statement joined its batch back to the table: under a
/// generic plan each batch of 1,000 read all the table's rows (a hash
/// join over a sequential scan), so a consumer whose table grew past a few
/// hundred thousand claims saw its purger run for many minutes while the
/// table kept growing. A batch must read only what it deletes.
#[sqlx::test(migrations = false)]
async fn a_purge_batch_reads_what_it_deletes_not_the_whole_table(pool: PgPool) {
    let pool = generic_plan_pool(&pool).await;
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    let expired = 50_000i64;
    fill_and_analyze(
        &pool,
        "dedup_claims",
        "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
         SELECT dedup_claims_claim_id('old', g::text), 'old', g::text, now() - interval '2 hours', now() - interval '1 hour' \
         FROM generate_series(1, $1) g \
         UNION ALL \
         SELECT dedup_claims_claim_id('live', g::text), 'live', g::text, now(), now() + interval '1 hour' FROM generate_series(1, 1000) g",
        expired,
    )
    .await;

    ten_batches_read_less_than(
        &pool,
        "dedup_claims",
        "SELECT count(claimed_at) FROM dedup_claims",
        (expired, expired + 1000),
        || async { store.purge_expired(1000).await.expect("purge") },
    )
    .await;

    // And the rest goes, the live claims stay.
    while store.purge_expired(1000).await.expect("purge") > 0 {}
    let left: Vec<(String, i64)> =
        sqlx::query_as("SELECT scope, count(*) FROM dedup_claims GROUP BY scope")
            .fetch_all(&pool)
            .await
            .expect("count");
    assert_eq!(left, vec![("live".to_owned(), 1000)]);
}

/// The same for the relay's purge of sent events (kept for the retention):
/// `seq IN (batch)` was a hash join over the whole outbox per batch.
#[sqlx::test(migrations = false)]
async fn an_outbox_purge_batch_reads_what_it_deletes_not_the_whole_table(pool: PgPool) {
    let pool = generic_plan_pool(&pool).await;
    let outbox = OutboxWriter::new(
        OutboxConfig::default().with_retention(Retention::Keep(Duration::from_secs(3600))),
    )
    .expect("config");
    outbox.migrate(&pool).await.expect("migrate");
    let source = outbox.reader(pool.clone());
    let old = 50_000i64;
    fill_and_analyze(
        &pool,
        "dedup_outbox",
        "INSERT INTO dedup_outbox (event_id, topic, payload, header_names, header_values, sent_at) \
         SELECT g::text, 't', 'x'::bytea, '{}'::text[], '{}'::bytea[], now() - interval '2 hours' \
         FROM generate_series(1, $1) g \
         UNION ALL \
         SELECT 'recent-' || g, 't', 'x'::bytea, '{}'::text[], '{}'::bytea[], now() FROM generate_series(1, 1000) g",
        old,
    )
    .await;

    ten_batches_read_less_than(
        &pool,
        "dedup_outbox",
        "SELECT count(payload) FROM dedup_outbox",
        (old, old + 1000),
        || async { source.purge_sent(1000).await.expect("purge") },
    )
    .await;
    while source.purge_sent(1000).await.expect("purge") > 0 {}
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_outbox")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 1000, "the events sent within the retention stay");
}

/// Statistics gathered while every claim lay hours ahead (a 4 h TTL), then
/// the table emptied and refilled with claims that expire (a 10 s TTL): the
/// planner, sure that nothing is expired, fetched each batch's rows back
/// through the expiry index, reading every expired claim per batch (199,000
/// rows for a batch of 1,000), and the purger fell ever further behind.
#[sqlx::test(migrations = false)]
async fn a_purge_batch_reads_what_it_deletes_under_stale_statistics(pool: PgPool) {
    let pool = generic_plan_pool(&pool).await;
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    for statement in [
        // Autoanalyze must not refresh the statistics before the purge.
        "ALTER TABLE dedup_claims SET (autovacuum_enabled = off)",
        "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
         SELECT dedup_claims_claim_id('ahead', g::text), 'ahead', g::text, now(), now() + interval '4 hours' + g * interval '10 microseconds' \
         FROM generate_series(1, 100000) g",
        "ANALYZE dedup_claims",
        "TRUNCATE dedup_claims",
        "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
         SELECT dedup_claims_claim_id('old', g::text), 'old', g::text, now() - interval '2 hours', \
             now() - interval '1 minute' + g * interval '100 microseconds' \
         FROM generate_series(1, 50000) g",
    ] {
        sqlx::query(statement)
            .execute(&pool)
            .await
            .expect(statement);
    }
    ten_batches_read_less_than(
        &pool,
        "dedup_claims",
        "SELECT count(claimed_at) FROM dedup_claims",
        (50_000, 50_000),
        || async { store.purge_expired(1000).await.expect("purge") },
    )
    .await;
}

/// A purge running while a claim takes over an expired row (the claim's
/// transaction still open) leaves that row alone, and after the claim
/// commits the row is live: the purge never deletes a claim someone holds.
#[sqlx::test(migrations = false)]
async fn a_purge_leaves_a_claim_being_taken_over(pool: PgPool) {
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    sqlx::query(
        "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
         SELECT dedup_claims_claim_id('s', k), 's', k, now() - interval '2 hours', \
             now() - interval '1 hour' FROM unnest(ARRAY['taken', 'left']) AS k",
    )
    .execute(&pool)
    .await
    .expect("fill");
    let key = DedupKey::new("s", "taken").expect("key");
    let hour = Ttl::from_secs(3600).expect("ttl");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        store.claim(&mut tx, &key, None, hour).await.expect("claim"),
        Claim::Reclaimed
    );
    // A purge that waited for the claim's lock would wait for ever (the
    // claim commits after it): bounded, so that fails instead of hanging.
    let purged = tokio::time::timeout(Duration::from_secs(30), store.purge_expired(1000))
        .await
        .expect("the purge waited for a claim's lock")
        .expect("purge");
    assert_eq!(purged, 1, "only the expired claim nobody holds");
    store.commit(tx).await.expect("commit");
    assert_eq!(store.purge_expired(1000).await.expect("purge"), 0);
    let mut tx = store.begin().await.expect("begin");
    assert!(
        matches!(
            store.claim(&mut tx, &key, None, hour).await.expect("claim"),
            Claim::Duplicate { .. }
        ),
        "the claim taken over during the purge is live"
    );
    store.rollback(tx).await.expect("rollback");
}
