//! Key-ordered concurrency (`key_concurrency`): within one partition,
//! events of different ordering keys run at once, each key's one at a
//! time in offset order, and the committed offset never passes an
//! unfinished event.

use super::*;

use dedup_kafka::OrderBy;
use rdkafka::Offset;

/// One step of an account's numbered sequence.
#[derive(serde::Deserialize)]
struct Step {
    event_id: String,
    account_id: String,
    seq: i64,
    /// How long its transaction stays open (a slow statement).
    millis: u64,
    /// Waits until the test's `gate` table has a row.
    #[serde(default)]
    gated: bool,
}

fn step(account: &str, seq: i64, millis: u64, gated: bool) -> Vec<u8> {
    serde_json::json!({
        "event_id": uuid::Uuid::new_v4(),
        "account_id": account,
        "seq": seq,
        "millis": millis,
        "gated": gated,
        "amount_cents": 1,
    })
    .to_string()
    .into_bytes()
}

fn micros_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros() as i64
}

/// Records when it ran, then credits the account: each step's row says
/// which of its account's steps it was and when its transaction ran.
#[idempotent(key = "event_id", ttl = "4h")]
async fn run_step(tx: &mut PgTx, ev: Step) -> Result<(), sqlx::Error> {
    let started = micros_now();
    if ev.gated {
        while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM gate")
            .fetch_one(&mut **tx)
            .await?
            == 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(ev.millis)).await;
    sqlx::query("INSERT INTO steps (account, seq, started, ended) VALUES ($1, $2, $3, $4)")
        .bind(&ev.account_id)
        .bind(ev.seq)
        .bind(started)
        .bind(micros_now())
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

async fn steps_store(pool: &PgPool) -> PgStore {
    for table in [
        "CREATE TABLE steps (account text NOT NULL, seq bigint NOT NULL, \
         started bigint NOT NULL, ended bigint NOT NULL)",
        "CREATE TABLE gate (open bool)",
    ] {
        sqlx::query(table).execute(pool).await.expect("table");
    }
    store(pool).await
}

/// Every step's run, per account, in the order they started.
async fn runs(pool: &PgPool) -> std::collections::BTreeMap<String, Vec<(i64, i64, i64)>> {
    let rows: Vec<(String, i64, i64, i64)> =
        sqlx::query_as("SELECT account, seq, started, ended FROM steps ORDER BY started, seq")
            .fetch_all(pool)
            .await
            .expect("steps");
    let mut by_account = std::collections::BTreeMap::<String, Vec<_>>::new();
    for (account, seq, started, ended) in rows {
        by_account
            .entry(account)
            .or_default()
            .push((seq, started, ended));
    }
    by_account
}

/// Each account's steps ran once each, in order, never two at once.
fn assert_in_order_one_at_a_time(
    runs: &std::collections::BTreeMap<String, Vec<(i64, i64, i64)>>,
    accounts: usize,
    steps: i64,
) {
    assert_eq!(runs.len(), accounts);
    for (account, steps_run) in runs {
        let seqs: Vec<i64> = steps_run.iter().map(|(s, _, _)| *s).collect();
        assert_eq!(
            seqs,
            (0..steps).collect::<Vec<_>>(),
            "{account}'s steps, once each and in order"
        );
        for pair in steps_run.windows(2) {
            assert!(
                pair[0].2 <= pair[1].1,
                "{account}: step {} started before step {} ended",
                pair[1].0,
                pair[0].0
            );
        }
    }
}

/// The most runs that overlapped at one moment.
fn most_at_once(runs: &std::collections::BTreeMap<String, Vec<(i64, i64, i64)>>) -> usize {
    let mut edges: Vec<(i64, i32)> = runs
        .values()
        .flatten()
        .flat_map(|(_, started, ended)| [(*started, 1), (*ended, -1)])
        .collect();
    // An end before a start at the same instant: touching is not overlapping.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, delta) in edges {
        now += delta;
        most = most.max(now);
    }
    most as usize
}

/// One partition, twelve accounts of six numbered steps each whose
/// records are keyed by event id (so the ordering key is the
/// `account_id` field): with key_concurrency(6), several accounts' steps
/// overlap, and each account's run one at a time, in order.
#[sqlx::test(migrations = false)]
async fn events_of_different_keys_run_at_once_and_each_keys_in_order(pool: PgPool) {
    let store = steps_store(&pool).await;
    let topic = create_topic(1).await;
    let (accounts, steps) = (12, 6);
    let records = (0..steps).flat_map(|seq| {
        (0..accounts).map(move |a| {
            (
                uuid::Uuid::new_v4().to_string(),
                step(&format!("acct-{a}"), seq, 40, false),
            )
        })
    });
    produce_all(&producer(), &topic, records).await;

    let running = start(
        consumer(&store, &unique("g"))
            .key_concurrency(6)
            .order_by(&topic, OrderBy::field("account_id"))
            .handle(&topic, run_step),
    );
    let total = (accounts * steps) as u64;
    running
        .wait_for("all applied", |s| s.applied == total)
        .await;
    let stats = running.stop().await;
    assert_eq!((stats.skipped, stats.dead_lettered), (0, 0), "{stats:?}");
    let runs = runs(&pool).await;
    assert_in_order_one_at_a_time(&runs, accounts as usize, steps);
    let most = most_at_once(&runs);
    assert!(
        (3..=6).contains(&most),
        "up to 6 transactions at once, and well more than one: {most}"
    );
    assert_eq!(balance(&pool).await, total as i64);
}

/// The committed offset of a partition stays at its first unfinished
/// event while later ones finish; a consumer that stops there and one that
/// takes over apply nothing twice: what finished above it is redelivered
/// and skipped, counted as redelivered, and the events of the unfinished
/// one's key wait for it in order.
#[sqlx::test(migrations = false)]
async fn the_committed_offset_waits_for_the_first_unfinished_event(pool: PgPool) {
    let store = steps_store(&pool).await;
    let topic = create_topic(1).await;
    // Offsets 0-4 quick, 5 held at the gate, 6-25 quick (other keys), then
    // two more of the held one's key.
    let mut records = Vec::new();
    for i in 0..5 {
        records.push((
            format!("early-{i}"),
            step(&format!("early-{i}"), 0, 0, false),
        ));
    }
    records.push(("held".to_owned(), step("held", 0, 0, true)));
    for i in 0..20 {
        records.push((
            format!("later-{i}"),
            step(&format!("later-{i}"), 0, 0, false),
        ));
    }
    for seq in 1..3 {
        records.push(("held".to_owned(), step("held", seq, 0, false)));
    }
    produce_all(&producer(), &topic, records).await;
    let group = unique("g");

    // A transaction of its own per event: the held one holds no other
    // (events that share its transaction would wait with it).
    let running = start(
        consumer(&store, &group)
            .key_concurrency(4)
            .batch_size(1)
            .shutdown_timeout(Duration::from_millis(500))
            .handle(&topic, run_step),
    );
    running
        .wait_for("all but the held key applied", |s| s.applied == 25)
        .await;
    // A few commit intervals: nothing at or past offset 5 may be committed.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(common::committed(&topic, &group, 0), Offset::Offset(5));
    assert_eq!(
        balance_of(&pool, "held").await,
        0,
        "the held key's later events wait behind it"
    );
    let first = running.stop().await;
    assert_eq!(first.applied, 25, "{first:?}");

    sqlx::query("INSERT INTO gate VALUES (true)")
        .execute(&pool)
        .await
        .expect("open the gate");
    let second = drain(
        consumer(&store, &group)
            .key_concurrency(4)
            .handle(&topic, run_step),
        Duration::from_secs(2),
    )
    .await;
    assert_eq!(
        (second.applied, second.skipped, second.redelivered),
        (3, 20, 20),
        "the held key's three applied, the twenty finished above it skipped as redeliveries: {second:?}"
    );
    assert_in_order_one_at_a_time(
        &runs(&pool)
            .await
            .into_iter()
            .filter(|(a, _)| a == "held")
            .collect(),
        1,
        3,
    );
    assert_eq!(balance(&pool).await, 28, "every event once");
}

async fn balance_of(pool: &PgPool, account: &str) -> i64 {
    dedup_tests::balance(pool, account).await
}

/// The payments example under key-ordered concurrency, in processes that
/// are SIGKILLed mid-flight: four partitions, 200 accounts of ten numbered
/// payments each (one in ten sent twice, as a producer retry does), every
/// transaction slowed by a random 20-60 ms. Two members start; one is
/// killed a fifth of the way in, another (the replacement or the
/// survivor) at three fifths, each replaced at once. In the end every
/// payment is in the ledger once and each account's in the order sent.
#[sqlx::test(migrations = false)]
async fn members_killed_mid_flight_apply_every_event_once_and_each_key_in_order(pool: PgPool) {
    PgStore::from_pool(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    // The example's tables, made before two of them race to make them.
    for table in [
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
        "CREATE TABLE ledger (seq bigserial PRIMARY KEY, account_id text NOT NULL, \
         event_id uuid NOT NULL, amount_cents bigint NOT NULL)",
    ] {
        sqlx::query(table).execute(&pool).await.expect("table");
    }
    let topic = create_topic(4).await;
    let (accounts, per_account) = (200, 10);
    let mut sent: std::collections::HashMap<String, Vec<uuid::Uuid>> = Default::default();
    let mut records = Vec::new();
    for n in 0..per_account {
        for a in 0..accounts {
            let account = format!("acct-{a}");
            let id = uuid::Uuid::new_v4();
            let body = payment(id, &account, n + 1);
            records.push((account.clone(), body.clone()));
            if (a + n) % 10 == 0 {
                records.push((account.clone(), body));
            }
            sent.entry(account).or_default().push(id);
        }
    }
    produce_all(&producer(), &topic, records).await;

    let group = unique("g");
    let member = || {
        let mut cmd = common::payments(&pool, &topic, &group);
        cmd.env("DEDUP_KEY_CONCURRENCY", "16")
            .env("EFFECT_MS", "20-60")
            .env("KAFKA_SESSION_TIMEOUT_MS", "6000")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        KillOnDrop(Some(cmd.spawn().expect("start payments")))
    };
    let total = accounts * per_account;
    let mut members = vec![member(), member()];
    for (killed_at, victim) in [(total / 5, 0), (total * 3 / 5, 1)] {
        wait_for_ledger(&pool, killed_at).await;
        // SIGKILL: mid-transaction, nothing committed to Kafka since the
        // last commit interval.
        drop(std::mem::replace(&mut members[victim], member()));
    }
    wait_for_ledger(&pool, total).await;
    drop(members);

    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM ledger")
            .fetch_one(&pool)
            .await
            .expect("ledger");
    assert_eq!((rows, distinct), (total, total), "every payment once");
    let ledger: Vec<(String, uuid::Uuid)> =
        sqlx::query_as("SELECT account_id, event_id FROM ledger ORDER BY seq")
            .fetch_all(&pool)
            .await
            .expect("ledger");
    let mut applied: std::collections::HashMap<String, Vec<uuid::Uuid>> = Default::default();
    for (account, id) in ledger {
        applied.entry(account).or_default().push(id);
    }
    for (account, ids) in &sent {
        assert_eq!(
            applied.get(account),
            Some(ids),
            "{account}'s payments in the order sent"
        );
    }
    let expected: i64 = accounts * (1..=per_account).sum::<i64>();
    assert_eq!(balance(&pool).await, expected);
}

/// Waits until the ledger holds `n` rows (or two minutes pass).
async fn wait_for_ledger(pool: &PgPool, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(pool)
            .await
            .expect("ledger");
        if rows >= n {
            return;
        }
        assert!(Instant::now() < deadline, "stuck at {rows} of {n} payments");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `order_by` that cannot take effect is refused at build, naming the
/// topic: without key_concurrency, or for a topic with no handler.
#[sqlx::test(migrations = false)]
async fn an_ordering_that_would_do_nothing_is_refused(pool: PgPool) {
    let store = steps_store(&pool).await;
    let refused = |builder: ConsumerBuilder<PgStore>| match builder.build() {
        Ok(_) => panic!("built"),
        Err(e) => e.to_string(),
    };
    let without = refused(
        consumer(&store, "g")
            .order_by("steps", OrderBy::field("account_id"))
            .handle("steps", run_step),
    );
    assert!(
        without.contains("\"steps\"") && without.contains("key_concurrency"),
        "{without}"
    );
    let elsewhere = refused(
        consumer(&store, "g")
            .key_concurrency(4)
            .order_by("other", OrderBy::header("tenant"))
            .handle("steps", run_step),
    );
    assert!(
        elsewhere.contains("\"other\"") && elsewhere.contains("no handler"),
        "{elsewhere}"
    );
}

/// A rebalance under key-ordered concurrency: a second member joins while
/// the first runs four partitions of 40 accounts' numbered steps (20 ms
/// transactions, eight at once per partition), and the first then leaves.
/// The revokes wait for the units running; whatever finished above a
/// partition's first unfinished event is skipped by its next owner. Every
/// step runs once, each account's in order, and none two at once.
#[sqlx::test(migrations = false)]
async fn a_rebalance_mid_flight_applies_every_event_once_and_each_key_in_order(pool: PgPool) {
    let store = steps_store(&pool).await;
    let topic = create_topic(4).await;
    let (accounts, steps) = (40, 10);
    let records = (0..steps).flat_map(|seq| {
        (0..accounts).map(move |a| {
            let account = format!("acct-{a}");
            (account.clone(), step(&account, seq, 20, false))
        })
    });
    produce_all(&producer(), &topic, records).await;
    let group = unique("g");
    let member = || {
        start(
            consumer(&store, &group)
                .key_concurrency(8)
                .handle(&topic, run_step),
        )
    };
    let total = (accounts * steps) as u64;
    let first = member();
    first
        .wait_for("a quarter applied", |s| s.applied >= total / 4)
        .await;
    let second = member();
    second
        .wait_for("the second member's first events", |s| s.applied > 0)
        .await;
    let first = first.stop().await;
    second
        .wait_for("the rest applied", |s| s.applied + first.applied >= total)
        .await;
    let second = second.stop().await;
    assert_eq!(
        first.applied + second.applied,
        total,
        "{first:?} {second:?}"
    );
    assert_eq!(
        first.skipped + second.skipped,
        first.redelivered + second.redelivered,
        "every skip a redelivery: {first:?} {second:?}"
    );
    assert_in_order_one_at_a_time(&runs(&pool).await, accounts as usize, steps);
    assert_eq!(balance(&pool).await, total as i64);
}
