//! The console's layout, and the pages of the claims and the outbox.

use dedup_core::admin::ClaimRecord;
use hyper::StatusCode;
use maud::{DOCTYPE, Markup, html};

use super::{Answer, Asked, Console, log_action};
use crate::claims::Claims;
use crate::time::{human_seconds, rfc3339};

/// The stylesheet: plain CSS, readable on a laptop and a phone.
const CSS: &str = include_str!("console.css");

/// The overview's refresh, and forms that change something sent once.
/// Vendored: nothing is fetched from elsewhere.
const JS: &str = include_str!("console.js");

/// `/assets/...`.
pub(crate) fn asset(path: &[String]) -> Answer {
    match path.get(1).map(String::as_str) {
        Some("console.css") => Answer::Asset("text/css; charset=utf-8", CSS),
        Some("console.js") => Answer::Asset("text/javascript; charset=utf-8", JS),
        _ => Answer::Asset("text/plain; charset=utf-8", ""),
    }
}

/// A whole page: the menu, `title`, then `body`.
pub(crate) fn layout(console: Option<&Console>, title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · dedup console" }
                link rel="stylesheet" href="/assets/console.css";
                script src="/assets/console.js" defer {}
            }
            body {
                header {
                    a.brand href="/" { "dedup" }
                    nav {
                        a href="/" { "Overview" }
                        a href="/dlq" { "Dead letters" }
                        a href="/claims" { "Claims" }
                        a href="/outbox" { "Outbox" }
                    }
                    @if console.is_some_and(Console::read_only) {
                        span.badge { "read-only" }
                    }
                    @if let Some(console) = console.filter(|c| c.needs_token()) {
                        form.signout method="post" action="/logout" {
                            (csrf(console))
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// A page that only says something.
pub(crate) fn message(console: &Console, title: &str, text: &str) -> Markup {
    layout(Some(console), title, html! { p.notice { (text) } })
}

/// A failure on a page: what went wrong, as the operator tool says it.
pub(crate) fn failed(console: &Console, title: &str, failure: &crate::Failure) -> Answer {
    Answer::Page(
        StatusCode::BAD_GATEWAY,
        layout(
            Some(console),
            title,
            html! { p.error { (failure.to_string()) } },
        ),
    )
}

/// The login form (only on a console with a token).
pub(crate) fn login(next: &str, wrong: Option<&str>) -> Markup {
    layout(
        None,
        "Sign in",
        html! {
            @if let Some(wrong) = wrong { p.error { (wrong) } }
            p { "This console needs its token (" code { "DEDUP_CONSOLE_TOKEN" } ")." }
            form method="post" action="/login" {
                input type="hidden" name="next" value=(next);
                label { "Token " input type="password" name="token" autocomplete="current-password" autofocus; }
                button type="submit" { "Sign in" }
            }
        },
    )
}

/// The hidden field every form that changes something carries.
pub(crate) fn csrf(console: &Console) -> Markup {
    html! { input type="hidden" name="csrf" value=(console.csrf()); }
}

/// The page for a console started without `--database-url`.
fn no_database(console: &Console, title: &str) -> Answer {
    Answer::Page(
        StatusCode::OK,
        layout(
            Some(console),
            title,
            html! {
                p.notice {
                    "No database: start the console with " code { "--database-url" }
                    " (or " code { "DATABASE_URL" } ") to see claims and the outbox."
                }
            },
        ),
    )
}

/// `/claims`: the claims per scope, and one claim by scope and key.
pub(crate) async fn claims(console: &Console, asked: &Asked) -> Answer {
    let Some(db) = console.db() else {
        return no_database(console, "Claims");
    };
    let claims = match Claims::connect(db).await {
        Ok(claims) => claims,
        Err(e) => return failed(console, "Claims", &e),
    };
    let scope = asked.query.get("scope").unwrap_or("").to_owned();
    let parts: Vec<String> = asked
        .query
        .all("key")
        .into_iter()
        // As given: an id with a space is another id (an empty field is
        // one left blank, not a part).
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect();
    let found = if scope.is_empty() || parts.is_empty() {
        None
    } else {
        Some(lookup(&claims, &scope, &parts).await)
    };
    let stats = claims.stats().await;
    let body = html! {
        section {
            h2 { "Find a claim" }
            form.inline method="get" action="/claims" {
                label { "Scope " input name="scope" value=(scope) placeholder="payments::record_payment" size="40"; }
                @for part in parts.iter().map(String::as_str).chain((parts.is_empty()).then_some("")) {
                    label { "Key " input name="key" value=(part) placeholder="event id"; }
                }
                button type="submit" { "Find" }
            }
            p.hint { "A composite key (" code { "key = \"tenant_id, event_id\"" } "): one Key per part, in the attribute's order; add parts as "
                code { "?key=a&key=b" } "." }
            @match &found {
                None => {}
                Some(Err(e)) => p.error { (e.to_string()) },
                Some(Ok((_, key, None))) => p.notice { "No claim for " code { (key) } ": a delivery of this event would apply it." },
                Some(Ok((_, key, Some(record)))) => (claim_card(console, &scope, &parts, key, record)),
            }
        }
        section {
            h2 { "Per scope" }
            @match &stats {
                Err(e) => p.error { (e.to_string()) },
                Ok(stats) => (stats_table(stats)),
            }
        }
    };
    Answer::Page(StatusCode::OK, layout(Some(console), "Claims", body))
}

/// The id as given (composite parts joined), the key as stored, the claim.
type Found = (String, dedup_core::DedupKey, Option<ClaimRecord>);

async fn lookup(claims: &Claims, scope: &str, parts: &[String]) -> Result<Found, crate::Failure> {
    let id = crate::ClaimKey {
        scope: scope.to_owned(),
        key: parts.to_vec(),
    }
    .id()?;
    let key = Claims::key(scope, &id)?;
    let record = claims.record(&key).await?;
    Ok((id, key, record))
}

fn claim_card(
    console: &Console,
    scope: &str,
    parts: &[String],
    key: &dedup_core::DedupKey,
    record: &ClaimRecord,
) -> Markup {
    let state = crate::claims::state(record);
    html! {
        div.card id="claim" {
            h3 { "Claim " code { (key) } }
            dl {
                dt { "state" } dd.state { (state) }
                dt { "claimed at" } dd { (rfc3339(record.claimed_at)) " (database clock)" }
                dt { "expires at" } dd { (rfc3339(record.expires_at)) }
                dt { "fingerprint" } dd { @match record.fingerprint { Some(f) => code { (f.to_string()) }, None => "none" } }
                dt { "lease" } dd { @if record.in_progress { "in progress" } @else { "none" } }
            }
            @if !console.read_only() {
                form method="post" action="/claims/release" {
                    (csrf(console))
                    input type="hidden" name="scope" value=(scope);
                    @for part in parts { input type="hidden" name="key" value=(part); }
                    button.danger type="submit" { "Release…" }
                }
            }
        }
    }
}

fn stats_table(stats: &crate::claims::StatsReport) -> Markup {
    let (rows, live) = stats
        .scopes
        .iter()
        .fold((0, 0), |(rows, live), s| (rows + s.rows, live + s.live));
    html! {
        p { (rows) " claims, " (live) " live, " (rows - live) " expired (waiting for the purge)" }
        @if stats.scopes.is_empty() {
            p.notice { "No claims yet." }
        } @else {
            div.scroll { table {
                thead { tr { th { "scope" } th.num { "claims" } th.num { "live" } th.num { "expired" } th { "expiries" } } }
                tbody {
                    @for s in &stats.scopes {
                        tr {
                            td { a href={ "/claims?scope=" (encode(&s.scope)) } { code { (s.scope) } } }
                            td.num { (s.rows) } td.num { (s.live) } td.num { (s.rows - s.live) }
                            td.small { (rfc3339(s.oldest_expiry)) " … " (rfc3339(s.newest_expiry)) }
                        }
                    }
                }
            } }
        }
    }
}

/// A query value, percent-encoded.
pub(crate) fn encode(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

/// `POST /claims/release`: the confirmation, then the release.
pub(crate) async fn release(console: &Console, asked: &Asked) -> Answer {
    let Some(db) = console.db() else {
        return no_database(console, "Release a claim");
    };
    let scope = asked.form.get("scope").unwrap_or("").to_owned();
    let parts: Vec<String> = asked
        .form
        .all("key")
        .into_iter()
        .map(str::to_owned)
        .collect();
    let claims = match Claims::connect(db).await {
        Ok(claims) => claims,
        Err(e) => return failed(console, "Release a claim", &e),
    };
    let (id, key, record) = match lookup(&claims, &scope, &parts).await {
        Ok(found) => found,
        Err(e) => return failed(console, "Release a claim", &e),
    };
    let claim_url = format!(
        "/claims?scope={}{}",
        encode(&scope),
        parts
            .iter()
            .map(|p| format!("&key={}", encode(p)))
            .collect::<String>()
    );
    let back = html! { p { a href=(claim_url) { "Back to the claim" } } };
    if record.is_none() {
        return Answer::Page(
            StatusCode::OK,
            layout(
                Some(console),
                "Release a claim",
                html! { p.notice { "No claim for " code { (key) } ": nothing to release." } (back) },
            ),
        );
    }
    // The claim confirmed is the one released: taken again since (it
    // expired and another delivery claimed it), it is another claim.
    let taken_at = record
        .as_ref()
        .map(|r| rfc3339(r.claimed_at))
        .unwrap_or_default();
    if asked.form.get("confirm") == Some("yes")
        && asked.form.get("claimed_at") != Some(taken_at.as_str())
    {
        return Answer::Page(
            StatusCode::CONFLICT,
            layout(
                Some(console),
                "Release a claim",
                html! { p.warning { "The claim " code { (key) } " was taken again since you looked (claimed at " (taken_at) "): nothing was released. Look at it again." } (back) },
            ),
        );
    }
    if asked.form.get("confirm") != Some("yes") {
        let body = html! {
            p.warning {
                "Releasing " code { (key) } " lets its event be applied again when it is delivered again "
                "(a replay, a rewind, a producer's retry). Release it only if its effect was undone or never happened."
            }
            form method="post" action="/claims/release" {
                (csrf(console))
                input type="hidden" name="scope" value=(scope);
                @for part in &parts { input type="hidden" name="key" value=(part); }
                input type="hidden" name="claimed_at" value=(taken_at);
                input type="hidden" name="confirm" value="yes";
                button.danger type="submit" { "Release the claim" }
                " "
                a href=(claim_url) { "Cancel" }
            }
        };
        return Answer::Page(
            StatusCode::OK,
            layout(Some(console), "Release a claim?", body),
        );
    }
    match claims.release(&scope, &id).await {
        Ok(_) => {
            log_action(asked, &format!("released claim {key}"));
            let expires = record.map(|r| rfc3339(r.expires_at)).unwrap_or_default();
            let body = html! {
                p.done { "Released " code { (key) } " (it was to expire at " (expires) ")." }
                (back)
            };
            Answer::Page(
                StatusCode::OK,
                layout(Some(console), "Claim released", body),
            )
        }
        Err(e) => failed(console, "Release a claim", &e),
    }
}

/// `/outbox`: pending, leased and failing events per topic, oldest age.
pub(crate) async fn outbox(console: &Console) -> Answer {
    let Some(db) = console.db() else {
        return no_database(console, "Outbox");
    };
    let topics = match crate::outbox::pending(&db.database_url, console.outbox_table()).await {
        Ok(report) => report.topics,
        Err(e) => return failed(console, "Outbox", &e),
    };
    let pending: u64 = topics.iter().map(|t| t.pending).sum();
    let body = html! {
        p { "Table " code { (console.outbox_table()) } ": " (pending) " events pending." }
        @if topics.is_empty() {
            p.notice { "Nothing pending: every enqueued event is in Kafka." }
        } @else {
            div.scroll { table {
                thead { tr { th { "topic" } th.num { "pending" } th.num { "leased" } th.num { "lease expired" } th.num { "failing" } th { "oldest waiting" } th { "last error" } } }
                tbody {
                    @for t in &topics {
                        tr {
                            td { code { (t.topic) } }
                            td.num { (t.pending) } td.num { (t.leased) } td.num { (t.lease_expired) }
                            td.num { (t.failing) }
                            td { (human_seconds(t.oldest_age.as_secs_f64())) }
                            td.small { (t.last_error.as_deref().unwrap_or("")) }
                        }
                    }
                }
            } }
        }
    };
    Answer::Page(StatusCode::OK, layout(Some(console), "Outbox", body))
}
