//! A handler whose events come as Avro through a schema registry.

use std::fmt;
use std::future::Future;

use dedup_core::decode::Prepare;
use dedup_core::{
    Describe, Error, Fingerprint, Handler, HandlerError, Headers, KeyError, Lease, LeaseHandler,
    Ttl,
};
use serde::de::DeserializeOwned;

use crate::avro::{AvroDecoder, AvroSchema};
use crate::json::JsonSchemaDecoder;
use crate::protobuf::ProtobufDecoder;
use crate::{Registry, SchemaError};

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
pub type AvroHandler<H> = SchemaHandler<H, AvroDecoder<<H as Describe>::Event>>;

/// A handler of yours whose payloads are JSON Schema records in
/// Confluent's wire format: each validated against the schema its id
/// names, then read by serde into the handler's event type. Failures as
/// [`AvroHandler`]'s.
pub type JsonSchemaHandler<H> = SchemaHandler<H, JsonSchemaDecoder<<H as Describe>::Event>>;

/// A handler of yours whose payloads are Protobuf records in Confluent's
/// wire format: each record's message indexes placed in the `.proto` file
/// its schema id names, checked to be the handler's event type (prost's
/// [`Name`](prost::Name)), then read by prost. The handler itself is
/// declared `#[idempotent(..., format = "protobuf")]` (dedup-core's
/// `protobuf` feature), which its key and fingerprint need; the wrapper
/// replaces only its decoding. Failures as [`AvroHandler`]'s.
pub type ProtobufHandler<H> = SchemaHandler<H, ProtobufDecoder<<H as Describe>::Event>>;

/// What reads a handler's payloads through a registry: a [`Prepare`]
/// (fetching what a record needs) that then decodes synchronously.
pub trait SchemaDecoder: Prepare {
    /// The decoded event.
    type Event;

    /// Decodes a record whose schema was prepared.
    fn decode(&self, payload: &[u8]) -> Result<Self::Event, SchemaError>;
}

impl<T: DeserializeOwned + Send + 'static> SchemaDecoder for AvroDecoder<T> {
    type Event = T;

    fn decode(&self, payload: &[u8]) -> Result<T, SchemaError> {
        AvroDecoder::decode(self, payload)
    }
}

impl<T: DeserializeOwned + Send + 'static> SchemaDecoder for JsonSchemaDecoder<T> {
    type Event = T;

    fn decode(&self, payload: &[u8]) -> Result<T, SchemaError> {
        JsonSchemaDecoder::decode(self, payload)
    }
}

/// A handler with its payloads read by a [`SchemaDecoder`]: made by
/// [`AvroHandler::new`], [`JsonSchemaHandler::new`] or
/// [`ProtobufHandler::new`].
pub struct SchemaHandler<H, D> {
    inner: H,
    decoder: D,
}

impl<H: Describe, D: fmt::Debug> fmt::Debug for SchemaHandler<H, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchemaHandler")
            .field("scope", &self.inner.scope())
            .field("decoder", &self.decoder)
            .finish()
    }
}

impl<H> SchemaHandler<H, AvroDecoder<H::Event>>
where
    H: Describe,
    H::Event: DeserializeOwned + AvroSchema,
{
    /// `handler`, its payloads read as Avro through `registry`.
    pub fn new(handler: H, registry: Registry) -> Self {
        SchemaHandler {
            inner: handler,
            decoder: AvroDecoder::new(registry),
        }
    }
}

impl<H> SchemaHandler<H, JsonSchemaDecoder<H::Event>>
where
    H: Describe,
    H::Event: DeserializeOwned,
{
    /// `handler`, its payloads read as JSON Schema records through
    /// `registry`.
    pub fn new(handler: H, registry: Registry) -> Self {
        SchemaHandler {
            inner: handler,
            decoder: JsonSchemaDecoder::new(registry),
        }
    }
}

impl<T: prost::Message + Default + prost::Name + 'static> SchemaDecoder for ProtobufDecoder<T> {
    type Event = T;

    fn decode(&self, payload: &[u8]) -> Result<T, SchemaError> {
        ProtobufDecoder::decode(self, payload)
    }
}

impl<H> SchemaHandler<H, ProtobufDecoder<H::Event>>
where
    H: Describe,
    H::Event: prost::Message + Default + prost::Name,
{
    /// `handler`, its payloads read as Protobuf records through `registry`.
    pub fn new(handler: H, registry: Registry) -> Self {
        SchemaHandler {
            inner: handler,
            decoder: ProtobufDecoder::new(registry),
        }
    }
}

impl<H, D> Describe for SchemaHandler<H, D>
where
    H: Describe,
    D: SchemaDecoder<Event = H::Event> + Send + Sync + 'static,
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
        Ok(SchemaDecoder::decode(&self.decoder, payload)?)
    }

    fn preparer(&self) -> Option<&dyn Prepare> {
        Some(&self.decoder)
    }
}

impl<H, D> Handler for SchemaHandler<H, D>
where
    H: Handler,
    D: SchemaDecoder<Event = H::Event> + Send + Sync + 'static,
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

/// A lease-mode handler (`#[idempotent(lease = "30s")]`) reads through the
/// registry the same way: its effect runs under its lease as before.
impl<H, D> LeaseHandler for SchemaHandler<H, D>
where
    H: LeaseHandler,
    D: SchemaDecoder<Event = H::Event> + Send + Sync + 'static,
{
    fn lease(&self) -> Ttl {
        self.inner.lease()
    }

    fn handle(
        &self,
        lease: &Lease,
        event: Self::Event,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        LeaseHandler::handle(&self.inner, lease, event)
    }
}
