//! A handler whose events come as Avro through a schema registry.

use std::future::Future;

use dedup_core::decode::Prepare;
use dedup_core::{Describe, Error, Fingerprint, Handler, HandlerError, Headers, KeyError, Ttl};
use serde::de::DeserializeOwned;

use crate::Registry;
use crate::avro::{AvroDecoder, AvroSchema};

/// A handler of yours whose payloads are Avro in Confluent's wire format:
/// each decoded with its writer's schema from the registry, resolved to
/// the handler's event type (its [`AvroSchema`]). Everything else (scope,
/// TTL, key, fingerprint, body) is the handler's own.
///
/// The runtime fetches the writer's schema before decoding (dedup-core's
/// [`Prepare`]): a registry that is down is waited out and dead-letters
/// nothing, one that refuses the credentials stops the consumer; a record
/// without the frame, of a schema id the registry does not know, or whose
/// bytes do not match their schema is dead-lettered as a decode failure.
///
/// ```no_run
/// # use dedup_core::{HandlerError, MemoryTx, idempotent};
/// # use dedup_registry::{Registry, avro::AvroSchema, AvroHandler};
/// #[derive(serde::Deserialize)]
/// struct PaymentRecorded { event_id: String, amount_cents: i64 }
/// # impl AvroSchema for PaymentRecorded { fn get_schema() -> dedup_registry::avro::AvroSchemaText { unimplemented!() } }
///
/// #[idempotent(key = "event_id", ttl = "4h")]
/// async fn record(tx: &mut MemoryTx, ev: PaymentRecorded) -> Result<(), HandlerError> {
///     # let _ = (tx, ev);
///     Ok(())
/// }
///
/// # fn f() -> Result<(), dedup_registry::RegistryError> {
/// let registry = Registry::builder("https://registry.example.com").build()?;
/// let handler = AvroHandler::new(record, registry);
/// // ConsumerBuilder::handle("payments", handler)
/// # let _ = handler; Ok(()) }
/// ```
pub struct AvroHandler<H: Describe> {
    inner: H,
    decoder: AvroDecoder<H::Event>,
}

impl<H: Describe> std::fmt::Debug for AvroHandler<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AvroHandler")
            .field("scope", &self.inner.scope())
            .field("decoder", &self.decoder)
            .finish()
    }
}

impl<H> AvroHandler<H>
where
    H: Describe,
    H::Event: DeserializeOwned + AvroSchema,
{
    /// `handler`, its payloads read as Avro through `registry`.
    pub fn new(handler: H, registry: Registry) -> Self {
        AvroHandler {
            inner: handler,
            decoder: AvroDecoder::new(registry),
        }
    }
}

impl<H> Describe for AvroHandler<H>
where
    H: Describe,
    H::Event: DeserializeOwned,
{
    type Event = H::Event;

    fn scope(&self) -> &str {
        self.inner.scope()
    }

    fn ttl(&self) -> Ttl {
        self.inner.ttl()
    }

    fn key(&self, event: &Self::Event, headers: &dyn Headers) -> Result<String, KeyError> {
        self.inner.key(event, headers)
    }

    fn fingerprint(&self, event: &Self::Event, payload: &[u8]) -> Option<Fingerprint> {
        self.inner.fingerprint(event, payload)
    }

    fn decode(&self, payload: &[u8]) -> Result<Self::Event, Error> {
        Ok(self.decoder.decode(payload)?)
    }

    fn preparer(&self) -> Option<&dyn Prepare> {
        Some(&self.decoder)
    }
}

impl<H> Handler for AvroHandler<H>
where
    H: Handler,
    H::Event: DeserializeOwned,
{
    type Tx = H::Tx;

    fn takes_batches(&self) -> bool {
        self.inner.takes_batches()
    }

    fn handle(
        &self,
        tx: &mut Self::Tx,
        event: Self::Event,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        self.inner.handle(tx, event)
    }

    fn handle_batch(
        &self,
        tx: &mut Self::Tx,
        events: Vec<Self::Event>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        self.inner.handle_batch(tx, events)
    }
}
