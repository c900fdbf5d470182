//! The console's pages, written with maud: HTML checked when the crate compiles, every
//! value escaped, their style and script in the console's own files (`assets`).

mod events;
mod keys;

pub(crate) use events::*;
pub(crate) use keys::*;

use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use maud::{html, Markup, DOCTYPE};

use super::relays::{self, Rates};
use super::{assets, DeadAction, Frame};
use crate::operate::{
    format_time, Abandoned, AbandonedCursor, AbandonedFilter, AuditEntry, BlockedKey,
    CompletionStage, CompletionState, DeadBound, DeadDetail, DeadPreview, DeadReason,
    DeadSelection, EventFilter, FailedPublish, KeyCounts, KeyCursor, KeyDetail, KeyEvent,
    KeyFilter, KeySummary, Lease, Page, PendingEvent, RelaySession, RequestKey, StepRecord,
    TopicPending,
};
use crate::outbox::DeadEvent;
use crate::Outcome;

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

/// The query string (`?a=1&b=2`, or nothing) of the fields that name `filter`'s events.
pub(crate) fn filter_query(filter: &EventFilter) -> String {
    let fields = filter_fields(filter);
    if fields.is_empty() {
        return String::new();
    }
    let pairs: Vec<String> = fields
        .iter()
        .map(|(name, value)| format!("{name}={}", encode(value)))
        .collect();
    format!("?{}", pairs.join("&"))
}

/// The form fields that name `filter`'s events, as the console reads them back: `id`
/// (repeated), `reason`, `topic`, `ordering_key`, `older_than` (in seconds).
fn filter_fields(filter: &EventFilter) -> Vec<(&'static str, String)> {
    let mut fields: Vec<(&'static str, String)> = Vec::new();
    for id in filter.ids.iter().flatten() {
        fields.push(("id", id.clone()));
    }
    if let Some(reason) = &filter.reason {
        fields.push(("reason", reason.clone()));
    }
    if let Some(topic) = &filter.topic {
        fields.push(("topic", topic.clone()));
    }
    if let Some(prefix) = &filter.ordering_key {
        fields.push(("ordering_key", prefix.clone()));
    }
    if let Some(age) = filter.older_than {
        fields.push(("older_than", format!("{}s", age.as_secs())));
    }
    fields
}

/// `n` `thing`s, the plural with an `s`: `1 event`, `12 events`.
fn counted(n: u64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
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

/// A long id (an event's, a key, a fingerprint) in a list: shortened on screen with an
/// ellipsis, whole in the page's text (selected, searched and copied whole), in its
/// `title`, and in its copy button's. A link to `href` when there is one (the button
/// beside it, not in it). The button needs the script; without it, it is not shown.
fn short(id: &str, href: Option<String>) -> Markup {
    html! {
        span.id {
            @if let Some(href) = href {
                a href=(href) { code title=(id) { (id) } }
            } @else {
                code title=(id) { (id) }
            }
            (copy(id))
        }
    }
}

/// A long id on its own page: whole, with its copy button.
fn whole(id: &str) -> Markup {
    html! { span.id.whole { code { (id) } (copy(id)) } }
}

fn copy(id: &str) -> Markup {
    html! {
        button.copy type="button" data-copy=(id) title="Copy the whole id" { "copy" }
    }
}

/// The link to the page of an outbox event: the dead events' own, or the pending one's.
fn event_href(base: &str, id: &str, dead: bool) -> String {
    let page = if dead { "dead" } else { "pending" };
    format!("{base}/{page}/event?id={}", encode(id))
}

fn layout(frame: &Frame, title: &str, body: Markup) -> Markup {
    let base = &frame.base;
    let now = format_time(SystemTime::now());
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="referrer" content="no-referrer";
                title { (title) " · idem" }
                link rel="stylesheet" href=(format!("{base}/assets/{}", assets::style()));
                script src=(format!("{base}/assets/{}", assets::script())) defer {}
            }
            body {
                header {
                    strong { "idem" }
                    // Mounted with `Router::nest`, the overview is the base itself.
                    a href=(if base.is_empty() { "/" } else { base.as_str() }) { "Overview" }
                    a href=(format!("{base}/keys")) { "Keys" }
                    a href=(format!("{base}/abandoned")) { "Abandoned" }
                    a href=(format!("{base}/outbox")) { "Outbox" }
                    a href=(format!("{base}/pending")) { "Pending events" }
                    a href=(format!("{base}/dead")) { "Dead events" }
                    @if frame.dead_letters {
                        a href=(format!("{base}/dead-letters")) { "Dead letters" }
                    }
                    a href=(format!("{base}/audit")) { "Audit" }
                    @if frame.token.is_none() {
                        span.muted { "read-only" }
                    }
                    // The script makes it "live, every 5 s", with a pause button.
                    @if frame.live.is_some() {
                        span #live data-at=(now) { "as of " (now) ", reload for fresh figures" }
                    }
                }
                main data-live=[frame.live] {
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
/// hidden, one button. Nothing for an operator who may not act.
fn action(
    frame: &Frame,
    path: &str,
    fields: &[(&str, String)],
    label: &str,
    danger: bool,
) -> Markup {
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

/// A link to the confirmation page of `action` on the events `filter` names, labelled
/// `label`. Nothing for an operator who may not act.
fn to_preview(frame: &Frame, action: DeadAction, filter: &EventFilter, label: &str) -> Markup {
    if frame.token.is_none() {
        return html! {};
    }
    let href = format!("{}{}{}", frame.base, action.path(), filter_query(filter));
    html! {
        a.action href=(href) { (label) }
    }
}

/// "First page" (when `paged`) and "Next page" (to `next`, with the list's other
/// fields `query`) under a list.
fn pager(base_path: &str, query: &str, paged: bool, next: Option<String>) -> Markup {
    let separator = if query.is_empty() { '?' } else { '&' };
    html! {
        @if paged || next.is_some() {
            nav.pages {
                @if paged { a href=(format!("{base_path}{query}")) { "First page" } }
                @if let Some(next) = next {
                    a rel="next" href=(format!("{base_path}{query}{separator}after={}", encode(&next))) { "Next page" }
                }
            }
        }
    }
}

/// An error page, in the console's layout: under the base the console is mounted at
/// (its stylesheet, script and header), the status as its title, and what happened.
pub(crate) fn error(frame: &Frame, status: StatusCode, message: &str) -> Markup {
    layout(
        frame,
        &status.to_string(),
        html! { section.warn { p { (message) } } },
    )
}

/// The overview's figures from the database: every instance's records and events, the
/// same whichever instance serves the page.
pub(crate) struct Database<'a> {
    pub(crate) counts: &'a [KeyCounts],
    pub(crate) reasons: &'a [DeadReason],
    pub(crate) pending: &'a [TopicPending],
    pub(crate) lag: Option<Duration>,
    pub(crate) relays: &'a [RelaySession],
}

/// The overview's figures from this process: counted since it started, or sampled by it.
pub(crate) struct Process<'a> {
    /// The requests it answered per scope and outcome (feature `metrics`), else `None`.
    pub(crate) outcomes: &'a Option<Vec<(String, Outcome, u64)>>,
    /// What its relays did lately, when the service gave their counters.
    pub(crate) relays: Option<&'a Rates>,
    /// The lag chart of its samples.
    pub(crate) chart: Markup,
}

/// A block's title, and where its figures come from.
fn sourced(title: &str, source: &str) -> Markup {
    html! { h2 { (title) span.source { (source) } } }
}

/// The relays holding their sessions now ([`crate::operate::Operate::outbox_relays`]).
fn relays_table(relays: &[RelaySession]) -> Markup {
    html! {
        @if relays.is_empty() {
            p.muted {
                "No relay holds a session now: none runs, or they run where leases end by "
                "their time only (the portable mode, behind a transaction pooler without a "
                "direct session)."
            }
        } @else {
            table.relays {
                tr { th { "session" } th { "owner number" } th { "from" } th { "connected" } }
                @for r in relays {
                    tr {
                        td { code { (r.name) } }
                        td.n { (r.owner) }
                        td { @if let Some(addr) = &r.client_addr { code { (addr) } } @else { span.muted { "local socket, or hidden from this role" } } }
                        td.at { @if let Some(since) = r.since { (format_time(since)) } @else { span.muted { "hidden from this role" } } }
                    }
                }
            }
        }
    }
}

pub(crate) fn overview(frame: &Frame, database: &Database<'_>, process: &Process<'_>) -> Markup {
    let Database {
        counts,
        reasons,
        pending,
        lag,
        relays,
    } = *database;
    let pending_total: u64 = pending.iter().map(|p| p.events).sum();
    let dead_total: u64 = reasons.iter().map(|r| r.events).sum();
    let base = &frame.base;
    let body = html! {
        section.db {
            (sourced("From the database", "every instance's records and events, as the database has them now"))
            div.cols {
                div {
                    h3 { "Outbox" }
                    div.figures {
                        span {
                            a href=(format!("{base}/pending")) { strong.figure #pending-total { (pending_total) " pending" } }
                            @if let Some(lag) = lag { span.muted { ", the oldest " (ago(lag)) " old" } }
                        }
                        a href=(format!("{base}/dead")) { strong.figure #dead-total { (dead_total) " dead" } }
                    }
                    p { a href=(format!("{base}/outbox")) { "Pending per topic, relays, leases and blocked keys" } }
                }
                div {
                    h3 { "Relays" }
                    (relays_table(relays))
                }
            }
            h3 { "Records per scope" }
            @if counts.is_empty() {
                p.muted { "No records." }
            } @else {
                table.scopes {
                    tr { th { "scope" } th { "live" } th { "expiring within the hour" } th { "expired, not yet swept" } }
                    @for c in counts {
                        tr {
                            td { a href=(format!("{base}/keys?scope={}", encode(&c.scope))) { code { (c.scope) } } }
                            td.n { (c.live) } td.n { (c.expiring) } td.n { (c.expired) }
                        }
                    }
                }
            }
        }
        section.process {
            (sourced("From this process", "counted in the memory of the instance that serves this page, since it started: another instance counts its own, and a restart starts again from zero"))
            div.cols {
                div {
                    h3 { "Requests it answered" }
                    (outcomes_table(process.outcomes))
                    h3 { "Outbox lag over the last hour" }
                    (process.chart)
                }
                div { (relays::block(process.relays)) }
            }
        }
        section {
            (sourced("Dead events by reason", "from the database"))
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

/// What this process counted of its requests, per scope: fresh, replayed, 409, 422.
fn outcomes_table(outcomes: &Option<Vec<(String, Outcome, u64)>>) -> Markup {
    let Some(outcomes) = outcomes else {
        return html! {
            p.muted {
                "Not counted: the service is built without idem's " code { "metrics" } " feature."
            }
        };
    };
    let mut scopes: Vec<&str> = outcomes.iter().map(|(s, _, _)| s.as_str()).collect();
    scopes.dedup();
    let count = |scope: &str, outcome: Outcome| -> u64 {
        outcomes
            .iter()
            .filter(|(s, o, _)| s == scope && *o == outcome)
            .map(|(_, _, n)| n)
            .sum()
    };
    html! {
        @if scopes.is_empty() {
            p.muted { "None since this process started." }
        } @else {
            table.outcomes {
                tr { th { "scope" } th { "fresh" } th { "replayed" } th { "409 in use" } th { "422 mismatch" } }
                @for scope in &scopes {
                    tr {
                        td { code { (scope) } }
                        td.n { (count(scope, Outcome::Fresh)) }
                        td.n { (count(scope, Outcome::Replayed)) }
                        td.n { (count(scope, Outcome::Conflict)) }
                        td.n { (count(scope, Outcome::Mismatch)) }
                    }
                }
            }
            p.muted { "Feature " code { "metrics" } ": the figures behind " code { "idem_requests_total" } "." }
        }
    }
}

/// The dead events of one reason.
fn by_reason(reason: &str) -> EventFilter {
    EventFilter {
        reason: Some(reason.to_owned()),
        ..EventFilter::default()
    }
}

fn reason_table(frame: &Frame, reasons: &[DeadReason]) -> Markup {
    let base = &frame.base;
    html! {
        table.reasons {
            tr { th { "reason" } th { "events" } th { "topics" } th { "parked" } @if frame.token.is_some() { th {} } }
            @for r in reasons {
                @let filter = by_reason(&r.reason);
                tr {
                    td { a href=(format!("{base}/dead{}", filter_query(&filter))) title="List them" { code { (r.reason) } } }
                    td.n { (r.events) }
                    td { @for t in &r.topics { code { (t) } " " } }
                    td {
                        @if ago(r.newest) == ago(r.oldest) { (ago(r.oldest)) " ago" }
                        @else { (ago(r.newest)) " to " (ago(r.oldest)) " ago" }
                    }
                    @if frame.token.is_some() {
                        td {
                            (to_preview(frame, DeadAction::Redrive, &filter, "Re-drive these…"))
                            " "
                            (to_preview(frame, DeadAction::Discard, &filter, "Discard these…"))
                        }
                    }
                }
            }
        }
    }
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
