//! The console's pages, written with maud: HTML checked when the crate compiles, every
//! value escaped, no script.

use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use maud::{html, Markup, PreEscaped, DOCTYPE};

use super::Frame;
use crate::operate::{
    format_time, Abandoned, AuditEntry, BlockedKey, DeadDetail, DeadReason, DeadSelection,
    KeyCounts, KeyDetail, KeyFilter, KeySummary, Lease, StepRecord, TopicPending,
};
use crate::outbox::DeadEvent;
use crate::Outcome;

const STYLE: &str = "
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f8fa}
header{background:#1b1f24;color:#fff;padding:.6em 1.2em;display:flex;gap:1.4em;align-items:baseline}
header a{color:#c9d1d9;text-decoration:none}header a:hover{color:#fff}
header strong{font-size:1.1em;margin-right:1em}
main{padding:1em 1.2em;max-width:1100px}
section{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:.6em 1em;margin:0 0 1em}
h1{font-size:1.3em;margin:.2em 0 .6em}h2{font-size:1.05em;margin:.2em 0 .5em}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.25em .6em;border-bottom:1px solid #eaeef2;vertical-align:top}
th{font-weight:600;color:#57606a}td.n{text-align:right;font-variant-numeric:tabular-nums}
td.at{white-space:nowrap}
code,pre{font:12px ui-monospace,monospace}td code{word-break:break-all}pre{background:#f6f8fa;padding:.5em;overflow:auto}
.notice{background:#dafbe1;border-color:#4ac26b}.muted{color:#57606a}
.warn{background:#fff8c5;border-color:#d4a72c}.outside{color:#9a6700;font-weight:600}
form.inline{display:inline}button{font:inherit;padding:.15em .7em;cursor:pointer}
button.danger{color:#cf222e}input[type=text]{font:inherit;width:12em}
.chart{background:#fff;max-width:100%}
";

/// `text` for a URL's query: unreserved characters as they are, every other byte as
/// `%XX`.
pub(crate) fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Seconds as a reader takes them in: `0.4 s`, `12 s`, `3 min`, `2.5 h`, `3 d`.
pub(crate) fn seconds(secs: f64) -> String {
    if secs < 10.0 {
        let rounded = (secs * 10.0).round() / 10.0;
        format!("{rounded} s")
    } else if secs < 120.0 {
        format!("{} s", secs.round())
    } else if secs < 7_200.0 {
        format!("{} min", (secs / 60.0).round())
    } else if secs < 172_800.0 {
        format!("{} h", (secs / 360.0).round() / 10.0)
    } else {
        format!("{} d", (secs / 8_640.0).round() / 10.0)
    }
}

fn ago(d: Duration) -> String {
    seconds(d.as_secs_f64())
}

fn until(t: SystemTime) -> String {
    match t.duration_since(SystemTime::now()) {
        Ok(left) => format!("{} (in {})", format_time(t), ago(left)),
        Err(_) => format_time(t),
    }
}

fn layout(frame: &Frame, title: &str, body: Markup) -> Markup {
    let base = &frame.base;
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="referrer" content="no-referrer";
                title { (title) " · idem" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    strong { "idem" }
                    // Mounted with `Router::nest`, the overview is the base itself.
                    a href=(if base.is_empty() { "/" } else { base.as_str() }) { "Overview" }
                    a href=(format!("{base}/keys")) { "Keys" }
                    a href=(format!("{base}/abandoned")) { "Abandoned" }
                    a href=(format!("{base}/outbox")) { "Outbox" }
                    a href=(format!("{base}/dead")) { "Dead events" }
                    a href=(format!("{base}/audit")) { "Audit" }
                    @if frame.token.is_none() {
                        span.muted { "read-only" }
                    }
                }
                main {
                    @if let Some(notice) = &frame.notice {
                        section.notice role="status" { (notice) }
                    }
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// A POST form of the console: the action under the base, the CSRF token, `fields`
/// hidden, one button. Nothing when actions are off.
fn action(frame: &Frame, path: &str, fields: &[(&str, &str)], label: &str, danger: bool) -> Markup {
    let Some(token) = &frame.token else {
        return html! {};
    };
    html! {
        form.inline method="post" action=(format!("{}{path}", frame.base)) {
            input type="hidden" name="csrf" value=(token);
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            button class=[danger.then_some("danger")] type="submit" { (label) }
        }
    }
}

pub(crate) fn error(status: StatusCode, message: &str) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head { meta charset="utf-8"; title { (status) " · idem" } style { (PreEscaped(STYLE)) } }
            body { main { h1 { (status) } p { (message) } } }
        }
    }
}

pub(crate) fn overview(
    frame: &Frame,
    counts: &[KeyCounts],
    outcomes: &Option<Vec<(String, Outcome, u64)>>,
    reasons: &[DeadReason],
    pending: &[TopicPending],
    lag: Option<Duration>,
    chart: Markup,
) -> Markup {
    let count = |scope: &str, outcome: Outcome| -> u64 {
        outcomes
            .iter()
            .flatten()
            .filter(|(s, o, _)| s == scope && *o == outcome)
            .map(|(_, _, n)| n)
            .sum()
    };
    let pending_total: u64 = pending.iter().map(|p| p.events).sum();
    let dead_total: u64 = reasons.iter().map(|r| r.events).sum();
    let base = &frame.base;
    let body = html! {
        section {
            h2 { "Records per scope" }
            @if counts.is_empty() {
                p.muted { "No records." }
            } @else {
                table {
                    tr {
                        th { "scope" } th { "live" } th { "expiring within the hour" } th { "expired, not yet swept" }
                        @if outcomes.is_some() {
                            th { "fresh" } th { "replayed" } th { "409 in use" } th { "422 mismatch" }
                        }
                    }
                    @for c in counts {
                        tr {
                            td { a href=(format!("{base}/keys?scope={}", encode(&c.scope))) { code { (c.scope) } } }
                            td.n { (c.live) } td.n { (c.expiring) } td.n { (c.expired) }
                            @if outcomes.is_some() {
                                td.n { (count(&c.scope, Outcome::Fresh)) }
                                td.n { (count(&c.scope, Outcome::Replayed)) }
                                td.n { (count(&c.scope, Outcome::Conflict)) }
                                td.n { (count(&c.scope, Outcome::Mismatch)) }
                            }
                        }
                    }
                }
                @if outcomes.is_some() {
                    p.muted { "Requests are counted by this process since it started (feature " code { "metrics" } ")." }
                }
            }
        }
        section {
            h2 { "Outbox" }
            p {
                (pending_total) " pending"
                @if let Some(lag) = lag { ", the oldest " (ago(lag)) " old" }
                ". " a href=(format!("{base}/outbox")) { "Pending, leases and blocked keys" }
            }
            h2 { "Lag over the last hour" }
            (chart)
        }
        section {
            h2 { "Dead events by reason" }
            @if reasons.is_empty() {
                p.muted { "No dead events." }
            } @else {
                (reason_table(frame, reasons))
                p {
                    a href=(format!("{base}/dead")) { "All " (dead_total) " dead events" }
                }
            }
        }
    };
    layout(frame, "Overview", body)
}

fn reason_table(frame: &Frame, reasons: &[DeadReason]) -> Markup {
    html! {
        table.reasons {
            tr { th { "reason" } th { "events" } th { "topics" } th { "parked" } @if frame.token.is_some() { th {} } }
            @for r in reasons {
                tr {
                    td { code { (r.reason) } }
                    td.n { (r.events) }
                    td { @for t in &r.topics { code { (t) } " " } }
                    td {
                        @if ago(r.newest) == ago(r.oldest) { (ago(r.oldest)) " ago" }
                        @else { (ago(r.newest)) " to " (ago(r.oldest)) " ago" }
                    }
                    @if frame.token.is_some() {
                        td {
                            (action(frame, "/dead/redrive", &[("reason", &r.reason)], "Re-drive these", false))
                            " "
                            (action(frame, "/dead/discard", &[("reason", &r.reason)], "Discard these", true))
                        }
                    }
                }
            }
        }
    }
}

pub(crate) fn keys(
    frame: &Frame,
    filter: &KeyFilter,
    older_than: &str,
    listed: &[KeySummary],
) -> Markup {
    let base = &frame.base;
    let body = html! {
        section {
            h2 { "Look up a key" }
            form method="get" action=(format!("{base}/key")) {
                label { "scope " input type="text" name="scope" required; } " "
                label { "principal " input type="text" name="principal" placeholder="none"; } " "
                label { "key " input type="text" name="key" required; } " "
                button type="submit" { "Look up" }
            }
        }
        section {
            h2 { "Records" }
            form method="get" action=(format!("{base}/keys")) {
                label { "scope " input type="text" name="scope" value=(filter.scope.as_deref().unwrap_or("")); } " "
                label { "principal " input type="text" name="principal" value=(filter.principal.as_deref().unwrap_or("")); } " "
                label { "older than " input type="text" name="older_than" placeholder="24h" value=(older_than); } " "
                label { input type="checkbox" name="expired" value="1" checked[filter.include_expired]; " expired too" } " "
                button type="submit" { "List" }
            }
            @if listed.is_empty() {
                p.muted { "No records." }
            } @else {
                table {
                    tr { th { "scope" } th { "principal" } th { "key" } th { "status" } th { "body" } th { "created" } th { "expires" } }
                    @for k in listed {
                        tr {
                            td { code { (k.scope) } @if let Some(spread) = &k.spread { " " span.muted { "(spread by " (spread) ")" } } }
                            td { code { (k.principal) } }
                            td {
                                @if k.spread.is_some() {
                                    code { (k.key) }
                                } @else {
                                    a href=(format!("{base}/key?scope={}&principal={}&key={}", encode(&k.scope), encode(&k.principal), encode(&k.key))) { code { (k.key) } }
                                }
                            }
                            td.n { (k.status) }
                            td.n { (k.body_bytes) " B" }
                            td { (format_time(k.created_at)) }
                            td { (format_time(k.expires_at)) @if k.expired { " " span.muted { "(expired)" } } }
                        }
                    }
                }
                @if listed.len() as u32 >= filter.limit {
                    p.muted { "The newest " (filter.limit) " shown." }
                }
            }
            @if frame.token.is_some() {
                p { (action(frame, "/sweep", &[], "Sweep expired records now", false)) }
            }
        }
    };
    layout(frame, "Keys", body)
}

/// Requests that recorded steps and have not committed ([`Store::abandoned`]): each
/// links to its key's page, where the steps' results are.
///
/// [`Store::abandoned`]: crate::Store::abandoned
pub(crate) fn abandoned(frame: &Frame, idle_for: &str, limit: u32, listed: &[Abandoned]) -> Markup {
    let base = &frame.base;
    let body = html! {
        p.muted {
            "Requests whose outside calls (steps) were made and recorded, and which have not "
            "committed since: unless their clients retry, the service has no record of them."
        }
        form method="get" action=(format!("{base}/abandoned")) {
            label { "no step for " input type="text" name="idle" placeholder="5m" value=(idle_for); } " "
            button type="submit" { "List" }
        }
        @if listed.is_empty() {
            p.muted { "None." }
        } @else {
            table {
                tr { th { "scope" } th { "principal" } th { "key" } th { "steps" } th { "last step" } }
                @for a in listed {
                    tr {
                        td { code { (a.scope) } @if let Some(spread) = &a.spread { " " span.muted { "(spread by " (spread) ")" } } }
                        td { code { (a.principal) } }
                        td {
                            @if a.spread.is_some() {
                                code { (a.key) }
                            } @else {
                                a href=(format!("{base}/key?scope={}&principal={}&key={}", encode(&a.scope), encode(&a.principal), encode(&a.key))) { code { (a.key) } }
                            }
                        }
                        td {
                            @for (i, step) in a.steps.iter().enumerate() {
                                @if i > 0 { ", " }
                                code { (step.step) } " " span.muted { (format_time(step.recorded_at)) }
                            }
                        }
                        td { (ago(a.idle)) " ago" }
                    }
                }
            }
            @if listed.len() as u32 >= limit {
                p.muted { "The oldest " (limit) " shown." }
            }
        }
    };
    layout(frame, "Abandoned requests", body)
}

pub(crate) fn key(
    frame: &Frame,
    scope: &str,
    principal: &str,
    key: &str,
    found: Option<&KeyDetail>,
    steps: &[StepRecord],
) -> Markup {
    let body = html! {
        section {
            table {
                tr { th { "scope" } td { code { (scope) } } }
                tr { th { "principal" } td { @if principal.is_empty() { span.muted { "none" } } @else { code { (principal) } } } }
                tr { th { "key" } td { code { (key) } } }
                @if let Some(k) = found {
                    tr { th { "status" } td { (k.status) @if k.expired { " " span.muted { "(expired: the next request runs afresh)" } } } }
                    tr { th { "created" } td { (format_time(k.created_at)) } }
                    tr { th { "expires" } td { (until(k.expires_at)) } }
                    tr { th { "fingerprint" } td { code { (k.fingerprint) } } }
                    tr { th { "stored headers" } td { pre { (k.headers) } } }
                    tr { th { "response body" } td {
                        (k.body_bytes) " bytes"
                        @if let Some(body) = &k.body {
                            pre { (String::from_utf8_lossy(body)) }
                        } @else if !frame.show_bodies {
                            " " span.muted { "(hidden: bodies carry personal data; the service shows them with " code { "Console::show_bodies(true)" } ")" }
                        }
                    } }
                }
            }
            @if found.is_none() && steps.is_empty() {
                p { "No committed record of this key. A request in flight is not visible until it commits." }
            }
            @if !steps.is_empty() {
                h2 { "Recorded steps" }
                p.muted { "Outside calls of a request that has not committed: its retry resumes after them instead of calling again." }
                table {
                    tr { th { "step" } th { "recorded" } th { "expires" } th { "result" } }
                    @for step in steps {
                        tr {
                            td { code { (step.step) } }
                            td { (format_time(step.created_at)) }
                            td { (until(step.expires_at)) @if step.expired { " " span.muted { "(expired: a retry calls again)" } } }
                            td {
                                (step.result_bytes) " bytes"
                                @if let Some(result) = &step.result {
                                    pre { (result) }
                                } @else if !frame.show_bodies {
                                    " " span.muted { "(hidden)" }
                                }
                            }
                        }
                    }
                }
            }
            @if found.is_some() {
                p { (action(frame, "/key/purge", &[("scope", scope), ("principal", principal), ("key", key)], "Purge this key", true)) }
            }
        }
    };
    layout(frame, "Key", body)
}

fn lease_cells(l: &Lease) -> Markup {
    html! {
        td { code { (l.id) } }
        td { code { (l.topic) } }
        td.n { (l.attempts) }
        td {
            @match l.owner {
                Some(owner) => { "relay " (owner) }
                None => @if l.last_error.is_some() { "backoff, or a lease by time" } @else { "a relay (lease by time)" },
            }
        }
        td { (until(l.until)) }
        td { @if let Some(e) = &l.last_error { code { (e) } } }
    }
}

pub(crate) fn outbox(
    frame: &Frame,
    pending: &[TopicPending],
    leases: &[Lease],
    blocked: &[BlockedKey],
) -> Markup {
    let body = html! {
        section {
            h2 { "Pending per topic" }
            @if pending.is_empty() {
                p.muted { "Nothing pending." }
            } @else {
                table {
                    tr { th { "topic" } th { "pending" } th { "held" } th { "lag (oldest)" } }
                    @for p in pending {
                        tr { td { code { (p.topic) } } td.n { (p.events) } td.n { (p.held) } td { (ago(p.oldest)) } }
                    }
                }
            }
        }
        section {
            h2 { "Leased or backing off" }
            @if leases.is_empty() {
                p.muted { "No event is held." }
            } @else {
                table {
                    tr { th { "event" } th { "topic" } th { "attempts" } th { "held by" } th { "until" } th { "last error" } }
                    @for l in leases { tr { (lease_cells(l)) } }
                }
            }
        }
        section {
            h2 { "Blocked ordering keys" }
            @if blocked.is_empty() {
                p.muted { "No ordering key waits behind an event." }
            } @else {
                table {
                    tr { th { "ordering key" } th { "waiting" } th { "blocked by" } th { "topic" } th { "attempts" } th { "held by" } th { "until" } th { "last error" } }
                    @for b in blocked {
                        tr { td { code { (b.ordering_key) } } td.n { (b.waiting) } (lease_cells(&b.blocking)) }
                    }
                }
            }
        }
    };
    layout(frame, "Outbox", body)
}

/// An event's age beside the re-drive window `max_age`, marked when outside it.
fn age(event: &DeadEvent, max_age: Duration) -> Markup {
    html! {
        (ago(event.age)) " ago"
        @if event.outside_window(max_age) {
            " " span.outside title="A re-drive of it asks for confirmation" { "outside the re-drive window" }
        }
    }
}

/// What the re-drive window means, for the pages that show it.
fn window(max_age: Duration) -> Markup {
    html! {
        p.muted {
            "Re-drive window: " (ago(max_age)) ". Consumers that deduplicate with "
            code { "run_once" } " may have forgotten an event written longer ago, and would apply it "
            "again if it reached them before: re-driving one asks for confirmation."
        }
    }
}

pub(crate) fn dead(
    frame: &Frame,
    reasons: &[DeadReason],
    events: &[DeadEvent],
    max_age: Duration,
) -> Markup {
    let base = &frame.base;
    let body = html! {
        @if reasons.is_empty() {
            section { p.muted { "No dead events." } }
        } @else {
            section {
                h2 { "By reason" }
                (reason_table(frame, reasons))
                @if frame.token.is_some() {
                    p {
                        (action(frame, "/dead/redrive", &[("all", "1")], "Re-drive all", false)) " "
                        (action(frame, "/dead/discard", &[("all", "1")], "Discard all", true))
                    }
                }
            }
            section {
                h2 { "Events" }
                (window(max_age))
                form id="selected" method="post" {
                    @if let Some(token) = &frame.token { input type="hidden" name="csrf" value=(token); }
                    table.events {
                        tr { @if frame.token.is_some() { th {} } th { "event" } th { "topic" } th { "ordering key" } th { "attempts" } th { "parked" } th { "written" } th { "reason" } }
                        @for e in events {
                            tr {
                                @if frame.token.is_some() { td { input type="checkbox" name="id" value=(e.id) aria-label=(format!("select {}", e.id)); } }
                                td { a href=(format!("{base}/dead/event?id={}", encode(&e.id))) { code { (e.id) } } }
                                td { code { (e.topic) } }
                                td { @if let Some(k) = &e.ordering_key { code { (k) } } }
                                td.n { (e.attempts) }
                                td { (ago(e.dead_for)) " ago" }
                                td { (age(e, max_age)) }
                                td { code { (e.last_error) } }
                            }
                        }
                    }
                    @if frame.token.is_some() {
                        p {
                            button type="submit" formaction=(format!("{base}/dead/redrive")) { "Re-drive selected" } " "
                            button.danger type="submit" formaction=(format!("{base}/dead/discard")) { "Discard selected" }
                        }
                    }
                }
            }
        }
    };
    layout(frame, "Dead events", body)
}

pub(crate) fn dead_event(
    frame: &Frame,
    id: &str,
    found: Option<&DeadDetail>,
    max_age: Duration,
) -> Markup {
    let body = html! {
        section {
            @if let Some(d) = found {
                table {
                    tr { th { "event" } td { code { (d.event.id) } } }
                    tr { th { "topic" } td { code { (d.event.topic) } } }
                    tr { th { "ordering key" } td { @if let Some(k) = &d.event.ordering_key { code { (k) } } } }
                    tr { th { "written" } td { (format_time(d.created_at)) ", " (age(&d.event, max_age)) } }
                    tr { th { "attempts" } td { (d.event.attempts) } }
                    tr { th { "parked" } td { (ago(d.event.dead_for)) " ago" } }
                    tr { th { "reason" } td { code { (d.event.last_error) } } }
                    tr { th { "headers" } td { pre { (d.headers) } } }
                    tr { th { "payload" } td {
                        @if let Some(payload) = &d.payload {
                            pre { (String::from_utf8_lossy(payload)) }
                        } @else {
                            span.muted { "hidden: payloads carry personal data; the service shows them with " code { "Console::show_bodies(true)" } }
                        }
                    } }
                }
                (window(max_age))
                p {
                    (action(frame, "/dead/redrive", &[("id", &d.event.id)], "Re-drive", false)) " "
                    (action(frame, "/dead/discard", &[("id", &d.event.id)], "Discard", true))
                }
            } @else {
                p { "No dead event " code { (id) } ": it was re-driven, discarded, or never parked." }
            }
        }
    };
    layout(frame, "Dead event", body)
}

/// A re-drive refused because `outside` of the `selected` events are outside the window
/// `max_age` (the oldest `oldest` old): nothing moved; the form re-drives the same
/// selection with `force=1`.
pub(crate) fn redrive_past_window(
    frame: &Frame,
    selection: &DeadSelection,
    selected: u64,
    outside: u64,
    oldest: Duration,
    max_age: Duration,
) -> Markup {
    let mut fields: Vec<(&str, &str)> = match selection {
        DeadSelection::All => vec![("all", "1")],
        DeadSelection::Reason(reason) => vec![("reason", reason.as_str())],
        DeadSelection::Ids(ids) => ids.iter().map(|id| ("id", id.as_str())).collect(),
    };
    let expected = selected.to_string();
    fields.push(("force", "1"));
    fields.push(("expected", &expected));
    let body = html! {
        section.warn role="status" {
            p {
                strong { "Nothing was re-driven. " }
                (outside) " of the " (selected) " selected dead event(s) were written more than "
                (ago(max_age)) " ago, outside the re-drive window; the oldest " (ago(oldest)) " ago."
            }
            p {
                "Consumers that deduplicate with " code { "run_once" } " keep their record of a "
                "delivery for about that long. If one of these events reached them before (its "
                "publish failed after the broker took it), they may have forgotten it, and would "
                "apply it a second time."
            }
        }
        section {
            p {
                (action(frame, "/dead/redrive", &fields, &format!("Re-drive all {selected} anyway"), true))
                " "
                a href=(format!("{}/dead", frame.base)) { "Cancel" }
            }
        }
    };
    layout(frame, "Re-drive past the window?", body)
}

/// The audit trail, newest first: `entries`, at most `limit` of them; `paged` when this
/// page starts before the newest. A full page links to the rows older than its last.
pub(crate) fn audit(frame: &Frame, entries: &[AuditEntry], limit: u32, paged: bool) -> Markup {
    let base = &frame.base;
    let body = html! {
        p.muted {
            "Every action taken on idem's tables through the console, the "
            code { "idem" } " command line or the service's own tools, newest first; each "
            "row committed with its action."
        }
        @if entries.is_empty() {
            p.muted { @if paged { "No older actions." } @else { "No action was taken yet." } }
        } @else {
            table.audit {
                tr { th { "#" } th { "when" } th { "operator" } th { "via" } th { "action" } th { "selected" } th { "rows" } }
                @for e in entries {
                    tr {
                        td.n { (e.id) }
                        td.at { (format_time(e.at)) }
                        td { code { (e.operator) } }
                        td { (e.via) }
                        td { (e.action) }
                        td { code { (e.filter) } }
                        td.n { (e.rows) }
                    }
                }
            }
        }
        p {
            @if paged { a href=(format!("{base}/audit")) { "Newest" } " " }
            @if let Some(last) = entries.last().filter(|_| entries.len() as u32 >= limit) {
                a href=(format!("{base}/audit?before={}", last.id)) { "Older" }
            }
        }
    };
    layout(frame, "Audit trail", body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(encode("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
        assert_eq!(encode("Key-1_.~"), "Key-1_.~");
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(seconds(0.44), "0.4 s");
        assert_eq!(seconds(42.0), "42 s");
        assert_eq!(seconds(600.0), "10 min");
        assert_eq!(seconds(9_000.0), "2.5 h");
        assert_eq!(seconds(3.0 * 86_400.0), "3 d");
    }
}
