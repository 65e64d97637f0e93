//! A minimal client of PostgreSQL's streaming replication protocol, for
//! `outbox-logical-stream-drain`: a `replication=database` connection
//! (SCRAM-SHA-256 or cleartext password), `START_REPLICATION .. LOGICAL`,
//! the stream's messages, and standby status updates that confirm what was
//! published. What Debezium reads; sqlx speaks no replication protocol.

use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::BoxError;

/// One message of the stream.
pub(crate) enum Streamed {
    /// A `pgoutput` message.
    Data(Vec<u8>),
    /// The server asks for a status update (`true`: at once).
    Keepalive(bool),
}

pub(crate) struct ReplicationStream {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

/// The write half of a started stream: what confirms.
pub(crate) struct Confirmer {
    writer: OwnedWriteHalf,
}

impl ReplicationStream {
    /// Connects to `url` (`postgres://user:password@host:port/database`).
    pub(crate) async fn connect(url: &str) -> Result<Self, BoxError> {
        let rest = url
            .strip_prefix("postgres://")
            .or_else(|| url.strip_prefix("postgresql://"))
            .ok_or("a postgres:// URL")?;
        let (credentials, rest) = rest.split_once('@').ok_or("a URL with credentials")?;
        let (user, password) = credentials.split_once(':').ok_or("a URL with a password")?;
        let (address, database) = rest.split_once('/').ok_or("a URL with a database")?;
        let database = database.split('?').next().unwrap_or(database);
        let (reader, writer) = TcpStream::connect(address).await?.into_split();
        let mut stream = ReplicationStream {
            reader: BufReader::new(reader),
            writer,
        };
        let mut startup = Vec::new();
        startup.extend_from_slice(&196_608u32.to_be_bytes());
        for (k, v) in [
            ("user", user),
            ("database", database),
            ("replication", "database"),
        ] {
            startup.extend_from_slice(k.as_bytes());
            startup.push(0);
            startup.extend_from_slice(v.as_bytes());
            startup.push(0);
        }
        startup.push(0);
        let mut message = ((startup.len() + 4) as u32).to_be_bytes().to_vec();
        message.extend_from_slice(&startup);
        stream.writer.write_all(&message).await?;
        stream.authenticate(password).await?;
        Ok(stream)
    }

    async fn authenticate(&mut self, password: &str) -> Result<(), BoxError> {
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let first_bare = format!("n=,r={nonce}");
        let mut server_signature = Vec::new();
        // Once SCRAM began, success only after the server proved it knows
        // the password too (a server that asks for none, `trust`, is
        // taken at its word).
        let (mut began, mut verified) = (false, false);
        loop {
            let (kind, body) = self.read().await?;
            match kind {
                b'R' => {
                    let code = u32::from_be_bytes(body[..4].try_into()?);
                    match code {
                        0 if verified || !began => {}
                        0 => return Err("the server accepted without proving itself".into()),
                        10 => {
                            began = true;
                            let mut p = b"SCRAM-SHA-256\0".to_vec();
                            let first = format!("n,,{first_bare}");
                            p.extend_from_slice(&(first.len() as u32).to_be_bytes());
                            p.extend_from_slice(first.as_bytes());
                            self.send(b'p', &p).await?;
                        }
                        11 => {
                            let server_first = String::from_utf8(body[4..].to_vec())?;
                            let field = |k: &str| {
                                server_first
                                    .split(',')
                                    .find_map(|f| f.strip_prefix(k))
                                    .ok_or("a SCRAM field missing")
                            };
                            let (r, s, i) = (field("r=")?, field("s=")?, field("i=")?);
                            if !r.starts_with(&nonce) {
                                return Err("the server's SCRAM nonce is not ours".into());
                            }
                            let salt = base64_decode(s)?;
                            let salted = pbkdf2(password.as_bytes(), &salt, i.parse()?);
                            let client_key = hmac(&salted, b"Client Key");
                            let stored_key = Sha256::digest(client_key);
                            let without_proof = format!("c=biws,r={r}");
                            let auth_message =
                                format!("{first_bare},{server_first},{without_proof}");
                            let signature = hmac(&stored_key, auth_message.as_bytes());
                            let proof: Vec<u8> = client_key
                                .iter()
                                .zip(signature.iter())
                                .map(|(a, b)| a ^ b)
                                .collect();
                            let server_key = hmac(&salted, b"Server Key");
                            server_signature = hmac(&server_key, auth_message.as_bytes()).to_vec();
                            let last = format!("{without_proof},p={}", base64_encode(&proof));
                            self.send(b'p', last.as_bytes()).await?;
                        }
                        12 => {
                            let expected = format!("v={}", base64_encode(&server_signature));
                            if server_signature.is_empty()
                                || String::from_utf8_lossy(&body[4..]) != expected
                            {
                                return Err("the server's SCRAM signature does not match".into());
                            }
                            verified = true;
                        }
                        // Cleartext (3), MD5 (5) and the rest: not spoken.
                        other => return Err(format!("authentication method {other}").into()),
                    }
                }
                b'Z' => return Ok(()),
                b'E' => return Err(error_text(&body).into()),
                _ => {}
            }
        }
    }

    /// `START_REPLICATION` of `slot` (pgoutput) for `publication`.
    /// With `messages`, logical decoding messages too (PostgreSQL 14+).
    /// The stream is read by a task of its own, into the receiver (a read
    /// never cut off halfway by a timeout); the confirmer writes.
    pub(crate) async fn start(
        mut self,
        slot: &str,
        publication: &str,
        messages: bool,
    ) -> Result<
        (
            tokio::sync::mpsc::Receiver<Result<Streamed, BoxError>>,
            Confirmer,
        ),
        BoxError,
    > {
        let messages = if messages { ", messages 'true'" } else { "" };
        let query = format!(
            "START_REPLICATION SLOT {slot} LOGICAL 0/0 (proto_version '1', publication_names '{publication}'{messages})\0"
        );
        self.send(b'Q', query.as_bytes()).await?;
        loop {
            let (kind, body) = self.read().await?;
            match kind {
                b'W' => break,
                b'E' => return Err(error_text(&body).into()),
                _ => {}
            }
        }
        let (sender, receiver) = tokio::sync::mpsc::channel(10_000);
        let ReplicationStream { reader, writer } = self;
        tokio::spawn(async move {
            let mut reading = Reading { reader };
            loop {
                let next = reading.next().await;
                let failed = next.is_err();
                if sender.send(next).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok((receiver, Confirmer { writer }))
    }

    async fn send(&mut self, kind: u8, body: &[u8]) -> Result<(), BoxError> {
        send(&mut self.writer, kind, body).await
    }

    async fn read(&mut self) -> Result<(u8, Vec<u8>), BoxError> {
        read(&mut self.reader).await
    }
}

/// The read half of a started stream.
struct Reading {
    reader: BufReader<OwnedReadHalf>,
}

impl Reading {
    /// The next message of the stream.
    async fn next(&mut self) -> Result<Streamed, BoxError> {
        loop {
            let (kind, body) = read(&mut self.reader).await?;
            match (kind, body.first()) {
                (b'd', Some(b'w')) => return Ok(Streamed::Data(body[25..].to_vec())),
                (b'd', Some(b'k')) => return Ok(Streamed::Keepalive(body.get(17) == Some(&1))),
                (b'E', _) => return Err(error_text(&body).into()),
                _ => {}
            }
        }
    }
}

impl Confirmer {
    /// Confirms everything up to `lsn` (the slot may drop it).
    pub(crate) async fn confirm(&mut self, lsn: u64) -> Result<(), BoxError> {
        let mut body = vec![b'r'];
        for _ in 0..3 {
            body.extend_from_slice(&lsn.to_be_bytes());
        }
        // Microseconds since 2000-01-01.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_micros() as i64
            - 946_684_800_000_000;
        body.extend_from_slice(&now.to_be_bytes());
        body.push(0);
        send(&mut self.writer, b'd', &body).await
    }
}

async fn send(writer: &mut OwnedWriteHalf, kind: u8, body: &[u8]) -> Result<(), BoxError> {
    let mut message = Vec::with_capacity(body.len() + 5);
    message.push(kind);
    message.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
    message.extend_from_slice(body);
    writer.write_all(&message).await?;
    Ok(())
}

async fn read(reader: &mut BufReader<OwnedReadHalf>) -> Result<(u8, Vec<u8>), BoxError> {
    let kind = reader.read_u8().await?;
    let len = reader.read_u32().await? as usize;
    let mut body = vec![0; len.checked_sub(4).ok_or("a message length under 4")?];
    reader.read_exact(&mut body).await?;
    Ok((kind, body))
}

fn error_text(body: &[u8]) -> String {
    body.split(|&b| b == 0)
        .filter(|f| f.first() == Some(&b'M'))
        .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
        .next()
        .unwrap_or_else(|| "a server error".into())
}

fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(message);
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

fn pbkdf2(password: &[u8], salt: &[u8], iterations: u32) -> [u8; 32] {
    let mut first = salt.to_vec();
    first.extend_from_slice(&1u32.to_be_bytes());
    let mut u = hmac(password, &first);
    let mut out = u;
    for _ in 1..iterations {
        u = hmac(password, &u);
        for (o, x) in out.iter_mut().zip(u.iter()) {
            *o ^= x;
        }
    }
    out
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(BASE64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn base64_decode(text: &str) -> Result<Vec<u8>, BoxError> {
    let mut out = Vec::new();
    let (mut n, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = BASE64
            .iter()
            .position(|&b| b == c)
            .ok_or("a bad base64 digit")? as u32;
        n = n << 6 | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((n >> bits) as u8);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for bytes in [&b""[..], b"f", b"fo", b"foo", b"foob", b"fooba", b"foobar"] {
            assert_eq!(base64_decode(&base64_encode(bytes)).unwrap(), bytes);
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2.
        let mac = hmac(b"Jefe", b"what do ya want for nothing?");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
