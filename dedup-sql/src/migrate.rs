//! Running a backend's embedded migrations for a configured table.

use sqlx::migrate::{Migrate, MigrateError, Migration, Migrator};
use sqlx::{AssertSqlSafe, Database, Pool, SqlSafeStr};

use crate::TableName;

/// Runs `migrator`'s templates for `table`: each migration's SQL rendered
/// with the table's quoted names ([`TableName::render`]), applied versions
/// tracked in `<table>_migrations` (so stores with different tables in one
/// database migrate independently), the schema created if the name has one,
/// under the database's migration lock.
pub async fn run_migrations<DB>(
    pool: &Pool<DB>,
    migrator: &Migrator,
    table: &TableName,
) -> Result<(), MigrateError>
where
    DB: Database,
    DB::Connection: Migrate,
{
    let migrations = migrator
        .iter()
        .map(|m| {
            Migration::new(
                m.version,
                m.description.clone(),
                m.migration_type,
                AssertSqlSafe(table.render(m.sql.as_str())).into_sql_str(),
                m.no_tx,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(table.quoted_with_suffix("_migrations"));
    if let Some(schema) = table.quoted_schema() {
        migrator.create_schema(schema);
    }
    migrator.run(pool).await
}
