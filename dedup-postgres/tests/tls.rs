//! TLS to PostgreSQL, against the test server scripts/postgres.sh starts:
//! TLS on with a certificate our test CA signed, the role `dedup_tls`
//! refused without TLS, `dedup_mtls` refused without a client certificate.
//! Each test makes a database of its own over TLS.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dedup_core::{HandlerError, HandlerExt, Outcome, idempotent};
use dedup_postgres::{Error, PgConfig, PgStore, PgTx};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Executor};

/// The certificates scripts/tls.sh made.
fn tls_dir() -> PathBuf {
    std::env::var_os("DEDUP_TLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/dedup-tls"))
}

fn port() -> u16 {
    let url: PgConnectOptions = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://dedup:dedup@127.0.0.1:5432/dedup".into())
        .parse()
        .expect("DATABASE_URL");
    url.get_port()
}

/// `role`'s URL to `database`, with no TLS parameters.
fn plain_url(role: &str, database: &str) -> String {
    format!("postgres://{role}:dedup@localhost:{}/{database}", port())
}

/// `role`'s verify-full URL to `database`.
fn verified_url(role: &str, database: &str) -> String {
    format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        plain_url(role, database),
        tls_dir().join("ca.pem").display()
    )
}

/// A new database, made over TLS by `dedup_tls` (which owns it).
async fn fresh_database() -> String {
    let name = format!("dedup_tls_{}", uuid::Uuid::new_v4().simple());
    let options: PgConnectOptions = verified_url("dedup_tls", "postgres").parse().expect("url");
    let mut admin = options.connect().await.expect("dedup_tls over TLS");
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .expect("create the test database");
    name
}

#[derive(serde::Deserialize)]
struct Payment {
    event_id: String,
    amount_cents: i64,
}

#[idempotent(key = "event_id", ttl = "4h")]
async fn record_payment(tx: &mut PgTx, ev: Payment) -> Result<(), HandlerError> {
    sqlx::query("UPDATE totals SET cents = cents + $1")
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The store claims over TLS: a payment delivered twice is applied once,
/// and the server says the connection is encrypted.
async fn applies_once_over_tls(store: &PgStore) {
    store.migrate().await.expect("migrate over TLS");
    sqlx::query("CREATE TABLE totals (cents BIGINT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("totals");
    sqlx::query("INSERT INTO totals VALUES (0)")
        .execute(store.pool())
        .await
        .expect("row");
    let payload = br#"{"event_id":"p-1","amount_cents":250}"#;
    let first = record_payment.apply(store, payload, &()).await;
    let second = record_payment.apply(store, payload, &()).await;
    assert!(matches!(first, Outcome::Applied { .. }), "{first:?}");
    assert!(matches!(second, Outcome::Skipped { .. }), "{second:?}");
    let cents: i64 = sqlx::query_scalar("SELECT cents FROM totals")
        .fetch_one(store.pool())
        .await
        .expect("total");
    assert_eq!(cents, 250);
    let encrypted: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(store.pool())
            .await
            .expect("pg_stat_ssl");
    assert!(encrypted, "the store's connection is not encrypted");
}

#[tokio::test]
async fn verify_full_from_the_url() {
    let db = fresh_database().await;
    let store = PgStore::connect(&verified_url("dedup_tls", &db))
        .await
        .expect("verify-full through the URL");
    applies_once_over_tls(&store).await;
}

#[tokio::test]
async fn verify_full_from_the_config() {
    let db = fresh_database().await;
    let config = PgConfig::default().with_ca_file(tls_dir().join("ca.pem"));
    let store = PgStore::connect_with(&plain_url("dedup_tls", &db), config)
        .await
        .expect("verify-full through PgConfig::with_ca_file");
    applies_once_over_tls(&store).await;
}

/// A batch's transaction over TLS is sent as it is written, not held 40 ms
/// for the server's delayed acknowledgement (sqlx 0.9.0 left Nagle's
/// algorithm on: the batched benchmark ran at a third of its rate).
#[tokio::test]
async fn a_batch_over_tls_is_not_held_for_acknowledgements() {
    let db = fresh_database().await;
    let config = PgConfig::default().with_max_connections(1);
    let store = PgStore::connect_with(&verified_url("dedup_tls", &db), config)
        .await
        .expect("verify-full through the URL");
    store.migrate().await.expect("migrate over TLS");
    dedup_core::conformance::transport::batch_transactions_are_not_held(&store).await;
}

#[tokio::test]
async fn a_client_certificate_where_the_server_asks_for_one() {
    let db = fresh_database().await;
    let owner = PgStore::connect(&verified_url("dedup_tls", &db))
        .await
        .expect("the database's owner");
    for grant in [
        format!("GRANT ALL ON DATABASE {db} TO dedup_mtls"),
        "GRANT ALL ON SCHEMA public TO dedup_mtls".to_owned(),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(grant))
            .execute(owner.pool())
            .await
            .expect("grant");
    }

    // Without its certificate the role is refused, with a clear error, at once.
    let started = Instant::now();
    let config = PgConfig::default().with_ca_file(tls_dir().join("ca.pem"));
    let refused = PgStore::connect_with(&plain_url("dedup_mtls", &db), config.clone())
        .await
        .expect_err("no client certificate");
    assert!(started.elapsed() < Duration::from_secs(20), "it hung");
    let said = refused.to_string();
    assert!(said.contains("certificate"), "{said}");
    assert!(!said.contains("dedup@"), "a password in the error: {said}");

    let store = PgStore::connect_with(
        &plain_url("dedup_mtls", &db),
        config.with_client_cert(tls_dir().join("client.pem"), tls_dir().join("client.key")),
    )
    .await
    .expect("with the client certificate");
    applies_once_over_tls(&store).await;
}

#[tokio::test]
async fn an_expired_client_certificate_is_refused_with_a_clear_error() {
    let db = fresh_database().await;
    let config = PgConfig::default()
        .with_ca_file(tls_dir().join("ca.pem"))
        .with_client_cert(tls_dir().join("expired.pem"), tls_dir().join("expired.key"));
    let started = Instant::now();
    let refused = PgStore::connect_with(&plain_url("dedup_mtls", &db), config)
        .await
        .expect_err("a client certificate that expired in 2020");
    assert!(started.elapsed() < Duration::from_secs(20), "it hung");
    // rustls reports the server's alert: "received fatal alert:
    // CertificateExpired".
    let said = refused.to_string();
    assert!(said.to_lowercase().contains("expired"), "{said}");
    assert!(!said.contains(":dedup@"), "a password in the error: {said}");
}

#[tokio::test]
async fn a_wrong_password_over_tls_names_the_role_not_the_password() {
    let url = verified_url("dedup_tls", "postgres").replacen(":dedup@", ":not-the-password@", 1);
    let started = Instant::now();
    let refused = PgStore::connect(&url).await.expect_err("a wrong password");
    assert!(started.elapsed() < Duration::from_secs(20), "it hung");
    let said = refused.to_string();
    assert!(said.contains("dedup_tls"), "{said}");
    assert!(
        !said.contains("not-the-password"),
        "the password in the error: {said}"
    );
}

#[tokio::test]
async fn a_server_another_ca_signed_is_refused_at_once() {
    let db = fresh_database().await;
    let config = PgConfig::default().with_ca_file(tls_dir().join("other-ca.pem"));
    let started = Instant::now();
    let refused = PgStore::connect_with(&plain_url("dedup_tls", &db), config)
        .await
        .expect_err("a server our trusted CA did not sign");
    assert!(started.elapsed() < Duration::from_secs(20), "it hung");
    let said = refused.to_string();
    assert!(said.contains("certificate"), "{said}");
}

#[tokio::test]
async fn the_tls_only_role_is_refused_in_clear() {
    // The server really is TLS-only for this role: what the tests above
    // prove is not proven by a server that takes anything.
    let refused = PgStore::connect(&format!(
        "{}?sslmode=disable",
        plain_url("dedup_tls", "postgres")
    ))
    .await
    .expect_err("in clear");
    assert!(refused.to_string().contains("no encryption"), "{refused}");
}

#[tokio::test]
async fn a_wrong_file_is_named_before_any_connection() {
    let junk = std::env::temp_dir().join(format!("dedup-not-a-ca-{}.pem", std::process::id()));
    std::fs::write(&junk, "hello\n").expect("write");
    // No server listens on port 9: only the files are looked at.
    let url = "postgres://dedup_tls:secret-password@localhost:9/postgres";
    for (config, names) in [
        (PgConfig::default().with_ca_file(&junk), "CA file"),
        (
            PgConfig::default()
                .with_client_cert(tls_dir().join("client.key"), tls_dir().join("client.pem")),
            "client certificate",
        ),
        (
            PgConfig::default()
                .with_client_cert(tls_dir().join("client.pem"), tls_dir().join("client.pem")),
            "client key",
        ),
        (
            PgConfig::default().with_ca_file(tls_dir().join("missing.pem")),
            "cannot be read",
        ),
    ] {
        let e = PgStore::connect_with(url, config)
            .await
            .expect_err("a wrong file");
        assert!(matches!(e, Error::Tls { .. }), "{e:?}");
        let said = e.to_string();
        assert!(said.contains(names), "{said}");
        assert!(!said.contains("secret-password"), "{said}");
    }
    std::fs::remove_file(&junk).ok();
}
