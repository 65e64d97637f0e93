//! Protobuf in Confluent's wire format: each record's message indexes
//! placed in the `.proto` file the registry holds for its schema id, the
//! type they name checked against the handler's (prost's [`Name`]), then
//! the body decoded by prost; encoded with a `.proto` registered under a
//! subject.
//!
//! Protobuf evolves by field numbers: a field added or removed reads in
//! both directions without the writer's schema, so the registry's file is
//! used to know what a record is, not to read it.

use std::fmt;
use std::marker::PhantomData;

use dedup_core::decode::{ConfluentFrame, Prepare, PrepareFuture};
use prost::{Message, Name};

use crate::client::{Registry, Schema, SchemaKind};
use crate::error::SchemaError;
use crate::known::{KnownSchemas, framed_id, lookup_id, ready_or, register_id};
use crate::proto::{Numbering, ProtoFile};

/// Reads a registered schema as a `.proto` file, for schema id `id`.
fn parse(id: u32, registered: &Schema) -> Result<ProtoFile, SchemaError> {
    let unusable = |why: String| SchemaError::Schema {
        id,
        expected: "Protobuf",
        why,
    };
    if registered.kind != SchemaKind::Protobuf {
        return Err(unusable(format!("it is a {} schema", registered.kind)));
    }
    // The registry accepted the file: if dedup's reader cannot read it,
    // that is dedup's limit, not the record's (nothing is dead-lettered).
    ProtoFile::parse(&registered.text).map_err(|why| SchemaError::Unreadable {
        id,
        format: "Protobuf",
        why,
    })
}

/// Decodes Protobuf records of Confluent's wire format into `T`, a prost
/// message with its full name ([`Name`]: prost-build's
/// `enable_type_names()`, or an `impl` of your own).
///
/// Each schema id's `.proto` file is fetched once
/// ([`prepare`](ProtobufDecoder::prepare), async: the registry may be
/// down, an outage) and kept; [`decode`](ProtobufDecoder::decode) is then
/// synchronous. A record whose message indexes name another type than
/// `T` (another message of the same file, or of another file), or none,
/// is the record's fault, as are bytes prost cannot read.
pub struct ProtobufDecoder<T> {
    registry: Registry,
    files: KnownSchemas<ProtoFile>,
    _event: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for ProtobufDecoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtobufDecoder")
            .field("registry", &self.registry)
            .field("schemas", &self.files.len())
            .finish()
    }
}

impl<T: Message + Default + Name> ProtobufDecoder<T> {
    /// A decoder into `T` through `registry`.
    pub fn new(registry: Registry) -> Self {
        ProtobufDecoder {
            registry,
            files: KnownSchemas::new(),
            _event: PhantomData,
        }
    }

    /// Makes sure the `.proto` file `payload`'s schema id names is at
    /// hand, asking the registry if it is not; returns the schema id.
    /// Faults as [`AvroDecoder::prepare`](crate::avro::AvroDecoder::prepare)'s.
    pub async fn prepare(&self, payload: &[u8]) -> Result<u32, SchemaError> {
        self.files
            .prepare(&self.registry, payload, |id, registered| async move {
                parse(id, &registered)
            })
            .await
    }

    /// Decodes a record whose schema [`prepare`](Self::prepare) fetched.
    pub fn decode(&self, payload: &[u8]) -> Result<T, SchemaError> {
        let frame = ConfluentFrame::parse_protobuf(payload)?;
        let id = frame.schema_id;
        let file = self.files.ready(id)?;
        let mismatch = |why: String| SchemaError::Mismatch { id, why };
        let indexes = &frame.message_indexes;
        let expected = T::full_name();
        // Serializers count a message's nested types two ways (with or
        // without map entries and groups): the indexes are taken either
        // way, unless the two ways name two different types.
        let by_descriptor = file.full_name(indexes, Numbering::Descriptor);
        let by_declared = file.full_name(indexes, Numbering::Declared);
        let name = match (by_descriptor, by_declared) {
            (Some(a), Some(b)) if a != b => {
                return Err(mismatch(format!(
                    "its message indexes {indexes:?} name {a} as protoc counts the schema's \
                     types and {b} as Confluent's Java client counts them (without map \
                     entries and groups), so which type it is cannot be told; declare nested \
                     messages before map fields and groups, or make the type top-level"
                )));
            }
            (Some(name), _) | (None, Some(name)) => name,
            (None, None) => {
                return Err(mismatch(format!(
                    "its message indexes {indexes:?} name no message type of the schema"
                )));
            }
        };
        if name != expected {
            return Err(mismatch(format!(
                "it is a {name}, and the handler reads {expected}"
            )));
        }
        T::decode(frame.body).map_err(|e| mismatch(format!("{expected}: {e}")))
    }

    /// [`prepare`](Self::prepare), then [`decode`](Self::decode).
    pub async fn decode_fetching(&self, payload: &[u8]) -> Result<T, SchemaError> {
        self.prepare(payload).await?;
        self.decode(payload)
    }
}

impl<T: Message + Default + Name + 'static> Prepare for ProtobufDecoder<T> {
    fn prepare<'a>(&'a self, payload: &'a [u8]) -> PrepareFuture<'a> {
        Box::pin(async move { ready_or(ProtobufDecoder::prepare(self, payload).await) })
    }

    fn schema_id(&self, payload: &[u8]) -> Option<u32> {
        framed_id(payload)
    }
}

/// Encodes `T` as Protobuf in Confluent's wire format: the schema id of a
/// `.proto` file the registry holds under a subject (found or registered
/// once, when the encoder is made) and `T`'s message indexes in it, so
/// that [`encode`](ProtobufEncoder::encode) asks the registry nothing.
pub struct ProtobufEncoder<T> {
    id: u32,
    /// Magic byte, schema id and message indexes: every record's start.
    prefix: Vec<u8>,
    _value: PhantomData<fn(&T)>,
}

impl<T> fmt::Debug for ProtobufEncoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtobufEncoder")
            .field("schema_id", &self.id)
            .finish()
    }
}

impl<T: Message + Name> ProtobufEncoder<T> {
    /// Registers `proto` (the text of the `.proto` file that declares `T`,
    /// without imports: a file that imports others is registered with its
    /// references by a deploy step, then found with
    /// [`lookup`](Self::lookup)) under `subject`.
    pub async fn register(
        registry: &Registry,
        subject: &str,
        proto: &str,
    ) -> Result<Self, SchemaError> {
        let schema = Schema::new(SchemaKind::Protobuf, proto);
        let indexes = indexes_of::<T>(&schema)?;
        let id = register_id(registry, subject, &schema).await?;
        Ok(Self::with(id, &indexes))
    }

    /// Finds `schema` (a `.proto` file with its references) among
    /// `subject`'s versions without registering it. Not found is a
    /// configuration error ([`SchemaError::Unregistered`]).
    pub async fn lookup(
        registry: &Registry,
        subject: &str,
        schema: &Schema,
    ) -> Result<Self, SchemaError> {
        let indexes = indexes_of::<T>(schema)?;
        let id = lookup_id(registry, subject, schema).await?;
        Ok(Self::with(id, &indexes))
    }

    fn with(id: u32, indexes: &[i32]) -> Self {
        let mut prefix = vec![0];
        prefix.extend_from_slice(&id.to_be_bytes());
        if indexes == [0] {
            // The format's short form for the file's first message.
            prefix.push(0);
        } else {
            zigzag(&mut prefix, indexes.len() as i64);
            for &index in indexes {
                zigzag(&mut prefix, i64::from(index));
            }
        }
        ProtobufEncoder {
            id,
            prefix,
            _value: PhantomData,
        }
    }

    /// The schema id the records carry.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// `value`, framed: magic byte 0, the schema id, `T`'s message indexes,
    /// the message.
    pub fn encode(&self, value: &T) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.prefix.len() + value.encoded_len());
        out.extend_from_slice(&self.prefix);
        // `encode_raw` panics only on a buffer that cannot grow: a Vec grows.
        value.encode_raw(&mut out);
        out
    }
}

/// Where `T` stands among the message types of `schema`'s file.
fn indexes_of<T: Name>(schema: &Schema) -> Result<Vec<i32>, SchemaError> {
    let encode = |why: String| SchemaError::Encode { id: 0, why };
    let file = ProtoFile::parse(&schema.text).map_err(encode)?;
    let name = T::full_name();
    if file.indexes(&name, Numbering::Descriptor).is_none() {
        return Err(encode(format!("the .proto file does not declare {name}")));
    }
    file.unambiguous_indexes(&name).ok_or_else(|| {
        encode(format!(
            "no message indexes name {name} both as protoc and as Confluent's Java client count \
             the file's types (map fields or groups before nested messages): declare nested \
             messages first, or make the type top-level"
        ))
    })
}

/// `n` as a zig-zag varint, as the frame's message indexes are written.
fn zigzag(out: &mut Vec<u8>, n: i64) {
    let mut v = ((n << 1) ^ (n >> 63)) as u64;
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[cfg(test)]
mod tests {
    use dedup_core::decode::ConfluentFrame;

    #[test]
    fn frames_carry_the_message_indexes_the_decoder_reads() {
        #[derive(Clone, PartialEq, prost::Message)]
        struct Empty {}
        impl prost::Name for Empty {
            const NAME: &'static str = "Empty";
            const PACKAGE: &'static str = "";
        }
        for indexes in [vec![0], vec![1], vec![0, 2], vec![3, 70, 1]] {
            let encoder = super::ProtobufEncoder::<Empty>::with(7, &indexes);
            let payload = encoder.encode(&Empty {});
            let frame = ConfluentFrame::parse_protobuf(&payload).unwrap();
            assert_eq!((frame.schema_id, frame.message_indexes), (7, indexes));
            assert!(frame.body.is_empty());
        }
        let short = super::ProtobufEncoder::<Empty>::with(7, &[0]);
        assert_eq!(short.encode(&Empty {}), [0, 0, 0, 0, 7, 0]);
    }
}
