//! The outbox conformance suite against a real MySQL or MariaDB server,
//! each case in its own database.

mod common;

use dedup_core::OutboxMessage;
use dedup_core::conformance::outbox::OutboxFixture;
use dedup_mysql::{OutboxConfig, OutboxReader, OutboxWriter};
use sqlx::MySqlPool;

struct MySql {
    pool: MySqlPool,
    writer: OutboxWriter,
}

impl OutboxFixture for MySql {
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

async fn fresh(retention: dedup_core::Retention) -> MySql {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(20)
        .connect_with(common::as_service(common::fresh_database().await, true).await)
        .await
        .expect("connect");
    let writer =
        OutboxWriter::new(OutboxConfig::default().with_retention(retention)).expect("config");
    writer.migrate(&pool).await.expect("migrate");
    writer
        .migrate(&pool)
        .await
        .expect("migrating twice is a no-op");
    MySql { pool, writer }
}

dedup_core::outbox_conformance_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    |retention| fresh(retention).await
);
