//! Retry tiers (`retry_tiers`): an event whose handler fails transiently
//! waits in a tier topic while its partition moves on, and is applied once
//! when its failure has passed.

use super::*;

use std::collections::{BTreeMap, HashSet};

use dedup_kafka::{ReadTiers, RetryTiers};

/// A payment that says when it was produced.
#[derive(serde::Deserialize)]
struct Timed {
    event_id: String,
    account_id: String,
    seq: i64,
    produced_ms: i64,
}

fn timed(account: &str, seq: i64) -> Vec<u8> {
    serde_json::json!({
        "event_id": uuid::Uuid::new_v4(),
        "account_id": account,
        "seq": seq,
        "produced_ms": now_ms(),
        "amount_cents": 1,
    })
    .to_string()
    .into_bytes()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// Records when it was applied, then credits the account. The `applied`
/// table's trigger fails it (a transient error, as a downstream's 503
/// would be) for account `acct-bad` while the `failing` table has a row.
#[idempotent(key = "event_id", ttl = "4h")]
async fn apply_timed(tx: &mut PgTx, ev: Timed) -> Result<(), sqlx::Error> {
    record_timed(tx, ev).await
}

/// What `apply_timed` does, for the handlers that share it.
async fn record_timed(tx: &mut PgTx, ev: Timed) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO applied (event_id, account, seq, produced_ms, applied_ms) \
         VALUES ($1, $2, $3, $4, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)",
    )
    .bind(&ev.event_id)
    .bind(&ev.account_id)
    .bind(ev.seq)
    .bind(ev.produced_ms)
    .execute(&mut **tx)
    .await?;
    credit(
        tx,
        &PaymentReceived {
            event_id: ev.event_id,
            account_id: ev.account_id,
            amount_cents: 1,
        },
    )
    .await
}

/// Makes inserts into `table` fail for account `acct-bad` (its `column`)
/// while the `failing` table has a row, as a downstream's 503 would: a
/// trigger's `RAISE`, a transient error. It starts with one.
async fn fail_bad_account(pool: &PgPool, table: &str, column: &str) {
    let function = format!(
        "CREATE FUNCTION fail_bad() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.{column} = 'acct-bad' AND EXISTS (SELECT 1 FROM failing) THEN \
             RAISE EXCEPTION 'the downstream answers 503'; \
           END IF; \
           RETURN NEW; \
         END $$"
    );
    let trigger = format!(
        "CREATE TRIGGER fail_bad BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION fail_bad()"
    );
    for statement in [
        "CREATE TABLE failing (since timestamptz)",
        "INSERT INTO failing VALUES (now())",
        &function,
        &trigger,
    ] {
        // Identifiers of this file's own tables, not input.
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(pool)
            .await
            .expect(statement);
    }
}

/// The store, the `applied` table and the trigger that fails `acct-bad`
/// while `failing` has a row (it starts with one).
async fn failing_store(pool: &PgPool) -> PgStore {
    sqlx::query(
        "CREATE TABLE applied (event_id text NOT NULL, account text NOT NULL, seq bigint NOT NULL, \
         produced_ms bigint NOT NULL, applied_ms bigint NOT NULL)",
    )
    .execute(pool)
    .await
    .expect("applied");
    fail_bad_account(pool, "applied", "account").await;
    store(pool).await
}

/// Creates the tiers' topics of `topic` (as many partitions as it has).
async fn create_tiers(topic: &str, delays: &[&str], partitions: i32) -> Vec<String> {
    let mut topics = Vec::new();
    for delay in delays {
        let name = format!("{topic}.retry-{delay}");
        common::create_named_topic(&name, partitions).await;
        topics.push(name);
    }
    topics
}

/// Every record of `topic` now (up to its high watermarks).
async fn read_all(topic: &str) -> Vec<rdkafka::message::OwnedMessage> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let reader: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("reader"))
        .create()
        .expect("reader");
    let metadata = reader
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let mut total = 0;
    for p in metadata.topics()[0].partitions() {
        let (low, high) = reader
            .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
            .expect("watermarks");
        total += (high - low) as usize;
    }
    drop(reader);
    if total == 0 {
        return Vec::new();
    }
    common::read_from(&brokers(), topic, total).await
}

/// The origin offsets (partition, offset) the records of a tier name,
/// each once: no event was moved to a tier twice.
fn origins_once(records: &[rdkafka::message::OwnedMessage], tier: &str) -> HashSet<(i32, i64)> {
    let mut seen = HashSet::new();
    for record in records {
        let origin = (
            header(record, "dedup.origin.partition")
                .and_then(|p| p.parse().ok())
                .expect("an origin partition"),
            header(record, "dedup.origin.offset")
                .and_then(|o| o.parse().ok())
                .expect("an origin offset"),
        );
        assert!(seen.insert(origin), "{origin:?} moved to {tier} twice");
    }
    seen
}

/// 5,000 payments of 50 accounts stream through 2 partitions for 10 s
/// while one account's handler fails transiently. With tiers of 2 s and
/// 15 s (and 2 attempts in place), the
/// other accounts' payments are applied while it fails, within seconds of
/// being produced (its events hold their partition for the few attempts in
/// place only); once the failure has passed, the failing account's events
/// are applied from the tiers, once each. Nothing is dead-lettered and no
/// event is moved to a tier twice.
#[sqlx::test(migrations = false)]
async fn a_failing_key_waits_in_a_tier_while_the_others_are_applied(pool: PgPool) {
    let store = failing_store(&pool).await;
    let topic = create_topic(2).await;
    // The failure ends once the others are applied, which this test allows
    // 20 s under load (below): the tiers outlast that (2 + 15 + 30 s), so
    // no failing event runs out of them and is dead-lettered first (a
    // loaded four-lane run took 11 s for the others and dead-lettered 21
    // with only the first two).
    let tiers = create_tiers(&topic, &["2s", "15s", "30s"], 2).await;
    let running = start(
        consumer(&store, &unique("g"))
            .retry_tiers_with(
                RetryTiers::new(["2s", "15s", "30s"])
                    .expect("tiers")
                    .attempts_in_place(2),
            )
            .handle(&topic, apply_timed),
    );

    // 5,000 events of 50 accounts (one of them failing), keyed by account,
    // produced in 20 rounds of 250 half a second apart: the failing
    // account's 10 events a second all go to one partition.
    let (accounts, rounds, per_round) = (50usize, 20i64, 250usize);
    let account = |i: usize| match i % accounts {
        0 => "acct-bad".to_owned(),
        a => format!("acct-{a}"),
    };
    let producer = producer();
    for round in 0..rounds {
        let records = (0..per_round).map(|i| {
            let seq = round * per_round as i64 + i as i64;
            let a = account(i);
            (a.clone(), timed(&a, seq))
        });
        produce_all(&producer, &topic, records).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let total = rounds as usize * per_round;
    let bad = total / accounts;

    // The others are applied while the failure lasts.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM applied")
            .fetch_one(&pool)
            .await
            .expect("count");
        if applied as usize == total - bad {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the other accounts' events were not all applied: {applied}; {}",
            running.stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let longest: i64 = sqlx::query_scalar("SELECT max(applied_ms - produced_ms) FROM applied")
        .fetch_one(&pool)
        .await
        .expect("longest");
    eprintln!("longest delay of an unaffected event while one key failed: {longest} ms");
    assert!(
        longest < 20_000,
        "an unaffected event waited {longest} ms behind the failing key"
    );
    let moving = running.stats.snapshot();
    assert!(
        moving.moved >= bad as u64,
        "each failing event moved: {moving:?}"
    );

    // The failure passes: the failing account's events are applied from
    // the tiers, once each.
    sqlx::query("DELETE FROM failing")
        .execute(&pool)
        .await
        .expect("failure over");
    running
        .wait_for("the failing account's events applied", |s| {
            s.applied == total as u64
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(balance(&pool).await, total as i64, "each applied once");
    let per_event: Vec<(String, i64)> = sqlx::query_as(
        "SELECT event_id, count(*) FROM applied GROUP BY event_id HAVING count(*) > 1",
    )
    .fetch_all(&pool)
    .await
    .expect("doubles");
    assert!(per_event.is_empty(), "applied twice: {per_event:?}");
    let bad_applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM applied WHERE account = 'acct-bad'")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(bad_applied as usize, bad);

    // Every failing event went to the first tier once, some on to the
    // second and third (once); what a tier's record says of it.
    let first = read_all(&tiers[0]).await;
    let second = read_all(&tiers[1]).await;
    let third = read_all(&tiers[2]).await;
    assert_eq!(origins_once(&first, "the 2s tier").len(), bad);
    origins_once(&second, "the 15s tier");
    origins_once(&third, "the 30s tier");
    assert_eq!(
        stats.moved as usize,
        first.len() + second.len() + third.len(),
        "{stats:?}"
    );
    let record = &first[0];
    assert_eq!(header(record, "dedup.origin.topic"), Some(topic.as_str()));
    assert_eq!(header(record, "dedup.retry.tier"), Some("2s"));
    assert_eq!(header(record, "dedup.error.kind"), Some("handler"));
    assert!(
        header(record, "dedup.error.message").is_some_and(|m| m.contains("503")),
        "{:?}",
        header(record, "dedup.error.message")
    );
    assert_eq!(header(record, "dedup.retry.attempt"), Some("2"));
    let due: i64 = header(record, "dedup.retry.due")
        .and_then(|d| d.parse().ok())
        .expect("a due time");
    let moved_at = record.timestamp().to_millis().expect("a timestamp");
    assert!(
        (moved_at + 1_900..=moved_at + 2_500).contains(&due),
        "due 2 s after the move: {due} vs {moved_at}"
    );
}

/// A tier's record is not applied before it is due: the tier's partition
/// waits, paused, and the record is applied once the delay has passed.
/// Another process can read the tiers ([`ReadTiers::Only`]) while the
/// first only moves events there ([`ReadTiers::Elsewhere`]).
#[sqlx::test(migrations = false)]
async fn a_tier_record_waits_until_due_and_another_process_can_read_the_tiers(pool: PgPool) {
    let store = failing_store(&pool).await;
    let topic = create_topic(1).await;
    create_tiers(&topic, &["3s"], 1).await;
    let tiers = || RetryTiers::new(["3s"]).expect("tiers");
    let group = unique("g");
    let mover = start(
        consumer(&store, &group)
            .retry_tiers_with(tiers().read(ReadTiers::Elsewhere))
            .handle(&topic, apply_timed),
    );
    produce(&producer(), &topic, "acct-bad", &timed("acct-bad", 0), None).await;
    mover.wait_for("the event moved", |s| s.moved == 1).await;
    let moved_at = Instant::now();
    sqlx::query("DELETE FROM failing")
        .execute(&pool)
        .await
        .expect("failure over");
    // The tiers' reader, a process of its own in production.
    let reader = start(
        consumer(&store, &group)
            .retry_tiers_with(tiers().read(ReadTiers::Only))
            .handle(&topic, apply_timed),
    );
    reader
        .wait_for("the event applied from the tier", |s| s.applied == 1)
        .await;
    let waited = moved_at.elapsed();
    assert!(
        waited >= Duration::from_millis(2_500),
        "applied {waited:?} after its move, before its 3 s were up"
    );
    let (mover, reader) = (mover.stop().await, reader.stop().await);
    assert_eq!((mover.applied, mover.moved), (0, 1), "{mover:?}");
    assert_eq!((reader.applied, reader.moved), (1, 0), "{reader:?}");
    assert_eq!(balance(&pool).await, 1);
    let applied: BTreeMap<String, i64> =
        sqlx::query_as("SELECT account, count(*) FROM applied GROUP BY account")
            .fetch_all(&pool)
            .await
            .expect("applied")
            .into_iter()
            .collect();
    assert_eq!(applied.get("acct-bad"), Some(&1));
}

/// A consumer whose retry tiers' topics are missing, or have fewer
/// partitions than the handled topic (a move keeps its origin's
/// partition), does not start, and says what to create.
#[sqlx::test(migrations = false)]
async fn missing_tier_topics_are_named_at_start(pool: PgPool) {
    let store = failing_store(&pool).await;
    let topic = create_topic(2).await;
    let run = |tiers: [&'static str; 2]| {
        consumer(&store, &unique("g"))
            .retry_tiers(tiers)
            .handle(&topic, apply_timed)
            .build()
            .expect("consumer")
            .run_until(std::future::pending())
    };
    let missing = run(["1s", "9s"]).await.expect_err("no tier topics");
    assert!(
        missing.to_string().contains(&format!(
            "{topic}.retry-1s\" does not exist: create it with 2 partitions"
        )),
        "{missing}"
    );
    create_tiers(&topic, &["1s"], 2).await;
    common::create_named_topic(&format!("{topic}.retry-9s"), 1).await;
    let fewer = run(["1s", "9s"]).await.expect_err("too few partitions");
    assert!(
        fewer.to_string().contains("retry-9s\" has 1 partitions"),
        "{fewer}"
    );
}

/// The payments example with tiers of 1 s and 2 s, one account's payments
/// failing transiently, killed (SIGABRT, as a crash) right after its 3rd
/// move twice, then run to the end once the failure has passed (what was
/// moved is applied from the tier, the rest where it is): no payment is
/// lost or applied twice, none is dead-lettered, and no event was moved to
/// a tier twice (a move recorded before the crash is skipped as already
/// moved when its original is redelivered).
#[sqlx::test(migrations = false)]
async fn crashes_right_after_moves_lose_and_double_nothing(pool: PgPool) {
    crash_after_moves(&pool, false).await;
}

/// The same with key hold-back: what is in the tiers is recorded in the
/// store, so across the crashes the failing account's later payments still
/// follow its first, and all of its payments are applied in the order
/// produced.
#[sqlx::test(migrations = false)]
async fn with_hold_back_crashes_keep_each_keys_order(pool: PgPool) {
    let produced = crash_after_moves(&pool, true).await;
    let applied: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM ledger WHERE account_id = 'acct-bad' ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .expect("ledger");
    assert_eq!(
        applied, produced,
        "the failing account's payments, in order"
    );
}

/// Runs the payments example over one failing account among ten, killed
/// right after its 3rd move twice, then to the end; checks that nothing
/// was lost, doubled, dead-lettered or moved twice. Returns the failing
/// account's event ids in the order produced.
async fn crash_after_moves(pool: &PgPool, hold: bool) -> Vec<uuid::Uuid> {
    let pool = pool.clone();
    for statement in [
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
        "CREATE TABLE ledger (seq bigserial PRIMARY KEY, account_id text NOT NULL, \
         event_id uuid NOT NULL, amount_cents bigint NOT NULL)",
    ] {
        sqlx::query(statement)
            .execute(&pool)
            .await
            .expect(statement);
    }
    fail_bad_account(&pool, "ledger", "account_id").await;
    let topic = create_topic(2).await;
    let tiers = create_tiers(&topic, &["1s", "2s"], 2).await;
    let (accounts, each) = (10, 20);
    let mut produced = Vec::new();
    let records: Vec<(String, Vec<u8>)> = (0..accounts * each)
        .map(|i| {
            let account = match i % accounts {
                0 => "acct-bad".to_owned(),
                a => format!("acct-{a}"),
            };
            let id = uuid::Uuid::new_v4();
            if account == "acct-bad" {
                produced.push(id);
            }
            (account.clone(), payment(id, &account, 1))
        })
        .collect();
    produce_all(&producer(), &topic, records).await;
    let group = unique("g");
    // A crashed run must end at its failpoint, never idle: it gets 20 s of
    // idleness, the last run 10 s. With 4 s, a loaded machine once fetched
    // nothing in the 4 s after a run's assignment, which then ended idle
    // instead of crashing.
    let run = |failpoint: Option<&str>| {
        let mut cmd = common::payments(&pool, &topic, &group);
        let idle = if failpoint.is_some() { "20s" } else { "10s" };
        cmd.args(["--exit-when-idle", idle])
            .env("KAFKA_SESSION_TIMEOUT_MS", "6000")
            .env("DEDUP_RETRY_TIERS", "1s,2s")
            .env("DEDUP_RETRY_HOLD_KEYS", if hold { "1" } else { "0" });
        if let Some(f) = failpoint {
            cmd.env("DEDUP_FAILPOINT", f);
        }
        cmd.output().expect("run the payments example")
    };
    for _ in 0..2 {
        let crashed = run(Some("after-move:3"));
        assert!(
            !crashed.status.success(),
            "the failpoint must kill the process: {}",
            String::from_utf8_lossy(&crashed.stderr)
        );
    }
    sqlx::query("DELETE FROM failing")
        .execute(&pool)
        .await
        .expect("failure over");
    let finished = run(None);
    assert!(
        finished.status.success(),
        "{}",
        String::from_utf8_lossy(&finished.stderr)
    );
    assert!(
        last_line(&finished).ends_with("dead_lettered=0"),
        "{}",
        last_line(&finished)
    );
    let total = (accounts * each) as i64;
    assert_eq!(balance(&pool).await, total, "each payment applied once");
    let doubled: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
        "SELECT event_id, count(*) FROM ledger GROUP BY event_id HAVING count(*) > 1",
    )
    .fetch_all(&pool)
    .await
    .expect("ledger");
    assert!(doubled.is_empty(), "applied twice: {doubled:?}");
    // Each crash came right after a move was recorded: its original,
    // redelivered, was skipped as already moved, not moved again.
    let moved = origins_once(&read_all(&tiers[0]).await, "the 1s tier").len();
    assert!(
        (3..=each).contains(&moved),
        "the crashed runs moved at least 3 of the failing account's payments: {moved}"
    );
    origins_once(&read_all(&tiers[1]).await, "the 2s tier");
    produced
}

/// Ends the failure, waits until `total` events are applied, stops the
/// consumer (nothing dead-lettered) and returns the `seq` of the failing
/// account's events in the order applied.
async fn end_failure(pool: &PgPool, running: common::Running, total: u64) -> Vec<i64> {
    sqlx::query("DELETE FROM failing")
        .execute(pool)
        .await
        .expect("failure over");
    running
        .wait_for("the failing account's events applied", |s| {
            s.applied == total
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    sqlx::query_scalar(
        "SELECT seq FROM applied WHERE account = 'acct-bad' ORDER BY applied_ms, seq",
    )
    .fetch_all(pool)
    .await
    .expect("order")
}

/// A consumer with tiers of 1 s and 3 s, 2 attempts in place, and key
/// hold-back.
fn holding_back(store: &PgStore) -> ConsumerBuilder<PgStore> {
    consumer(store, &unique("g")).retry_tiers_with(
        RetryTiers::new(["1s", "3s"])
            .expect("tiers")
            .attempts_in_place(2)
            .hold_keys(true),
    )
}

/// With key hold-back, while one account's payment waits in a tier, its
/// later payments follow it there (without attempts) and the other
/// accounts' are applied; once the failure has passed, the failing
/// account's payments are applied once each, in the order produced.
/// Without it, they would be applied out of order: a later one as soon as
/// it comes, the earlier ones when their tier is due.
#[sqlx::test(migrations = false)]
async fn with_hold_back_a_failing_keys_events_are_applied_in_order(pool: PgPool) {
    let store = failing_store(&pool).await;
    let topic = create_topic(1).await;
    create_tiers(&topic, &["1s", "3s"], 1).await;
    let running = start(holding_back(&store).handle(&topic, apply_timed));
    let (accounts, each) = (10usize, 30i64);
    let records: Vec<(String, Vec<u8>)> = (0..each)
        .flat_map(|seq| {
            (0..accounts).map(move |a| {
                let account = match a {
                    0 => "acct-bad".to_owned(),
                    a => format!("acct-{a}"),
                };
                (account.clone(), timed(&account, seq))
            })
        })
        .collect();
    produce_all(&producer(), &topic, records).await;
    let others = (accounts - 1) * each as usize;
    running
        .wait_for("the other accounts' payments applied", |s| {
            s.applied == others as u64
        })
        .await;
    let total = accounts * each as usize;
    let order = end_failure(&pool, running, total as u64).await;
    assert_eq!(order, (0..each).collect::<Vec<_>>(), "once each, in order");
    assert_eq!(balance(&pool).await, total as i64);
}

/// Runs `dedup args...` (the operator tool) against the brokers.
async fn dedup_cli(args: &[&str]) -> serde_json::Value {
    let mut cmd = Command::new(common::cli());
    cmd.args(args)
        .env("KAFKA_BROKERS", brokers())
        .env_remove("DEDUP_FAILPOINT");
    let output = tokio::task::spawn_blocking(move || cmd.output().expect("run dedup"))
        .await
        .expect("join");
    assert!(
        output.status.success(),
        "dedup failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON")
}

/// `dedup retry list` shows what waits in a tier (its key, due time,
/// attempts, origin and reason), and `dedup retry release` sends it home
/// to be applied now, long before its minute is up; the tier's record is
/// then nothing more to wait for.
#[sqlx::test(migrations = false)]
async fn the_cli_lists_what_waits_in_a_tier_and_releases_it(pool: PgPool) {
    let store = failing_store(&pool).await;
    let topic = create_topic(1).await;
    let tier = create_tiers(&topic, &["1m"], 1).await.remove(0);
    let group = unique("g");
    let running = start(
        consumer(&store, &group)
            .retry_tiers_with(RetryTiers::new(["1m"]).expect("tiers").attempts_in_place(1))
            .handle(&topic, apply_timed),
    );
    let producer = producer();
    produce(&producer, &topic, "acct-bad", &timed("acct-bad", 0), None).await;
    produce(&producer, &topic, "acct-1", &timed("acct-1", 1), None).await;
    running
        .wait_for("one moved, one applied", |s| s.moved == 1 && s.applied == 1)
        .await;

    let listed = dedup_cli(&["--json", "retry", "list", &tier, "--group", &group]).await;
    assert_eq!(listed["waiting"], 1, "{listed:#}");
    let record = &listed["records"][0];
    assert_eq!(record["key"], "acct-bad");
    assert_eq!(record["tier"], "1m");
    assert_eq!(record["attempts"], 1);
    assert_eq!(record["origin"]["topic"], topic.as_str());
    assert_eq!(record["origin"]["offset"], 0);
    assert_eq!(record["error_kind"], "handler");
    let due_in = record["due_in_seconds"].as_f64().expect("due");
    assert!((30.0..=60.0).contains(&due_in), "{due_in}");
    let other = dedup_cli(&[
        "--json", "retry", "list", &tier, "--group", &group, "--key", "acct-1",
    ])
    .await;
    assert_eq!(other["waiting"], 0, "filtered by key: {other:#}");

    sqlx::query("DELETE FROM failing")
        .execute(&pool)
        .await
        .expect("failure over");
    let released = dedup_cli(&[
        "--json", "retry", "release", &tier, "--group", &group, "--yes",
    ])
    .await;
    assert_eq!(released["released"][0]["offset"], 0, "{released:#}");
    running
        .wait_for("the released event applied", |s| s.applied == 2)
        .await;
    let stats = running.stop().await;
    assert_eq!((stats.moved, stats.dead_lettered), (1, 0), "{stats:?}");
    assert_eq!(balance(&pool).await, 2);
}

/// Records that only claim to be the runtime's own change nothing. With a
/// signing key and key hold-back: an unsigned record written straight to
/// the tier, and an unsigned "released" copy on the origin topic naming
/// the held event, are dead-lettered as themselves (kind
/// `forged_tier_headers`, their own topic and offset as the original), the
/// forged copy is not applied and releases nothing: the key's next event
/// still follows the held one. `dedup retry release` with the key then
/// releases both, applied in their order.
#[sqlx::test(migrations = false)]
async fn forged_tier_headers_are_dead_lettered_and_release_nothing(pool: PgPool) {
    let store = failing_store(&pool).await;
    let topic = create_topic(1).await;
    let tier = create_tiers(&topic, &["1m"], 1).await.remove(0);
    let dlq = format!("{topic}.dlq");
    common::create_named_topic(&dlq, 1).await;
    let group = unique("g");
    let secret = "a-test-key-of-more-than-16-bytes";
    let key_file = std::env::temp_dir().join(unique("tier-key"));
    std::fs::write(&key_file, format!("{secret}\n")).expect("key file");
    let running = start(
        consumer(&store, &group)
            .retry_tiers_with(
                RetryTiers::new(["1m"])
                    .expect("tiers")
                    .attempts_in_place(1)
                    .hold_keys(true)
                    .signing_key(dedup_kafka::TierKey::new(secret).expect("key")),
            )
            .handle(&topic, apply_timed),
    );
    let producer = producer();
    let headers = |pairs: &[(&str, String)]| {
        pairs.iter().fold(OwnedHeaders::new(), |h, (key, value)| {
            h.insert(Header {
                key,
                value: Some(value.as_bytes()),
            })
        })
    };
    let origin = |offset: i64| {
        vec![
            ("dedup.origin.topic", topic.clone()),
            ("dedup.origin.partition", "0".to_owned()),
            ("dedup.origin.offset", offset.to_string()),
        ]
    };
    // Straight into the tier, well formed but unsigned (it would credit
    // acct-2 as if it had come from the topic).
    let mut on_tier = origin(5);
    on_tier.push(("dedup.retry.tier", "1m".to_owned()));
    produce(
        &producer,
        &tier,
        "acct-2",
        &timed("acct-2", 50),
        Some(headers(&on_tier)),
    )
    .await;
    running
        .wait_for("the forged tier record dead-lettered", |s| {
            s.dead_lettered == 1
        })
        .await;

    // acct-bad's first payment fails and waits in the tier, holding its key.
    produce(&producer, &topic, "acct-bad", &timed("acct-bad", 0), None).await;
    running.wait_for("moved", |s| s.moved == 1).await;
    sqlx::query("DELETE FROM failing")
        .execute(&pool)
        .await
        .expect("failure over");
    // A "released" copy naming it (offset 0), unsigned: it must not stand
    // for it, be applied, or let the key go.
    let mut released = origin(0);
    released.push(("dedup.retry.released", format!("{tier}/0/0")));
    let forged = timed("acct-bad", 99);
    produce(
        &producer,
        &topic,
        "acct-bad",
        &forged,
        Some(headers(&released)),
    )
    .await;
    running
        .wait_for("the forged copy dead-lettered", |s| s.dead_lettered == 2)
        .await;
    // So the key is still held: its next payment follows into the tier,
    // while another account's is applied.
    produce(&producer, &topic, "acct-bad", &timed("acct-bad", 1), None).await;
    produce(&producer, &topic, "acct-1", &timed("acct-1", 2), None).await;
    running
        .wait_for("acct-bad's next followed, acct-1 applied", |s| {
            s.moved == 2 && s.applied == 1
        })
        .await;

    let dead = common::read_from(&brokers(), &dlq, 2).await;
    let originals: Vec<(Option<&str>, Option<&str>, Option<&str>)> = dead
        .iter()
        .map(|d| {
            assert_eq!(header(d, "dedup.error.kind"), Some("forged_tier_headers"));
            (
                header(d, "dedup.original.topic"),
                header(d, "dedup.original.offset"),
                header(d, "dedup.error.message"),
            )
        })
        .collect();
    assert_eq!(
        originals[0].0,
        Some(tier.as_str()),
        "as itself: {originals:?}"
    );
    assert_eq!(originals[1].0, Some(topic.as_str()), "{originals:?}");
    assert_eq!(
        originals[1].1,
        Some("1"),
        "its own offset, not 0: {originals:?}"
    );
    assert!(
        originals
            .iter()
            .all(|o| o.2.is_some_and(|m| m.contains("dedup.retry.signature"))),
        "{originals:?}"
    );

    // Behind them in the tier (so still waiting when the operator acts),
    // an unsigned record naming acct-bad's second payment (offset 2) as
    // its origin: signed by the CLI, it would release that payment's hold.
    let mut planted = origin(2);
    planted.push(("dedup.retry.tier", "1m".to_owned()));
    let planted_payload = timed("acct-bad", 98);
    produce(
        &producer,
        &tier,
        "acct-bad",
        &planted_payload,
        Some(headers(&planted)),
    )
    .await;

    // And one with no tier headers at all: it must not stop the release of
    // the others.
    produce(&producer, &tier, "acct-9", &timed("acct-9", 97), None).await;

    // The operator releases them with the key: applied now, in order; the
    // planted records are refused, neither signed nor sent.
    let key_path = key_file.to_str().expect("utf-8 path");
    let released = dedup_cli(&[
        "--json",
        "retry",
        "release",
        &tier,
        "--group",
        &group,
        "--yes",
        "--tier-key-file",
        key_path,
    ])
    .await;
    std::fs::remove_file(&key_file).expect("remove the key file");
    assert_eq!(
        released["released"].as_array().map(Vec::len),
        Some(2),
        "{released:#}"
    );
    assert_eq!(
        released["refused"].as_array().map(Vec::len),
        Some(2),
        "{released:#}"
    );
    assert_eq!(
        released["refused"][0]["record"],
        format!("{tier}/0/3"),
        "{released:#}"
    );
    running
        .wait_for("the released payments applied", |s| s.applied == 3)
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 2, "{stats:?}");
    let order: Vec<i64> = sqlx::query_scalar(
        "SELECT seq FROM applied WHERE account IN ('acct-bad', 'acct-2') ORDER BY applied_ms, seq",
    )
    .fetch_all(&pool)
    .await
    .expect("order");
    assert_eq!(
        order,
        [0, 1],
        "the forged ones never applied; the held key in order"
    );
    assert_eq!(balance(&pool).await, 3);
}

/// A refund: another event type on the payments' topic, by its `type`
/// field, recorded by its own handler.
#[derive(serde::Deserialize)]
struct Refund {
    event_id: String,
    account_id: String,
    seq: i64,
    produced_ms: i64,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn apply_refund(tx: &mut PgTx, ev: Refund) -> Result<(), sqlx::Error> {
    let timed = Timed {
        event_id: ev.event_id,
        account_id: ev.account_id,
        seq: ev.seq,
        produced_ms: ev.produced_ms,
    };
    record_timed(tx, timed).await
}

/// On a topic of two event types (payments and refunds, each its own
/// handler), key hold-back holds a key across types, as the partition
/// orders it: while one account's payment waits in a tier, its later
/// refunds and payments follow it, and all are applied in the order
/// produced once the failure passes.
#[sqlx::test(migrations = false)]
async fn hold_back_keeps_a_keys_order_across_the_event_types_of_a_topic(pool: PgPool) {
    let store = failing_store(&pool).await;
    let topic = create_topic(1).await;
    create_tiers(&topic, &["1s", "3s"], 1).await;
    let running = start(
        holding_back(&store)
            .handle_type(
                &topic,
                dedup_kafka::EventType::field("type", "payment"),
                apply_timed,
            )
            .handle_type(
                &topic,
                dedup_kafka::EventType::field("type", "refund"),
                apply_refund,
            ),
    );
    let typed = |account: &str, seq: i64| {
        let kind = if seq % 2 == 0 { "payment" } else { "refund" };
        let mut body: serde_json::Value =
            serde_json::from_slice(&timed(account, seq)).expect("json");
        body["type"] = kind.into();
        (account.to_owned(), body.to_string().into_bytes())
    };
    let records: Vec<(String, Vec<u8>)> = (0..12)
        .flat_map(|seq| [typed("acct-bad", seq), typed("acct-1", seq)])
        .collect();
    produce_all(&producer(), &topic, records).await;
    running
        .wait_for("the other account's events applied", |s| s.applied == 12)
        .await;
    let order = end_failure(&pool, running, 24).await;
    assert_eq!(
        order,
        (0..12).collect::<Vec<_>>(),
        "payments and refunds in order"
    );
}
