//! `outbox-logical-sql-drain`: a relay that reads the outbox's inserts from
//! PostgreSQL's logical decoding (what Debezium does) instead of leasing
//! and marking rows, measured as an option beside the table relay.
//!
//! It needs `wal_level = logical` and a role allowed to create replication
//! slots (`ALTER ROLE .. REPLICATION`). A logical slot is created before the
//! backlog is enqueued (a slot decodes what comes after it); the relay then
//! takes up to `--logical-batch` changes at a time with
//! `pg_logical_slot_peek_binary_changes` (the `pgoutput` plugin, through a
//! publication of the outbox table), sends each insert, waits for every
//! acknowledgement, deletes the published rows (as `Retention::Delete`
//! does) and only then advances the slot past them: a relay killed before
//! the advance publishes them again (at least once, as the table relay).
//! Not a product feature: a measurement of what this path would cost.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;

use crate::BoxError;

/// The slot and publication the mode made, dropped by [`Slot::drop_all`].
pub(crate) struct Slot {
    name: String,
    publication: String,
}

impl Slot {
    /// Checks the server can decode, then makes a publication of the outbox
    /// table and a `pgoutput` slot.
    pub(crate) async fn create(pool: &PgPool) -> Result<Self, BoxError> {
        let level: String = sqlx::query_scalar("SHOW wal_level").fetch_one(pool).await?;
        if level != "logical" {
            return Err(format!(
                "the outbox-logical modes need wal_level = logical (it is {level}): \
                 ALTER SYSTEM SET wal_level = logical, restart PostgreSQL, and \
                 ALTER ROLE <the benchmark's role> REPLICATION"
            )
            .into());
        }
        let id = uuid::Uuid::new_v4().simple().to_string();
        let slot = Slot {
            name: format!("dedup_bench_{id}"),
            publication: format!("dedup_bench_{id}"),
        };
        // Both names are made here from a UUID: safe to splice.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE PUBLICATION {} FOR TABLE dedup_outbox WITH (publish = 'insert')",
            slot.publication
        )))
        .execute(pool)
        .await?;
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&slot.name)
            .execute(pool)
            .await?;
        Ok(slot)
    }

    /// Drops the slot (which would otherwise hold WAL on the server for
    /// good) and the publication. A slot whose stream just closed may still
    /// be active for a moment: tried again for up to 10 s.
    pub(crate) async fn drop_all(&self, pool: &PgPool) -> Result<(), BoxError> {
        let started = Instant::now();
        loop {
            match sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&self.name)
                .execute(pool)
                .await
            {
                Ok(_) => break,
                Err(e) if started.elapsed() < Duration::from_secs(10) => {
                    tracing::debug!(error = %e, "the slot is not dropped yet");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP PUBLICATION {}",
            self.publication
        )))
        .execute(pool)
        .await?;
        Ok(())
    }
}

/// What the relay did, and where its time went.
#[derive(Default)]
pub(crate) struct Drained {
    pub(crate) published: u64,
    pub(crate) batches: u64,
    pub(crate) peek: Duration,
    pub(crate) send: Duration,
    pub(crate) delete: Duration,
    pub(crate) advance: Duration,
}

/// One decoded insert of the outbox table, or a logical decoding message
/// (`pg_logical_emit_message`, no row: `seq` is `None`).
struct Insert {
    seq: Option<i64>,
    event_id: String,
    topic: String,
    key: Option<String>,
    payload: Vec<u8>,
}

/// An idempotent producer whose sends every in-sync replica acknowledges:
/// the relay's settings, and the direct mode's.
pub(crate) fn producer(brokers: &str) -> Result<FutureProducer, BoxError> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()?)
}

/// Hands `e` to the producer with its `event-id` header, waiting while
/// the producer's queue is full.
async fn send(
    producer: &FutureProducer,
    e: &Insert,
) -> Result<rdkafka::producer::DeliveryFuture, BoxError> {
    let headers = OwnedHeaders::new().insert(Header {
        key: dedup_core::outbox::EVENT_ID_HEADER,
        value: Some(&e.event_id),
    });
    let mut record = FutureRecord::to(&e.topic)
        .payload(&e.payload)
        .headers(headers);
    if let Some(key) = &e.key {
        record = record.key(key);
    }
    Ok(crate::produce::send_when_room(producer, record).await?)
}

/// Publishes what the slot holds until `events` went out.
pub(crate) async fn drain(
    pool: &PgPool,
    slot: &Slot,
    brokers: &str,
    batch: usize,
    events: u64,
) -> Result<Drained, BoxError> {
    let producer = producer(brokers)?;
    let mut conn = pool.acquire().await?;
    let mut relations: HashMap<u32, Vec<String>> = HashMap::new();
    let mut out = Drained::default();
    let started = Instant::now();
    while out.published < events {
        if started.elapsed() > Duration::from_secs(3600) {
            return Err("gave up after an hour".into());
        }
        let at = Instant::now();
        let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes( \
                 $1, NULL, $2, 'proto_version', '1', 'publication_names', $3)",
        )
        .bind(&slot.name)
        .bind(batch as i32)
        .bind(&slot.publication)
        .fetch_all(&mut *conn)
        .await?;
        out.peek += at.elapsed();
        let Some(last_lsn) = rows.last().map(|(lsn, _)| lsn.clone()) else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let mut inserts = Vec::new();
        for (_, data) in &rows {
            if let Some(insert) = decode(data, &mut relations)? {
                inserts.push(insert);
            }
        }
        let at = Instant::now();
        let mut deliveries = Vec::with_capacity(inserts.len());
        for e in &inserts {
            deliveries.push(send(&producer, e).await?);
        }
        for delivery in deliveries {
            delivery.await?.map_err(|(e, _)| e)?;
        }
        out.send += at.elapsed();
        let at = Instant::now();
        let seqs: Vec<i64> = inserts.iter().filter_map(|e| e.seq).collect();
        sqlx::query("DELETE FROM dedup_outbox WHERE seq = ANY($1)")
            .bind(&seqs)
            .execute(&mut *conn)
            .await?;
        out.delete += at.elapsed();
        let at = Instant::now();
        sqlx::query("SELECT pg_replication_slot_advance($1, $2::pg_lsn)")
            .bind(&slot.name)
            .bind(&last_lsn)
            .execute(&mut *conn)
            .await?;
        out.advance += at.elapsed();
        out.published += inserts.len() as u64;
        out.batches += 1;
    }
    Ok(out)
}

/// Decodes one `pgoutput` message (protocol 1): a relation's columns are
/// remembered, an insert into the outbox table is returned, anything else
/// (begin, commit) is skipped.
fn decode(
    data: &[u8],
    relations: &mut HashMap<u32, Vec<String>>,
) -> Result<Option<Insert>, BoxError> {
    let mut r = Reader { data, at: 1 };
    match data.first() {
        Some(b'R') => {
            let id = r.u32()?;
            let _namespace = r.cstring()?;
            let _name = r.cstring()?;
            let _identity = r.u8()?;
            let n = r.u16()?;
            let mut columns = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let _flags = r.u8()?;
                columns.push(r.cstring()?);
                let _type = r.u32()?;
                let _modifier = r.u32()?;
            }
            relations.insert(id, columns);
            Ok(None)
        }
        Some(b'I') => {
            let id = r.u32()?;
            let columns = relations
                .get(&id)
                .ok_or("an insert before its relation message")?;
            if r.u8()? != b'N' {
                return Err("an insert without its new tuple".into());
            }
            let n = r.u16()? as usize;
            let mut values: HashMap<&str, Option<&[u8]>> = HashMap::with_capacity(n);
            for column in columns.iter().take(n) {
                let value = match r.u8()? {
                    b'n' | b'u' => None,
                    b't' => {
                        let len = r.u32()? as usize;
                        Some(r.take(len)?)
                    }
                    other => return Err(format!("a column of kind {other}").into()),
                };
                values.insert(column.as_str(), value);
            }
            let text = |name: &str| -> Option<String> {
                values
                    .get(name)
                    .copied()
                    .flatten()
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            };
            let payload = text("payload").ok_or("an insert without its payload")?;
            Ok(Some(Insert {
                seq: Some(text("seq").ok_or("no seq")?.parse()?),
                event_id: text("event_id").ok_or("no event_id")?,
                topic: text("topic").ok_or("no topic")?,
                key: text("key"),
                payload: unhex(&payload)?,
            }))
        }
        Some(b'M') => {
            let _flags = r.u8()?;
            let _lsn = r.take(8)?;
            if r.cstring()? != MESSAGE_PREFIX {
                return Ok(None);
            }
            let _len = r.u32()?;
            let mut field = || -> Result<Vec<u8>, BoxError> {
                let len = r.u32()? as usize;
                Ok(r.take(len)?.to_vec())
            };
            let (topic, key, event_id, payload) = (field()?, field()?, field()?, field()?);
            Ok(Some(Insert {
                seq: None,
                event_id: String::from_utf8(event_id)?,
                topic: String::from_utf8(topic)?,
                key: Some(String::from_utf8(key)?),
                payload,
            }))
        }
        _ => Ok(None),
    }
}

/// The prefix of `outbox-logical-message-drain`'s messages.
pub(crate) const MESSAGE_PREFIX: &str = "dedup-outbox";

/// A message's content: topic, key, event id, payload, each as a length
/// (u32) then its bytes.
pub(crate) fn message_content(topic: &str, key: &str, event_id: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + topic.len() + key.len() + event_id.len() + payload.len());
    for field in [
        topic.as_bytes(),
        key.as_bytes(),
        event_id.as_bytes(),
        payload,
    ] {
        out.extend_from_slice(&(field.len() as u32).to_be_bytes());
        out.extend_from_slice(field);
    }
    out
}

/// A `bytea` in PostgreSQL's text output (`\x` then hex).
fn unhex(text: &str) -> Result<Vec<u8>, BoxError> {
    let hex = text.strip_prefix("\\x").ok_or("a bytea not in hex")?;
    let digit = |c: u8| -> Result<u8, BoxError> {
        Ok(match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return Err("a bytea with a bad hex digit".into()),
        })
    };
    hex.as_bytes()
        .chunks(2)
        .map(|pair| match pair {
            [hi, lo] => Ok(digit(*hi)? << 4 | digit(*lo)?),
            _ => Err("a bytea of odd length".into()),
        })
        .collect()
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BoxError> {
        let out = self
            .data
            .get(self.at..self.at + n)
            .ok_or("a pgoutput message cut short")?;
        self.at += n;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, BoxError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, BoxError> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into()?))
    }
    fn u32(&mut self) -> Result<u32, BoxError> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into()?))
    }
    fn cstring(&mut self) -> Result<String, BoxError> {
        let rest = &self.data[self.at..];
        let end = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or("a pgoutput string without its end")?;
        self.at += end + 1;
        Ok(String::from_utf8_lossy(&rest[..end]).into_owned())
    }
}

/// The end of the transaction a `pgoutput` commit message closes.
fn commit_end(data: &[u8]) -> Option<u64> {
    (data.first() == Some(&b'C'))
        .then(|| data.get(10..18))
        .flatten()
        .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
}

/// A transaction's sends, its rows (`None`: a message) and where it ends in
/// the WAL.
type Sent = (
    Vec<rdkafka::producer::DeliveryFuture>,
    Vec<Option<i64>>,
    u64,
);

/// `outbox-logical-stream-drain`: the same relay on the replication protocol's
/// stream (decoded once, as it comes; what Debezium reads). Each insert is
/// sent as it arrives; a second task awaits the acknowledgements in order,
/// deletes the published rows every 5,000 events (or when nothing more has
/// come) and then the stream confirms the end of the last transaction
/// published whole.
pub(crate) async fn drain_stream(
    url: &str,
    pool: &PgPool,
    slot: &Slot,
    brokers: &str,
    events: u64,
    messages: bool,
) -> Result<Drained, BoxError> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let producer = producer(brokers)?;
    let (mut stream, mut confirmer) = crate::pgstream::ReplicationStream::connect(url)
        .await?
        .start(&slot.name, &slot.publication, messages)
        .await?;
    let (sent, mut to_ack) = tokio::sync::mpsc::unbounded_channel::<Sent>();
    let acked = Arc::new(AtomicU64::new(0));
    let published = Arc::new(AtomicU64::new(0));
    let acker = {
        let (pool, acked, published) = (pool.clone(), acked.clone(), published.clone());
        tokio::spawn(async move {
            let mut out = Drained::default();
            let mut seqs: Vec<Option<i64>> = Vec::new();
            let mut end = 0;
            loop {
                let next = match to_ack.try_recv() {
                    Ok(next) => Some(next),
                    Err(tokio::sync::mpsc::error::TryRecvError::Empty) if seqs.is_empty() => {
                        to_ack.recv().await
                    }
                    Err(tokio::sync::mpsc::error::TryRecvError::Empty) => None,
                    Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                        if seqs.is_empty() {
                            break;
                        }
                        None
                    }
                };
                if let Some((deliveries, rows, at)) = next {
                    for delivery in deliveries {
                        delivery.await?.map_err(|(e, _)| e)?;
                    }
                    seqs.extend(rows);
                    end = at;
                    if seqs.len() < 5_000 {
                        continue;
                    }
                }
                let at = Instant::now();
                let rows: Vec<i64> = seqs.iter().filter_map(|s| *s).collect();
                if !rows.is_empty() {
                    sqlx::query("DELETE FROM dedup_outbox WHERE seq = ANY($1)")
                        .bind(&rows)
                        .execute(&pool)
                        .await?;
                }
                out.delete += at.elapsed();
                out.batches += 1;
                published.fetch_add(seqs.len() as u64, Ordering::SeqCst);
                seqs.clear();
                acked.store(end, Ordering::SeqCst);
            }
            Ok::<_, BoxError>(out)
        })
    };
    let mut relations: HashMap<u32, Vec<String>> = HashMap::new();
    let (mut deliveries, mut rows) = (Vec::new(), Vec::new());
    let mut confirmed = 0;
    let started = Instant::now();
    while published.load(Ordering::SeqCst) < events {
        if started.elapsed() > Duration::from_secs(3600) {
            return Err("gave up after an hour".into());
        }
        if acker.is_finished() {
            return Err(acker
                .await?
                .err()
                .map_or("the acknowledgements stopped".into(), |e| e));
        }
        match tokio::time::timeout(Duration::from_millis(20), stream.recv()).await {
            Err(_) => {}
            Ok(None) => return Err("the replication stream ended".into()),
            Ok(Some(message)) => match message? {
                crate::pgstream::Streamed::Keepalive(true) => confirmer.confirm(confirmed).await?,
                crate::pgstream::Streamed::Keepalive(false) => {}
                crate::pgstream::Streamed::Data(data) => {
                    if let Some(end) = commit_end(&data) {
                        let done = (
                            std::mem::take(&mut deliveries),
                            std::mem::take(&mut rows),
                            end,
                        );
                        sent.send(done)
                            .map_err(|_| "the acknowledgements stopped")?;
                    } else if let Some(e) = decode(&data, &mut relations)? {
                        deliveries.push(send(&producer, &e).await?);
                        rows.push(e.seq);
                    }
                }
            },
        }
        let now = acked.load(Ordering::SeqCst);
        if now > confirmed {
            confirmed = now;
            confirmer.confirm(confirmed).await?;
        }
    }
    drop(sent);
    let mut out = acker.await??;
    out.published = published.load(Ordering::SeqCst);
    confirmer.confirm(acked.load(Ordering::SeqCst)).await?;
    Ok(out)
}
