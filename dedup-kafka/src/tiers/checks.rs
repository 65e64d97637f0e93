//! The retry tiers' checks before a consumer starts: their topics exist
//! with the partitions a move needs, and each handler's TTL outlives the way
//! through them.

use crate::oauth::TokenContext;
use std::time::Duration;

use super::TopicTiers;
use crate::Error;

/// The start-up check: each retry tier's topic exists with at least as
/// many partitions as its handled topic (a move keeps its origin's
/// partition), exactly as many if `exact` (the Kafka-only runtime reads a
/// tier's partition with its input's). A handled topic that cannot be read
/// is left to the consumer; a broker that does not answer is only warned
/// about.
pub(crate) async fn check_topics(
    admin: &rdkafka::ClientConfig,
    tiers: Vec<std::sync::Arc<TopicTiers>>,
    exact: bool,
) -> Result<(), Error> {
    if tiers.is_empty() {
        return Ok(());
    }
    let admin = admin.clone();
    let counted = tokio::task::spawn_blocking(move || {
        let client: rdkafka::consumer::BaseConsumer<TokenContext> =
            admin.create_with_context(TokenContext)?;
        crate::oauth::take_token(&client);
        let mut out = Vec::new();
        for topic in &tiers {
            let count = |name: &str| -> Result<usize, rdkafka::error::KafkaError> {
                let metadata = rdkafka::consumer::Consumer::fetch_metadata(
                    &client,
                    Some(name),
                    Duration::from_secs(10),
                )?;
                let Some(topic) = metadata.topics().iter().find(|t| t.name() == name) else {
                    return Ok(0);
                };
                match topic.error() {
                    None => Ok(topic.partitions().len()),
                    Some(
                        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
                    ) => Ok(0),
                    // Not authorized, no leader yet...: not known to be missing.
                    Some(e) => Err(rdkafka::error::KafkaError::MetadataFetch(e.into())),
                }
            };
            let origin = count(&topic.origin)?;
            for tier in &topic.tiers {
                out.push((
                    topic.origin.clone(),
                    origin,
                    tier.topic.clone(),
                    count(&tier.topic)?,
                ));
            }
        }
        Ok::<_, rdkafka::error::KafkaError>(out)
    })
    .await
    .map_err(|e| Error::Fatal(format!("checking the retry tiers' topics: {e}")))?;
    let counted = match counted {
        Ok(counted) => counted,
        Err(e) => {
            tracing::warn!(error = %e, "cannot check the retry tiers' topics");
            return Ok(());
        }
    };
    for (origin, partitions, tier, has) in counted {
        if partitions == 0 {
            continue;
        }
        if has < partitions || (exact && has != partitions) {
            let what = match has {
                0 => "does not exist".to_owned(),
                n => format!("has {n} partitions"),
            };
            let why = match exact {
                true => "a tier's partition is read with its input partition",
                false => "a move keeps its origin's partition",
            };
            return Err(Error::Config(format!(
                "the retry tier's topic {tier:?} {what}: create it with {partitions} \
                 partitions, as many as {origin:?} ({why})"
            )));
        }
    }
    Ok(())
}

/// Refuses handler `scope`'s TTL when it is not longer than an event's way
/// through its topic's tiers: the tiers' delays together, and under key
/// hold-back one more round of the last tier (an event that follows
/// another may wait a round there after the one it follows finishes).
/// Its claim (and its hold record) would then expire while the event
/// waits in a tier: a duplicate applied at the origin meanwhile would have
/// lapsed when the tier's copy is applied, which is applied again, and a
/// lapsed hold would let the key's later events pass it.
pub(crate) fn refuse_short_ttl(
    scope: &str,
    ttl: dedup_core::Ttl,
    tiers: &TopicTiers,
) -> Result<(), Error> {
    let mut legs: Vec<Duration> = tiers.tiers.iter().map(|t| t.delay).collect();
    if tiers.hold_keys
        && let Some(last) = legs.last().copied()
    {
        legs.push(last);
    }
    let path: Duration = legs.iter().sum();
    if ttl.as_duration() > path {
        return Ok(());
    }
    let sum = legs
        .iter()
        .map(|d| shown(*d))
        .collect::<Vec<_>>()
        .join(" + ");
    let hold = match tiers.hold_keys {
        true => ", the last counted twice under key hold-back",
        false => "",
    };
    Err(Error::Config(format!(
        "handler {scope:?} of {:?}: its TTL {ttl} is not longer than the way through its retry \
         tiers ({sum} = {}{hold}): a claim would expire while its event waits in a tier, and \
         a duplicate could be applied twice; give the TTL more than {} or shorten the tiers",
        tiers.origin,
        shown(path),
        shown(path),
    )))
}

/// A delay in the TTL grammar (`1h5m30s`) where it is whole seconds.
fn shown(delay: Duration) -> String {
    match dedup_core::Ttl::from_secs(delay.as_secs()) {
        Some(ttl) if delay.subsec_nanos() == 0 => ttl.to_string(),
        _ => format!("{delay:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RetryTiers;

    /// A TTL the tiers' way can outlive is refused, with the sum in the
    /// error; under key hold-back the last tier counts twice.
    #[test]
    fn a_ttl_not_longer_than_the_tiers_way_is_refused() {
        let ttl = |s: &str| dedup_core::Ttl::parse(s).unwrap();
        let tiers = RetryTiers::new(["30s", "5m", "1h"]).unwrap();
        let of = tiers.of("payments", crate::OrderBy::default(), 1);
        let err = refuse_short_ttl("pay", ttl("1h"), &of)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("TTL 1h is not longer") && err.contains("30s + 5m + 1h = 1h5m30s"),
            "{err}"
        );
        assert!(
            refuse_short_ttl("pay", ttl("1h5m30s"), &of).is_err(),
            "equal"
        );
        assert!(refuse_short_ttl("pay", ttl("1h5m31s"), &of).is_ok());
        let held = tiers
            .hold_keys(true)
            .of("payments", crate::OrderBy::default(), 1);
        let err = refuse_short_ttl("pay", ttl("2h"), &held)
            .unwrap_err()
            .to_string();
        assert!(err.contains("30s + 5m + 1h + 1h = 2h5m30s"), "{err}");
        assert!(refuse_short_ttl("pay", ttl("3h"), &held).is_ok());
    }
}
