//! What can go wrong, sorted by whose fault it is: the record's (it goes to
//! the dead-letter topic), the environment's (an outage, waited out) or the
//! configuration's (the consumer stops and says what to fix).

use dedup_core::decode::FrameError;

/// Whose fault a failure is, which decides what a consumer does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The record's own: a payload without the wire format's frame, a schema
    /// id the registry does not know, bytes that do not match their schema.
    /// Retrying cannot help: the record is dead-lettered with the reason.
    Record,
    /// The environment's: the registry is unreachable, slow, or answers 5xx
    /// or 429. Nothing is wrong with the record: it is waited out.
    Outage,
    /// The configuration's: the registry refuses the credentials (401) or
    /// their rights (403), its certificate cannot be verified, or it rejects
    /// a schema dedup registers. Waiting cannot help and no record is to
    /// blame: the consumer stops with the reason.
    Configuration,
}

/// A request to the registry that failed. Never holds a credential.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry has no such schema, subject or version (HTTP 404 with
    /// the registry's error code: a 404 without one is a URL that is not
    /// the registry's API, [`Rejected`](RegistryError::Rejected)).
    #[error("the schema registry has no {what} ({message})")]
    NotFound {
        /// What was asked for: `schema id 7`, `subject payments-value`...
        what: String,
        /// The registry's own words, with its error code.
        message: String,
    },
    /// The registry refused the credentials (401) or what they may do (403).
    #[error(
        "the schema registry refused {what}: HTTP {status} ({message}); check the registry's \
         user and password or token, and that they may read (and, to register schemas, write) \
         its subjects"
    )]
    Refused {
        /// What was asked for.
        what: String,
        /// 401 or 403.
        status: u16,
        /// The registry's own words.
        message: String,
    },
    /// The registry's certificate cannot be verified: another CA, another
    /// host, expired. A configuration error, not an outage.
    #[error(
        "the schema registry's certificate cannot be verified ({0}); give the CA that signed it \
         (ca_file), and check the URL's host and the certificate's dates"
    )]
    Certificate(String),
    /// The registry cannot be reached, is slow, or answers 5xx or 429: an
    /// outage.
    #[error("the schema registry is unavailable: {0}")]
    Unavailable(String),
    /// The registry rejected a request: a schema it finds invalid (422) or
    /// incompatible with the subject's earlier versions (409), another 4xx.
    #[error("the schema registry rejected {what}: HTTP {status} ({message})")]
    Rejected {
        /// What was asked for.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The registry's own words.
        message: String,
    },
    /// The registry holds a schema of a type dedup does not read (Apicurio
    /// keeps OpenAPI, XML...): for a record that names it, the record's
    /// fault.
    #[error("the schema registry's {what} is of type {schema_type}, not AVRO, JSON or PROTOBUF")]
    Unsupported {
        /// What was asked for.
        what: String,
        /// The registry's `schemaType`.
        schema_type: String,
    },
    /// The registry's settings are not usable (a URL that is not one, a CA
    /// file without a certificate).
    #[error("the schema registry's settings: {0}")]
    Settings(String),
}

impl RegistryError {
    /// Whose fault the failure is when a consumer asked for the writer's
    /// schema of a record: a schema id the registry does not know is the
    /// record's.
    pub fn fault(&self) -> Fault {
        match self {
            RegistryError::NotFound { .. } | RegistryError::Unsupported { .. } => Fault::Record,
            RegistryError::Unavailable(_) => Fault::Outage,
            RegistryError::Refused { .. }
            | RegistryError::Certificate(_)
            | RegistryError::Rejected { .. }
            | RegistryError::Settings(_) => Fault::Configuration,
        }
    }
}

/// A record that could not be decoded, or a value that could not be
/// encoded, with whose fault it is ([`SchemaError::fault`]).
#[derive(Clone, Debug, thiserror::Error)]
pub enum SchemaError {
    /// The payload has no frame of Confluent's wire format (magic byte 0,
    /// then the schema id).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// Fetching the writer's schema (or, to encode, the subject's) failed.
    #[error("schema id {id}: {source}")]
    Registry {
        /// The schema id the record names (0 when encoding).
        id: u32,
        /// Why.
        #[source]
        source: RegistryError,
    },
    /// The registry's schema of this id is not one this codec reads (a
    /// Protobuf schema where Avro is expected) or does not parse.
    #[error("schema id {id} is not a usable {expected} schema: {why}")]
    Schema {
        /// The schema id.
        id: u32,
        /// The format the codec reads.
        expected: &'static str,
        /// Why.
        why: String,
    },
    /// The registry's schema of this id is of the codec's format, but
    /// dedup cannot read it (a `.proto` file its reader gets wrong): not
    /// the record's fault, so nothing is dead-lettered; the consumer stops
    /// and names the schema.
    #[error(
        "schema id {id} is a {format} schema that dedup cannot read ({why}); its records are not \
         dead-lettered: please report the schema"
    )]
    Unreadable {
        /// The schema id.
        id: u32,
        /// The format.
        format: &'static str,
        /// Why.
        why: String,
    },
    /// The record's bytes do not match its schema, or the schema cannot be
    /// resolved to the handler's type (a field it needs that the writer
    /// did not have and that has no default).
    #[error("the record does not match schema id {id}: {why}")]
    Mismatch {
        /// The schema id the record names.
        id: u32,
        /// Why, in the Avro library's words.
        why: String,
    },
    /// The subject has no version that is the encoder's schema, and the
    /// encoder may not register it.
    #[error(
        "subject {subject:?} has no version with this schema: register it (a deploy step, or \
         an encoder made with register)"
    )]
    Unregistered {
        /// The subject.
        subject: String,
    },
    /// A value to encode does not fit the schema it is encoded with.
    #[error("the value does not fit schema id {id}: {why}")]
    Encode {
        /// The schema id.
        id: u32,
        /// Why.
        why: String,
    },
}

impl SchemaError {
    /// Whose fault it is (see [`Fault`]).
    pub fn fault(&self) -> Fault {
        match self {
            SchemaError::Frame(_) | SchemaError::Schema { .. } | SchemaError::Mismatch { .. } => {
                Fault::Record
            }
            SchemaError::Registry { source, .. } => source.fault(),
            SchemaError::Unregistered { .. }
            | SchemaError::Encode { .. }
            | SchemaError::Unreadable { .. } => Fault::Configuration,
        }
    }

    /// The schema id the record names, where it has one.
    pub fn schema_id(&self) -> Option<u32> {
        match self {
            SchemaError::Frame(_) | SchemaError::Unregistered { .. } => None,
            SchemaError::Registry { id, .. }
            | SchemaError::Schema { id, .. }
            | SchemaError::Mismatch { id, .. }
            | SchemaError::Unreadable { id, .. }
            | SchemaError::Encode { id, .. } => Some(*id),
        }
    }
}

impl From<SchemaError> for dedup_core::Error {
    /// The record's fault is [`dedup_core::Error::Decode`]: dead-lettered.
    /// Anything else is never the record's to carry: an environment error,
    /// waited out (a runtime makes the decoder ready first, so a decode
    /// meets it only if that step was skipped).
    fn from(error: SchemaError) -> Self {
        match error.fault() {
            Fault::Record => dedup_core::Error::Decode(Box::new(error)),
            Fault::Outage | Fault::Configuration => {
                dedup_core::Error::Store(dedup_core::StoreError::environment(error))
            }
        }
    }
}
