//! Exactly-once effects for [axum] handlers on PostgreSQL.
//!
//! `#[idempotent]` turns a handler into an endpoint that honours the `Idempotency-Key`
//! header: the first request runs the handler inside a PostgreSQL transaction in which
//! the key's row, the stored response and the handler's own writes commit together;
//! retries replay the stored response; a retry that arrives while the first request is
//! still running gets 409; a key reused with a different payload gets 422; a handler
//! that fails rolls everything back, so the client may simply retry.
//!
//! ```no_run
//! use axum::extract::FromRef;
//! use axum::http::StatusCode;
//! use axum::routing::post;
//! use axum::{Json, Router};
//! use idem_runtime::{idempotent, Idempotency, Problem, Tx};
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
//!     idempotency: Idempotency,
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
//! let idempotency = Idempotency::new(pool);
//! idempotency.migrate().await?;
//! let app = Router::new()
//!     .route("/charges", post(create_charge))
//!     .with_state(AppState { idempotency });
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
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
//! # Where exactly-once ends
//!
//! Only writes made through [`Tx`] share the transaction. A call to another service (a
//! payment processor, an email) cannot be rolled back: if the request fails after it,
//! the retry calls again. Forward [`Tx::derived_key`] to services that accept an
//! idempotency key of their own, and keep other side effects out of the handler
//! (write them to an outbox table through `Tx` instead).

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(hidden)]
pub mod __private;
mod cycle;
mod expiry;
pub mod fingerprint;
mod inspect;
pub mod key;
pub mod observe;
mod once;
pub mod problem;
mod response;
mod store;
mod tx;
pub mod webhook;

use axum::body::Bytes;
use axum::Json;

pub use expiry::Sweeper;
pub use fingerprint::Fingerprint;
#[doc(inline)]
pub use idem_macros::idempotent;
pub use inspect::KeyRecord;
pub use key::{IdempotencyKey, KeyError, IDEMPOTENCY_KEY};
pub use observe::Outcome;
pub use once::{OnceError, Work};
pub use problem::Problem;
pub use response::{IDEMPOTENT_RECORDED, IDEMPOTENT_REPLAYED};
pub use store::{
    is_unavailable, Idempotency, IdempotencyBuilder, InvalidTableName, PrincipalResolver,
    DEFAULT_TABLE, SCHEMA_SQL,
};
pub use tx::Tx;

/// A request body idem can fingerprint: the last parameter of an `#[idempotent]`
/// handler whose payload identifies the request.
///
/// With `fields = [...]` the named fields are read from [`fingerprint_value`] (and only
/// they need to be `Serialize`); without, the whole value is fingerprinted and must be
/// `Serialize`. Implemented for [`Json<T>`], [`String`] and [`Bytes`]; implement it for
/// your own body extractors.
///
/// [`fingerprint_value`]: FingerprintBody::fingerprint_value
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a request body idem can fingerprint",
    label = "`fields = [...]` reads its fields from this parameter",
    note = "make the last parameter a JSON body, such as `Json<T>`, or implement `idem_runtime::FingerprintBody` for it"
)]
pub trait FingerprintBody {
    /// The value whose fields are fingerprinted.
    type Value: ?Sized;

    /// The deserialized body.
    fn fingerprint_value(&self) -> &Self::Value;
}

impl<T> FingerprintBody for Json<T> {
    type Value = T;

    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

impl FingerprintBody for String {
    type Value = str;

    fn fingerprint_value(&self) -> &str {
        self
    }
}

impl FingerprintBody for Bytes {
    type Value = [u8];

    fn fingerprint_value(&self) -> &[u8] {
        self
    }
}

/// An extractor that names the principal (account, tenant) a request acts for, for a
/// handler's `principal = Type` option, which overrides the store's resolver.
///
/// ```
/// use idem_runtime::Principal;
///
/// struct Tenant(u64);
///
/// impl Principal for Tenant {
///     fn principal_id(&self) -> String {
///         self.0.to_string()
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot name the principal of an idempotent request",
    note = "`principal = Type` needs an extractor that implements `idem_runtime::Principal`"
)]
pub trait Principal {
    /// The principal's identifier: keys are looked up per (scope, principal, key).
    fn principal_id(&self) -> String;
}
