//! Helpers shared by the end-to-end test binaries: broker address, random
//! names, topics, reading records back, the examples' binaries.

use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use dedup_kafka::{ConsumerBuilder, StatsSnapshot};
use dedup_postgres::PgStore;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Headers as _, Message as _, OwnedMessage};
use rdkafka::producer::FutureProducer;
use sqlx::PgPool;

/// The brokers the tests use: `KAFKA_BROKERS`, default `127.0.0.1:9092`.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// How a client reaches the shared broker's SASL_SSL listener (SCRAM-SHA-512,
/// our test CA), as `scripts/kafka.sh secure-env` gives it: `KAFKA_BROKERS`
/// and `KAFKA_CFG_*` variables, for a process of a test's own.
pub fn secured_env() -> Vec<(String, String)> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg("secure-env")
        .output()
        .expect("kafka.sh secure-env");
    assert!(out.status.success(), "kafka.sh secure-env failed");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Adds ACLs on the shared broker (`scripts/kafka.sh acl --add ARGS`, the
/// arguments of Kafka's `kafka-acls.sh`). The broker authorizes every
/// listener but PLAINTEXT's: a resource with no ACL stays open to all, so a
/// test denies a principal by allowing someone else on its own resources.
pub fn acl(args: &[&str]) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka.sh");
    let out = Command::new("bash")
        .arg(script)
        .args(["acl", "--add", "--force"])
        .args(args)
        .output()
        .expect("kafka.sh acl");
    assert!(
        out.status.success(),
        "kafka.sh acl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Allows the SASL_SSL listener's user `dedup` `operation` on one resource
/// (`kind`: `--topic`, `--group`, `--transactional-id`).
pub fn allow_dedup(operation: &str, kind: &str, name: &str) {
    acl(&[
        "--allow-principal",
        "User:dedup",
        "--operation",
        operation,
        kind,
        name,
    ]);
}

/// ACLs for another principal on the `resources` (`--topic T --group G`):
/// `dedup` may use none of them until allowed.
pub fn only_for_someone_else(resources: &[&str]) {
    let mut args = vec![
        "--allow-principal",
        "User:someone-else",
        "--operation",
        "All",
    ];
    args.extend_from_slice(resources);
    acl(&args);
}

/// `(key, value)` librdkafka settings and the brokers of the SASL_SSL
/// listener as the user `dedup` ([`secured_env`] for a builder's `set`).
pub fn secured_settings() -> (String, Vec<(String, String)>) {
    let mut brokers = String::new();
    let mut settings = Vec::new();
    for (k, v) in secured_env() {
        if k == "KAFKA_BROKERS" {
            brokers = v;
        } else if let Some(key) = k.strip_prefix("KAFKA_CFG_") {
            settings.push((key.to_lowercase().replace('_', "."), v));
        }
    }
    (brokers, settings)
}

/// A start as `dedup` on `topic`, `group` and the dead-letter topic `dlq`,
/// all of which have ACLs for someone else only: `refused` starts and
/// returns its error. Missing Read on the topic, then on the group, then
/// any right on `dlq`, each is named (granted after): one error with the
/// `kafka-acls.sh` arguments that add it, and no password.
pub async fn each_missing_acl_is_named<F, Fut>(refused: F, topic: &str, group: &str, dlq: &str)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = String>,
{
    only_for_someone_else(&["--topic", topic, "--topic", dlq, "--group", group]);
    let steps = [
        (
            format!("--allow-principal User:dedup --operation Read --topic {topic}"),
            ("Read", "--topic", topic),
        ),
        (
            format!("--operation Read --group {group}"),
            ("Read", "--group", group),
        ),
        (
            format!("--operation Write --topic {dlq}"),
            ("Describe", "--topic", dlq),
        ),
    ];
    for (named, (operation, kind, name)) in steps {
        let said = refused().await;
        assert!(said.contains(&named), "{named:?} not in: {said}");
        assert!(!said.contains("dedup-secret"), "{said}");
        // Then granted, but for the dead-letter topic only Describe: the
        // test goes on to show what Write refused later does.
        allow_dedup(operation, kind, name);
    }
}

/// `run()` of a runtime that must stop on its own within `secs`: its error.
pub async fn start_error<T: std::fmt::Debug>(
    secs: u64,
    run: impl std::future::Future<Output = Result<T, dedup_kafka::Error>>,
) -> String {
    tokio::time::timeout(Duration::from_secs(secs), run)
        .await
        .expect("the start must not hang")
        .expect_err("the start must fail")
        .to_string()
}

/// `prefix` and a random suffix: a name no other test uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A new topic of `partitions` partitions on the shared broker.
pub async fn create_topic(partitions: i32) -> String {
    create_topic_on(&brokers(), partitions).await
}

/// Creates a topic with a random name on the broker at `brokers`.
pub async fn create_topic_on(brokers: &str, partitions: i32) -> String {
    create_topic_with(brokers, partitions, &[]).await
}

/// Creates a topic with a random name and topic `configs` on the broker at
/// `brokers`.
pub async fn create_topic_with(brokers: &str, partitions: i32, configs: &[(&str, &str)]) -> String {
    let name = unique("dedup-test");
    create_named_topic_with(brokers, &name, partitions, configs).await;
    name
}

/// Creates topic `name` of `partitions` partitions on the shared broker
/// (a test's retry tiers, named after its topic).
pub async fn create_named_topic(name: &str, partitions: i32) {
    create_named_topic_with(&brokers(), name, partitions, &[]).await;
}

async fn create_named_topic_with(
    brokers: &str,
    name: &str,
    partitions: i32,
    configs: &[(&str, &str)],
) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    for (key, value) in configs {
        topic = topic.set(key, value);
    }
    let results = admin
        .create_topics([&topic], &AdminOptions::new())
        .await
        .expect("create topic");
    for r in results {
        r.expect("topic created");
    }
}

/// An idempotent producer to the shared broker.
pub fn producer() -> FutureProducer {
    producer_on(&brokers())
}

/// An idempotent producer for the broker at `brokers`.
pub fn producer_on(brokers: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .create()
        .expect("producer")
}

/// Reads `n` records of `topic` from the beginning.
pub async fn read(topic: &str, n: usize) -> Vec<OwnedMessage> {
    read_from(&brokers(), topic, n).await
}

/// Reads `n` records of `topic` from the beginning, from the broker at `brokers`.
pub async fn read_from(brokers: &str, topic: &str, n: usize) -> Vec<OwnedMessage> {
    read_until(brokers, topic, |read| read.len() >= n).await
}

/// Reads `topic` from the beginning until `enough` says so, failing after
/// 30 s without a record.
pub async fn read_until(
    brokers: &str,
    topic: &str,
    mut enough: impl FnMut(&[OwnedMessage]) -> bool,
) -> Vec<OwnedMessage> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("reader"))
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("reader");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut out = Vec::new();
    while !enough(&out) {
        let msg = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("no record of {topic} for 30 s after {}", out.len()))
            .expect("record");
        out.push(msg.detach());
    }
    out
}

/// Reads `topic` from the beginning on the broker at `brokers`, expecting
/// exactly `n` records: `n` arrive, then none more within 5 s.
pub async fn read_exactly(brokers: &str, topic: &str, n: usize) -> Vec<OwnedMessage> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("reader"))
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("reader");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut out = Vec::new();
    loop {
        // Generous while records are owed, then a settling wait.
        let wait = if out.len() < n { 30 } else { 5 };
        match tokio::time::timeout(Duration::from_secs(wait), consumer.recv()).await {
            Ok(msg) => out.push(msg.expect("record").detach()),
            Err(_) if out.len() < n => {
                panic!("{topic}: {} records of the {n} expected", out.len())
            }
            Err(_) => break,
        }
        assert!(
            out.len() <= n,
            "{topic}: more than the {n} records expected: {:?}",
            out.iter()
                .map(|m| (
                    m.partition(),
                    m.offset(),
                    header(m, "dedup.original.offset")
                ))
                .collect::<Vec<_>>()
        );
    }
    out
}

/// The value of header `name` of `msg`, as text.
pub fn header<'a>(msg: &'a OwnedMessage, name: &str) -> Option<&'a str> {
    msg.headers()?
        .iter()
        .filter(|h| h.key == name)
        .last()
        .and_then(|h| std::str::from_utf8(h.value?).ok())
}

/// The database URL of the test's own database, for a child process.
pub fn database_url(pool: &PgPool) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let db = pool
        .connect_options()
        .get_database()
        .expect("test database")
        .to_owned();
    let (server, _) = base.rsplit_once('/').expect("URL with a database");
    format!("{server}/{db}")
}

/// Builds what the tests start as processes, once per test binary, and
/// returns `target/<profile>`: the examples and the CLI with its crash
/// points, with the arguments `scripts/tests.py` builds them with (the
/// whole workspace's features, examples selected so that dev-dependencies'
/// features count too: no dependency is built a second time). Skipped
/// when `DEDUP_TESTS_PREBUILT` is set: `scripts/tests.py` built them
/// before it runs the test binaries side by side, where each one's build
/// would queue on cargo's lock and re-link binaries another one is
/// starting.
fn built() -> std::path::PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        if std::env::var_os("DEDUP_TESTS_PREBUILT").is_some() {
            return;
        }
        let args = [
            "build",
            "--quiet",
            "--workspace",
            "--bins",
            "--examples",
            "--features",
            "dedup-cli/failpoints",
        ];
        let status = Command::new(env!("CARGO"))
            .args(args)
            .status()
            .expect("cargo build");
        assert!(status.success(), "cargo {args:?} failed");
    });
    let deps = std::env::current_exe().expect("test binary");
    deps.parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>")
        .to_owned()
}

/// A new, empty database of the test's own on the MySQL or MariaDB server
/// `MYSQL_URL` names (scripts/mariadb.sh starts one; its `start` drops
/// the `dedup_test_` databases of earlier runs): its URL, for a child
/// process, and a pool on it.
pub async fn mysql_database() -> (String, sqlx::MySqlPool) {
    use sqlx::{ConnectOptions as _, Executor as _};
    let server = std::env::var("MYSQL_URL")
        .unwrap_or_else(|_| "mysql://dedup:dedup@127.0.0.1:3307/dedup".into());
    let options: sqlx::mysql::MySqlConnectOptions = server.parse().expect("MYSQL_URL");
    let name = format!("dedup_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = options.connect().await.expect("connect to MYSQL_URL");
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
        .await
        .expect("create the test database");
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .connect_with(options.database(&name))
        .await
        .expect("connect to the test database");
    let (base, _) = server.rsplit_once('/').expect("URL with a database");
    (format!("{base}/{name}"), pool)
}

/// The binary of an example of `examples/`.
pub fn example(name: &str) -> std::path::PathBuf {
    built().join("examples").join(name)
}

/// The `dedup` operator tool, with its test-only crash points.
pub fn cli() -> std::path::PathBuf {
    built().join("dedup")
}

/// The payments example, reading `topic` in `group` from the brokers into
/// the test's own database; `DEDUP_FAILPOINT` cleared.
pub fn payments(pool: &PgPool, topic: &str, group: &str) -> Command {
    let mut cmd = Command::new(example("payments"));
    cmd.env("DATABASE_URL", database_url(pool))
        .env("KAFKA_BROKERS", brokers())
        .env("TOPIC", topic)
        .env("GROUP_ID", group)
        .env_remove("DEDUP_FAILPOINT");
    cmd
}

/// The offset `group` has committed for partition `partition` of `topic`
/// (`Offset::Invalid` if none), read as a member that does not join.
pub fn committed(topic: &str, group: &str, partition: i32) -> rdkafka::Offset {
    let member: rdkafka::consumer::BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .create()
        .expect("member");
    let mut asked = rdkafka::TopicPartitionList::new();
    asked.add_partition(topic, partition);
    member
        .committed_offsets(asked, Duration::from_secs(10))
        .expect("committed offsets")
        .find_partition(topic, partition)
        .map(|p| p.offset())
        .expect("asked for")
}

/// The last line the process printed on stdout.
pub fn last_line(output: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout.lines().last().unwrap_or_default().to_owned()
}

/// Kills a child process that a failing test leaves behind.
pub struct KillOnDrop(pub Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs a fresh consumer of `group` until it has been idle for `idle`
/// (after getting its partitions) and returns what it did.
pub async fn drain(builder: ConsumerBuilder<PgStore>, idle: Duration) -> StatsSnapshot {
    let consumer = builder.build().expect("consumer");
    let stats = consumer.stats();
    consumer
        .run_until(async move {
            while stats.idle_for() < idle {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("consumer ran")
}

/// A service that `scripts/<name>.sh` runs with the environment `env`:
/// one of a test's own.
pub(crate) struct Script {
    pub(crate) name: &'static str,
    pub(crate) env: Vec<(&'static str, String)>,
}

impl Script {
    pub(crate) fn command(&self, action: &str) -> Command {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../scripts")
            .join(format!("{}.sh", self.name));
        let mut cmd = Command::new("bash");
        cmd.arg(path).arg(action);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    /// Runs `<name>.sh <action>`, failing the test if it fails.
    pub(crate) async fn run(&self, action: &str) {
        let mut cmd = self.command(action);
        let status = tokio::task::spawn_blocking(move || cmd.status())
            .await
            .expect("join")
            .expect("script");
        assert!(status.success(), "{}.sh {action} failed", self.name);
    }
}

/// A broker of a test's own (its own data and ports), stopped on drop: for
/// tests that stop or kill a broker, so the tests beside them never notice.
pub struct OwnBroker {
    script: Script,
    /// Its `bootstrap.servers`.
    pub address: String,
}

impl OwnBroker {
    /// Starts a fresh broker in `.kafka/<name>` on `port` (its controller on
    /// `port + 1`); each test that uses one takes its own name and port.
    pub async fn start(name: &str, port: u16) -> Self {
        Self::start_with(name, port, Vec::new()).await
    }

    /// [`start`](Self::start), with SASL_SSL on `port + 2` (its
    /// [`address`](Self::address)) and SSL on `port + 3` presenting the
    /// test CA's certificate `cert` (`server`, or `expired`).
    pub async fn start_secured(name: &str, port: u16, cert: &str) -> Self {
        let mut broker = Self::start_with(
            name,
            port,
            vec![
                ("DEDUP_KAFKA_SASL_SSL_PORT", (port + 2).to_string()),
                ("DEDUP_KAFKA_SSL_PORT", (port + 3).to_string()),
                ("DEDUP_KAFKA_SERVER_CERT", cert.to_owned()),
            ],
        )
        .await;
        broker.address = format!("127.0.0.1:{}", port + 2);
        broker
    }

    async fn start_with(name: &str, port: u16, mut env: Vec<(&'static str, String)>) -> Self {
        let home = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../.kafka")
            .join(name);
        env.push(("DEDUP_KAFKA_HOME", home.display().to_string()));
        env.push(("DEDUP_KAFKA_PORT", port.to_string()));
        let broker = OwnBroker {
            script: Script { name: "kafka", env },
            address: format!("127.0.0.1:{port}"),
        };
        // A fresh broker each run: one left over from a killed run is
        // stopped, and earlier runs' topics do not slow its start.
        broker.run("stop").await;
        let _ = std::fs::remove_dir_all(home.join("data"));
        broker.run("start").await;
        broker
    }

    /// Runs `kafka.sh <action>` (`start`, `stop`, `kill`) for this broker.
    pub async fn run(&self, action: &str) {
        self.script.run(action).await;
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        let _ = self.script.command("stop").status();
    }
}

/// A PostgreSQL cluster of a test's own (its own data directory and port),
/// deleted on drop: for tests that stop or kill the database, so the tests
/// beside them never notice.
pub struct OwnPostgres {
    script: Script,
    /// The URL of its `dedup` database.
    pub url: String,
}

impl OwnPostgres {
    /// Starts a fresh cluster `<name>` on `port`; each test that uses one
    /// takes its own name and port.
    pub async fn start(name: &str, port: u16) -> Self {
        let pg = OwnPostgres {
            script: Script {
                name: "postgres",
                env: vec![
                    ("DEDUP_PG_CLUSTER", name.to_owned()),
                    ("PGPORT", port.to_string()),
                ],
            },
            url: format!("postgres://dedup:dedup@127.0.0.1:{port}/dedup"),
        };
        // A fresh cluster each run: one left over from a killed run goes.
        pg.run("drop").await;
        pg.run("start").await;
        pg
    }

    /// Runs `postgres.sh <action>` (`start`, `stop`, `kill`) for this
    /// cluster.
    pub async fn run(&self, action: &str) {
        self.script.run(action).await;
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = self.script.command("drop").status();
    }
}

/// A consumer running in the background.
pub struct Running {
    /// Its counters, live.
    pub stats: std::sync::Arc<dedup_kafka::Stats>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<StatsSnapshot>,
}

/// Builds and runs a consumer in the background until [`Running::stop`].
pub fn start(builder: ConsumerBuilder<PgStore>) -> Running {
    let consumer = builder.build().expect("consumer");
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        consumer
            .run_until(async {
                let _ = stopped.await;
            })
            .await
            .expect("consumer ran")
    });
    Running { stats, stop, task }
}

impl Running {
    /// Waits until `done` holds for the counters (or 60 s pass).
    pub async fn wait_for(&self, what: &str, done: impl Fn(StatsSnapshot) -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !done(self.stats.snapshot()) {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}; stats {}",
                self.stats.snapshot()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Stops it and returns what it did.
    pub async fn stop(self) -> StatsSnapshot {
        let _ = self.stop.send(());
        self.task.await.expect("consumer task")
    }
}

/// Turns the test's own database read-only (or back) the way a failover to
/// a standby looks to a consumer: new sessions are read-only, and the
/// existing ones are cut off.
pub async fn set_read_only(pool: &PgPool, on: bool) {
    let mut conn = pool.acquire().await.expect("connection");
    // This session may have started read-only itself.
    sqlx::query("SET default_transaction_read_only = off")
        .execute(&mut *conn)
        .await
        .expect("session read-write");
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *conn)
        .await
        .expect("database name");
    let change = if on {
        "SET default_transaction_read_only = on"
    } else {
        "RESET default_transaction_read_only"
    };
    // The name comes from the server, quoted as an identifier.
    let alter = format!("ALTER DATABASE \"{}\" {change}", db.replace('"', "\"\""));
    sqlx::query(sqlx::AssertSqlSafe(alter))
        .execute(&mut *conn)
        .await
        .expect("alter database");
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(&mut *conn)
    .await
    .expect("cut the sessions off");
    // Not back into the pool: its session setting is not the database's.
    conn.close().await.expect("close");
}

/// How many records `topic` holds (its partitions' high watermarks less
/// their low ones).
pub fn records_in(topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("count"))
        .create()
        .expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    metadata.topics()[0]
        .partitions()
        .iter()
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
                .expect("watermarks");
            high - low
        })
        .sum()
}

/// A free port on loopback: the OS's pick, released for the caller (an
/// example's `METRICS_ADDR`, a WebDriver).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}
