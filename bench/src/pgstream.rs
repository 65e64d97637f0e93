//! A minimal client of PostgreSQL's streaming replication protocol, for
//! `outbox-logical-stream-drain`: a `replication=database` connection
//! (SCRAM-SHA-256), `START_REPLICATION .. LOGICAL`, the stream's messages,
//! and standby status updates that confirm what was published. What
//! Debezium reads; sqlx speaks no replication protocol. The messages and
//! SCRAM are `postgres-protocol`'s; the replication stream's own messages
//! (inside CopyData) are read here.

use bytes::{Buf as _, BytesMut};
use fallible_iterator::FallibleIterator as _;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::{ErrorResponseBody, Header, Message};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
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
    reader: Reader,
    writer: OwnedWriteHalf,
}

/// The write half of a started stream: what confirms.
pub(crate) struct Confirmer {
    writer: OwnedWriteHalf,
}

/// What the server sent.
enum Received {
    Message(Message),
    /// `CopyBothResponse`, which `postgres-protocol` does not parse: the
    /// replication stream begins.
    CopyBoth,
}

/// The read half: the bytes read and not yet a whole message.
struct Reader {
    half: OwnedReadHalf,
    buf: BytesMut,
}

impl Reader {
    async fn next(&mut self) -> Result<Received, BoxError> {
        loop {
            if let Some(header) = Header::parse(&self.buf)?
                && header.tag() == b'W'
            {
                let total = usize::try_from(header.len())? + 1;
                if self.buf.len() >= total {
                    self.buf.advance(total);
                    return Ok(Received::CopyBoth);
                }
            } else if let Some(message) = Message::parse(&mut self.buf)? {
                return Ok(Received::Message(message));
            }
            if self.half.read_buf(&mut self.buf).await? == 0 {
                return Err("the server closed the connection".into());
            }
        }
    }

    /// The next message of a started stream.
    async fn streamed(&mut self) -> Result<Streamed, BoxError> {
        loop {
            match self.next().await? {
                Received::Message(Message::CopyData(body)) => {
                    let data = body.data();
                    match data.first() {
                        Some(b'w') => return Ok(Streamed::Data(data[25..].to_vec())),
                        Some(b'k') => return Ok(Streamed::Keepalive(data.get(17) == Some(&1))),
                        _ => {}
                    }
                }
                Received::Message(Message::ErrorResponse(body)) => return Err(error_text(&body)),
                _ => {}
            }
        }
    }
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
        let (half, writer) = TcpStream::connect(address).await?.into_split();
        let mut stream = ReplicationStream {
            reader: Reader {
                half,
                buf: BytesMut::new(),
            },
            writer,
        };
        let mut out = BytesMut::new();
        frontend::startup_message(
            [
                ("user", user),
                ("database", database),
                ("replication", "database"),
            ],
            &mut out,
        )?;
        stream.writer.write_all(&out).await?;
        stream.authenticate(password).await?;
        Ok(stream)
    }

    /// SCRAM-SHA-256 (a server that asks for no password, `trust`, is
    /// taken at its word); once SCRAM began, success only after the server
    /// proved it knows the password too.
    async fn authenticate(&mut self, password: &str) -> Result<(), BoxError> {
        let mut scram: Option<ScramSha256> = None;
        let (mut began, mut verified) = (false, false);
        loop {
            let Received::Message(message) = self.reader.next().await? else {
                return Err("a stream before authentication".into());
            };
            let mut out = BytesMut::new();
            match message {
                Message::AuthenticationOk if began && !verified => {
                    return Err("the server accepted without proving itself".into());
                }
                Message::AuthenticationSasl(body) => {
                    let mut mechanisms = body.mechanisms();
                    let mut offered = false;
                    while let Some(m) = mechanisms.next()? {
                        offered |= m == sasl::SCRAM_SHA_256;
                    }
                    if !offered {
                        return Err("the server offers no SCRAM-SHA-256".into());
                    }
                    began = true;
                    let client =
                        ScramSha256::new(password.as_bytes(), ChannelBinding::unsupported());
                    frontend::sasl_initial_response(
                        sasl::SCRAM_SHA_256,
                        client.message(),
                        &mut out,
                    )?;
                    scram = Some(client);
                }
                Message::AuthenticationSaslContinue(body) => {
                    let client = scram.as_mut().ok_or("SCRAM out of turn")?;
                    client.update(body.data())?;
                    frontend::sasl_response(client.message(), &mut out)?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    // Checks the server's signature.
                    scram
                        .as_mut()
                        .ok_or("SCRAM out of turn")?
                        .finish(body.data())?;
                    verified = true;
                }
                Message::AuthenticationCleartextPassword
                | Message::AuthenticationMd5Password(_)
                | Message::AuthenticationKerberosV5
                | Message::AuthenticationScmCredential
                | Message::AuthenticationGss
                | Message::AuthenticationSspi => {
                    return Err("an authentication method other than SCRAM-SHA-256".into());
                }
                Message::ReadyForQuery(_) => return Ok(()),
                Message::ErrorResponse(body) => return Err(error_text(&body)),
                _ => {}
            }
            if !out.is_empty() {
                self.writer.write_all(&out).await?;
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
            "START_REPLICATION SLOT {slot} LOGICAL 0/0 (proto_version '1', publication_names '{publication}'{messages})"
        );
        let mut out = BytesMut::new();
        frontend::query(&query, &mut out)?;
        self.writer.write_all(&out).await?;
        loop {
            match self.reader.next().await? {
                Received::CopyBoth => break,
                Received::Message(Message::ErrorResponse(body)) => return Err(error_text(&body)),
                Received::Message(_) => {}
            }
        }
        let (sender, receiver) = tokio::sync::mpsc::channel(10_000);
        let ReplicationStream { mut reader, writer } = self;
        tokio::spawn(async move {
            loop {
                let next = reader.streamed().await;
                let failed = next.is_err();
                if sender.send(next).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok((receiver, Confirmer { writer }))
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
        let mut out = BytesMut::new();
        frontend::CopyData::new(&body[..])?.write(&mut out);
        self.writer.write_all(&out).await?;
        Ok(())
    }
}

/// The message of a server's error.
fn error_text(body: &ErrorResponseBody) -> BoxError {
    let mut fields = body.fields();
    while let Ok(Some(field)) = fields.next() {
        if field.type_() == b'M' {
            return String::from_utf8_lossy(field.value_bytes())
                .into_owned()
                .into();
        }
    }
    "a server error".into()
}
