//! A client of the schema registry's REST API as Confluent Schema Registry
//! defines it, which Apicurio (`/apis/ccompat/v6`), Karapace and Redpanda
//! serve too: schemas by id (cached for ever: an id's schema never
//! changes), a subject's versions, registering and looking up a schema.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use crate::answer::send;
use crate::error::RegistryError;

/// How long one request may take before the registry counts as slow (an
/// outage), unless [`RegistryBuilder::timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The format of a registered schema (`schemaType`; Avro when absent).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SchemaKind {
    /// Apache Avro.
    #[serde(rename = "AVRO")]
    Avro,
    /// JSON Schema.
    #[serde(rename = "JSON")]
    Json,
    /// Protocol Buffers.
    #[serde(rename = "PROTOBUF")]
    Protobuf,
}

impl SchemaKind {
    /// The registry's name of the format: `AVRO`, `JSON`, `PROTOBUF`.
    pub fn as_str(self) -> &'static str {
        match self {
            SchemaKind::Avro => "AVRO",
            SchemaKind::Json => "JSON",
            SchemaKind::Protobuf => "PROTOBUF",
        }
    }
}

impl fmt::Display for SchemaKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A schema another one refers to by name: version `version` of `subject`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaReference {
    /// The name the referring schema uses (an Avro full name, a `.proto`
    /// file name).
    pub name: String,
    /// The subject it is registered under.
    pub subject: String,
    /// Its version there.
    pub version: i32,
}

/// A schema as the registry keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    /// Its format.
    pub kind: SchemaKind,
    /// Its text: Avro's JSON, a JSON Schema, a `.proto` file.
    pub text: String,
    /// The schemas it refers to.
    pub references: Vec<SchemaReference>,
}

impl Schema {
    /// A schema of `kind` with this text and no references.
    pub fn new(kind: SchemaKind, text: impl Into<String>) -> Self {
        Schema {
            kind,
            text: text.into(),
            references: Vec::new(),
        }
    }
}

/// One version of a subject.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubjectVersion {
    /// The subject.
    pub subject: String,
    /// The version, from 1.
    pub version: i32,
    /// The schema's id (the one records carry).
    pub id: u32,
    /// The schema.
    pub schema: Schema,
}

/// The registry's JSON for a schema (by id, or one version of a subject).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaJson {
    schema: String,
    #[serde(default)]
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<SchemaReference>,
    #[serde(default)]
    subject: Option<String>,
    #[serde(default)]
    version: Option<i32>,
    #[serde(default)]
    id: Option<u32>,
}

impl SchemaJson {
    /// The schema, if its `schemaType` is one of the three formats (a
    /// registry may keep others: Apicurio's OpenAPI, XML...).
    fn schema(self, what: &str) -> Result<Schema, RegistryError> {
        let kind = match self.schema_type.as_deref() {
            None | Some("AVRO") => SchemaKind::Avro,
            Some("JSON") => SchemaKind::Json,
            Some("PROTOBUF") => SchemaKind::Protobuf,
            Some(other) => {
                return Err(RegistryError::Unsupported {
                    what: what.to_owned(),
                    schema_type: other.to_owned(),
                });
            }
        };
        Ok(Schema {
            kind,
            text: self.schema,
            references: self.references,
        })
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct NewSchemaJson<'a> {
    schema: &'a str,
    // Avro is the default: leave it out, as Confluent's clients do (some
    // registries refuse an explicit AVRO).
    #[serde(skip_serializing_if = "Option::is_none")]
    schema_type: Option<SchemaKind>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    references: &'a [SchemaReference],
}

#[derive(Deserialize)]
struct RegisteredJson {
    id: u32,
}

/// How the client proves who it is.
#[derive(Clone)]
enum Auth {
    None,
    Basic { user: String, password: String },
    Bearer(String),
}

/// Builds a [`Registry`]. `Debug` shows the URL and the kind of
/// credentials, never a password or token.
pub struct RegistryBuilder {
    url: String,
    auth: Auth,
    roots: Vec<reqwest::Certificate>,
    timeout: Duration,
    error: Option<RegistryError>,
}

impl fmt::Debug for RegistryBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryBuilder")
            .field("url", &self.url)
            .field("auth", &auth_kind(&self.auth))
            .field("extra_roots", &self.roots.len())
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn auth_kind(auth: &Auth) -> String {
    match auth {
        Auth::None => "none".to_owned(),
        Auth::Basic { user, .. } => format!("basic (user {user:?})"),
        Auth::Bearer(_) => "bearer".to_owned(),
    }
}

impl RegistryBuilder {
    /// HTTP basic auth: a user and password, or a Confluent Cloud API key
    /// and secret.
    pub fn basic_auth(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.auth = Auth::Basic {
            user: user.into(),
            password: password.into(),
        };
        self
    }

    /// A bearer token (an OAuth access token the registry accepts).
    pub fn bearer_token(mut self, token: impl Into<String>) -> Self {
        self.auth = Auth::Bearer(token.into());
        self
    }

    /// Trusts also the CA certificates in the PEM file `path` (a registry
    /// with a certificate of a private CA); the system's CAs stay trusted.
    pub fn ca_file(mut self, path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        let read = std::fs::read(path)
            .map_err(|e| format!("the CA file {} cannot be read: {e}", path.display()))
            .and_then(|pem| {
                reqwest::Certificate::from_pem_bundle(&pem)
                    .ok()
                    .filter(|certificates| !certificates.is_empty())
                    .ok_or_else(|| {
                        format!("the CA file {} holds no PEM certificate", path.display())
                    })
            });
        match read {
            Ok(certificates) => self.roots.extend(certificates),
            Err(why) => self.error = Some(RegistryError::Settings(why)),
        }
        self
    }

    /// How long one request may take before the registry counts as slow
    /// (an outage). Default [`DEFAULT_TIMEOUT`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The client. Fails on settings that cannot work: a URL that is not
    /// one, or not `https` (plain `http` only to this machine: credentials
    /// would cross in clear), a CA file without a certificate.
    pub fn build(self) -> Result<Registry, RegistryError> {
        if let Some(error) = self.error {
            return Err(error);
        }
        let trimmed = self.url.trim_end_matches('/');
        let mut base = reqwest::Url::parse(&format!("{trimmed}/")).map_err(|e| {
            RegistryError::Settings(format!(
                "{:?} is not a URL: {e}",
                without_userinfo(&self.url)
            ))
        })?;
        let mut auth = self.auth;
        if !base.username().is_empty() {
            // user:password@host: basic auth (unless given otherwise),
            // never kept in the URL, which errors and Debug show.
            if matches!(auth, Auth::None) {
                auth = Auth::Basic {
                    user: base.username().to_owned(),
                    password: base.password().unwrap_or_default().to_owned(),
                };
            }
            let _ = base.set_username("");
            let _ = base.set_password(None);
        }
        let loopback = is_loopback(&base);
        match base.scheme() {
            "https" => {}
            "http" if loopback => {}
            _ => {
                return Err(RegistryError::Settings(format!(
                    "{:?} is not https (plain http only to localhost)",
                    base.as_str()
                )));
            }
        }
        let mut http = reqwest::Client::builder()
            // A registry's API does not redirect: a 3xx is a wrong URL
            // (a configuration error), never followed with the credentials.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(self.timeout)
            .connect_timeout(self.timeout.min(Duration::from_secs(5)));
        if loopback {
            http = http.no_proxy();
        }
        for root in self.roots {
            http = http.add_root_certificate(root);
        }
        let http = http
            .build()
            .map_err(|e| RegistryError::Settings(format!("cannot make the HTTP client: {e}")))?;
        Ok(Registry {
            inner: Arc::new(Inner {
                base,
                http,
                auth,
                by_id: Mutex::new(HashMap::new()),
            }),
        })
    }
}

/// A schema registry's client: cheap to clone (clones share the cache and
/// the connections).
///
/// ```no_run
/// # async fn f() -> Result<(), dedup_registry::RegistryError> {
/// let registry = dedup_registry::Registry::builder("https://registry.example.com")
///     .basic_auth("api-key", std::env::var("REGISTRY_SECRET").unwrap_or_default())
///     .build()?;
/// let schema = registry.schema(7).await?;
/// println!("schema 7 is {}", schema.kind);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

struct Inner {
    base: reqwest::Url,
    http: reqwest::Client,
    auth: Auth,
    /// Schemas by id, each fetched once however many ask at the same time;
    /// a failed fetch leaves its cell empty for the next one to try.
    by_id: Mutex<HashMap<u32, Arc<OnceCell<Arc<Schema>>>>>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("url", &self.inner.base.as_str())
            .field("auth", &auth_kind(&self.inner.auth))
            .finish()
    }
}

impl Registry {
    /// A client of the registry at `url` (for Apicurio, its
    /// Confluent-compatible API: `https://host/apis/ccompat/v6`).
    pub fn builder(url: impl Into<String>) -> RegistryBuilder {
        RegistryBuilder {
            url: url.into(),
            auth: Auth::None,
            roots: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            error: None,
        }
    }

    /// The registry's base URL.
    pub fn url(&self) -> &str {
        self.inner.base.as_str()
    }

    /// The schema of id `id`: asked of the registry once, then kept (an id
    /// never names another schema).
    pub async fn schema(&self, id: u32) -> Result<Arc<Schema>, RegistryError> {
        let cell = {
            let mut cache = self.inner.by_id.lock().unwrap_or_else(|p| p.into_inner());
            cache.entry(id).or_default().clone()
        };
        let fetched = cell
            .get_or_try_init(|| async {
                let what = format!("schema id {id}");
                let url = self.url_of(&["schemas", "ids", &id.to_string()]);
                let json: SchemaJson = self.get(&what, url).await?;
                Ok(Arc::new(json.schema(&what)?))
            })
            .await
            .cloned();
        if fetched.is_err() {
            // No empty cell left behind for each id that failed (ids of
            // junk payloads would pile up): the next ask makes a new one.
            let mut cache = self.inner.by_id.lock().unwrap_or_else(|p| p.into_inner());
            if cache.get(&id).is_some_and(|cell| cell.get().is_none()) {
                cache.remove(&id);
            }
        }
        fetched
    }

    /// The schema of id `id` if it was fetched before, without asking.
    pub fn cached(&self, id: u32) -> Option<Arc<Schema>> {
        let cache = self.inner.by_id.lock().unwrap_or_else(|p| p.into_inner());
        cache.get(&id).and_then(|cell| cell.get().cloned())
    }

    /// The versions registered under `subject`, oldest first.
    pub async fn versions(&self, subject: &str) -> Result<Vec<i32>, RegistryError> {
        let what = format!("subject {subject:?}");
        self.get(&what, self.url_of(&["subjects", subject, "versions"]))
            .await
    }

    /// Version `version` of `subject`.
    pub async fn version(
        &self,
        subject: &str,
        version: i32,
    ) -> Result<SubjectVersion, RegistryError> {
        let what = format!("version {version} of subject {subject:?}");
        let url = self.url_of(&["subjects", subject, "versions", &version.to_string()]);
        let json: SchemaJson = self.get(&what, url).await?;
        subject_version(&what, subject, version, json)
    }

    /// The latest version of `subject`.
    pub async fn latest(&self, subject: &str) -> Result<SubjectVersion, RegistryError> {
        let what = format!("the latest version of subject {subject:?}");
        let url = self.url_of(&["subjects", subject, "versions", "latest"]);
        let json: SchemaJson = self.get(&what, url).await?;
        let version = json.version.unwrap_or(0);
        subject_version(&what, subject, version, json)
    }

    /// Registers `schema` under `subject` (a no-op returning its id if the
    /// subject has it already); the registry checks it against the
    /// subject's compatibility rule first (409 when it breaks it).
    pub async fn register(&self, subject: &str, schema: &Schema) -> Result<u32, RegistryError> {
        let what = format!("a {} schema for subject {subject:?}", schema.kind);
        let url = self.url_of(&["subjects", subject, "versions"]);
        let registered: RegisteredJson = self.post(&what, url, schema).await?;
        Ok(registered.id)
    }

    /// The version of `subject` that is `schema`, if it has one: what a
    /// producer that may not register asks.
    pub async fn lookup(
        &self,
        subject: &str,
        schema: &Schema,
    ) -> Result<Option<SubjectVersion>, RegistryError> {
        let what = format!("a {} schema of subject {subject:?}", schema.kind);
        let url = self.url_of(&["subjects", subject]);
        match self.post::<SchemaJson>(&what, url, schema).await {
            Ok(json) => {
                let version = json.version.unwrap_or(0);
                subject_version(&what, subject, version, json).map(Some)
            }
            Err(RegistryError::NotFound { .. }) => Ok(None),
            Err(other) => Err(other),
        }
    }

    fn url_of(&self, segments: &[&str]) -> reqwest::Url {
        let mut url = self.inner.base.clone();
        {
            // The base ends with '/': drop that empty segment, then add
            // each segment percent-encoded (a subject may hold any
            // character).
            let mut path = url
                .path_segments_mut()
                .expect("an http(s) URL has path segments");
            path.pop_if_empty();
            path.extend(segments);
        }
        url
    }

    fn request(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let request = request.header(
            reqwest::header::ACCEPT,
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        match &self.inner.auth {
            Auth::None => request,
            Auth::Basic { user, password } => request.basic_auth(user, Some(password)),
            Auth::Bearer(token) => request.bearer_auth(token),
        }
    }

    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        url: reqwest::Url,
    ) -> Result<T, RegistryError> {
        let request = self.request(self.inner.http.get(url));
        send(what, request).await
    }

    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        url: reqwest::Url,
        schema: &Schema,
    ) -> Result<T, RegistryError> {
        let body = serde_json::to_vec(&NewSchemaJson {
            schema: &schema.text,
            schema_type: (schema.kind != SchemaKind::Avro).then_some(schema.kind),
            references: &schema.references,
        })
        .map_err(|e| RegistryError::Settings(format!("cannot write the request: {e}")))?;
        let request = self
            .request(self.inner.http.post(url))
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/vnd.schemaregistry.v1+json",
            )
            .body(body);
        send(what, request).await
    }
}

fn subject_version(
    what: &str,
    subject: &str,
    version: i32,
    json: SchemaJson,
) -> Result<SubjectVersion, RegistryError> {
    Ok(SubjectVersion {
        subject: json.subject.clone().unwrap_or_else(|| subject.to_owned()),
        version: json.version.unwrap_or(version),
        id: json.id.unwrap_or(0),
        schema: json.schema(what)?,
    })
}

/// `url` with any `user:password@` cut out, for an error message.
fn without_userinfo(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***@{}", &url[..scheme + 3], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

fn is_loopback(url: &reqwest::Url) -> bool {
    match url.host_str() {
        Some("localhost") => true,
        Some(host) => host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback()),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_a_secret() {
        let builder =
            Registry::builder("https://registry.example.com").basic_auth("key", "the-secret");
        assert!(!format!("{builder:?}").contains("the-secret"));
        let registry = builder.build().unwrap();
        assert!(!format!("{registry:?}").contains("the-secret"));
        let bearer = Registry::builder("https://registry.example.com")
            .bearer_token("the-token")
            .build()
            .unwrap();
        assert!(!format!("{bearer:?}").contains("the-token"));
    }

    #[test]
    fn credentials_in_the_url_become_basic_auth_and_are_never_shown() {
        let registry = Registry::builder("https://key:the-secret@registry.example.com/api")
            .build()
            .unwrap();
        assert!(!format!("{registry:?}").contains("the-secret"));
        assert!(!registry.url().contains("the-secret"));
        assert!(
            format!("{registry:?}").contains("basic (user"),
            "{registry:?}"
        );
        let err = Registry::builder("https://key:the-secret@exa mple")
            .build()
            .unwrap_err();
        assert!(!err.to_string().contains("the-secret"), "{err}");
        let err = Registry::builder("http://key:the-secret@registry.example.com")
            .build()
            .unwrap_err();
        assert!(!err.to_string().contains("the-secret"), "{err}");
    }

    #[test]
    fn plain_http_only_to_this_machine() {
        let err = Registry::builder("http://registry.example.com")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("not https"), "{err}");
        Registry::builder("http://127.0.0.1:8081").build().unwrap();
        Registry::builder("http://localhost:8081/").build().unwrap();
        let err = Registry::builder("not a url").build().unwrap_err();
        assert!(err.to_string().contains("not a URL"), "{err}");
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let dir = std::env::temp_dir().join(format!("dedup-registry-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("empty.pem");
        std::fs::write(&file, "not a certificate").unwrap();
        let err = Registry::builder("https://registry.example.com")
            .ca_file(&file)
            .build()
            .unwrap_err();
        assert!(
            err.to_string().contains("holds no PEM certificate"),
            "{err}"
        );
        let err = Registry::builder("https://registry.example.com")
            .ca_file(dir.join("missing.pem"))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("cannot be read"), "{err}");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn subjects_are_percent_encoded_in_the_path() {
        let registry = Registry::builder("https://r.example.com/apis/ccompat/v6/")
            .build()
            .unwrap();
        let url = registry.url_of(&["subjects", "a/b c", "versions"]);
        assert_eq!(
            url.as_str(),
            "https://r.example.com/apis/ccompat/v6/subjects/a%2Fb%20c/versions"
        );
    }
}
