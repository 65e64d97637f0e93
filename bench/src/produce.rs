//! Producing the workload, in a process of its own: the consumer's peak RSS
//! is then the consumer's, not the producer's buffers. The child reports
//! each acknowledgement on its stdout (`partition offset source unix_µs`);
//! the parent keeps them compactly, per partition by offset and per source.

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer,
};
use rdkafka::{ClientConfig, Message as _};

use crate::BoxError;
use crate::workload::Workload;

/// Microseconds since the Unix epoch: a clock both processes share.
pub(crate) fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The child's producer: each acknowledgement is timed in librdkafka's
/// delivery callback, as it arrives, and handed to the writer thread.
struct AckContext {
    acks: mpsc::Sender<(i32, i64, u32, u64)>,
    failed: AtomicU64,
}

impl ClientContext for AckContext {}

impl ProducerContext for AckContext {
    /// The event's source number.
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, source: usize) {
        let at = unix_micros();
        match result {
            Ok(m) => {
                let _ = self
                    .acks
                    .send((m.partition(), m.offset(), source as u32, at));
            }
            Err(_) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The child's side: produces `work` to `topic` (at `rate` events/s, or as
/// fast as it can) and prints each acknowledgement.
pub(crate) fn produce(
    brokers: &str,
    topic: &str,
    work: &Workload,
    rate: Option<f64>,
) -> Result<(), BoxError> {
    // One writer thread: acknowledgements are written as they come and
    // flushed whenever none is waiting, so a steady run's parent sees them
    // within milliseconds.
    let (acks, acked) = mpsc::channel::<(i32, i64, u32, u64)>();
    let writer = std::thread::spawn(move || {
        let mut out = BufWriter::new(std::io::stdout().lock());
        while let Ok(first) = acked.recv() {
            let mut next = Some(first);
            while let Some((p, o, s, t)) = next {
                let _ = writeln!(out, "{p} {o} {s} {t}");
                next = acked.try_recv().ok();
            }
            let _ = out.flush();
        }
    });
    let producer: ThreadedProducer<AckContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "5")
        .set("enable.idempotence", "true")
        .create_with_context(AckContext {
            acks,
            failed: AtomicU64::new(0),
        })?;
    // Connected and the topic's leaders known before the clock starts, so
    // a rated run does not begin with a burst of the events due meanwhile.
    producer
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(30))?;
    let started = Instant::now();
    for i in 0..work.len() {
        if let Some(rate) = rate {
            // Paced by the millisecond: the events due within the next one
            // go together (a sleep per event, 30,000 a second, cost this
            // process a quarter of a core of the two the run shares).
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            let now = Instant::now();
            if due > now + Duration::from_millis(1) {
                std::thread::sleep(due - now);
            }
        }
        let (key, payload) = work.message(i);
        let mut record = BaseRecord::with_opaque_to(topic, work.source(i) as usize)
            .key(&key)
            .payload(&payload);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
    }
    producer.flush(Duration::from_secs(120))?;
    let failed = producer.context().failed.load(Ordering::Relaxed);
    // Dropping the producer drops the last sender: the writer ends.
    drop(producer);
    let _ = writer.join();
    if failed > 0 {
        return Err(format!("{failed} events could not be produced").into());
    }
    Ok(())
}

/// When each event was acknowledged, as the parent keeps it.
#[derive(Default)]
pub(crate) struct Acks {
    /// Per partition, by offset: µs since the epoch (0 = not yet).
    pub(crate) by_offset: Vec<Vec<u64>>,
    /// Per source number: the first acknowledgement of that event.
    pub(crate) by_source: Vec<u64>,
    pub(crate) count: u64,
}

impl Acks {
    fn record(&mut self, partition: usize, offset: usize, source: usize, micros: u64) {
        if self.by_offset.len() <= partition {
            self.by_offset.resize_with(partition + 1, Vec::new);
        }
        let offsets = &mut self.by_offset[partition];
        if offsets.len() <= offset {
            offsets.resize(offset + 1, 0);
        }
        offsets[offset] = micros;
        if self.by_source.len() <= source {
            self.by_source.resize(source + 1, 0);
        }
        if self.by_source[source] == 0 || micros < self.by_source[source] {
            self.by_source[source] = micros;
        }
        self.count += 1;
    }

    /// The acknowledgement of `offset` in `partition`, if seen.
    pub(crate) fn at(&self, partition: i32, offset: i64) -> Option<u64> {
        let t = *self
            .by_offset
            .get(usize::try_from(partition).ok()?)?
            .get(usize::try_from(offset).ok()?)?;
        (t > 0).then_some(t)
    }
}

/// The parent's side: a producer child and the thread reading its
/// acknowledgements.
pub(crate) struct Producer {
    child: Child,
    /// Events the child was asked to produce.
    events: usize,
    reader: Option<std::thread::JoinHandle<()>>,
    acks: Arc<Mutex<Acks>>,
}

impl Drop for Producer {
    /// A run that fails midway does not leave its producer running.
    fn drop(&mut self) {
        end_if_running(&mut self.child);
    }
}

/// Kills `child` and reaps it, unless it has exited: a child of this
/// program never outlives the run that started it.
pub(crate) fn end_if_running(child: &mut Child) {
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Producer {
    /// Starts this program as `--produce-to topic` with the same workload.
    pub(crate) fn spawn(
        topic: &str,
        events: usize,
        duplicates: f64,
        window: usize,
        rate: Option<f64>,
    ) -> Result<Self, BoxError> {
        let mut command = Command::new(std::env::current_exe()?);
        command
            .args(["--produce-to", topic, "--events", &events.to_string()])
            .args(["--duplicates", &duplicates.to_string()])
            .args(["--window", &window.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(rate) = rate {
            command.args(["--rate", &rate.to_string()]);
        }
        let mut child = command.spawn()?;
        let stdout = child.stdout.take().ok_or("the producer's stdout")?;
        let acks = Arc::new(Mutex::new(Acks::default()));
        let reader = {
            let acks = acks.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let f: Vec<u64> = line
                        .split_whitespace()
                        .filter_map(|x| x.parse().ok())
                        .collect();
                    if let [p, o, s, t] = f[..] {
                        acks.lock()
                            .expect("lock")
                            .record(p as usize, o as usize, s as usize, t);
                    }
                }
            })
        };
        Ok(Producer {
            child,
            events,
            reader: Some(reader),
            acks,
        })
    }

    /// Whether the child is still producing; an error as soon as it has
    /// failed.
    pub(crate) fn running(&mut self) -> Result<bool, BoxError> {
        match self.child.try_wait()? {
            None => Ok(true),
            Some(status) if status.success() => Ok(false),
            Some(status) => Err(format!("the producer failed: {status}").into()),
        }
    }

    /// Waits for the child to finish; its acknowledgements, or an error if
    /// it failed or not every event was acknowledged.
    pub(crate) fn finish(mut self) -> Result<Acks, BoxError> {
        let status = self.child.wait()?;
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        if !status.success() {
            return Err(format!("the producer failed: {status}").into());
        }
        let acks = std::mem::take(&mut *self.acks.lock().expect("lock"));
        if acks.count != self.events as u64 {
            return Err(format!("{} of {} events acknowledged", acks.count, self.events).into());
        }
        Ok(acks)
    }
}

/// Hands `record` to `producer`, waiting (1 ms at a time) while its queue
/// is full; the delivery to await, or the producer's refusal.
pub(crate) async fn send_when_room<K, P>(
    producer: &rdkafka::producer::FutureProducer,
    mut record: rdkafka::producer::FutureRecord<'_, K, P>,
) -> Result<rdkafka::producer::DeliveryFuture, KafkaError>
where
    K: rdkafka::message::ToBytes + ?Sized,
    P: rdkafka::message::ToBytes + ?Sized,
{
    loop {
        match producer.send_result(record) {
            Ok(delivery) => return Ok(delivery),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                record = back;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err((e, _)) => return Err(e),
        }
    }
}
