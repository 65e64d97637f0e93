//! One try at a batch's transaction: its records, its offsets, its commit
//! (what a refusal by the broker says is `refusal`'s).
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dedup_core::Handler;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::Consumer as _;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{DeliveryFuture, FutureRecord, Producer as _};

use super::outputs::Outputs;

use super::TransactionalConsumer;
use super::batch::With;
use super::changelog::ClaimRecord;
use super::claims::Sweep;
use super::fate::Fate;
use super::refusal::{first_refusal, is_fatal, is_records_fault};
use crate::Error;
use crate::dead_letter_format::{self, DeadLetter};

/// Where a record of the transaction came from, to tell whose fault its
/// failure is.
#[derive(Clone, Copy)]
pub(super) enum Source {
    Output(usize),
    DeadLetter(usize),
    Move(usize),
    Changelog,
}

/// What a transaction writes to the changelog: the records of the claims it
/// takes, and each partition's sweep (the keys it tombstones).
pub(super) type Changelog<'a> = (&'a [ClaimRecord], &'a BTreeMap<i32, Sweep>);

/// How a transaction attempt ended.
pub(super) enum Attempt {
    Committed,
    /// A record was refused for its own sake: message `.0` now has fate
    /// `.1`; the batch is judged again around it and run in a new
    /// transaction.
    Refused(usize, Fate),
    /// The broker refused a request of records to topic `.0` for a
    /// reason no single record may have caused (a size): run again sending
    /// that topic's records one at a time, to find the one at fault.
    Ambiguous(String),
    /// The environment failed or the group moved on: the batch is dropped
    /// and its partitions rewound to their committed offsets. With
    /// `unwritable`, a topic of the transaction could not be written.
    Rewind {
        why: String,
        unwritable: bool,
        lost: bool,
    },
}

/// How long a transaction's commit, offsets or abort may stay unresolved
/// (librdkafka's retriable errors: the coordinator unreachable) before the
/// consumer stops: a restart resumes from what Kafka committed, while
/// another call on a producer with one in progress could only conflict.
pub(super) const UNRESOLVED_LIMIT: Duration = Duration::from_secs(120);

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    pub(super) async fn init_transactions(&self) -> Result<(), Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let timeout = self.transaction_timeout.max(Duration::from_secs(10));
            match tokio::task::block_in_place(|| self.producer.init_transactions(timeout)) {
                Ok(()) => return Ok(()),
                Err(e)
                    if e.rdkafka_error_code()
                        == Some(RDKafkaErrorCode::TransactionalIdAuthorizationFailed) =>
                {
                    let id = &self.transactional_id;
                    let group = self.consumer_config.get("group.id").unwrap_or_default();
                    let prefix = format!("{group}-dedup-");
                    // The ids dedup makes are new at every start: one
                    // prefixed ACL covers them all.
                    let (resource, pattern) = if id.starts_with(&prefix) {
                        (prefix.as_str(), " --resource-pattern-type prefixed")
                    } else {
                        (id.as_str(), "")
                    };
                    let principal = crate::access::principal(&self.shared_config);
                    return Err(Error::Config(format!(
                        "the brokers do not let {principal} use transactional id {id:?} ({e}): \
                         grant it Write on the transactional id, e.g. {}",
                        crate::access::grant_command(
                            &principal,
                            "Write",
                            &format!("--transactional-id {resource}{pattern}")
                        )
                    )));
                }
                Err(e) if is_fatal(&e) || attempt >= 30 => {
                    return Err(Error::Fatal(format!(
                        "initializing transactions failed: {e}"
                    )));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "initializing transactions; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// One try at the batch's transaction.
    pub(super) async fn transact(
        &self,
        with: &With<'_>,
        batch: &[OwnedMessage],
        fates: &[Fate],
        changelog: Changelog<'_>,
        offsets: &TopicPartitionList,
        isolate: &BTreeSet<String>,
    ) -> Result<Attempt, Error> {
        let With { consumer, busy, .. } = *with;
        let timeout = self.transaction_timeout;
        // Where a transaction's time goes, for the debug log (the per-phase
        // profile of the Kafka-only runtime: docs/src/performance.md).
        let begun = Instant::now();
        if let Err(e) = self.producer.begin_transaction() {
            return Err(Error::Fatal(format!("beginning a transaction failed: {e}")));
        }
        crate::failpoint::failpoint("transaction-before-outputs");
        // A member that lost partitions of the batch (it was dropped from
        // its group) must not commit them: their new owner runs them.
        let assigned = match consumer.assignment() {
            Ok(assigned) => assigned,
            Err(e) => {
                self.abort().await?;
                return Err(e.into());
            }
        };
        let lost = consumer.assignment_lost()
            || offsets
                .elements()
                .iter()
                .any(|e| assigned.find_partition(e.topic(), e.partition()).is_none());
        let group = consumer.group_metadata().filter(|_| !lost);
        let Some(group) = group else {
            self.abort().await?;
            return Ok(Attempt::Rewind {
                why: "partitions of the batch are no longer assigned".into(),
                unwritable: false,
                lost: true,
            });
        };
        crate::failpoint::failpoint("transaction-before-offsets");
        // The offsets go to the transaction on a thread of their own while
        // the records are queued (nothing commits before every record is
        // acknowledged, below): their two round trips overlap the
        // queueing instead of following it.
        let offsets_sending = {
            let producer = self.producer.clone();
            let offsets = offsets.clone();
            tokio::task::spawn_blocking(move || -> Result<Result<(), KafkaError>, Error> {
                let started = Instant::now();
                loop {
                    match producer.send_offsets_to_transaction(&offsets, &group, timeout) {
                        Ok(()) => return Ok(Ok(())),
                        // Resumable: the same call again, until it resolves.
                        Err(KafkaError::Transaction(e)) if e.is_retriable() && !e.is_fatal() => {
                            Self::unresolved("sending the offsets", &e, started)?;
                        }
                        Err(e) => return Ok(Err(e)),
                    }
                }
            })
        };
        let mut sent: Vec<(Source, DeliveryFuture)> = Vec::new();
        let queued_result = self
            .queue_records(batch, fates, changelog, &mut sent, isolate)
            .await;
        let records = sent.len();
        let queued = begun.elapsed();
        // An abort must wait for the offsets' call to end (librdkafka
        // refuses a transactional call while another is in progress).
        let offsets_result = match offsets_sending.await {
            Ok(result) => result?,
            Err(e) => {
                return Err(Error::Fatal(format!(
                    "sending the offsets of a transaction failed: {e}"
                )));
            }
        };
        if let Err((source, e)) = queued_result {
            // A fenced producer's offsets say why, not its refused abort.
            return match offsets_result {
                Err(e) if is_fatal(&e) => self.failed("send offsets", e).await,
                _ => self.send_failed(source, e, sent, isolate, fates).await,
            };
        }
        let offsets_sent = begun.elapsed();
        // The group coordinator holds the offsets, pending the commit: the
        // loop gathers the next batch while the broker acknowledges this
        // one (busy.rs says why a poll is safe from here on).
        // Ended before any abort: a transaction aborted has no offsets.
        let mut carrying = offsets_result.is_ok().then(|| busy.carry_from_here());
        crate::failpoint::failpoint("transaction-before-acks");
        // Every record acknowledged (or refused) before the commit: a
        // refusal names its record, and the commit has nothing left to
        // flush (rust-rdkafka's flush would wait out a 100 ms poll for
        // acknowledgements that its polling thread takes). Offsets that
        // failed make librdkafka purge the records still queued, whose
        // reports then read "purged": their failure is the offsets' then,
        // unless a record was refused for its own sake.
        match tokio::time::timeout(timeout, first_refusal(sent)).await {
            Ok(None) => {}
            Ok(Some(refusal)) if offsets_result.is_ok() || is_records_fault(&refusal.1) => {
                drop(carrying.take());
                self.abort().await?;
                return self.refused_report(refusal, isolate, fates);
            }
            Ok(Some(_)) => {}
            Err(_) => {
                drop(carrying.take());
                return self
                    .failed(
                        "produce",
                        KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut),
                    )
                    .await;
            }
        }
        if let Err(e) = offsets_result {
            return self.failed("send offsets", e).await;
        }
        self.let_go().await;
        let acknowledged = begun.elapsed();
        crate::failpoint::failpoint("transaction-before-commit");
        if crate::failpoint::fails("transaction-fails-before-commit") {
            drop(carrying.take());
            self.abort().await?;
            return Ok(Attempt::Rewind {
                why: "failpoint transaction-fails-before-commit".into(),
                unwritable: false,
                lost: false,
            });
        }
        let started = Instant::now();
        loop {
            match tokio::task::block_in_place(|| self.producer.commit_transaction(timeout)) {
                Ok(()) => break,
                // Resumable: the same call again, until it resolves.
                Err(KafkaError::Transaction(e)) if e.is_retriable() && !e.is_fatal() => {
                    Self::unresolved("committing", &e, started)?;
                }
                Err(e) => {
                    drop(carrying.take());
                    return self.failed("commit", e).await;
                }
            }
        }
        crate::failpoint::failpoint("transaction-after-commit");
        let committed = begun.elapsed();
        tracing::debug!(
            messages = fates.len(),
            records,
            queue_ms = ms(queued),
            offsets_ms = ms(offsets_sent - queued),
            acks_ms = ms(acknowledged - offsets_sent),
            commit_ms = ms(committed - acknowledged),
            "transaction committed"
        );
        Ok(Attempt::Committed)
    }

    /// Waits until librdkafka has let go of the transaction's records, at
    /// most 100 ms. A record's delivery future resolves inside its report's
    /// callback, a moment before librdkafka releases the record; a commit
    /// that comes in that moment finds it still counted, and rust-rdkafka's
    /// flush before the commit then polls for 100 ms a queue that its own
    /// polling thread drains (40 commits in 500 did, in the benchmark, once
    /// the wait for the acknowledgements came right before the commit).
    async fn let_go(&self) {
        for _ in 0..64 {
            if self.producer.in_flight_count() == 0 {
                return;
            }
            tokio::task::yield_now().await;
        }
        let deadline = Instant::now() + Duration::from_millis(100);
        while self.producer.in_flight_count() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Queues the transaction's records: outputs and dead letters in
    /// partition order, then the changelog (tombstones, then the records of
    /// the claims taken). `Err` names the first record the producer refused
    /// outright.
    async fn queue_records(
        &self,
        batch: &[OwnedMessage],
        fates: &[Fate],
        changelog: Changelog<'_>,
        sent: &mut Vec<(Source, DeliveryFuture)>,
        isolate: &BTreeSet<String>,
    ) -> Result<(), (Source, KafkaError)> {
        for (i, (msg, fate)) in batch.iter().zip(fates.iter()).enumerate() {
            let sent_one = match fate {
                Fate::Applied { outputs, .. } => {
                    let mut result = Ok(());
                    for out in outputs {
                        let mut record = FutureRecord::<[u8], [u8]>::to(&out.topic);
                        if let Some(k) = &out.key {
                            record = record.key(k);
                        }
                        if let Some(p) = &out.payload {
                            record = record.payload(p);
                        }
                        if let Some(p) = out.partition {
                            record = record.partition(p);
                        }
                        if !out.headers.is_empty() {
                            let mut hs = OwnedHeaders::new();
                            for (name, value) in &out.headers {
                                hs = hs.insert(Header {
                                    key: name,
                                    value: Some(value),
                                });
                            }
                            record = record.headers(hs);
                        }
                        result = self.send(record, Source::Output(i), sent, isolate).await;
                        if result.is_err() {
                            break;
                        }
                    }
                    result
                }
                Fate::Skipped { .. } => Ok(()),
                Fate::Dead {
                    kind,
                    message,
                    attempts,
                    keep,
                } => {
                    let why = DeadLetter {
                        topic: &self.dead_letter_topic,
                        kind,
                        message: message.clone(),
                        attempts: *attempts,
                        handler: self.handler.scope(),
                        schema_id: dead_letter_format::schema_id(self.handler.preparer(), msg),
                        origin: self.origin(msg),
                        moved: None,
                    };
                    let record = dead_letter_format::record(msg, &why, *keep);
                    self.send(record, Source::DeadLetter(i), sent, isolate)
                        .await
                }
                Fate::Moved {
                    tier,
                    kind,
                    message,
                    attempts,
                    due_ms,
                } => {
                    let why = self.move_to(msg, *tier, kind, message.clone(), *attempts, *due_ms);
                    let record = dead_letter_format::record(msg, &why, None);
                    self.send(record, Source::Move(i), sent, isolate).await
                }
            };
            if let Err((source, e)) = sent_one {
                return Err((source, e));
            }
        }
        let (claimed, tombstones) = changelog;
        for (&p, sweep) in tombstones {
            for key in &sweep.tombstones {
                let record = FutureRecord::<[u8], [u8]>::to(&self.changelog)
                    .partition(p)
                    .key(key.as_bytes());
                if let Err((source, e)) = self.send(record, Source::Changelog, sent, isolate).await
                {
                    return Err((source, e));
                }
            }
        }
        for claims in claimed {
            let record = FutureRecord::<[u8], [u8]>::to(&self.changelog)
                .partition(claims.partition)
                .key(&claims.key[..])
                .payload(&claims.value[..]);
            if let Err((source, e)) = self.send(record, Source::Changelog, sent, isolate).await {
                return Err((source, e));
            }
        }
        Ok(())
    }

    /// Sends one record of the transaction, waiting while librdkafka's
    /// queue is full; `Err` if the producer refused it outright.
    pub(super) async fn send<'a>(
        &self,
        mut record: FutureRecord<'a, [u8], [u8]>,
        source: Source,
        sent: &mut Vec<(Source, DeliveryFuture)>,
        isolate: &BTreeSet<String>,
    ) -> Result<(), (Source, KafkaError)> {
        let alone = isolate.contains(record.topic);
        loop {
            match self.producer.send_result(record) {
                // Alone in its request: its acknowledgement names it.
                Ok(fut) if alone => {
                    let _ = self.producer.flush(Duration::ZERO);
                    return match tokio::time::timeout(self.transaction_timeout, fut).await {
                        Ok(Ok(Ok(_))) => Ok(()),
                        Ok(Ok(Err((e, _)))) => Err((source, e)),
                        _ => Err((source, KafkaError::Canceled)),
                    };
                }
                Ok(fut) => {
                    sent.push((source, fut));
                    return Ok(());
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err((source, e)),
            }
        }
    }

    /// Whether the changelog has fewer partitions than the input now.
    pub(super) fn partition_missing(&self) -> bool {
        let count = |topic: &str| -> Option<usize> {
            let metadata = self
                .producer
                .client()
                .fetch_metadata(Some(topic), Duration::from_secs(10))
                .ok()?;
            metadata.topics().first().map(|t| t.partitions().len())
        };
        tokio::task::block_in_place(
            || matches!((count(&self.topic), count(&self.changelog)), (Some(i), Some(c)) if c < i),
        )
    }

    /// A retriable error of a call librdkafka resumes: the same call goes
    /// again, unless it has stayed unresolved for [`UNRESOLVED_LIMIT`].
    pub(super) fn unresolved(
        step: &str,
        e: &rdkafka::error::RDKafkaError,
        since: Instant,
    ) -> Result<(), Error> {
        if since.elapsed() >= UNRESOLVED_LIMIT {
            return Err(Error::Fatal(format!(
                "{step} a transaction stayed unresolved for {:?} ({e}): stopping; a restart \
                 resumes from what Kafka committed",
                since.elapsed()
            )));
        }
        tracing::warn!(error = %e, step, "transaction: retrying");
        Ok(())
    }

    /// Aborts the open transaction; a retriable failure is retried (the
    /// same call resumes), anything else stops the consumer.
    pub(super) async fn abort(&self) -> Result<(), Error> {
        let started = Instant::now();
        loop {
            match tokio::task::block_in_place(|| {
                self.producer.abort_transaction(self.transaction_timeout)
            }) {
                Ok(()) => return Ok(()),
                Err(KafkaError::Transaction(e)) if e.is_retriable() && !e.is_fatal() => {
                    Self::unresolved("aborting", &e, started)?;
                }
                Err(e) => {
                    return Err(Error::Fatal(format!(
                        "aborting the transaction failed: {e}"
                    )));
                }
            }
        }
    }

    /// A step of the transaction failed: fatal errors stop the consumer,
    /// anything else aborts and rewinds.
    pub(super) async fn failed(&self, step: &str, e: KafkaError) -> Result<Attempt, Error> {
        if is_fatal(&e) {
            return Err(Error::Fatal(format!(
                "the transactional producer failed fatally at {step} (another instance with \
                 transactional.id {:?}?): {e}",
                self.transactional_id
            )));
        }
        self.abort().await?;
        Ok(Attempt::Rewind {
            why: format!("{step}: {e}"),
            unwritable: dead_letter_format::is_unwritable(&e),
            lost: false,
        })
    }
}

/// A duration in milliseconds, for the debug logs.
pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
