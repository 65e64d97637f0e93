//! JSON Schema in Confluent's wire format: each record validated against
//! the schema its frame names (the registry's), then read by serde into
//! the handler's type; encoded with a schema registered under a subject.

use std::fmt;
use std::marker::PhantomData;

use dedup_core::decode::{ConfluentFrame, Prepare, PrepareFuture};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::client::{Registry, Schema, SchemaKind};
use crate::error::SchemaError;
use crate::known::{KnownSchemas, framed_id, ready_or, register_id};

/// Compiles a registered schema as JSON Schema, for schema id `id`, with
/// the schemas it refers to (fetched from their subjects, and theirs in
/// turn): a `$ref` is followed only to one of those, never fetched from
/// elsewhere.
async fn compile(
    registry: &Registry,
    id: u32,
    registered: &Schema,
) -> Result<jsonschema::Validator, SchemaError> {
    let unusable = |why: String| SchemaError::Schema {
        id,
        expected: "JSON",
        why,
    };
    if registered.kind != SchemaKind::Json {
        return Err(unusable(format!("it is a {} schema", registered.kind)));
    }
    let schema: serde_json::Value =
        serde_json::from_str(&registered.text).map_err(|e| unusable(e.to_string()))?;
    // Each reference under the URI its name resolves to, as the validator
    // resolves a `$ref` (against the schema's `$id`, or the default base).
    let base = schema
        .get("$id")
        .and_then(serde_json::Value::as_str)
        .and_then(|id| jsonschema::uri::from_str(id).ok());
    let mut by_uri = std::collections::HashMap::new();
    for (name, text) in
        crate::known::referenced(registry, id, "JSON", &registered.references).await?
    {
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| unusable(format!("its reference {name}: {e}")))?;
        let resolved = [
            jsonschema::uri::from_str(&name).ok(),
            base.as_ref()
                .and_then(|base| jsonschema::uri::resolve_against(&base.borrow(), &name).ok()),
        ];
        for uri in resolved.into_iter().flatten() {
            by_uri.insert(uri.as_str().to_owned(), value.clone());
        }
    }
    jsonschema::options()
        .with_retriever(References(by_uri))
        .build(&schema)
        .map_err(|e| unusable(e.to_string()))
}

/// The schemas a registered JSON Schema refers to, by the URI each
/// reference's name resolves to: a `$ref` resolves to one of them exactly,
/// or to nothing; nothing is fetched.
struct References(std::collections::HashMap<String, serde_json::Value>);

impl jsonschema::Retrieve for References {
    fn retrieve(
        &self,
        uri: &jsonschema::Uri<String>,
    ) -> Result<serde_json::Value, Box<dyn std::error::Error + Send + Sync>> {
        self.0.get(uri.as_str()).cloned().ok_or_else(|| {
            format!("{uri} is not among the schema's references in the registry").into()
        })
    }
}

/// Decodes JSON Schema records of Confluent's wire format into `T`: the
/// record's JSON validated against the schema its id names, then read by
/// serde. As [`AvroDecoder`](crate::avro::AvroDecoder): fetching is
/// [`prepare`](JsonSchemaDecoder::prepare) (async), decoding synchronous.
pub struct JsonSchemaDecoder<T> {
    registry: Registry,
    known: KnownSchemas<jsonschema::Validator>,
    _event: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for JsonSchemaDecoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonSchemaDecoder")
            .field("registry", &self.registry)
            .finish()
    }
}

impl<T: DeserializeOwned> JsonSchemaDecoder<T> {
    /// A decoder into `T` through `registry`.
    pub fn new(registry: Registry) -> Self {
        JsonSchemaDecoder {
            registry,
            known: KnownSchemas::new(),
            _event: PhantomData,
        }
    }

    /// Makes sure the schema `payload` names is compiled, asking the
    /// registry if it is not; returns the schema id. Faults as
    /// [`AvroDecoder::prepare`](crate::avro::AvroDecoder::prepare)'s.
    pub async fn prepare(&self, payload: &[u8]) -> Result<u32, SchemaError> {
        self.known
            .prepare(&self.registry, payload, |id, registered| async move {
                compile(&self.registry, id, &registered).await
            })
            .await
    }

    /// Decodes a record whose schema [`prepare`](Self::prepare) fetched:
    /// its JSON, valid against the schema, read into `T`.
    pub fn decode(&self, payload: &[u8]) -> Result<T, SchemaError> {
        let frame = ConfluentFrame::parse(payload)?;
        let id = frame.schema_id;
        let validator = self.known.ready(id)?;
        let mismatch = |why: String| SchemaError::Mismatch { id, why };
        let value: serde_json::Value =
            serde_json::from_slice(frame.body).map_err(|e| mismatch(e.to_string()))?;
        if let Err(e) = validator.validate(&value) {
            return Err(mismatch(format!("{e} (at {})", e.instance_path())));
        }
        serde_json::from_value(value).map_err(|e| mismatch(e.to_string()))
    }

    /// [`prepare`](Self::prepare), then [`decode`](Self::decode).
    pub async fn decode_fetching(&self, payload: &[u8]) -> Result<T, SchemaError> {
        self.prepare(payload).await?;
        self.decode(payload)
    }
}

impl<T: DeserializeOwned + Send + 'static> Prepare for JsonSchemaDecoder<T> {
    fn prepare<'a>(&'a self, payload: &'a [u8]) -> PrepareFuture<'a> {
        Box::pin(async move { ready_or(JsonSchemaDecoder::prepare(self, payload).await) })
    }

    fn schema_id(&self, payload: &[u8]) -> Option<u32> {
        framed_id(payload)
    }
}

/// Encodes `T` as JSON in Confluent's wire format, with a JSON Schema
/// registered under a subject (found or registered once), each value
/// checked against it before it is sent.
pub struct JsonSchemaEncoder<T> {
    id: u32,
    validator: jsonschema::Validator,
    _value: PhantomData<fn(&T)>,
}

impl<T> fmt::Debug for JsonSchemaEncoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonSchemaEncoder")
            .field("schema_id", &self.id)
            .finish()
    }
}

impl<T: Serialize> JsonSchemaEncoder<T> {
    /// Registers `schema` (a JSON Schema's text) under `subject`.
    pub async fn register(
        registry: &Registry,
        subject: &str,
        schema: &str,
    ) -> Result<Self, SchemaError> {
        let registered = Schema::new(SchemaKind::Json, schema);
        let id = register_id(registry, subject, &registered).await?;
        let validator =
            compile(registry, id, &registered)
                .await
                .map_err(|e| SchemaError::Encode {
                    id,
                    why: e.to_string(),
                })?;
        Ok(JsonSchemaEncoder {
            id,
            validator,
            _value: PhantomData,
        })
    }

    /// The schema id the records carry.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// `value` as JSON, framed, after checking it against the schema.
    pub fn encode(&self, value: &T) -> Result<Vec<u8>, SchemaError> {
        let encode = |why: String| SchemaError::Encode { id: self.id, why };
        let json = serde_json::to_value(value).map_err(|e| encode(e.to_string()))?;
        if let Err(e) = self.validator.validate(&json) {
            return Err(encode(format!("{e} (at {})", e.instance_path())));
        }
        let mut out = vec![0];
        out.extend_from_slice(&self.id.to_be_bytes());
        serde_json::to_writer(&mut out, &json).map_err(|e| encode(e.to_string()))?;
        Ok(out)
    }
}
