//! What each schema id gave a decoder, shared by the formats: the parsed
//! schema (kept: an id never names another schema), or why its records are
//! refused (an id the registry does not know, a schema the decoder cannot
//! use), kept for [`REFUSAL_KEPT`] so that a burst of them asks the
//! registry once and a registry that was behind is asked again.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dedup_core::decode::{ConfluentFrame, Unready};

use crate::client::{Registry, Schema, SchemaReference};
use crate::error::{RegistryError, SchemaError};

/// How long a refused schema id is kept before the registry is asked again.
pub const REFUSAL_KEPT: Duration = Duration::from_secs(300);

enum Known<V> {
    Ready(Arc<V>),
    Refused(SchemaError, Instant),
}

impl<V> Clone for Known<V> {
    fn clone(&self) -> Self {
        match self {
            Known::Ready(schema) => Known::Ready(schema.clone()),
            Known::Refused(why, at) => Known::Refused(why.clone(), *at),
        }
    }
}

/// A decoder's schemas by id.
pub(crate) struct KnownSchemas<V> {
    by_id: Mutex<HashMap<u32, Known<V>>>,
}

impl<V> KnownSchemas<V> {
    pub(crate) fn new() -> Self {
        KnownSchemas {
            by_id: Mutex::new(HashMap::new()),
        }
    }

    /// Makes sure the schema `payload`'s frame names is at hand, if it is
    /// not asking `registry` for it and making it ready with `parse`: the
    /// record's schema id. A failure that is the record's fault is kept;
    /// an outage or a configuration error is not.
    pub(crate) async fn prepare<F, Fut>(
        &self,
        registry: &Registry,
        payload: &[u8],
        parse: F,
    ) -> Result<u32, SchemaError>
    where
        F: FnOnce(u32, Arc<Schema>) -> Fut,
        Fut: Future<Output = Result<V, SchemaError>>,
    {
        let id = ConfluentFrame::parse(payload)?.schema_id;
        match self.get(id) {
            Some(Known::Ready(_)) => return Ok(id),
            Some(Known::Refused(why, at)) if at.elapsed() < REFUSAL_KEPT => return Err(why),
            Some(Known::Refused(..)) | None => {}
        }
        let fetched = match registry.schema(id).await {
            Ok(registered) => parse(id, registered).await,
            Err(source) => Err(SchemaError::Registry { id, source }),
        };
        let known = match fetched {
            Ok(schema) => Known::Ready(Arc::new(schema)),
            Err(why) if why.fault() == crate::Fault::Record => Known::Refused(why, Instant::now()),
            Err(other) => return Err(other),
        };
        {
            let mut all = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
            if matches!(known, Known::Refused(..)) {
                // Junk ids do not pile up: refusals past their time go.
                all.retain(|_, k| match k {
                    Known::Ready(_) => true,
                    Known::Refused(_, at) => at.elapsed() < REFUSAL_KEPT,
                });
            }
            all.insert(id, known.clone());
        }
        match known {
            Known::Ready(_) => Ok(id),
            Known::Refused(why, _) => Err(why),
        }
    }

    /// The schema of `id` that [`prepare`](Self::prepare) made ready, or
    /// why its records are refused. One never prepared is not the record's
    /// fault: an outage, retried.
    pub(crate) fn ready(&self, id: u32) -> Result<Arc<V>, SchemaError> {
        match self.get(id) {
            Some(Known::Ready(schema)) => Ok(schema),
            Some(Known::Refused(why, _)) => Err(why),
            None => Err(SchemaError::Registry {
                id,
                source: RegistryError::Unavailable(
                    "its schema was not fetched (prepare the record first)".to_owned(),
                ),
            }),
        }
    }

    /// How many schema ids it knows of.
    pub(crate) fn len(&self) -> usize {
        self.by_id.lock().map(|all| all.len()).unwrap_or(0)
    }

    fn get(&self, id: u32) -> Option<Known<V>> {
        self.by_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }
}

/// The schema id a payload's frame names, if it has the frame.
pub(crate) fn framed_id(payload: &[u8]) -> Option<u32> {
    ConfluentFrame::parse(payload)
        .ok()
        .map(|frame| frame.schema_id)
}

/// A decoder's `prepare` as dedup-core's `Prepare` says it: a record's
/// fault is left for `decode` to refuse; an outage or a configuration
/// error is not ready.
pub(crate) fn ready_or(prepared: Result<u32, SchemaError>) -> Result<(), Unready> {
    match prepared {
        Ok(_) => Ok(()),
        Err(e) => match e.fault() {
            crate::Fault::Record => Ok(()),
            crate::Fault::Outage => Err(Unready::Outage(Box::new(e))),
            crate::Fault::Configuration => Err(Unready::Configuration(Box::new(e))),
        },
    }
}

/// The schemas `references` name, and those they name, each once: the
/// name the referring schema uses, and the text.
///
/// A reference the registry does not have is not the record's fault (the
/// registry served the schema that names it): [`SchemaError::Unreadable`].
pub(crate) async fn referenced(
    registry: &Registry,
    id: u32,
    format: &'static str,
    references: &[SchemaReference],
) -> Result<Vec<(String, String)>, SchemaError> {
    let mut pending: Vec<SchemaReference> = references.to_vec();
    let mut fetched: HashMap<(String, i32), String> = HashMap::new();
    let mut named = std::collections::HashSet::new();
    let mut texts = Vec::new();
    while let Some(reference) = pending.pop() {
        let at = (reference.subject.clone(), reference.version);
        let text = match fetched.get(&at) {
            Some(text) => text.clone(),
            None => {
                let version = registry
                    .version(&reference.subject, reference.version)
                    .await
                    .map_err(|source| match source {
                        RegistryError::NotFound { .. } => SchemaError::Unreadable {
                            id,
                            format,
                            why: format!(
                                "its reference {:?} ({} version {}) is not in the registry: {source}",
                                reference.name, reference.subject, reference.version
                            ),
                        },
                        source => SchemaError::Registry { id, source },
                    })?;
                pending.extend(version.schema.references.iter().cloned());
                fetched.insert(at, version.schema.text.clone());
                version.schema.text
            }
        };
        // One version may be named two ways (by two schemas): both names.
        if named.insert(reference.name.clone()) {
            texts.push((reference.name, text));
        }
    }
    Ok(texts)
}

/// Registers `schema` under `subject` for an encoder: its id (the one it
/// has if the subject has it already).
pub(crate) async fn register_id(
    registry: &Registry,
    subject: &str,
    schema: &Schema,
) -> Result<u32, SchemaError> {
    registry
        .register(subject, schema)
        .await
        .map_err(|source| SchemaError::Registry { id: 0, source })
}

/// Finds `schema` among `subject`'s versions for an encoder that may not
/// register: its id, or [`SchemaError::Unregistered`].
pub(crate) async fn lookup_id(
    registry: &Registry,
    subject: &str,
    schema: &Schema,
) -> Result<u32, SchemaError> {
    let found = registry
        .lookup(subject, schema)
        .await
        .map_err(|source| SchemaError::Registry { id: 0, source })?;
    found
        .map(|version| version.id)
        .ok_or_else(|| SchemaError::Unregistered {
            subject: subject.to_owned(),
        })
}
