//! What a refusal by the broker says about whose fault it is: a record
//! refused for its own sake (too large, an invalid topic) changes its
//! message's fate; anything else is the environment's, and the transaction
//! is tried again.

use std::collections::BTreeSet;

use dedup_core::Handler;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message as _;
use rdkafka::producer::DeliveryFuture;

use super::TransactionalConsumer;
use super::fate::{Fate, dead};
use super::outputs::Outputs;
use super::transact::{Attempt, Source};
use crate::Error;
use crate::dead_letter_format;

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    /// A send refused outright. Its own size or topic: its message's fate.
    /// Anything else may follow from an earlier request's refusal (the
    /// transaction, once failed, refuses every later record), so the earlier
    /// records' reports are looked at first.
    pub(super) async fn send_failed(
        &self,
        source: Source,
        e: KafkaError,
        sent: Vec<(Source, DeliveryFuture)>,
        isolate: &BTreeSet<String>,
        fates: &[Fate],
    ) -> Result<Attempt, Error> {
        if is_records_fault(&e) {
            self.abort().await?;
            return self.refused(source, e, fates);
        }
        let earlier = tokio::time::timeout(self.transaction_timeout, first_refusal(sent))
            .await
            .ok()
            .flatten();
        self.abort().await?;
        match earlier {
            Some(refusal) if is_records_fault(&refusal.1) => {
                self.refused_report(refusal, isolate, fates)
            }
            _ => self.refused(source, e, fates),
        }
    }

    /// A refusal reported by the broker for a record of topic `.2`: named
    /// for certain only if the record was alone in its request.
    pub(super) fn refused_report(
        &self,
        (source, e, topic): (Source, KafkaError, Option<String>),
        isolate: &BTreeSet<String>,
        fates: &[Fate],
    ) -> Result<Attempt, Error> {
        match topic {
            Some(topic) if is_records_fault(&e) && !isolate.contains(&topic) => {
                tracing::warn!(error = %e, topic, "the broker refused records of the transaction; sending that topic's one at a time to find the one at fault");
                Ok(Attempt::Ambiguous(topic))
            }
            _ => self.refused(source, e, fates),
        }
    }

    /// A record refused for its own sake changes its message's fate: an
    /// output too large (or to an invalid topic) dead-letters its event, a
    /// dead letter too large is cut. Anything else is the environment's.
    pub(super) fn refused(
        &self,
        source: Source,
        e: KafkaError,
        fates: &[Fate],
    ) -> Result<Attempt, Error> {
        match source {
            Source::Output(i) if is_records_fault(&e) => {
                tracing::warn!(error = %e, "an output of the handler was refused; the event is dead-lettered");
                Ok(Attempt::Refused(
                    i,
                    dead(
                        "output",
                        format!("the handler's output was refused: {e}"),
                        1,
                    ),
                ))
            }
            Source::DeadLetter(i) if dead_letter_format::is_too_large(&e) => {
                let Fate::Dead {
                    kind,
                    message,
                    attempts,
                    keep,
                } = &fates[i]
                else {
                    unreachable!("a dead letter's source is dead");
                };
                let keep = match keep {
                    None => Some(dead_letter_format::TRUNCATED_PAYLOAD_BYTES),
                    Some(0) => {
                        return Err(Error::Fatal(format!(
                            "a dead letter for {:?} is too large even without its payload: raise the topic's max.message.bytes",
                            self.dead_letter_topic
                        )));
                    }
                    Some(_) => Some(0),
                };
                tracing::warn!(error = %e, ?keep, "the dead letter is too large for the broker; sending it with its payload cut");
                Ok(Attempt::Refused(
                    i,
                    Fate::Dead {
                        kind,
                        message: message.clone(),
                        attempts: *attempts,
                        keep,
                    },
                ))
            }
            // A move is never cut: one too large for its tier is
            // dead-lettered instead. A tier that refuses records (compacted)
            // or lacks a partition is the environment's.
            Source::Move(i)
                if matches!(
                    e,
                    KafkaError::MessageProduction(
                        RDKafkaErrorCode::MessageSizeTooLarge
                            | RDKafkaErrorCode::InvalidMessageSize
                    )
                ) =>
            {
                let Fate::Moved {
                    tier,
                    kind,
                    message,
                    attempts,
                    ..
                } = &fates[i]
                else {
                    unreachable!("a move's source is moved");
                };
                tracing::warn!(error = %e, tier = self.tier(*tier).name, "the retry tier refused the move; the event is dead-lettered");
                Ok(Attempt::Refused(
                    i,
                    dead(
                        kind,
                        format!(
                            "it could not be moved to retry tier {:?}: {:?} refused it ({e}); it \
                             failed with: {message}",
                            self.tier(*tier).name,
                            self.tier(*tier).topic
                        ),
                        *attempts,
                    ),
                ))
            }
            Source::Move(i)
                if matches!(
                    e,
                    KafkaError::MessageProduction(
                        RDKafkaErrorCode::UnknownPartition | RDKafkaErrorCode::InvalidRecord
                    )
                ) =>
            {
                let Fate::Moved { tier, .. } = &fates[i] else {
                    unreachable!("a move's source is moved");
                };
                let why = match e {
                    KafkaError::MessageProduction(RDKafkaErrorCode::InvalidRecord) => {
                        "refuses moves: is it compacted? A tier must keep every record it is \
                         given until it is read"
                    }
                    _ => {
                        "has fewer partitions than the input (the input gained some): add as \
                         many to the tier"
                    }
                };
                Err(Error::Fatal(format!(
                    "the retry tier's topic {:?} {why} ({e})",
                    self.tier(*tier).topic
                )))
            }
            Source::Changelog
                if matches!(
                    e,
                    KafkaError::MessageProduction(
                        RDKafkaErrorCode::UnknownPartition
                            | RDKafkaErrorCode::UnknownTopicOrPartition
                    )
                ) && self.partition_missing() =>
            {
                Err(Error::Fatal(format!(
                    "the changelog {:?} has no partition for every input partition of {:?}: the \
                     input gained partitions; add as many to the changelog",
                    self.changelog, self.topic
                )))
            }
            // A claim record alone refused for its size: a changelog made
            // with a `max.message.bytes` below a claim record's.
            Source::Changelog
                if matches!(
                    e,
                    KafkaError::MessageProduction(
                        RDKafkaErrorCode::MessageSizeTooLarge
                            | RDKafkaErrorCode::InvalidMessageSize
                    )
                ) =>
            {
                Err(Error::Fatal(format!(
                    "the changelog {:?} refuses a record of claims for its size ({e}): they \
                     grow to 64 KiB and go to the broker several at a time; set the topic's \
                     max.message.bytes to Kafka's default (1048588) or more",
                    self.changelog
                )))
            }
            Source::DeadLetter(_)
                if matches!(
                    e,
                    KafkaError::MessageProduction(RDKafkaErrorCode::InvalidRecord)
                ) =>
            {
                Err(Error::Fatal(format!(
                    "the dead-letter topic {:?} refuses dead letters ({e}): is it compacted? \
                     Dead letters may have no key",
                    self.dead_letter_topic
                )))
            }
            // librdkafka purges the records of a transaction that failed
            // (a partition it could not add: a topic the principal may not
            // write); its TXNERR log line says why.
            _ if matches!(
                e,
                KafkaError::MessageProduction(RDKafkaErrorCode::PurgeQueue)
            ) =>
            {
                Ok(Attempt::Rewind {
                    why: format!(
                        "the transaction failed and its records were purged ({e}); librdkafka's \
                         TXNERR error above says why (\"Topic authorization failed\": grant the \
                         principal Write on the topic it names)"
                    ),
                    unwritable: false,
                    lost: false,
                })
            }
            _ => Ok(Attempt::Rewind {
                why: format!("a record was refused: {e}"),
                unwritable: dead_letter_format::is_unwritable(&e),
                lost: false,
            }),
        }
    }
}

/// The first record the broker refused, awaiting every report: one refused
/// for its own sake (a size, an invalid record) if there is one, since a
/// refusal makes the transaction fail the records after it too; with the
/// topic it was sent to.
pub(super) async fn first_refusal(
    sent: Vec<(Source, DeliveryFuture)>,
) -> Option<(Source, KafkaError, Option<String>)> {
    let mut first = None;
    for (source, fut) in sent {
        let (error, topic) = match fut.await {
            Ok(Ok(_)) => continue,
            Ok(Err((err, msg))) => (err, Some(msg.topic().to_owned())),
            Err(_) => (KafkaError::Canceled, None),
        };
        if is_records_fault(&error) && !matches!(source, Source::Changelog) {
            return Some((source, error, topic));
        }
        first.get_or_insert((source, error, topic));
    }
    first
}

pub(super) fn is_fatal(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(t) if t.is_fatal())
}

/// A produce error that no retry can help for this record.
pub(super) fn is_records_fault(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::UnknownPartition
        )
    )
}
