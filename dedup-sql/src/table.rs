//! Configurable table names: validated, then always quoted, so a name from
//! configuration can never change a statement's meaning.

use std::fmt;

/// Longest accepted table name: leaves room for the `_migrations` and
/// `_expires_at_idx` suffixes inside PostgreSQL's 63-byte identifier limit.
pub const MAX_TABLE_LEN: usize = 48;

/// A table name that was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid table name {name:?}: use letters, digits and underscores, not starting with a digit, \
     at most {MAX_TABLE_LEN} bytes, {}",
    if *.schema_allowed { "optionally schema-qualified (\"dedup.claims\")" } else { "without a schema (this database's tables have none)" }
)]
pub struct InvalidTableName {
    name: String,
    schema_allowed: bool,
}

/// A validated `[schema.]table`: ASCII letters, digits and `_`, not
/// starting with a digit, at most [`MAX_TABLE_LEN`] bytes each part.
///
/// ```
/// use dedup_sql::TableName;
///
/// let t = TableName::parse("billing.claims")?;
/// assert_eq!(t.quoted(), r#""billing"."claims""#);
/// assert!(TableName::parse("claims; DROP TABLE users").is_err());
/// # Ok::<(), dedup_sql::InvalidTableName>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
    /// The identifier quote: `"` (standard SQL) or a backtick (MySQL).
    quote: char,
}

pub(crate) fn is_identifier(s: &str) -> bool {
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
            schema_allowed: true,
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
            quote: '"',
        })
    }

    /// Validates `name` as a plain `table`, for databases whose statements
    /// cannot name a schema everywhere (SQLite's `CREATE INDEX` cannot).
    pub fn parse_unqualified(name: &str) -> Result<Self, InvalidTableName> {
        match Self::parse(name) {
            Ok(table) if table.schema.is_none() => Ok(table),
            _ => Err(InvalidTableName {
                name: name.to_owned(),
                schema_allowed: false,
            }),
        }
    }

    /// `"schema"."table"` with `suffix` appended to the table part (for
    /// companion tables such as `<table>_migrations`).
    pub fn quoted_with_suffix(&self, suffix: &str) -> String {
        // Validation admits no quote character, so wrapping in quotes is
        // exact quoting.
        let q = self.quote;
        match &self.schema {
            Some(schema) => format!("{q}{schema}{q}.{q}{}{suffix}{q}", self.table),
            None => format!("{q}{}{suffix}{q}", self.table),
        }
    }

    /// The quoted, possibly qualified table.
    pub fn quoted(&self) -> String {
        self.quoted_with_suffix("")
    }

    /// The quoted name of an index on this table (indexes live in the
    /// table's schema, so they are never qualified).
    pub fn quoted_index(&self, suffix: &str) -> String {
        let q = self.quote;
        format!("{q}{}{suffix}{q}", self.table)
    }

    /// The quoted schema, if the name is qualified.
    pub fn quoted_schema(&self) -> Option<String> {
        let q = self.quote;
        self.schema.as_ref().map(|s| format!("{q}{s}{q}"))
    }

    /// The same name quoted the MySQL way, with backticks (its default
    /// `sql_mode` reads double quotes as string literals).
    pub fn with_backticks(mut self) -> Self {
        self.quote = '`';
        self
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
    fn quotes_with_backticks_for_mysql() {
        let t = TableName::parse("billing.outbox").unwrap().with_backticks();
        assert_eq!(
            t.render("{{table}} {{index:pending_idx}} {{object:tokens}} '{{name}}'"),
            "`billing`.`outbox` `outbox_pending_idx` `billing`.`outbox_tokens` 'billing.outbox'"
        );
        assert_eq!(t.quoted_schema().as_deref(), Some("`billing`"));
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

    #[test]
    fn unqualified_names_refuse_a_schema_and_say_so() {
        assert!(TableName::parse_unqualified("claims").is_ok());
        let err = TableName::parse_unqualified("main.claims").unwrap_err();
        assert!(err.to_string().contains("without a schema"), "{err}");
        let err = TableName::parse("a;b").unwrap_err();
        assert!(
            err.to_string().contains("optionally schema-qualified"),
            "{err}"
        );
    }
}
