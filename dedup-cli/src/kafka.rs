//! Kafka clients for the CLI: settings, topic metadata, reading a topic to
//! its end.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Message as _, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};

use crate::{Failure, KafkaArgs};

/// How long a metadata or offsets request may take.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(15);

/// How long reading may go without progress before it is given up.
const STALL: Duration = Duration::from_secs(30);

/// The CLI's consumers (made with [`consumer`]).
pub(crate) type KafkaConsumer = BaseConsumer<dedup_kafka::TokenContext>;

/// The OAUTHBEARER tokens' keeper, once an OIDC token endpoint is given:
/// one for the whole command, whatever clients it makes.
static KEEPER: OnceLock<dedup_kafka::TokenKeeper> = OnceLock::new();

/// The settings every client gets: the brokers, the `--kafka-config` file's
/// settings, the `KAFKA_CFG_*` environment variables (named as the
/// services' builders name them), then the `--kafka-set` pairs; with
/// `--oidc-token-endpoint`, OAUTHBEARER tokens from it (make the clients
/// with `dedup_kafka::TokenContext`).
pub(crate) fn config(kafka: &KafkaArgs) -> Result<ClientConfig, Failure> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka.brokers);
    if let Some(path) = &kafka.config_file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Failure::new(format!(
                "cannot read --kafka-config {}: {e}",
                path.display()
            ))
        })?;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line.split_once('=').ok_or_else(|| {
                // The line may hold a secret: only its number is shown.
                Failure::new(format!("{} line {}: not KEY=VALUE", path.display(), n + 1))
            })?;
            config.set(key.trim(), value.trim());
        }
    }
    for (key, _variable, value) in dedup_kafka::settings_from_env("KAFKA_CFG_") {
        config.set(key, value);
    }
    for pair in &kafka.settings {
        let (key, value) = pair.split_once('=').ok_or_else(|| {
            Failure::new("a --kafka-set is not KEY=VALUE (e.g. security.protocol=sasl_ssl)")
        })?;
        config.set(key.trim(), value.trim());
    }
    if let Some(endpoint) = &kafka.oidc.oidc_token_endpoint {
        oauthbearer(&mut config, endpoint, &kafka.oidc)?;
    }
    Ok(config)
}

/// Sets `config` to take OAUTHBEARER tokens from the OIDC token endpoint
/// (client credentials), starting the keeper the first time.
fn oauthbearer(
    config: &mut ClientConfig,
    endpoint: &str,
    oidc: &crate::OidcArgs,
) -> Result<(), Failure> {
    match config
        .get("sasl.mechanisms")
        .or(config.get("sasl.mechanism"))
    {
        None => {
            config.set("sasl.mechanisms", "OAUTHBEARER");
        }
        Some(m) if m.eq_ignore_ascii_case("OAUTHBEARER") => {}
        Some(m) => {
            return Err(Failure::new(format!(
                "--oidc-token-endpoint gives OAUTHBEARER tokens, but sasl.mechanisms is {m}"
            )));
        }
    }
    let keeper = match KEEPER.get() {
        Some(keeper) => keeper,
        None => {
            let client_id = oidc.oidc_client_id.as_deref().ok_or_else(|| {
                Failure::new("--oidc-token-endpoint needs --oidc-client-id (DEDUP_OIDC_CLIENT_ID)")
            })?;
            // Never on the command line, which every user of the machine sees.
            let secret = std::env::var("DEDUP_OIDC_CLIENT_SECRET").map_err(|_| {
                Failure::new(
                    "--oidc-token-endpoint needs the client's secret in DEDUP_OIDC_CLIENT_SECRET",
                )
            })?;
            let provider = match &oidc.oidc_ca_file {
                Some(ca) => dedup_kafka::OidcClientCredentials::with_ca_file(
                    endpoint, client_id, secret, ca,
                ),
                None => dedup_kafka::OidcClientCredentials::new(endpoint, client_id, secret),
            }
            .map_err(|e| Failure::new(format!("--oidc-token-endpoint: {e}")))?;
            let provider = match &oidc.oidc_scope {
                Some(scope) => provider.scope(scope),
                None => provider,
            };
            let started = dedup_kafka::TokenKeeper::start(provider)
                .map_err(|e| Failure::new(e.to_string()))?;
            // A command runs once: no token is its failure, with the reason.
            started
                .first_token()
                .map_err(|e| Failure::new(format!("--oidc-token-endpoint: {e}")))?;
            KEEPER.get_or_init(|| started)
        }
    };
    keeper.configure(config);
    Ok(())
}

/// librdkafka refused to create a client: why, without a setting's value.
pub(crate) fn refused(client: &str, e: &KafkaError) -> Failure {
    Failure::new(format!(
        "cannot create a Kafka {client}: {}",
        dedup_kafka::redacted(e)
    ))
}

/// The partitions of `topic`, or a failure saying it does not exist.
pub(crate) fn partitions<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
) -> Result<Vec<i32>, Failure> {
    let metadata = consumer
        .fetch_metadata(Some(topic), TIMEOUT)
        .map_err(|e| unreachable_brokers(&e))?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Err(no_such_topic(topic));
    };
    match found.error() {
        None => {}
        Some(rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => {
            return Err(no_such_topic(topic));
        }
        Some(e) => {
            return Err(Failure::new(format!(
                "the brokers refuse the metadata of topic {topic:?}: {:?}",
                RDKafkaErrorCode::from(e)
            )));
        }
    }
    let mut partitions: Vec<i32> = found.partitions().iter().map(|p| p.id()).collect();
    if partitions.is_empty() {
        return Err(no_such_topic(topic));
    }
    partitions.sort_unstable();
    Ok(partitions)
}

fn no_such_topic(topic: &str) -> Failure {
    Failure::new(format!(
        "topic {topic:?} does not exist on these brokers (check the name and --brokers)"
    ))
}

pub(crate) fn unreachable_brokers(e: &KafkaError) -> Failure {
    Failure::new(format!(
        "cannot reach the Kafka brokers ({e}): check --brokers / KAFKA_BROKERS and --kafka-set"
    ))
}

/// A consumer for reading `topic` with `group` (committing nothing unless
/// asked to).
pub(crate) fn consumer(kafka: &KafkaArgs, group: &str) -> Result<KafkaConsumer, Failure> {
    let mut config = config(kafka)?;
    let consumer: KafkaConsumer = config
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .create_with_context(dedup_kafka::TokenContext)
        .map_err(|e| refused("consumer", &e))?;
    if KEEPER.get().is_some() {
        // Its first token, before it is only asked for metadata.
        dedup_kafka::TokenKeeper::serve(&consumer);
    }
    Ok(consumer)
}

/// Reads `topic` to its end as of now, each partition from its offset in
/// `from` (from its start where `from` has none).
pub(crate) fn read_to_end_from(
    consumer: &KafkaConsumer,
    topic: &str,
    from: &HashMap<i32, i64>,
) -> Result<Vec<OwnedMessage>, Failure> {
    Ok(read_between(consumer, topic, from, None)?.0)
}

/// Reads `topic`, each partition from its offset in `from` (its start
/// where `from` has none) to its end as of now or, with `until`, to its
/// offset there (a partition `until` lacks is not read): the records,
/// partition by partition in offset order, and where each partition's
/// read ended.
pub(crate) fn read_between(
    consumer: &KafkaConsumer,
    topic: &str,
    from: &HashMap<i32, i64>,
    until: Option<&HashMap<i32, i64>>,
) -> Result<(Vec<OwnedMessage>, HashMap<i32, i64>), Failure> {
    let mut ranges = HashMap::new();
    for (p, low, high) in watermarks(consumer, topic)? {
        let start = from.get(&p).map_or(low, |&at| at.max(low));
        let end = match until {
            None => high,
            Some(until) => match until.get(&p) {
                Some(&end) => end.min(high),
                None => continue,
            },
        };
        ranges.insert(p, (start, end.max(start)));
    }
    let ends = ranges.iter().map(|(&p, &(_, end))| (p, end)).collect();
    let mut by_partition = read_ranges(consumer, topic, &ranges)?;
    let mut partitions: Vec<i32> = ranges.into_keys().collect();
    partitions.sort_unstable();
    let records = partitions
        .iter()
        .flat_map(|p| by_partition.remove(p).unwrap_or_default())
        .collect();
    Ok((records, ends))
}

/// Each partition of `topic` with its low and high watermarks, in
/// partition order.
pub(crate) fn watermarks(
    consumer: &KafkaConsumer,
    topic: &str,
) -> Result<Vec<(i32, i64, i64)>, Failure> {
    partitions(consumer, topic)?
        .into_iter()
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, TIMEOUT)
                .map_err(|e| unreachable_brokers(&e))?;
            Ok((p, low, high))
        })
        .collect()
}

/// Reads the records of `topic` in each partition's range `[from, to)`, by
/// partition in offset order.
pub(crate) fn read_ranges(
    consumer: &KafkaConsumer,
    topic: &str,
    ranges: &HashMap<i32, (i64, i64)>,
) -> Result<HashMap<i32, Vec<OwnedMessage>>, Failure> {
    let mut by_partition: HashMap<i32, Vec<OwnedMessage>> = HashMap::new();
    visit_ranges(consumer, topic, ranges, |msg| {
        by_partition.entry(msg.partition()).or_default().push(msg);
    })?;
    Ok(by_partition)
}

/// Hands each record of `topic` in each partition's range `[from, to)` to
/// `visit`, each partition's in offset order (the partitions interleaved):
/// a caller that keeps few of them holds few.
pub(crate) fn visit_ranges(
    consumer: &KafkaConsumer,
    topic: &str,
    ranges: &HashMap<i32, (i64, i64)>,
    mut visit: impl FnMut(OwnedMessage),
) -> Result<(), Failure> {
    let mut ends = HashMap::new();
    let mut assignment = TopicPartitionList::new();
    for (&p, &(from, to)) in ranges {
        if to > from {
            ends.insert(p, to);
            assignment
                .add_partition_offset(topic, p, Offset::Offset(from))
                .map_err(|e| Failure::new(format!("assigning {topic}/{p}: {e}")))?;
        }
    }
    consumer
        .assign(&assignment)
        .map_err(|e| Failure::new(format!("assigning {topic}: {e}")))?;
    // A partition paused at the end of an earlier range stays paused
    // through a new assignment. (Test-only: a resume librdkafka drops,
    // below.)
    if !crate::failpoint::fails("resume-lost") {
        consumer
            .resume(&assignment)
            .map_err(|e| Failure::new(format!("assigning {topic}: {e}")))?;
    }
    // Partitions not yet read to their end, by that end.
    let mut open = ends.clone();
    let mut progress = Instant::now();
    while !open.is_empty() {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(msg)) => {
                progress = Instant::now();
                let p = msg.partition();
                let end = ends.get(&p).copied().unwrap_or(0);
                // Records past the end as of the start are the next run's.
                let last = msg.offset() + 1 >= end;
                if msg.offset() < end {
                    visit(msg.detach());
                }
                if last && open.remove(&p).is_some() {
                    pause(consumer, topic, p);
                }
            }
            Some(Err(e)) => return Err(Failure::new(format!("reading {topic}: {e}"))),
            None => {
                // Offsets that are not records (transaction markers, a
                // compacted range) end a partition without a last record.
                let positions = consumer
                    .position()
                    .map_err(|e| Failure::new(format!("reading {topic}: {e}")))?;
                for elem in positions.elements_for_topic(topic) {
                    if let Offset::Offset(at) = elem.offset()
                        && open.get(&elem.partition()).is_some_and(|&end| at >= end)
                    {
                        open.remove(&elem.partition());
                        pause(consumer, topic, elem.partition());
                    }
                }
                // librdkafka drops a partition's resume that reaches it
                // after a newer request of its own thread (this read's
                // assignment starting its fetch), and the partition the
                // last read paused at its end would stay paused (seen as a
                // search stalled on one partition). Resuming what is still
                // open, while nothing comes, ends that.
                if !open.is_empty() {
                    let mut still = TopicPartitionList::new();
                    for &p in open.keys() {
                        still.add_partition(topic, p);
                    }
                    let _ = consumer.resume(&still);
                }
                if !open.is_empty() && progress.elapsed() > STALL {
                    return Err(Failure::new(format!(
                        "reading {topic} made no progress for {STALL:?}; partitions left: {:?}",
                        open.keys().collect::<Vec<_>>()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Stops fetching a partition read to its range's end: the records after
/// it (a range ending before the partition does) are not wanted.
fn pause(consumer: &KafkaConsumer, topic: &str, partition: i32) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    // Only a saving: records past the end are dropped anyway.
    let _ = consumer.pause(&tpl);
}
