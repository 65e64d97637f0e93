//! Claims found by a digest of scope and key (schema v2): a filled v1
//! table upgraded in place keeps every claim, the SQL spelling of the
//! digest is the store's, and the runtime's ordered reads of dead-letter
//! records stay on an index. Each case has its own database.

use std::time::{Duration, Instant, SystemTime};

use dedup_core::{Claim, Classification, DedupKey, DedupStore, ORDERED_SCOPE_PREFIX, Ttl};
use dedup_postgres::{PgStore, claim_id};
use dedup_sql::{TableName, run_migrations};
use sqlx::PgPool;
use sqlx::migrate::Migrator;

mod common;
use common::{assert_reads_are_counted, fill_and_analyze, generic_plan_pool, rows_read};

fn key(scope: &str, id: &str) -> DedupKey {
    DedupKey::new(scope, id).expect("key")
}

fn dead_letter_scope() -> String {
    format!("{ORDERED_SCOPE_PREFIX}payments/orders/0")
}

/// The table `name` (`[schema.]table`) as version 1 of the migrations
/// left it.
async fn migrate_to_v1(pool: &PgPool, name: &str) {
    let all = sqlx::migrate!("./migrations");
    let v1 = Migrator::with_migrations(all.iter().filter(|m| m.version == 1).cloned().collect());
    let table = TableName::parse(name).expect("table name");
    run_migrations(pool, &v1, &table).await.expect("v1");
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass($1) \
         AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
    )
    .bind(table.quoted())
    .fetch_all(pool)
    .await
    .expect("columns");
    assert_eq!(columns, ["scope", "key", "claimed_at", "expires_at"], "v1");
}

async fn primary_key(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT a.attname::text FROM pg_index i \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
         WHERE i.indrelid = 'dedup_claims'::regclass AND i.indisprimary ORDER BY a.attnum",
    )
    .fetch_all(pool)
    .await
    .expect("primary key")
}

/// Claims taken under v1 (live, expired, dead-letter records) answer the
/// same after the upgrade: a live one is a duplicate with its expiry and
/// age, an expired one is taken over, a dead-letter record is listed.
#[sqlx::test(migrations = false)]
async fn a_filled_v1_table_upgrades_in_place(pool: PgPool) {
    migrate_to_v1(&pool, "dedup_claims").await;
    let records = dead_letter_scope();
    sqlx::query(
        "INSERT INTO dedup_claims (scope, key, claimed_at, expires_at) \
         SELECT 'payments', 'evt-' || g, now() - interval '10 minutes', \
             now() + interval '3 hours 50 minutes' FROM generate_series(1, 20000) g \
         UNION ALL \
         SELECT 'payments', 'evt-' || g, now() - interval '5 hours', now() - interval '1 hour' \
         FROM generate_series(20001, 25000) g \
         UNION ALL \
         SELECT $1, lpad(g::text, 20, '0') || '.ab', now(), now() + interval '1 day' \
         FROM generate_series(1, 30) g",
    )
    .bind(&records)
    .execute(&pool)
    .await
    .expect("fill v1");
    let v1_expiry: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at)::float8 FROM dedup_claims \
         WHERE scope = 'payments' AND key = 'evt-1'",
    )
    .fetch_one(&pool)
    .await
    .expect("v1 expiry");

    let store = PgStore::from_pool(pool.clone());
    let started = Instant::now();
    store.migrate().await.expect("upgrade to v2");
    eprintln!("upgraded 25,030 claims in {:?}", started.elapsed());
    store
        .migrate()
        .await
        .expect("a second migrate does nothing");

    assert_eq!(primary_key(&pool).await, ["id"]);
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE tablename = 'dedup_claims' ORDER BY indexname",
    )
    .fetch_all(&pool)
    .await
    .expect("indexes");
    assert_eq!(
        indexes,
        [
            "CREATE INDEX dedup_claims_expires_at_idx ON public.dedup_claims USING btree (expires_at)",
            "CREATE INDEX dedup_claims_ordered_idx ON public.dedup_claims USING btree (scope, key) \
             WHERE (scope ~~ 'dedup.dead-letter/%'::text)",
            "CREATE UNIQUE INDEX dedup_claims_pkey ON public.dedup_claims USING btree (id)",
        ],
        "the purge's expiry index rebuilt, the ordered index for dead-letter records"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_claims")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, 25_030, "every claim kept");

    let keys = [
        key("payments", "evt-1"),
        key("payments", "evt-20000"),
        key("payments", "evt-20001"),
        key("payments", "evt-new"),
    ];
    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, &keys, &[], Ttl::from_secs(3600).expect("ttl"))
        .await
        .expect("claim");
    store.commit(tx).await.expect("commit");
    let Claim::Duplicate {
        expires_at, age, ..
    } = claims[0]
    else {
        panic!("a live v1 claim is a duplicate after the upgrade: {claims:?}");
    };
    let expiry = expires_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs_f64();
    assert!((expiry - v1_expiry).abs() < 0.001, "its expiry kept");
    assert!(
        (Duration::from_secs(599)..Duration::from_secs(700)).contains(&age),
        "its age kept: {age:?}"
    );
    assert!(matches!(claims[1], Claim::Duplicate { .. }), "{claims:?}");
    assert_eq!(
        claims[2],
        Claim::Reclaimed,
        "an expired v1 claim is taken over"
    );
    assert_eq!(claims[3], Claim::Fresh);

    let from = key(&records, &format!("{:020}", 25));
    let listed = store.live_ids_from(&from).await.expect("records");
    let expected: Vec<String> = (25..=30).map(|n| format!("{n:020}.ab")).collect();
    assert_eq!(
        listed, expected,
        "the dead-letter records from offset 25 on"
    );
}

/// The function the upgrade fills `id` with, which operators query by, is
/// the digest the store computes, for any text.
#[sqlx::test(migrations = false)]
async fn the_sql_claim_id_is_the_stores(pool: PgPool) {
    PgStore::from_pool(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    for (scope, id) in [
        ("s", "k"),
        ("ab", "c"),
        ("a", "bc"),
        ("payments::récord", "évt-😀-1"),
        ("x", &"long".repeat(100)),
    ] {
        let k = key(scope, id);
        let in_sql: uuid::Uuid = sqlx::query_scalar("SELECT dedup_claims_claim_id($1, $2)")
            .bind(k.scope())
            .bind(k.id())
            .fetch_one(&pool)
            .await
            .expect("sql digest");
        assert_eq!(in_sql, claim_id(&k), "({scope:?}, {id:?})");
    }
}

/// The runtime reads each assigned partition's dead-letter records in key
/// order: with the primary key on the digest, a partial index keeps those
/// scopes in order, and the read touches the records, not the table.
#[sqlx::test(migrations = false)]
async fn dead_letter_records_are_read_through_an_index(pool: PgPool) {
    let pool = generic_plan_pool(&pool).await;
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    let records = dead_letter_scope();
    fill_and_analyze(
        &pool,
        "dedup_claims",
        "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
         SELECT dedup_claims_claim_id(s, k), s, k, now(), now() + interval '4 hours' \
         FROM (SELECT 'payments' AS s, 'evt-' || g AS k FROM generate_series(1, 100000) g \
               UNION ALL \
               SELECT $1, lpad(g::text, 20, '0') || '.ab' FROM generate_series(1, 50) g) AS c",
        &records,
    )
    .await;

    let before = rows_read(&pool, "dedup_claims").await;
    // More than five runs: the generic plan is the one measured.
    for _ in 0..7 {
        let listed = store
            .live_ids_from(&key(&records, &format!("{:020}", 41)))
            .await
            .expect("records");
        assert_eq!(listed.len(), 10, "offsets 41 to 50");
    }
    let read = rows_read(&pool, "dedup_claims").await - before;
    assert!(
        read < 1_000,
        "7 reads of 10 records read {read} rows of a table of 100,050"
    );
    assert_reads_are_counted(
        &pool,
        "dedup_claims",
        "SELECT count(claimed_at) FROM dedup_claims",
    )
    .await;

    // A scope the runtime does not name is still answered, by a scan.
    let listed = store
        .live_ids_from(&key("payments", "evt-99998"))
        .await
        .expect("any scope");
    assert_eq!(listed, ["evt-99998", "evt-99999"]);
}

/// A table in a schema of its own upgrades too: the v1 expiry index, which
/// lives in that schema, is found, dropped and built again.
#[sqlx::test(migrations = false)]
async fn a_schema_qualified_v1_table_upgrades_in_place(pool: PgPool) {
    migrate_to_v1(&pool, "billing.Claims").await;
    sqlx::query(
        r#"INSERT INTO billing."Claims" (scope, key, claimed_at, expires_at)
           VALUES ('payments', 'evt-1', now(), now() + interval '1 hour')"#,
    )
    .execute(&pool)
    .await
    .expect("fill v1");
    let config = dedup_postgres::PgConfig::default().with_table("billing.Claims");
    let store = PgStore::from_pool_with(pool.clone(), config).expect("store");
    store.migrate().await.expect("upgrade to v2");

    let mut tx = store.begin().await.expect("begin");
    let claim = store
        .claim(
            &mut tx,
            &key("payments", "evt-1"),
            None,
            Ttl::from_secs(3600).expect("ttl"),
        )
        .await
        .expect("claim");
    store.rollback(tx).await.expect("rollback");
    assert!(matches!(claim, Claim::Duplicate { .. }), "{claim:?}");
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = 'billing' \
         AND tablename = 'Claims' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .expect("indexes");
    assert_eq!(
        indexes,
        ["Claims_expires_at_idx", "Claims_ordered_idx", "Claims_pkey"]
    );
}

/// What a batch claim wrote, read inside its transaction: per id, whether
/// its row version is this transaction's own (`xmin` its top-level id: the
/// `ON CONFLICT` statement) or a subtransaction's (the plain insert, in its
/// savepoint), and whether this transaction locked it (`xmax`).
async fn written_by(
    tx: &mut dedup_postgres::PgTx,
    table: &str,
    ids: &[uuid::Uuid],
) -> Vec<(bool, bool)> {
    let mut out = Vec::new();
    for id in ids {
        let (top, locked): (bool, bool) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT xmin::text::int8 = pg_current_xact_id()::text::int8 % 4294967296, \
                    xmax::text::int8 = pg_current_xact_id()::text::int8 % 4294967296 \
             FROM {table} WHERE id = $1"
        )))
        .bind(id)
        .fetch_one(&mut **tx)
        .await
        .expect("the claim's row");
        out.push((top, locked));
    }
    out
}

/// A batch claims its new keys with a plain insert (no speculative
/// insertion: its rows are the savepoint's), takes an expired claim over
/// with the upsert (the transaction's own), and neither writes nor locks a
/// live duplicate's row: on a fresh table and on a v1 table upgraded in
/// place, where `id` was added last.
#[sqlx::test(migrations = false)]
async fn a_batch_inserts_new_claims_plainly_and_leaves_duplicates_alone(pool: PgPool) {
    for (table, quoted) in [
        ("dedup_claims", "dedup_claims"),
        ("billing.Claims", r#"billing."Claims""#),
    ] {
        if table == "billing.Claims" {
            migrate_to_v1(&pool, table).await;
        }
        let config = dedup_postgres::PgConfig::default().with_table(table);
        let store = PgStore::from_pool_with(pool.clone(), config).expect("store");
        store.migrate().await.expect("migrate");
        let ttl = Ttl::from_secs(3600).expect("ttl");
        let (live, expired) = (key("payments", "live"), key("payments", "expired"));
        let mut tx = store.begin().await.expect("begin");
        store
            .claim_many(&mut tx, &[live.clone(), expired.clone()], &[], ttl)
            .await
            .expect("first claims");
        store.commit(tx).await.expect("commit");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {quoted} SET expires_at = now() - interval '1 second' WHERE id = $1"
        )))
        .bind(claim_id(&expired))
        .execute(&pool)
        .await
        .expect("expire one");

        let keys = [
            key("payments", "new-1"),
            live,
            expired,
            key("payments", "new-2"),
        ];
        let mut tx = store.begin().await.expect("begin");
        let claims = store
            .claim_many(&mut tx, &keys, &[], ttl)
            .await
            .expect("claim_many");
        let ids: Vec<uuid::Uuid> = keys.iter().map(claim_id).collect();
        let written = written_by(&mut tx, quoted, &ids).await;
        store.commit(tx).await.expect("commit");

        assert_eq!(claims[0], Claim::Fresh, "{table}: {claims:?}");
        assert!(
            matches!(claims[1], Claim::Duplicate { .. }),
            "{table}: {claims:?}"
        );
        assert_eq!(claims[2], Claim::Reclaimed, "{table}: {claims:?}");
        assert_eq!(claims[3], Claim::Fresh, "{table}: {claims:?}");
        let said = format!(
            "{table}: (row version the transaction's own, locked by it) per key: {written:?}"
        );
        assert_eq!(
            written[0],
            (false, false),
            "new, inserted in the savepoint: {said}"
        );
        assert_eq!(
            written[3],
            (false, false),
            "new, inserted in the savepoint: {said}"
        );
        assert_eq!(
            written[1],
            (false, false),
            "live, neither written nor locked: {said}"
        );
        assert!(written[2].0, "expired, taken over by the upsert: {said}");
    }
}

/// Between two versions of the table the store's errors are the
/// environment's, so the runtime waits them out instead of dead-lettering
/// good events: a table not migrated yet (no `id` column), and one whose
/// key a newer version changed (no unique key on `id` for `ON CONFLICT`, or
/// a deferrable one).
#[sqlx::test(migrations = false)]
async fn a_table_between_versions_is_waited_out(pool: PgPool) {
    let store = PgStore::from_pool(pool.clone());
    let claim_error = || async {
        let mut tx = store.begin().await.expect("begin");
        let err = store
            .claim_many(
                &mut tx,
                &[key("payments", "evt-1")],
                &[],
                Ttl::from_secs(60).expect("ttl"),
            )
            .await
            .expect_err("a table of another version");
        store.rollback(tx).await.expect("rollback");
        (err.classification(), err.code().map(str::to_owned))
    };

    migrate_to_v1(&pool, "dedup_claims").await;
    assert_eq!(
        claim_error().await,
        (Classification::Environment, Some("42703".to_owned())),
        "not migrated yet"
    );

    store.migrate().await.expect("upgrade to v2");
    sqlx::query("ALTER TABLE dedup_claims DROP CONSTRAINT dedup_claims_pkey")
        .execute(&pool)
        .await
        .expect("a newer version's key");
    assert_eq!(
        claim_error().await,
        (Classification::Environment, Some("42P10".to_owned())),
        "migrated by a newer version"
    );

    // A key `ON CONFLICT` refuses to use (deferrable): neither the plain
    // insert (which would find a race only at COMMIT, as an event's error)
    // nor the upsert runs.
    sqlx::query("ALTER TABLE dedup_claims ADD PRIMARY KEY (id) DEFERRABLE")
        .execute(&pool)
        .await
        .expect("a deferrable key");
    assert_eq!(
        claim_error().await,
        (Classification::Environment, Some("55000".to_owned())),
        "a deferrable key"
    );
}

/// A batch's new claims, written by its plain insert, hold what the upsert
/// writes: the scope and key texts (multi-byte ones too), the fingerprint
/// or NULL, taken at the transaction's `now()` on the database clock and
/// expiring the TTL later; and the batch reports that expiry.
#[sqlx::test(migrations = false)]
async fn a_batch_writes_each_claims_columns_exactly(pool: PgPool) {
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    let ttl = Ttl::from_secs(4 * 3600).expect("ttl");
    let keys = [
        key("payments", "evt-1"),
        key("zahlungen/ü", "ereignis-ß-€-🦀"),
        key("payments", "evt-3"),
    ];
    let fingerprint = dedup_core::Fingerprint::of_payload(b"{\"amount\":10}");
    let fingerprints = [Some(fingerprint), None, Some(fingerprint)];
    let mut tx = store.begin().await.expect("begin");
    let started: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000000)::int8")
        .fetch_one(&mut *tx)
        .await
        .expect("now");
    let claims = store
        .claim_many(&mut tx, &keys, &fingerprints, ttl)
        .await
        .expect("claim_many");
    store.commit(tx).await.expect("commit");
    assert_eq!(claims, [Claim::Fresh, Claim::Fresh, Claim::Fresh]);

    for (k, fingerprint) in keys.iter().zip(fingerprints) {
        let (scope, id, claimed, expires, stored): (String, String, i64, i64, Option<Vec<u8>>) =
            sqlx::query_as(
                "SELECT scope, key, (extract(epoch FROM claimed_at) * 1000000)::int8, \
                        (extract(epoch FROM expires_at) * 1000000)::int8, fingerprint \
                 FROM dedup_claims WHERE id = $1",
            )
            .bind(claim_id(k))
            .fetch_one(&pool)
            .await
            .expect("the claim's row");
        assert_eq!((scope.as_str(), id.as_str()), (k.scope(), k.id()));
        assert_eq!(claimed, started, "{k:?}: taken at the transaction's now()");
        assert_eq!(
            expires - claimed,
            4 * 3600 * 1_000_000,
            "{k:?}: the TTL later"
        );
        assert_eq!(
            stored.as_deref(),
            fingerprint.as_ref().map(|f| &f.as_bytes()[..]),
            "{k:?}: its fingerprint"
        );
    }
    // A redelivery of the batch reads each claim's expiry as written.
    let mut tx = store.begin().await.expect("begin");
    let again = store
        .claim_many(&mut tx, &keys, &fingerprints, ttl)
        .await
        .expect("claim_many");
    store.rollback(tx).await.expect("rollback");
    let expected = SystemTime::UNIX_EPOCH
        + Duration::from_micros(u64::try_from(started).expect("after 1970"))
        + Duration::from_secs(4 * 3600);
    for (claim, kept) in again.into_iter().zip(fingerprints) {
        match claim {
            Claim::Duplicate {
                expires_at,
                fingerprint,
                ..
            } => {
                assert_eq!(expires_at, expected);
                assert_eq!(fingerprint, kept, "the fingerprint kept, or none");
            }
            other => panic!("a duplicate, got {other:?}"),
        }
    }
}

/// A claims table under row-level security that applies to the store's
/// role (here its owner, with `FORCE`), and one with a trigger that keeps
/// only some of the rows it is sent: a batch's new keys are claimed all
/// the same (the policy and the trigger applied), never an error.
/// (`COPY FROM`, tried for the batch's insert, refuses the first table.)
#[sqlx::test(migrations = false)]
async fn a_table_under_policies_and_triggers_is_claimed(pool: PgPool) {
    let store = PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    let ttl = Ttl::from_secs(3600).expect("ttl");
    let batch = |name: &str| {
        let name = name.to_owned();
        [
            key(&name, "evt-1"),
            key(&name, "evt-2"),
            key(&name, "evt-3"),
        ]
    };
    sqlx::raw_sql(
        "ALTER TABLE dedup_claims ENABLE ROW LEVEL SECURITY; \
         ALTER TABLE dedup_claims FORCE ROW LEVEL SECURITY; \
         CREATE POLICY every_claim ON dedup_claims USING (true) WITH CHECK (true)",
    )
    .execute(&pool)
    .await
    .expect("row-level security");
    let policed: bool = sqlx::query_scalar("SELECT row_security_active('dedup_claims')")
        .fetch_one(&pool)
        .await
        .expect("row_security_active");
    assert!(policed, "the store's role is under the table's policies");
    let keys = batch("policed");
    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, &keys, &[], ttl)
        .await
        .expect("claimed under row-level security");
    store.commit(tx).await.expect("commit");
    assert_eq!(claims, [Claim::Fresh, Claim::Fresh, Claim::Fresh]);

    sqlx::raw_sql(
        "ALTER TABLE dedup_claims DISABLE ROW LEVEL SECURITY; \
         CREATE FUNCTION keep_some() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.key = 'evt-2' AND NEW.scope = 'triggered' THEN RETURN NULL; END IF; \
         RETURN NEW; END $$; \
         CREATE TRIGGER keep_some BEFORE INSERT ON dedup_claims \
             FOR EACH ROW EXECUTE FUNCTION keep_some()",
    )
    .execute(&pool)
    .await
    .expect("a trigger");
    let keys = batch("triggered");
    let mut tx = store.begin().await.expect("begin");
    let claims = store
        .claim_many(&mut tx, &keys, &[], ttl)
        .await
        .expect("claimed beside the trigger");
    store.commit(tx).await.expect("commit");
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dedup_claims WHERE scope = 'triggered'")
            .fetch_one(&pool)
            .await
            .expect("rows");
    assert_eq!(rows, 2, "the trigger kept two of the three rows");
    assert_eq!(claims[0], Claim::Fresh, "{claims:?}");
    assert_eq!(claims[2], Claim::Fresh, "{claims:?}");
}
