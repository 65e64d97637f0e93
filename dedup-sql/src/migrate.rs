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
    let mut conn = pool.acquire().await?;
    if up_to_date(&mut *conn, &migrator).await? {
        return Ok(());
    }
    // On a connection closed after, never returned to the pool: sqlx's
    // run returns without releasing its session-wide migration lock when a
    // migration fails (or when this future is dropped midway), and a
    // pooled connection holding it would stall the next migration (the
    // owner's too). Relies on sqlx-core 0.9's `run_direct` (what `run`
    // calls).
    conn.close_on_drop();
    migrator.run_direct(None, &mut *conn, false).await
}

/// Whether `migrator`'s every migration is applied with the same checksum,
/// read without a lock or DDL: `Ok(true)` current, `Ok(false)` a migration
/// is missing (or no migrations table yet, or the read failed: the full
/// run decides). What the full run would refuse is an error here already,
/// as the full run gives it (a role without DDL rights would only be told
/// it may not create the migrations table): a migration left half applied
/// ([`MigrateError::Dirty`]), one applied that this release does not know
/// (a newer release's: [`MigrateError::VersionMissing`]), or one whose SQL
/// changed ([`MigrateError::VersionMismatch`]).
async fn up_to_date<C: Migrate + ?Sized>(
    conn: &mut C,
    migrator: &Migrator,
) -> Result<bool, MigrateError> {
    let table = migrator.table_name.as_ref();
    match conn.dirty_version(table).await {
        Ok(None) => {}
        Ok(Some(version)) => return Err(MigrateError::Dirty(version)),
        Err(_) => return Ok(false),
    }
    let Ok(applied) = conn.list_applied_migrations(table).await else {
        return Ok(false);
    };
    let ours: Vec<&Migration> = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .collect();
    for a in &applied {
        match ours.iter().find(|m| m.version == a.version) {
            None => return Err(MigrateError::VersionMissing(a.version)),
            Some(m) if m.checksum != a.checksum => {
                return Err(MigrateError::VersionMismatch(a.version));
            }
            Some(_) => {}
        }
    }
    Ok(applied.len() == ours.len())
}
