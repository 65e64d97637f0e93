//! The outbox conformance suite against SQLite, each case on its own
//! database file.

use dedup_core::OutboxMessage;
use dedup_core::conformance::outbox::OutboxFixture;
use dedup_sqlite::{OutboxConfig, OutboxReader, OutboxWriter, SqliteStore};

struct Sqlite {
    store: SqliteStore,
    writer: OutboxWriter,
}

impl OutboxFixture for Sqlite {
    type Source = OutboxReader;

    fn reader(&self) -> OutboxReader {
        self.writer.reader(self.store.pool().clone())
    }

    async fn enqueue(&self, messages: Vec<OutboxMessage>, commit: bool) -> Vec<String> {
        let mut tx = self
            .store
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .expect("begin");
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

async fn fresh(retention: dedup_core::Retention) -> Sqlite {
    let path = std::env::temp_dir().join(format!("dedup-outbox-{}.db", uuid::Uuid::new_v4()));
    let store = SqliteStore::open(&path).await.expect("open");
    let writer =
        OutboxWriter::new(OutboxConfig::default().with_retention(retention)).expect("config");
    writer.migrate(store.pool()).await.expect("migrate");
    writer
        .migrate(store.pool())
        .await
        .expect("migrating twice is a no-op");
    Sqlite { store, writer }
}

dedup_core::outbox_conformance_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    |retention| fresh(retention).await
);
