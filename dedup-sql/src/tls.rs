//! TLS to the database as a store's settings give it (the URL's own
//! parameters work as well): the CA to trust and the client certificate to
//! present, each file checked before any connection is tried, and one
//! warning when a connection that leaves this host is not verified.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use crate::Error;

/// A store's TLS files. With a CA file TLS is required, and the server's
/// certificate must be signed by that CA and name the host the store
/// connects to (PostgreSQL's `sslmode=verify-full`, MySQL's
/// `ssl-mode=VERIFY_IDENTITY`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsFiles {
    /// The CA certificates (PEM) a server's certificate must chain to.
    pub ca_file: Option<PathBuf>,
    /// A client certificate (PEM) and its private key (PEM), for a server
    /// that asks for one (mutual TLS).
    pub client: Option<(PathBuf, PathBuf)>,
}

impl TlsFiles {
    /// Whether any file is set.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client.is_some()
    }

    /// Checks that each file can be read and holds what it is for (PEM
    /// certificates; a PEM private key): a wrong file is said here, naming
    /// it, instead of as a failed handshake. A key's contents are never
    /// shown.
    pub fn check(&self) -> Result<(), Error> {
        if let Some(ca) = &self.ca_file {
            check_pem(ca, "CA file", "CERTIFICATE")?;
        }
        if let Some((cert, key)) = &self.client {
            check_pem(cert, "client certificate", "CERTIFICATE")?;
            check_pem(key, "client key", "PRIVATE KEY")?;
        }
        Ok(())
    }
}

/// `path` read, with at least one PEM block whose label ends with `label`.
fn check_pem(path: &Path, what: &str, label: &str) -> Result<(), Error> {
    let text = std::fs::read(path).map_err(|e| Error::Tls {
        message: format!("the {what} {} cannot be read: {e}", path.display()),
    })?;
    let text = String::from_utf8_lossy(&text);
    let found = text.lines().any(|line| {
        line.strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|l| l.ends_with(label))
    });
    if found {
        Ok(())
    } else {
        Err(Error::Tls {
            message: format!(
                "the {what} {} holds no PEM {label} (a -----BEGIN ...{label}----- block)",
                path.display()
            ),
        })
    }
}

/// Warns, once per store, when a connection to `host` leaves this machine
/// and does not verify the server (a password and the data could go to
/// whoever answers): `verified` says whether it checks the server's
/// certificate against a CA.
pub fn warn_unverified(database: &str, host: &str, verified: bool, how: &str) {
    if verified || is_local(host) {
        return;
    }
    tracing::warn!(
        database,
        host,
        "the connection to the database is not verified against a CA: {how}"
    );
}

/// A host on this machine: a loopback address, `localhost`, or a socket.
fn is_local(host: &str) -> bool {
    host.is_empty()
        || host.starts_with('/')
        || host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_checked_for_what_they_hold() {
        let dir = std::env::temp_dir().join(format!("dedup-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        let junk = dir.join("junk.pem");
        std::fs::write(
            &cert,
            "-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nsecret\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        std::fs::write(&junk, "not a certificate\n").expect("write");

        let ok = TlsFiles {
            ca_file: Some(cert.clone()),
            client: Some((cert.clone(), key.clone())),
        };
        ok.check().expect("a certificate and a key");

        let bad_ca = TlsFiles {
            ca_file: Some(junk.clone()),
            client: None,
        };
        let e = bad_ca.check().expect_err("junk").to_string();
        assert!(e.contains("CA file") && e.contains("junk.pem"), "{e}");

        // A key given as the certificate, and the key's text never shown.
        let swapped = TlsFiles {
            ca_file: None,
            client: Some((key.clone(), cert.clone())),
        };
        let e = swapped.check().expect_err("swapped").to_string();
        assert!(e.contains("client certificate"), "{e}");
        assert!(!e.contains("secret"), "{e}");

        let missing = TlsFiles {
            ca_file: Some(dir.join("nowhere.pem")),
            client: None,
        };
        let e = missing.check().expect_err("missing").to_string();
        assert!(e.contains("cannot be read"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn local_hosts_are_told_apart() {
        for host in [
            "localhost",
            "127.0.0.1",
            "::1",
            "[::1]",
            "/var/run/postgresql",
            "",
        ] {
            assert!(is_local(host), "{host}");
        }
        for host in ["db.example.com", "10.0.0.5", "192.168.1.1"] {
            assert!(!is_local(host), "{host}");
        }
    }
}
