//! Running a backend's embedded migrations for a configured table.

use sqlx::migrate::{Migrate, MigrateError, Migration, Migrator};
use sqlx::{AssertSqlSafe, Database, Pool, SqlSafeStr};

use crate::TableName;

/// Runs `migrator`'s templates for `table`: each migration's SQL rendered
/// with the table's quoted names ([`TableName::render`]), applied versions
/// tracked in `<table>_migrations` (so stores with different tables in one
/// database migrate independently), the schema created if the name has one,
/// under the database's migration lock.
///
/// When every migration is already applied it only reads the migrations
/// table (no lock, no DDL): a service whose role holds only the rights on
/// dedup's tables (the book's grants) may call it at every start once the
/// owner has migrated.
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
    {
        let mut conn = pool.acquire().await?;
        if up_to_date(&mut *conn, &migrator).await {
            return Ok(());
        }
    }
    migrator.run(pool).await
}

/// Whether `migrator`'s every migration is applied with the same checksum,
/// nothing is left half applied, and no version unknown here was applied (a
/// newer release's: the full run reports it), read without a lock or DDL.
/// Any doubt (no migrations table yet, a failed read) is `false`: the full
/// run decides.
async fn up_to_date<C: Migrate + ?Sized>(conn: &mut C, migrator: &Migrator) -> bool {
    let table = migrator.table_name.as_ref();
    if !matches!(conn.dirty_version(table).await, Ok(None)) {
        return false;
    }
    let Ok(applied) = conn.list_applied_migrations(table).await else {
        return false;
    };
    let ours: Vec<&Migration> = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .collect();
    applied.len() == ours.len()
        && ours.iter().all(|m| {
            applied
                .iter()
                .any(|a| a.version == m.version && a.checksum == m.checksum)
        })
}
