//! dedup in one command, with nothing to install:
//!
//! `cargo run --example quickstart`
//!
//! It starts an in-process Kafka (librdkafka's mock cluster) and an SQLite
//! store in a temporary file, unless `KAFKA_BROKERS` / `DATABASE_URL` are set
//! (then it uses that broker and PostgreSQL). Then:
//!
//! 1. a retrying producer publishes payments, some of them twice;
//! 2. a consumer whose handler ADDS each amount to a balance (not idempotent
//!    by itself) crashes for real (the process aborts) right after a database
//!    commit, before any offset commit;
//! 3. a few malformed messages arrive, and a new consumer in the same group
//!    takes over, gets the crashed consumer's messages again and skips them,
//!    and sends the malformed ones to the dead-letter topic;
//! 4. a handler with a 2 s TTL shows a redelivery after its TTL applied again
//!    (on a topic, group and store of its own, beside 2 and 3: its waits
//!    overlap theirs).
//!
//! About 13 s once built, on 2 cores (the report's `took` line): most of it
//! is waiting for Kafka's group protocol (a new group's first join, a
//! crashed member's session) and for the TTL to pass.
//!
//! It ends with a report and checks that every balance equals the sum of the
//! distinct payments; it exits non-zero if not, so it doubles as a smoke test.

#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use dedup_core::{DedupStore, Handler, HandlerError, idempotent};
use dedup_kafka::{Consumer, StatsSnapshot, TtlCheck};
use dedup_postgres::{PgStore, PgTx};
use dedup_sqlite::{SqliteStore, SqliteTx};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};

/// Set in the environment of the child process that plays the consumer
/// that crashes.
const CRASH_ROLE: &str = "QUICKSTART_CRASHING_CONSUMER";

/// Where Kafka is: a real broker, or the in-process mock cluster.
#[derive(Clone)]
struct Kafka {
    brokers: String,
    mock: bool,
}

#[derive(serde::Deserialize)]
struct PaymentReceived {
    event_id: uuid::Uuid,
    account_id: String,
    amount_cents: i64,
}

/// The same two handlers for each store's transaction type: the effect adds
/// to a balance, so a duplicate applied twice would show.
macro_rules! payment_handlers {
    ($tx:ty, $sql:literal, $main:ident, $short_ttl:ident) => {
        #[idempotent(key = "event_id", ttl = "4h", scope = "quickstart::record_payment")]
        async fn $main(tx: &mut $tx, ev: PaymentReceived) -> Result<(), HandlerError> {
            sqlx::query($sql)
                .bind(&ev.account_id)
                .bind(ev.amount_cents)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }

        #[idempotent(
            key = "event_id",
            ttl = "2s",
            scope = "quickstart::record_payment_short_ttl"
        )]
        async fn $short_ttl(tx: &mut $tx, ev: PaymentReceived) -> Result<(), HandlerError> {
            sqlx::query($sql)
                .bind(&ev.account_id)
                .bind(ev.amount_cents)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }
    };
}

payment_handlers!(
    SqliteTx,
    "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
     ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + excluded.balance",
    sqlite_payment,
    sqlite_payment_short_ttl
);
payment_handlers!(
    PgTx,
    "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
     ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + excluded.balance",
    pg_payment,
    pg_payment_short_ttl
);

const ACCOUNTS_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL)";

/// Where the claims and balances live.
#[derive(Clone)]
enum Db {
    Sqlite(PathBuf, SqliteStore),
    Postgres(String, PgStore),
}

impl Db {
    async fn open(location: Option<&str>) -> Result<Db, Box<dyn std::error::Error>> {
        let db = match location {
            Some(url) if url.starts_with("postgres") => {
                let store = PgStore::connect(url).await?;
                store.migrate().await?;
                sqlx::query(ACCOUNTS_TABLE).execute(store.pool()).await?;
                Db::Postgres(url.to_owned(), store)
            }
            _ => {
                let path = location.map(PathBuf::from).unwrap_or_else(|| {
                    std::env::temp_dir()
                        .join(format!("dedup-quickstart-{}.db", uuid::Uuid::new_v4()))
                });
                let store = SqliteStore::open(&path).await?;
                store.migrate().await?;
                sqlx::query(ACCOUNTS_TABLE).execute(store.pool()).await?;
                Db::Sqlite(path, store)
            }
        };
        Ok(db)
    }

    fn location(&self) -> String {
        match self {
            Db::Sqlite(path, _) => path.display().to_string(),
            Db::Postgres(url, _) => url.clone(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Db::Sqlite(path, _) => format!("SQLite in {}", path.display()),
            Db::Postgres(..) => "PostgreSQL from DATABASE_URL".to_owned(),
        }
    }

    async fn balance(&self, account_prefix: &str) -> Result<i64, sqlx::Error> {
        let like = format!("{account_prefix}%");
        match self {
            Db::Sqlite(_, s) => {
                sqlx::query_scalar(
                    "SELECT coalesce(sum(balance), 0) FROM accounts WHERE id LIKE ?1",
                )
                .bind(like)
                .fetch_one(s.pool())
                .await
            }
            Db::Postgres(_, s) => {
                sqlx::query_scalar(
                    "SELECT coalesce(sum(balance), 0)::int8 FROM accounts WHERE id LIKE $1",
                )
                .bind(like)
                .fetch_one(s.pool())
                .await
            }
        }
    }

    /// How many of `ids` the main handler has claimed (and so applied).
    async fn claimed(&self, ids: &[String]) -> Result<i64, sqlx::Error> {
        match self {
            Db::Sqlite(_, s) => {
                sqlx::query_scalar(
                    "SELECT count(*) FROM dedup_claims WHERE scope = 'quickstart::record_payment' \
                     AND key IN (SELECT value FROM json_each(?1))",
                )
                .bind(serde_json::to_string(ids).expect("json"))
                .fetch_one(s.pool())
                .await
            }
            Db::Postgres(_, s) => {
                sqlx::query_scalar(
                    "SELECT count(*) FROM dedup_claims WHERE scope = 'quickstart::record_payment' \
                     AND key = ANY($1)",
                )
                .bind(ids)
                .fetch_one(s.pool())
                .await
            }
        }
    }

    /// Consumes `topic` as `group` until idle; `short_ttl` picks the 2 s
    /// handler.
    async fn consume(
        &self,
        kafka: &Kafka,
        topic: &str,
        group: &str,
        short_ttl: bool,
    ) -> StatsSnapshot {
        match (self, short_ttl) {
            (Db::Sqlite(_, s), false) => {
                consume(s.clone(), sqlite_payment, kafka, topic, group).await
            }
            (Db::Sqlite(_, s), true) => {
                consume(s.clone(), sqlite_payment_short_ttl, kafka, topic, group).await
            }
            (Db::Postgres(_, s), false) => {
                consume(s.clone(), pg_payment, kafka, topic, group).await
            }
            (Db::Postgres(_, s), true) => {
                consume(s.clone(), pg_payment_short_ttl, kafka, topic, group).await
            }
        }
    }
}

/// Runs a consumer until it has been idle for a second and a half.
async fn consume<S, H>(
    store: S,
    handler: H,
    kafka: &Kafka,
    topic: &str,
    group: &str,
) -> StatsSnapshot
where
    S: DedupStore,
    H: Handler<Tx = S::Tx>,
{
    let consumer = Consumer::builder(store)
        .brokers(&kafka.brokers)
        .group_id(group)
        // The mock cluster has no admin API: the start-up check of the TTLs
        // against the topics' retention would wait 10 s for an answer.
        .ttl_check(if kafka.mock {
            TtlCheck::Off
        } else {
            TtlCheck::Warn
        })
        .commit_interval(Duration::from_millis(500))
        // A crashed member keeps its partitions until its session times
        // out (45 s by default); keep the demo short. A real broker refuses
        // less than 6 s (`group.min.session.timeout.ms`); the mock takes 3 s
        // (at 2 s its group never settled here: its rebalance timer is the
        // session less a second).
        .set(
            "session.timeout.ms",
            if kafka.mock { "3000" } else { "6000" },
        )
        .set("heartbeat.interval.ms", "1000")
        .handle(topic, handler)
        .build()
        .expect("consumer settings");
    let stats = consumer.stats();
    let idle = async move {
        while stats.idle_for() < Duration::from_millis(1500) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // A group that never settles (an overloaded machine) fails the demo
    // instead of hanging it.
    tokio::time::timeout(Duration::from_secs(120), consumer.run_until(idle))
        .await
        .expect("the consumer finished within 2 minutes")
        .expect("consumer")
}

/// The TTL: a redelivery within it is skipped, one after it applies again.
/// Sends one payment twice, consumes, waits the 2 s TTL out, sends it again
/// and consumes again: what each run of the 2 s-TTL handler did.
async fn ttl_demo(
    db: Db,
    kafka: Kafka,
    producer: FutureProducer,
    topic: String,
    group: String,
    account: String,
) -> Result<(StatsSnapshot, StatsSnapshot), String> {
    let (_, late) = payment(&account, 1000);
    let send_late = async || {
        send(&producer, &topic, "late", &late)
            .await
            .map_err(|e| e.to_string())
    };
    send_late().await?;
    send_late().await?;
    let first = db.consume(&kafka, &topic, &group, true).await;
    tokio::time::sleep(Duration::from_millis(2200)).await;
    send_late().await?;
    let second = db.consume(&kafka, &topic, &group, true).await;
    Ok((first, second))
}

async fn create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Result<(), Box<dyn std::error::Error>> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    for result in admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await?
    {
        result.map_err(|(topic, e)| format!("creating {topic}: {e}"))?;
    }
    Ok(())
}

async fn send(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    producer
        .send(
            FutureRecord::to(topic).key(key).payload(payload),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    Ok(())
}

fn payment(account: &str, cents: i64) -> (uuid::Uuid, String) {
    let id = uuid::Uuid::new_v4();
    let json = serde_json::json!({ "event_id": id, "account_id": account, "amount_cents": cents });
    (id, json.to_string())
}

/// The child process: consumes until the failpoint aborts it.
async fn crashing_consumer() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let db = Db::open(Some(&var("QUICKSTART_DB")?)).await?;
    db.consume(
        &Kafka {
            brokers: var("QUICKSTART_BROKERS")?,
            mock: std::env::var("QUICKSTART_MOCK").is_ok_and(|v| v == "1"),
        },
        &var("QUICKSTART_TOPIC")?,
        &var("QUICKSTART_GROUP")?,
        false,
    )
    .await;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os(CRASH_ROLE).is_some() {
        return crashing_consumer().await;
    }
    if std::env::var_os("QUICKSTART_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .log_internal_errors(false)
            .init();
    }
    let started = Instant::now();
    println!("dedup quickstart: idempotent Kafka consumers\n");

    // 1. Infrastructure: a real broker and database if given, else in-process ones.
    let run = uuid::Uuid::new_v4().simple().to_string();
    let (topic, ttl_topic, group) = (
        format!("payments-{run}"),
        format!("late-{run}"),
        format!("quickstart-{run}"),
    );
    let accounts = format!("acct-{}-", &run[..8]);
    // Not under `accounts`: its balance is its own.
    let late_account = format!("late-{}", &run[..8]);
    let mock;
    let kafka = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) => {
            println!("  kafka    {brokers} (KAFKA_BROKERS)");
            create_topic(&brokers, &topic, 3).await?;
            create_topic(&brokers, &ttl_topic, 1).await?;
            Kafka {
                brokers,
                mock: false,
            }
        }
        Err(_) => {
            // The mock cluster makes topics itself; it has no admin API.
            mock = MockCluster::<'static, DefaultProducerContext>::new(1)?;
            mock.create_topic(&topic, 3, 1)?;
            mock.create_topic(&ttl_topic, 1, 1)?;
            println!(
                "  kafka    in-process mock cluster at {}",
                mock.bootstrap_servers()
            );
            Kafka {
                brokers: mock.bootstrap_servers(),
                mock: true,
            }
        }
    };
    let brokers = &kafka.brokers;
    let db = Db::open(std::env::var("DATABASE_URL").ok().as_deref()).await?;
    println!("  store    {}\n", db.describe());
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;

    // 2. A producer that retries: every fifth payment is sent twice.
    let (mut distinct, mut duplicates, mut expected) = (0u64, 0u64, 0i64);
    let mut ids = Vec::new();
    for i in 0..200i64 {
        let account = format!("{accounts}{}", i % 10);
        let cents = 100 + i;
        let (id, json) = payment(&account, cents);
        send(&producer, &topic, &account, &json).await?;
        ids.push(id.to_string());
        distinct += 1;
        expected += cents;
        if i % 5 == 0 {
            send(&producer, &topic, &account, &json).await?;
            duplicates += 1;
        }
    }
    println!(
        "produced {} messages: {distinct} payments, {duplicates} sent twice",
        distinct + duplicates
    );

    // 3. A consumer that crashes (the process aborts) right after the
    //    database commit that applied its 80th payment, before committing any
    //    Kafka offset.
    const CRASH_AT_PAYMENT: u64 = 80;
    let mut crashing = Command::new(std::env::current_exe()?);
    crashing
        .env(CRASH_ROLE, "1")
        .env(
            "DEDUP_FAILPOINT",
            format!("after-commit:{CRASH_AT_PAYMENT}"),
        )
        .env("QUICKSTART_DB", db.location())
        .env("QUICKSTART_BROKERS", brokers)
        .env("QUICKSTART_MOCK", if kafka.mock { "1" } else { "" })
        .env("QUICKSTART_TOPIC", &topic)
        .env("QUICKSTART_GROUP", &group)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // The TTL's demonstration (step 5) runs meanwhile, on its own topic and
    // group: its waits (a group to join, the TTL to pass) overlap these.
    // Its own SQLite file (SQLite has one writer at a time: the crashing
    // consumer's batches could hold the duplicate's claim back past its
    // 2 s TTL); PostgreSQL is shared.
    let ttl_db = match &db {
        Db::Sqlite(..) => Db::open(None).await?,
        Db::Postgres(..) => db.clone(),
    };
    let ttl_demo = tokio::spawn(ttl_demo(
        ttl_db.clone(),
        kafka.clone(),
        producer.clone(),
        ttl_topic.clone(),
        format!("{group}-ttl"),
        late_account.clone(),
    ));
    let crashed = tokio::task::spawn_blocking(move || crashing.status()).await??;
    let balance_at_crash = db.balance(&accounts).await?;
    // Counted, not assumed: that commit may hold a whole batch, and other
    // partitions' transactions may commit while it aborts the process.
    let applied_before_crash = db.claimed(&ids).await? as u64;
    match crashed.success() {
        false => println!(
            "consumer 1 crashed right after the database commit of its {CRASH_AT_PAYMENT}th payment \
             ({applied_before_crash} payments worth {balance_at_crash} cents applied), before any offset commit"
        ),
        true => println!("consumer 1 was meant to crash but finished"),
    }

    // 4. Three malformed messages arrive (sent now, so that only the next
    //    consumer meets them and the count below is exact), and a new
    //    consumer in the same group takes over from the committed offsets: it
    //    receives the crashed consumer's work again and skips it, and
    //    dead-letters the malformed ones.
    for bad in [
        r#"{"event_id": "#,
        r#"{"account_id": "x", "amount_cents": 1}"#,
        "not json",
    ] {
        send(&producer, &topic, "malformed", bad).await?;
    }
    println!("produced 3 malformed messages");
    let after = db.consume(&kafka, &topic, &group, false).await;
    println!(
        "consumer 2 took over from the committed offsets: applied={} skipped={} dead_lettered={}",
        after.applied, after.skipped, after.dead_lettered
    );

    // 5. The TTL (run beside 3 and 4, above).
    let (first, second) = ttl_demo.await??;
    println!(
        "2s TTL: first delivery applied={} / duplicate skipped={}; after the TTL the same event applied={} again",
        first.applied, first.skipped, second.applied
    );

    // 6. The check.
    let late_balance = ttl_db.balance(&late_account).await?;
    let balance = db.balance(&accounts).await?;
    let applied = applied_before_crash + after.applied;
    println!("\nreport");
    println!("  events produced          {}", distinct + duplicates + 3);
    println!(
        "  duplicates delivered     {}  ({duplicates} sent twice by the producer, {} redelivered after the crash)",
        after.skipped,
        after.skipped.saturating_sub(duplicates)
    );
    println!(
        "  applied                  {applied}  ({applied_before_crash} before the crash + {} after)",
        after.applied
    );
    println!("  skipped as duplicates    {}", after.skipped);
    println!(
        "  dead-lettered            {}  (to {topic}.dlq, the reason in its headers)",
        after.dead_lettered
    );
    println!(
        "  balances                 {balance} cents; the {distinct} distinct payments sum to {expected}"
    );
    println!(
        "  redelivery after TTL     applied again: {late_balance} cents = 2 x 1000, by design"
    );
    println!(
        "  took                     {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let ok = !crashed.success()
        && applied_before_crash >= CRASH_AT_PAYMENT
        && applied == distinct
        && balance == expected
        && after.dead_lettered == 3
        && (first.applied, first.skipped, second.applied) == (1, 1, 1)
        && late_balance == 2000;
    if ok {
        println!("\nOK: every payment applied exactly once, across duplicates and a crash");
        Ok(())
    } else {
        println!("\nFAILED: balances or counts do not match the distinct payments");
        std::process::exit(1);
    }
}
