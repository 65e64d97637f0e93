//! What the tests that count rows read share: a connection that always
//! uses generic plans, and the table statistics that count the reads.

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// A one-connection pool (its statistics are the ones flushed and read)
/// that always uses generic plans.
pub(crate) async fn generic_plan_pool(pool: &PgPool) -> PgPool {
    let options = (*pool.connect_options())
        .clone()
        .options([("plan_cache_mode", "force_generic_plan")]);
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .expect("connect")
}

/// Rows of `table` read so far by sequential scans and fetched through
/// indexes, as this connection's statistics say once flushed. (Not the
/// index entries read: within a round, entries of rows the round already
/// deleted are read again until PostgreSQL may mark them dead, which a
/// snapshot held anywhere in the database delays.)
pub(crate) async fn rows_read(pool: &PgPool, table: &str) -> i64 {
    let mut conn = pool.acquire().await.expect("connection");
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .expect("flush");
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .expect("snapshot");
    sqlx::query_scalar(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) \
         FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(&mut *conn)
    .await
    .expect("stats")
}

/// The control: `count_all`, a count of every row of `table` through a
/// column no index holds, shows up in [`rows_read`], so a test that finds
/// few rows read is not just reading statistics nobody collects.
pub(crate) async fn assert_reads_are_counted(pool: &PgPool, table: &str, count_all: &'static str) {
    let before = rows_read(pool, table).await;
    let rows: i64 = sqlx::query_scalar(count_all)
        .fetch_one(pool)
        .await
        .expect("read all");
    let read = rows_read(pool, table).await - before;
    assert!(
        rows > 0 && read >= rows,
        "reading {rows} rows of {table} counted {read}: statistics are not collected"
    );
}

/// Runs `fill` (one bind parameter, `value`) and refreshes `table`'s
/// statistics, as autovacuum would have by the time a plan matters.
pub(crate) async fn fill_and_analyze<T>(pool: &PgPool, table: &str, fill: &'static str, value: T)
where
    T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
{
    sqlx::query(fill)
        .bind(value)
        .execute(pool)
        .await
        .expect("fill");
    sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {table}")))
        .execute(pool)
        .await
        .expect("analyze");
}
