//! Avro in Confluent's wire format: decoded with the writer's schema (the
//! registry's, by the id the record carries) resolved to the reader's (the
//! handler's type), so that a record written with an older or newer schema
//! still reads; encoded with a schema registered under a subject.

use std::fmt;
use std::marker::PhantomData;

use apache_avro::schema_compatibility::SchemaCompatibility;
use dedup_core::decode::{ConfluentFrame, Prepare, PrepareFuture};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use apache_avro::{AvroSchema, Schema as AvroSchemaText};

use crate::client::{Registry, Schema, SchemaKind};
use crate::error::SchemaError;
pub use crate::known::REFUSAL_KEPT;
use crate::known::{KnownSchemas, framed_id, lookup_id, ready_or, referenced, register_id};

/// A writer's schema, parsed, with the named schemas it refers to.
struct Writer {
    schema: apache_avro::Schema,
    named: Vec<apache_avro::Schema>,
}

/// Decodes Avro records of Confluent's wire format into `T`.
///
/// The writer's schema of each schema id is fetched once
/// ([`prepare`](AvroDecoder::prepare), async: the registry may be down,
/// which is an outage) and kept; [`decode`](AvroDecoder::decode) is then
/// synchronous and depends on nothing but the record. The reader's schema
/// is `T`'s ([`AvroSchema`], derived with the `derive` feature), and Avro's
/// schema resolution reads a record written with an evolved schema: a
/// field the writer lacks takes the reader's default, a field the reader
/// lacks is skipped.
pub struct AvroDecoder<T> {
    registry: Registry,
    reader: apache_avro::Schema,
    writers: KnownSchemas<Writer>,
    _event: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for AvroDecoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let writers = self.writers.len();
        f.debug_struct("AvroDecoder")
            .field("registry", &self.registry)
            .field("writer_schemas", &writers)
            .finish()
    }
}

impl<T: DeserializeOwned + AvroSchema> AvroDecoder<T> {
    /// A decoder into `T`, with `T`'s schema as the reader's.
    pub fn new(registry: Registry) -> Self {
        Self::with_reader_schema(registry, T::get_schema())
    }
}

impl<T: DeserializeOwned> AvroDecoder<T> {
    /// A decoder into `T` with a reader's schema of your own (one parsed
    /// from an `.avsc` file with [`AvroSchemaText::parse_str`]).
    pub fn with_reader_schema(registry: Registry, reader: apache_avro::Schema) -> Self {
        AvroDecoder {
            registry,
            reader,
            writers: KnownSchemas::new(),
            _event: PhantomData,
        }
    }

    /// Makes sure the writer's schema of `payload` is at hand, asking the
    /// registry if it is not: returns the record's schema id. A payload
    /// without the frame, or whose id the registry does not know or holds
    /// no usable Avro schema, is the record's fault; a registry that cannot
    /// answer is an outage ([`SchemaError::fault`]).
    pub async fn prepare(&self, payload: &[u8]) -> Result<u32, SchemaError> {
        self.writers
            .prepare(&self.registry, payload, |id, registered| async move {
                parse_writer(&self.registry, id, &registered).await
            })
            .await
    }

    /// Decodes a record whose writer's schema [`prepare`](Self::prepare)
    /// fetched. Synchronous: only the record can make it fail (a record
    /// whose schema was not prepared fails as an outage, to be retried).
    pub fn decode(&self, payload: &[u8]) -> Result<T, SchemaError> {
        let frame = ConfluentFrame::parse(payload)?;
        let id = frame.schema_id;
        let writer = self.writers.ready(id)?;
        let mut body = frame.body;
        let value = apache_avro::from_avro_datum_schemata(
            &writer.schema,
            writer.named.iter().collect(),
            &mut body,
            Some(&self.reader),
        )
        .map_err(|e| SchemaError::Mismatch {
            id,
            why: e.to_string(),
        })?;
        if !body.is_empty() {
            return Err(SchemaError::Mismatch {
                id,
                why: format!("{} bytes follow the record", body.len()),
            });
        }
        apache_avro::from_value::<T>(&value).map_err(|e| SchemaError::Mismatch {
            id,
            why: e.to_string(),
        })
    }

    /// [`prepare`](Self::prepare), then [`decode`](Self::decode).
    pub async fn decode_fetching(&self, payload: &[u8]) -> Result<T, SchemaError> {
        self.prepare(payload).await?;
        self.decode(payload)
    }
}

impl<T: DeserializeOwned + Send + 'static> Prepare for AvroDecoder<T> {
    /// Fetches the writer's schema a record names. A record that cannot be
    /// prepared for what it is (no frame, an unknown id) is left for
    /// [`decode`](AvroDecoder::decode) to refuse; a registry that cannot
    /// answer is an outage, one that refuses the credentials a
    /// configuration error.
    fn prepare<'a>(&'a self, payload: &'a [u8]) -> PrepareFuture<'a> {
        Box::pin(async move { ready_or(AvroDecoder::prepare(self, payload).await) })
    }

    fn schema_id(&self, payload: &[u8]) -> Option<u32> {
        framed_id(payload)
    }
}

/// Parses a registered schema as Avro, with the schemas it refers to
/// (fetched from their subjects, and theirs in turn).
async fn parse_writer(
    registry: &Registry,
    id: u32,
    registered: &Schema,
) -> Result<Writer, SchemaError> {
    let unusable = |why: String| SchemaError::Schema {
        id,
        expected: "Avro",
        why,
    };
    if registered.kind != SchemaKind::Avro {
        return Err(unusable(format!("it is a {} schema", registered.kind)));
    }
    let named_texts: Vec<String> = referenced(registry, id, "Avro", &registered.references)
        .await?
        .into_iter()
        .map(|(_, text)| text)
        .collect();
    let (schema, named) = apache_avro::Schema::parse_str_with_list(&registered.text, &named_texts)
        .map_err(|e| unusable(e.to_string()))?;
    Ok(Writer { schema, named })
}

/// Encodes `T` as Avro in Confluent's wire format, with one schema the
/// registry knows under a subject: found (or registered) once, when the
/// encoder is made, so that [`encode`](AvroEncoder::encode) is synchronous
/// and asks the registry nothing (a handler encodes inside its
/// transaction).
pub struct AvroEncoder<T> {
    id: u32,
    schema: apache_avro::Schema,
    _value: PhantomData<fn(&T)>,
}

impl<T> fmt::Debug for AvroEncoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AvroEncoder")
            .field("schema_id", &self.id)
            .finish()
    }
}

impl<T: Serialize + AvroSchema> AvroEncoder<T> {
    /// Registers `T`'s schema under `subject` (its id if the subject has it
    /// already): for a producer allowed to register. The registry refuses
    /// a schema that breaks the subject's compatibility rule (409), a
    /// configuration error.
    pub async fn register(registry: &Registry, subject: &str) -> Result<Self, SchemaError> {
        let schema = T::get_schema();
        let id = register_id(registry, subject, &registry_schema(&schema)?).await?;
        Ok(AvroEncoder {
            id,
            schema,
            _value: PhantomData,
        })
    }

    /// Finds `T`'s schema among `subject`'s versions, without registering
    /// it: for a producer whose schemas are registered by a deploy step.
    /// Not found is a configuration error ([`SchemaError::Unregistered`]).
    pub async fn lookup(registry: &Registry, subject: &str) -> Result<Self, SchemaError> {
        let schema = T::get_schema();
        let id = lookup_id(registry, subject, &registry_schema(&schema)?).await?;
        Ok(AvroEncoder {
            id,
            schema,
            _value: PhantomData,
        })
    }
}

impl<T: Serialize> AvroEncoder<T> {
    /// The schema id the records carry.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// `value` as Avro, framed: magic byte 0, the schema id, the record.
    pub fn encode(&self, value: &T) -> Result<Vec<u8>, SchemaError> {
        let mut out = Vec::with_capacity(64);
        out.push(0);
        out.extend_from_slice(&self.id.to_be_bytes());
        apache_avro::write_avro_datum_ref(&self.schema, value, &mut out).map_err(|e| {
            SchemaError::Encode {
                id: self.id,
                why: e.to_string(),
            }
        })?;
        Ok(out)
    }
}

fn registry_schema(schema: &apache_avro::Schema) -> Result<Schema, SchemaError> {
    let text = serde_json::to_string(schema).map_err(|e| SchemaError::Encode {
        id: 0,
        why: format!("cannot write the schema: {e}"),
    })?;
    Ok(Schema::new(SchemaKind::Avro, text))
}

/// Whether a reader's schema reads every version of a subject: what
/// `dedup check` reports before a deploy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Readability {
    /// The subject.
    pub subject: String,
    /// One line per version, oldest first.
    pub versions: Vec<VersionReadability>,
}

/// Whether a reader's schema reads one version of a subject.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionReadability {
    /// The version.
    pub version: i32,
    /// Its schema id.
    pub id: u32,
    /// `Ok` if readable, else why not (in the Avro library's words).
    pub readable: Result<(), String>,
}

impl Readability {
    /// Whether every version is readable.
    pub fn all_readable(&self) -> bool {
        self.versions.iter().all(|v| v.readable.is_ok())
    }
}

/// Checks that `reader` can read a record written with any version of
/// `subject` (Avro's schema resolution rules: a field the reader adds needs
/// a default, types may only be promoted).
pub async fn readability(
    registry: &Registry,
    subject: &str,
    reader: &apache_avro::Schema,
) -> Result<Readability, SchemaError> {
    let versions = registry
        .versions(subject)
        .await
        .map_err(|source| SchemaError::Registry { id: 0, source })?;
    let mut checked = Vec::with_capacity(versions.len());
    for version in versions {
        let registered = registry
            .version(subject, version)
            .await
            .map_err(|source| SchemaError::Registry { id: 0, source })?;
        let readable = match parse_writer(registry, registered.id, &registered.schema).await {
            Ok(writer) => {
                SchemaCompatibility::can_read(&writer.schema, reader).map_err(|e| e.to_string())
            }
            Err(SchemaError::Schema { why, .. }) => Err(why),
            Err(other) => return Err(other),
        };
        checked.push(VersionReadability {
            version,
            id: registered.id,
            readable,
        });
    }
    Ok(Readability {
        subject: subject.to_owned(),
        versions: checked,
    })
}
