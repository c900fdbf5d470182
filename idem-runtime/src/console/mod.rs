//! An operator's console for idem's keys and outbox: an axum [`Router`] that the service
//! mounts, rendering HTML on the server, over the same queries as the command-line tool
//! ([`crate::operate`]). One small script of its own (the copy buttons, the live pages)
//! improves the pages; every page works without it.
//!
//! ```no_run
//! # async fn f(store: idem::Store) {
//! use axum::{Extension, Router};
//! use idem::console::{Console, Role};
//!
//! let admin = Console::new(store)
//!     .actions(true) // re-drive, discard, purge, sweep, complete, abandon: for admins
//!     .operator_header(axum::http::HeaderName::from_static("x-operator"))
//!     .router()
//!     // One level of operator: everyone who passes the service's auth acts. A service
//!     // with two inserts the `Role` of each request in its auth layer instead.
//!     .layer(Extension(Role::Admin));
//! // Behind the service's own authentication: the console has none.
//! let app: Router = Router::new().nest("/admin/idem", admin);
//! # }
//! ```
//!
//! - **No authentication of its own.** Mount it behind the service's auth layer (the
//!   guide's "Operating idem", "The console", shows a bearer-token layer); anyone who
//!   reaches it sees keys, scopes and principals.
//! - **Read-only unless [`Console::actions`]** turns on the actions (re-drive and discard
//!   dead events, purge a key, sweep, complete or abandon an abandoned request), **and
//!   the request's [`Role`] is [`Role::Admin`]**. The role is the application's decision:
//!   its auth layer inserts a `Role` into the request's extensions
//!   (`request.extensions_mut().insert(..)`, or axum's `Extension` layer for a console
//!   with one level), where no client can set it.
//!   A request without one is [`Role::ReadOnly`]: it sees no action button nor form, and
//!   every action answers it 403 (an HTML page, as the console's other errors), whatever
//!   CSRF token it sends. Each form carries a CSRF token tied to the operator, and each
//!   action is logged (target `idem::console`, INFO) with the operator's name from
//!   [`Console::operator_header`], a header the auth layer sets.
//! - **Every action is audited.** It runs through [`Operate::audited`](crate::operate::Operate::audited) as the operator
//!   (`unknown` without the header), via `console`: its row in the audit table commits
//!   with the action, and the "Audit" page lists the trail, newest first, whoever acted
//!   (the console, `idem` on the command line, the service's own tools).
//! - **A bulk action shows what it will touch first.** Re-driving or discarding dead
//!   events (checked ones, a reason's, those a filter finds, or all) opens a confirmation
//!   page: how many, the first of them, how many are past the re-drive window
//!   ([`StoreBuilder::redrive_max_age`](crate::StoreBuilder::redrive_max_age)), and a
//!   button that names the count ("Re-drive 12 events"). Only that button acts, and it
//!   acts on the events the page counted: the filter within the preview's
//!   [`DeadBound`] (the highest `seq` and the instant it saw). An event parked after the
//!   preview is left as it is, and the page after the action says how many were. A
//!   sweep's page counts the expired records per scope before its button sweeps them.
//!   Purging one key is a single-item action: the key's own page, which shows the record,
//!   is its confirmation, and its button purges that record only.
//! - **Abandoned requests show where their completion stands** ([`crate::complete`]): its
//!   state (pending, failed, abandoning, or not completable), how often the completer ran
//!   it, how many runs failed, the last error and when. "Complete now" (a stored request
//!   only) sends it to the completer's next look, its failures forgotten; "Abandon for
//!   good" opens a page that names the scope, principal and key and its steps, and says
//!   that their compensations will run and the key will answer 410: only that page's
//!   button abandons. An action that finds nothing to act on says so (404, or 409 for a
//!   request its endpoint did not store) and does nothing.
//! - **Things are found by filters and pages.** The key list by scope, principal, key
//!   prefix and age; the abandoned requests by scope, principal, key prefix, completion
//!   stage and idle time; the pending and the dead events by topic, reason (last error),
//!   ordering key prefix and age; each a page at a time by keyset ("Next page" starts
//!   after the last row shown, never at an offset). A key's page lists the events its
//!   request wrote that are still in the outbox; an event's page links to the request
//!   that wrote it, when its record is still there ([`Operate::key_events`](crate::operate::Operate::key_events) says how, and
//!   what no link reaches), and shows its last ten failed publishes with their times
//!   ([`Operate::event_errors`](crate::operate::Operate::event_errors)).
//! - **Bodies and payloads hidden unless [`Console::show_bodies`]**: stored responses,
//!   event payloads and dead letters' payloads carry personal data.
//! - **Live.** The overview and the outbox page fetch themselves again every
//!   [`Console::refresh_every`] (5 s by default) and put the new figures in place,
//!   without a reload, while the tab is visible; an operator pauses it in the header.
//!   Without script they are plain pages, their time in the header.
//! - **Where each figure comes from is said.** The overview shows the database's
//!   figures (records per scope, pending and dead events, the relays holding their
//!   sessions: the same from every instance) apart from this process's (the requests it
//!   answered since it started, with the `metrics` feature; its relays' per-minute
//!   figures, given with [`Console::relay_stats`]; the lag chart, which it samples).
//! - **Relays by host and process.** Wherever a lease's owner number appears, the relay
//!   is shown by the host and process id its session names ([`Operate::outbox_relays`](crate::operate::Operate::outbox_relays)),
//!   and the overview and the outbox list the relays.
//! - **Long ids are shortened** in lists (the whole id in the text, its `title` and a
//!   copy button), and the pages use the window's width.
//! - **No inline script or style.** Pages are sent with a `Content-Security-Policy` that
//!   allows the console's own stylesheet and script (`/assets/..`, named by a hash of
//!   their content, under the mount point) and nothing else, and may not be framed. Its
//!   error pages (400, 403, 404, 409, 500, 503) are pages of the console too, with its
//!   stylesheet and header.
//!
//! Pages: the overview, keys (a list, and one key's record, steps and events), the
//! abandoned requests, the outbox (pending per topic, relays, leases, blocked ordering
//! keys), the pending events (listed, and one by one), the dead events (grouped by
//! reason, listed, and one by one), the consumers' dead letters where configured
//! (`Console::jetstream_dead_letters`, feature `nats`), and the audit trail.
//!
//! The lag chart is drawn from samples the console takes itself, every
//! [`Console::lag_sample_every`], from the router's first request until the router is
//! dropped; it starts empty when the process does. The
//! relays' counters are sampled with it.
//!
//! [`DeadBound`]: crate::operate::DeadBound

mod abandoned;
mod assets;
mod csrf;
mod events;
mod form;
mod keys;
mod lag;
mod pages;
mod relays;

use events::*;
use keys::*;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::{FromRequestParts, NestedPath, Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, LOCATION, X_FRAME_OPTIONS};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::Markup;
use serde::Deserialize;

use crate::operate::{
    Audited, ConfirmError, DeadBound, EventFilter, KeyCursor, KeyFilter, Operator,
};
use crate::outbox::RelayStats;
use crate::Store;

/// The console of one store, configured; [`Console::router`] makes its router.
#[must_use = "a `Console` serves nothing until `.router()` is mounted"]
pub struct Console {
    store: Store,
    actions: bool,
    show_bodies: bool,
    operator_header: Option<HeaderName>,
    lag_every: Duration,
    refresh_every: Duration,
    relay_stats: Option<Box<dyn Fn() -> RelayStats + Send + Sync>>,
    #[cfg(any(feature = "nats", feature = "amqp"))]
    dead_letters: Option<DeadLetters>,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("store", &self.store)
            .field("actions", &self.actions)
            .field("show_bodies", &self.show_bodies)
            .field("operator_header", &self.operator_header)
            .finish_non_exhaustive()
    }
}

/// Where the consumers' dead letters are read from (`Console::jetstream_dead_letters`,
/// `Console::amqp_dead_letters`).
#[cfg(any(feature = "nats", feature = "amqp"))]
enum DeadLetters {
    #[cfg(feature = "nats")]
    JetStream {
        // Boxed: a context is some hundreds of bytes, a connection's handle one pointer.
        jetstream: Box<async_nats::jetstream::Context>,
        stream: String,
    },
    #[cfg(feature = "amqp")]
    Amqp {
        connection: Arc<lapin::Connection>,
        queue: String,
    },
}

/// What an operator may do in the console, decided by the service: its auth layer
/// inserts one into each request's extensions (where a client cannot set it), beside
/// the operator's name in [`Console::operator_header`].
///
/// ```
/// use axum::extract::Request;
/// use axum::middleware::Next;
/// use axum::response::{IntoResponse, Response};
/// use idem::console::Role;
///
/// /// Two bearer tokens: one acts, one only looks.
/// async fn operators(mut request: Request, next: Next) -> Response {
///     let sent = request.headers().get("authorization").and_then(|v| v.to_str().ok());
///     let role = match sent {
///         Some("Bearer admin-token-0123456789") => Role::Admin,
///         Some("Bearer viewer-token-0123456789") => Role::ReadOnly,
///         _ => return axum::http::StatusCode::UNAUTHORIZED.into_response(),
///     };
///     request.extensions_mut().insert(role);
///     next.run(request).await
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Sees every page; shown no action, and answered 403 on any action. What a request
    /// without a `Role` is.
    #[default]
    ReadOnly,
    /// Sees every page and takes the console's actions, when [`Console::actions`] is on.
    Admin,
}

impl Console {
    /// The console of `store`: read-only, bodies and payloads hidden, the lag sampled
    /// every 30 s, the live pages refreshed every 5 s.
    pub fn new(store: Store) -> Self {
        Self {
            store,
            actions: false,
            show_bodies: false,
            operator_header: None,
            lag_every: Duration::from_secs(30),
            refresh_every: Duration::from_secs(5),
            relay_stats: None,
            #[cfg(any(feature = "nats", feature = "amqp"))]
            dead_letters: None,
        }
    }

    /// Whether the console has its actions (default off): re-drive and discard dead
    /// events, purge a key, sweep expired records, complete or abandon an abandoned
    /// request. On, they are offered to the requests whose [`Role`] is [`Role::Admin`],
    /// and refused (403) to the others; off, their routes do not exist (404).
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

    /// How often the outbox's lag is sampled for the overview's chart, and the relays'
    /// counters for their per-minute figures (default 30 s; at least 100 ms).
    pub fn lag_sample_every(mut self, every: Duration) -> Self {
        self.lag_every = every.max(Duration::from_millis(100));
        self
    }

    /// How often the live pages (the overview, the outbox) fetch their figures again in
    /// the operator's browser (default 5 s; whole seconds, at least one). Each refresh
    /// runs the page's queries once, as a reload would.
    pub fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh_every = Duration::from_secs(every.as_secs().max(1));
        self
    }

    /// The counters of the relays this process runs, read when a page shows them and at
    /// each lag sample: the overview and the outbox show what they published, retried
    /// and parked per minute, and since they started, labelled as this process's (the
    /// relays of other processes count in theirs; a fleet's figures are in the relays'
    /// metrics, feature `metrics`). Without it those pages say so.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store, publisher: impl idem::outbox::Publisher) -> Result<(), idem::outbox::RelayError> {
    /// use std::sync::Arc;
    ///
    /// let relay = Arc::new(store.relay(publisher).spawn()?);
    /// let console = idem::console::Console::new(store.clone())
    ///     .relay_stats({
    ///         let relay = Arc::clone(&relay);
    ///         move || relay.stats()
    ///     })
    ///     .router::<()>();
    /// # Ok(()) }
    /// ```
    pub fn relay_stats<F>(mut self, stats: F) -> Self
    where
        F: Fn() -> RelayStats + Send + Sync + 'static,
    {
        self.relay_stats = Some(Box::new(stats));
        self
    }

    /// The consumers' dead letters, read back from the JetStream stream `stream` (the one
    /// that captures their
    /// [`dead_letter_subject`](crate::outbox::nats::JetStreamConsumer::dead_letter_subject))
    /// with [`dead_letters`](crate::outbox::nats::dead_letters): a "Dead letters" page,
    /// linked from the header, lists the newest (event id, subject, reason, time; the
    /// payload only with [`Console::show_bodies`]). Without it the page does not exist.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), async_nats::ConnectError> {
    /// let jetstream = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
    /// let console = idem::console::Console::new(store)
    ///     .jetstream_dead_letters(jetstream, "charges_dead")
    ///     .router::<()>();
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "nats")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub fn jetstream_dead_letters(
        mut self,
        jetstream: async_nats::jetstream::Context,
        stream: impl Into<String>,
    ) -> Self {
        self.dead_letters = Some(DeadLetters::JetStream {
            jetstream: Box::new(jetstream),
            stream: stream.into(),
        });
        self
    }

    /// The consumers' dead letters, read back from the RabbitMQ queue `queue` (the one
    /// bound to their dead-letter exchange) with
    /// [`dead_letters`](crate::outbox::amqp::dead_letters), without taking them: a "Dead
    /// letters" page, linked from the header, lists the oldest (event id, routing key,
    /// RabbitMQ's reason, time; the payload only with [`Console::show_bodies`]). Why the
    /// consumer gave up is in its log line, which names the event. Without it (or
    /// [`Console::jetstream_dead_letters`], which it replaces) the page does not exist.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), lapin::Error> {
    /// use std::sync::Arc;
    ///
    /// let amqp = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
    /// let console = idem::console::Console::new(store)
    ///     .amqp_dead_letters(Arc::new(amqp), "charges_ledger_dead")
    ///     .router::<()>();
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "amqp")]
    #[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
    pub fn amqp_dead_letters(
        mut self,
        connection: Arc<lapin::Connection>,
        queue: impl Into<String>,
    ) -> Self {
        self.dead_letters = Some(DeadLetters::Amqp {
            connection,
            queue: queue.into(),
        });
        self
    }

    /// The console's router, to mount with [`Router::nest`] behind the service's
    /// authentication. It starts nothing: its first request starts the lag sampler (on
    /// the runtime that serves it), which stops when the router (and every clone of it)
    /// is dropped.
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
            refresh_every: self.refresh_every,
            relays: self.relay_stats.map(relays::Counters::new),
            #[cfg(any(feature = "nats", feature = "amqp"))]
            dead_letters: self.dead_letters,
            sampling: std::sync::Once::new(),
        });
        let mut router = Router::new()
            .route("/", get(overview))
            .route("/assets/{file}", get(assets::serve))
            .route("/keys", get(keys))
            .route("/abandoned", get(abandoned::list))
            .route("/key", get(key))
            .route("/outbox", get(outbox))
            .route("/pending", get(pending))
            .route("/pending/event", get(pending_event))
            .route("/dead", get(dead))
            .route("/dead/event", get(dead_event))
            .route("/event/request", get(event_request))
            .route("/audit", get(audit));
        #[cfg(any(feature = "nats", feature = "amqp"))]
        if shared.dead_letters.is_some() {
            router = router.route("/dead-letters", get(dead_letters));
        }
        if self.actions {
            router = router
                .route("/key/purge", post(purge_key))
                .route("/abandoned/complete", post(abandoned::complete))
                .route(
                    "/abandoned/abandon",
                    get(abandoned::abandon_preview).post(abandoned::abandon),
                )
                .route("/sweep", get(sweep_preview).post(sweep))
                .route("/dead/redrive", get(redrive_preview).post(redrive))
                .route("/dead/discard", get(discard_preview).post(discard));
        }
        router
            .layer(middleware::from_fn_with_state(
                Arc::clone(&shared),
                framed_errors,
            ))
            .with_state(shared)
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
    /// How often the live pages refresh.
    refresh_every: Duration,
    /// This process's relays, when the service gave their counters.
    relays: Option<relays::Counters>,
    #[cfg(any(feature = "nats", feature = "amqp"))]
    dead_letters: Option<DeadLetters>,
    /// Whether the lag sampler has started (at the first request).
    sampling: std::sync::Once,
}

/// The handlers' state.
type Console_ = State<Arc<Shared>>;

/// What a page needs besides its data: where the console is mounted, whether this
/// operator may act (and their CSRF token), a message after an action.
pub(crate) struct Frame {
    base: String,
    token: Option<String>,
    show_bodies: bool,
    notice: Option<String>,
    /// Whether the header links to the dead letters' page.
    dead_letters: bool,
    /// Every how many seconds the page refreshes itself; `None` for a page that does not.
    live: Option<u64>,
}

/// Who asks, as the service's auth layer described them: where the console is mounted
/// (`/admin/idem`, or nothing at the root: every link and form of a page starts with
/// it), the operator's name from [`Console::operator_header`] (empty without it), and
/// their [`Role`].
struct Viewer {
    base: String,
    operator: String,
    role: Role,
}

impl FromRequestParts<Arc<Shared>> for Viewer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Arc<Shared>,
    ) -> Result<Self, Self::Rejection> {
        let nested = parts.extensions.get::<NestedPath>();
        Ok(Self {
            base: nested
                .map(|n| n.as_str().trim_end_matches('/').to_owned())
                .unwrap_or_default(),
            operator: console.operator(&parts.headers),
            role: parts.extensions.get::<Role>().copied().unwrap_or_default(),
        })
    }
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

    /// Whether `viewer` may act: the actions are on and their role is admin.
    fn may_act(&self, viewer: &Viewer) -> bool {
        self.actions && viewer.role == Role::Admin
    }

    fn frame(&self, viewer: &Viewer, notice: Option<String>) -> Frame {
        Frame {
            base: viewer.base.clone(),
            token: self
                .may_act(viewer)
                .then(|| self.csrf.token(&viewer.operator)),
            show_bodies: self.show_bodies,
            notice,
            dead_letters: self.has_dead_letters(),
            live: None,
        }
    }

    /// The frame of a page that refreshes itself (the overview, the outbox).
    fn live_frame(&self, viewer: &Viewer, notice: Option<String>) -> Frame {
        Frame {
            live: Some(self.refresh_every.as_secs()),
            ..self.frame(viewer, notice)
        }
    }

    /// Whether the consumers' dead letters are configured.
    fn has_dead_letters(&self) -> bool {
        #[cfg(any(feature = "nats", feature = "amqp"))]
        {
            self.dead_letters.is_some()
        }
        #[cfg(not(any(feature = "nats", feature = "amqp")))]
        {
            false
        }
    }

    /// What this process's relays did lately, if the service gave their counters.
    fn relay_rates(&self) -> Option<relays::Rates> {
        self.relays.as_ref().and_then(relays::Counters::rates)
    }

    /// The refusal of an action's page to a read-only operator; `None` for an admin.
    fn read_only(&self, viewer: &Viewer) -> Option<Response> {
        (!self.may_act(viewer)).then(|| Refused::ReadOnly.page())
    }

    /// The operator of a POST that may act: an admin whose form carries their CSRF
    /// token. Else why not, the role checked first, so that a read-only operator is
    /// refused whatever token they send.
    fn acting(&self, viewer: &Viewer, token: &str) -> Result<String, Refused> {
        if !self.may_act(viewer) {
            return Err(Refused::ReadOnly);
        }
        if !self.csrf.verify(&viewer.operator, token) {
            return Err(Refused::Token);
        }
        Ok(viewer.operator.clone())
    }

    /// The store's actions as `operator` takes them through the console: recorded in the
    /// audit trail (`unknown` when the operator header names nobody).
    fn audited(&self, operator: &str) -> Audited<'_> {
        let name = if operator.is_empty() {
            "unknown"
        } else {
            operator
        };
        self.store.operate().audited(Operator::new(name, "console"))
    }
}

/// Why an action was refused (403).
enum Refused {
    /// The operator's role is read-only.
    ReadOnly,
    /// The form's CSRF token is missing or another operator's.
    Token,
}

impl Refused {
    fn page(&self) -> Response {
        let why = match self {
            Self::ReadOnly => {
                "This operator's role is read-only: the console's actions are for operators \
                 the service names admin."
            }
            Self::Token => {
                "The form's CSRF token is missing or not this operator's: reload the page and \
                 try again."
            }
        };
        page_error(StatusCode::FORBIDDEN, why)
    }
}

/// A page: no caching (it shows live data, possibly personal), never in a frame (its
/// forms act), no script or style but the console's own.
fn html(status: StatusCode, markup: Markup) -> Response {
    let mut response = (status, markup).into_response();
    let headers = response.headers_mut();
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(assets::POLICY),
    );
    response
}

/// An error page: `status`, and `message` to say what happened. A handler cannot know
/// the viewer's frame everywhere it fails (a refusal, a bad field), so the response
/// carries the message to [`framed_errors`], which renders the page in the console's
/// layout, under the base the console is mounted at.
fn page_error(status: StatusCode, message: &str) -> Response {
    let mut response = status.into_response();
    response
        .extensions_mut()
        .insert(ErrorPage(message.to_owned()));
    response
}

/// The message of an error page, on its way to [`framed_errors`].
#[derive(Clone)]
struct ErrorPage(String);

/// Every error page of the console ([`page_error`]) rendered as its other pages are, for
/// the viewer who asked: with the stylesheet and script under the console's mount point
/// (which only the request knows, from [`NestedPath`]), so that the page is styled under
/// its policy, and with the console's header to go on from.
async fn framed_errors(
    State(console): Console_,
    viewer: Viewer,
    request: Request,
    next: Next,
) -> Response {
    console.sampling.call_once(|| {
        tokio::spawn(lag::sample(Arc::downgrade(&console), console.lag_every));
    });
    let mut response = next.run(request).await;
    let Some(ErrorPage(message)) = response.extensions_mut().remove::<ErrorPage>() else {
        return response;
    };
    let status = response.status();
    let frame = console.frame(&viewer, None);
    html(status, pages::error(&frame, status, &message))
}

/// A database error as a page, logged.
fn failed(error: sqlx::Error) -> Response {
    tracing::warn!(target: "idem::console", %error, "idem console: a query failed");
    let status = if crate::sqlstate::is_unavailable(&error) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    page_error(status, &format!("The database answered: {error}"))
}

/// Back to `path` (under the console's base) after an action, saying what was done.
fn back(base: &str, path: &str, notice: &str) -> Response {
    let separator = if path.contains('?') { '&' } else { '?' };
    see_other(&format!(
        "{base}{path}{separator}done={}",
        pages::encode(notice)
    ))
}

/// A redirect (303) to `location`, a path the console made.
fn see_other(location: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    if let Ok(value) = HeaderValue::from_str(location) {
        response.headers_mut().insert(LOCATION, value);
    }
    response
}

#[derive(Deserialize, Default)]
struct Notice {
    done: Option<String>,
}
