//! Publishes payment events `{event_id, account_id, amount_cents}` for demos,
//! tests and benchmarks, with a share of exact duplicates (the same event
//! sent again, as a retrying producer does) and optionally malformed ones.
//!
//! `cargo run -p dedup-examples --example produce -- --count 1000 --duplicates 0.1 --malformed 0.01`
//!
//! Environment: `KAFKA_BROKERS` (default `localhost:9092`), `TOPIC` (default
//! `payments`). Last line: `produced=N distinct=N duplicates=N malformed=N
//! total_cents=N` (the balance sum a correct consumer ends with).

#![allow(clippy::print_stdout)]

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};

struct Args {
    count: u64,
    duplicates: f64,
    malformed: f64,
    accounts: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        count: 1000,
        duplicates: 0.1,
        malformed: 0.0,
        accounts: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--count" => args.count = value.parse().map_err(|e| bad(&e))?,
            "--duplicates" => args.duplicates = value.parse().map_err(|e| bad(&e))?,
            "--malformed" => args.malformed = value.parse().map_err(|e| bad(&e))?,
            "--accounts" => args.accounts = value.parse::<u64>().map_err(|e| bad(&e))?.max(1),
            _ => {
                return Err(format!(
                    "unknown flag {flag}; flags: --count --duplicates --malformed --accounts"
                ));
            }
        }
    }
    if !(0.0..1.0).contains(&args.duplicates) || !(0.0..1.0).contains(&args.malformed) {
        return Err("--duplicates and --malformed are shares in [0, 1)".into());
    }
    Ok(args)
}

/// xorshift: deterministic enough for a demo, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let topic = std::env::var("TOPIC").unwrap_or_else(|_| "payments".into());
    let producer: FutureProducer = ClientConfig::new()
        .set(
            "bootstrap.servers",
            std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "localhost:9092".into()),
        )
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()?;

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()));
    let (mut distinct, mut duplicates, mut malformed, mut total_cents) = (0u64, 0u64, 0u64, 0i64);
    let mut last: Option<(String, String)> = None;
    let mut sends = Vec::new();
    for _ in 0..args.count {
        let (key, payload) = if rng.next() < args.malformed {
            malformed += 1;
            ("malformed".to_owned(), "{\"event_id\": ".to_owned())
        } else if let (true, Some(prev)) = (rng.next() < args.duplicates, &last) {
            duplicates += 1;
            prev.clone()
        } else {
            distinct += 1;
            let account = format!("acct-{}", (rng.next() * args.accounts as f64) as u64);
            let cents = 1 + (rng.next() * 10_000.0) as i64;
            total_cents += cents;
            let payload = serde_json::json!({
                "event_id": uuid::Uuid::new_v4(),
                "account_id": account,
                "amount_cents": cents,
            })
            .to_string();
            last = Some((account, payload.clone()));
            last.clone().expect("just set")
        };
        // Keyed by account, so one account's events stay in order on one partition.
        let producer = producer.clone();
        let topic = topic.clone();
        sends.push(tokio::spawn(async move {
            producer
                .send(
                    FutureRecord::to(&topic).key(&key).payload(&payload),
                    Duration::from_secs(30),
                )
                .await
                .map(|_| ())
                .map_err(|(e, _)| e)
        }));
    }
    for send in sends {
        send.await??;
    }
    println!(
        "produced={} distinct={distinct} duplicates={duplicates} malformed={malformed} total_cents={total_cents}",
        args.count
    );
    Ok(())
}
