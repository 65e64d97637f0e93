//! Kafka-to-Kafka modes (`--kafka-only`): the transactional consumer
//! (exactly once, claims in a changelog topic, no database) against a
//! plain at-least-once consume-transform-produce loop without dedup and
//! against what its users would pick instead, a Kafka Streams application
//! doing the same job exactly once (`kafka-streams`, bench/streams/: its
//! seen ids in a persistent RocksDB store, 2 stream threads, Jackson), and
//! the time a new owner takes to restore the claims.
//!
//! Both pipelines read the workload's payments and write each one, with
//! `"enriched": true`, keyed by account, to an output topic (as
//! examples/enrich). Latency runs from the input's produce acknowledgement
//! to its offset being committed: inside the transaction for the
//! transactional mode (so with its output), after the output's
//! acknowledgement for the plain one (auto-commit every 100 ms). The end
//! check counts the output's committed records: each distinct event once
//! (transactional), every delivery (plain).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedup_core::{HandlerError, idempotent};
use dedup_kafka::{Outputs, TransactionalConsumer};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message as _;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::consume::ConsumerChild;
use crate::produce::Producer;
use crate::workload::Workload;
use crate::{Args, BoxError, Report, env_or, new_topic, watch_commits};

/// The modes `--kafka-only` runs, `batched` (PostgreSQL) first for the
/// comparison.
pub(crate) const KAFKA_MODES: [&str; 5] = [
    "batched",
    "kafka-transactional",
    "kafka-plain",
    "kafka-streams",
    "kafka-restore",
];

/// The Kafka Streams application's Maven project.
const STREAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/streams");

/// Builds the Kafka Streams application (bench/streams/, with Maven: its
/// jar and its dependencies under target/), once per benchmark run.
pub(crate) fn build_streams() -> Result<(), BoxError> {
    eprintln!("  building the Kafka Streams application (mvn package) ...");
    let status = std::process::Command::new("mvn")
        .args(["-q", "-B", "-f", &format!("{STREAMS}/pom.xml")])
        .args(["clean", "package", "dependency:copy-dependencies"])
        .args(["-DincludeScope=runtime", "-DoutputDirectory=target/lib"])
        .status()
        .map_err(|e| format!("mvn (Java 17 and Maven, as scripts/kafka.sh installs them): {e}"))?;
    if !status.success() {
        return Err(format!("building {STREAMS} failed: {status}").into());
    }
    Ok(())
}

/// The Kafka Streams application on `topic`, writing to `output`, with
/// application id (its consumer group) `group`, its state in `state`.
fn streams_child(
    brokers: &str,
    topic: &str,
    output: &str,
    group: &str,
    state: &std::path::Path,
) -> Result<ConsumerChild, BoxError> {
    let mut command = std::process::Command::new("java");
    command
        .args(["-Xms256m", "-Xmx1g", "-XX:+UseG1GC", "-cp"])
        .arg(format!(
            "{STREAMS}/target/bench-kafka-streams-1.jar:{STREAMS}/target/lib/*"
        ))
        .arg("dev.dedup.bench.Enrich")
        .args([brokers, topic, output, group])
        .arg(state);
    ConsumerChild::start(command)
}

#[derive(serde::Deserialize, serde::Serialize)]
struct Payment {
    event_id: String,
    account_id: String,
    amount_cents: i64,
    #[serde(default)]
    source: u32,
}

#[derive(serde::Serialize)]
struct Enriched<'a> {
    #[serde(flatten)]
    payment: &'a Payment,
    enriched: bool,
}

/// The output topic of this process's mode.
static OUTPUT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[idempotent(key = "event_id", ttl = "4h", scope = "bench::enrich")]
async fn enrich(out: &mut Outputs, ev: Payment) -> Result<(), HandlerError> {
    let topic = OUTPUT.get().expect("output topic set");
    out.send(
        topic,
        &ev.account_id,
        &Enriched {
            payment: &ev,
            enriched: true,
        },
    )
}

pub(crate) async fn run(mode: &str, args: &Args) -> Result<Report, BoxError> {
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let work = Workload::new(args.events, args.duplicates, 0);
    let topic = new_topic(&brokers, mode, args.partitions).await?;
    let output = new_topic(&brokers, &format!("{mode}-out"), args.partitions).await?;
    let group = format!("{topic}-g");
    let acks = Producer::spawn(&topic, args.events, args.duplicates, 0, None)?.finish()?;
    let total = work.len() as u64;
    crate::settle_disk();
    let started = Instant::now();
    // The Kafka Streams application's state (its RocksDB store), removed
    // after the run.
    let state = std::env::temp_dir().join(format!("dedup-bench-{group}"));
    let mut consumer = if mode == "kafka-streams" {
        streams_child(&brokers, &topic, &output, &group, &state)?
    } else {
        ConsumerChild::spawn(mode, &topic, &group, Some(&output), args)?
    };
    let commits = watch_commits(
        &brokers,
        &topic,
        &group,
        args.partitions,
        total,
        &acks,
        started,
        &mut consumer,
    )
    .await?;
    // Every offset committed: the clock stops here, as for `batched` (the
    // consumer's shutdown is not the run's).
    let seconds = started.elapsed().as_secs_f64();
    let consumed = consumer.stop()?;
    let _ = std::fs::remove_dir_all(&state);
    let batches = consumed.batches;
    let expected = if mode == "kafka-plain" {
        work.len()
    } else {
        work.distinct
    } as i64;
    let outputs = committed_records(&brokers, &output, args.partitions)?;
    if mode == "kafka-restore" {
        eprintln!(
            "  kafka-restore: {} claims written in {seconds:.1} s ({:.0} events/s)",
            work.distinct,
            work.len() as f64 / seconds
        );
        let restore = restore_time(&brokers, &topic, &group, &output, args).await?;
        let mut report = Report::new(
            mode,
            work.distinct,
            restore,
            Vec::new(),
            (outputs, expected),
            batches,
        );
        report.events_per_s = 0.0;
        return Ok(report);
    }
    let mut report = Report::new(
        mode,
        work.len(),
        seconds,
        commits.latencies,
        (outputs, expected),
        batches,
    )
    .steady_from(commits.first);
    report.peak_rss_mib = consumed.peak_rss_mib;
    Ok(report)
}

/// A transactional consumer of the benchmark's handler, in the background.
pub(crate) struct Transactional {
    stats: Arc<dedup_kafka::Stats>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<dedup_kafka::StatsSnapshot, dedup_kafka::Error>>,
}

impl Transactional {
    /// Starts it on `topic` as `group`, writing to `output`.
    pub(crate) fn spawn(
        brokers: &str,
        topic: &str,
        group: &str,
        output: &str,
        args: &Args,
    ) -> Self {
        // One output per process (the handler reads it from here).
        let _ = OUTPUT.set(output.to_owned());
        let mut builder = TransactionalConsumer::builder(topic, enrich)
            .brokers(brokers)
            .group_id(group);
        for (k, v) in &args.settings {
            builder = builder.set(k, v);
        }
        let consumer = builder.build().expect("consumer settings");
        let stats = consumer.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run_until(async {
            let _ = stopped.await;
        }));
        Transactional { stats, stop, task }
    }

    pub(crate) async fn stop(self) -> Result<dedup_kafka::StatsSnapshot, BoxError> {
        let _ = self.stop.send(());
        Ok(self.task.await??)
    }
}

/// How long a new consumer of `group` takes from its start to applying one
/// new event on every partition: joining the group, restoring every
/// partition's claims from the changelog, one transaction. Printed beside
/// the same for a fresh topic and group with no claims (the part that is
/// not restoring).
async fn restore_time(
    brokers: &str,
    topic: &str,
    group: &str,
    output: &str,
    args: &Args,
) -> Result<f64, BoxError> {
    let empty = new_topic(brokers, "kafka-restore-empty", args.partitions).await?;
    let baseline = first_applied(brokers, &empty, &format!("{empty}-g"), output, args).await?;
    let full = first_applied(brokers, topic, group, output, args).await?;
    eprintln!(
        "  kafka-restore: a new owner applied its first events {full:.2} s after its start with the claims to restore, {baseline:.2} s with none (restore ~{:.2} s); peak RSS {:.1} MiB",
        full - baseline,
        crate::peak_rss_mib()
    );
    Ok(full)
}

/// Produces one new event to each partition of `topic`, then starts a
/// consumer of `group` and times it until it has applied them all.
async fn first_applied(
    brokers: &str,
    topic: &str,
    group: &str,
    output: &str,
    args: &Args,
) -> Result<f64, BoxError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    for p in 0..args.partitions {
        let id = format!("new-{}", uuid::Uuid::new_v4().simple());
        let payload =
            serde_json::json!({"event_id": id, "account_id": "a", "amount_cents": 1}).to_string();
        producer
            .send(
                FutureRecord::<str, str>::to(topic)
                    .partition(p)
                    .key(&id)
                    .payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    crate::settle_disk();
    let started = Instant::now();
    let run = Transactional::spawn(brokers, topic, group, output, args);
    while run.stats.snapshot().applied < args.partitions as u64 {
        if started.elapsed() > Duration::from_secs(600) {
            return Err("no event applied within 10 min".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    run.stop().await?;
    Ok(seconds)
}

/// The plain pipeline: consume, transform, produce with an idempotent
/// producer, store each offset once its output is acknowledged (in order
/// per partition), librdkafka auto-committing them every 100 ms. At least
/// once: a crash repeats what was produced after the last commit. It
/// fetches as dedup's runtimes do ([`dedup_kafka::PREFETCH_DEFAULTS`]), so
/// the two pipelines differ by the claims and the transactions, not by
/// librdkafka's fetch defaults: with those its queue filled to 100,000
/// messages and its fetcher then waited a whole second
/// (`fetch.queue.backoff.ms`), which starved it (125,000-131,000 events/s
/// with the machine 27-35% busy).
pub(crate) async fn plain(
    brokers: String,
    topic: String,
    group: String,
    output: String,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), BoxError> {
    let mut config = ClientConfig::new();
    for (k, v) in dedup_kafka::PREFETCH_DEFAULTS {
        config.set(k, v);
    }
    let consumer: Arc<StreamConsumer> = Arc::new(
        config
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "100")
            .set("enable.auto.offset.store", "false")
            .create()?,
    );
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .create()?;
    consumer.subscribe(&[&topic])?;
    let (acked, mut to_store) = tokio::sync::mpsc::unbounded_channel();
    let storer = {
        let consumer = consumer.clone();
        let topic = topic.clone();
        tokio::spawn(async move {
            while let Some((partition, offset, delivery)) = to_store.recv().await {
                let delivery: rdkafka::producer::DeliveryFuture = delivery;
                match delivery.await {
                    Ok(Ok(_)) => {}
                    _ => return Err::<(), BoxError>("an output was not acknowledged".into()),
                }
                consumer.store_offset(&topic, partition, offset)?;
            }
            Ok(())
        })
    };
    loop {
        let msg = tokio::select! {
            _ = &mut stop => break,
            msg = consumer.recv() => msg?,
        };
        let payment: Payment = serde_json::from_slice(msg.payload().unwrap_or_default())?;
        let value = serde_json::to_vec(&Enriched {
            payment: &payment,
            enriched: true,
        })?;
        let record = FutureRecord::to(&output)
            .key(payment.account_id.as_str())
            .payload(&value);
        let delivery = crate::produce::send_when_room(&producer, record).await?;
        acked.send((msg.partition(), msg.offset(), delivery))?;
    }
    drop(acked);
    storer.await??;
    match consumer.commit_consumer_state(rdkafka::consumer::CommitMode::Sync) {
        // Auto-commit took everything already.
        Ok(()) | Err(KafkaError::ConsumerCommit(rdkafka::types::RDKafkaErrorCode::NoOffset)) => {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// A reader's context: a partition's end is what the reader waits for,
/// not an error. librdkafka also reports it as a client error, which
/// rust-rdkafka's default context logs at ERROR level, six lines a count.
pub(crate) struct EndIsNoError;

impl rdkafka::ClientContext for EndIsNoError {
    fn error(&self, error: KafkaError, reason: &str) {
        let end = matches!(
            &error,
            KafkaError::Global(rdkafka::types::RDKafkaErrorCode::PartitionEOF)
                | KafkaError::PartitionEOF(_)
        );
        if !end {
            tracing::error!("librdkafka: {error}: {reason}");
        }
    }
}

impl rdkafka::consumer::ConsumerContext for EndIsNoError {}

/// A `read_committed` reader of `topic`'s `partitions` from their start,
/// reporting each partition's end (`PartitionEOF`).
pub(crate) fn committed_reader(
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Result<BaseConsumer<EndIsNoError>, BoxError> {
    let reader: BaseConsumer<EndIsNoError> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("{topic}-read"))
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("enable.auto.commit", "false")
        .create_with_context(EndIsNoError)?;
    let mut assignment = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        assignment.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
    }
    reader.assign(&assignment)?;
    Ok(reader)
}

/// The records of `topic` a `read_committed` consumer sees (the high
/// watermarks also count transaction markers and aborted records).
fn committed_records(brokers: &str, topic: &str, partitions: i32) -> Result<i64, BoxError> {
    let reader = committed_reader(brokers, topic, partitions)?;
    let (mut count, mut at_end) = (0i64, 0);
    let started = Instant::now();
    while at_end < partitions {
        match reader.poll(Duration::from_millis(500)) {
            Some(Ok(_)) => count += 1,
            Some(Err(KafkaError::PartitionEOF(_))) => at_end += 1,
            Some(Err(e)) => return Err(e.into()),
            None if started.elapsed() > Duration::from_secs(600) => {
                return Err("counting the output took over 10 min".into());
            }
            None => {}
        }
    }
    Ok(count)
}
