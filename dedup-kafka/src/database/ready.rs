//! A decoder made ready for a message before it decodes it: a schema
//! registry's writer's schema fetched (see `dedup_core::decode::Prepare`),
//! an outage waited out, a configuration error stopping the consumer. So
//! decoding itself depends on the message alone, and its errors stay the
//! message's fault.

use dedup_core::DedupStore;

use crate::database::partition::state::Partition;
use crate::database::partition::{Runtime, wait_unless_stopped};
use crate::database::route::Route;
use crate::pipeline::outage::{NotReady, Retrying, prepare_once};
use crate::retry::Jitter;

/// Whether the route's decoder is ready for `payload`: `true` at once for
/// a handler that needs nothing fetched. `false` when the consumer stops or
/// the partition is revoked meanwhile, or when the decoder cannot be made
/// ready (the consumer then stops with the reason): the message is then
/// left unfinished, its offset uncommitted.
pub(crate) async fn ready<S: DedupStore>(
    shared: &Runtime<S>,
    route: &Route<S>,
    partition: &Partition,
    payload: &[u8],
    jitter: &mut Jitter,
) -> bool {
    let Some(preparer) = route.handler.preparer() else {
        return true;
    };
    let limit = shared.settings.pipeline.attempt_timeout;
    let mut retrying = Retrying::new(&shared.stats, shared.settings.pipeline.retry);
    loop {
        let outage = match prepare_once(preparer, payload, limit, route.handler.scope()).await {
            Ok(()) => return true,
            Err(NotReady::Configuration(why)) => {
                shared.fail(why);
                return false;
            }
            Err(NotReady::Outage(outage)) => outage,
        };
        let wait = match retrying.environment_failed(&outage, jitter.next()) {
            Ok(wait) => wait,
            Err(why) => {
                shared.fail(why);
                return false;
            }
        };
        if !wait_unless_stopped(shared, partition, wait).await {
            return false;
        }
    }
}
