//! `dedup`: the operator's tool for a dedup deployment.
//!
//! Claims (`claims get|release|stats|purge`), dead letters (`dlq
//! inspect|replay`), retry tiers (`retry list|release`), the outbox's backlog (`outbox pending`), a TTL
//! against a topic's retention (`check`), and all of it in a browser
//! (`console`). Connections come from
//! `DATABASE_URL` and `KAFKA_BROKERS` (flags override). Text by default,
//! `--json` for scripts; the exit code is 0 on success, 1 on any error (with
//! a message that says what to do), 2 on a usage error.

#![allow(clippy::print_stdout)] // a command-line tool prints its results

mod check;
mod claims;
mod console;
mod dlq;
mod failpoint;
mod kafka;
mod outbox;
mod retry;
mod schemas;
mod store;
mod time;

use std::fmt;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use dedup_core::Ttl;

#[derive(Parser)]
#[command(
    name = "dedup",
    version,
    about = "Operate dedup: claims, dead letters, retry tiers, the outbox, TTL checks, the console"
)]
struct Cli {
    /// Print JSON instead of text, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect, release and purge claims.
    #[command(subcommand)]
    Claims(ClaimsCommand),
    /// Inspect and replay a dead-letter topic.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// What waits in a retry tier, and releasing it early.
    #[command(subcommand)]
    Retry(RetryCommand),
    /// The transactional outbox.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Compare a handler's TTL with its topic's retention: what a replay from
    /// the earliest offset would do.
    Check(CheckArgs),
    /// Create or upgrade dedup's tables, as their owner (a deploy step);
    /// with `--grant-to`, give a service's role only the rights it needs on
    /// them, so that the service never holds the right to change the schema.
    Migrate(MigrateArgs),
    /// Serve the console: lag, outcomes, dead letters, claims and the
    /// outbox in a browser; release and replay with confirmation.
    Console(Box<console::ConsoleArgs>),
}

/// Where the claims are.
#[derive(Args)]
pub(crate) struct Database {
    /// The database: `postgres://..`, `mysql://..` (MariaDB too) or
    /// `sqlite://path`.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// The claims table (`name`, or `schema.name` on PostgreSQL).
    #[arg(long, default_value = "dedup_claims")]
    table: String,
}

/// How to reach the brokers.
#[derive(Args, Clone)]
pub(crate) struct KafkaArgs {
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "localhost:9092")]
    brokers: String,
    /// A file of librdkafka settings, one `key=value` per line (`#`
    /// comments): the place for passwords, which a command line shows to
    /// every user of the machine.
    #[arg(long = "kafka-config", value_name = "FILE", env = "DEDUP_KAFKA_CONFIG")]
    config_file: Option<std::path::PathBuf>,
    /// A librdkafka setting for every client, e.g.
    /// `security.protocol=sasl_ssl` (repeatable; after --kafka-config and
    /// the `KAFKA_CFG_<NAME>` environment variables, which the services'
    /// builders read too: `KAFKA_CFG_SASL_PASSWORD` sets `sasl.password`).
    #[arg(long = "kafka-set", value_name = "KEY=VALUE")]
    settings: Vec<String>,
    #[command(flatten)]
    oidc: OidcArgs,
}

/// SASL OAUTHBEARER tokens from an OIDC identity provider, by OAuth 2.0
/// client credentials (the client's secret from `DEDUP_OIDC_CLIENT_SECRET`
/// only).
#[derive(Args, Clone, Debug)]
pub(crate) struct OidcArgs {
    /// The identity provider's token endpoint: every Kafka client of the
    /// command then authenticates with OAUTHBEARER tokens from it (https;
    /// plain http only to localhost). The client's secret is read from
    /// DEDUP_OIDC_CLIENT_SECRET.
    #[arg(
        long = "oidc-token-endpoint",
        value_name = "URL",
        env = "DEDUP_OIDC_TOKEN_ENDPOINT"
    )]
    oidc_token_endpoint: Option<String>,
    /// The OAuth client id.
    #[arg(
        long = "oidc-client-id",
        value_name = "ID",
        env = "DEDUP_OIDC_CLIENT_ID"
    )]
    oidc_client_id: Option<String>,
    /// The scope to ask for.
    #[arg(long = "oidc-scope", value_name = "SCOPE", env = "DEDUP_OIDC_SCOPE")]
    oidc_scope: Option<String>,
    /// A PEM file of CA certificates to trust for the token endpoint,
    /// beside the system's.
    #[arg(long = "oidc-ca-file", value_name = "FILE", env = "DEDUP_OIDC_CA_FILE")]
    oidc_ca_file: Option<std::path::PathBuf>,
}

/// Which claim.
#[derive(Args)]
struct ClaimKey {
    /// The handler's scope (`#[idempotent(scope = ..)]`, by default
    /// `module::path::function`).
    #[arg(long)]
    scope: String,
    /// The event id. For a composite key (`key = "tenant_id, event_id"`),
    /// give `--key` once per part, in the attribute's order.
    #[arg(long, required = true)]
    key: Vec<String>,
}

impl ClaimKey {
    /// The event id as the handler claims it.
    fn id(&self) -> Result<String, Failure> {
        if self.key.len() > 1 && self.key.iter().any(String::is_empty) {
            return Err(Failure::new(
                "--key: a part of a composite key is empty, and no handler claims such a key",
            ));
        }
        Ok(dedup_core::composite_id(
            self.key.iter().map(String::as_str),
        ))
    }
}

#[derive(Subcommand)]
enum ClaimsCommand {
    /// Show one claim: when it was taken and when it expires, on the
    /// database clock.
    Get {
        #[command(flatten)]
        db: Database,
        #[command(flatten)]
        claim: ClaimKey,
    },
    /// Delete one claim, so that the event is applied again when it is
    /// delivered again.
    Release {
        #[command(flatten)]
        db: Database,
        #[command(flatten)]
        claim: ClaimKey,
        /// Confirm the deletion.
        #[arg(long)]
        yes: bool,
    },
    /// Rows, live and expired claims, expiries and sizes, per scope.
    Stats {
        #[command(flatten)]
        db: Database,
    },
    /// Delete expired claims now, in bounded batches.
    Purge {
        #[command(flatten)]
        db: Database,
        /// Claims deleted per statement.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        batch_size: u32,
    },
}

#[derive(Subcommand)]
enum DlqCommand {
    /// Count a dead-letter topic's records by kind, original partition and
    /// handler; `--show N` prints N of them.
    Inspect {
        #[command(flatten)]
        kafka: KafkaArgs,
        /// The dead-letter topic.
        topic: String,
        /// Print this many records (headers, key, a payload preview).
        #[arg(long, default_value_t = 0)]
        show: usize,
    },
    /// Produce dead letters back to their original topic, once per original
    /// message, resuming where an interrupted replay stopped.
    Replay(Box<dlq::ReplayArgs>),
}

/// A retry tier's waiting records, as `dedup retry` lists and releases
/// them.
#[derive(Args)]
struct TierRecords {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// The retry tier's topic.
    topic: String,
    /// The consumer group that reads the tier.
    #[arg(long)]
    group: String,
    /// Only the records of this Kafka key (repeatable).
    #[arg(long)]
    key: Vec<String>,
}

#[derive(Subcommand)]
enum RetryCommand {
    /// What waits in a retry tier (`<topic>.retry-<delay>`): the records
    /// the consumer group has not taken yet, per partition with the next
    /// due time; `--show N` prints N of them.
    List {
        #[command(flatten)]
        tier: TierRecords,
        /// Print this many records.
        #[arg(long, default_value_t = 0)]
        show: usize,
    },
    /// Release what waits in a retry tier now: a copy of each goes back
    /// to its origin topic and partition and is applied at once; the tier's
    /// record is skipped as applied when it is due.
    Release {
        #[command(flatten)]
        tier: TierRecords,
        /// Confirm: the released events are applied now, however long they
        /// were to wait.
        #[arg(long)]
        yes: bool,
        /// The consumers' retry tiers' signing key (`RetryTiers::signing_key`):
        /// a file holding it. The copies are signed with it; without it a
        /// consumer with a key dead-letters them as forged.
        #[arg(long, env = "DEDUP_TIER_KEY_FILE")]
        tier_key_file: Option<std::path::PathBuf>,
    },
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// The backlog per topic: pending events, the oldest one's age, events
    /// backing off after a failure.
    Pending {
        /// The database: `postgres://..`, `mysql://..` (MariaDB too) or
        /// `sqlite://path`.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// The outbox table.
        #[arg(long, default_value = "dedup_outbox")]
        table: String,
    },
}

#[derive(Args)]
struct MigrateArgs {
    #[command(flatten)]
    db: Database,
    /// The outbox table too, if the services use one (`dedup_outbox`, the
    /// default name).
    #[arg(long, value_name = "TABLE")]
    outbox: Option<String>,
    /// Then grant this role (PostgreSQL) or account (MySQL: `user` or
    /// `user@host`, which must exist) what a service needs on the tables:
    /// their rows, never their schema. The grants are printed.
    #[arg(long, value_name = "ROLE")]
    grant_to: Option<String>,
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// The topic the handler consumes.
    #[arg(long)]
    topic: String,
    /// The handler's TTL, e.g. `4h`: compared with how long the topic
    /// keeps its records.
    #[arg(long, required_unless_present = "reader_schema")]
    ttl: Option<Ttl>,
    #[command(flatten)]
    schemas: schemas::SchemaArgs,
}

/// A failure, with what to do about it.
#[derive(Debug)]
pub(crate) struct Failure(pub(crate) String);

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Failure {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Failure(message.into())
    }
}

/// What a command prints: text for people, JSON for scripts.
pub(crate) trait Report {
    fn text(&self) -> String;
    fn json(&self) -> serde_json::Value;
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command).await {
        Ok(report) => {
            if cli.json {
                println!("{:#}", report.json());
            } else {
                print!("{}", report.text());
            }
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("error: {failure}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> Result<Box<dyn Report>, Failure> {
    Ok(match command {
        Command::Claims(ClaimsCommand::Get { db, claim }) => {
            let claims = claims::Claims::connect(&db).await?;
            Box::new(claims.get(&claim.scope, &claim.id()?).await?)
        }
        Command::Claims(ClaimsCommand::Release { db, claim, yes }) => {
            if !yes {
                return Err(Failure::new(
                    "releasing a claim lets its event be applied again; add --yes to confirm",
                ));
            }
            let claims = claims::Claims::connect(&db).await?;
            Box::new(claims.release(&claim.scope, &claim.id()?).await?)
        }
        Command::Claims(ClaimsCommand::Stats { db }) => {
            Box::new(claims::Claims::connect(&db).await?.stats().await?)
        }
        Command::Claims(ClaimsCommand::Purge { db, batch_size }) => Box::new(
            claims::Claims::connect(&db)
                .await?
                .purge(batch_size)
                .await?,
        ),
        Command::Dlq(DlqCommand::Inspect { kafka, topic, show }) => {
            Box::new(dlq::inspect(&kafka, &topic, show).await?)
        }
        Command::Dlq(DlqCommand::Replay(args)) => Box::new(dlq::replay(&args).await?),
        Command::Retry(RetryCommand::List { tier, show }) => Box::new(retry::list(
            &tier.kafka,
            &tier.topic,
            &tier.group,
            &tier.key,
            show,
        )?),
        Command::Retry(RetryCommand::Release {
            tier,
            yes,
            tier_key_file,
        }) => {
            if !yes {
                return Err(Failure::new(
                    "releasing applies the waiting events now; add --yes to confirm",
                ));
            }
            let signing = match tier_key_file {
                Some(path) => Some(
                    dedup_kafka::TierKey::from_file(&path)
                        .map_err(|e| Failure::new(format!("--tier-key-file: {e}")))?,
                ),
                None => None,
            };
            Box::new(
                retry::release(
                    &tier.kafka,
                    &tier.topic,
                    &tier.group,
                    &tier.key,
                    signing.as_ref(),
                )
                .await?,
            )
        }
        Command::Outbox(OutboxCommand::Pending {
            database_url,
            table,
        }) => Box::new(outbox::pending(&database_url, &table).await?),
        Command::Migrate(args) => Box::new(
            store::migrate(
                &args.db.database_url,
                &args.db.table,
                args.outbox.as_deref(),
                args.grant_to.as_deref(),
            )
            .await?,
        ),
        Command::Check(args) => {
            let mut reports: Vec<Box<dyn Report>> = Vec::new();
            if let Some(ttl) = args.ttl {
                reports.push(Box::new(check::check(&args.kafka, &args.topic, ttl).await?));
            }
            if let Some(schema) = &args.schemas.reader_schema {
                let report = schemas::check(&args.schemas, &args.topic, schema).await?;
                // A type that cannot read a version fails the check: a
                // deploy pipeline stops on it.
                if !report.ok() {
                    return Err(Failure::new(report.text().trim_end()));
                }
                reports.push(Box::new(report));
            }
            Box::new(check::Reports(reports))
        }
        Command::Console(args) => Box::new(console::serve(*args).await?),
    })
}
