//! How a batch is gathered, the same in both runtimes: at most the batch
//! size and its bytes, and a linger only for a batch whose first message found nothing
//! waiting behind it. Messages that queued behind a running batch are a
//! batch already, even one alone: lingering would only add to their wait
//! (at steady load every batch would wait the whole linger on top of the
//! one before). The database runtime gathers from a partition's queue, the
//! Kafka-only one from the consumer; each asks [`Gathering::wait`] how long
//! to wait for the next message.

use std::future::Future;
use std::time::Duration;

use rdkafka::message::Message;
use tokio::time::Instant;

/// The bytes of keys and payloads that fill a batch unless set (16 MiB):
/// far above a batch of small records, so only large ones make smaller
/// batches.
pub(crate) const BATCH_BYTES: usize = 16 << 20;

/// How batches are gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Batching {
    /// Most messages in a batch (at least 1).
    pub(crate) size: usize,
    /// The batch is full once its messages' keys and payloads add up to
    /// this many bytes (its first message joins whatever its size): large
    /// records make smaller batches, so a batch's transaction stays short.
    pub(crate) bytes: usize,
    /// How long an idle source's first message waits for company.
    pub(crate) linger: Duration,
}

/// A batch being gathered, from its first message on.
#[derive(Debug)]
pub(crate) struct Gathering {
    size: usize,
    /// Most bytes, and the bytes taken so far.
    most_bytes: usize,
    bytes: usize,
    /// When its first message came.
    started: Instant,
    /// Until when it waits for more; `None`: it takes only what is waiting.
    until: Option<Instant>,
}

impl Batching {
    /// Starts a batch at its first message. `idle`: nothing was waiting
    /// when the first message came (a partition's queue was empty, or the
    /// consumer's last batch left no backlog); only then does it linger.
    pub(crate) fn start(&self, idle: bool) -> Gathering {
        let started = Instant::now();
        Gathering {
            size: self.size.max(1),
            most_bytes: self.bytes,
            bytes: 0,
            started,
            until: idle.then(|| started + self.linger),
        }
    }
}

impl Gathering {
    /// How long since its first message came.
    pub(crate) fn since(&self) -> Duration {
        self.started.elapsed()
    }

    /// Counts `msg` in the batch's bytes.
    pub(crate) fn took<M: Message>(&mut self, msg: &M) {
        self.bytes = self.bytes.saturating_add(bytes_of(msg));
    }

    /// The same gathering, holding the bytes of `batch` alone.
    pub(crate) fn recounted<M: Message>(mut self, batch: &[M]) -> Self {
        self.bytes = 0;
        for msg in batch {
            self.took(msg);
        }
        self
    }

    /// Whether a batch holding `len` (and the bytes counted) is full: what
    /// comes next is a backlog, taken without lingering.
    pub(crate) fn is_full(&self, len: usize) -> bool {
        len >= self.size || self.bytes_full()
    }

    /// Whether the bytes counted reached the most allowed.
    pub(crate) fn bytes_full(&self) -> bool {
        self.bytes >= self.most_bytes
    }

    /// How long to wait for the next message of a batch holding `len`
    /// (and the bytes [`took`](Self::took) counted): `None` when it is full
    /// by either, zero when it takes only what is waiting
    /// already (not idle, or the linger is over: then what is waiting still
    /// joins, up to the batch size). A wait that ends without a message ends
    /// the batch. Wait with [`within`], which does not wait at all for zero.
    pub(crate) fn wait(&self, len: usize) -> Option<Duration> {
        if self.is_full(len) {
            return None;
        }
        Some(self.until.map_or(Duration::ZERO, |at| {
            at.saturating_duration_since(Instant::now())
        }))
    }
}

/// The bytes of `msg` a batch counts: its key and payload.
fn bytes_of<M: Message>(msg: &M) -> usize {
    msg.key().map_or(0, <[u8]>::len) + msg.payload().map_or(0, <[u8]>::len)
}

/// `next` if it completes within `wait`. A zero wait takes only what is
/// ready: `next` is polled once, with no timer (a zero timeout would still
/// wait for the timer's next tick, about a millisecond, and whatever came
/// meanwhile would join: at steady load every batch would fill up).
/// `next` must be cancel-safe (a queue's or the consumer's `recv`).
pub(crate) async fn within<F: Future>(wait: Duration, next: F) -> Option<F::Output> {
    if !wait.is_zero() {
        return tokio::time::timeout(wait, next).await.ok();
    }
    tokio::select! {
        biased;
        out = next => Some(out),
        () = std::future::ready(()) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BATCHING: Batching = Batching {
        size: 3,
        bytes: usize::MAX,
        linger: Duration::from_secs(30),
    };

    #[test]
    fn only_an_idle_source_lingers_and_a_full_batch_goes() {
        // Idle: its first message waits the linger for company.
        let idle = BATCHING.start(true);
        let wait = idle.wait(1).expect("not full");
        assert!(wait > Duration::from_secs(29) && wait <= Duration::from_secs(30));
        assert!(idle.wait(2).expect("not full") <= wait);
        assert_eq!(idle.wait(3), None, "full");

        // Over the linger: what is waiting still joins, nothing more.
        let over = Batching {
            linger: Duration::ZERO,
            ..BATCHING
        }
        .start(true);
        assert_eq!(over.wait(2), Some(Duration::ZERO));

        // Messages were waiting: take them and go.
        let busy = BATCHING.start(false);
        assert_eq!(busy.wait(1), Some(Duration::ZERO));
        assert_eq!(busy.wait(3), None);

        // A batch size of 0 is 1.
        let one = Batching {
            size: 0,
            ..BATCHING
        }
        .start(true);
        assert_eq!(one.wait(1), None);
    }

    /// A batch is full once its keys and payloads reach the bytes allowed,
    /// whatever its count; its first message joins whatever its size.
    #[test]
    fn large_records_fill_a_batch_by_bytes() {
        let record = |payload: &'static [u8]| {
            rdkafka::message::OwnedMessage::new(
                Some(payload.to_vec()),
                Some(b"key".to_vec()),
                "t".into(),
                rdkafka::Timestamp::NotAvailable,
                0,
                0,
                None,
            )
        };
        let mut batch = Batching {
            size: 100,
            bytes: 10,
            ..BATCHING
        }
        .start(false);
        batch.took(&record(b"abcd"));
        assert_eq!(batch.wait(1), Some(Duration::ZERO), "7 bytes of 10");
        batch.took(&record(b"ab"));
        assert_eq!(batch.wait(2), None, "12 bytes: full");
        let mut one = Batching {
            size: 100,
            bytes: 10,
            ..BATCHING
        }
        .start(true);
        one.took(&record(&[0; 64]));
        assert_eq!(
            one.wait(1),
            None,
            "a record over the bytes is a batch alone"
        );
    }

    /// A zero wait takes what is ready and returns at once otherwise: a
    /// zero timeout would wait for the timer's next tick (about 1 ms), and
    /// at steady load every busy batch would fill up meanwhile.
    #[tokio::test]
    async fn a_zero_wait_takes_only_what_is_ready() {
        let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        sender.send(1).unwrap();
        assert_eq!(within(Duration::ZERO, receiver.recv()).await, Some(Some(1)));
        tokio::spawn(async move {
            // Arrives a moment later: not taken by a zero wait.
            tokio::task::yield_now().await;
            sender.send(2).unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        for _ in 0..1000 {
            assert_eq!(within(Duration::ZERO, receiver.recv()).await, None);
        }
        let later = within(Duration::from_secs(5), receiver.recv()).await;
        assert_eq!(later, Some(Some(2)));
    }
}
