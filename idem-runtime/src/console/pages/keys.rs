//! The keys' pages: the list, the abandoned requests, one key, an abandon's
//! confirmation, a sweep's preview, and the audit trail.

use super::*;

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
pub(super) fn query_of(pairs: &[(&str, String)]) -> String {
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
pub(super) fn completion_cells(completion: Option<&CompletionState>) -> Markup {
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
pub(super) fn acting_principal(a: &Abandoned) -> &str {
    if a.spread.as_deref() == Some("key") {
        ""
    } else {
        &a.principal
    }
}

/// An admin's actions on an abandoned request: "Complete now" for a stored request, and
/// the link to the confirmation page of "Abandon for good"; neither once it is being
/// abandoned. `list` (the list's query) takes the operator back to the page as it was.
pub(super) fn abandoned_actions(frame: &Frame, a: &Abandoned, list: &str) -> Markup {
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
