//! The operator tool, `dedup`, run as a process against the real PostgreSQL
//! and Kafka, on claims and dead letters that a real consumer made.

use dedup_tests::common;

use std::process::{Command, Output};
use std::time::Duration;

use dedup_tests::blockable::{SCOPE, block, consume, migrated, unblock_all};
use dedup_tests::{payment, total_balance};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use common::{
    brokers, create_topic, database_url, header, producer, read_exactly, records_in, unique,
};

/// Runs `dedup args...` with the test's database and the brokers.
async fn dedup(pool: &PgPool, args: &[&str]) -> Output {
    dedup_with(pool, args, &[]).await
}

async fn dedup_with(pool: &PgPool, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(common::cli());
    cmd.args(args)
        .env("DATABASE_URL", database_url(pool))
        .env("KAFKA_BROKERS", brokers())
        .env_remove("DEDUP_FAILPOINT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    tokio::task::spawn_blocking(move || cmd.output().expect("run dedup"))
        .await
        .expect("join")
}

/// `dedup claims <verb> --scope SCOPE --key <key> <more...>`.
async fn claim(pool: &PgPool, verb: &str, key: &str, more: &[&str]) -> Output {
    let args = [&["claims", verb, "--scope", SCOPE, "--key", key][..], more].concat();
    dedup(pool, &args).await
}

/// The JSON a successful `--json` command printed.
fn json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "dedup failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Produces payments: `(event id, account, cents)`.
async fn pay(topic: &str, payments: &[(uuid::Uuid, &str, i64)]) {
    let producer = producer();
    for (id, account, cents) in payments {
        producer
            .send(
                FutureRecord::to(topic)
                    .key(*account)
                    .payload(&payment(*id, account, *cents)),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }
}

#[sqlx::test(migrations = false)]
async fn claims_get_release_stats_and_purge(pool: PgPool) {
    let store = migrated(&pool).await;
    let topic = create_topic(1).await;
    let group = unique("g");
    let ids: Vec<String> = (0..3).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    let payments: Vec<_> = ids
        .iter()
        .zip([("a", 100), ("b", 20), ("c", 3)])
        .map(|(id, (account, cents))| (id.parse().expect("uuid"), account, cents))
        .collect();
    pay(&topic, &payments).await;
    assert_eq!(consume(&store, &topic, &group).await.applied, 3);

    let got = json(&claim(&pool, "get", &ids[0], &["--json"]).await);
    assert_eq!(got["found"], true, "{got}");
    assert_eq!(got["live"], true, "{got}");
    let expires_in = got["expires_in_seconds"].as_f64().expect("seconds");
    assert!(
        (3.9 * 3600.0..=4.0 * 3600.0).contains(&expires_in),
        "a 4h TTL: {got}"
    );
    let text = stdout(&claim(&pool, "get", &ids[0], &[]).await);
    // 3h59m a moment after the claim; a loaded machine (the full gate
    // failed on 3h58m) may take a minute or more to get here.
    assert!(text.contains("live, expires in 3h5"), "{text}");

    // Expired claims of another handler, waiting for the purger.
    sqlx::query(
        "INSERT INTO dedup_claims (id, scope, key, claimed_at, expires_at) \
         SELECT dedup_claims_claim_id('old', 'k' || n), 'old', 'k' || n, \
             now() - interval '2 hours', now() - interval '1 hour' \
         FROM generate_series(1, 5) AS n",
    )
    .execute(&pool)
    .await
    .expect("expired claims");
    let stats = json(&dedup(&pool, &["claims", "stats", "--json"]).await);
    assert_eq!(stats["rows"], 8, "{stats}");
    assert_eq!(stats["live"], 3, "{stats}");
    assert_eq!(stats["expired"], 5, "{stats}");
    let scopes = stats["scopes"].as_array().expect("scopes");
    assert_eq!(scopes.len(), 2, "{stats}");
    assert_eq!(scopes[0]["scope"], SCOPE, "{stats}");
    assert_eq!(scopes[0]["live"], 3, "{stats}");
    assert!(stats["total_bytes"].as_i64().expect("size") > 0, "{stats}");

    let purged = json(&dedup(&pool, &["claims", "purge", "--batch-size", "2", "--json"]).await);
    assert_eq!(purged["deleted"], 5, "{purged}");
    assert_eq!(purged["batches"], 3, "2 + 2 + 1: {purged}");
    let stats = json(&dedup(&pool, &["claims", "stats", "--json"]).await);
    assert_eq!(
        (&stats["rows"], &stats["live"]),
        (&3.into(), &3.into()),
        "{stats}"
    );

    // Releasing needs a confirmation, and then lets the event apply again.
    let refused = claim(&pool, "release", &ids[1], &[]).await;
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("--yes"), "{}", stderr(&refused));
    let released = json(&claim(&pool, "release", &ids[1], &["--yes", "--json"]).await);
    assert_eq!(released["released"], true, "{released}");
    let gone = json(&claim(&pool, "get", &ids[1], &["--json"]).await);
    assert_eq!(gone["found"], false, "{gone}");
    let again = claim(&pool, "release", &ids[1], &["--yes"]).await;
    assert!(!again.status.success(), "releasing nothing is an error");
    assert!(stderr(&again).contains("no claim"), "{}", stderr(&again));
    pay(&topic, &payments[1..2]).await;
    assert_eq!(consume(&store, &topic, &group).await.applied, 1);
    assert_eq!(
        total_balance(&pool).await,
        143,
        "the released event applied again"
    );
}

#[sqlx::test(migrations = false)]
async fn bad_settings_are_clear_errors_that_reveal_no_secret(pool: PgPool) {
    migrated(&pool).await;
    let bad_name = dedup(
        &pool,
        &["claims", "stats", "--table", "x; DROP TABLE accounts"],
    )
    .await;
    assert!(!bad_name.status.success());
    assert!(
        stderr(&bad_name).contains("not a valid table name"),
        "{}",
        stderr(&bad_name)
    );
    let missing = dedup(&pool, &["claims", "stats", "--table", "no_such_claims"]).await;
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("no claims table"),
        "{}",
        stderr(&missing)
    );
    let url = with_password(&database_url(&pool), "hunter2-secret");
    let denied = dedup_with(&pool, &["claims", "stats"], &[("DATABASE_URL", &url)]).await;
    assert!(!denied.status.success());
    assert!(
        stderr(&denied).contains("cannot connect"),
        "{}",
        stderr(&denied)
    );
    assert!(!stderr(&denied).contains("hunter2"), "{}", stderr(&denied));
    let typo = dedup(
        &pool,
        &[
            "dlq",
            "inspect",
            &unique("t"),
            "--kafka-set",
            "sasl.pasword=hunter2-secret",
        ],
    )
    .await;
    assert!(!typo.status.success());
    assert!(stderr(&typo).contains("sasl.pasword"), "{}", stderr(&typo));
    assert!(!stderr(&typo).contains("hunter2"), "{}", stderr(&typo));
    let no_topic = dedup(&pool, &["dlq", "inspect", &unique("missing")]).await;
    assert!(!no_topic.status.success());
    assert!(
        stderr(&no_topic).contains("does not exist"),
        "{}",
        stderr(&no_topic)
    );
}

/// Poisoned payments dead-lettered, the cause fixed, the dead letters
/// replayed: each applied exactly once. A copy in the dead-letter topic is
/// replayed once; an event applied meanwhile through another path is
/// skipped with --check-claims; --dry-run sends nothing; a second replay
/// sends nothing.
#[sqlx::test(migrations = false)]
async fn a_replay_after_the_fix_applies_every_dead_letter_once(pool: PgPool) {
    let store = migrated(&pool).await;
    let topic = create_topic(2).await;
    let dlq = format!("{topic}.dlq");
    let group = unique("g");
    block(&pool, "blocked-1").await;
    block(&pool, "blocked-2").await;
    let ids: Vec<uuid::Uuid> = (0..6).map(|_| uuid::Uuid::new_v4()).collect();
    let payments = [
        (ids[0], "a", 1),
        (ids[1], "blocked-1", 10),
        (ids[2], "b", 100),
        (ids[3], "blocked-2", 1000),
        (ids[4], "blocked-1", 10_000),
        (ids[5], "c", 100_000),
    ];
    pay(&topic, &payments).await;
    let first = consume(&store, &topic, &group).await;
    assert_eq!((first.applied, first.dead_lettered), (3, 3), "{first:?}");
    let dead = read_exactly(&brokers(), &dlq, 3).await;

    // A copy, as older versions wrote after a crash.
    let copy = &dead[0];
    let mut headers = OwnedHeaders::new();
    for h in copy.headers().expect("headers").iter() {
        headers = headers.insert(Header {
            key: h.key,
            value: h.value,
        });
    }
    producer()
        .send(
            FutureRecord::to(&dlq)
                .key(copy.key().expect("key"))
                .payload(copy.payload().expect("payload"))
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("copy produced");

    let inspected = json(&dedup(&pool, &["dlq", "inspect", &dlq, "--show", "1", "--json"]).await);
    assert_eq!(inspected["records"], 4, "{inspected}");
    assert_eq!(inspected["distinct"], 3, "{inspected}");
    assert_eq!(inspected["copies"], 1, "{inspected}");
    assert_eq!(inspected["by_kind"]["handler"], 4, "{inspected}");
    assert_eq!(inspected["by_handler"][SCOPE], 4, "{inspected}");
    assert_eq!(
        inspected["shown"].as_array().map(Vec::len),
        Some(1),
        "{inspected}"
    );

    // The fix; and one blocked payment applied through another path (sent
    // again by its producer) before the replay.
    unblock_all(&pool).await;
    pay(&topic, &[(ids[3], "blocked-2", 1000)]).await;
    assert_eq!(consume(&store, &topic, &group).await.applied, 1);

    let before = records_in(&topic);
    let replay = [
        "dlq",
        "replay",
        &dlq,
        "--check-claims",
        "--scope",
        SCOPE,
        "--key",
        "event_id",
    ];
    let dry = dedup(&pool, &[&replay[..], &["--dry-run"]].concat()).await;
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert!(
        stdout(&dry).contains("would_replay=2 skipped_applied=1 skipped_copies=1"),
        "{}",
        stdout(&dry)
    );
    assert_eq!(records_in(&topic), before, "a dry run sends nothing");

    let done = dedup(&pool, &replay).await;
    assert!(done.status.success(), "{}", stderr(&done));
    assert!(
        stdout(&done).contains("replayed=2 skipped_applied=1 skipped_copies=1"),
        "{}",
        stdout(&done)
    );
    assert_eq!(records_in(&topic), before + 2);
    let after = consume(&store, &topic, &group).await;
    assert_eq!((after.applied, after.dead_lettered), (2, 0), "{after:?}");
    assert_eq!(
        total_balance(&pool).await,
        111_111,
        "every payment applied exactly once"
    );

    // What a replayed record carries.
    let replayed = common::read(&topic, payments.len() + 3).await;
    let last = replayed
        .iter()
        .find(|m| header(m, "dedup.replay.count").is_some())
        .expect("a replayed record");
    assert_eq!(header(last, "dedup.replay.count"), Some("1"));
    assert!(
        header(last, "dedup.replayed.from").is_some_and(|f| f.starts_with(&dlq)),
        "{:?}",
        header(last, "dedup.replayed.from")
    );
    assert_eq!(
        header(last, "dedup.error.kind"),
        None,
        "dead-letter headers dropped"
    );
    assert_eq!(header(last, "dedup.original.topic"), None);

    let twice = dedup(&pool, &replay).await;
    assert!(twice.status.success(), "{}", stderr(&twice));
    assert!(
        stdout(&twice).contains("replayed=0") && stdout(&twice).contains("already_replayed=4"),
        "{}",
        stdout(&twice)
    );
    assert_eq!(
        records_in(&topic),
        before + 2,
        "a finished replay sends nothing again"
    );
}

/// A replay killed after sending part of the dead letters and before
/// committing its progress sends that part again when run again; the
/// consumer skips what it applied already: the balances prove it.
#[sqlx::test(migrations = false)]
async fn an_interrupted_replay_resumes_and_nothing_applies_twice(pool: PgPool) {
    let store = migrated(&pool).await;
    let topic = create_topic(1).await;
    let dlq = format!("{topic}.dlq");
    let group = unique("g");
    block(&pool, "blocked").await;
    let payments: Vec<_> = (0..5)
        .map(|i| (uuid::Uuid::new_v4(), "blocked", 10_i64.pow(i)))
        .collect();
    pay(&topic, &payments).await;
    assert_eq!(consume(&store, &topic, &group).await.dead_lettered, 5);
    unblock_all(&pool).await;

    let replay = ["dlq", "replay", &dlq, "--commit-every", "2"];
    let killed = dedup_with(
        &pool,
        &replay,
        &[("DEDUP_FAILPOINT", "replay-before-commit")],
    )
    .await;
    assert!(!killed.status.success(), "the failpoint must kill it");
    // The two it sent arrive and are applied.
    let partial = consume(&store, &topic, &group).await;
    assert_eq!(partial.applied, 2, "{partial:?}");

    let resumed = dedup(&pool, &replay).await;
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(
        stdout(&resumed).contains("replayed=5"),
        "{}",
        stdout(&resumed)
    );
    let rest = consume(&store, &topic, &group).await;
    assert_eq!((rest.applied, rest.skipped), (3, 2), "{rest:?}");
    assert_eq!(total_balance(&pool).await, 11_111, "each applied once");
}

/// Records a replay cannot place, or whose headers are malformed: a clear
/// error, and nothing sent.
#[sqlx::test(migrations = false)]
async fn a_replay_refuses_records_it_cannot_place_and_sends_nothing(pool: PgPool) {
    let target = create_topic(1).await;
    let not_a_dlq = create_topic(1).await;
    pay(&not_a_dlq, &[(uuid::Uuid::new_v4(), "a", 1)]).await;
    let refused = dedup(&pool, &["dlq", "replay", &not_a_dlq]).await;
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("no dedup.original"),
        "{}",
        stderr(&refused)
    );

    let malformed = create_topic(1).await;
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "dedup.original.topic",
            value: Some(target.as_str()),
        })
        .insert(Header {
            key: "dedup.original.partition",
            value: Some("zero"),
        })
        .insert(Header {
            key: "dedup.original.offset",
            value: Some("3"),
        });
    producer()
        .send(
            FutureRecord::to(&malformed)
                .key("k")
                .payload("{}")
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
    let refused = dedup(&pool, &["dlq", "replay", &malformed]).await;
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("dedup.original.partition")
            && stderr(&refused).contains("not a number"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(records_in(&target), 0, "nothing sent");

    // Told to, it leaves such records out, reports them and moves past.
    let group = unique("replay");
    let skipped = dedup(
        &pool,
        &[
            "dlq",
            "replay",
            &malformed,
            "--skip-invalid",
            "--group",
            &group,
        ],
    )
    .await;
    assert!(skipped.status.success(), "{}", stderr(&skipped));
    assert!(
        stdout(&skipped).contains("replayed=0") && stdout(&skipped).contains("skipped_invalid=1"),
        "{}",
        stdout(&skipped)
    );
    // The same group with other filters would skip what they let through.
    let other = dedup(
        &pool,
        &[
            "dlq", "replay", &malformed, "--group", &group, "--kind", "decode",
        ],
    )
    .await;
    assert!(!other.status.success());
    assert!(
        stderr(&other).contains("other options"),
        "{}",
        stderr(&other)
    );
    assert_eq!(records_in(&target), 0, "nothing sent");
}

/// Among copies of one original message, a whole one is replayed, never a
/// copy whose payload was cut to fit the dead-letter topic. A dead letter of
/// another message at the same offset (its topic was created again) is no
/// copy: it is replayed too.
#[sqlx::test(migrations = false)]
async fn a_replay_prefers_a_whole_copy_to_a_cut_one(pool: PgPool) {
    let target = create_topic(1).await;
    let dlq = create_topic(1).await;
    let whole = payment(uuid::Uuid::new_v4(), "a", 7);
    let other = payment(uuid::Uuid::new_v4(), "a", 8);
    let dead_letter = |payload: &[u8], cut: bool, timestamp: &str| {
        let mut headers = OwnedHeaders::new();
        for (key, value) in [
            ("dedup.original.topic", target.as_str()),
            ("dedup.original.partition", "0"),
            ("dedup.original.offset", "41"),
            ("dedup.original.timestamp", timestamp),
            ("dedup.error.kind", "handler"),
            ("user-header", "kept"),
        ] {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        if cut {
            headers = headers.insert(Header {
                key: "dedup.payload.truncated",
                value: Some("true"),
            });
        }
        (payload.to_vec(), headers)
    };
    let producer = producer();
    for (payload, headers) in [
        dead_letter(&whole[..5], true, "1000"),
        dead_letter(&whole, false, "1000"),
        dead_letter(&other, false, "2000"),
    ] {
        producer
            .send(
                FutureRecord::to(&dlq)
                    .key("a")
                    .payload(&payload)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }
    let done = dedup(&pool, &["dlq", "replay", &dlq]).await;
    assert!(done.status.success(), "{}", stderr(&done));
    assert!(
        stdout(&done).contains("replayed=2 skipped_applied=0 skipped_copies=1"),
        "{}",
        stdout(&done)
    );
    let sent = read_exactly(&brokers(), &target, 2).await;
    assert_eq!(sent[0].payload(), Some(&whole[..]), "the whole copy");
    assert_eq!(sent[1].payload(), Some(&other[..]), "the other message");
    assert_eq!(header(&sent[0], "user-header"), Some("kept"));
    assert_eq!(header(&sent[0], "dedup.payload.truncated"), None);
}

#[sqlx::test(migrations = false)]
async fn check_compares_the_ttl_with_the_topics_retention(pool: PgPool) {
    let short = common::create_topic_with(
        &brokers(),
        1,
        &[("retention.ms", "3600000"), ("segment.ms", "600000")],
    )
    .await;
    let ok = json(
        &dedup(
            &pool,
            &["check", "--topic", &short, "--ttl", "4h", "--json"],
        )
        .await,
    );
    assert_eq!(ok["replay_from_earliest_is_deduplicated"], true, "{ok}");
    assert_eq!(ok["retention_ms"], 3_600_000, "{ok}");
    let forever = common::create_topic_with(&brokers(), 1, &[("retention.ms", "-1")]).await;
    let kept = json(
        &dedup(
            &pool,
            &["check", "--topic", &forever, "--ttl", "7d", "--json"],
        )
        .await,
    );
    assert_eq!(
        kept["replay_from_earliest_is_deduplicated"], false,
        "{kept}"
    );
    assert!(
        kept["verdict"]
            .as_str()
            .is_some_and(|v| v.contains("for ever")),
        "{kept}"
    );
    // An hour's retention, but segments of a week (the default): records
    // stay readable for up to a week and an hour.
    let week = common::create_topic_with(&brokers(), 1, &[("retention.ms", "3600000")]).await;
    let warned = dedup(&pool, &["check", "--topic", &week, "--ttl", "4h"]).await;
    assert!(warned.status.success(), "{}", stderr(&warned));
    assert!(
        stdout(&warned).contains("warning") && stdout(&warned).contains("7d1h"),
        "{}",
        stdout(&warned)
    );
}

/// `url` with its password replaced by `password`, whatever role and
/// password it names.
fn with_password(url: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("DATABASE_URL is a URL");
    let (userinfo, host) = rest
        .rsplit_once('@')
        .expect("DATABASE_URL names a role (user@host)");
    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
    format!("{scheme}://{user}:{password}@{host}")
}

/// The operator's tool where production puts it: the brokers only through
/// SASL_SSL (SCRAM-SHA-512, the test CA), settings from `KAFKA_CFG_*` as
/// the services read them, and the database only over verify-full as a
/// role that may not connect in clear. `dlq inspect` and a claims-checked
/// `dlq replay` work there; a wrong Kafka password is one clear error that
/// never shows it.
#[sqlx::test(migrations = false)]
async fn the_cli_reaches_a_sasl_ssl_cluster_and_a_tls_only_database(pool: PgPool) {
    let store = migrated(&pool).await;
    let topic = create_topic(1).await;
    let dlq = format!("{topic}.dlq");
    let group = unique("g");
    block(&pool, "blocked-1").await;
    let ids: Vec<uuid::Uuid> = (0..2).map(|_| uuid::Uuid::new_v4()).collect();
    pay(&topic, &[(ids[0], "a", 1), (ids[1], "blocked-1", 10)]).await;
    let first = consume(&store, &topic, &group).await;
    assert_eq!((first.applied, first.dead_lettered), (1, 1), "{first:?}");
    unblock_all(&pool).await;

    // The TLS-only role may read and write dedup's tables in this database.
    sqlx::query("GRANT ALL ON ALL TABLES IN SCHEMA public TO dedup_tls")
        .execute(&pool)
        .await
        .expect("grant");
    let options: sqlx::postgres::PgConnectOptions =
        database_url(&pool).parse().expect("the test's URL");
    let tls_dir = std::env::var("DEDUP_TLS_DIR").unwrap_or_else(|_| "/var/tmp/dedup-tls".into());
    let database = format!(
        "postgres://dedup_tls:dedup@localhost:{}/{}?sslmode=verify-full&sslrootcert={tls_dir}/ca.pem",
        options.get_port(),
        options.get_database().expect("a database"),
    );
    let secured = common::secured_env();
    let mut env: Vec<(&str, &str)> = secured
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env.push(("DATABASE_URL", &database));

    let inspected = dedup_with(&pool, &["dlq", "inspect", &dlq, "--json"], &env).await;
    assert!(inspected.status.success(), "{}", stderr(&inspected));
    assert_eq!(json(&inspected)["records"], 1);
    let replay = [
        "dlq",
        "replay",
        &dlq,
        "--check-claims",
        "--scope",
        SCOPE,
        "--key",
        "event_id",
    ];
    let done = dedup_with(&pool, &replay, &env).await;
    assert!(done.status.success(), "{}", stderr(&done));
    assert!(stdout(&done).contains("replayed=1"), "{}", stdout(&done));
    let after = consume(&store, &topic, &group).await;
    assert_eq!((after.applied, after.dead_lettered), (1, 0), "{after:?}");
    assert_eq!(total_balance(&pool).await, 11, "each payment applied once");

    let mut wrong: Vec<(&str, &str)> = env
        .iter()
        .filter(|(k, _)| *k != "KAFKA_CFG_SASL_PASSWORD")
        .copied()
        .collect();
    wrong.push(("KAFKA_CFG_SASL_PASSWORD", "not-the-password"));
    let refused = dedup_with(&pool, &["dlq", "inspect", &dlq], &wrong).await;
    assert!(!refused.status.success());
    let said = stderr(&refused);
    assert!(said.contains("cannot reach the Kafka brokers"), "{said}");
    assert!(!said.contains("not-the-password"), "{said}");
}

/// The operator's tool with SASL OAUTHBEARER tokens from an OIDC identity
/// provider (a token endpoint of the test's own; the client's secret from
/// `DEDUP_OIDC_CLIENT_SECRET` only): `dlq inspect` reads the dead letters
/// through the SASL_SSL listener. A wrong secret is one clear error with
/// the identity provider's reason, at once and never showing the secret.
#[sqlx::test(migrations = false)]
async fn the_cli_takes_oauthbearer_tokens_from_an_oidc_identity_provider(pool: PgPool) {
    let store = migrated(&pool).await;
    let topic = create_topic(1).await;
    let dlq = format!("{topic}.dlq");
    block(&pool, "blocked-1").await;
    pay(&topic, &[(uuid::Uuid::new_v4(), "blocked-1", 10)]).await;
    let first = consume(&store, &topic, &unique("g")).await;
    assert_eq!(first.dead_lettered, 1, "{first:?}");

    let endpoint = dedup_tests::oidc::token_endpoint(Duration::from_secs(10)).await;
    let (brokers, settings) = common::secured_settings();
    let ca = settings
        .iter()
        .find(|(k, _)| k == "ssl.ca.location")
        .map(|(_, v)| v.clone())
        .expect("the test CA");
    let env = |secret: &'static str| {
        vec![
            ("KAFKA_BROKERS", brokers.clone()),
            ("KAFKA_CFG_SECURITY_PROTOCOL", "SASL_SSL".to_owned()),
            ("KAFKA_CFG_SSL_CA_LOCATION", ca.clone()),
            ("DEDUP_OIDC_TOKEN_ENDPOINT", endpoint.url.clone()),
            ("DEDUP_OIDC_CLIENT_ID", "dedup-svc".to_owned()),
            ("DEDUP_OIDC_SCOPE", "kafka".to_owned()),
            ("DEDUP_OIDC_CLIENT_SECRET", secret.to_owned()),
        ]
    };
    let run = |env: Vec<(&'static str, String)>, args: Vec<String>| {
        let pool = pool.clone();
        async move {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            dedup_with(&pool, &args, &env).await
        }
    };
    let inspect = vec![
        "dlq".to_owned(),
        "inspect".to_owned(),
        dlq.clone(),
        "--json".to_owned(),
    ];
    let inspected = run(env("s3cret"), inspect.clone()).await;
    assert!(inspected.status.success(), "{}", stderr(&inspected));
    assert_eq!(json(&inspected)["records"], 1);
    assert!(
        endpoint.given.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the tokens came from the endpoint"
    );

    let started = std::time::Instant::now();
    let refused = run(env("wrong-oidc-secret"), inspect).await;
    assert!(!refused.status.success());
    let said = stderr(&refused);
    assert!(said.contains("invalid_client"), "{said}");
    assert!(!said.contains("wrong-oidc-secret"), "{said}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "a refusal is said at once"
    );
}
