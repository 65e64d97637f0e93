//! Least privilege: what a service's role needs on dedup's tables, granted
//! by their owner (the book's Security chapter).

use dedup_sql::{Error, Role, TableName};
use sqlx::PgPool;

/// The statements that give `role` what a service needs on the claims table
/// `claims` and, if given, the outbox table `outbox`: their rows read and
/// written, the fencing-token and outbox sequences used, the migrations
/// tables read (so [`PgStore::migrate`](crate::PgStore::migrate) finds them
/// current and changes nothing); no right to create, alter or drop. Run
/// them as the tables' owner, after migrating ([`grant`] does both).
///
/// ```
/// let sql = dedup_postgres::grant_statements("dedup_app", "dedup_claims", Some("dedup_outbox"))?;
/// assert_eq!(sql[0], r#"GRANT SELECT, INSERT, UPDATE, DELETE ON "dedup_claims" TO "dedup_app""#);
/// # Ok::<(), dedup_postgres::Error>(())
/// ```
pub fn grant_statements(
    role: &str,
    claims: &str,
    outbox: Option<&str>,
) -> Result<Vec<String>, Error> {
    let role = Role::parse(role)?.quoted();
    let claims = TableName::parse(claims)?;
    let outbox = outbox.map(TableName::parse).transpose()?;
    let mut sql: Vec<String> = needed(&claims, outbox.as_ref())
        .iter()
        .map(|n| {
            let kind = if n.sequence { "SEQUENCE " } else { "" };
            format!(
                "GRANT {} ON {kind}{} TO {role}",
                n.rights.join(", "),
                n.object
            )
        })
        .collect();
    // A schema of their own needs its USAGE (public's is everyone's).
    let mut schemas: Vec<String> = std::iter::once(&claims)
        .chain(&outbox)
        .filter_map(TableName::quoted_schema)
        .collect();
    schemas.dedup();
    for schema in schemas {
        sql.insert(0, format!("GRANT USAGE ON SCHEMA {schema} TO {role}"));
    }
    Ok(sql)
}

/// An object a service needs rights on, named as the statements name it
/// (quoted: case kept).
struct Needed {
    object: String,
    sequence: bool,
    rights: &'static [&'static str],
}

/// What a service needs on the claims table `claims` and the outbox
/// `outbox`: what [`grant_statements`] grants and [`grant`] checks.
fn needed(claims: &TableName, outbox: Option<&TableName>) -> Vec<Needed> {
    const ROWS: &[&str] = &["SELECT", "INSERT", "UPDATE", "DELETE"];
    let table = |object, rights| Needed {
        object,
        sequence: false,
        rights,
    };
    let sequence = |object| Needed {
        object,
        sequence: true,
        rights: &["USAGE"],
    };
    let mut needed = vec![
        table(claims.quoted(), ROWS),
        table(claims.quoted_with_suffix("_migrations"), &["SELECT"]),
        sequence(claims.quoted_with_suffix("_tokens")),
    ];
    if let Some(outbox) = outbox {
        needed.extend([
            table(outbox.quoted(), ROWS),
            table(
                outbox.quoted_with_suffix("_leases"),
                &["SELECT", "INSERT", "DELETE"],
            ),
            table(outbox.quoted_with_suffix("_migrations"), &["SELECT"]),
            sequence(outbox.quoted_with_suffix("_seq_seq")),
        ]);
    }
    needed
}

/// Runs [`grant_statements`] in one transaction, as the tables' owner (the
/// tables must exist: migrate first), then checks that the role holds the
/// rights: PostgreSQL only warns when a `GRANT` by someone else grants
/// nothing, and that is an error here ([`Error::NotGranted`]).
pub async fn grant(
    pool: &PgPool,
    role: &str,
    claims: &str,
    outbox: Option<&str>,
) -> Result<(), Error> {
    let statements = grant_statements(role, claims, outbox)?;
    let database = Error::database::<crate::Pg>;
    let mut tx = pool.begin().await.map_err(database)?;
    for statement in statements {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await
            .map_err(database)?;
    }
    // What the role can do now, object by object and right by right (the
    // check functions answer for any one of several rights).
    let claims = TableName::parse(claims)?;
    let outbox = outbox.map(TableName::parse).transpose()?;
    for needed in needed(&claims, outbox.as_ref()) {
        let check = if needed.sequence {
            "SELECT has_sequence_privilege($1, $2, $3)"
        } else {
            "SELECT has_table_privilege($1, $2, $3)"
        };
        for right in needed.rights {
            let held: bool = sqlx::query_scalar(check)
                .bind(role)
                .bind(&needed.object)
                .bind(right)
                .fetch_one(&mut *tx)
                .await
                .map_err(database)?;
            if !held {
                return Err(Error::NotGranted {
                    role: role.to_owned(),
                    object: needed.object,
                    rights: (*right).to_owned(),
                });
            }
        }
    }
    tx.commit().await.map_err(database)
}
