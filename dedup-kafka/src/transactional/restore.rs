//! The changelog topic: created beside the input, and read back into a
//! partition's claims when the partition is assigned.

use crate::oauth::TokenContext;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};

use super::changelog::Key;
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
    let probe: BaseConsumer<TokenContext> = base.create_with_context(TokenContext)?;
    tokio::task::block_in_place(|| crate::oauth::take_token(&probe));
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
    if crate::oauth::from_provider(base) {
        return existing_changelog(
            tokio::task::block_in_place(|| count(changelog))?,
            input,
            inputs,
            changelog,
        );
    }
    let admin: AdminClient<TokenContext> = base.create_with_context(TokenContext)?;
    // Created only if missing: the brokers refuse CreateTopics to a
    // principal without Create even for a topic that exists.
    if tokio::task::block_in_place(|| count(changelog))?.is_none() {
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
                Err((name, RDKafkaErrorCode::TopicAuthorizationFailed)) => {
                    let principal = crate::access::principal(base);
                    return Err(Error::Config(format!(
                        "the changelog topic {name:?} does not exist and the brokers do not let \
                         {principal} create it: create it once (compacted, {inputs} partitions: \
                         kafka-topics.sh --create --topic {name} --partitions {inputs} --config \
                         cleanup.policy=compact), or grant it Create on it ({})",
                        crate::access::grant_command(
                            &principal,
                            "Create",
                            &format!("--topic {name}")
                        )
                    )));
                }
                Err((name, code)) => {
                    return Err(Error::Config(format!(
                        "the changelog topic {name:?} could not be created: {code}"
                    )));
                }
            }
        }
    }
    // An existing topic must be compacted only: retention would forget
    // claims (and duplicates would be applied again). A topic just created
    // may be described before its configuration is (no entries): asked
    // again for a moment.
    let started = Instant::now();
    loop {
        match cleanup_policy(&admin, changelog, base).await? {
            Some(policy) if policy == "compact" => break,
            Some(policy) => {
                return Err(Error::Config(format!(
                    "the changelog topic {changelog:?} has cleanup.policy={policy:?}: it must be \
                     \"compact\" alone (deletion by retention would forget claims)"
                )));
            }
            None if started.elapsed() < REQUEST_TIMEOUT => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => {
                return Err(Error::Config(format!(
                    "the changelog topic {changelog:?} shows no cleanup.policy: it cannot be \
                     checked to be \"compact\""
                )));
            }
        }
    }
    // Metadata can lag the creation by a moment.
    let started = Instant::now();
    loop {
        match tokio::task::block_in_place(|| count(changelog))? {
            Some(n) if n >= inputs => return Ok(()),
            Some(n) => return Err(too_few_partitions(changelog, n, input, inputs)),
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

/// With a token provider, the changelog as it is: rdkafka's admin client,
/// never polled for a token, cannot create it or describe its
/// configuration. `partitions` is its count, `None` if it does not exist.
fn existing_changelog(
    partitions: Option<usize>,
    input: &str,
    inputs: usize,
    changelog: &str,
) -> Result<(), Error> {
    match partitions {
        Some(n) if n >= inputs => {
            tracing::warn!(
                changelog,
                "with a token provider the changelog's cleanup.policy cannot be checked \
                 (rdkafka's admin client cannot take OAUTHBEARER tokens from code): it must be \
                 \"compact\" alone, or claims are forgotten and duplicates applied again"
            );
            Ok(())
        }
        Some(n) => Err(too_few_partitions(changelog, n, input, inputs)),
        None => Err(Error::Config(format!(
            "the changelog topic {changelog:?} does not exist, and with a token provider dedup \
             cannot create it (rdkafka's admin client cannot take OAUTHBEARER tokens from \
             code): create it once, compacted, with as many partitions as {input:?}: \
             kafka-topics.sh --bootstrap-server <brokers> --create --topic {changelog} \
             --partitions {inputs} --config cleanup.policy=compact"
        ))),
    }
}

/// A changelog of `n` partitions for an input of `inputs`.
fn too_few_partitions(changelog: &str, n: usize, input: &str, inputs: usize) -> Error {
    Error::Config(format!(
        "the changelog topic {changelog:?} has {n} partitions and the input {input:?} has \
         {inputs}: add partitions to the changelog (it must be co-partitioned)"
    ))
}

/// The changelog topic's `cleanup.policy`, or `None` when the broker
/// describes it without one (a topic it has only just created).
async fn cleanup_policy(
    admin: &AdminClient<TokenContext>,
    changelog: &str,
    base: &ClientConfig,
) -> Result<Option<String>, Error> {
    let described = admin
        .describe_configs(
            [&ResourceSpecifier::Topic(changelog)],
            &AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)),
        )
        .await?;
    let mut policy = None;
    for resource in described {
        let resource = resource.map_err(|e| {
            let grant = if e == RDKafkaErrorCode::TopicAuthorizationFailed {
                let principal = crate::access::principal(base);
                format!(
                    "; its compaction is checked at every start: grant {principal} \
                     DescribeConfigs on it ({})",
                    crate::access::grant_command(
                        &principal,
                        "DescribeConfigs",
                        &format!("--topic {changelog}")
                    )
                )
            } else {
                String::new()
            };
            Error::Config(format!(
                "the changelog topic {changelog:?} cannot be described: {e}{grant}"
            ))
        })?;
        policy = policy.or_else(|| {
            resource
                .get("cleanup.policy")
                .and_then(|entry| entry.value.clone())
                .filter(|value| !value.is_empty())
        });
    }
    Ok(policy)
}

/// How the restore reader fetches. With librdkafka's defaults, a queue
/// that holds `queued.min.messages` (100,000 per partition) or 64 MiB
/// makes it wait a whole second (`fetch.queue.backoff.ms`) before
/// fetching again, which a restore reaches at once: a million claims took
/// 5.5 s. Looking again after 1 ms is the gain; the queue is capped at
/// 8 MiB (down from 64), and fetches wait at most 10 ms at a partition's
/// end. A reader that only hashed the keys then read 900,011 records in
/// 0.73-0.86 s, and a restore of a million claims took 1.0-1.3 s (the
/// book's Performance chapter). The reader lives for the restore alone.
const RESTORE_FETCH: [(&str, &str); 4] = [
    ("queued.max.messages.kbytes", "8192"),
    ("queued.min.messages", "100000"),
    ("fetch.queue.backoff.ms", "1"),
    ("fetch.wait.max.ms", "10"),
];

/// Reads `partitions` of the changelog from their start into claims, one
/// reader for all.
///
/// It reads committed records only and stops at the end of each
/// partition's log as it was when it began, which it reaches once every
/// transaction open then has ended: claims of a transaction still open (a
/// previous owner's, about to be committed or aborted) are never missed.
/// Blocking: call it off the async workers or inside `block_in_place`.
pub(crate) fn restore(
    base: &ClientConfig,
    changelog: &str,
    partitions: &[i32],
) -> Result<HashMap<i32, PartitionClaims>, Error> {
    let started = Instant::now();
    let probe = |isolation: &str| -> Result<BaseConsumer<TokenContext>, Error> {
        let probe = base
            .clone()
            .set("isolation.level", isolation)
            .create_with_context(TokenContext)?;
        crate::oauth::take_token(&probe);
        Ok(probe)
    };
    let mut out: HashMap<i32, PartitionClaims> = partitions
        .iter()
        .map(|&p| (p, PartitionClaims::default()))
        .collect();
    let uncommitted = probe("read_uncommitted")?;
    let mut high = HashMap::new();
    for &p in partitions {
        let (low, h) = uncommitted.fetch_watermarks(changelog, p, REQUEST_TIMEOUT)?;
        if h > low {
            high.insert(p, h);
        }
    }
    if high.is_empty() {
        return Ok(out);
    }
    // First every transaction open on a partition now must end (a previous
    // owner's, committed or aborted by its fencing or its timeout): then its
    // committed log reaches `high`, and the first end of the log the reader
    // meets lies at or past it.
    let stable = probe("read_committed")?;
    let mut warned = Instant::now();
    for (&p, &h) in &high {
        while stable.fetch_watermarks(changelog, p, REQUEST_TIMEOUT)?.1 < h {
            if warned.elapsed() > Duration::from_secs(10) {
                warned = Instant::now();
                tracing::warn!(
                    changelog,
                    partition = p,
                    high = h,
                    "restoring claims: waiting for a transaction still open on the changelog (a previous owner's) to end"
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Where each log starts, read now that the wait is over (a log start
    // moved meanwhile would fail the assignment below, `auto.offset.reset`
    // being `error`, and the restore would be tried again).
    let mut low = HashMap::new();
    for &p in high.keys() {
        low.insert(
            p,
            uncommitted
                .fetch_watermarks(changelog, p, REQUEST_TIMEOUT)?
                .0,
        );
    }
    let mut reader_config = base.clone();
    // From the leader: a follower's end of the log can lag its leader's.
    reader_config.remove("client.rack");
    reader_config
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        // Offsets out of range (the log's start moved by retention) are an
        // error, never a silent jump to the end.
        .set("auto.offset.reset", "error")
        // librdkafka refuses an assignment without a group; this one never
        // joins (assign, not subscribe) nor commits.
        .set("group.id", format!("{changelog}-restore"))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    for (k, v) in RESTORE_FETCH {
        reader_config.set(k, v);
    }
    let reader: BaseConsumer<QuietEof> = reader_config.create_with_context(QuietEof)?;
    // From the log's start as the watermarks gave it: `Offset::Beginning`
    // is looked up again first, which cost half a second before the first
    // record.
    let mut assignment = TopicPartitionList::new();
    for (&p, &start) in &low {
        assignment.add_partition_offset(changelog, p, Offset::Offset(start))?;
    }
    reader.assign(&assignment)?;
    let mut records = 0u64;
    let mut left: std::collections::HashSet<i32> = high.keys().copied().collect();
    while !left.is_empty() {
        match reader.poll(Duration::from_millis(500)) {
            Some(Ok(msg)) => {
                records += 1;
                let p = msg.partition();
                let key = msg.key().and_then(Key::of).ok_or_else(|| {
                    corrupt(
                        changelog,
                        p,
                        msg.offset(),
                        "its key is neither a claim's digest nor a claim record's",
                    )
                })?;
                out.get_mut(&p)
                    .expect("an assigned partition")
                    .restore(key, msg.payload())
                    .map_err(|why| corrupt(changelog, p, msg.offset(), &why))?;
                if msg.offset() + 1 >= high[&p] {
                    left.remove(&p);
                }
            }
            // The end of a partition's committed log, at or past its `high`.
            Some(Err(KafkaError::PartitionEOF(p))) => {
                left.remove(&p);
            }
            None => {}
            Some(Err(e)) => return Err(e.into()),
        }
    }
    tracing::info!(
        changelog,
        partitions = ?partitions,
        records,
        claims = out.values().map(PartitionClaims::len).sum::<usize>(),
        took = ?started.elapsed(),
        "claims restored"
    );
    Ok(out)
}

/// What a partition committed last, if anything.
pub(crate) struct Committed {
    /// The next offset to read.
    pub(crate) offset: Option<i64>,
    /// The stream time after the record before it.
    pub(crate) stream_time: Option<i64>,
}

/// What each of `partitions` of `topic` committed: its offset and the
/// stream time in the offset's metadata, where there is one (see
/// [`claims::stream_time_of`]). The committed offsets are read stable: a
/// transaction still open on them has ended. A partition the broker
/// answers with an error fails the whole read (to be tried again): a
/// stream time taken as missing could judge a record against a claim
/// already tombstoned. Blocking, as [`restore`] is.
pub(crate) fn committed<C: rdkafka::consumer::ConsumerContext>(
    consumer: &impl rdkafka::consumer::Consumer<C>,
    topic: &str,
    partitions: &[i32],
) -> Result<HashMap<i32, Committed>, Error> {
    let mut asked = TopicPartitionList::new();
    for &p in partitions {
        asked.add_partition(topic, p);
    }
    let committed = consumer.committed_offsets(asked, REQUEST_TIMEOUT)?;
    let mut out = HashMap::new();
    for e in committed.elements() {
        e.error()?;
        let offset = match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        };
        let stream_time = claims::stream_time_of(e.metadata());
        out.insert(
            e.partition(),
            Committed {
                offset,
                stream_time,
            },
        );
    }
    Ok(out)
}

fn corrupt(changelog: &str, partition: i32, offset: i64, why: &str) -> Error {
    Error::Fatal(format!(
        "the claims changelog {changelog:?} partition {partition} offset {offset} cannot be read: \
         {why} (is another application writing it?)"
    ))
}

/// The restore reader's context: the end of a partition is how a restore
/// knows it is done, not an error to log.
struct QuietEof;

impl rdkafka::ClientContext for QuietEof {
    crate::oauth::tokens_from_the_provider!();

    fn error(&self, error: KafkaError, reason: &str) {
        if !matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        ) {
            tracing::error!(error = %error, reason, "librdkafka error (claims restore)");
        }
    }
}

impl rdkafka::consumer::ConsumerContext for QuietEof {}
