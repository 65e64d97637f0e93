//! The dedup-core conformance suite against a real MySQL or MariaDB server,
//! each case in its own database, at InnoDB's default isolation (REPEATABLE
//! READ) and at READ COMMITTED, as a service's user holding only the grants
//! dedup lists.

mod common;

use common::{Isolation, fresh_service_store};

mod repeatable_read {
    use super::*;

    dedup_core::conformance_tests!(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        || fresh_service_store(Isolation::RepeatableRead).await
    );
}

mod read_committed {
    use super::*;

    dedup_core::conformance_tests!(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        || fresh_service_store(Isolation::ReadCommitted).await
    );
}
