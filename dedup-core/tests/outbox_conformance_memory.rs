//! The outbox conformance suite on the reference in-memory outbox.

use dedup_core::conformance::outbox::OutboxFixture;
use dedup_core::{DedupStore, MemoryOutbox, MemoryStore, OutboxMessage};

struct Memory {
    store: MemoryStore,
    outbox: MemoryOutbox,
}

impl OutboxFixture for Memory {
    type Source = MemoryOutbox;

    fn reader(&self) -> MemoryOutbox {
        self.outbox.reader()
    }

    async fn enqueue(&self, messages: Vec<OutboxMessage>, commit: bool) -> Vec<String> {
        let mut tx = self.store.begin().await.expect("begin");
        let ids = messages
            .into_iter()
            .map(|m| self.outbox.enqueue(&mut tx, m))
            .collect();
        if commit {
            self.store.commit(tx).await.expect("commit");
        } else {
            self.store.rollback(tx).await.expect("rollback");
        }
        ids
    }
}

dedup_core::outbox_conformance_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    |retention| Memory {
        store: MemoryStore::new(),
        outbox: MemoryOutbox::new(retention),
    }
);
