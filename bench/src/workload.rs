//! The workload every mode runs: the same messages each run, made again
//! from their source number when needed.

/// The workload: `events` messages, a share of them exact duplicates of an
/// earlier one (a retrying producer), JSON of about 200 bytes. Only each
/// message's source number is kept; its bytes are made again when needed,
/// so the benchmark's own copy of the workload does not weigh on the
/// consumer's RSS. Each payload carries its source number (`source`), so a
/// handler can say which events it applied.
pub(crate) struct Workload {
    sources: Vec<u32>,
    pub(crate) distinct: usize,
}

impl Workload {
    /// A duplicate copies any earlier message (`window` 0), or one of the
    /// last `window` distinct events: a producer retrying within seconds,
    /// as opposed to a replay hours later. (Not the last `window` messages:
    /// one of those may itself copy an older event, and chains of copies
    /// would reach back past a short TTL.)
    pub(crate) fn new(events: usize, duplicates: f64, window: usize) -> Self {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut sources = Vec::with_capacity(events);
        let mut distinct = 0u32;
        for i in 0..events {
            if i > 0 && rng.unit() < duplicates {
                if window == 0 {
                    let pick = (rng.unit() * i as f64) as usize;
                    sources.push(sources[pick.min(i - 1)]);
                } else {
                    let span = window.min(distinct as usize) as u32;
                    let back = 1 + (rng.unit() * f64::from(span)) as u32;
                    sources.push(distinct - back.min(span));
                }
            } else {
                sources.push(distinct);
                distinct += 1;
            }
        }
        Workload {
            sources,
            distinct: distinct as usize,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.sources.len()
    }

    /// The source number of message `i` (the same for a message and its
    /// duplicates; distinct events are numbered from 0).
    pub(crate) fn source(&self, i: usize) -> u32 {
        self.sources[i]
    }

    /// Message `i` as (Kafka key, JSON payload).
    pub(crate) fn message(&self, i: usize) -> (String, String) {
        let mut rng =
            Rng(0x9e37_79b9_7f4a_7c15
                ^ u64::from(self.sources[i]).wrapping_mul(0xff51_afd7_ed55_8ccd));
        let account = format!("acct-{:04}", (rng.unit() * 1000.0) as u32);
        let payload = serde_json::json!({
            "event_id": uuid::Uuid::from_u64_pair(rng.next(), rng.next()),
            "account_id": account,
            "amount_cents": 1 + (rng.unit() * 100_000.0) as i64,
            "memo": "x".repeat(80),
            "source": self.sources[i],
        })
        .to_string();
        (account, payload)
    }
}

/// xorshift64: a fixed, fast sequence (the workload is the same every run).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}
