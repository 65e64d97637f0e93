//! The outbox conformance suite against a real PostgreSQL, each case in its
//! own database (`#[sqlx::test]`).

mod service;

use dedup_core::OutboxMessage;
use dedup_core::conformance::outbox::OutboxFixture;
use dedup_postgres::{OutboxConfig, OutboxReader, OutboxWriter};
use sqlx::PgPool;

struct Pg {
    pool: PgPool,
    writer: OutboxWriter,
}

impl OutboxFixture for Pg {
    type Source = OutboxReader;

    fn reader(&self) -> OutboxReader {
        self.writer.reader(self.pool.clone())
    }

    async fn enqueue(&self, messages: Vec<OutboxMessage>, commit: bool) -> Vec<String> {
        let mut tx = self.pool.begin().await.expect("begin");
        let mut ids = Vec::new();
        for message in messages {
            ids.push(
                self.writer
                    .enqueue(&mut tx, message)
                    .await
                    .expect("enqueue"),
            );
        }
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        ids
    }
}

/// The outbox of the test's database, migrated.
async fn fresh(pool: PgPool, retention: dedup_core::Retention) -> Pg {
    // Room for each relay's listening connection, as in production (the
    // test's pool is small).
    // As a service's role holding only the grants (the owner migrated):
    // its own migrate() finds the table current.
    let pool = service::service_pool(&pool, true, 30).await;
    let writer =
        OutboxWriter::new(OutboxConfig::default().with_retention(retention)).expect("config");
    writer
        .migrate(&pool)
        .await
        .expect("migrate finds the table current");
    Pg { pool, writer }
}

dedup_core::outbox_conformance_tests!(
    #[sqlx::test(migrations = false)]
    |retention, pool: PgPool| fresh(pool, retention).await
);
