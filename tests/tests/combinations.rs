//! The combination suite (issue 27): the contract's promises, run over the settings a user
//! can combine, generated rather than written case by case.
//!
//! Six axes: the mode (the default, behind the suite's PgBouncer in transaction mode,
//! portable on the suite's Citus), where the key comes from (`Idempotency-Key`, a signed id
//! header, a verified body field, `digest(body)`, `run_once`), where the principal comes
//! from (none, the store's resolver, the resolver with `require_principal()`, the
//! endpoint's `principal = ..`), the spread (none, `spread = key`, a tenant function, or
//! changed between two starts of the service), the isolation level and the concurrency
//! policy (reject; `wait(..)`; `wait(..)` under a shorter `statement_timeout`). A pairwise
//! cover of them ([`idem_tests::pairwise`]) gives some twenty cells; the pairs that cannot
//! be configured are refused by [`refuse`], each with its reason, and printed with the
//! cover. The signed key sources exist only with a signed body: `webhook-id` is Standard
//! Webhooks' signed id header, the body field is a Stripe event's `id`, the digest is of a
//! GitHub delivery (which signs the body alone); the `Idempotency-Key` header takes a plain
//! JSON body (a signed body keyed by it does not compile:
//! `ui/fail/default_key_on_signed_body.rs`).
//!
//! Each cell runs its service on a real database, twice: a first start takes the first
//! deliveries, then stops; a second start, with the cell's spread after the change where
//! the spread changed, takes their retries. The checks, each on its own message:
//!
//! - a retry replays: the stored status, content type and body, byte for byte, with
//!   `Idempotent-Replayed: true`, and the handler does not run again;
//! - concurrent copies of a request in flight get 409 (`reject`) or the replay, and the
//!   handler runs once;
//! - the key with another payload gets 422 (for `digest(body)`, where the payload is the
//!   key: the same content spelled otherwise replays, other content is another delivery);
//! - a captured signed delivery, sent again with headers its signature does not cover
//!   (another `X-Account`, none, a fresh `Idempotency-Key`, a fresh `X-GitHub-Delivery`),
//!   replays and never acts again;
//! - a principal never sees another's answer (where the key comes from `Idempotency-Key`
//!   and a principal is resolved): the same key under another account runs on its own, a
//!   store that requires a principal refuses a request without one, and a tenant named by
//!   an anonymous body never answers for the account of that name;
//! - a failed attempt (the handler's `Err`) leaves nothing and stays retryable;
//! - an expired record lets its key run afresh.
//!
//! Effects are counted in a business table the handler writes through `Tx`: "once" is one
//! row. A cell that fails names the check and what it saw; all cells run, and each mode's
//! test fails at the end with the list of failing cells and why. Every HTTP endpoint is one
//! of a fixed set of handlers (the attribute is compile-time), one per compile-time
//! combination the cover needs, written out in [`endpoints!`] and read back from their
//! attributes; the unit tests below check that the set is exactly what the cover needs,
//! and that the cover holds every allowed pair and no refused one.
//!
//! Size and time: 23 cells (8 default, 8 pooler, 7 portable) of up to seven checks, each
//! cell one to two seconds; each mode's cells run one after another, the three modes side
//! by side, about 30 s for the whole file on two cores, the Citus cluster's start included
//! (CONTRIBUTING.md, "Run the tests").

use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{post, MethodRouter};
use axum::{Json, Router};
use futures::future::join_all;
use futures::FutureExt;
use idem::extract::Principal;
use idem::jobs::OnceError;
use idem::webhook::{GitHub, Signed, StandardWebhooks, Stripe, Verifier};
use idem::{idempotent, Pooler, Problem, Store, Tx};
use idem_tests::axis;
use idem_tests::pairwise::{self, Axis, Choice, Cover};
use idem_tests::{with_test_db, Answer, Citus, Pgbouncer, TestApp};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::Notify;

// ---------------------------------------------------------------------------------------
// The axes, their cover, and the pairs refused by design.

axis! {
    /// Where PostgreSQL is, and how the store is built for it.
    Mode as "mode" {
        /// One PostgreSQL, reached directly.
        Default = "default",
        /// Behind the suite's PgBouncer in transaction mode, `Pooler::Transaction`.
        Pooler = "pooler",
        /// On the suite's Citus (a coordinator and two workers), `portable()`, the tables
        /// distributed.
        Portable = "portable",
    }
}

axis! {
    /// Where the key comes from.
    KeySource as "key" {
        /// The `Idempotency-Key` header, with a plain JSON body.
        IdempotencyKey = "idempotency-key",
        /// Standard Webhooks' signed `webhook-id`: `key = header("webhook-id")`.
        WebhookId = "webhook-id",
        /// A verified body field: a Stripe event's `id`, `key = id`.
        BodyField = "body-field",
        /// `key = digest(body)` of a GitHub delivery, whose signature covers the body alone.
        Digest = "digest",
        /// `Store::run_once` keyed by the message's id: a queue consumer.
        RunOnce = "run_once",
    }
}

axis! {
    /// Where the principal comes from.
    PrincipalSource as "principal" {
        /// Nowhere: keys global to their scope.
        None = "none",
        /// The store's resolver (`StoreBuilder::principal`), reading `X-Account`.
        Resolver = "resolver",
        /// The same resolver, and `require_principal()`.
        Required = "required",
        /// The endpoint's own `principal = ..`: the account an auth layer put in
        /// `X-Account` for a plain endpoint, the endpoint's own merchant for a signed one.
        Endpoint = "endpoint",
    }
}

axis! {
    /// Where a key without a principal is kept.
    SpreadSetting as "spread" {
        /// No option (the nobody value; a hash of the key in the portable mode).
        None = "none",
        /// `spread = key`, `RunOnce::spread_by_key`.
        Key = "key",
        /// `spread = account_of`, `RunOnce::spread_by(account)`: the body's account.
        Tenant = "tenant",
        /// `spread = key` at the first start, `spread = account_of` at the second: the
        /// change the guide's "Changing where keys are kept" describes (in the portable mode the first is what no option
        /// does too, a hash of the key).
        Changed = "changed",
    }
}

axis! {
    /// The attribute's `isolation = ..`.
    Isolation as "isolation" {
        /// `read_committed`, the default.
        ReadCommitted = "read_committed",
        /// `repeatable_read`.
        RepeatableRead = "repeatable_read",
        /// `serializable`.
        Serializable = "serializable",
    }
}

axis! {
    /// What a copy of a request in flight gets.
    Concurrency as "concurrency" {
        /// `concurrency = reject` (for `run_once`, the store's default conflict wait).
        Reject = "reject",
        /// `concurrency = wait("5s")` (for `run_once`, `conflict_wait(5 s)`).
        Wait = "wait",
        /// The same wait with the store's `statement_timeout` at 300 ms, shorter than it
        /// and than the handler.
        WaitShortTimeout = "wait+statement_timeout",
    }
}

/// The axes, in the cover's order.
const AXES: [Axis; 6] = [
    Mode::AXIS,
    KeySource::AXIS,
    PrincipalSource::AXIS,
    SpreadSetting::AXIS,
    Isolation::AXIS,
    Concurrency::AXIS,
];

/// Why two values cannot be configured together, or `None` when they can.
fn refuse(a: Choice, b: Choice) -> Option<&'static str> {
    let either = |axis: &Axis| {
        let index = AXES.iter().position(|x| x.name == axis.name)?;
        [a, b].into_iter().find(|c| c.0 == index).map(|c| c.1)
    };
    let key = either(&KeySource::AXIS).map(|v| KeySource::ALL[v]);
    let principal = either(&PrincipalSource::AXIS).map(|v| PrincipalSource::ALL[v]);
    let spread = either(&SpreadSetting::AXIS).map(|v| SpreadSetting::ALL[v]);
    let isolation = either(&Isolation::AXIS).map(|v| Isolation::ALL[v]);
    match (key, principal, spread, isolation) {
        (Some(KeySource::RunOnce), Some(PrincipalSource::Resolver), ..) => Some(
            "a queue message has no HTTP request for the store's resolver to read: `run_once` \
             keys are global to their scope (the guide's \"Queue consumers and jobs\")",
        ),
        (Some(KeySource::RunOnce), Some(PrincipalSource::Endpoint), ..) => Some(
            "`principal = ..` is an option of `#[idempotent]`, and `run_once` has no attribute",
        ),
        (
            Some(KeySource::RunOnce),
            _,
            _,
            Some(Isolation::RepeatableRead | Isolation::Serializable),
        ) => Some("`RunOnce` has no isolation setting: its work runs at read committed"),
        (
            _,
            Some(PrincipalSource::Endpoint),
            Some(SpreadSetting::Key | SpreadSetting::Tenant | SpreadSetting::Changed),
            _,
        ) => Some(
            "`spread = ..` with `principal = ..` does not compile: a key with a principal is \
             kept under it (ui/fail/spread_with_principal.rs)",
        ),
        _ => None,
    }
}

/// One cell of the cover.
#[derive(Debug, Clone, Copy)]
struct Cell {
    /// Its number in the cover.
    n: usize,
    mode: Mode,
    key: KeySource,
    principal: PrincipalSource,
    spread: SpreadSetting,
    isolation: Isolation,
    concurrency: Concurrency,
}

/// The cover, and its cells.
fn cover() -> (Cover, Vec<Cell>) {
    let cover = pairwise::cover(&AXES, refuse);
    let cells = cover
        .cells
        .iter()
        .enumerate()
        .map(|(n, c)| Cell {
            n,
            mode: Mode::ALL[c[0]],
            key: KeySource::ALL[c[1]],
            principal: PrincipalSource::ALL[c[2]],
            spread: SpreadSetting::ALL[c[3]],
            isolation: Isolation::ALL[c[4]],
            concurrency: Concurrency::ALL[c[5]],
        })
        .collect();
    (cover, cells)
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cell {:2} ({} {} principal={} spread={} {} {})",
            self.n,
            self.mode.name(),
            self.key.name(),
            self.principal.name(),
            self.spread.name(),
            self.isolation.name(),
            self.concurrency.name()
        )
    }
}

// ---------------------------------------------------------------------------------------
// The endpoints: one handler per compile-time combination the cover needs.

/// `spread = ..` on an endpoint, or on a `run_once`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpreadOption {
    None,
    Key,
    Tenant,
}

/// Whether the endpoint names its principal itself (`principal = ..`) or leaves it to the
/// store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrincipalOption {
    Store,
    Endpoint,
}

/// The attribute's `concurrency = ..`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConcurrencyOption {
    Reject,
    Wait,
}

/// An endpoint's compile-time settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Endpoint {
    key: KeySource,
    principal: PrincipalOption,
    spread: SpreadOption,
    concurrency: ConcurrencyOption,
    isolation: Isolation,
}

impl Cell {
    /// The spread of the first start and of the second.
    fn starts(&self) -> [SpreadOption; 2] {
        match self.spread {
            SpreadSetting::None => [SpreadOption::None; 2],
            SpreadSetting::Key => [SpreadOption::Key; 2],
            SpreadSetting::Tenant => [SpreadOption::Tenant; 2],
            SpreadSetting::Changed => [SpreadOption::Key, SpreadOption::Tenant],
        }
    }

    /// The endpoint a start with `spread` serves; `None` for `run_once`.
    fn endpoint(&self, spread: SpreadOption) -> Option<Endpoint> {
        (self.key != KeySource::RunOnce).then_some(Endpoint {
            key: self.key,
            principal: match self.principal {
                PrincipalSource::Endpoint => PrincipalOption::Endpoint,
                _ => PrincipalOption::Store,
            },
            spread,
            concurrency: match self.concurrency {
                Concurrency::Reject => ConcurrencyOption::Reject,
                Concurrency::Wait | Concurrency::WaitShortTimeout => ConcurrencyOption::Wait,
            },
            isolation: self.isolation,
        })
    }
}

/// The handlers, written out whole, and [`ENDPOINTS`]: each handler's attribute and
/// parameters as written (`stringify!`), read back by [`Endpoint::of`], with its route.
///
/// Not generated from the settings' names: `#[idempotent]` cannot be used inside a
/// `macro_rules!` that supplies some of a handler's tokens (its name, body type, options)
/// and writes the others itself (`cannot find value __idem_span in this scope`: the
/// attribute defines its locals with the call site's hygiene and refers to some of them
/// with the user's tokens' spans). So every token of a handler is written here and passed
/// through as it is, and its settings are read from what it says, never restated.
macro_rules! endpoints {
    ($($hash:tt $attr:tt $async:tt $fn:tt $name:ident $params:tt -> $ret:tt $body:tt)*) => {
        $($hash $attr $async $fn $name $params -> $ret $body)*

        /// Each handler's attribute and parameters as written, and its route.
        const ENDPOINTS: &[(&str, &str, fn() -> MethodRouter<Service>)] =
            &[$((stringify!($attr), stringify!($params), || post($name)),)*];
    };
}

// One handler per compile-time combination the cover needs (`every_cell_has_its_endpoints`
// names one missing or unused); `_before` and `_after` are the two starts of a change.
endpoints! {
    #[idempotent(scope = "combinations", concurrency = reject, isolation = read_committed)]
    async fn e00(tx: Tx, State(f): State<Fixture>, body: Json<Order>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = header("webhook-id"), spread = key, concurrency = wait("5s"), isolation = repeatable_read)]
    async fn e01(tx: Tx, State(f): State<Fixture>, body: Signed<Order, StandardWebhooks>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = id, spread = account_of, concurrency = wait("5s"), isolation = serializable)]
    async fn e02(tx: Tx, State(f): State<Fixture>, body: Signed<Order, Stripe>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = digest(body), principal = Merchant, concurrency = wait("5s"), isolation = repeatable_read)]
    async fn e03(tx: Tx, State(f): State<Fixture>, body: Signed<Order, GitHub>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = digest(body), spread = key, concurrency = reject, isolation = serializable)]
    async fn e05(tx: Tx, State(f): State<Fixture>, body: Signed<Order, GitHub>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", spread = account_of, concurrency = wait("5s"), isolation = read_committed)]
    async fn e06(tx: Tx, State(f): State<Fixture>, body: Json<Order>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = header("webhook-id"), spread = account_of, concurrency = reject, isolation = repeatable_read)]
    async fn e07(tx: Tx, State(f): State<Fixture>, body: Signed<Order, StandardWebhooks>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = header("webhook-id"), principal = Merchant, concurrency = wait("5s"), isolation = serializable)]
    async fn e08(tx: Tx, State(f): State<Fixture>, body: Signed<Order, StandardWebhooks>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = id, spread = key, concurrency = reject, isolation = serializable)]
    async fn e09_before(tx: Tx, State(f): State<Fixture>, body: Signed<Order, Stripe>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = id, spread = account_of, concurrency = reject, isolation = serializable)]
    async fn e09_after(tx: Tx, State(f): State<Fixture>, body: Signed<Order, Stripe>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", spread = key, concurrency = wait("5s"), isolation = repeatable_read)]
    async fn e10_before(tx: Tx, State(f): State<Fixture>, body: Json<Order>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", spread = account_of, concurrency = wait("5s"), isolation = repeatable_read)]
    async fn e10_after(tx: Tx, State(f): State<Fixture>, body: Json<Order>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = id, spread = key, concurrency = wait("5s"), isolation = read_committed)]
    async fn e12(tx: Tx, State(f): State<Fixture>, body: Signed<Order, Stripe>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", spread = key, concurrency = reject, isolation = serializable)]
    async fn e13(tx: Tx, State(f): State<Fixture>, body: Json<Order>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = digest(body), spread = account_of, concurrency = wait("5s"), isolation = read_committed)]
    async fn e14(tx: Tx, State(f): State<Fixture>, body: Signed<Order, GitHub>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = id, principal = Merchant, concurrency = reject, isolation = repeatable_read)]
    async fn e15(tx: Tx, State(f): State<Fixture>, body: Signed<Order, Stripe>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = header("webhook-id"), spread = key, concurrency = wait("5s"), isolation = read_committed)]
    async fn e17_before(tx: Tx, State(f): State<Fixture>, body: Signed<Order, StandardWebhooks>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = header("webhook-id"), spread = account_of, concurrency = wait("5s"), isolation = read_committed)]
    async fn e17_after(tx: Tx, State(f): State<Fixture>, body: Signed<Order, StandardWebhooks>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", principal = Account, concurrency = wait("5s"), isolation = read_committed)]
    async fn e18(tx: Tx, State(f): State<Fixture>, body: Json<Order>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = digest(body), spread = key, concurrency = wait("5s"), isolation = repeatable_read)]
    async fn e19_before(tx: Tx, State(f): State<Fixture>, body: Signed<Order, GitHub>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = digest(body), spread = account_of, concurrency = wait("5s"), isolation = repeatable_read)]
    async fn e19_after(tx: Tx, State(f): State<Fixture>, body: Signed<Order, GitHub>) -> Handled { handle(tx, &f, &body.0).await }

    #[idempotent(scope = "combinations", key = header("webhook-id"), concurrency = wait("5s"), isolation = serializable)]
    async fn e22(tx: Tx, State(f): State<Fixture>, body: Signed<Order, StandardWebhooks>) -> Handled { handle(tx, &f, &body.0).await }
}

/// What every handler answers.
type Handled = Result<(StatusCode, Json<Value>), Failure>;

/// Every handler's body: [`act`], answered 201.
async fn handle(tx: Tx<'_>, fixture: &Fixture, order: &Order) -> Handled {
    let answer = act(tx, fixture, order).await?;
    Ok((StatusCode::CREATED, Json(answer)))
}

impl Endpoint {
    /// The settings a handler's attribute and parameters say, as `stringify!` spelled
    /// them; panics on an option this suite's handlers do not use, or on a body that does
    /// not go with the key source.
    fn of(attr: &str, params: &str) -> Self {
        let squeeze =
            |text: &str| -> String { text.chars().filter(|c| !c.is_whitespace()).collect() };
        let (attr, params) = (squeeze(attr), squeeze(params));
        let inner = attr
            .strip_prefix("[idempotent(")
            .and_then(|rest| rest.strip_suffix(")]"))
            .unwrap_or_else(|| panic!("not an `#[idempotent(..)]`: {attr}"));
        let mut options = BTreeMap::new();
        let (mut depth, mut from) = (0, 0);
        for (at, c) in inner.char_indices().chain([(inner.len(), ',')]) {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    let option = &inner[from..at];
                    let (name, value) = option
                        .split_once('=')
                        .unwrap_or_else(|| panic!("not `name = value`: {option}"));
                    assert!(
                        options.insert(name, value).is_none(),
                        "{name} twice: {attr}"
                    );
                    from = at + 1;
                }
                _ => {}
            }
        }
        assert_eq!(options.remove("scope"), Some("\"combinations\""), "{attr}");
        let key = match options.remove("key") {
            None => KeySource::IdempotencyKey,
            Some("header(\"webhook-id\")") => KeySource::WebhookId,
            Some("id") => KeySource::BodyField,
            Some("digest(body)") => KeySource::Digest,
            Some(other) => panic!("key = {other}: not a key source of this suite"),
        };
        let body = match key {
            KeySource::IdempotencyKey => "body:Json<Order>",
            KeySource::WebhookId => "body:Signed<Order,StandardWebhooks>",
            KeySource::BodyField => "body:Signed<Order,Stripe>",
            KeySource::Digest => "body:Signed<Order,GitHub>",
            KeySource::RunOnce => unreachable!("`run_once` has no attribute"),
        };
        assert!(params.contains(body), "{attr} takes {body}, not {params}");
        let signed = key != KeySource::IdempotencyKey;
        let principal = match options.remove("principal") {
            None => PrincipalOption::Store,
            Some("Account") if !signed => PrincipalOption::Endpoint,
            Some("Merchant") if signed => PrincipalOption::Endpoint,
            Some(other) => panic!("principal = {other} on {attr}"),
        };
        let spread = match options.remove("spread") {
            None => SpreadOption::None,
            Some("key") => SpreadOption::Key,
            Some("account_of") => SpreadOption::Tenant,
            Some(other) => panic!("spread = {other}"),
        };
        let concurrency = match options.remove("concurrency") {
            None | Some("reject") => ConcurrencyOption::Reject,
            Some("wait(\"5s\")") => ConcurrencyOption::Wait,
            Some(other) => panic!("concurrency = {other}: this suite waits 5 s"),
        };
        let isolation = match options.remove("isolation") {
            None | Some("read_committed") => Isolation::ReadCommitted,
            Some("repeatable_read") => Isolation::RepeatableRead,
            Some("serializable") => Isolation::Serializable,
            Some(other) => panic!("isolation = {other}"),
        };
        assert!(
            options.is_empty(),
            "options this suite does not vary: {options:?}"
        );
        Self {
            key,
            principal,
            spread,
            concurrency,
            isolation,
        }
    }
}

/// The route serving `endpoint`.
fn route(endpoint: Endpoint) -> MethodRouter<Service> {
    let (.., route) = ENDPOINTS
        .iter()
        .find(|(attr, params, _)| Endpoint::of(attr, params) == endpoint)
        .unwrap_or_else(|| panic!("no handler for {endpoint:?}: add it to `endpoints!`"));
    route()
}

// ---------------------------------------------------------------------------------------
// The service: its state, its principals, and the one thing every handler does.

/// Standard Webhooks' secret (`whsec_` and 24 bytes in base64).
const STANDARD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// Stripe's secret, used whole as the key.
const STRIPE_SECRET: &str = "whsec_combinations_0123456789abcdef";
/// GitHub's secret.
const GITHUB_SECRET: &str = "combinations-github-secret-0123";
/// The account the requests come from (`X-Account`).
const ACCOUNT: &str = "acct_1";
/// The tenant their bodies name (`spread = account_of`): not [`ACCOUNT`], so that a key
/// kept under one is never found under the other by chance.
const TENANT: &str = "tenant_1";
/// The principal of the signed endpoints with `principal = Merchant`.
const MERCHANT: &str = "merchant_7";
/// The header an auth layer fills with the authenticated account, in this suite.
const ACCOUNT_HEADER: &str = "x-account";
/// How long the handler of a copy's first request takes.
const SLOW: Duration = Duration::from_millis(800);
/// The store's `statement_timeout` for `wait+statement_timeout`: shorter than the wait
/// and than [`SLOW`].
const SHORT_STATEMENT_TIMEOUT: Duration = Duration::from_millis(300);
/// `concurrency = wait("5s")`, and `run_once`'s conflict wait.
const WAIT: Duration = Duration::from_secs(5);
/// The longest a half of a check may take.
const PHASE_LIMIT: Duration = Duration::from_secs(30);

/// The body every endpoint takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Order {
    id: String,
    account: Option<String>,
    amount: i64,
}

/// `spread = account_of`: the account the order names.
fn account_of(order: &Order) -> Option<&str> {
    order.account.as_deref()
}

/// The store's resolver: the account in `X-Account`.
fn account(parts: &Parts) -> Option<String> {
    let value = parts.headers.get(ACCOUNT_HEADER)?.to_str().ok()?;
    Some(value.to_owned())
}

/// A plain endpoint's own `principal = Account`: the account an auth layer vouched for.
struct Account(String);

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        account(parts).map(Self).ok_or_else(|| {
            Problem::new(
                StatusCode::UNAUTHORIZED,
                "urn:combinations:unauthenticated",
                "No account",
            )
        })
    }
}

impl Principal for Account {
    fn principal_id(&self) -> String {
        self.0.clone()
    }
}

/// A signed endpoint's own `principal = Merchant`: fixed by the endpoint's code (the
/// merchant this provider's endpoint is configured for), nothing a request says.
struct Merchant;

impl<S: Send + Sync> FromRequestParts<S> for Merchant {
    type Rejection = Infallible;

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, Infallible> {
        Ok(Self)
    }
}

impl Principal for Merchant {
    fn principal_id(&self) -> String {
        MERCHANT.to_owned()
    }
}

/// What the test makes a handler do, by the order's id.
#[derive(Default)]
struct Faults {
    /// Fail once, after writing (the write must roll back).
    fail_once: Mutex<HashSet<String>>,
    /// Take [`SLOW`], after saying so on `started`.
    slow: Mutex<HashSet<String>>,
    started: Notify,
}

/// A cell's business table and faults, shared by its two starts.
#[derive(Clone)]
struct Fixture {
    /// The cell's schema: `effects` is the business table, `keys` idem's.
    schema: Arc<str>,
    /// Whether statements may be named (not behind the pooler).
    persistent: bool,
    faults: Arc<Faults>,
}

/// The service's state.
#[derive(Clone, FromRef)]
struct Service {
    store: Store,
    standard: Verifier<StandardWebhooks>,
    stripe: Verifier<Stripe>,
    github: Verifier<GitHub>,
    fixture: Fixture,
}

/// Why a handler failed: it answers `Err`, so nothing is stored.
#[derive(Debug)]
enum Failure {
    /// The failure the test asked for.
    Injected,
    /// The handler's own statement failed.
    Database(sqlx::Error),
}

/// The problem `type` of [`Failure::Injected`], which tells it from idem's own problems.
const INJECTED: &str = "urn:combinations:injected-failure";

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Injected => f.write_str("the injected failure"),
            Self::Database(e) => write!(f, "the handler's statement failed: {e}"),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let kind = match self {
            Self::Injected => INJECTED,
            Self::Database(_) => "urn:combinations:database",
        };
        Problem::new(StatusCode::INTERNAL_SERVER_ERROR, kind, "Failed")
            .with_detail(self.to_string())
            .into_response()
    }
}

/// Numbers every run of a handler, so that a replay and a fresh run never look alike.
static RUNS: AtomicI64 = AtomicI64::new(0);

/// What every handler and every `run_once` does: one row in `effects` through `Tx`, and
/// an answer naming this run.
async fn act(mut tx: Tx<'_>, fixture: &Fixture, order: &Order) -> Result<Value, Failure> {
    let run = RUNS.fetch_add(1, Ordering::Relaxed) + 1;
    let slow = fixture.faults.slow.lock().unwrap().contains(&order.id);
    if slow {
        fixture.faults.started.notify_one();
        tokio::time::sleep(SLOW).await;
    }
    let principal = tx.principal().unwrap_or_default().to_owned();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {}.effects (principal, id, run, amount) VALUES ($1, $2, $3, $4)",
        fixture.schema
    )))
    .bind(&principal)
    .bind(&order.id)
    .bind(run)
    .bind(order.amount)
    .persistent(fixture.persistent)
    .execute(&mut *tx)
    .await
    .map_err(Failure::Database)?;
    if fixture.faults.fail_once.lock().unwrap().remove(&order.id) {
        return Err(Failure::Injected);
    }
    Ok(json!({ "id": order.id, "run": run, "principal": principal, "amount": order.amount }))
}

// ---------------------------------------------------------------------------------------
// Where a mode's cells run, and a cell's service.

/// A mode's database: the options the service connects with, and a direct pool for the
/// test's own statements (never through the pooler).
struct Site {
    mode: Mode,
    service: PgConnectOptions,
    direct: PgPool,
}

/// One start of a cell's service.
struct Instance {
    store: Store,
    pool: PgPool,
    /// The HTTP server; `None` for `run_once`.
    app: Option<TestApp>,
    fixture: Fixture,
    /// `run_once`'s spread.
    spread: SpreadOption,
}

/// Starts the cell's service with `spread`, as a service starts: connect, build the
/// store, migrate (and distribute on Citus), verify, serve. `Err` says which step refused.
async fn start(
    site: &Site,
    cell: &Cell,
    spread: SpreadOption,
    fixture: &Fixture,
) -> Result<Instance, String> {
    let options = match site.mode {
        Mode::Pooler => site.service.clone().statement_cache_capacity(0),
        Mode::Default | Mode::Portable => site.service.clone(),
    };
    let pool = idem::extract::warn_on_escaping_writes(PgPoolOptions::new())
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut builder = Store::builder(pool.clone()).table(format!("{}.keys", fixture.schema));
    builder = match site.mode {
        Mode::Default => builder,
        Mode::Pooler => builder.pooler(Pooler::Transaction),
        Mode::Portable => builder.portable(true),
    };
    builder = match cell.principal {
        PrincipalSource::None | PrincipalSource::Endpoint => builder,
        PrincipalSource::Resolver => builder.principal(account),
        PrincipalSource::Required => builder.principal(account).require_principal(true),
    };
    builder = match cell.concurrency {
        Concurrency::Reject => builder,
        Concurrency::Wait => builder.conflict_wait(WAIT),
        Concurrency::WaitShortTimeout => builder
            .conflict_wait(WAIT)
            .statement_timeout(SHORT_STATEMENT_TIMEOUT),
    };
    let store = builder.build().map_err(|e| format!("build: {e}"))?;
    store.migrate().await.map_err(|e| format!("migrate: {e}"))?;
    if site.mode == Mode::Portable {
        store
            .distribute(None)
            .await
            .map_err(|e| format!("distribute: {e}"))?;
    }
    store.verify().await.map_err(|e| format!("verify: {e}"))?;
    let app = match cell.endpoint(spread) {
        None => None,
        Some(endpoint) => {
            let service = Service {
                store: store.clone(),
                standard: Verifier::new(STANDARD_SECRET).expect("a valid secret"),
                stripe: Verifier::new(STRIPE_SECRET).expect("a valid secret"),
                github: Verifier::new(GITHUB_SECRET).expect("a valid secret"),
                fixture: fixture.clone(),
            };
            let router = Router::new()
                .route("/orders", route(endpoint))
                .with_state(service);
            Some(TestApp::serve(pool.clone(), router).await)
        }
    };
    Ok(Instance {
        store,
        pool,
        app,
        fixture: fixture.clone(),
        spread,
    })
}

impl Instance {
    /// Stops serving and closes the pool.
    async fn stop(self) {
        drop(self.app);
        self.pool.close().await;
    }

    /// Sends `delivery` and reads the answer.
    async fn send(&self, delivery: &Delivery) -> Reply {
        match &self.app {
            Some(_) => Reply::of(self.post(delivery).await),
            None => self.run_once(&delivery.order).await,
        }
    }

    /// `POST /orders` with the delivery's body and headers, the answer as it came.
    async fn post(&self, delivery: &Delivery) -> Answer {
        let app = self.app.as_ref().expect("an HTTP endpoint");
        let headers = delivery.headers.iter().map(|(n, v)| (n, v));
        app.deliver_to("/orders", &delivery.body, headers).await
    }

    /// The consumer: `run_once` keyed by the order's id, its payload the order.
    async fn run_once(&self, order: &Order) -> Reply {
        let ran = AtomicBool::new(false);
        let mut once = self
            .store
            .run_once("combinations", &order.id)
            .payload(order);
        once = match self.spread {
            SpreadOption::None => once,
            SpreadOption::Key => once.spread_by_key(),
            SpreadOption::Tenant => once.spread_by(order.account.as_deref().unwrap_or("")),
        };
        let result = once
            .run(async |tx| {
                ran.store(true, Ordering::SeqCst);
                act(tx, &self.fixture, order).await
            })
            .await;
        let stored = |value: &Value| Stored {
            status: 200,
            content_type: None,
            body: serde_json::to_vec(value).expect("JSON"),
        };
        match result {
            Ok(value) if ran.load(Ordering::SeqCst) => Reply::Fresh(stored(&value)),
            Ok(value) => Reply::Replay(stored(&value)),
            Err(OnceError::InUse) => Reply::Conflict,
            Err(OnceError::Mismatch) => Reply::Mismatch,
            Err(OnceError::Work(Failure::Injected)) => Reply::Failed,
            Err(error) => Reply::Other(format!("run_once: {error}")),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Deliveries and answers.

/// A request as its sender makes it: the order, the exact body bytes and the headers.
#[derive(Debug, Clone)]
struct Delivery {
    order: Order,
    body: String,
    headers: Vec<(String, String)>,
}

impl Delivery {
    /// The same bytes with header `name` set to `value` (replaced, or added).
    fn with(&self, name: &str, value: &str) -> Self {
        let mut copy = self.without(name);
        copy.headers.push((name.to_owned(), value.to_owned()));
        copy
    }

    /// The same bytes without header `name`.
    fn without(&self, name: &str) -> Self {
        let mut copy = self.clone();
        copy.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        copy
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Cell {
    /// `order` as this cell's sender delivers it, with `key` where the key source is a
    /// header (`Idempotency-Key`, `webhook-id`; GitHub's unsigned `X-GitHub-Delivery`),
    /// signed where the source is, from `X-Account` [`ACCOUNT`].
    fn delivery(&self, order: &Order, key: &str) -> Delivery {
        let body = serde_json::to_string(order).expect("JSON");
        self.delivery_of(order, body, key)
    }

    /// The same with the body spelled as `body`.
    fn delivery_of(&self, order: &Order, body: String, key: &str) -> Delivery {
        let text = |headers: Vec<(axum::http::HeaderName, String)>| -> Vec<(String, String)> {
            headers
                .into_iter()
                .map(|(n, v)| (n.as_str().to_owned(), v))
                .collect()
        };
        let t = now();
        let mut headers = match self.key {
            KeySource::IdempotencyKey => vec![("idempotency-key".to_owned(), key.to_owned())],
            KeySource::WebhookId => text(
                Verifier::<StandardWebhooks>::new(STANDARD_SECRET)
                    .expect("a valid secret")
                    .sign(key, t, body.as_bytes()),
            ),
            KeySource::BodyField => text(
                Verifier::<Stripe>::new(STRIPE_SECRET)
                    .expect("a valid secret")
                    .sign("", t, body.as_bytes()),
            ),
            KeySource::Digest => {
                let mut signed = text(
                    Verifier::<GitHub>::new(GITHUB_SECRET)
                        .expect("a valid secret")
                        .sign("", t, body.as_bytes()),
                );
                signed.push(("x-github-delivery".to_owned(), key.to_owned()));
                signed
            }
            KeySource::RunOnce => Vec::new(),
        };
        headers.push((ACCOUNT_HEADER.to_owned(), ACCOUNT.to_owned()));
        Delivery {
            order: order.clone(),
            body,
            headers,
        }
    }

    /// Whether the key comes from what a signature covers.
    fn signed(&self) -> bool {
        matches!(
            self.key,
            KeySource::WebhookId | KeySource::BodyField | KeySource::Digest
        )
    }
}

/// A stored or fresh answer: what a replay must repeat byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stored {
    status: u16,
    content_type: Option<String>,
    body: Vec<u8>,
}

impl fmt::Display for Stored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status, String::from_utf8_lossy(&self.body))
    }
}

/// What a delivery got.
#[derive(Debug)]
enum Reply {
    /// The handler ran and its answer was stored.
    Fresh(Stored),
    /// A stored answer, replayed.
    Replay(Stored),
    /// 409 `key-in-use` with `Retry-After`; `OnceError::InUse`.
    Conflict,
    /// 422 `key-reused`; `OnceError::Mismatch`.
    Mismatch,
    /// The handler's injected failure.
    Failed,
    /// Anything else.
    Other(String),
}

impl Reply {
    /// Reads an HTTP answer.
    fn of(answer: Answer) -> Self {
        let stored = Stored {
            status: answer.status,
            content_type: answer.header("content-type").map(str::to_owned),
            body: answer.body.clone(),
        };
        if answer.replayed() {
            return Self::Replay(stored);
        }
        if answer.status == 201 {
            return Self::Fresh(stored);
        }
        let kind = serde_json::from_slice::<Value>(&answer.body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        match answer.status {
            409 if kind.ends_with(":key-in-use") && answer.header("retry-after").is_some() => {
                Self::Conflict
            }
            422 if kind.ends_with(":key-reused") => Self::Mismatch,
            500 if kind == INJECTED => Self::Failed,
            _ => Self::Other(stored.to_string()),
        }
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fresh(s) => write!(f, "a fresh run ({s})"),
            Self::Replay(s) => write!(f, "a replay ({s})"),
            Self::Conflict => f.write_str("409 key-in-use"),
            Self::Mismatch => f.write_str("422 key-reused"),
            Self::Failed => f.write_str("the injected failure"),
            Self::Other(s) => write!(f, "{s}"),
        }
    }
}

/// How a check found a promise broken: what it saw.
type Broken = String;

/// Returns `Err` with the message unless `condition` holds.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(format!($($message)+));
        }
    };
}

/// The answer of a fresh run; `Err` naming `what` otherwise.
fn fresh(reply: Reply, what: &str) -> Result<Stored, Broken> {
    match reply {
        Reply::Fresh(stored) => Ok(stored),
        other => Err(format!("{what}: expected a fresh run, got {other}")),
    }
}

/// `Err` naming `what` unless `reply` replays `first` byte for byte.
fn replays(reply: &Reply, first: &Stored, what: &str) -> Result<(), Broken> {
    match reply {
        Reply::Replay(stored) if stored == first => Ok(()),
        Reply::Replay(stored) => Err(format!(
            "{what}: the replay differs from the stored answer: {stored} vs {first}"
        )),
        other => Err(format!(
            "{what}: expected the replay of {first}, got {other}"
        )),
    }
}

// ---------------------------------------------------------------------------------------
// The checks.

/// One promise, checked on a message of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    Replay,
    Concurrency,
    Payload,
    Capture,
    Principals,
    Failure,
    Expiry,
}

const CHECKS: [Check; 7] = [
    Check::Replay,
    Check::Concurrency,
    Check::Payload,
    Check::Capture,
    Check::Principals,
    Check::Failure,
    Check::Expiry,
];

impl Check {
    /// The promise, as printed.
    fn promise(self) -> &'static str {
        match self {
            Self::Replay => "a retry replays",
            Self::Concurrency => "a concurrent copy gets 409 or the replay",
            Self::Payload => "another payload under the key gets 422",
            Self::Capture => "a captured signed delivery never acts twice",
            Self::Principals => "a principal never sees another's answer",
            Self::Failure => "a failed attempt stays retryable",
            Self::Expiry => "an expired record lets the key run afresh",
        }
    }

    /// The message's id.
    fn id(self, cell: &Cell) -> String {
        format!("{self:?}-{}", cell.n).to_lowercase()
    }

    /// Why the check does not apply to `cell`, or `None` when it does.
    fn skipped(self, cell: &Cell) -> Option<&'static str> {
        match self {
            Self::Capture if !cell.signed() => Some("nothing is signed"),
            Self::Principals
                if cell.key != KeySource::IdempotencyKey
                    || cell.principal == PrincipalSource::None =>
            {
                Some("no principal is resolved from the request")
            }
            _ => None,
        }
    }
}

/// What a check's first half leaves its second: the delivery, and its answer when it was
/// stored.
struct Memo {
    delivery: Delivery,
    first: Option<Stored>,
}

impl Memo {
    /// The stored first answer.
    fn first(&self) -> Result<&Stored, Broken> {
        self.first
            .as_ref()
            .ok_or_else(|| "the first delivery stored nothing".to_owned())
    }
}

/// A cell under test: where it runs, and its fixture.
struct Ctx<'a> {
    site: &'a Site,
    cell: &'a Cell,
    fixture: Fixture,
}

impl Ctx<'_> {
    /// The check's message: its order for [`TENANT`], of `amount`.
    fn order(&self, check: Check, amount: i64) -> Order {
        Order {
            id: check.id(self.cell),
            account: Some(TENANT.to_owned()),
            amount,
        }
    }

    /// The check's key, where the key is not in the body.
    fn key(&self, check: Check) -> String {
        format!("key-{}", check.id(self.cell))
    }

    /// The check's delivery of its order.
    fn delivery(&self, check: Check) -> Delivery {
        self.cell
            .delivery(&self.order(check, 100), &self.key(check))
    }

    /// How many times the handler's effect for `id` committed.
    async fn effects(&self, id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.effects WHERE id = $1",
            self.fixture.schema
        )))
        .bind(id)
        .fetch_one(&self.site.direct)
        .await
        .expect("count effects")
    }

    /// `Err` naming `what` unless `id`'s effect committed `expected` times.
    async fn effects_are(&self, id: &str, expected: i64, what: &str) -> Result<(), Broken> {
        let effects = self.effects(id).await;
        ensure!(
            effects == expected,
            "{what}: the handler's effect committed {effects} times, not {expected}"
        );
        Ok(())
    }

    /// Makes the record whose stored answer names `id` expired.
    async fn expire(&self, id: &str) -> Result<(), Broken> {
        let expired = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {}.keys SET expires_at = now() - interval '1 second' \
              WHERE position(convert_to($1, 'UTF8') in body) > 0",
            self.fixture.schema
        )))
        .bind(format!("\"id\":\"{id}\""))
        .execute(&self.site.direct)
        .await
        .expect("expire the record");
        let rows = expired.rows_affected();
        ensure!(rows == 1, "{rows} stored answers name {id}, not one");
        Ok(())
    }

    /// The first half of `check`, on the first start.
    async fn before(&self, check: Check, s: &Instance) -> Result<Memo, Broken> {
        let id = check.id(self.cell);
        let delivery = self.delivery(check);
        match check {
            Check::Concurrency => Ok(Memo {
                delivery,
                first: None,
            }),
            Check::Failure => {
                self.fixture
                    .faults
                    .fail_once
                    .lock()
                    .unwrap()
                    .insert(id.clone());
                let reply = s.send(&delivery).await;
                ensure!(
                    matches!(reply, Reply::Failed),
                    "the failing attempt: expected the handler's failure, got {reply}"
                );
                self.effects_are(&id, 0, "the failed attempt").await?;
                Ok(Memo {
                    delivery,
                    first: None,
                })
            }
            _ => {
                let first = fresh(s.send(&delivery).await, "the first delivery")?;
                self.effects_are(&id, 1, "the first delivery").await?;
                if check == Check::Expiry {
                    self.expire(&id).await?;
                }
                Ok(Memo {
                    delivery,
                    first: Some(first),
                })
            }
        }
    }

    /// The second half of `check`, on the second start.
    async fn after(&self, check: Check, s: &Instance, memo: Memo) -> Result<(), Broken> {
        let id = check.id(self.cell);
        match check {
            Check::Replay => {
                replays(&s.send(&memo.delivery).await, memo.first()?, "the retry")?;
                self.effects_are(&id, 1, "after the retry").await
            }
            Check::Concurrency => self.copies(s).await,
            Check::Payload => self.payload(s, &memo).await,
            Check::Capture => self.capture(s, &memo).await,
            Check::Principals => self.principals(s, &memo).await,
            Check::Failure => {
                let reply = s.send(&memo.delivery).await;
                let first = fresh(reply, "the retry of the failed attempt")?;
                self.effects_are(&id, 1, "the retry of the failed attempt")
                    .await?;
                replays(
                    &s.send(&memo.delivery).await,
                    &first,
                    "the retry after that",
                )
            }
            Check::Expiry => {
                let reply = s.send(&memo.delivery).await;
                let again = fresh(reply, "the retry after the expiry")?;
                self.effects_are(&id, 2, "the retry after the expiry")
                    .await?;
                replays(
                    &s.send(&memo.delivery).await,
                    &again,
                    "the retry after that",
                )
            }
        }
    }

    /// Two copies sent while the first request is in its handler.
    async fn copies(&self, s: &Instance) -> Result<(), Broken> {
        let id = Check::Concurrency.id(self.cell);
        let delivery = self.delivery(Check::Concurrency);
        self.fixture.faults.slow.lock().unwrap().insert(id.clone());
        let (first, copies) = tokio::join!(s.send(&delivery), async {
            let started = self.fixture.faults.started.notified();
            if tokio::time::timeout(WAIT, started).await.is_err() {
                return None;
            }
            Some(join_all([s.send(&delivery), s.send(&delivery)]).await)
        });
        let first = fresh(first, "the first of the copies")?;
        let copies = copies.ok_or("the first copy never reached its handler")?;
        for copy in &copies {
            match (self.cell.concurrency, copy) {
                (Concurrency::Reject, Reply::Conflict) => {}
                (_, Reply::Replay(_)) => replays(copy, &first, "a concurrent copy")?,
                (Concurrency::Reject, other) => {
                    return Err(format!(
                        "a concurrent copy: expected 409 key-in-use or the replay, got {other}"
                    ))
                }
                (Concurrency::Wait | Concurrency::WaitShortTimeout, other) => {
                    return Err(format!(
                        "a concurrent copy: expected the replay once the first committed (it \
                         waits up to {WAIT:?}, the first takes {SLOW:?}), got {other}"
                    ))
                }
            }
        }
        self.effects_are(&id, 1, "after the concurrent copies")
            .await
    }

    /// The key with another payload; for a digest, the same content spelled otherwise
    /// and other content.
    async fn payload(&self, s: &Instance, memo: &Memo) -> Result<(), Broken> {
        let id = Check::Payload.id(self.cell);
        let key = self.key(Check::Payload);
        let other = self.order(Check::Payload, 999);
        if self.cell.key != KeySource::Digest {
            let reply = s.send(&self.cell.delivery(&other, &key)).await;
            ensure!(
                matches!(reply, Reply::Mismatch),
                "the key with another payload: expected 422 key-reused, got {reply}"
            );
            return self.effects_are(&id, 1, "after the other payload").await;
        }
        let order = &memo.delivery.order;
        let respelled = format!(
            "{{\n  \"amount\": {},\n  \"id\": \"{}\",\n  \"account\": \"{}\"\n}}",
            order.amount,
            order.id,
            order.account.as_deref().unwrap_or_default()
        );
        let same = self.cell.delivery_of(order, respelled, &key);
        let what = "the same content spelled otherwise";
        replays(&s.send(&same).await, memo.first()?, what)?;
        let reply = s.send(&self.cell.delivery(&other, &key)).await;
        fresh(reply, "other content, which is another key")?;
        self.effects_are(&id, 2, "after both").await
    }

    /// The first delivery's exact bytes and signature again, under headers the
    /// signature does not cover.
    async fn capture(&self, s: &Instance, memo: &Memo) -> Result<(), Broken> {
        let id = Check::Capture.id(self.cell);
        let first = memo.first()?;
        let delivery = &memo.delivery;
        let mut variants = vec![
            ("another X-Account", delivery.with(ACCOUNT_HEADER, "acct_2")),
            ("no X-Account", delivery.without(ACCOUNT_HEADER)),
            (
                "a fresh Idempotency-Key",
                delivery.with("idempotency-key", "fresh-key"),
            ),
        ];
        if self.cell.key == KeySource::Digest {
            variants.push((
                "a fresh X-GitHub-Delivery",
                delivery.with("x-github-delivery", "fresh-delivery"),
            ));
        }
        let mut wrong = Vec::new();
        for (variant, copy) in variants {
            let before = self.effects(&id).await;
            let reply = s.send(&copy).await;
            let acted = self.effects(&id).await - before;
            let replayed = matches!(&reply, Reply::Replay(stored) if stored == first);
            if !replayed || acted != 0 {
                wrong.push(format!("with {variant}: {reply}, acted {acted} more times"));
            }
        }
        ensure!(
            wrong.is_empty(),
            "the captured delivery, sent again: {}",
            wrong.join("; ")
        );
        Ok(())
    }

    /// Another account's request with the same key, a request without a principal
    /// where one is required, and a tenant named by an anonymous body.
    async fn principals(&self, s: &Instance, memo: &Memo) -> Result<(), Broken> {
        let id = Check::Principals.id(self.cell);
        let delivery = &memo.delivery;
        let reply = s.send(&delivery.with(ACCOUNT_HEADER, "acct_2")).await;
        fresh(reply, "the same key from another account")?;
        let reply = s.send(delivery).await;
        replays(&reply, memo.first()?, "the first account's retry")?;
        self.effects_are(&id, 2, "one effect per account").await?;
        if self.cell.principal == PrincipalSource::Required {
            let answer = s.post(&delivery.without(ACCOUNT_HEADER)).await;
            let kind = serde_json::from_slice::<Value>(&answer.body)
                .ok()
                .and_then(|v| v["type"].as_str().map(str::to_owned))
                .unwrap_or_default();
            ensure!(
                answer.status == 401 && kind.ends_with(":missing-principal"),
                "a request without a principal: expected 401 missing-principal, got {} {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
        }
        let spreads_by_tenant = matches!(
            self.cell.spread,
            SpreadSetting::Tenant | SpreadSetting::Changed
        );
        if self.cell.principal == PrincipalSource::Resolver && spreads_by_tenant {
            // Invariant 8: a tenant read from a body never collides with an
            // authenticated principal of that name.
            let order = Order {
                id: format!("{id}-stranger"),
                account: Some("acct_9".to_owned()),
                amount: 5,
            };
            let stranger = self
                .cell
                .delivery(&order, &format!("key-{id}-stranger"))
                .without(ACCOUNT_HEADER);
            let reply = s.send(&stranger).await;
            fresh(reply, "an anonymous request naming acct_9 in its body")?;
            let reply = s.send(&stranger.with(ACCOUNT_HEADER, "acct_9")).await;
            fresh(
                reply,
                "acct_9's own request with the stranger's key and body",
            )?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Running the cells.

/// Runs one half of a check within [`PHASE_LIMIT`]; a panic (a statement of the test's
/// own that failed) is caught as the check's failure, so that the other checks still run.
async fn caught<T>(future: impl Future<Output = Result<T, Broken>>) -> Result<T, Broken> {
    match tokio::time::timeout(PHASE_LIMIT, AssertUnwindSafe(future).catch_unwind()).await {
        Err(_) => Err(format!("did not finish within {PHASE_LIMIT:?}")),
        Ok(Err(panic)) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .map_or_else(|| "panicked".to_owned(), |m| format!("panicked: {m}"))),
        Ok(Ok(outcome)) => outcome,
    }
}

/// How one check of a cell went.
enum Verdict {
    Held,
    /// Refused at the second start, as invariant 9 allows for a change.
    RefusedAtStart(String),
    Skipped(&'static str),
    Broken(Broken),
}

/// Runs every check of `cell` on `site`: the first halves on a first start, the second
/// halves on a second start.
async fn run_cell(site: &Site, cell: &Cell) -> Vec<(Check, Verdict)> {
    let schema = format!("cell_{:02}", cell.n);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA {schema}; \
         CREATE TABLE {schema}.effects \
           (principal text NOT NULL, id text NOT NULL, run bigint NOT NULL, amount bigint NOT NULL)"
    )))
    .execute(&site.direct)
    .await
    .expect("create the business table");
    if site.mode == Mode::Portable {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT create_distributed_table('{schema}.effects', 'principal')"
        )))
        .execute(&site.direct)
        .await
        .expect("distribute the business table");
    }
    let fixture = Fixture {
        schema: schema.into(),
        persistent: site.mode != Mode::Pooler,
        faults: Arc::default(),
    };
    let ctx = Ctx {
        site,
        cell,
        fixture,
    };
    let [first_spread, second_spread] = cell.starts();
    let checks: Vec<Check> = CHECKS
        .into_iter()
        .filter(|c| c.skipped(cell).is_none())
        .collect();
    let mut verdicts: Vec<(Check, Verdict)> = CHECKS
        .into_iter()
        .filter_map(|c| c.skipped(cell).map(|why| (c, Verdict::Skipped(why))))
        .collect();

    let first = match start(site, cell, first_spread, &ctx.fixture).await {
        Ok(instance) => instance,
        Err(error) => {
            let verdict = || Verdict::Broken(format!("the first start failed: {error}"));
            verdicts.extend(checks.iter().map(|&c| (c, verdict())));
            return verdicts;
        }
    };
    let mut memos = Vec::new();
    for &check in &checks {
        memos.push(caught(ctx.before(check, &first)).await);
    }
    first.stop().await;

    let second = match start(site, cell, second_spread, &ctx.fixture).await {
        Ok(instance) => instance,
        Err(error) => {
            let changed = cell.spread == SpreadSetting::Changed;
            for (&check, memo) in checks.iter().zip(memos) {
                let verdict = match memo {
                    Err(broken) => Verdict::Broken(broken),
                    Ok(_) if changed => Verdict::RefusedAtStart(error.clone()),
                    Ok(_) => Verdict::Broken(format!("the second start failed: {error}")),
                };
                verdicts.push((check, verdict));
            }
            return verdicts;
        }
    };
    for (&check, memo) in checks.iter().zip(memos) {
        let verdict = match memo {
            Err(broken) => Verdict::Broken(format!("(first start) {broken}")),
            Ok(memo) => match caught(ctx.after(check, &second, memo)).await {
                Ok(()) => Verdict::Held,
                Err(broken) => Verdict::Broken(broken),
            },
        };
        verdicts.push((check, verdict));
    }
    second.stop().await;
    verdicts
}

/// Runs the cover's cells of `site`'s mode, one after another; prints each cell's
/// verdicts, and panics at the end naming the cells that broke a promise.
async fn run_mode(site: &Site) {
    let (cover, cells) = cover();
    let cells: Vec<Cell> = cells.into_iter().filter(|c| c.mode == site.mode).collect();
    println!(
        "{} mode: {} of the cover's {} cells",
        site.mode.name(),
        cells.len(),
        cover.cells.len()
    );
    let mut broken = Vec::new();
    for cell in &cells {
        let started = Instant::now();
        let mut verdicts = run_cell(site, cell).await;
        verdicts.sort_by_key(|(check, _)| CHECKS.iter().position(|c| c == check));
        let mut report = format!("{cell}, {:.1} s\n", started.elapsed().as_secs_f64());
        let mut failed = Vec::new();
        for (check, verdict) in &verdicts {
            let line = match verdict {
                Verdict::Held => "held".to_owned(),
                Verdict::RefusedAtStart(why) => format!("refused at start-up: {why}"),
                Verdict::Skipped(why) => format!("does not apply: {why}"),
                Verdict::Broken(why) => {
                    failed.push(format!("{}: {why}", check.promise()));
                    format!("BROKEN: {why}")
                }
            };
            report.push_str(&format!("    {:<45} {line}\n", check.promise()));
        }
        print!("{report}");
        if !failed.is_empty() {
            broken.push(format!("{cell}\n      {}", failed.join("\n      ")));
        }
    }
    assert!(
        broken.is_empty(),
        "{} of {} cells in the {} mode broke a promise:\n  {}",
        broken.len(),
        cells.len(),
        site.mode.name(),
        broken.join("\n  ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_modes_cells_keep_every_promise() {
    with_test_db(async |db| {
        let site = Site {
            mode: Mode::Default,
            service: db.options.clone(),
            direct: db.pool(4).await,
        };
        run_mode(&site).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pooler_cells_keep_every_promise_behind_pgbouncer() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let site = Site {
            mode: Mode::Pooler,
            service: bouncer.options(),
            direct: db.pool(4).await,
        };
        run_mode(&site).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portable_cells_keep_every_promise_on_citus() {
    // One cluster for all of them (a start takes most of the time); each cell has a
    // schema of its own.
    let Some(cluster) = Citus::start("combinations::portable", 2).await else {
        return;
    };
    let direct = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(cluster.options())
        .await
        .expect("connect to the coordinator");
    let site = Site {
        mode: Mode::Portable,
        service: cluster.options(),
        direct,
    };
    run_mode(&site).await;
}

// ---------------------------------------------------------------------------------------
// The cover itself.

/// The cover holds every allowed pair of values of two axes and no refused one, each
/// refusal has its reason, and the generator gives the same cover twice.
#[test]
fn the_cover_holds_every_allowed_pair_and_no_refused_one() {
    let (cover, cells) = cover();
    println!("{cover}");
    let held: HashSet<pairwise::Pair> = cover
        .cells
        .iter()
        .flat_map(|c| pairwise::pairs_of(c).collect::<Vec<_>>())
        .collect();
    for pair in pairwise::pairs(&AXES) {
        match refuse(pair.0, pair.1) {
            None => assert!(held.contains(&pair), "{pair:?} is not covered"),
            Some(reason) => {
                assert!(!held.contains(&pair), "{pair:?} is refused but held");
                assert!(!reason.is_empty());
            }
        }
    }
    // The pairs refused by design, and nothing else.
    assert_eq!(cover.refused.len(), 7, "{cover}");
    assert!(cells.iter().all(|c| c.key != KeySource::RunOnce
        || (c.principal != PrincipalSource::Resolver
            && c.principal != PrincipalSource::Endpoint
            && c.isolation == Isolation::ReadCommitted)));
    assert!(cells
        .iter()
        .all(|c| c.principal != PrincipalSource::Endpoint || c.spread == SpreadSetting::None));
    assert_eq!(pairwise::cover(&AXES, refuse), cover, "deterministic");
    // Every mode has cells: none is covered only in passing.
    for mode in Mode::ALL {
        assert!(cells.iter().filter(|c| c.mode == *mode).count() >= 5);
    }
}

/// Every start of every cell has its handler among [`ENDPOINTS`], and every handler there
/// serves a cell: the set is what the cover needs, no more.
#[test]
fn every_cell_has_its_endpoints() {
    let (_, cells) = cover();
    let mut needed = Vec::new();
    for cell in &cells {
        for spread in cell.starts() {
            if let Some(endpoint) = cell.endpoint(spread) {
                if !needed.contains(&endpoint) {
                    needed.push(endpoint);
                }
            }
        }
    }
    let have: Vec<Endpoint> = ENDPOINTS
        .iter()
        .map(|(attr, params, _)| Endpoint::of(attr, params))
        .collect();
    let missing: Vec<&Endpoint> = needed.iter().filter(|e| !have.contains(e)).collect();
    assert!(
        missing.is_empty(),
        "add handlers to `endpoints!` for {missing:#?}"
    );
    let unused: Vec<&Endpoint> = have.iter().filter(|e| !needed.contains(e)).collect();
    assert!(unused.is_empty(), "no cell serves {unused:#?}");
    for (n, endpoint) in have.iter().enumerate() {
        assert!(
            !have[..n].contains(endpoint),
            "two handlers for {endpoint:?}"
        );
    }
}
