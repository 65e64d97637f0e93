use dedup_core::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Ev {
    event_id: String,
}

struct Service;

impl Service {
    #[idempotent(key = "event_id", ttl = "4h")]
    async fn handler(&self, _ev: Ev) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {}
