//! Exactly-once effects for [axum] handlers on PostgreSQL.
//!
//! `#[idempotent]` turns a handler into an endpoint that honours the `Idempotency-Key`
//! header: the first request runs the handler inside a PostgreSQL transaction in which
//! the key's row, the stored response and the handler's own writes commit together;
//! retries replay the stored response; a retry that arrives while the first request is
//! still running gets 409; a key reused with a different payload gets 422; a handler
//! that fails rolls everything back, so the client may simply retry.
//!
//! On crates.io the package is `idem-axum` (`idem` there is another crate), and its
//! library is `idem`: `cargo add idem-axum`, then `use idem::..`. Keep that name (no
//! rename): the attribute's generated code calls `::idem::`.
//!
//! ```no_run
//! use axum::extract::FromRef;
//! use axum::http::StatusCode;
//! use axum::routing::post;
//! use axum::{Json, Router};
//! use idem::{idempotent, Problem, Store, Tx};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Deserialize)]
//! struct NewCharge {
//!     amount: i64,
//!     currency: String,
//!     customer: String,
//!     description: Option<String>,
//! }
//!
//! #[derive(Serialize)]
//! struct Charge {
//!     id: i64,
//!     amount: i64,
//! }
//!
//! // Only `amount`, `currency` and `customer` identify the request: a retry with another
//! // `description` replays, one with another `amount` is refused with 422.
//! #[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer])]
//! async fn create_charge(
//!     mut tx: Tx,
//!     Json(req): Json<NewCharge>,
//! ) -> Result<(StatusCode, Json<Charge>), Problem> {
//!     if req.amount <= 0 {
//!         // An `Err` rolls back and stores nothing: a corrected retry with the same key runs.
//!         return Err(Problem::new(StatusCode::BAD_REQUEST, "https://example.com/invalid-amount", "Invalid amount"));
//!     }
//!     let id: i64 = sqlx::query_scalar(
//!         "INSERT INTO charges (amount, currency, customer) VALUES ($1, $2, $3) RETURNING id",
//!     )
//!     .bind(req.amount)
//!     .bind(&req.currency)
//!     .bind(&req.customer)
//!     .fetch_one(&mut *tx)
//!     .await
//!     .map_err(|_| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "https://example.com/db", "Database error"))?;
//!     Ok((StatusCode::CREATED, Json(Charge { id, amount: req.amount })))
//! }
//!
//! #[derive(Clone, FromRef)]
//! struct AppState {
//!     store: Store,
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let url = std::env::var("DATABASE_URL")
//!     .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
//! let pool = sqlx::PgPool::connect(&url).await?;
//! let store = Store::new(pool);
//! store.migrate().await?;
//! let app = Router::new()
//!     .route("/charges", post(create_charge))
//!     .with_state(AppState { store });
//! let addr = std::env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
//! let listener = tokio::net::TcpListener::bind(addr).await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! # The contract a client sees
//!
//! | situation | answer |
//! |---|---|
//! | first request with key K | the handler runs once in a transaction; on commit its response is stored with K |
//! | retry of K, same fingerprint | the stored status, allow-listed headers and body, plus `Idempotent-Replayed: true` |
//! | retry of K while the first still runs | 409 problem with `Retry-After` |
//! | K reused with another fingerprint or target | 422 problem; nothing runs |
//! | key missing or malformed | 400 problem |
//! | handler returned `Err`, or a 5xx | everything rolled back; the client may retry with K |
//! | handler returned `Ok` below 500 | final: committed and replayed (write deliberate rejections as `Ok`) |
//! | K older than its `ttl` | treated as new |
//! | database unreachable | 503 problem with `Retry-After`; the handler does not run |
//!
//! # The fingerprint
//!
//! A retry is the same request when it has the same fingerprint: a SHA-256 over the
//! scope, the method, the matched route and its path parameters, the query string, and
//! the named `fields` (without `fields`, the whole body), encoded from the deserialized
//! values. Whitespace and key order in the client's JSON never matter: map and struct
//! entries are sorted, and so are the elements of an unordered set (`std`'s or
//! `hashbrown`'s `HashSet`, at any depth), which serializes in its hasher's order.
//! Sequences keep their order. The query's pairs are decoded and sorted by name, the
//! values of a repeated name kept in the order they came: `?a=1&a=2` is not `?a=2&a=1`.
//!
//! The encoder sees values through `serde`, so two things escape it:
//!
//! - A whole body is compared through its `Serialize` impl, and what that impl leaves
//!   out is not compared. A field marked `#[serde(skip_serializing)]` (or `skip`), or
//!   left out by a `skip_serializing_if` that holds for more than one value, is read by
//!   the handler, yet a retry that changes only that field replays the first answer
//!   instead of being refused with 422. Name the fields that identify the request with
//!   `fields = [...]` (a named field is hashed from its own value, whatever the
//!   struct's serde attributes), or do not skip fields of a request body.
//! - A set is recognised by its type, which the encoder sees wherever a value is a
//!   field, an element, a map entry, or inside `Some`, `Box` or a newtype. A set behind
//!   `#[serde(transparent)]`, `serialize_with` or a `Serialize` impl of one's own is
//!   encoded in its iteration order, and identical retries would be refused: use a
//!   `BTreeSet` there.
//!
//! # Where exactly-once ends
//!
//! Only writes made through [`Tx`] share the transaction. A call to another service (a
//! payment processor, an email) cannot be rolled back: if the request fails after it,
//! the retry calls again. Forward [`Tx::derived_key`] to services that accept an
//! idempotency key of their own, and keep other side effects out of the handler:
//! record them with [`Tx::emit`] and let a relay deliver them ([`outbox`]).

//!
//! # Without the macro
//!
//! [`layer::IdempotencyLayer`] gives a tower service the same contract: a hand-written
//! axum route, a `tower::ServiceBuilder` stack, another framework's service. Its handler
//! takes [`layer::Locked`] where it would take `Tx`, and the fingerprint is the body's
//! bytes, the values at JSON pointers, or a function of the bytes.
//!
//! # Queue consumers and jobs
//!
//! The same guarantee without HTTP: [`Store::run_once`](crate::Store::run_once) runs a message's work once per
//! message id, in a transaction that also stores its result.
//!
//! # Observability
//!
//! One `tracing` span per idempotent request, `idem.request`, at INFO, with `scope`,
//! `outcome` (an [`Outcome`]), `status` (HTTP requests) and the timings `claim_ms`,
//! `handler_ms` and `total_ms`. It never carries a key, a principal or a body: logs are
//! read by people who must not learn one tenant's keys or payloads.
//!
//! With the `metrics` feature, install any `metrics` recorder (such as
//! `metrics-exporter-prometheus`) and these appear:
//!
//! | name | kind | labels | meaning |
//! |---|---|---|---|
//! | `idem_requests_total` | counter | `scope`, `outcome` | idempotent requests by [`Outcome`] |
//! | `idem_request_duration_seconds` | histogram | `scope`, `outcome` | time from the claim to the answer |
//! | `idem_swept_rows_total` | counter | | expired rows deleted by purges and sweepers |
//! | `idem_steps_total` | counter | `scope`, `step`, `outcome` | steps ([`Tx::step`]) by outcome: `recorded`, `replayed`, `failed`, `timed_out`, `mismatch`, `lost`, `unrecorded`, `unkeyed` |
//! | `idem_step_duration_seconds` | histogram | `scope`, `step`, `outcome` | a step's time, its call and its record included |
//! | `idem_abandoned_requests` | gauge | | requests idle after their steps, uncommitted ([`StoreBuilder::abandoned_after`](crate::StoreBuilder::abandoned_after)), as the sweeper last counted |
//! | `idem_outbox_published_total` | counter | | outbox events published and deleted |
//! | `idem_outbox_retried_total` | counter | | failed publishes that will be tried again |
//! | `idem_outbox_dead_total` | counter | | outbox events parked as dead |
//! | `idem_outbox_lag_seconds` | gauge | | the age of the oldest pending outbox event |
//! | `idem_outbox_publish_delay_seconds` | histogram | | from the start of an event's transaction to the relay taking it, for each published event |
//!
//! # Events
//!
//! [`Tx::emit`] records an event in the request's transaction, and a relay
//! ([`Store::relay`](crate::Store::relay)) publishes it after the commit: see [`outbox`].
//!
//! # Features
//!
//! - `webhook` (default): [`webhook::Signed`] deliveries, verified with HMAC-SHA256.
//! - `metrics`: the metrics above.
//! - `utoipa`: OpenAPI through utoipa: `#[idempotent]` above `#[utoipa::path]` documents
//!   the key and idem's problem responses; `idem::openapi`.
//! - `nats`: `outbox::nats`, a JetStream publisher and consumer.
//! - `amqp`: `outbox::amqp`, an AMQP 0.9.1 (RabbitMQ) publisher and consumer.
//! - `console`: `idem::console`, an operator's console (an axum router) to mount behind the
//!   service's authentication.
//! - `testing` (for `[dev-dependencies]`): `idem::testing`, a test kit that proves a
//!   service's own handlers exactly-once, crashing them at every durable point.
//! - `failpoints` (for tests; `testing` turns it on): `idem::failpoint`, the durable points
//!   where a test makes a process die.
#![cfg_attr(docsrs, feature(doc_cfg))]

// Where the code lives. `engine` runs one idempotent attempt in PostgreSQL terms and
// knows no HTTP; it runs on `table`, which owns the DDL and every statement with its
// binds. Above the engine: the HTTP adapter `web` and `once` (`Store::run_once`). On
// `web`: `webhook`, which answers with `web`'s problems, and `probe`, the generated
// code's checks of the handler's types, which hand `web` its `Answer` and `Fields`
// (`web` names neither). The operators' queries, `operate`, sit on the store and the
// outbox's table with their own statements, and `console` (beside `web`) and the
// `idem-cli` binary on them. Nothing imports upward: `header_hash`, which `probe` and
// `webhook` share, sits below both; nothing but `console` imports `operate`.

#[doc(hidden)]
pub mod __private;
mod answers;
mod background;
pub mod complete;
#[cfg(feature = "console")]
#[cfg_attr(docsrs, doc(cfg(feature = "console")))]
pub mod console;
mod deployment;
mod distribution;
mod engine;
mod expiry;
#[cfg(feature = "failpoints")]
#[cfg_attr(docsrs, doc(cfg(feature = "failpoints")))]
pub mod failpoint;
#[cfg(not(feature = "failpoints"))]
mod failpoint;
mod fingerprint;
mod header_hash;
mod identity;
mod inspect;
mod key;
mod literal;
mod migrate;
mod observe;
mod once;
#[cfg(feature = "utoipa")]
#[cfg_attr(docsrs, doc(cfg(feature = "utoipa")))]
pub mod openapi;
pub mod operate;
pub mod outbox;
mod probe;
pub mod schema;
mod spread;
pub mod sqlstate;
mod steps;
mod store;
mod table;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod transaction;
mod tx;
mod web;
#[cfg(feature = "webhook")]
#[cfg_attr(docsrs, doc(cfg(feature = "webhook")))]
pub mod webhook;

pub use fingerprint::FingerprintError;
/// Makes a tonic service's `#[idempotent]` methods idempotent (the `tonic` feature): on
/// the service's `impl` block, above `#[tonic::async_trait]`. See the book's gRPC chapter.
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub use idem_macros::grpc;
#[doc(inline)]
pub use idem_macros::idempotent;
pub use key::KeyError;
pub use migrate::VerifyError;
pub use observe::Outcome;
pub use steps::StepError;
pub use store::{BuildError, Store, StoreBuilder};
pub use table::Pooler;
pub use tx::Tx;
pub use web::problem::Problem;

/// The headers idem reads and writes, and the key as it reads it.
pub mod header {
    pub use crate::key::{
        IdempotencyKey, KeyOrigin, HASHED_KEY_PREFIX, IDEMPOTENCY_KEY, MAX_KEY_LEN,
    };
    pub use crate::web::response::{IDEMPOTENT_RECORDED, IDEMPOTENT_REPLAYED};
}

/// idem's problem responses (RFC 9457): their media type, the base of their `type` URIs,
/// and each type's last segment. [`Problem`] is the response itself.
pub mod problem {
    pub use crate::web::problem::{problem_type, DEFAULT_PROBLEM_BASE, PROBLEM_JSON};
}

/// What a handler's arguments are read with: the body a fingerprint reads, and the
/// principal the key is kept under; and a check that writes go through `Tx`.
pub mod extract {
    pub use crate::web::escape::warn_on_escaping_writes;
    pub use crate::web::extract::{FingerprintBody, Principal};
}

/// The attribute's promise without the attribute: [`IdempotencyLayer`](layer::IdempotencyLayer)
/// makes any tower service of HTTP requests idempotent (a hand-written axum route, a
/// `tower::ServiceBuilder` stack, another framework's service), and lends it the
/// request's [`Transaction`](layer::Transaction).
pub mod layer {
    pub use crate::web::layer::{Ended, Idempotency, IdempotencyLayer, Locked, Transaction};
}

/// Exactly-once work outside a handler: a queue consumer's message, a scheduled job
/// ([`Store::run_once`](crate::Store::run_once)).
pub mod jobs {
    pub use crate::once::{OnceError, RunOnce};
}

/// The deletion of expired records: a background task ([`Store::spawn_sweeper`](crate::Store::spawn_sweeper)).
pub mod sweep {
    pub use crate::expiry::{Sweeper, SweeperError};
}
