//! HTTPS for the console (`--tls-cert`, `--tls-key`): rustls with the ring
//! provider (the one the database connections already use), TLS 1.2 and
//! 1.3, HTTP/1.1.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::Failure;

/// An acceptor serving the certificate chain in `cert` with the key in
/// `key`; an error naming the file that is missing, unreadable, or holds
/// no certificate or key (never the key's contents).
pub(crate) fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, Failure> {
    let named = |flag: &str, path: &Path, what: String| {
        Failure::new(format!("{flag} {}: {what}", path.display()))
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .map_err(|e| {
            named(
                "--tls-cert",
                cert,
                format!("cannot read a PEM certificate ({e})"),
            )
        })?;
    if chain.is_empty() {
        return Err(named("--tls-cert", cert, "holds no PEM certificate".into()));
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        named(
            "--tls-key",
            key,
            format!("cannot read a PEM private key ({e})"),
        )
    })?;
    // The process's provider: ring, the one this build has.
    let mut config = ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| {
            Failure::new(format!(
                "--tls-cert {} and --tls-key {} do not make a server certificate: {e}",
                cert.display(),
                key.display()
            ))
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
