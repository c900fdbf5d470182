//! The `#[idempotent]` attribute of idem. Depend on the package `idem-axum` (its library
//! is `idem`), which re-exports it: `use idem::idempotent;`.

mod attr;
mod errors;
mod expand;
mod grpc;
mod openapi;
mod valid;

use proc_macro::TokenStream;

/// Makes an axum handler idempotent on PostgreSQL.
///
/// The handler runs inside a PostgreSQL transaction in which the `Idempotency-Key`'s
/// row, the stored response and the handler's own writes (through `Tx`) commit
/// together. Retries replay the stored response; a duplicate in flight gets 409; a key
/// reused with another payload gets 422; an `Err` or a 5xx rolls everything back.
///
/// ```
/// use axum::http::StatusCode;
/// use axum::Json;
/// use idem::{idempotent, Problem, Tx};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Deserialize, Serialize)]
/// struct NewCharge {
///     amount: i64,
///     currency: String,
///     description: Option<String>,
/// }
///
/// #[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency])]
/// async fn create_charge(mut tx: Tx, Json(req): Json<NewCharge>) -> Result<StatusCode, Problem> {
///     sqlx::query("INSERT INTO charges (amount, currency) VALUES ($1, $2)")
///         .bind(req.amount)
///         .bind(&req.currency)
///         .execute(&mut *tx)
///         .await
///         .map_err(|e| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "urn:example:db", "Database error")
///             .with_detail(e.to_string()))?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
///
/// # Options
///
/// | option | meaning |
/// |---|---|
/// | `scope = "charges"` | required: the namespace of the endpoint's keys; 1 to 64 ASCII letters, digits, `_`, `-`, `.`, `:` or `/` |
/// | `ttl = "24h"` | how long responses are replayed: a whole number and `s`, `m`, `h` or `d`, more than zero and at most 100 years; default one day |
/// | `fields = [amount, customer.id]` | the body fields that identify a request; default: the whole body |
/// | `key = field.path`, `key = header("Name")` or `key = digest(body)` | where the key comes from, instead of the `Idempotency-Key` header: a body field (`key = id`, `key = meta.event_id`), checked at compile time like `fields`, whose value is text, an integer or an `Option` of one; another header, its name in any case; or `sha256:` and the hex SHA-256 of the body's canonical encoding, so that equal content, however spaced or ordered, is one key |
/// | `principal = Tenant` | an extractor implementing `idem::extract::Principal`; default: the store's resolver |
/// | `spread = key` or `spread = account_of` | where a key without a principal (a webhook's, typically) is kept, instead of the one value all such keys share on a single node (a portable store spreads them by a hash of the key without the option): a hash of the key, or the tenant the body concerns, found by a function from the body type (`fn account_of(event: &Event) -> Option<String>`; `None` falls back to the hash). The handler reads the value with `tx.principal()` to write its rows beside the key. Not with `principal = ..`; see `idem::jobs::RunOnce::spread_by` for consumers |
/// | `required = false` | a request without a key runs, in its transaction, unrecorded, and is answered with `Idempotent-Recorded: false`; a malformed key is still refused. Default `true`: a request without a key gets 400 |
/// | `concurrency = reject` or `concurrency = wait("30s")` | what a duplicate of a request still in flight gets. `reject` (the default): 409 at once, after the store's own `conflict_wait` (1 ms unless configured). `wait("30s")`: it waits up to that long for the first to finish and gets its replay, 409 only past the wait; `ms`, `s`, `m` or `h`, more than zero and at most an hour |
/// | `isolation = serializable` | the transaction's isolation level: `read_committed` (the default, PostgreSQL's own), `repeatable_read` or `serializable`. The claim runs at that level too. A commit that cannot be serialized (40001) rolls back and answers 503 with `Retry-After`; map your own statements' such errors the same way with `idem::sqlstate::is_serialization_failure`. `SET TRANSACTION` inside the handler cannot work: the claim is already the transaction's first statement |
/// | `statement_timeout = "5s"` | the bound on each statement of the handler (PostgreSQL's `statement_timeout`, for this request's transaction only), instead of the store's `statement_timeout`; `ms`, `s`, `m` or `h`, more than zero and at most a day. Set it to the endpoint's timeout layer's limit: a request the layer drops leaves its statement running on the server, holding the key (409) until it ends |
///
/// `fields` and `key = field` read the body, so the handler needs one as its last
/// parameter. A webhook, for instance, keys on the event's own id, and a redelivery that
/// arrives while the first delivery is still running waits for its response:
///
/// ```
/// # use axum::Json;
/// # use idem::{idempotent, Tx};
/// # use serde::{Deserialize, Serialize};
/// #[derive(Deserialize, Serialize)]
/// struct Event {
///     id: String,
///     kind: String,
/// }
///
/// #[idempotent(scope = "payment_events", ttl = "7d", key = id, concurrency = wait("30s"))]
/// async fn payment_event(_tx: Tx, Json(event): Json<Event>) -> String {
///     event.kind
/// }
/// ```
///
/// # The handler
///
/// An ordinary axum handler, `async`, with at most one `Tx` parameter anywhere in its
/// list and its body extractor last. It may return any `IntoResponse`, or a `Result` of
/// two: `Ok` below 500 commits and is replayed, `Err` rolls back.
///
/// The body, the last parameter, identifies the request: without `fields`, its whole
/// value is fingerprinted. `Json<T>`, `Form<T>`, a `Query<T>` as the payload, `String`,
/// `Bytes`, an `Option` or `Result` of one, and any extractor implementing
/// `idem::extract::FingerprintBody` are; a last parameter that reads the body and is none of
/// these is a compile error, since a payload left out would let a reused key with
/// another payload replay the first answer. That holds whatever state the extractor is
/// written for (`impl FromRequest<AppState> for AppJson<T>` too): whether a parameter
/// reads the body depends on the router's state, so the error is reported where the
/// handler is routed (`post(handler)`), or on the parameter under
/// `#[axum::debug_handler]`. A last parameter that reads the request's head only
/// (`Path`, `State`, `HeaderMap`) means the handler has no body: its method and path
/// identify it.
///
/// A handler without `Tx` gets a warning (a `deprecated` one, the only kind a macro can
/// raise on stable): its writes through a pool of its own commit apart from the key, and
/// a retry repeats them. On a handler that writes nothing, `#[allow(deprecated)]`
/// silences it.
///
/// A signed body (`idem::webhook::Signed<T, S>`) takes its key from what is signed:
/// a field (`key = id`), the body's digest (`key = digest(body)`, for GitHub, which signs
/// no id), or the id header of a scheme that signs it (`key = header("webhook-id")` for
/// Standard Webhooks). Any other `key = header(..)` is a compile error there, and so is
/// no `key = ..` at all (the default `Idempotency-Key` header), since a header the
/// signature does not cover would let a captured delivery run again under fresh ids.
///
/// Lints see the handler as you wrote it: the expansion allows none on your code. A
/// handler with nothing to await is still `async`, and `clippy::unused_async` (pedantic)
/// says so; allow it on the handler if you lint with the pedantic group.
///
/// # With other attributes
///
/// `#[idempotent]` goes first, above the attributes that describe the handler axum
/// sees, since attributes expand from the top:
///
/// ```text
/// #[idempotent(scope = "charges")]
/// #[utoipa::path(post, path = "/charges", responses((status = 201, description = "Created")))]
/// #[axum::debug_handler]
/// async fn create_charge(tx: Tx, Json(req): Json<NewCharge>) -> Result<StatusCode, Problem> { .. }
/// ```
///
/// - `#[utoipa::path(...)]` below it (the `utoipa` feature) gets idem's parts added: the
///   key's header parameter, the problem responses and `Idempotent-Replayed` (see
///   `idem::openapi`). Written above it, utoipa would document the handler without
///   them; `#[idempotent]` finds the `__path_<handler>` struct utoipa left beside the
///   function and makes that a compile error on itself.
/// - `#[axum::debug_handler]` below it checks the handler axum sees, given the state of
///   the handler's `State<T>` parameter; name it with `#[axum::debug_handler(state = AppState)]`
///   when the handler has none, or when `T` is a sub-state.
///
/// Other attributes, such as lints, apply to your function's body
/// and may go anywhere below.
///
/// # The router's state
///
/// The handler takes idem's `Store` from the router's state through `FromRef`: a
/// `#[derive(Clone, FromRef)]` state with a `store: idem::Store` field, or the `Store`
/// itself as the state. A route on a router whose state holds none fails to build on
/// that route, `post(handler)`, naming the state and the fix:
///
/// ```compile_fail,E0277
/// # use axum::{routing::post, Json, Router};
/// # use idem::{idempotent, Tx};
/// # use serde_json::Value;
/// #[derive(Clone)]
/// struct AppState {
///     pool: sqlx::PgPool,
/// }
///
/// #[idempotent(scope = "charges")]
/// async fn create_charge(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
///     Json(v)
/// }
///
/// // error[E0277]: the router's state `AppState` holds no `idem::Store`
/// fn app(pool: sqlx::PgPool) -> Router {
///     Router::new()
///         .route("/charges", post(create_charge))
///         .with_state(AppState { pool })
/// }
/// ```
///
/// The generated handler is generic over the router's state (except under
/// `#[axum::debug_handler]`), which routing infers: name it in a route, not alone
/// (`let _ = create_charge;` needs the state, `create_charge::<AppState>`).
///
/// # Mistakes are compile errors
///
/// Every option is checked at compile time, on your own tokens. A field the body does
/// not have is rustc's own error, with its suggestion:
///
/// ```compile_fail,E0609
/// # use axum::Json;
/// # use idem::{idempotent, Tx};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Deserialize, Serialize)]
/// # struct NewCharge { amount: i64, currency: String }
/// // error[E0609]: no field `curency` on type `&NewCharge`
/// //   help: a field with a similar name exists: `currency`
/// #[idempotent(scope = "charges", fields = [amount, curency])]
/// async fn create_charge(tx: Tx, Json(req): Json<NewCharge>) -> String {
///     String::new()
/// }
/// ```
///
/// and so is ending idem's transaction by hand:
///
/// ```compile_fail
/// # use axum::Json;
/// # use idem::{idempotent, Tx};
/// # use serde_json::Value;
/// // error: `tx.commit()`: idem ends the request's transaction itself, together with the
/// //        key and the stored response; return `Ok(..)` to commit or `Err(..)` to roll back
/// #[idempotent(scope = "charges")]
/// async fn create_charge(tx: Tx, Json(req): Json<Value>) -> String {
///     tx.commit().await.ok();
///     req.to_string()
/// }
/// ```
///
/// The fix: name fields that exist, and let the return value decide.
///
/// ```
/// # use axum::Json;
/// # use idem::{idempotent, Tx};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Deserialize, Serialize)]
/// # struct NewCharge { amount: i64, currency: String }
/// #[idempotent(scope = "charges", fields = [amount, currency])]
/// async fn create_charge(_tx: Tx, Json(req): Json<NewCharge>) -> Result<String, String> {
///     Ok(format!("{} {}", req.amount, req.currency))
/// }
/// ```
///
/// Set `IDEM_MACROS_DEBUG=1` while building to print each expansion to stderr.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}

/// Makes the `#[idempotent]` methods of a tonic service idempotent: on the service's
/// `impl` block, above `#[tonic::async_trait]`.
///
/// tonic's server traits go through `#[tonic::async_trait]`, which rewrites every method
/// of the block before an attribute on a method could expand; this one, on the block,
/// rewrites each method marked `#[idempotent(..)]` first. The method keeps tonic's
/// signature, `&self` and the request, and may add `tx: Tx` after them: the rewrite
/// takes it out of the signature and gives the method the request's transaction, as a
/// handler gets it. The service holds the store: `Store: FromRef<Service>`, as a
/// router's state does.
///
/// ```text
/// #[idem::grpc]
/// #[tonic::async_trait]
/// impl Charges for ChargeService {
///     #[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer.id], key = request_id)]
///     async fn create(&self, request: Request<NewCharge>, mut tx: Tx) -> Result<Response<Charge>, Status> { .. }
/// }
/// ```
///
/// The options are the attribute's, with what they mean for a message: `fields` names
/// the request message's fields (a nested one through messages, which prost keeps in an
/// `Option`: absent, the value is `None`), and without it the whole message, as prost
/// encodes it, is the payload; `key = request_id` reads the key from a field
/// (AIP-155's `request_id`), `key = header("..")` from other metadata, and the default is
/// the `idempotency-key` metadata. `principal`, `spread`, `completable` and
/// `key = digest(body)` are for axum handlers and are compile errors here. `Ok` commits
/// and is replayed, message and metadata, with `idempotent-replayed: true`; `Err` rolls
/// back. A refusal is a status: `ABORTED` with `RetryInfo` for a duplicate in flight,
/// `FAILED_PRECONDITION` for another payload under the key, `INVALID_ARGUMENT` without
/// a key, `UNAVAILABLE` with the database away.
#[proc_macro_attribute]
pub fn grpc(args: TokenStream, item: TokenStream) -> TokenStream {
    grpc::grpc(args.into(), item.into()).into()
}
