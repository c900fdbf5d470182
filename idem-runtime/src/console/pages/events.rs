//! The outbox's pages: its state, pending and dead events, one event, the consumers'
//! dead letters, an event's request, and a bulk action's preview.

use super::*;

/// Who holds an event: the relay of owner number `owner` (its host and process), or what
/// holds it without one.
pub(super) fn holder(owner: Option<i32>, backing_off: bool, relays: &[RelaySession]) -> Markup {
    match owner {
        Some(owner) => relays::owner(i64::from(owner), relays),
        None if backing_off => html! { "backoff, or a lease by time" },
        None => html! { "a relay (lease by time)" },
    }
}

pub(super) fn lease_cells(base: &str, l: &Lease, relays: &[RelaySession]) -> Markup {
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
pub(super) fn attempts(errors: &[FailedPublish]) -> Markup {
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
pub(super) fn age(event: &DeadEvent, max_age: Duration) -> Markup {
    html! {
        (ago(event.age)) " ago"
        @if event.outside_window(max_age) {
            " " span.outside title="A re-drive of it is forced past the window" { "outside the re-drive window" }
        }
    }
}

/// What the re-drive window means, for the pages that show it.
pub(super) fn window(max_age: Duration) -> Markup {
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
pub(super) fn confirmation(
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
pub(super) fn listing(filter: &EventFilter) -> EventFilter {
    let mut listed = filter.clone();
    listed.ids = None;
    listed
}

/// The form of `action` with `fields`.
pub(super) fn action_form(
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
