//! The operator tool's claims and outbox commands, the same tests on
//! PostgreSQL, MySQL (a real MariaDB server) and SQLite: the tool picks the
//! backend by the URL's scheme and reads each store through the admin
//! functions its crate owns.

use std::process::Output;
use std::time::Duration;

use dedup_core::{Claim, DedupKey, DedupStore, OutboxMessage, OutboxSource, PublishFailure, Ttl};
use dedup_tests::common;
use sqlx::PgPool;

const SCOPE: &str = "app::record_payment";

/// A store under test: where the tool finds it, its claims and its outbox.
trait Backend {
    type Store: DedupStore;
    type Source: OutboxSource;
    /// The `DATABASE_URL` the tool gets.
    fn url(&self) -> String;
    /// The same, to change.
    fn url_mut(&mut self) -> &mut String;
    fn store(&self) -> &Self::Store;
    /// Enqueues `messages` in one committed transaction.
    async fn enqueue(&self, messages: Vec<OutboxMessage>);
    fn reader(&self) -> Self::Source;
}

struct Pg {
    url: String,
    store: dedup_postgres::PgStore,
    writer: dedup_postgres::OutboxWriter,
}

impl Backend for Pg {
    type Store = dedup_postgres::PgStore;
    type Source = dedup_postgres::OutboxReader;
    fn url(&self) -> String {
        self.url.clone()
    }
    fn url_mut(&mut self) -> &mut String {
        &mut self.url
    }
    fn store(&self) -> &Self::Store {
        &self.store
    }
    async fn enqueue(&self, messages: Vec<OutboxMessage>) {
        let mut tx = self.store.pool().begin().await.expect("begin");
        for m in messages {
            self.writer.enqueue(&mut tx, m).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
    fn reader(&self) -> Self::Source {
        self.writer.reader(self.store.pool().clone())
    }
}

struct MySql {
    url: String,
    store: dedup_mysql::MySqlStore,
    writer: dedup_mysql::OutboxWriter,
}

impl Backend for MySql {
    type Store = dedup_mysql::MySqlStore;
    type Source = dedup_mysql::OutboxReader;
    fn url(&self) -> String {
        self.url.clone()
    }
    fn url_mut(&mut self) -> &mut String {
        &mut self.url
    }
    fn store(&self) -> &Self::Store {
        &self.store
    }
    async fn enqueue(&self, messages: Vec<OutboxMessage>) {
        let mut tx = self.store.pool().begin().await.expect("begin");
        for m in messages {
            self.writer.enqueue(&mut tx, m).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
    fn reader(&self) -> Self::Source {
        self.writer.reader(self.store.pool().clone())
    }
}

struct Sqlite {
    url: String,
    store: dedup_sqlite::SqliteStore,
    writer: dedup_sqlite::OutboxWriter,
}

impl Backend for Sqlite {
    type Store = dedup_sqlite::SqliteStore;
    type Source = dedup_sqlite::OutboxReader;
    fn url(&self) -> String {
        self.url.clone()
    }
    fn url_mut(&mut self) -> &mut String {
        &mut self.url
    }
    fn store(&self) -> &Self::Store {
        &self.store
    }
    async fn enqueue(&self, messages: Vec<OutboxMessage>) {
        let mut tx = self.store.begin().await.expect("begin");
        for m in messages {
            self.writer.enqueue(&mut tx, m).await.expect("enqueue");
        }
        self.store.commit(tx).await.expect("commit");
    }
    fn reader(&self) -> Self::Source {
        self.writer.reader(self.store.pool().clone())
    }
}

async fn postgres(pool: PgPool) -> Pg {
    let store = dedup_postgres::PgStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    let writer = dedup_postgres::OutboxWriter::default();
    writer.migrate(&pool).await.expect("migrate outbox");
    Pg {
        url: common::database_url(&pool),
        store,
        writer,
    }
}

async fn mysql() -> MySql {
    let (url, pool) = common::mysql_database().await;
    let store = dedup_mysql::MySqlStore::from_pool(pool.clone());
    store.migrate().await.expect("migrate");
    let writer = dedup_mysql::OutboxWriter::default();
    writer.migrate(&pool).await.expect("migrate outbox");
    MySql { url, store, writer }
}

async fn sqlite() -> Sqlite {
    let path = std::env::temp_dir().join(format!("dedup-cli-{}.db", uuid::Uuid::new_v4()));
    let store = dedup_sqlite::SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    let writer = dedup_sqlite::OutboxWriter::default();
    writer.migrate(store.pool()).await.expect("migrate outbox");
    Sqlite {
        url: format!("sqlite://{}", path.display()),
        store,
        writer,
    }
}

/// Runs `dedup args...` against the backend's database.
async fn dedup(backend: &impl Backend, args: &[&str]) -> Output {
    let mut cmd = std::process::Command::new(common::cli());
    cmd.args(args)
        .env("DATABASE_URL", backend.url())
        .env_remove("DEDUP_FAILPOINT");
    tokio::task::spawn_blocking(move || cmd.output().expect("run dedup"))
        .await
        .expect("join")
}

fn json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "dedup failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

async fn claim(store: &impl DedupStore, scope: &str, id: &str, ttl: &str) -> Claim {
    let key = DedupKey::new(scope, id).expect("key");
    let mut tx = store.begin().await.expect("begin");
    let claim = store
        .claim(&mut tx, &key, None, Ttl::parse(ttl).expect("ttl"))
        .await
        .expect("claim");
    store.commit(tx).await.expect("commit");
    claim
}

/// `dedup claims <verb> --scope SCOPE --key <id> <more...>`.
async fn command(backend: &impl Backend, verb: &str, id: &str, more: &[&str]) -> Output {
    let args = [&["claims", verb, "--scope", SCOPE, "--key", id][..], more].concat();
    dedup(backend, &args).await
}

/// `claims get --json` of a composite key given by its parts.
async fn parts(backend: &impl Backend, parts: &[&str]) -> serde_json::Value {
    let mut args = vec!["claims", "get", "--scope", SCOPE, "--json"];
    for part in parts {
        args.extend(["--key", part]);
    }
    json(&dedup(backend, &args).await)
}

/// `claims get|release|stats|purge`, composite keys and bad names.
async fn claims_commands(backend: impl Backend) {
    let store = backend.store();
    for id in ["e-1", "e-2", "e-3"] {
        assert_eq!(claim(store, SCOPE, id, "4h").await, Claim::Fresh);
    }
    let composite = dedup_core::composite_id(["a,b", "c"]);
    claim(store, SCOPE, &composite, "4h").await;
    for n in 0..5 {
        claim(store, "old", &format!("k{n}"), "1s").await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let got = json(&command(&backend, "get", "e-1", &["--json"]).await);
    assert_eq!(
        (&got["found"], &got["live"]),
        (&true.into(), &true.into()),
        "{got}"
    );
    let expires_in = got["expires_in_seconds"].as_f64().expect("seconds");
    assert!(
        (3.9 * 3600.0..=4.0 * 3600.0).contains(&expires_in),
        "a 4h TTL: {got}"
    );
    assert!(
        got["claimed_at"].as_str().expect("time").ends_with('Z'),
        "{got}"
    );
    let text = stdout(&command(&backend, "get", "e-1", &[]).await);
    assert!(text.contains("live, expires in 3h59m"), "{text}");

    let stats = json(&dedup(&backend, &["claims", "stats", "--json"]).await);
    assert_eq!(
        (&stats["rows"], &stats["live"], &stats["expired"]),
        (&9.into(), &4.into(), &5.into()),
        "{stats}"
    );
    let scopes = stats["scopes"].as_array().expect("scopes");
    assert_eq!(scopes.len(), 2, "{stats}");
    assert_eq!(
        (&scopes[0]["scope"], &scopes[0]["live"]),
        (&SCOPE.into(), &4.into())
    );
    assert_eq!(
        (&scopes[1]["scope"], &scopes[1]["expired"]),
        (&"old".into(), &5.into())
    );

    let purged = json(
        &dedup(
            &backend,
            &["claims", "purge", "--batch-size", "2", "--json"],
        )
        .await,
    );
    assert_eq!(
        (&purged["deleted"], &purged["batches"]),
        (&5.into(), &3.into()),
        "{purged}"
    );
    let stats = json(&dedup(&backend, &["claims", "stats", "--json"]).await);
    assert_eq!(
        (&stats["rows"], &stats["live"]),
        (&4.into(), &4.into()),
        "{stats}"
    );

    // Releasing needs a confirmation; then the event is new again.
    let refused = command(&backend, "release", "e-2", &[]).await;
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("--yes"), "{}", stderr(&refused));
    let released = json(&command(&backend, "release", "e-2", &["--yes", "--json"]).await);
    assert_eq!(released["released"], true, "{released}");
    assert_eq!(
        json(&command(&backend, "get", "e-2", &["--json"]).await)["found"],
        false
    );
    let again = command(&backend, "release", "e-2", &["--yes"]).await;
    assert!(!again.status.success(), "releasing nothing is an error");
    assert!(stderr(&again).contains("no claim"), "{}", stderr(&again));
    assert_eq!(
        claim(store, SCOPE, "e-2", "4h").await,
        Claim::Fresh,
        "applied again"
    );

    // A composite key by its parts, in order.
    assert_eq!(parts(&backend, &["a,b", "c"]).await["found"], true);
    assert_eq!(parts(&backend, &["a", "b,c"]).await["found"], false);
    assert_eq!(
        parts(&backend, &["c", "a,b"]).await["found"],
        false,
        "order matters"
    );

    // Bad names are clear errors.
    let bad = dedup(&backend, &["claims", "stats", "--table", "x; DROP TABLE y"]).await;
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("not a valid table name"),
        "{}",
        stderr(&bad)
    );
    let missing = dedup(&backend, &["claims", "stats", "--table", "no_such_claims"]).await;
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("no claims table"),
        "{}",
        stderr(&missing)
    );
}

/// `outbox pending`: per topic, pending, leased, expired leases, failures.
async fn outbox_pending(backend: impl Backend) {
    backend
        .enqueue(
            ["orders", "orders", "invoices"]
                .into_iter()
                .map(|topic| OutboxMessage::bytes(topic, b"{}".to_vec()))
                .collect(),
        )
        .await;
    let pending = json(&dedup(&backend, &["outbox", "pending", "--json"]).await);
    assert_eq!(pending["pending"], 3, "{pending}");
    let topics = pending["topics"].as_array().expect("topics");
    assert_eq!(topics.len(), 2, "{pending}");
    assert_eq!(
        (&topics[1]["topic"], &topics[1]["pending"]),
        (&"orders".into(), &2.into())
    );
    assert_eq!(
        (&topics[1]["leased"], &topics[1]["lease_expired"]),
        (&0.into(), &0.into())
    );

    // The invoice failed once; a relay holds the first order; another's
    // lease on the second ran out (its relay stopped).
    let reader = backend.reader();
    let (lease, all) = reader
        .lease_pending(10, Duration::from_secs(600))
        .await
        .expect("lease");
    let invoice = all
        .iter()
        .find(|r| r.topic == "invoices")
        .expect("invoice")
        .seq;
    reader
        .finish(
            &lease,
            &[],
            &[PublishFailure::new(
                invoice,
                "broker down",
                Duration::from_secs(600),
            )],
        )
        .await
        .expect("finish");
    let (_held, first) = reader
        .lease_pending(1, Duration::from_secs(600))
        .await
        .expect("lease");
    let (_abandoned, second) = reader
        .lease_pending(1, Duration::from_millis(1))
        .await
        .expect("lease");
    assert_eq!((first.len(), second.len()), (1, 1));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let pending = json(&dedup(&backend, &["outbox", "pending", "--json"]).await);
    let topics = pending["topics"].as_array().expect("topics");
    assert_eq!(
        (&topics[0]["failing"], &topics[0]["last_error"]),
        (&1.into(), &"broker down".into())
    );
    assert_eq!(
        (&topics[1]["leased"], &topics[1]["lease_expired"]),
        (&1.into(), &1.into()),
        "{pending}"
    );
    let text = stdout(&dedup(&backend, &["outbox", "pending"]).await);
    assert!(text.contains("1 being published (leased)"), "{text}");
    assert!(text.contains("1 left by a relay that stopped"), "{text}");
    assert!(
        text.contains("1 failing (last error: broker down)"),
        "{text}"
    );
    let missing = dedup(&backend, &["outbox", "pending", "--table", "no_outbox"]).await;
    assert!(
        stderr(&missing).contains("no outbox table"),
        "{}",
        stderr(&missing)
    );
}

#[sqlx::test(migrations = false)]
async fn claims_commands_on_postgres(pool: PgPool) {
    claims_commands(postgres(pool).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_commands_on_mysql() {
    claims_commands(mysql().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_commands_on_sqlite() {
    claims_commands(sqlite().await).await;
}

#[sqlx::test(migrations = false)]
async fn outbox_pending_on_postgres(pool: PgPool) {
    outbox_pending(postgres(pool).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_pending_on_mysql() {
    outbox_pending(mysql().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_pending_on_sqlite() {
    outbox_pending(sqlite().await).await;
}

/// `url` on `localhost` (the name the test CA's server certificate holds),
/// with `tls` and the CA file `ca` of scripts/tls.sh.
fn over_tls(url: &str, tls: &str, ca: &str) -> String {
    let dir = std::env::var("DEDUP_TLS_DIR").unwrap_or_else(|_| "/var/tmp/dedup-tls".into());
    format!(
        "{}?{tls}={dir}/{ca}",
        url.replacen("@127.0.0.1:", "@localhost:", 1)
    )
}

/// The tool over TLS verified against the test CA: every claims command
/// works; trusting another CA, it refuses the server, saying why, without
/// the password.
async fn claims_commands_over_verified_tls(mut backend: impl Backend, tls: &str) {
    let plain = backend.url();
    *backend.url_mut() = over_tls(&plain, tls, "other-ca.pem");
    let refused = dedup(&backend, &["claims", "stats"]).await;
    assert!(
        !refused.status.success(),
        "a server another CA signed was trusted"
    );
    let said = stderr(&refused);
    assert!(
        said.contains("cannot connect") && said.contains("certificate"),
        "{said}"
    );
    assert!(!said.contains("dedup:dedup"), "the password in: {said}");
    *backend.url_mut() = over_tls(&plain, tls, "ca.pem");
    claims_commands(backend).await;
}

#[sqlx::test(migrations = false)]
async fn claims_commands_on_postgres_over_verified_tls(pool: PgPool) {
    let tls = "sslmode=verify-full&sslrootcert";
    claims_commands_over_verified_tls(postgres(pool).await, tls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_commands_on_mysql_over_verified_tls() {
    let tls = "ssl-mode=VERIFY_IDENTITY&ssl-ca";
    claims_commands_over_verified_tls(mysql().await, tls).await;
}

/// Least privilege from the tool: `dedup migrate --outbox --grant-to` as the
/// tables' owner prints the grants it ran; then, as the service's role
/// (scripts/postgres.sh's and mariadb.sh's `dedup_app`, holding nothing
/// else), `dedup migrate` finds the tables current, and `outbox pending`
/// and every claims command work.
async fn least_privilege(mut backend: impl Backend, grantee: &str) {
    let granted = dedup(
        &backend,
        &["migrate", "--outbox", "dedup_outbox", "--grant-to", grantee],
    )
    .await;
    let said = stdout(&granted);
    assert!(granted.status.success(), "{}", stderr(&granted));
    assert!(
        said.contains("GRANT SELECT, INSERT, UPDATE, DELETE ON") && said.contains("dedup_app"),
        "{said}"
    );
    let owner = backend.url();
    *backend.url_mut() = owner.replacen("//dedup:", "//dedup_app:", 1);
    assert_ne!(owner, backend.url(), "the URL names the owner");
    let current = dedup(&backend, &["migrate", "--outbox", "dedup_outbox"]).await;
    assert!(current.status.success(), "{}", stderr(&current));
    let pending = dedup(&backend, &["outbox", "pending", "--json"]).await;
    assert_eq!(json(&pending)["topics"], serde_json::json!([]));
    claims_commands(backend).await;
}

#[sqlx::test(migrations = false)]
async fn least_privilege_on_postgres(pool: PgPool) {
    least_privilege(postgres(pool).await, "dedup_app").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_on_mysql() {
    least_privilege(mysql().await, "dedup_app@127.0.0.1").await;
}
