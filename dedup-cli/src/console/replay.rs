//! The replay page: `dlq replay` itself from the console, its dry run shown
//! first and the replay only once confirmed.

use dedup_core::Ttl;
use hyper::StatusCode;
use maud::{Markup, html};

use super::pages::{csrf, failed, layout};
use super::{Answer, Asked, Console};
use crate::dlq::{Pinned, ReplayArgs, Selection};
use crate::{Failure, Report as _};

use super::reading::{Filter, valid_topic};

pub(super) fn replay_form(console: &Console, topic: &str, filter: &Filter) -> Markup {
    // "(none)" is how a page names letters without a kind; no replay
    // selects it.
    let kind = filter
        .kind
        .as_deref()
        .filter(|k| *k != "(none)")
        .unwrap_or("");
    html! {
        section.card {
            h2 { "Replay" }
            p.hint {
                "Sends dead letters back to their original topics, once per original message, as "
                code { "dedup dlq replay" } " does. You see a dry run first."
                @if console.db().is_some() { " With a key, events that already hold a live claim (in the scope given, or in each dead letter's own handler's) are left out: applied through another copy." }
            }
            form method="post" action={ "/dlq/" (topic) "/replay" } {
                (csrf(console))
                label { "Kind " input name="kind" value=(kind) placeholder="any"; }
                label { "Original partition " input name="partition" inputmode="numeric" placeholder="any" size="4"; }
                label { "Dead-lettered within " input name="since" placeholder="e.g. 2h" size="6"; }
                @if console.db().is_some() {
                    label { "Handler scope " input name="scope" placeholder="each letter's dedup.handler" size="40"; }
                    label { "Key " input name="key" value=(console.key()) size="20"; }
                }
                label.check { input type="checkbox" name="skip_invalid" value="yes"; " leave out records whose dedup headers cannot be read" }
                button type="submit" { "Dry run" }
            }
        }
    }
}

/// `POST /dlq/<topic>/replay`: the dry run, then (confirmed) the replay.
pub(crate) async fn replay(console: &Console, topic: &str, asked: &Asked) -> Answer {
    if !valid_topic(topic) {
        return super::not_found(console);
    }
    let form = &asked.form;
    let since = match form.get("since").map(Ttl::parse).transpose() {
        Ok(since) => since,
        Err(e) => return failed(console, "Replay", &Failure::new(format!("within: {e}"))),
    };
    let partition = match form.get("partition").map(str::parse::<i32>).transpose() {
        Ok(p) => p,
        Err(_) => {
            return failed(
                console,
                "Replay",
                &Failure::new("the original partition is a number"),
            );
        }
    };
    // With a database and a key, claims are checked: in the scope given,
    // or each letter's own handler's.
    let check_claims = match (console.db(), form.get("key")) {
        (Some(_), Some(key)) => Some((form.get("scope").map(str::to_owned), key.to_owned())),
        _ => None,
    };
    let confirmed = form.get("confirm") == Some("yes");
    let pinned = match (confirmed, form.get("pinned").map(Pinned::parse)) {
        (false, _) => None,
        (true, Some(Some(pinned))) => Some(pinned),
        (true, _) => {
            return failed(
                console,
                "Replay",
                &Failure::new("a replay is confirmed after its dry run: run the dry run again"),
            );
        }
    };
    let selection = Selection {
        kind: form.get("kind").map(str::to_owned),
        partition,
        since,
        check_claims: check_claims.clone(),
        skip_invalid: form.get("skip_invalid") == Some("yes"),
        pinned,
    };
    let args = ReplayArgs::chosen(
        console.kafka().clone(),
        topic.to_owned(),
        selection,
        console.db(),
        !confirmed,
    );
    let what = format!(
        "dead letters of {topic} (kind {}, original partition {}, within {}, claims {}{})",
        form.get("kind").unwrap_or("any"),
        form.get("partition").unwrap_or("any"),
        form.get("since").unwrap_or("any"),
        check_claims
            .as_ref()
            .map_or("not checked".to_owned(), |(scope, key)| format!(
                "checked by {key} in {}",
                scope.as_deref().unwrap_or("each letter's handler's scope")
            )),
        if form.get("skip_invalid") == Some("yes") {
            ", unreadable headers left out"
        } else {
            ""
        },
    );
    let outcome = if confirmed {
        // One replay at a time; a second confirmation of the same dry run
        // then finds the first one's work done, and sends nothing.
        let turn = console.replaying().clone().lock_owned().await;
        super::log_action(asked, &format!("replay of {what} started"));
        let (asked_at, remote) = (asked.path.join("/"), asked.remote);
        // Detached from the request: a browser that goes away does not
        // stop a replay between sending and committing.
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            // A panic is logged too, then ends the request as a failure.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                runtime.block_on(crate::dlq::replay(&args))
            }))
            .unwrap_or_else(|_| Err(Failure::new("the replay panicked (see the log)")));
            let said = match &outcome {
                Ok(report) => {
                    let json = report.json();
                    let n = |name: &str| json[name].as_u64().unwrap_or(0);
                    format!(
                        "replayed {} {what}: skipped {} applied, {} copies, {} truncated, {} \
                         invalid, {} filtered, {} replayed earlier",
                        n("replayed"),
                        n("skipped_applied"),
                        n("skipped_copies"),
                        n("skipped_truncated"),
                        n("skipped_invalid"),
                        n("skipped_filtered"),
                        n("already_replayed"),
                    )
                }
                Err(e) => format!("replay of {what} failed: {e}"),
            };
            super::log(&asked_at, remote, &said);
            outcome
        })
        .await
        .unwrap_or_else(|e| Err(Failure::new(format!("the replay failed: {e}"))))
    } else {
        // Off the server's threads: a replay's Kafka calls block.
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || runtime.block_on(crate::dlq::replay(&args)))
            .await
            .unwrap_or_else(|e| Err(Failure::new(format!("the dry run failed: {e}"))))
    };
    let (report, pinned) = match outcome {
        Ok(report) => (report.json(), report.pinned.text()),
        Err(e) => return failed(console, "Replay", &e),
    };
    let count = |name: &str| report[name].as_u64().unwrap_or(0);
    let lines: Vec<&str> = report["records"]
        .as_array()
        .map(|a| a.iter().filter_map(|l| l.as_str()).collect())
        .unwrap_or_default();
    let rows = [
        (
            if confirmed {
                "replayed"
            } else {
                "would replay"
            },
            if confirmed {
                "replayed"
            } else {
                "would_replay"
            },
        ),
        ("skipped: applied already (live claim)", "skipped_applied"),
        ("skipped: copies of one original", "skipped_copies"),
        ("skipped: payload cut", "skipped_truncated"),
        ("left out by the selection", "skipped_filtered"),
        ("replayed by an earlier run", "already_replayed"),
    ];
    let body = html! {
        @if confirmed {
            p.done id="replay-result" { "Replayed " (count("replayed")) " dead letters of " code { (topic) } "." }
        } @else {
            p.notice id="replay-result" { "Dry run: nothing was sent. " (count("would_replay")) " dead letters would be replayed." }
        }
        div.scroll { table id="replay-counts" {
            tbody { @for (label, name) in rows { tr { th { (label) } td.num data-name=(name) { (count(name)) } } } }
        } }
        @if !confirmed && count("would_replay") > 0 {
            form method="post" action={ "/dlq/" (topic) "/replay" } {
                (csrf(console))
                @for name in ["kind", "partition", "since", "scope", "key", "skip_invalid"] {
                    @if let Some(value) = form.get(name) { input type="hidden" name=(name) value=(value); }
                }
                input type="hidden" name="pinned" value=(pinned);
                input type="hidden" name="confirm" value="yes";
                button.danger type="submit" { "Replay " (count("would_replay")) " dead letters" }
                " " a href={ "/dlq/" (topic) } { "Cancel" }
            }
        }
        @if !lines.is_empty() {
            h2 { "Records" }
            pre.small { @for line in lines.iter().take(500) { (line) "\n" } @if lines.len() > 500 { "… and " (lines.len() - 500) " more\n" } }
        }
        p { a href={ "/dlq/" (topic) } { "Back to " (topic) } }
    };
    let title = if confirmed {
        "Replayed"
    } else {
        "Replay: dry run"
    };
    Answer::Page(StatusCode::OK, layout(Some(console), title, body))
}
