//! `dedup check --reader-schema`: whether a handler's Avro schema reads
//! every version registered under its topic's subject, before a deploy.

use std::path::PathBuf;

use clap::Args;
use dedup_registry::Registry;
use dedup_registry::avro::{AvroSchemaText, Readability, readability};
use serde_json::json;

use crate::{Failure, Report};

/// The registry and the reader's schema to check against it.
#[derive(Args)]
pub(crate) struct SchemaArgs {
    /// An Avro schema (`.avsc`) of the handler's event type: checked
    /// against every version of the topic's subject in the registry.
    #[arg(long, requires = "registry")]
    pub(crate) reader_schema: Option<PathBuf>,
    /// The subject (default: `<topic>-value`, Confluent's topic naming).
    #[arg(long)]
    pub(crate) subject: Option<String>,
    /// The schema registry's URL (Confluent's REST API; Apicurio's
    /// `/apis/ccompat/v6`).
    #[arg(long, env = "DEDUP_REGISTRY_URL")]
    pub(crate) registry: Option<String>,
    /// Its user (HTTP basic auth; the password from DEDUP_REGISTRY_PASSWORD).
    #[arg(long, env = "DEDUP_REGISTRY_USERNAME")]
    pub(crate) registry_user: Option<String>,
    /// A CA certificate (PEM) to trust besides the system's.
    #[arg(long, env = "DEDUP_REGISTRY_CA")]
    pub(crate) registry_ca: Option<PathBuf>,
}

/// Reads the reader's schema and checks it against the subject's versions.
pub(crate) async fn check(
    args: &SchemaArgs,
    topic: &str,
    schema: &PathBuf,
) -> Result<SchemaReport, Failure> {
    let text = std::fs::read_to_string(schema)
        .map_err(|e| Failure::new(format!("cannot read {}: {e}", schema.display())))?;
    let reader = AvroSchemaText::parse_str(&text)
        .map_err(|e| Failure::new(format!("{} is not an Avro schema: {e}", schema.display())))?;
    let url = args.registry.as_deref().ok_or_else(|| {
        Failure::new("--reader-schema needs the registry: --registry or DEDUP_REGISTRY_URL")
    })?;
    let mut registry = Registry::builder(url);
    if let Some(user) = &args.registry_user {
        let password = std::env::var("DEDUP_REGISTRY_PASSWORD").map_err(|_| {
            Failure::new("--registry-user needs the password in DEDUP_REGISTRY_PASSWORD")
        })?;
        registry = registry.basic_auth(user, password);
    }
    if let Some(ca) = &args.registry_ca {
        registry = registry.ca_file(ca);
    }
    let registry = registry.build().map_err(|e| Failure::new(e.to_string()))?;
    let subject = args
        .subject
        .clone()
        .unwrap_or_else(|| format!("{topic}-value"));
    let checked = readability(&registry, &subject, &reader)
        .await
        .map_err(|e| Failure::new(e.to_string()))?;
    Ok(SchemaReport {
        schema: schema.display().to_string(),
        checked,
    })
}

/// `check --reader-schema`.
pub(crate) struct SchemaReport {
    schema: String,
    checked: Readability,
}

impl SchemaReport {
    /// Whether the reader's schema reads every version.
    pub(crate) fn ok(&self) -> bool {
        self.checked.all_readable()
    }
}

impl Report for SchemaReport {
    fn text(&self) -> String {
        let mut out = String::new();
        for v in &self.checked.versions {
            let said = match &v.readable {
                Ok(()) => "readable".to_owned(),
                Err(why) => format!("NOT readable: {why}"),
            };
            out.push_str(&format!(
                "{} version {} (schema id {}): {said}\n",
                self.checked.subject, v.version, v.id
            ));
        }
        out.push_str(&if self.ok() {
            format!(
                "ok: {} reads every version of {}\n",
                self.schema, self.checked.subject
            )
        } else {
            format!(
                "{} cannot read every version of {}: records of those versions would be \
                 dead-lettered; give the new fields defaults, or keep the old ones\n",
                self.schema, self.checked.subject
            )
        });
        out
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "reader_schema": self.schema,
            "subject": self.checked.subject,
            "all_readable": self.ok(),
            "versions": self.checked.versions.iter().map(|v| json!({
                "version": v.version,
                "schema_id": v.id,
                "readable": v.readable.is_ok(),
                "why_not": v.readable.as_ref().err(),
            })).collect::<Vec<_>>(),
        })
    }
}
