//! Least privilege: the role a service connects as is granted rights on
//! dedup's rows, never on its schema. A role cannot be a bind parameter in
//! `GRANT`, so it is validated before it is written into one.

use crate::MAX_TABLE_LEN;
use crate::table::is_identifier;

/// A role (PostgreSQL) or user (MySQL) name that was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid role {name:?}: use letters, digits and underscores, not starting with a digit, at \
     most {MAX_TABLE_LEN} bytes, and a role of its own (not PUBLIC, NONE or a pg_ role) (MySQL: \
     `user` or `user@host`, the host of letters, digits, `.`, `-`, `_` or `%`)"
)]
pub struct InvalidRole {
    name: String,
}

/// A validated grantee: a PostgreSQL role, or a MySQL `user@host` (host
/// `%` when not given).
///
/// ```
/// use dedup_sql::Role;
///
/// assert_eq!(Role::parse("dedup_app")?.quoted(), r#""dedup_app""#);
/// assert_eq!(Role::parse_account("app@10.0.%")?.quoted_account(), "'app'@'10.0.%'");
/// assert!(Role::parse("app\"; DROP TABLE users; --").is_err());
/// # Ok::<(), dedup_sql::InvalidRole>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Role {
    name: String,
    host: String,
}

fn is_host(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '%'))
}

impl Role {
    /// A PostgreSQL role: an identifier, and not one that names more than
    /// a role (`public`, which is everyone even quoted, `none`, the
    /// predefined `pg_*` roles).
    pub fn parse(name: &str) -> Result<Self, InvalidRole> {
        let lower = name.to_ascii_lowercase();
        if !is_identifier(name)
            || matches!(
                lower.as_str(),
                "public" | "none" | "current_user" | "session_user"
            )
            || lower.starts_with("pg_")
        {
            return Err(InvalidRole {
                name: name.to_owned(),
            });
        }
        Ok(Role {
            name: name.to_owned(),
            host: "%".to_owned(),
        })
    }

    /// A MySQL account: `user` (any host) or `user@host`.
    pub fn parse_account(account: &str) -> Result<Self, InvalidRole> {
        let invalid = || InvalidRole {
            name: account.to_owned(),
        };
        let (user, host) = account.split_once('@').unwrap_or((account, "%"));
        if !is_identifier(user) || !is_host(host) {
            return Err(invalid());
        }
        Ok(Role {
            name: user.to_owned(),
            host: host.to_owned(),
        })
    }

    /// The role as a quoted identifier (`"name"`).
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.name)
    }

    /// The account as MySQL writes it (`'user'@'host'`).
    pub fn quoted_account(&self) -> String {
        format!("'{}'@'{}'", self.name, self.host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_and_hosts_are_accepted() {
        for bad in ["", "1app", "app-x", "a\"b", "a'b", "a b", &"a".repeat(49)] {
            assert!(Role::parse(bad).is_err(), "{bad:?}");
            assert!(Role::parse_account(bad).is_err(), "{bad:?}");
        }
        for bad in ["app@", "app@a'b", "app@a b", "app@x@y"] {
            assert!(Role::parse_account(bad).is_err(), "{bad:?}");
        }
        assert!(
            Role::parse("app@host").is_err(),
            "PostgreSQL roles have no host"
        );
        for everyone in ["public", "PUBLIC", "none", "pg_read_all_data", "Pg_monitor"] {
            assert!(Role::parse(everyone).is_err(), "{everyone}");
        }
        assert_eq!(
            Role::parse_account("app").unwrap().quoted_account(),
            "'app'@'%'"
        );
        assert_eq!(
            Role::parse_account("app@db-1.internal")
                .unwrap()
                .quoted_account(),
            "'app'@'db-1.internal'"
        );
    }
}
