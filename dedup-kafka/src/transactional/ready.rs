//! The handler's decoder made ready for a batch before it is judged: a
//! schema registry's writer's schemas fetched (see
//! `dedup_core::decode::Prepare`), an outage waited out, a configuration
//! error stopping the consumer. So decoding depends on the message alone,
//! and its errors stay the message's fault.

use std::collections::HashMap;

use dedup_core::Handler;
use rdkafka::message::{Message as _, OwnedMessage};

use super::TransactionalConsumer;
use super::batch::With;
use super::fate::{Fate, Halt};
use super::outputs::Outputs;
use crate::Error;
use crate::pipeline::outage::{NotReady, Retrying, prepare_once};
use crate::retry::Jitter;

impl<H: Handler<Tx = Outputs>> TransactionalConsumer<H> {
    /// Readies the decoder for each message of `batch` whose fate is not
    /// `forced`; at once for a handler that needs nothing fetched. Halts
    /// when the consumer stops or the group rebalances while it waits, or
    /// when the decoder cannot be made ready (the consumer stops with the
    /// reason): nothing of the batch is then committed.
    pub(super) async fn ready(
        &self,
        batch: &[OwnedMessage],
        forced: &HashMap<usize, Fate>,
        jitter: &mut Jitter,
        with: &With<'_>,
    ) -> Result<(), Halt> {
        let Some(preparer) = self.handler.preparer() else {
            return Ok(());
        };
        let limit = self.pipeline.attempt_timeout;
        let mut retrying = Retrying::new(&self.stats, self.pipeline.retry);
        for (i, msg) in batch.iter().enumerate() {
            if forced.contains_key(&i) {
                continue;
            }
            let payload = msg.payload().unwrap_or_default();
            loop {
                let outage =
                    match prepare_once(preparer, payload, limit, self.handler.scope()).await {
                        Ok(()) => break,
                        Err(NotReady::Configuration(why)) => {
                            return Err(Halt::Fatal(Error::Fatal(why)));
                        }
                        Err(NotReady::Outage(outage)) => outage,
                    };
                let wait = retrying
                    .environment_failed(&outage, jitter.next())
                    .map_err(|why| Halt::Fatal(Error::Fatal(why)))?;
                let mut stopping = with.stopping.clone();
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = stopping.wait_for(|s| *s) => return Err(Halt::Stopped),
                    () = with.busy.rebalance() => return Err(Halt::Rebalanced),
                }
            }
        }
        Ok(())
    }
}
