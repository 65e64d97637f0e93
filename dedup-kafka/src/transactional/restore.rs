//! The changelog topic: created beside the input, and read back into a
//! partition's claims when the partition is assigned.

use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};

use super::claims::{self, PartitionClaims};
use crate::Error;

/// How long one metadata or watermark request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Creates the changelog topic (compacted, as many partitions as the input)
/// unless it exists, and checks that it has a partition for every input
/// partition.
pub(crate) async fn ensure_changelog(
    base: &ClientConfig,
    input: &str,
    changelog: &str,
    replication: i32,
) -> Result<(), Error> {
    let probe: BaseConsumer = base.create()?;
    let count = |topic: &str| -> Result<Option<usize>, Error> {
        let metadata = probe.fetch_metadata(Some(topic), REQUEST_TIMEOUT)?;
        Ok(metadata
            .topics()
            .first()
            .filter(|t| t.error().is_none())
            .map(|t| t.partitions().len()))
    };
    let inputs = tokio::task::block_in_place(|| count(input))?.ok_or_else(|| {
        Error::Config(format!(
            "the input topic {input:?} does not exist: the changelog {changelog:?} is created with as many partitions"
        ))
    })?;
    let admin: AdminClient<DefaultClientContext> = base.create()?;
    let topic = NewTopic::new(
        changelog,
        inputs as i32,
        TopicReplication::Fixed(replication),
    )
    .set("cleanup.policy", "compact");
    let created = admin
        .create_topics(
            [&topic],
            &AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)),
        )
        .await?;
    for result in created {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                return Err(Error::Config(format!(
                    "the changelog topic {name:?} could not be created: {code}"
                )));
            }
        }
    }
    // Metadata can lag the creation by a moment.
    let started = Instant::now();
    loop {
        match tokio::task::block_in_place(|| count(changelog))? {
            Some(n) if n >= inputs => return Ok(()),
            Some(n) => {
                return Err(Error::Config(format!(
                    "the changelog topic {changelog:?} has {n} partitions and the input {input:?} \
                     has {inputs}: add partitions to the changelog (it must be co-partitioned)"
                )));
            }
            None if started.elapsed() < REQUEST_TIMEOUT => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => {
                return Err(Error::Config(format!(
                    "the changelog topic {changelog:?} was created but does not show in metadata"
                )));
            }
        }
    }
}

/// Reads partition `partition` of the changelog from its start into claims.
///
/// It reads committed records only and stops at the end of the log as it
/// was when it began, which it reaches once every transaction open then
/// has ended: claims of a transaction still open (a previous owner's, about
/// to be committed or aborted) are never missed. Blocking: call it off the
/// async workers or inside `block_in_place`.
pub(crate) fn restore(
    base: &ClientConfig,
    changelog: &str,
    partition: i32,
) -> Result<PartitionClaims, Error> {
    let started = Instant::now();
    let probe = |isolation: &str| -> Result<BaseConsumer, Error> {
        Ok(base.clone().set("isolation.level", isolation).create()?)
    };
    let (low, high) =
        probe("read_uncommitted")?.fetch_watermarks(changelog, partition, REQUEST_TIMEOUT)?;
    let mut out = PartitionClaims::default();
    if high <= low {
        return Ok(out);
    }
    // First every transaction open on the partition now must end (a
    // previous owner's, committed or aborted by its fencing or its
    // timeout): then the committed log reaches `high`, and the first end of
    // the log the reader meets lies at or past it.
    let stable = probe("read_committed")?;
    let mut warned = Instant::now();
    while stable
        .fetch_watermarks(changelog, partition, REQUEST_TIMEOUT)?
        .1
        < high
    {
        if warned.elapsed() > Duration::from_secs(10) {
            warned = Instant::now();
            tracing::warn!(
                changelog,
                partition,
                high,
                "restoring claims: waiting for a transaction still open on the changelog (a previous owner's) to end"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let reader: BaseConsumer = base
        .clone()
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        // librdkafka refuses an assignment without a group; this one never
        // joins (assign, not subscribe) nor commits.
        .set("group.id", format!("{changelog}-restore"))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()?;
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(changelog, partition, Offset::Beginning)?;
    reader.assign(&assignment)?;
    let mut records = 0u64;
    loop {
        match reader.poll(Duration::from_millis(500)) {
            Some(Ok(msg)) => {
                records += 1;
                let digest: claims::ClaimDigest =
                    msg.key().and_then(|k| k.try_into().ok()).ok_or_else(|| {
                        corrupt(
                            changelog,
                            partition,
                            msg.offset(),
                            "its key is not 16 bytes",
                        )
                    })?;
                match msg.payload() {
                    None => out.remove(&digest),
                    Some(value) => {
                        let entry = claims::decode(value)
                            .map_err(|why| corrupt(changelog, partition, msg.offset(), &why))?;
                        out.put(digest, entry);
                    }
                }
                if msg.offset() + 1 >= high {
                    break;
                }
            }
            // The end of the committed log, at or past `high`.
            Some(Err(KafkaError::PartitionEOF(_))) => break,
            None => {}
            Some(Err(e)) => return Err(e.into()),
        }
    }
    tracing::info!(
        changelog,
        partition,
        records,
        claims = out.len(),
        took = ?started.elapsed(),
        "claims restored"
    );
    Ok(out)
}

fn corrupt(changelog: &str, partition: i32, offset: i64, why: &str) -> Error {
    Error::Fatal(format!(
        "the claims changelog {changelog:?} partition {partition} offset {offset} cannot be read: \
         {why} (is another application writing it?)"
    ))
}
