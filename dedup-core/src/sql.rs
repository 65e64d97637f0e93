//! Configurable SQL table names, shared by the SQL backends: validated,
//! then always quoted, so a name from configuration can never change a
//! statement's meaning.

use std::fmt;

/// Longest accepted table name: leaves room for the `_migrations` and
/// `_expires_at_idx` suffixes inside PostgreSQL's 63-byte identifier limit.
pub const MAX_TABLE_LEN: usize = 48;

/// A table name that was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid table name {name:?}: use letters, digits and underscores, not starting with a digit, \
     at most {MAX_TABLE_LEN} bytes, optionally schema-qualified (\"dedup.claims\")"
)]
pub struct InvalidTableName {
    name: String,
}

/// A validated `[schema.]table`: ASCII letters, digits and `_`, not
/// starting with a digit, at most [`MAX_TABLE_LEN`] bytes each part.
///
/// ```
/// use dedup_core::sql::TableName;
///
/// let t = TableName::parse("billing.claims")?;
/// assert_eq!(t.quoted(), r#""billing"."claims""#);
/// assert!(TableName::parse("claims; DROP TABLE users").is_err());
/// # Ok::<(), dedup_core::sql::InvalidTableName>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && s.len() <= MAX_TABLE_LEN
}

impl TableName {
    /// Validates `name`, `table` or `schema.table`.
    pub fn parse(name: &str) -> Result<Self, InvalidTableName> {
        let invalid = || InvalidTableName {
            name: name.to_owned(),
        };
        let (schema, table) = match name.split_once('.') {
            Some((schema, table)) => (Some(schema), table),
            None => (None, name),
        };
        if !is_identifier(table) || schema.is_some_and(|s| !is_identifier(s)) {
            return Err(invalid());
        }
        Ok(TableName {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// `"schema"."table"` with `suffix` appended to the table part (for
    /// companion tables such as `<table>_migrations`).
    pub fn quoted_with_suffix(&self, suffix: &str) -> String {
        // Validation admits no `"`, so wrapping in quotes is exact quoting.
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{}{suffix}\"", self.table),
            None => format!("\"{}{suffix}\"", self.table),
        }
    }

    /// The quoted, possibly qualified table.
    pub fn quoted(&self) -> String {
        self.quoted_with_suffix("")
    }

    /// The quoted name of an index on this table (indexes live in the
    /// table's schema, so they are never qualified).
    pub fn quoted_index(&self, suffix: &str) -> String {
        format!("\"{}{suffix}\"", self.table)
    }

    /// The quoted schema, if the name is qualified.
    pub fn quoted_schema(&self) -> Option<String> {
        self.schema.as_ref().map(|s| format!("\"{s}\""))
    }
}

impl TableName {
    /// Fills a migration template: `{{table}}` becomes the quoted table,
    /// `{{expires_index}}` the quoted name of its expiry index,
    /// `{{index:NAME}}` the quoted index `<table>_NAME`, `{{object:NAME}}`
    /// the quoted, qualified companion `<table>_NAME` (a function), and
    /// `{{name}}` the unquoted `[schema.]table` (validation leaves nothing
    /// in it that could end a string literal).
    pub fn render(&self, template: &str) -> String {
        let mut out = template
            .replace("{{table}}", &self.quoted())
            .replace("{{expires_index}}", &self.quoted_index("_expires_at_idx"))
            .replace("{{name}}", &self.to_string());
        for (tag, quote) in [
            ("{{index:", Self::quoted_index as fn(&Self, &str) -> String),
            ("{{object:", Self::quoted_with_suffix),
        ] {
            while let Some(start) = out.find(tag) {
                let Some(len) = out[start..].find("}}") else {
                    break;
                };
                let name = &out[start + tag.len()..start + len];
                let quoted = quote(self, &format!("_{name}"));
                out.replace_range(start..start + len + 2, &quoted);
            }
        }
        out
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.table),
            None => f.write_str(&self.table),
        }
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableName({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_qualified_names() {
        assert_eq!(
            TableName::parse("dedup_claims").unwrap().quoted(),
            "\"dedup_claims\""
        );
        let t = TableName::parse("billing.Claims_2").unwrap();
        assert_eq!(t.quoted(), "\"billing\".\"Claims_2\"");
        assert_eq!(
            t.quoted_with_suffix("_migrations"),
            "\"billing\".\"Claims_2_migrations\""
        );
        assert_eq!(
            t.quoted_index("_expires_at_idx"),
            "\"Claims_2_expires_at_idx\""
        );
    }

    #[test]
    fn renders_companion_names() {
        let t = TableName::parse("billing.outbox").unwrap();
        assert_eq!(
            t.render("{{table}} {{index:pending_idx}} {{object:notify}}() '{{name}}'"),
            "\"billing\".\"outbox\" \"outbox_pending_idx\" \"billing\".\"outbox_notify\"() 'billing.outbox'"
        );
    }

    #[test]
    fn rejects_anything_that_could_escape_quoting() {
        for bad in [
            "",
            "1claims",
            "claims\"; DROP TABLE users; --",
            "claims;",
            "a.b.c",
            ".claims",
            "claims.",
            "my claims",
            "clåims",
            &"x".repeat(MAX_TABLE_LEN + 1),
        ] {
            assert!(TableName::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }
}

/// The bookkeeping of a batch claim, the same for every SQL backend: one
/// row per distinct key goes into the claim statement (ON CONFLICT cannot
/// touch a row twice in one statement), the rows it returns are the claims
/// taken, the keys it does not return are live duplicates whose expiry is
/// read separately, and a key given twice is answered at its repeats from
/// its first position.
///
/// ```
/// use dedup_core::sql::BatchClaims;
/// use dedup_core::{Claim, DedupKey};
/// use std::time::SystemTime;
///
/// let keys = [DedupKey::new("s", "a")?, DedupKey::new("s", "b")?, DedupKey::new("s", "a")?];
/// let mut batch = BatchClaims::new(&keys);
/// assert_eq!(batch.distinct().len(), 2);
/// let t = SystemTime::now();
/// batch.claimed("s", "a", true, t); // the statement returned a (fresh), not b
/// assert_eq!(batch.unclaimed().len(), 1);
/// batch.live("s", "b", t); // b's live claim, read afterwards
/// let claims = batch.finish();
/// assert_eq!(claims[0], Claim::Fresh);
/// assert_eq!(claims[1], Claim::Duplicate { expires_at: t });
/// assert_eq!(claims[2], Claim::Duplicate { expires_at: t }, "a repeat of a");
/// # Ok::<(), dedup_core::KeyError>(())
/// ```
#[derive(Debug)]
pub struct BatchClaims<'k> {
    keys: &'k [crate::DedupKey],
    /// Index into `distinct` of each distinct (scope, id).
    index: std::collections::HashMap<(&'k str, &'k str), usize>,
    distinct: Vec<&'k crate::DedupKey>,
    /// Per distinct key: `Some(true)` fresh, `Some(false)` reclaimed.
    taken: Vec<Option<bool>>,
    expires_at: Vec<Option<std::time::SystemTime>>,
}

impl<'k> BatchClaims<'k> {
    /// Starts a batch claim of `keys`, in their order.
    pub fn new(keys: &'k [crate::DedupKey]) -> Self {
        let mut index = std::collections::HashMap::with_capacity(keys.len());
        let mut distinct = Vec::with_capacity(keys.len());
        for key in keys {
            index.entry((key.scope(), key.id())).or_insert_with(|| {
                distinct.push(key);
                distinct.len() - 1
            });
        }
        let n = distinct.len();
        BatchClaims {
            keys,
            index,
            distinct,
            taken: vec![None; n],
            expires_at: vec![None; n],
        }
    }

    /// The distinct keys, in first-seen order: what the claim statement gets.
    pub fn distinct(&self) -> &[&'k crate::DedupKey] {
        &self.distinct
    }

    /// Records a row the claim statement returned: the claim was taken.
    pub fn claimed(
        &mut self,
        scope: &str,
        id: &str,
        fresh: bool,
        expires_at: std::time::SystemTime,
    ) {
        if let Some(&i) = self.index.get(&(scope, id)) {
            self.taken[i] = Some(fresh);
            self.expires_at[i] = Some(expires_at);
        }
    }

    /// The distinct keys the statement did not return: live claims of
    /// other transactions, whose expiry is to be read.
    pub fn unclaimed(&self) -> Vec<&'k crate::DedupKey> {
        self.distinct
            .iter()
            .zip(&self.taken)
            .filter(|(_, taken)| taken.is_none())
            .map(|(key, _)| *key)
            .collect()
    }

    /// Records the expiry of a live claim.
    pub fn live(&mut self, scope: &str, id: &str, expires_at: std::time::SystemTime) {
        if let Some(&i) = self.index.get(&(scope, id)) {
            self.expires_at[i] = Some(expires_at);
        }
    }

    /// One claim per key, in the order given. A live claim whose expiry
    /// could not be read (it vanished in between, purged at its expiry) is
    /// reported as expiring now.
    pub fn finish(self) -> Vec<crate::Claim> {
        let mut answered = vec![false; self.distinct.len()];
        self.keys
            .iter()
            .map(|key| {
                let i = self.index[&(key.scope(), key.id())];
                let expires_at = self.expires_at[i].unwrap_or_else(std::time::SystemTime::now);
                match (self.taken[i], std::mem::replace(&mut answered[i], true)) {
                    (Some(true), false) => crate::Claim::Fresh,
                    (Some(false), false) => crate::Claim::Reclaimed,
                    _ => crate::Claim::Duplicate { expires_at },
                }
            })
            .collect()
    }
}

/// A time the database gave as microseconds since the Unix epoch (how the
/// SQL backends read `expires_at` without a date-time crate).
pub fn time_from_unix_micros(us: i64) -> std::time::SystemTime {
    let magnitude = std::time::Duration::from_micros(us.unsigned_abs());
    if us >= 0 {
        std::time::UNIX_EPOCH + magnitude
    } else {
        std::time::UNIX_EPOCH - magnitude
    }
}

/// A TTL as the signed seconds SQL parameters take. A TTL is at most 100
/// years, far inside `i64`.
pub fn ttl_seconds(ttl: crate::Ttl) -> i64 {
    i64::try_from(ttl.as_secs()).expect("a TTL fits in i64 seconds")
}
