#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// The Apache Avro library dedup-registry is built with (0.21): its
/// `AvroSchema` derive (feature `derive`) writes paths from
/// `apache_avro::`, so a module deriving it imports this
/// (`use dedup_registry::apache_avro;`) or depends on the same release.
pub use apache_avro;
/// The prost release dedup-registry decodes Protobuf with (0.14): the
/// handler's event types implement its `Message` and `Name`.
pub use prost;

mod answer;
pub mod avro;
mod client;
mod error;
mod handler;
pub mod json;
mod known;
mod proto;
pub mod protobuf;

pub use client::{
    DEFAULT_TIMEOUT, Registry, RegistryBuilder, Schema, SchemaKind, SchemaReference, SubjectVersion,
};
pub use error::{Fault, RegistryError, SchemaError};
pub use handler::{AvroHandler, JsonSchemaHandler, ProtobufHandler, SchemaDecoder, SchemaHandler};
