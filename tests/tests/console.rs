//! The console (`dedup console`) in a real browser: Debian's Chromium,
//! driven through WebDriver (chromedriver), against a console on the real
//! Kafka and PostgreSQL, on dead letters and claims a real consumer made.
//! `scripts/deps.sh` installs chromium and chromium-driver.
//!
//! With `DEDUP_SCREENSHOTS=<dir>`, each page is saved there as a PNG (the
//! book's pictures come from that: `docs/src/console/`).

use dedup_tests::common;
use dedup_tests::common::free_port;

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dedup_kafka::Consumer;
use dedup_tests::blockable::{SCOPE, block, consume, migrated, record_payment, unblock_all};
use dedup_tests::{payment, store, total_balance};
use fantoccini::{Client, ClientBuilder, Locator};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;

use common::{brokers, create_topic, database_url, header, producer, unique};

/// A process killed when the test ends, however it ends, with whatever
/// it started (chromedriver's Chromium): it leads a process group of its
/// own, and the group is killed.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `dedup console <args>` with the test's database and brokers; its
/// address, from the line it prints when it serves.
async fn console(pool: &PgPool, args: &[&str], env: &[(&str, &str)]) -> (Killed, String) {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = Command::new(common::cli());
    cmd.process_group(0);
    cmd.arg("console")
        .args(args)
        .env("DATABASE_URL", database_url(pool))
        .env("KAFKA_BROKERS", brokers())
        .env_remove("DEDUP_CONSOLE_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("dedup console");
    let stdout = child.stdout.take().expect("stdout");
    let child = Killed(child);
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("its line");
        line
    })
    .await
    .expect("join");
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .trim_end_matches('/')
        .replace("0.0.0.0", "127.0.0.1");
    (child, url)
}

/// Chromium through chromedriver, headless, with a profile of its own.
async fn browser() -> (Client, Killed, tempdir::Dir) {
    use std::os::unix::process::CommandExt as _;
    // A port picked and taken by one test at a time; a chromedriver that
    // could not bind it (another process took it first) exits, and another
    // port is tried, so a test never talks to another test's driver.
    static PICKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let (port, driver) = loop {
        let _picking = PICKING.lock().unwrap_or_else(|e| e.into_inner());
        let port = free_port();
        let mut driver = Killed(
            Command::new("chromedriver")
                .arg(format!("--port={port}"))
                .process_group(0)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("chromedriver (scripts/deps.sh installs chromium-driver)"),
        );
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
            && started.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        if driver.0.try_wait().expect("chromedriver's state").is_none() {
            break (port, driver);
        }
    };
    let profile = tempdir::Dir::new("dedup-console-chromium");
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                format!("--user-data-dir={}", profile.path().display()),
            ],
        }),
    );
    let started = Instant::now();
    let client = loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(client) => break client,
            Err(e) if started.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no WebDriver session: {e}"),
        }
    };
    (client, driver, profile)
}

/// A temporary directory removed at the end.
mod tempdir {
    pub(crate) struct Dir(std::path::PathBuf);

    impl Dir {
        pub(crate) fn new(prefix: &str) -> Self {
            let path = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir_all(&path).expect("temp dir");
            Dir(path)
        }

        pub(crate) fn path(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Saves what the browser shows as `<name>.png` under `DEDUP_SCREENSHOTS`.
async fn screenshot(browser: &Client, name: &str) {
    let Ok(dir) = std::env::var("DEDUP_SCREENSHOTS") else {
        return;
    };
    let png = browser.screenshot().await.expect("screenshot");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    std::fs::write(std::path::Path::new(&dir).join(format!("{name}.png")), png).expect("saved");
}

/// The text of the element `css` finds.
async fn text(browser: &Client, css: &str) -> String {
    browser
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css}: {e}"))
        .text()
        .await
        .expect("text")
}

/// Opens the topic page at `page` and sends its replay form as it is: the
/// dry run's page.
async fn dry_run(browser: &Client, page: &str) -> String {
    browser.goto(page).await.expect("the topic's page");
    browser
        .form(Locator::Css("form[action$='/replay']"))
        .await
        .expect("the replay form")
        .submit()
        .await
        .expect("dry run");
    wait_for_text(browser, "Dry run: nothing was sent").await
}

/// Clicks what `at` finds (a link, a button).
async fn click(browser: &Client, at: Locator<'_>) {
    let what = format!("{at:?}");
    browser
        .find(at)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"))
        .click()
        .await
        .unwrap_or_else(|e| panic!("clicking {what}: {e}"));
}

/// Waits until the page's body holds `wanted` (a page still loading after
/// a click is read again).
async fn wait_for_text(browser: &Client, wanted: &str) -> String {
    let started = Instant::now();
    loop {
        let body = match browser.find(Locator::Css("body")).await {
            Ok(body) => body.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if body.contains(wanted) {
            return body;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{wanted:?} never showed; the page says:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn produce(topic: &str, key: &str, payload: &[u8]) {
    producer()
        .send(
            FutureRecord::to(topic).key(key).payload(payload),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
}

/// How many records `topic` holds.
fn records_in(topic: &str) -> usize {
    usize::try_from(common::records_in(topic)).expect("a count")
}

/// How many of the records of `topic` a replay sent (all of them read).
async fn replayed_into(topic: &str) -> usize {
    common::read(topic, records_in(topic))
        .await
        .iter()
        .filter(|m| header(m, "dedup.replayed.from").is_some())
        .count()
}

/// What an on-call engineer does: the overview shows the group and its
/// service; a poison message shows up under its kind and its page says
/// why; after the fix, a dry run and then a replay send the dead letter
/// home once and the consumer applies it; a claim is found and released.
#[sqlx::test(migrations = false)]
async fn an_operator_finds_the_poison_replays_after_the_fix_and_releases_a_claim(pool: PgPool) {
    let store = migrated(&pool).await;
    let topic = create_topic(1).await;
    let dlq = format!("{topic}.dlq");
    let group = unique("g");
    block(&pool, "blocked-1").await;
    let (applied_id, blocked_id) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    produce(&topic, "a", &payment(applied_id, "a", 1)).await;
    produce(&topic, "blocked-1", &payment(blocked_id, "blocked-1", 10)).await;
    produce(&topic, "c", b"{\"event_id\": \"garbled").await;
    let first = consume(&store, &topic, &group).await;
    assert_eq!((first.applied, first.dead_lettered), (1, 2), "{first:?}");

    // A consumer that keeps running, with its metrics for the overview.
    let metrics_port = free_port();
    let running = Consumer::builder(store.clone())
        .brokers(brokers())
        .group_id(&group)
        .commit_interval(Duration::from_millis(200))
        .serve_http(format!("127.0.0.1:{metrics_port}"))
        .handle(&topic, record_payment)
        .build()
        .expect("consumer");
    let stats = running.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(running.run_until(async move {
        let _ = stopped.await;
    }));

    let metrics = format!("http://127.0.0.1:{metrics_port}/metrics");
    let (_console, url) = console(
        &pool,
        &["--listen", "127.0.0.1:0", "--metrics", &metrics],
        &[],
    )
    .await;
    let (browser, _driver, _profile) = browser().await;

    // The overview: the group with its member and lag, the service's outcomes.
    browser.goto(&format!("{url}/")).await.expect("overview");
    let overview = wait_for_text(&browser, &group).await;
    let mut ours = String::new();
    let started = Instant::now();
    while !ours.contains("members 1") {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "our group's card: {ours}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        for card in browser
            .find_all(Locator::Css(".group"))
            .await
            .expect("cards")
        {
            let text = card.text().await.unwrap_or_default();
            if text.contains(&group) {
                ours = text;
            }
        }
    }
    assert!(ours.contains("lag 0"), "{ours}");
    assert!(overview.contains(SCOPE), "the handler's scope: {overview}");
    assert!(overview.contains("running"), "no outage: {overview}");
    screenshot(&browser, "overview").await;
    // It refreshes itself, without a reload.
    let started = Instant::now();
    while browser
        .find(Locator::Css("#overview[data-refreshed]"))
        .await
        .is_err()
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "never refreshed"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The dead letters: the decode failure under its kind, newest first.
    browser.goto(&format!("{url}/dlq")).await.expect("dlq");
    click(&browser, Locator::LinkText(&dlq)).await;
    let list = wait_for_text(&browser, "2 records in the topic").await;
    assert!(
        list.contains("decode 1") && list.contains("handler 1"),
        "{list}"
    );
    screenshot(&browser, "dead-letters").await;
    click(&browser, Locator::Css("nav.kinds a[href$='kind=decode']")).await;
    let rows = browser
        .find_all(Locator::Css("#letters tbody tr"))
        .await
        .expect("rows");
    assert_eq!(rows.len(), 1, "only the decode failure");
    rows[0]
        .find(Locator::Css("td:last-child a"))
        .await
        .expect("its link")
        .click()
        .await
        .expect("open the letter");
    assert_eq!(text(&browser, "#kind").await, "decode");
    let reason = text(&browser, "#reason").await;
    assert!(
        reason.contains("EOF") || reason.contains("expected"),
        "the decode error: {reason}"
    );
    assert!(text(&browser, "#payload").await.contains("garbled"));
    assert!(
        text(&browser, "#claim-state").await.contains("no event_id"),
        "a keyless event holds no claim"
    );
    screenshot(&browser, "dead-letter").await;
    // The same page on a phone's width: nothing cut off.
    browser
        .set_window_size(412, 915)
        .await
        .expect("phone width");
    let overflow: serde_json::Value = browser
        .execute(
            "return document.documentElement.scrollWidth > window.innerWidth + 1",
            vec![],
        )
        .await
        .expect("width");
    assert_eq!(overflow, serde_json::json!(false), "no sideways scrolling");
    screenshot(&browser, "phone").await;
    browser
        .set_window_size(1280, 900)
        .await
        .expect("laptop width");

    // The blocked payment's page: no claim, so a replay would apply it.
    browser
        .goto(&format!("{url}/dlq/{dlq}?kind=handler"))
        .await
        .expect("handler kind");
    click(&browser, Locator::Css("#letters tbody tr td:last-child a")).await;
    assert!(text(&browser, "#reason").await.contains("blocked"));
    assert!(text(&browser, "#claim-state").await.contains("No claim"));

    // The fix, then the replay of the handler failures: dry run first.
    unblock_all(&pool).await;
    let dry = dry_run(&browser, &format!("{url}/dlq/{dlq}?kind=handler")).await;
    assert!(dry.contains("1 dead letters would be replayed"), "{dry}");
    screenshot(&browser, "replay-dry-run").await;
    assert_eq!(records_in(&topic), 3, "a dry run sends nothing");
    click(&browser, Locator::Css("button.danger")).await;
    let done = wait_for_text(&browser, "Replayed 1 dead letters").await;
    assert!(done.contains(&dlq), "{done}");
    screenshot(&browser, "replay-done").await;
    assert_eq!(records_in(&topic), 4);
    assert_eq!(replayed_into(&topic).await, 1, "sent home once");
    // A second replay (the same selection) sends nothing again.
    let again = dry_run(&browser, &format!("{url}/dlq/{dlq}?kind=handler")).await;
    assert!(
        again.contains("0 dead letters would be replayed"),
        "{again}"
    );

    // The running consumer applies the replayed payment, once.
    let started = Instant::now();
    while total_balance(&pool).await != 11 {
        assert!(started.elapsed() < Duration::from_secs(30), "never applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        stats.snapshot().dead_lettered,
        0,
        "applied, not dead-lettered again"
    );

    // A claim: found by scope and key, released after a confirmation.
    browser
        .goto(&format!(
            "{url}/claims?scope={}&key={applied_id}",
            SCOPE.replace(':', "%3A")
        ))
        .await
        .expect("claims");
    let claim = text(&browser, "#claim").await;
    assert!(claim.contains("live, expires in"), "{claim}");
    screenshot(&browser, "claims").await;
    click(&browser, Locator::Css("#claim button.danger")).await;
    wait_for_text(&browser, "lets its event be applied again").await;
    let still = claims_of(&pool, applied_id).await;
    assert_eq!(still, 1, "nothing released before the confirmation");
    click(&browser, Locator::Css("button.danger")).await;
    wait_for_text(&browser, "Released").await;
    let gone = claims_of(&pool, applied_id).await;
    assert_eq!(gone, 0, "released");

    // The outbox: three events no relay has published yet.
    let writer = dedup_postgres::OutboxWriter::default();
    writer.migrate(&pool).await.expect("migrate the outbox");
    let mut tx = pool.begin().await.expect("begin");
    for topic in ["payments.settled", "payments.settled", "ledger"] {
        writer
            .enqueue(
                &mut tx,
                dedup_core::OutboxMessage::bytes(topic, b"{}".to_vec()),
            )
            .await
            .expect("enqueue");
    }
    tx.commit().await.expect("commit");
    browser
        .goto(&format!("{url}/outbox"))
        .await
        .expect("outbox");
    let outbox = text(&browser, "main").await;
    assert!(outbox.contains("3 events pending"), "{outbox}");
    assert!(outbox.contains("payments.settled 2"), "per topic: {outbox}");
    screenshot(&browser, "outbox").await;
    browser.close().await.expect("close");
    let _ = stop.send(());
    running.await.expect("join").expect("consumer ran");
}

/// On an address other than loopback the console needs its token: without
/// one it does not start; with one, a page without it is refused and the
/// token signs the browser in. A POST without the page's CSRF token is
/// refused even then.
#[sqlx::test(migrations = false)]
async fn a_console_on_another_address_refuses_pages_without_its_token(pool: PgPool) {
    use dedup_core::DedupStore as _;
    let store = store(&pool).await;
    let key = dedup_core::DedupKey::new(SCOPE, "evt-1").expect("key");
    let mut tx = store.begin().await.expect("begin");
    store
        .claim(
            &mut tx,
            &key,
            None,
            dedup_core::Ttl::parse("4h").expect("ttl"),
        )
        .await
        .expect("claim");
    store.commit(tx).await.expect("commit");
    let refused = Command::new(common::cli())
        .args(["console", "--listen", "0.0.0.0:0"])
        .env("DATABASE_URL", database_url(&pool))
        .env_remove("DEDUP_CONSOLE_TOKEN")
        .output()
        .expect("dedup console");
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("DEDUP_CONSOLE_TOKEN"), "{said}");

    let token = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    // Plain HTTP to a proxy that adds TLS in front (the browser here talks
    // to it directly).
    let (_console, url) = console(
        &pool,
        &["--listen", "0.0.0.0:0", "--behind-tls-proxy"],
        &[("DEDUP_CONSOLE_TOKEN", &token)],
    )
    .await;
    let (browser, _driver, _profile) = browser().await;
    browser
        .goto(&format!("{url}/claims"))
        .await
        .expect("claims");
    let page = text(&browser, "body").await;
    assert!(page.contains("needs its token"), "{page}");
    assert!(
        !page.contains("Per scope"),
        "nothing of the page shown: {page}"
    );
    screenshot(&browser, "sign-in").await;
    let source = browser.source().await.expect("source");
    assert!(
        !source.contains(&token) && !source.contains("dedup:dedup@"),
        "no secret in the HTML"
    );

    let form = browser
        .form(Locator::Css("form"))
        .await
        .expect("login form");
    form.set_by_name("token", "wrong-token-of-some-length")
        .await
        .expect("typed");
    form.submit().await.expect("sign in");
    wait_for_text(&browser, "not the console's token").await;

    let form = browser
        .form(Locator::Css("form"))
        .await
        .expect("login form");
    form.set_by_name("token", &token).await.expect("typed");
    form.submit().await.expect("sign in");
    let claims = wait_for_text(&browser, "Per scope").await;
    assert!(claims.contains("Find a claim"), "{claims}");
    let source = browser.source().await.expect("source");
    assert!(!source.contains(&token), "the token is never on a page");
    assert!(
        !source.contains(&database_url(&pool)),
        "nor the database's URL"
    );

    // A form posted from another site, even with the session and the
    // page's CSRF token, is refused.
    browser
        .goto(&format!(
            "{url}/claims?scope={}&key=evt-1",
            SCOPE.replace(':', "%3A")
        ))
        .await
        .expect("the claim");
    let csrf = browser
        .find(Locator::Css("input[name=csrf]"))
        .await
        .expect("a form's CSRF field")
        .attr("value")
        .await
        .expect("value")
        .expect("a token");
    let cookie = browser
        .get_named_cookie("dedup_console")
        .await
        .expect("the session cookie");
    let address = url.trim_start_matches("http://").to_owned();
    let request = format!(
        "POST /claims/release HTTP/1.1\r\nHost: {address}\r\nOrigin: http://evil.example\r\n\
         Cookie: dedup_console={}\r\nContent-Type: application/x-www-form-urlencoded\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        cookie.value(),
        format!("csrf={csrf}&scope=blockable%3A%3Arecord_payment&key=evt-1").len()
    ) + &format!("csrf={csrf}&scope=blockable%3A%3Arecord_payment&key=evt-1");
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::{Read as _, Write as _};
        let mut stream = std::net::TcpStream::connect(&address).expect("connect");
        stream.write_all(request.as_bytes()).expect("sent");
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer
    })
    .await
    .expect("join");
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    browser.refresh().await.expect("the claim again");
    assert!(
        text(&browser, "#claim").await.contains("live"),
        "the claim is still there"
    );

    // A form posted from elsewhere (no CSRF token) changes nothing.
    let forged: serde_json::Value = browser
        .execute(
            "return fetch('/claims/release', {method: 'POST', headers: {'Content-Type': \
             'application/x-www-form-urlencoded'}, body: 'scope=s&key=k&confirm=yes'}) \
             .then(r => r.status)",
            vec![],
        )
        .await
        .expect("fetch");
    assert_eq!(forged, serde_json::json!(403));
    browser.close().await.expect("close");
}

/// A read pauses each partition it has read to its range's end, and the
/// next read resumes them; librdkafka drops a resume that reaches the
/// partition after a newer request of its own thread (the next read's
/// assignment starting the fetch), and a search's next step found the
/// partition paused for good and gave up after 30 s (seen once, on a
/// loaded machine). With every resume after the first dropped (failpoint
/// `resume-lost`), a search deep in the topic still ends: while nothing
/// comes, the read resumes the partitions it still reads.
#[sqlx::test(migrations = false)]
async fn a_search_is_not_held_by_a_dropped_resume(pool: PgPool) {
    let dlq = format!("{}.dlq", unique("paused"));
    common::create_named_topic(&dlq, 3).await;
    let producer = producer();
    let mut sent = Vec::new();
    for n in 0..3_000 {
        let key = format!("k{n}");
        let record = FutureRecord::to(&dlq).key(&key).payload("{}");
        sent.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| e)
                .expect("queued"),
        );
    }
    for delivery in sent {
        delivery
            .await
            .expect("delivered")
            .map_err(|(e, _)| e)
            .expect("acknowledged");
    }
    let (_console, url) = console(
        &pool,
        &["--listen", "127.0.0.1:0", "--read-only"],
        &[("DEDUP_FAILPOINT", "resume-lost:2:1000")],
    )
    .await;
    let (browser, _driver, _profile) = browser().await;
    let started = Instant::now();
    browser
        .goto(&format!("{url}/dlq/{dlq}?q=k42"))
        .await
        .expect("search");
    wait_for_text(&browser, "records in the topic").await;
    let hits = keys(&browser).await;
    assert!(
        hits.contains(&"k42".to_owned()),
        "found in {:?}: {hits:?}",
        started.elapsed()
    );
    assert!(hits.iter().all(|k| k.contains("k42")), "{hits:?}");
    browser.close().await.expect("close");
}

/// A dead-letter topic of 100,000 records opens at its newest page by
/// reading back from each partition's end, not the whole topic: the page
/// says how many it read (the figure is printed; timing is the
/// benchmark's business on this shared machine, not a test's).
#[sqlx::test(migrations = false)]
async fn a_large_dead_letter_topic_opens_at_its_end(pool: PgPool) {
    const RECORDS: usize = 100_000;
    let dlq = format!("{}.dlq", unique("big"));
    common::create_named_topic(&dlq, 3).await;
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .create()
        .expect("producer");
    let started = Instant::now();
    let mut pending = Vec::with_capacity(RECORDS);
    for n in 0..RECORDS {
        let kind = if n % 10 == 0 { "decode" } else { "handler" };
        let headers = rdkafka::message::OwnedHeaders::new()
            .insert(rdkafka::message::Header {
                key: "dedup.error.kind",
                value: Some(kind),
            })
            .insert(rdkafka::message::Header {
                key: "dedup.error.message",
                value: Some("failed"),
            });
        let key = format!("k{n}");
        let record = FutureRecord::to(&dlq)
            .key(&key)
            .payload("{}")
            .headers(headers);
        pending.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| e)
                .expect("queued"),
        );
    }
    for delivery in pending {
        delivery
            .await
            .expect("delivered")
            .map_err(|(e, _)| e)
            .expect("acknowledged");
    }
    eprintln!(
        "produced {RECORDS} dead letters in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let (_console, url) = console(&pool, &["--listen", "127.0.0.1:0", "--read-only"], &[]).await;
    let (browser, _driver, _profile) = browser().await;
    let started = Instant::now();
    browser
        .goto(&format!("{url}/dlq/{dlq}"))
        .await
        .expect("the topic");
    let page = wait_for_text(&browser, "records in the topic").await;
    eprintln!(
        "first page of {RECORDS} dead letters in the browser: {} ms ({})",
        started.elapsed().as_millis(),
        page.lines()
            .find(|l| l.contains("records in the topic"))
            .unwrap_or("")
    );
    assert!(
        page.contains(&format!("{RECORDS} records in the topic")),
        "{page}"
    );
    let read: u64 = page
        .split("Read ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("how many it read");
    assert!(
        read <= 300,
        "read {read} records for one page: not from the end"
    );
    let first = keys(&browser).await;
    assert_eq!(first.len(), 50, "a page of the newest");
    let number = |key: &String| key.trim_start_matches('k').parse::<usize>().expect("k<n>");
    assert!(
        first.iter().all(|k| number(k) >= RECORDS - 300),
        "the newest (of the 100 read from each partition's end): {first:?}"
    );
    // The next page goes on below what this one read: 50 more, none again.
    click(&browser, Locator::Id("older")).await;
    wait_for_text(&browser, "records in the topic").await;
    let second = keys(&browser).await;
    assert_eq!(second.len(), 50);
    assert!(
        second.iter().all(|k| !first.contains(k)),
        "{first:?} then {second:?}"
    );

    // A search reads back step by step until it finds its match, deep in
    // the topic.
    let started = Instant::now();
    browser
        .goto(&format!("{url}/dlq/{dlq}?q=k12345"))
        .await
        .expect("search");
    let found = wait_for_text(&browser, "records in the topic").await;
    eprintln!(
        "search for one key among {RECORDS}: {} ms ({})",
        started.elapsed().as_millis(),
        found
            .lines()
            .find(|l| l.contains("records in the topic"))
            .unwrap_or("")
    );
    let hits = keys(&browser).await;
    assert!(hits.contains(&"k12345".to_owned()), "{hits:?}");
    assert!(hits.iter().all(|k| k.contains("k12345")), "{hits:?}");
    assert!(
        browser
            .find(Locator::Css("form[action$='/replay']"))
            .await
            .is_err(),
        "read-only: no replay form"
    );
    browser.close().await.expect("close");
}

/// How many claims the payment `id` holds in the test's scope.
async fn claims_of(pool: &PgPool, id: uuid::Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM dedup_claims WHERE scope = $1 AND key = $2")
        .bind(SCOPE)
        .bind(id.to_string())
        .fetch_one(pool)
        .await
        .expect("count")
}

/// The Kafka keys of the dead letters a topic page lists.
async fn keys(browser: &Client) -> Vec<String> {
    let mut keys = Vec::new();
    for cell in browser
        .find_all(Locator::Css("#letters tbody tr td:nth-child(3)"))
        .await
        .expect("rows")
    {
        keys.push(cell.text().await.expect("key"));
    }
    keys
}

/// A partition whose producers' clocks disagree (here, each record stamped
/// earlier than the one before) pages through every record once: a page
/// never reorders a partition, so "Older" neither repeats nor skips.
#[sqlx::test(migrations = false)]
async fn pages_go_through_every_dead_letter_once_whatever_the_clocks(pool: PgPool) {
    const RECORDS: usize = 120;
    let dlq = format!("{}.dlq", unique("skewed"));
    common::create_named_topic(&dlq, 1).await;
    let producer = producer();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    for n in 0..RECORDS {
        let key = format!("k{n}");
        producer
            .send(
                FutureRecord::to(&dlq)
                    .key(&key)
                    .payload("{}")
                    .timestamp(now_ms - 1000 * n as i64),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced");
    }
    let (_console, url) = console(&pool, &["--listen", "127.0.0.1:0"], &[]).await;
    let (browser, _driver, _profile) = browser().await;
    browser
        .goto(&format!("{url}/dlq/{dlq}"))
        .await
        .expect("the topic");
    let mut seen = Vec::new();
    for page in 1.. {
        wait_for_text(&browser, "records in the topic").await;
        seen.extend(keys(&browser).await);
        if browser.find(Locator::Id("older")).await.is_err() {
            break;
        }
        assert!(page < 10, "pages never end: {seen:?}");
        click(&browser, Locator::Id("older")).await;
    }
    let mut distinct = seen.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), seen.len(), "a record shown twice: {seen:?}");
    assert_eq!(seen.len(), RECORDS, "every record shown: {seen:?}");
    browser.close().await.expect("close");
}

/// A replay confirmed twice at once (a double click, two tabs) sends each
/// dead letter once: replays run one at a time, and the second finds the
/// plan its dry run showed already carried out, so it sends nothing.
#[sqlx::test(migrations = false)]
async fn a_replay_confirmed_twice_at_once_sends_once(pool: PgPool) {
    let store = migrated(&pool).await;
    let topic = create_topic(1).await;
    let dlq = format!("{topic}.dlq");
    let group = unique("g");
    block(&pool, "blocked-1").await;
    block(&pool, "blocked-2").await;
    produce(
        &topic,
        "blocked-1",
        &payment(uuid::Uuid::new_v4(), "blocked-1", 1),
    )
    .await;
    produce(
        &topic,
        "blocked-2",
        &payment(uuid::Uuid::new_v4(), "blocked-2", 2),
    )
    .await;
    let first = consume(&store, &topic, &group).await;
    assert_eq!(first.dead_lettered, 2, "{first:?}");
    unblock_all(&pool).await;

    let (_console, url) = console(&pool, &["--listen", "127.0.0.1:0"], &[]).await;
    let (browser, _driver, _profile) = browser().await;
    let dry = dry_run(&browser, &format!("{url}/dlq/{dlq}")).await;
    assert!(dry.contains("2 dead letters would be replayed"), "{dry}");
    let statuses = browser
        .execute(
            "const form = document.querySelector(\"form[action$='/replay']\"); \
             const body = new URLSearchParams(new FormData(form)); \
             const send = () => fetch(form.action, {method: 'POST', body: body}).then(r => r.status); \
             return Promise.all([send(), send()]);",
            vec![],
        )
        .await
        .expect("two confirmations");
    let statuses: Vec<u64> = serde_json::from_value(statuses).expect("statuses");
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "one replay, one refused: {statuses:?}"
    );
    assert_eq!(records_in(&topic), 4, "each dead letter sent home once");
    assert_eq!(replayed_into(&topic).await, 2);
    browser.close().await.expect("close");
}

/// A long random token.
fn console_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// The certificates scripts/tls.sh made.
fn tls_dir() -> String {
    std::env::var("DEDUP_TLS_DIR").unwrap_or_else(|_| "/var/tmp/dedup-tls".into())
}

/// The `dedup_console` cookie a `Set-Cookie` header gives, as a `Cookie`
/// header sends it back, with the attributes it was set with.
fn session_cookie(answer: &reqwest::Response) -> (String, String) {
    let set = answer
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .expect("a Set-Cookie header")
        .to_owned();
    let pair = set.split(';').next().expect("name=value").trim().to_owned();
    (pair, set)
}

/// The CSRF token of the first form on a page.
fn csrf_of(page: &str) -> String {
    let field = "name=\"csrf\" value=\"";
    let at = page.find(field).expect("a CSRF field") + field.len();
    page[at..].split('"').next().expect("its value").to_owned()
}

/// On another address the console serves HTTPS itself (or refuses to start
/// in clear): pages over TLS verified against the certificate's CA, plain
/// HTTP to it answered with nothing; a session lasts 8 hours, is sent only
/// over TLS, and ends at sign-out for good; five wrong tokens in a minute
/// and the right one is refused too.
#[sqlx::test(migrations = false)]
async fn the_console_serves_https_ends_sessions_and_limits_wrong_tokens(pool: PgPool) {
    let _store = store(&pool).await;
    let token = console_token();
    let tls = tls_dir();
    let in_clear = Command::new(common::cli())
        .args(["console", "--listen", "0.0.0.0:0"])
        .env("DATABASE_URL", database_url(&pool))
        .env("DEDUP_CONSOLE_TOKEN", &token)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dedup console");
    let mut in_clear = Killed(in_clear);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = in_clear.0.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "a console on 0.0.0.0 without TLS started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!status.success(), "served a token in clear");
    let mut said = String::new();
    std::io::Read::read_to_string(in_clear.0.stderr.as_mut().expect("stderr"), &mut said)
        .expect("its error");
    assert!(said.contains("--tls-cert"), "{said}");

    let (cert, key) = (format!("{tls}/server.pem"), format!("{tls}/server.key"));
    let (_console, url) = console(
        &pool,
        &[
            "--listen",
            "0.0.0.0:0",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ],
        &[("DEDUP_CONSOLE_TOKEN", &token)],
    )
    .await;
    assert!(url.starts_with("https://"), "{url}");
    let url = url.replacen("127.0.0.1", "localhost", 1);
    let ca = std::fs::read(format!("{tls}/ca.pem")).expect("the test CA");
    let client = reqwest::Client::builder()
        .no_proxy()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).expect("a PEM certificate"))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let plain = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .get(url.replacen("https://", "http://", 1) + "/login")
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(
        !plain.as_ref().is_ok_and(|r| r.status().is_success()),
        "plain HTTP got a page: {plain:?}"
    );

    let page = client
        .get(format!("{url}/claims"))
        .send()
        .await
        .expect("over TLS");
    assert_eq!(page.status(), 401);
    let signed_in = client
        .post(format!("{url}/login"))
        .form(&[("token", token.as_str()), ("next", "/claims")])
        .send()
        .await
        .expect("sign in");
    assert_eq!(signed_in.status(), 303);
    let (session, set) = session_cookie(&signed_in);
    assert!(
        set.contains("Secure") && set.contains("HttpOnly") && set.contains("Max-Age=28800"),
        "{set}"
    );
    let claims = client
        .get(format!("{url}/claims"))
        .header(reqwest::header::COOKIE, &session)
        .send()
        .await
        .expect("claims");
    assert_eq!(claims.status(), 200);
    let claims = claims.text().await.expect("page");
    assert!(claims.contains("Sign out"), "{claims}");

    let signed_out = client
        .post(format!("{url}/logout"))
        .header(reqwest::header::COOKIE, &session)
        .form(&[("csrf", csrf_of(&claims))])
        .send()
        .await
        .expect("sign out");
    assert_eq!(signed_out.status(), 303);
    let (_, cleared) = session_cookie(&signed_out);
    assert!(cleared.contains("Max-Age=0"), "{cleared}");
    let after = client
        .get(format!("{url}/claims"))
        .header(reqwest::header::COOKIE, &session)
        .send()
        .await
        .expect("claims");
    assert_eq!(after.status(), 401, "the ended session still works");

    for _ in 0..5 {
        let wrong = client
            .post(format!("{url}/login"))
            .form(&[("token", "a-wrong-token-of-some-length")])
            .send()
            .await
            .expect("wrong token");
        assert_eq!(wrong.status(), 401);
    }
    let limited = client
        .post(format!("{url}/login"))
        .form(&[("token", token.as_str())])
        .send()
        .await
        .expect("right token");
    assert_eq!(limited.status(), 429, "a sixth try in the minute");
}

/// Sends `request` on `stream` and reads the answer's status line, waiting
/// at most `limit`; `None` if none came.
fn status_line(stream: &mut std::net::TcpStream, request: &str, limit: Duration) -> Option<String> {
    use std::io::{Read as _, Write as _};
    stream.write_all(request.as_bytes()).expect("sent");
    stream.set_read_timeout(Some(limit)).expect("timeout");
    let mut answer = Vec::new();
    let mut buf = [0u8; 512];
    while !answer.windows(2).any(|w| w == b"\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    text.lines().next().map(str::to_owned)
}

/// Behind a TLS proxy: a POST without credentials announcing a 1 MB form
/// it never sends is refused at once, its body unread (not after the 10 s
/// the console gives a form); beyond `--max-connections`, a connection
/// waits until another ends.
#[sqlx::test(migrations = false)]
async fn the_console_checks_credentials_before_bodies_and_caps_connections(pool: PgPool) {
    let token = console_token();
    let (_console, url) = console(
        &pool,
        &[
            "--listen",
            "0.0.0.0:0",
            "--behind-tls-proxy",
            "--max-connections",
            "2",
        ],
        &[("DEDUP_CONSOLE_TOKEN", &token)],
    )
    .await;
    let address = url.trim_start_matches("http://").to_owned();
    tokio::task::spawn_blocking(move || {
        let connect = || std::net::TcpStream::connect(&address).expect("connect");
        let started = Instant::now();
        let unread = format!(
            "POST /claims/release HTTP/1.1\r\nHost: {address}\r\nContent-Type: \
             application/x-www-form-urlencoded\r\nContent-Length: 1000000\r\n\r\n"
        );
        let mut refused = connect();
        let line = status_line(&mut refused, &unread, Duration::from_secs(5));
        assert_eq!(line.as_deref(), Some("HTTP/1.1 401 Unauthorized"));
        assert!(started.elapsed() < Duration::from_secs(5));
        // Closed by the console (its place given back) before the next.
        let mut rest = Vec::new();
        let _ = std::io::Read::read_to_end(&mut refused, &mut rest);

        // Two idle connections hold both places.
        let first = connect();
        let _second = connect();
        std::thread::sleep(Duration::from_millis(300));
        let get = format!("GET /login HTTP/1.1\r\nHost: {address}\r\n\r\n");
        let mut third = connect();
        assert_eq!(
            status_line(&mut third, &get, Duration::from_secs(1)),
            None,
            "a third connection was served beside two"
        );
        drop(first);
        use std::io::Read as _;
        let mut rest = Vec::new();
        third
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = [0u8; 512];
        while !rest.windows(4).any(|w| w == b"\r\n\r\n") {
            match third.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => rest.extend_from_slice(&buf[..n]),
            }
        }
        let answer = String::from_utf8_lossy(&rest);
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "served once the first ended: {answer}"
        );
    })
    .await
    .expect("join");
}
