//! Least privilege: what a service's user needs on dedup's tables, granted
//! by their owner (the book's Security chapter).

use dedup_sql::{Error, Role, TableName};
use sqlx::MySqlPool;

/// The statements that give the account `user` (`user` for any host, or
/// `user@host`) what a service needs on the claims table `claims` and, if
/// given, the outbox table `outbox` (both in the connection's database):
/// their rows read and written, the fencing-token row updated, the
/// migrations tables read (so [`MySqlStore::migrate`](crate::MySqlStore::migrate)
/// finds them current and changes nothing); no right to create, alter or
/// drop. Run them as a user who may grant them, after migrating ([`grant`]
/// does both). The account must exist.
///
/// ```
/// let sql = dedup_mysql::grant_statements("dedup_app@10.0.%", "dedup_claims", None)?;
/// assert_eq!(sql[0], "GRANT SELECT, INSERT, UPDATE, DELETE ON `dedup_claims` TO 'dedup_app'@'10.0.%'");
/// # Ok::<(), dedup_mysql::Error>(())
/// ```
pub fn grant_statements(
    user: &str,
    claims: &str,
    outbox: Option<&str>,
) -> Result<Vec<String>, Error> {
    let account = Role::parse_account(user)?.quoted_account();
    let table = |name: &str| TableName::parse_unqualified(name).map(TableName::with_backticks);
    let claims = table(claims)?;
    let mut sql = vec![
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {account}",
            claims.quoted()
        ),
        format!(
            "GRANT SELECT, UPDATE ON {} TO {account}",
            claims.quoted_with_suffix("_tokens")
        ),
        format!(
            "GRANT SELECT ON {} TO {account}",
            claims.quoted_with_suffix("_migrations")
        ),
    ];
    if let Some(outbox) = outbox {
        let outbox = table(outbox)?;
        sql.extend([
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {account}",
                outbox.quoted()
            ),
            format!(
                "GRANT SELECT ON {} TO {account}",
                outbox.quoted_with_suffix("_migrations")
            ),
        ]);
    }
    Ok(sql)
}

/// Runs [`grant_statements`] one by one (MySQL commits each `GRANT` at
/// once: nothing can hold them in one transaction), as a user who may
/// grant them (the tables must exist: migrate first).
pub async fn grant(
    pool: &MySqlPool,
    user: &str,
    claims: &str,
    outbox: Option<&str>,
) -> Result<(), Error> {
    for statement in grant_statements(user, claims, outbox)? {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(pool)
            .await
            .map_err(Error::database::<crate::MySql>)?;
    }
    Ok(())
}
