//! TLS to MariaDB, against the test server scripts/mariadb.sh starts: TLS
//! on with a certificate our test CA signed, the user `dedup_tls` refused
//! without TLS, `dedup_mtls` without a client certificate. Each test makes
//! a database of its own over TLS.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dedup_core::{HandlerError, HandlerExt, Outcome, idempotent};
use dedup_mysql::{Error, MySqlConfig, MySqlStore, MySqlTx};
use sqlx::mysql::MySqlConnectOptions;
use sqlx::{ConnectOptions, Executor};

/// The certificates scripts/tls.sh made.
fn tls_dir() -> PathBuf {
    std::env::var_os("DEDUP_TLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/dedup-tls"))
}

fn port() -> u16 {
    let url: MySqlConnectOptions = std::env::var("MYSQL_URL")
        .unwrap_or_else(|_| "mysql://dedup:dedup@127.0.0.1:3307/dedup".into())
        .parse()
        .expect("MYSQL_URL");
    url.get_port()
}

/// `user`'s URL to `database`, with no TLS parameters.
fn plain_url(user: &str, database: &str) -> String {
    format!("mysql://{user}:dedup@localhost:{}/{database}", port())
}

/// `user`'s VERIFY_IDENTITY URL to `database`.
fn verified_url(user: &str, database: &str) -> String {
    format!(
        "{}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        plain_url(user, database),
        tls_dir().join("ca.pem").display()
    )
}

/// A new database, made over TLS by `dedup_tls`.
async fn fresh_database() -> String {
    let name = format!("dedup_test_tls_{}", uuid::Uuid::new_v4().simple());
    let options: MySqlConnectOptions = verified_url("dedup_tls", "dedup").parse().expect("url");
    let mut admin = options.connect().await.expect("dedup_tls over TLS");
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
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
async fn record_payment(tx: &mut MySqlTx, ev: Payment) -> Result<(), HandlerError> {
    sqlx::query("UPDATE totals SET cents = cents + ?")
        .bind(ev.amount_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The store claims over TLS: a payment delivered twice is applied once,
/// and the server says the connection is encrypted.
async fn applies_once_over_tls(store: &MySqlStore) {
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
    let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(store.pool())
        .await
        .expect("Ssl_cipher");
    assert!(
        !cipher.is_empty(),
        "the store's connection is not encrypted"
    );
}

#[tokio::test]
async fn verify_identity_from_the_url() {
    let db = fresh_database().await;
    let store = MySqlStore::connect(&verified_url("dedup_tls", &db))
        .await
        .expect("VERIFY_IDENTITY through the URL");
    applies_once_over_tls(&store).await;
}

#[tokio::test]
async fn verify_identity_from_the_config() {
    let db = fresh_database().await;
    let config = MySqlConfig::default().with_ca_file(tls_dir().join("ca.pem"));
    let store = MySqlStore::connect_with(&plain_url("dedup_tls", &db), config)
        .await
        .expect("VERIFY_IDENTITY through MySqlConfig::with_ca_file");
    applies_once_over_tls(&store).await;
}

/// A batch's transaction over TLS is sent as it is written, not held 40 ms
/// for the server's delayed acknowledgement (sqlx 0.9.0 left Nagle's
/// algorithm on).
#[tokio::test]
async fn a_batch_over_tls_is_not_held_for_acknowledgements() {
    let db = fresh_database().await;
    let config = MySqlConfig::default().with_max_connections(1);
    let store = MySqlStore::connect_with(&verified_url("dedup_tls", &db), config)
        .await
        .expect("VERIFY_IDENTITY through the URL");
    store.migrate().await.expect("migrate over TLS");
    dedup_core::conformance::transport::batch_transactions_are_not_held(&store).await;
}

#[tokio::test]
async fn a_client_certificate_where_the_server_asks_for_one() {
    let db = fresh_database().await;
    let config = MySqlConfig::default().with_ca_file(tls_dir().join("ca.pem"));

    // Without its certificate the user is refused, with a clear error, at once.
    let started = Instant::now();
    let refused = MySqlStore::connect_with(&plain_url("dedup_mtls", &db), config.clone())
        .await
        .expect_err("no client certificate");
    assert!(started.elapsed() < Duration::from_secs(20), "it hung");
    let said = refused.to_string();
    assert!(said.contains("Access denied"), "{said}");
    assert!(!said.contains(":dedup@"), "a password in the error: {said}");

    let store = MySqlStore::connect_with(
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
    let config = MySqlConfig::default()
        .with_ca_file(tls_dir().join("ca.pem"))
        .with_client_cert(tls_dir().join("expired.pem"), tls_dir().join("expired.key"));
    let started = Instant::now();
    let refused = MySqlStore::connect_with(&plain_url("dedup_mtls", &db), config)
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
async fn a_wrong_password_over_tls_names_the_user_not_the_password() {
    let url = verified_url("dedup_tls", "dedup").replacen(":dedup@", ":not-the-password@", 1);
    let started = Instant::now();
    let refused = MySqlStore::connect(&url)
        .await
        .expect_err("a wrong password");
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
    let config = MySqlConfig::default().with_ca_file(tls_dir().join("other-ca.pem"));
    let started = Instant::now();
    let refused = MySqlStore::connect_with(&plain_url("dedup_tls", &db), config)
        .await
        .expect_err("a server our trusted CA did not sign");
    assert!(started.elapsed() < Duration::from_secs(20), "it hung");
    let said = refused.to_string();
    assert!(said.contains("certificate"), "{said}");
}

#[tokio::test]
async fn the_tls_only_user_is_refused_in_clear() {
    // The server really is TLS-only for this user: what the tests above
    // prove is not proven by a server that takes anything.
    let url = format!("{}?ssl-mode=DISABLED", plain_url("dedup_tls", "dedup"));
    let refused = MySqlStore::connect(&url).await.expect_err("in clear");
    assert!(refused.to_string().contains("Access denied"), "{refused}");
}

#[tokio::test]
async fn a_wrong_file_is_named_before_any_connection() {
    let junk = std::env::temp_dir().join(format!("dedup-not-a-ca-{}.pem", std::process::id()));
    std::fs::write(&junk, "hello\n").expect("write");
    // No server listens on port 9: only the files are looked at.
    let url = "mysql://dedup_tls:secret-password@localhost:9/dedup";
    for (config, names) in [
        (MySqlConfig::default().with_ca_file(&junk), "CA file"),
        (
            MySqlConfig::default()
                .with_client_cert(tls_dir().join("client.key"), tls_dir().join("client.pem")),
            "client certificate",
        ),
        (
            MySqlConfig::default()
                .with_client_cert(tls_dir().join("client.pem"), tls_dir().join("client.pem")),
            "client key",
        ),
    ] {
        let e = MySqlStore::connect_with(url, config)
            .await
            .expect_err("a wrong file");
        assert!(matches!(e, Error::Tls { .. }), "{e:?}");
        let said = e.to_string();
        assert!(said.contains(names), "{said}");
        assert!(!said.contains("secret-password"), "{said}");
    }
    std::fs::remove_file(&junk).ok();
}
