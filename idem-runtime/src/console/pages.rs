//! The console's pages, written with maud: HTML checked when the crate compiles, every
//! value escaped, their style and script in the console's own files (`assets`).

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

pub(crate) fn keys(
    frame: &Frame,
    filter: &KeyFilter,
    older_than: &str,
    paged: bool,
    page: &Page<KeySummary, KeyCursor>,
) -> Markup {
    let base = &frame.base;
    let listed = &page.rows;
    let mut query: Vec<(&str, String)> = Vec::new();
    for (name, value) in [
        ("scope", &filter.scope),
        ("principal", &filter.principal),
        ("prefix", &filter.key_prefix),
    ] {
        if let Some(value) = value {
            query.push((name, value.clone()));
        }
    }
    if !older_than.trim().is_empty() {
        query.push(("older_than", older_than.trim().to_owned()));
    }
    if filter.include_expired {
        query.push(("expired", "1".to_owned()));
    }
    if filter.limit != 100 {
        query.push(("limit", filter.limit.to_string()));
    }
    let query = query_of(&query);
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
            form.filter method="get" action=(format!("{base}/keys")) {
                label { "scope " input type="text" name="scope" value=(filter.scope.as_deref().unwrap_or("")); } " "
                label { "principal " input type="text" name="principal" value=(filter.principal.as_deref().unwrap_or("")); } " "
                label { "key prefix " input type="text" name="prefix" value=(filter.key_prefix.as_deref().unwrap_or("")); } " "
                label { "older than " input type="text" name="older_than" placeholder="24h" value=(older_than); } " "
                label { input type="checkbox" name="expired" value="1" checked[filter.include_expired]; " expired too" } " "
                @if filter.limit != 100 { input type="hidden" name="limit" value=(filter.limit); }
                button type="submit" { "List" }
            }
            @if listed.is_empty() {
                p.muted { @if paged { "No more records." } @else { "No records." } }
            } @else {
                table.keys {
                    tr { th { "scope" } th { "principal" } th { "key" } th { "status" } th { "body" } th { "created" } th { "expires" } }
                    @for k in listed {
                        tr {
                            td { code { (k.scope) } @if let Some(spread) = &k.spread { " " span.muted { "(spread by " (spread) ")" } } }
                            td { code { (k.principal) } }
                            td {
                                @if k.spread.is_some() {
                                    (short(&k.key, None))
                                } @else {
                                    (short(&k.key, Some(format!("{base}/key?scope={}&principal={}&key={}", encode(&k.scope), encode(&k.principal), encode(&k.key)))))
                                }
                            }
                            td.n { (k.status) }
                            td.n { (k.body_bytes) " B" }
                            td.at { (format_time(k.created_at)) }
                            td.at { (format_time(k.expires_at)) @if k.expired { " " span.muted { "(expired)" } } }
                        }
                    }
                }
            }
            (pager(&format!("{base}/keys"), &query, paged, page.next.as_ref().map(ToString::to_string)))
            @if frame.token.is_some() {
                p { a.action href=(format!("{base}/sweep")) { "Sweep expired records…" } }
            }
        }
    };
    layout(frame, "Keys", body)
}

/// `?name=value&..` of `pairs`, each value percent-encoded; nothing when there are none.
fn query_of(pairs: &[(&str, String)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let pairs: Vec<String> = pairs
        .iter()
        .map(|(name, value)| format!("{name}={}", encode(value)))
        .collect();
    format!("?{}", pairs.join("&"))
}

/// What the abandoned requests' list shows: its filter, the idle time as the operator
/// typed it (empty: the store's window, `default_idle`), its page size, and the page it
/// continues, if any.
pub(crate) struct AbandonedListed<'a> {
    pub(crate) filter: &'a AbandonedFilter,
    pub(crate) idle: &'a str,
    pub(crate) default_idle: String,
    pub(crate) limit: u32,
    pub(crate) after: Option<&'a AbandonedCursor>,
}

impl AbandonedListed<'_> {
    /// The fields of this list's filter and page size.
    fn fields(&self) -> Vec<(&'static str, String)> {
        let f = self.filter;
        let mut pairs: Vec<(&str, String)> = Vec::new();
        for (name, value) in [
            ("scope", &f.scope),
            ("principal", &f.principal),
            ("prefix", &f.key_prefix),
        ] {
            if let Some(value) = value {
                pairs.push((name, value.clone()));
            }
        }
        if let Some(stage) = f.completion {
            pairs.push(("completion", stage.to_string()));
        }
        if !self.idle.is_empty() {
            pairs.push(("idle", self.idle.to_owned()));
        }
        if self.limit != 100 {
            pairs.push(("limit", self.limit.to_string()));
        }
        pairs
    }

    /// The query of this list's filter and page size, for its pages' links.
    fn query(&self) -> String {
        query_of(&self.fields())
    }

    /// The query of this very page (its filter, and where it starts), without its `?`:
    /// what an action's form carries (`list`) to come back to it.
    fn this_page(&self) -> String {
        let mut fields = self.fields();
        if let Some(after) = self.after {
            fields.push(("after", after.to_string()));
        }
        query_of(&fields).trim_start_matches('?').to_owned()
    }

    fn form(&self, base: &str) -> Markup {
        let f = self.filter;
        let stage_label = |stage: CompletionStage| match stage {
            CompletionStage::Failed => "failed (parked)",
            CompletionStage::NotCompletable => "not completable",
            other => other.as_str(),
        };
        html! {
            form.filter method="get" action=(format!("{base}/abandoned")) {
                label { "scope " input type="text" name="scope" value=(f.scope.as_deref().unwrap_or("")); } " "
                label { "principal " input type="text" name="principal" value=(f.principal.as_deref().unwrap_or("")); } " "
                label { "key prefix " input type="text" name="prefix" value=(f.key_prefix.as_deref().unwrap_or("")); } " "
                label {
                    "completion "
                    select name="completion" {
                        option value="" selected[f.completion.is_none()] { "any" }
                        @for stage in CompletionStage::ALL {
                            option value=(stage) selected[f.completion == Some(stage)] { (stage_label(stage)) }
                        }
                    }
                } " "
                label { "no step for " input type="text" name="idle" placeholder=(self.default_idle) value=(self.idle); } " "
                @if self.limit != 100 { input type="hidden" name="limit" value=(self.limit); }
                button type="submit" { "List" }
                @if !self.query().is_empty() { " " a href=(format!("{base}/abandoned")) { "Clear" } }
            }
        }
    }
}

/// Requests that recorded steps and have not committed ([`Operate::abandoned_page`](crate::operate::Operate::abandoned_page)), as
/// `listed` filters them, a page at a time: each links to its key's page, where the
/// steps' results are, and shows where its completion stands; for an admin, its actions,
/// which come back to this page.
///
/// [`Operate::abandoned_page`](crate::operate::Operate::abandoned_page): crate::operate::Operate::abandoned_page
pub(crate) fn abandoned(
    frame: &Frame,
    listed: &AbandonedListed<'_>,
    page: &Page<Abandoned, AbandonedCursor>,
) -> Markup {
    let base = &frame.base;
    let this_page = listed.this_page();
    let body = html! {
        p.muted {
            "Requests whose outside calls (steps) were made and recorded, and which have not "
            "committed since: unless their clients retry, the service has no record of them. "
            "A completable endpoint's request (" code { "completable = true" } ") is stored "
            "with its first step, and the service's completer runs it again: "
            em { "pending" } " until it does, " em { "failed" } " once too many runs failed for "
            "good (parked: it runs again only when sent), " em { "abandoning" } " once an "
            "operator gave it up (the completer runs its steps' compensations, then its key "
            "answers 410). Oldest first step first."
        }
        section {
            (listed.form(base))
            @if page.rows.is_empty() {
                p.muted {
                    @if listed.after.is_some() { "No more." }
                    @else if listed.filter.idle_for.is_none_or(|idle| !idle.is_zero()) {
                        "None with no step for "
                        (listed.filter.idle_for.map_or_else(|| listed.default_idle.clone(), crate::operate::format_age))
                        " or more (parked and abandoning ones are listed whatever their idle time). "
                        a href=(format!("{base}/abandoned?idle=0s")) { "List every request with a step" }
                        "."
                    }
                    @else { "None." }
                }
            } @else {
                table.abandoned {
                    tr {
                        th { "scope" } th { "principal" } th { "key" } th { "steps" } th { "last step" }
                        th { "completion" } th { "tries" } th { "failures" } th { "last error" }
                        @if frame.token.is_some() { th {} }
                    }
                    @for a in &page.rows {
                        tr {
                            td { code { (a.scope) } @if let Some(spread) = &a.spread { " " span.muted { "(spread by " (spread) ")" } } }
                            td { code { (a.principal) } }
                            td {
                                @if a.spread.is_some() {
                                    (short(&a.key, None))
                                } @else {
                                    (short(&a.key, Some(format!("{base}/key?scope={}&principal={}&key={}", encode(&a.scope), encode(&a.principal), encode(&a.key)))))
                                }
                            }
                            td {
                                @for (i, step) in a.steps.iter().enumerate() {
                                    @if i > 0 { ", " }
                                    code { (step.step) } " " span.muted { (format_time(step.recorded_at)) }
                                }
                            }
                            td { (ago(a.idle)) " ago" }
                            (completion_cells(a.completion.as_ref()))
                            @if frame.token.is_some() {
                                td { (abandoned_actions(frame, a, &this_page)) }
                            }
                        }
                    }
                }
            }
            (pager(&format!("{base}/abandoned"), &listed.query(), listed.after.is_some(), page.next.as_ref().map(ToString::to_string)))
        }
    };
    layout(frame, "Abandoned requests", body)
}

/// Where an abandoned request's completion stands: its state, tries, failures, and the
/// last error with its time. A request its endpoint did not store is not completable
/// (an operator may still have abandoned it).
fn completion_cells(completion: Option<&CompletionState>) -> Markup {
    let Some(c) = completion else {
        return html! { td { span.muted { "not completable" } } td {} td {} td {} };
    };
    let state = match c.state.as_str() {
        "pending" => "the completer runs it",
        "failed" => "parked: too many runs failed",
        "abandoning" => "its registered undos run, then 410",
        _ => "",
    };
    html! {
        td {
            @if !c.stored { span.muted { "not completable" } ", " }
            (c.state)
            @if !state.is_empty() { " " span.muted { "(" (state) ")" } }
        }
        td.n { (c.tries) }
        td.n { (c.failures) }
        td {
            @if let Some(error) = &c.last_error { code { (error) } }
            @if let Some(at) = c.error_at { " " span.muted { (format_time(at)) } }
        }
    }
}

/// The principal an action on `a` names: none for a key spread by its hash, which is
/// found without one (as its key's page finds it); its principal, or tenant, otherwise.
fn acting_principal(a: &Abandoned) -> &str {
    if a.spread.as_deref() == Some("key") {
        ""
    } else {
        &a.principal
    }
}

/// An admin's actions on an abandoned request: "Complete now" for a stored request, and
/// the link to the confirmation page of "Abandon for good"; neither once it is being
/// abandoned. `list` (the list's query) takes the operator back to the page as it was.
fn abandoned_actions(frame: &Frame, a: &Abandoned, list: &str) -> Markup {
    let abandoning = a
        .completion
        .as_ref()
        .is_some_and(|c| c.state == "abandoning");
    let stored = a.completion.as_ref().is_some_and(|c| c.stored);
    let named = [
        ("scope", a.scope.clone()),
        ("principal", acting_principal(a).to_owned()),
        ("key", a.key.clone()),
        ("list", list.to_owned()),
    ];
    let query: Vec<String> = named
        .iter()
        .map(|(name, value)| format!("{name}={}", encode(value)))
        .collect();
    html! {
        @if !abandoning {
            @if stored {
                (action(frame, "/abandoned/complete", &named, "Complete now", false))
                " "
            }
            a.action href=(format!("{}/abandoned/abandon?{}", frame.base, query.join("&"))) { "Abandon for good…" }
        }
    }
}

/// The confirmation page of an abandon: the request, its live `steps`, what follows, and
/// the button that abandons it. `list` is the list's query, to go back to.
pub(crate) fn abandon(
    frame: &Frame,
    shown: &KeyShown<'_>,
    steps: &[StepRecord],
    list: Option<&str>,
) -> Markup {
    let KeyShown {
        scope,
        principal,
        key,
    } = *shown;
    let mut fields = vec![
        ("scope", scope.to_owned()),
        ("principal", principal.to_owned()),
        ("key", key.to_owned()),
        ("confirmed", "1".to_owned()),
    ];
    let mut back = format!("{}/abandoned", frame.base);
    if let Some(list) = list {
        fields.push(("list", list.to_owned()));
        back.push('?');
        back.push_str(list);
    }
    let body = html! {
        section {
            table {
                tr { th { "scope" } td { code { (scope) } } }
                tr { th { "principal" } td { @if principal.is_empty() { span.muted { "none" } } @else { code { (principal) } } } }
                tr { th { "key" } td { (whole(key)) } }
                tr { th { "steps" } td {
                    @for (i, step) in steps.iter().enumerate() {
                        @if i > 0 { ", " }
                        code { (step.step) } " " span.muted { "recorded " (format_time(step.created_at)) }
                    }
                } }
            }
        }
        section.warn {
            p {
                strong { "Each of its " (counted(steps.len() as u64, "step")) " that has an undo registered will be undone; a step without one is NOT undone. The key will answer 409 meanwhile, then 410. " }
                "The service's completer claims the key, runs the compensation the service "
                "registered for each step (a refund for a charge), the last step first, once "
                "each, as a step of its own, then commits a 410 for the key that names every "
                "step left as it was (no undo registered), as its audit row does: "
                "the client's retry, however late, gets 410 from then on, and the request never "
                "runs again."
            }
            p.muted {
                "Nothing happens until a completer of the service looks (it runs in the "
                "service, " code { "idem::complete::Completer" } "); the abandoned requests' "
                "page shows the request as abandoning until then."
            }
        }
        section {
            p {
                (action(frame, "/abandoned/abandon", &fields, "Abandon for good", true))
                " "
                a href=(back) { "Cancel" }
            }
        }
    };
    layout(frame, "Abandon this request for good?", body)
}

/// The key a key's page was asked for, as the operator wrote it.
pub(crate) struct KeyShown<'a> {
    pub(crate) scope: &'a str,
    pub(crate) principal: &'a str,
    pub(crate) key: &'a str,
}

pub(crate) fn key(
    frame: &Frame,
    shown: &KeyShown<'_>,
    found: Option<&KeyDetail>,
    steps: &[StepRecord],
    events: &[KeyEvent],
) -> Markup {
    let KeyShown {
        scope,
        principal,
        key,
    } = *shown;
    let base = &frame.base;
    let body = html! {
        section {
            table {
                tr { th { "scope" } td { code { (scope) } } }
                tr { th { "principal" } td { @if principal.is_empty() { span.muted { "none" } } @else { code { (principal) } } } }
                tr { th { "key" } td { (whole(key)) } }
                @if let Some(k) = found {
                    tr { th { "status" } td { (k.status) @if k.expired { " " span.muted { "(expired: the next request runs afresh)" } } } }
                    tr { th { "created" } td { (format_time(k.created_at)) } }
                    tr { th { "expires" } td { (until(k.expires_at)) } }
                    tr { th { "fingerprint" } td { (whole(&k.fingerprint)) } }
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
            @if found.is_some() {
                p { (action(frame, "/key/purge", &[("scope", scope.to_owned()), ("principal", principal.to_owned()), ("key", key.to_owned())], "Purge this key", true)) }
            }
        }
        @if !steps.is_empty() {
            section {
                h2 { "Recorded steps" }
                p.muted { "Outside calls of a request that has not committed: its retry resumes after them instead of calling again." }
                table.steps {
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
        }
        @if found.is_some() {
            section {
                h2 { "Events it wrote, still in the outbox" }
                @if events.is_empty() {
                    p.muted { "None: it wrote none, or the relay published them all." }
                } @else {
                    table.events {
                        tr { th { "event" } th { "topic" } th { "ordering key" } th { "state" } th { "attempts" } th { "last error" } }
                        @for e in events {
                            tr {
                                td { (short(&e.id, Some(event_href(base, &e.id, e.dead)))) }
                                td { code { (e.topic) } }
                                td { @if let Some(k) = &e.ordering_key { (short(k, None)) } }
                                td { @if e.dead { "dead" } @else { "pending" } }
                                td.n { (e.attempts) }
                                td { @if let Some(error) = &e.last_error { code { (error) } } }
                            }
                        }
                    }
                }
            }
        }
    };
    layout(frame, "Key", body)
}

/// Who holds an event: the relay of owner number `owner` (its host and process), or what
/// holds it without one.
fn holder(owner: Option<i32>, backing_off: bool, relays: &[RelaySession]) -> Markup {
    match owner {
        Some(owner) => relays::owner(i64::from(owner), relays),
        None if backing_off => html! { "backoff, or a lease by time" },
        None => html! { "a relay (lease by time)" },
    }
}

fn lease_cells(base: &str, l: &Lease, relays: &[RelaySession]) -> Markup {
    html! {
        td { (short(&l.id, Some(event_href(base, &l.id, false)))) }
        td { code { (l.topic) } }
        td.n { (l.attempts) }
        td { (holder(l.owner, l.last_error.is_some(), relays)) }
        td { (until(l.until)) }
        td { @if let Some(e) = &l.last_error { code { (e) } } }
    }
}

/// What the outbox page shows.
pub(crate) struct OutboxShown<'a> {
    pub(crate) pending: &'a [TopicPending],
    pub(crate) relays: &'a [RelaySession],
    pub(crate) rates: Option<&'a Rates>,
    pub(crate) leases: &'a [Lease],
    pub(crate) blocked: &'a [BlockedKey],
}

pub(crate) fn outbox(frame: &Frame, shown: &OutboxShown<'_>) -> Markup {
    let OutboxShown {
        pending,
        relays,
        rates,
        leases,
        blocked,
    } = *shown;
    let base = &frame.base;
    let body = html! {
        div.cols {
            section.db {
                (sourced("Pending per topic", "from the database"))
                @if pending.is_empty() {
                    p.muted { "Nothing pending." }
                } @else {
                    table {
                        tr { th { "topic" } th { "pending" } th { "held" } th { "lag (oldest)" } }
                        @for p in pending {
                            tr {
                                td { a href=(format!("{base}/pending?topic={}", encode(&p.topic))) { code { (p.topic) } } }
                                td.n { (p.events) } td.n { (p.held) } td { (ago(p.oldest)) }
                            }
                        }
                    }
                    p { a href=(format!("{base}/pending")) { "The pending events, one by one" } }
                }
            }
            section.process {
                (sourced("Published, retried, parked", "from this process"))
                (relays::block(rates))
            }
        }
        section.db {
            (sourced("Relays", "from the database: the sessions holding their locks now"))
            (relays_table(relays))
        }
        section.db {
            (sourced("Leased or backing off", "from the database"))
            @if leases.is_empty() {
                p.muted { "No event is held." }
            } @else {
                table.leases {
                    tr { th { "event" } th { "topic" } th { "attempts" } th { "held by" } th { "until" } th { "last error" } }
                    @for l in leases { tr { (lease_cells(base, l, relays)) } }
                }
            }
        }
        section.db {
            (sourced("Blocked ordering keys", "from the database"))
            @if blocked.is_empty() {
                p.muted { "No ordering key waits behind an event." }
            } @else {
                table.blocked {
                    tr { th { "ordering key" } th { "waiting" } th { "blocked by" } th { "topic" } th { "attempts" } th { "held by" } th { "until" } th { "last error" } }
                    @for b in blocked {
                        tr { td { (short(&b.ordering_key, None)) } td.n { (b.waiting) } (lease_cells(base, &b.blocking, relays)) }
                    }
                }
            }
        }
    };
    layout(frame, "Outbox", body)
}

/// An event's failed publishes ([`crate::operate::Operate::event_errors`]), oldest first.
fn attempts(errors: &[FailedPublish]) -> Markup {
    html! {
        section {
            h2 { "Failed publishes" }
            @if errors.is_empty() {
                p.muted { "None recorded: no publish of it failed (or it failed before idem kept them)." }
            } @else {
                table.attempts {
                    tr { th { "when" } th { "error" } }
                    @for e in errors {
                        tr {
                            td.at { (format_time(e.at)) " " span.muted { "(" (ago(SystemTime::now().duration_since(e.at).unwrap_or_default())) " ago)" } }
                            td { code { (e.error) } }
                        }
                    }
                }
                p.muted { "The last ten the relay recorded, oldest first; a re-drive keeps them." }
            }
        }
    }
}

/// An event's age beside the re-drive window `max_age`, marked when outside it.
fn age(event: &DeadEvent, max_age: Duration) -> Markup {
    html! {
        (ago(event.age)) " ago"
        @if event.outside_window(max_age) {
            " " span.outside title="A re-drive of it is forced past the window" { "outside the re-drive window" }
        }
    }
}

/// What the re-drive window means, for the pages that show it.
fn window(max_age: Duration) -> Markup {
    html! {
        p.muted {
            "Re-drive window: " (ago(max_age)) ". Consumers that deduplicate with "
            code { "run_once" } " may have forgotten an event written longer ago, and would apply it "
            "again if it reached them before: a re-drive's confirmation page says how many of its "
            "events are past the window."
        }
    }
}

/// What an events list shows: its filter (and the age as the operator typed it), its
/// page size, whether it is past its first page.
pub(crate) struct Listed<'a> {
    pub(crate) filter: &'a EventFilter,
    pub(crate) older_than: &'a str,
    pub(crate) limit: u32,
    pub(crate) paged: bool,
}

impl Listed<'_> {
    /// The query of this list's filter and page size, for its pages' links.
    fn query(&self) -> String {
        let mut query = filter_query(self.filter);
        if self.limit != 100 {
            query.push(if query.is_empty() { '?' } else { '&' });
            query.push_str(&format!("limit={}", self.limit));
        }
        query
    }

    /// The filter form of the list at `path`: topic, reason (`with_reason`), ordering key
    /// prefix, age.
    fn form(&self, base: &str, path: &str, with_reason: bool) -> Markup {
        let f = self.filter;
        html! {
            form.filter method="get" action=(format!("{base}{path}")) {
                label { "topic " input type="text" name="topic" value=(f.topic.as_deref().unwrap_or("")); } " "
                @if with_reason {
                    label { "reason " input type="text" name="reason" value=(f.reason.as_deref().unwrap_or("")); } " "
                }
                label { "ordering key prefix " input type="text" name="ordering_key" value=(f.ordering_key.as_deref().unwrap_or("")); } " "
                label { "older than " input type="text" name="older_than" placeholder="1h" value=(self.older_than); } " "
                @if self.limit != 100 { input type="hidden" name="limit" value=(self.limit); }
                button type="submit" { "Filter" }
                @if !f.is_all() { " " a href=(format!("{base}{path}")) { "Clear" } }
            }
        }
    }
}

pub(crate) fn pending(
    frame: &Frame,
    listed: &Listed<'_>,
    page: &Page<PendingEvent, i64>,
    relays: &[RelaySession],
) -> Markup {
    let base = &frame.base;
    let body = html! {
        section {
            (listed.form(base, "/pending", false))
            @if page.rows.is_empty() {
                p.muted { @if listed.paged { "No more pending events." } @else { "No pending event matches." } }
            } @else {
                table.events {
                    tr { th { "event" } th { "topic" } th { "ordering key" } th { "attempts" } th { "written" } th { "held" } th { "last error" } th {} }
                    @for e in &page.rows {
                        tr {
                            td { (short(&e.id, Some(event_href(base, &e.id, false)))) }
                            td { code { (e.topic) } }
                            td { @if let Some(k) = &e.ordering_key { (short(k, None)) } }
                            td.n { (e.attempts) }
                            td.at { (ago(e.age)) " ago" }
                            td {
                                @if let Some(held) = e.held_for {
                                    "for " (ago(held))
                                    @if let Some(owner) = e.owner { " by " (relays::owner(i64::from(owner), relays)) }
                                } @else { span.muted { "ready" } }
                            }
                            td { @if let Some(error) = &e.last_error { code { (error) } } }
                            td { a href=(format!("{base}/event/request?id={}", encode(&e.id))) { "its request" } }
                        }
                    }
                }
            }
            (pager(&format!("{base}/pending"), &listed.query(), listed.paged, page.next.map(|n| n.to_string())))
        }
    };
    layout(frame, "Pending events", body)
}

pub(crate) fn dead(
    frame: &Frame,
    listed: &Listed<'_>,
    reasons: &[DeadReason],
    page: &Page<DeadEvent, i64>,
    matching: u64,
    max_age: Duration,
) -> Markup {
    let base = &frame.base;
    let filter = listed.filter;
    let body = html! {
        @if reasons.is_empty() {
            section { p.muted { "No dead events." } }
        } @else {
            section {
                h2 { "By reason" }
                (reason_table(frame, reasons))
            }
            section {
                h2 { "Events" }
                (listed.form(base, "/dead", true))
                (window(max_age))
                p {
                    (counted(matching, "dead event"))
                    @if filter.is_all() { " in all." }
                    @else if matching == 1 { " matches the filter." }
                    @else { " match the filter." }
                    @if matching > 0 && frame.token.is_some() {
                        " "
                        (to_preview(frame, DeadAction::Redrive, filter, &format!("Re-drive {}…", if filter.is_all() { "all" } else { "these" })))
                        " "
                        (to_preview(frame, DeadAction::Discard, filter, &format!("Discard {}…", if filter.is_all() { "all" } else { "these" })))
                    }
                }
                @if page.rows.is_empty() {
                    p.muted { @if listed.paged { "No more dead events." } @else { "No dead event matches." } }
                } @else {
                    // Checked events go to the confirmation page of an action on them.
                    form #selected method="get" {
                        table.events {
                            tr { @if frame.token.is_some() { th {} } th { "event" } th { "topic" } th { "ordering key" } th { "attempts" } th { "parked" } th { "written" } th { "reason" } }
                            @for e in &page.rows {
                                tr {
                                    @if frame.token.is_some() { td { input type="checkbox" name="id" value=(e.id) aria-label=(format!("select {}", e.id)); } }
                                    td { (short(&e.id, Some(event_href(base, &e.id, true)))) }
                                    td { code { (e.topic) } }
                                    td { @if let Some(k) = &e.ordering_key { (short(k, None)) } }
                                    td.n { (e.attempts) }
                                    td.at { (ago(e.dead_for)) " ago" }
                                    td { (age(e, max_age)) }
                                    td { code { (e.last_error) } }
                                }
                            }
                        }
                        @if frame.token.is_some() {
                            p {
                                button type="submit" formaction=(format!("{base}/dead/redrive")) { "Re-drive selected…" } " "
                                button.danger type="submit" formaction=(format!("{base}/dead/discard")) { "Discard selected…" }
                            }
                        }
                    }
                }
                (pager(&format!("{base}/dead"), &listed.query(), listed.paged, page.next.map(|n| n.to_string())))
            }
        }
    };
    layout(frame, "Dead events", body)
}

pub(crate) fn dead_event(
    frame: &Frame,
    id: &str,
    found: Option<&DeadDetail>,
    errors: &[FailedPublish],
    max_age: Duration,
) -> Markup {
    let base = &frame.base;
    let one = EventFilter::from(&DeadSelection::Ids(vec![id.to_owned()]));
    let body = html! {
        section {
            @if let Some(d) = found {
                table {
                    tr { th { "event" } td { (whole(&d.event.id)) } }
                    tr { th { "topic" } td { code { (d.event.topic) } } }
                    tr { th { "ordering key" } td { @if let Some(k) = &d.event.ordering_key { code { (k) } } } }
                    tr { th { "written" } td { (format_time(d.created_at)) ", " (age(&d.event, max_age)) } }
                    tr { th { "attempts" } td { (d.event.attempts) } }
                    tr { th { "parked" } td { (ago(d.event.dead_for)) " ago" } }
                    tr { th { "reason" } td { code { (d.event.last_error) } } }
                    tr { th { "request" } td { a href=(format!("{base}/event/request?id={}", encode(&d.event.id))) { "The request that wrote it" } } }
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
                @if frame.token.is_some() {
                    p {
                        (to_preview(frame, DeadAction::Redrive, &one, "Re-drive…")) " "
                        (to_preview(frame, DeadAction::Discard, &one, "Discard…"))
                    }
                }
            } @else {
                p { "No dead event " code { (id) } ": it was re-driven, discarded, or never parked." }
            }
        }
        @if found.is_some() { (attempts(errors)) }
    };
    layout(frame, "Dead event", body)
}

/// A pending event: its row, who holds it, its failed publishes; or why it is not
/// there.
pub(crate) fn pending_event(
    frame: &Frame,
    id: &str,
    found: Option<&PendingEvent>,
    errors: &[FailedPublish],
    relays: &[RelaySession],
) -> Markup {
    let base = &frame.base;
    let body = html! {
        section {
            @if let Some(e) = found {
                table {
                    tr { th { "event" } td { (whole(&e.id)) } }
                    tr { th { "topic" } td { code { (e.topic) } } }
                    tr { th { "ordering key" } td { @if let Some(k) = &e.ordering_key { code { (k) } } } }
                    tr { th { "written" } td { (ago(e.age)) " ago" } }
                    tr { th { "attempts" } td { (e.attempts) } }
                    tr { th { "state" } td {
                        @if let Some(held) = e.held_for {
                            "held for " (ago(held)) " by " (holder(e.owner, e.last_error.is_some(), relays))
                        } @else { "ready: the next relay's round takes it" }
                    } }
                    tr { th { "last error" } td { @if let Some(error) = &e.last_error { code { (error) } } } }
                    tr { th { "request" } td { a href=(format!("{base}/event/request?id={}", encode(&e.id))) { "The request that wrote it" } } }
                }
            } @else {
                p { "No pending event " code { (id) } ": it was published (and deleted), discarded, or never written." }
            }
        }
        @if found.is_some() { (attempts(errors)) }
    };
    layout(frame, "Pending event", body)
}

/// A consumer's dead letter as the "Dead letters" page shows it, from JetStream or
/// RabbitMQ.
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(crate) struct Letter {
    pub(crate) sequence: u64,
    pub(crate) event_id: String,
    pub(crate) subject: String,
    pub(crate) reason: String,
    pub(crate) at: SystemTime,
    /// The payload as read (RabbitMQ's cut to its first 64 KiB).
    pub(crate) payload: Vec<u8>,
    pub(crate) payload_len: usize,
}

#[cfg(feature = "nats")]
impl From<crate::outbox::nats::DeadLetter> for Letter {
    fn from(l: crate::outbox::nats::DeadLetter) -> Self {
        Self {
            sequence: l.sequence,
            payload_len: l.payload.len(),
            event_id: l.event_id,
            subject: l.subject,
            reason: l.reason,
            at: l.at,
            payload: l.payload,
        }
    }
}

#[cfg(feature = "amqp")]
impl From<crate::outbox::amqp::DeadLetter> for Letter {
    fn from(l: crate::outbox::amqp::DeadLetter) -> Self {
        Self {
            sequence: l.sequence,
            event_id: l.event_id,
            subject: l.subject,
            reason: l.reason,
            at: l.at,
            payload: l.payload,
            payload_len: l.payload_len,
        }
    }
}

/// Where a "Dead letters" page reads from: what (`the JetStream stream`), its name, and
/// in which order it lists.
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(crate) struct LettersFrom {
    pub(crate) kind: &'static str,
    pub(crate) name: String,
    pub(crate) order: &'static str,
}

/// The consumers' dead letters read from `from`, `limit` at most; their payloads only
/// when the service shows bodies.
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(crate) fn dead_letters(
    frame: &Frame,
    from: &LettersFrom,
    limit: u32,
    letters: &[Letter],
) -> Markup {
    let base = &frame.base;
    let body = html! {
        section {
            p.muted {
                "What the consumers gave up on, " (from.order) ": at most " (limit) " from "
                (from.kind) " " code { (from.name) } ". The outbox's own dead events (never "
                "published) are under " a href=(format!("{base}/dead")) { "Dead events" } "."
            }
            @if letters.is_empty() {
                p.muted { "No dead letters." }
            } @else {
                table.letters {
                    tr { th { "#" } th { "event" } th { "subject" } th { "reason" } th { "stored" } th { "payload" } }
                    @for l in letters {
                        tr {
                            td.n { (l.sequence) }
                            td { (short(&l.event_id, None)) }
                            td { code { (l.subject) } }
                            td { code { (l.reason) } }
                            td.at { (format_time(l.at)) " " span.muted { "(" (ago(SystemTime::now().duration_since(l.at).unwrap_or_default())) " ago)" } }
                            td {
                                @if frame.show_bodies {
                                    pre { (String::from_utf8_lossy(&l.payload)) }
                                    @if l.payload_len > l.payload.len() {
                                        span.muted { "(the first " (l.payload.len()) " of " (l.payload_len) " bytes)" }
                                    }
                                } @else {
                                    span.muted { (l.payload_len) " bytes, hidden" }
                                }
                            }
                        }
                    }
                }
                @if !frame.show_bodies {
                    p.muted { "Payloads are hidden: they carry personal data; the service shows them with " code { "Console::show_bodies(true)" } "." }
                }
            }
        }
    };
    layout(frame, "Dead letters", body)
}

/// The request that wrote the event `id`, if its record says so.
pub(crate) fn event_request(frame: &Frame, id: &str, found: Option<&RequestKey>) -> Markup {
    let base = &frame.base;
    let body = html! {
        section {
            p { "Event " code { (id) } }
            @if let Some(k) = found {
                table {
                    tr { th { "scope" } td { code { (k.scope) } @if let Some(spread) = &k.spread { " " span.muted { "(spread by " (spread) ")" } } } }
                    tr { th { "principal" } td { @if k.principal.is_empty() { span.muted { "none" } } @else { code { (k.principal) } } } }
                    tr { th { "key" } td {
                        // A key spread by its hash is looked up without a principal; one
                        // spread by a tenant only with the body that named it.
                        @match k.spread.as_deref() {
                            None => a href=(format!("{base}/key?scope={}&principal={}&key={}", encode(&k.scope), encode(&k.principal), encode(&k.key))) { code { (k.key) } },
                            Some("key") => a href=(format!("{base}/key?scope={}&key={}", encode(&k.scope), encode(&k.key))) { code { (k.key) } },
                            Some(_) => code { (k.key) },
                        }
                    } }
                }
            } @else {
                p {
                    "No committed record says which request wrote it: the event is gone from the "
                    "outbox (published, re-driven and published, or discarded), it was written "
                    "without a key, or its request's record expired, was purged, or was taken over "
                    "by a later request with its key."
                }
            }
            p.muted {
                "An event's row does not record its key: it is found as the record created in the "
                "same transaction whose key derives the event's id. This reads the whole table of "
                "records."
            }
        }
    };
    layout(frame, "The request that wrote an event", body)
}

/// The form fields of a confirmation: the filter, the bound, and `force` for a re-drive
/// past the window.
fn confirmation(
    filter: &EventFilter,
    bound: &DeadBound,
    force: bool,
) -> Vec<(&'static str, String)> {
    let mut fields = filter_fields(filter);
    fields.push(("through", bound.through().to_string()));
    fields.push(("as_of", bound.as_of().to_string()));
    fields.push(("expected", bound.events().to_string()));
    if force {
        fields.push(("force", "1".to_owned()));
    }
    fields
}

/// The confirmation page of `action` on the dead events `filter` names: how many, the
/// first of them, those past the re-drive window `max_age`, and the button that acts on
/// what it counted. `warning` says why a confirmation was refused.
pub(crate) fn preview(
    frame: &Frame,
    action: DeadAction,
    filter: &EventFilter,
    preview: &DeadPreview,
    max_age: Duration,
    warning: Option<&str>,
) -> Markup {
    let base = &frame.base;
    let redrive = action == DeadAction::Redrive;
    let force = redrive && preview.outside_window > 0;
    let title = if redrive {
        "Re-drive dead events?"
    } else {
        "Discard dead events?"
    };
    let body = html! {
        @if let Some(warning) = warning {
            section.warn role="status" { p { strong { (warning) } } }
        }
        section {
            p {
                "Selected: " code { (filter) } ". "
                @if preview.events == 0 {
                    "No dead event matches: there is nothing to " (if redrive { "re-drive" } else { "discard" }) "."
                } @else {
                    strong { (counted(preview.events, "dead event")) } " match"
                    @if preview.events == 1 { "es" }
                    " now. "
                    @if redrive {
                        "A re-drive makes each pending again, its attempts reset: the relay publishes it."
                    } @else {
                        "A discard deletes each: it is never published."
                    }
                }
            }
            @if preview.events > 0 {
                p.muted {
                    "The button acts on the " (preview.events) " counted here, no other: an event "
                    "parked after this page was drawn may match the filter too, and is left as it is."
                }
            }
        }
        @if force {
            section.warn {
                p {
                    strong { (preview.outside_window) " of them were written more than " (ago(max_age)) " ago, " }
                    "outside the re-drive window. Consumers that deduplicate with " code { "run_once" }
                    " keep their record of a delivery for about that long. If one of these events "
                    "reached them before (its publish failed after the broker took it), they may have "
                    "forgotten it, and would apply it a second time."
                }
            }
        }
        @if !preview.first.is_empty() {
            section {
                h2 {
                    @if preview.events as usize > preview.first.len() {
                        "The first " (preview.first.len()) ", oldest first"
                    } @else {
                        "All of them, oldest first"
                    }
                }
                table.events {
                    tr { th { "event" } th { "topic" } th { "ordering key" } th { "attempts" } th { "parked" } th { "written" } th { "reason" } }
                    @for e in &preview.first {
                        tr {
                            td { (short(&e.id, Some(event_href(base, &e.id, true)))) }
                            td { code { (e.topic) } }
                            td { @if let Some(k) = &e.ordering_key { (short(k, None)) } }
                            td.n { (e.attempts) }
                            td.at { (ago(e.dead_for)) " ago" }
                            td { (age(e, max_age)) }
                            td { code { (e.last_error) } }
                        }
                    }
                }
            }
        }
        section {
            p {
                @if let Some(bound) = &preview.bound {
                    @let label = if force {
                        format!("{} {}, {} past the window", action.verb(), counted(preview.events, "event"), preview.outside_window)
                    } else {
                        format!("{} {}", action.verb(), counted(preview.events, "event"))
                    };
                    (action_form(frame, action, &confirmation(filter, bound, force), &label, !redrive || force))
                    " "
                }
                a href=(format!("{base}/dead{}", filter_query(&listing(filter)))) { "Cancel" }
            }
        }
    };
    layout(frame, title, body)
}

/// `filter` as the dead list shows it: without ids (the list has no field for them).
fn listing(filter: &EventFilter) -> EventFilter {
    let mut listed = filter.clone();
    listed.ids = None;
    listed
}

/// The form of `action` with `fields`.
fn action_form(
    frame: &Frame,
    action: DeadAction,
    fields: &[(&'static str, String)],
    label: &str,
    danger: bool,
) -> Markup {
    self::action(frame, action.path(), fields, label, danger)
}

/// What a re-drive refused for the window found.
pub(crate) struct Window {
    pub(crate) selected: u64,
    pub(crate) outside: u64,
    pub(crate) oldest: Duration,
    pub(crate) max_age: Duration,
}

/// A confirmed re-drive refused because events of it are outside the re-drive window by
/// now: nothing moved; the form re-drives the same events (the filter within the same
/// bound) with `force=1`.
pub(crate) fn redrive_past_window(
    frame: &Frame,
    filter: &EventFilter,
    bound: &DeadBound,
    window: &Window,
) -> Markup {
    let Window {
        selected,
        outside,
        oldest,
        max_age,
    } = *window;
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
                (action_form(frame, DeadAction::Redrive, &confirmation(filter, bound, true), &format!("Re-drive {} anyway", counted(selected, "event")), true))
                " "
                a href=(format!("{}/dead{}", frame.base, filter_query(&listing(filter)))) { "Cancel" }
            }
        }
    };
    layout(frame, "Re-drive past the window?", body)
}

/// The sweep's confirmation page: the expired records per scope, and the button that
/// sweeps them.
pub(crate) fn sweep_preview(frame: &Frame, counts: &[KeyCounts]) -> Markup {
    let expired: Vec<&KeyCounts> = counts.iter().filter(|c| c.expired > 0).collect();
    let total: u64 = expired.iter().map(|c| c.expired).sum();
    let body = html! {
        section {
            @if total == 0 {
                p { "No expired record is waiting for a sweep." }
            } @else {
                p {
                    strong { (counted(total, "expired record")) } " wait for a sweep. They are never "
                    "replayed again (a request with their key runs afresh); a sweep deletes them, and "
                    "the expired steps of requests that never committed."
                }
                table {
                    tr { th { "scope" } th { "expired" } }
                    @for c in &expired {
                        tr { td { code { (c.scope) } } td.n { (c.expired) } }
                    }
                }
                p.muted {
                    "A sweep deletes what has expired when it runs: a record that expires after this "
                    "page was drawn goes too (the service's own sweeper would delete it the same), and "
                    "the page after it says how many did."
                }
            }
        }
        section {
            p {
                @if total > 0 {
                    (action(frame, "/sweep", &[("expected", total.to_string())], &format!("Sweep {}", counted(total, "expired record")), true))
                    " "
                }
                a href=(format!("{}/keys", frame.base)) { "Cancel" }
            }
        }
    };
    layout(frame, "Sweep expired records?", body)
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
