//! An operator's console for idem's keys and outbox: an axum [`Router`] that the service
//! mounts, rendering HTML on the server (no script), over the same queries as the
//! command-line tool ([`crate::operate`]).
//!
//! ```no_run
//! # async fn f(store: idem::Store) {
//! use axum::Router;
//! use idem::console::Console;
//!
//! let admin = Console::new(store)
//!     .actions(true) // re-drive, discard, purge, sweep
//!     .operator_header(axum::http::HeaderName::from_static("x-operator"))
//!     .router();
//! // Behind the service's own authentication: the console has none.
//! let app: Router = Router::new().nest("/admin/idem", admin);
//! # }
//! ```
//!
//! - **No authentication of its own.** Mount it behind the service's auth layer (the
//!   guide's "Operating idem", "The console", shows a bearer-token layer); anyone who reaches it sees keys, scopes and
//!   principals.
//! - **Read-only unless [`Console::actions`]** turns on the POST forms (re-drive and
//!   discard dead events, purge a key, sweep). Each form carries a CSRF token tied to
//!   the operator, and each action is logged (target `idem::console`, INFO) with the
//!   operator's name from [`Console::operator_header`], a header the auth layer sets.
//! - **Every action is audited.** It runs through [`Store::audited`] as the operator
//!   (`unknown` without the header), via `console`: its row in the audit table commits
//!   with the action, and the "Audit" page lists the trail, newest first, whoever acted
//!   (the console, `idem` on the command line, the service's own tools).
//! - **A re-drive past the window asks first.** The dead events' pages show each event's
//!   age beside the store's re-drive window
//!   ([`StoreBuilder::redrive_max_age`](crate::StoreBuilder::redrive_max_age)); a
//!   re-drive whose selection holds an event outside it moves nothing and answers a
//!   page that says so, whose form re-drives the same selection with `force=1`.
//! - **Bodies and payloads hidden unless [`Console::show_bodies`]**: stored responses
//!   and event payloads carry personal data.
//!
//! Pages: the overview (records per scope, those expiring within the hour, what this
//! process counted of replays, 409s and 422s with the `metrics` feature, the outbox's
//! lag over the last hour, dead events by reason), keys (a list by scope, principal or
//! age, and one key's record), the outbox (pending per topic, leases, blocked ordering
//! keys), the dead events (grouped by reason, re-driven or discarded in bulk) and the
//! audit trail.
//!
//! The lag chart is drawn from samples the console takes itself, every
//! [`Console::lag_sample_every`], from when [`Console::router`] is called (within a tokio
//! runtime) until the router is dropped.

mod csrf;
mod lag;
mod pages;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::{Form, FromRequestParts, NestedPath, Query, State};
use axum::http::header::{CACHE_CONTROL, LOCATION, X_FRAME_OPTIONS};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::Markup;
use serde::Deserialize;

use crate::operate::{Audited, DeadSelection, KeyFilter, Operator, RedriveError};
use crate::Store;

/// The console of one store, configured; [`Console::router`] makes its router.
#[must_use = "a `Console` serves nothing until `.router()` is mounted"]
pub struct Console {
    store: Store,
    actions: bool,
    show_bodies: bool,
    operator_header: Option<HeaderName>,
    lag_every: Duration,
}

/// The read-only console of `store`, bodies hidden: `Console::new(store).router()`.
pub fn router<S>(store: Store) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    Console::new(store).router()
}

impl Console {
    /// The console of `store`: read-only, bodies and payloads hidden, the lag sampled
    /// every 30 s.
    pub fn new(store: Store) -> Self {
        Self {
            store,
            actions: false,
            show_bodies: false,
            operator_header: None,
            lag_every: Duration::from_secs(30),
        }
    }

    /// Whether the console offers its actions (default off): re-drive and discard dead
    /// events, purge a key, sweep expired records.
    pub fn actions(mut self, on: bool) -> Self {
        self.actions = on;
        self
    }

    /// Whether stored response bodies and event payloads are shown (default off: they
    /// carry personal data).
    pub fn show_bodies(mut self, on: bool) -> Self {
        self.show_bodies = on;
        self
    }

    /// The request header that names the operator, set by the service's auth layer: each
    /// action is logged with it, and the CSRF tokens are tied to it.
    pub fn operator_header(mut self, name: HeaderName) -> Self {
        self.operator_header = Some(name);
        self
    }

    /// How often the outbox's lag is sampled for the overview's chart (default 30 s; at
    /// least 100 ms).
    pub fn lag_sample_every(mut self, every: Duration) -> Self {
        self.lag_every = every.max(Duration::from_millis(100));
        self
    }

    /// The console's router, to mount with [`Router::nest`] behind the service's
    /// authentication. Call it within a tokio runtime: it starts the lag sampler, which
    /// stops when the router (and every clone of it) is dropped.
    pub fn router<S>(self) -> Router<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        let shared = Arc::new(Shared {
            store: self.store,
            actions: self.actions,
            show_bodies: self.show_bodies,
            operator_header: self.operator_header,
            csrf: csrf::Key::random(),
            lag_every: self.lag_every,
            lag: Mutex::new(VecDeque::new()),
        });
        tokio::spawn(lag::sample(Arc::downgrade(&shared), self.lag_every));
        let mut router = Router::new()
            .route("/", get(overview))
            .route("/keys", get(keys))
            .route("/abandoned", get(abandoned))
            .route("/key", get(key))
            .route("/outbox", get(outbox))
            .route("/dead", get(dead))
            .route("/dead/event", get(dead_event))
            .route("/audit", get(audit));
        if self.actions {
            router = router
                .route("/key/purge", post(purge_key))
                .route("/sweep", post(sweep))
                .route("/dead/redrive", post(redrive))
                .route("/dead/discard", post(discard));
        }
        router.with_state(shared)
    }
}

/// What every handler shares.
pub(crate) struct Shared {
    store: Store,
    actions: bool,
    show_bodies: bool,
    operator_header: Option<HeaderName>,
    csrf: csrf::Key,
    /// How often the sampler samples the lag.
    lag_every: Duration,
    /// The lag samples of the last hour: when, and the age of the oldest pending event
    /// in seconds (0 when none was pending), oldest first.
    lag: Mutex<VecDeque<(SystemTime, f64)>>,
}

/// The handlers' state.
type Console_ = State<Arc<Shared>>;

/// What a page needs besides its data: where the console is mounted, whether actions
/// are on (and the operator's CSRF token), a message after an action.
pub(crate) struct Frame {
    base: String,
    token: Option<String>,
    show_bodies: bool,
    notice: Option<String>,
}

impl Shared {
    fn operator(&self, headers: &HeaderMap) -> String {
        self.operator_header
            .as_ref()
            .and_then(|name| headers.get(name))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    }

    fn frame(&self, base: &str, headers: &HeaderMap, notice: Option<String>) -> Frame {
        Frame {
            base: base.to_owned(),
            token: self
                .actions
                .then(|| self.csrf.token(&self.operator(headers))),
            show_bodies: self.show_bodies,
            notice,
        }
    }

    /// The operator of a POST whose token is right; `None` for a missing or wrong
    /// token ([`refused`]).
    fn check(&self, headers: &HeaderMap, token: &str) -> Option<String> {
        let operator = self.operator(headers);
        self.csrf.verify(&operator, token).then_some(operator)
    }

    /// The store's actions as `operator` takes them through the console: recorded in the
    /// audit trail (`unknown` when the operator header names nobody).
    fn audited(&self, operator: &str) -> Audited<'_> {
        let name = if operator.is_empty() {
            "unknown"
        } else {
            operator
        };
        self.store.audited(Operator::new(name, "console"))
    }
}

/// Where the console is mounted: `/admin/idem`, or nothing at the root. Every link and
/// form of a page starts with it, so pages work under any mount point.
struct Base(String);

impl<S: Send + Sync> FromRequestParts<S> for Base {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let nested = parts.extensions.get::<NestedPath>();
        Ok(Self(
            nested
                .map(|n| n.as_str().trim_end_matches('/').to_owned())
                .unwrap_or_default(),
        ))
    }
}

/// A page: no caching (it shows live data, possibly personal), never in a frame (its
/// forms act).
fn html(status: StatusCode, markup: Markup) -> Response {
    let mut response = (status, markup).into_response();
    let headers = response.headers_mut();
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

/// A POST whose CSRF token is missing or not its operator's.
fn refused() -> Response {
    page_error(
        StatusCode::FORBIDDEN,
        "The form's CSRF token is missing or not this operator's: reload the page and try again.",
    )
}

fn page_error(status: StatusCode, message: &str) -> Response {
    html(status, pages::error(status, message))
}

/// A database error as a page, logged.
fn failed(error: sqlx::Error) -> Response {
    tracing::warn!(target: "idem::console", %error, "idem console: a query failed");
    let status = if crate::is_unavailable(&error) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    page_error(status, &format!("The database answered: {error}"))
}

/// Back to `path` (under the console's base) after an action, saying what was done.
fn back(base: &str, path: &str, notice: &str) -> Response {
    let separator = if path.contains('?') { '&' } else { '?' };
    let location = format!("{base}{path}{separator}done={}", pages::encode(notice));
    let mut response = StatusCode::SEE_OTHER.into_response();
    if let Ok(value) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(LOCATION, value);
    }
    response
}

#[derive(Deserialize, Default)]
struct Notice {
    done: Option<String>,
}

async fn overview(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Query(notice): Query<Notice>,
) -> Response {
    let store = &console.store;
    let within = Duration::from_secs(3_600);
    let (counts, reasons, pending, lag) = match tokio::try_join!(
        store.key_counts(within),
        store.dead_reasons(),
        store.outbox_pending(),
        store.outbox_lag(),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    lag::record(&console, lag);
    let samples: Vec<(SystemTime, f64)> = console
        .lag
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .copied()
        .collect();
    let frame = console.frame(&base, &headers, notice.done);
    let chart = lag::chart(&samples, SystemTime::now(), console.lag_every);
    html(
        StatusCode::OK,
        pages::overview(&frame, &counts, &outcomes(), &reasons, &pending, lag, chart),
    )
}

/// What this process counted of its requests (feature `metrics`), else nothing.
fn outcomes() -> Option<Vec<(String, crate::Outcome, u64)>> {
    #[cfg(feature = "metrics")]
    {
        Some(crate::operate::request_counts())
    }
    #[cfg(not(feature = "metrics"))]
    {
        None
    }
}

#[derive(Deserialize, Default)]
struct KeysQuery {
    scope: Option<String>,
    principal: Option<String>,
    older_than: Option<String>,
    expired: Option<String>,
    done: Option<String>,
}

/// A form's age field named `label`: `None` when left empty, else the age as operators
/// write it, or the line that says how to write one (a 400 page).
fn age_field(text: Option<&str>, label: &str) -> Result<Option<Duration>, String> {
    let Some(text) = text.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    crate::operate::parse_age(text)
        .map(Some)
        .ok_or_else(|| format!("\"{label}\" is a whole number and a unit: 90s, 30m, 24h or 7d."))
}

async fn keys(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Query(q): Query<KeysQuery>,
) -> Response {
    let filled = |v: &Option<String>| {
        v.as_deref()
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    };
    let older_than = match age_field(q.older_than.as_deref(), "older than") {
        Ok(age) => age,
        Err(how) => return page_error(StatusCode::BAD_REQUEST, &how),
    };
    let filter = KeyFilter {
        scope: filled(&q.scope),
        principal: filled(&q.principal),
        older_than,
        include_expired: q.expired.is_some(),
        limit: 100,
    };
    let listed = match console.store.keys(&filter).await {
        Ok(listed) => listed,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&base, &headers, q.done);
    html(
        StatusCode::OK,
        pages::keys(
            &frame,
            &filter,
            q.older_than.as_deref().unwrap_or(""),
            &listed,
        ),
    )
}

#[derive(Deserialize, Default)]
struct AbandonedQuery {
    idle: Option<String>,
    done: Option<String>,
}

async fn abandoned(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Query(q): Query<AbandonedQuery>,
) -> Response {
    let typed = q.idle.as_deref().map(str::trim).filter(|v| !v.is_empty());
    let idle_for = match age_field(typed, "no step for") {
        Ok(age) => age.unwrap_or_else(|| console.store.abandoned_after()),
        Err(how) => return page_error(StatusCode::BAD_REQUEST, &how),
    };
    let limit = 100;
    let listed = match console.store.abandoned(idle_for, limit).await {
        Ok(listed) => listed,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&base, &headers, q.done);
    html(
        StatusCode::OK,
        pages::abandoned(
            &frame,
            &typed.map_or_else(|| crate::operate::format_age(idle_for), str::to_owned),
            limit,
            &listed,
        ),
    )
}

#[derive(Deserialize)]
struct KeyQuery {
    scope: String,
    #[serde(default)]
    principal: String,
    key: String,
    done: Option<String>,
}

async fn key(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Query(q): Query<KeyQuery>,
) -> Response {
    let store = &console.store;
    let (found, steps) = match tokio::try_join!(
        store.key(&q.scope, &q.principal, &q.key, console.show_bodies),
        store.key_steps(&q.scope, &q.principal, &q.key, console.show_bodies),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&base, &headers, q.done);
    let status = if found.is_some() || !steps.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    html(
        status,
        pages::key(
            &frame,
            &q.scope,
            &q.principal,
            &q.key,
            found.as_ref(),
            &steps,
        ),
    )
}

async fn outbox(State(console): Console_, Base(base): Base, headers: HeaderMap) -> Response {
    let store = &console.store;
    let (pending, leases, blocked) = match tokio::try_join!(
        store.outbox_pending(),
        store.outbox_leases(100),
        store.outbox_blocked(100),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&base, &headers, None);
    html(
        StatusCode::OK,
        pages::outbox(&frame, &pending, &leases, &blocked),
    )
}

async fn dead(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Query(notice): Query<Notice>,
) -> Response {
    let store = &console.store;
    let (reasons, events) = match tokio::try_join!(
        store.dead_reasons(),
        store.dead_events_in(&DeadSelection::All, 500),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&base, &headers, notice.done);
    let max_age = store.redrive_max_age();
    html(
        StatusCode::OK,
        pages::dead(&frame, &reasons, &events, max_age),
    )
}

#[derive(Deserialize)]
struct EventQuery {
    id: String,
}

async fn dead_event(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Query(q): Query<EventQuery>,
) -> Response {
    let found = match console.store.dead_event(&q.id, console.show_bodies).await {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&base, &headers, None);
    let status = if found.is_some() {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    let max_age = console.store.redrive_max_age();
    html(
        status,
        pages::dead_event(&frame, &q.id, found.as_ref(), max_age),
    )
}

/// A POSTed form's fields, `id` repeated for a selection.
type Fields = Form<Vec<(String, String)>>;

fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// The dead events a form selects: `all`, a `reason`, or the checked `id`s; a re-drive's
/// `force` re-drives them past the re-drive window.
fn selection(fields: &[(String, String)]) -> Option<DeadSelection> {
    if field(fields, "all").is_some() {
        return Some(DeadSelection::All);
    }
    if let Some(reason) = field(fields, "reason") {
        return Some(DeadSelection::Reason(reason.to_owned()));
    }
    let ids: Vec<String> = fields
        .iter()
        .filter(|(n, _)| n == "id")
        .map(|(_, v)| v.clone())
        .collect();
    (!ids.is_empty()).then_some(DeadSelection::Ids(ids))
}

async fn redrive(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Form(fields): Fields,
) -> Response {
    dead_action(&console, &base, &headers, &fields, true).await
}

async fn discard(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Form(fields): Fields,
) -> Response {
    dead_action(&console, &base, &headers, &fields, false).await
}

async fn dead_action(
    console: &Shared,
    base: &str,
    headers: &HeaderMap,
    fields: &[(String, String)],
    redrive: bool,
) -> Response {
    let Some(operator) = console.check(headers, field(fields, "csrf").unwrap_or("")) else {
        return refused();
    };
    let Some(selection) = selection(fields) else {
        return back(base, "/dead", "Nothing was selected.");
    };
    let force = redrive && field(fields, "force").is_some();
    // The confirmation names how many it counted: a selection by reason, or of all,
    // that holds others by now (events parked since) is shown again, not re-driven.
    let expected = field(fields, "expected").and_then(|n| n.parse::<u64>().ok());
    if let (true, Some(expected)) = (force, expected) {
        match console.store.dead_count(&selection).await {
            Ok(now) if now != expected => {
                return back(
                    base,
                    "/dead",
                    &format!(
                        "Nothing was re-driven: the selection holds {now} dead event(s) now, \
                         not the {expected} you confirmed. Review it again."
                    ),
                );
            }
            Ok(_) => {}
            Err(e) => return failed(e),
        }
    }
    let audited = console.audited(&operator);
    let done = if force {
        audited.redrive_dead_forced(&selection).await
    } else if redrive {
        match audited.redrive_dead(&selection).await {
            Err(RedriveError::OutsideWindow {
                selected,
                outside,
                oldest,
                max_age,
            }) => {
                tracing::info!(
                    target: "idem::console",
                    operator = %operator,
                    action = "redrive",
                    selection = %selection,
                    outside,
                    "idem console: re-drive refused, events outside the re-drive window"
                );
                let frame = console.frame(base, headers, None);
                let page = pages::redrive_past_window(
                    &frame, &selection, selected, outside, oldest, max_age,
                );
                return html(StatusCode::CONFLICT, page);
            }
            Err(RedriveError::Database(e)) => Err(e),
            Ok(n) => Ok(n),
        }
    } else {
        audited.discard_dead(&selection).await
    };
    let n = match done {
        Ok(n) => n,
        Err(e) => return failed(e),
    };
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = if redrive { "redrive" } else { "discard" },
        selection = %selection,
        forced = force,
        events = n,
        "idem console: dead events {}",
        if redrive { "re-driven" } else { "discarded" }
    );
    let notice = if redrive {
        format!("Re-drove {n} dead event(s): they are pending again.")
    } else {
        format!("Discarded {n} dead event(s).")
    };
    back(base, "/dead", &notice)
}

async fn purge_key(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Form(fields): Fields,
) -> Response {
    let Some(operator) = console.check(&headers, field(&fields, "csrf").unwrap_or("")) else {
        return refused();
    };
    let (Some(scope), Some(key)) = (field(&fields, "scope"), field(&fields, "key")) else {
        return page_error(StatusCode::BAD_REQUEST, "A purge names a scope and a key.");
    };
    let principal = field(&fields, "principal").unwrap_or("");
    let n = match console
        .audited(&operator)
        .purge_key(scope, principal, key)
        .await
    {
        Ok(n) => n,
        Err(e) => return failed(e),
    };
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = "purge",
        scope,
        records = n,
        "idem console: key purged"
    );
    back(
        &base,
        "/keys",
        &format!("Purged {n} record(s) of that key in scope {scope}."),
    )
}

async fn sweep(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Form(fields): Fields,
) -> Response {
    let Some(operator) = console.check(&headers, field(&fields, "csrf").unwrap_or("")) else {
        return refused();
    };
    let n = match console.audited(&operator).purge_expired(1_000).await {
        Ok(n) => n,
        Err(e) => return failed(e),
    };
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = "sweep",
        records = n,
        "idem console: expired records swept"
    );
    back(&base, "/keys", &format!("Swept {n} expired record(s)."))
}

#[derive(Deserialize, Default)]
struct AuditQuery {
    before: Option<i64>,
}

/// The audit trail, newest first, a page at a time: `before` pages by id.
async fn audit(
    State(console): Console_,
    Base(base): Base,
    headers: HeaderMap,
    Query(q): Query<AuditQuery>,
) -> Response {
    let limit = 100;
    let entries = match console.store.audit_log(limit, q.before).await {
        Ok(entries) => entries,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&base, &headers, None);
    html(
        StatusCode::OK,
        pages::audit(&frame, &entries, limit, q.before.is_some()),
    )
}
