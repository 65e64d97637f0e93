//! Schemas v3 and v4: claims keep a fingerprint of their event's content,
//! and lease mode's token and state. A filled v2 table gains the columns
//! in place, without a rewrite; its claims (kept without a fingerprint)
//! still answer as duplicates of any content, and as done to a lease.

use std::time::Instant;

use dedup_core::{Acquire, Claim, DedupKey, DedupStore, Fingerprint, LeaseStore, Ttl};
use dedup_postgres::PgStore;
use dedup_sql::{TableName, run_migrations};
use sqlx::PgPool;
use sqlx::migrate::Migrator;

const CLAIMS: i64 = 100_000;

/// The claims table as version 2 of the migrations left it.
async fn migrate_to_v2(pool: &PgPool) {
    let all = sqlx::migrate!("./migrations");
    let v2 = Migrator::with_migrations(all.iter().filter(|m| m.version <= 2).cloned().collect());
    let table = TableName::parse("dedup_claims").expect("table name");
    run_migrations(pool, &v2, &table).await.expect("v2");
}

/// The file the table's rows are in: a rewrite gives it a new one.
async fn relfilenode(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT relfilenode::int8 FROM pg_class WHERE oid = 'dedup_claims'::regclass",
    )
    .fetch_one(pool)
    .await
    .expect("relfilenode")
}

#[sqlx::test(migrations = false)]
async fn a_filled_v2_table_gains_fingerprints_in_place(pool: PgPool) {
    migrate_to_v2(&pool).await;
    sqlx::query(
        "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
         SELECT dedup_claims_claim_id('payments', 'evt-' || g), 'payments', 'evt-' || g, \
             now() - interval '10 minutes', now() + interval '3 hours' \
         FROM generate_series(1, $1) g",
    )
    .bind(CLAIMS)
    .execute(&pool)
    .await
    .expect("fill v2");
    let file = relfilenode(&pool).await;

    let store = PgStore::from_pool(pool.clone());
    let started = Instant::now();
    store.migrate().await.expect("migrate to v3");
    let took = started.elapsed();
    eprintln!("{CLAIMS} claims: the upgrade to v4 took {took:?}");
    assert_eq!(relfilenode(&pool).await, file, "no row was rewritten");
    let columns: Vec<(String, String)> = sqlx::query_as(
        "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute \
         WHERE attrelid = 'dedup_claims'::regclass AND attnum > 4 AND NOT attisdropped \
         ORDER BY attnum",
    )
    .fetch_all(&pool)
    .await
    .expect("columns");
    let columns: Vec<(&str, &str)> = columns
        .iter()
        .map(|(name, kind)| (name.as_str(), kind.as_str()))
        .collect();
    assert_eq!(
        columns,
        [
            ("id", "uuid"),
            ("fingerprint", "bytea"),
            ("token", "bigint"),
            ("in_progress", "boolean")
        ]
    );
    store.migrate().await.expect("migrating again does nothing");

    // A v2 claim is a duplicate of any content: it kept no fingerprint.
    let ttl = Ttl::from_secs(3600).expect("ttl");
    let content = Fingerprint::of_payload(b"other content");
    let given = Some(content);
    let old = DedupKey::new("payments", "evt-7").expect("key");
    let mut tx = store.begin().await.expect("begin");
    let claim = store.claim(&mut tx, &old, given, ttl).await.expect("claim");
    let batch = store
        .claim_many(&mut tx, std::slice::from_ref(&old), &[given], ttl)
        .await
        .expect("claim_many");
    store.rollback(tx).await.expect("rollback");
    for claim in [claim, batch[0]] {
        assert!(
            matches!(
                claim,
                Claim::Duplicate {
                    fingerprint: None,
                    ..
                }
            ),
            "{claim:?}"
        );
    }

    // To lease mode, a v2 claim is done: its effect happened.
    let acquired = store.acquire(&old, given, ttl).await.expect("acquire");
    assert!(
        matches!(
            acquired,
            Acquire::Done {
                fingerprint: None,
                ..
            }
        ),
        "{acquired:?}"
    );

    // A new claim keeps its fingerprint, as 16 bytes.
    let new = DedupKey::new("payments", "evt-new").expect("key");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        store.claim(&mut tx, &new, given, ttl).await.expect("claim"),
        Claim::Fresh
    );
    store.commit(tx).await.expect("commit");
    let kept: Vec<u8> = sqlx::query_scalar(
        "SELECT fingerprint FROM dedup_claims WHERE id = dedup_claims_claim_id('payments', 'evt-new')",
    )
    .fetch_one(&pool)
    .await
    .expect("kept");
    assert_eq!(kept, content.as_bytes());
}
