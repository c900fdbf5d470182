//! The tower layer: the attribute's promise for a service it does not rewrite.
//!
//! [`IdempotencyLayer`] does with a request what the code `#[idempotent]` generates does:
//! reads a [`Guard`], fingerprints, claims with [`Guard::claim`], and hands the
//! answer to [`Claimed::finish`]. It differs where a macro sees what a layer cannot: the
//! fields are JSON pointers or a function of the body's bytes, the service reaches the
//! transaction through a [`Transaction`] in the request's extensions, and the answer's
//! status (or the service's error) says whether it commits, where the attribute reads
//! the handler's `Result`. A gRPC request (`application/grpc`) commits on its reply's
//! status, OK in its trailers, and is answered in gRPC, statuses for problems, under
//! the `tonic` feature (`web::grpc`).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use axum::RequestExt;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, StatusCode};
use serde::Serialize;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

use super::problem::{problem_type, Problem, Problems};
use super::response::{CaptureError, GRPC_STATUS};
use super::{Answer, Claimed, Fields, Guard, Spec};
use crate::store::Store;
use crate::table::Isolation;
use crate::tx::Tx;

/// The field the value of [`IdempotencyLayer::fingerprint`]'s function is fingerprinted
/// under.
const BY_FUNCTION: &str = "(fingerprint)";

/// Makes any `tower::Service` over HTTP requests idempotent, as `#[idempotent]` makes a
/// handler: the `Idempotency-Key` header, the claim in a PostgreSQL transaction, the
/// replay of the stored answer, and the 400, 409, 413, 422 and 503 problems.
///
/// The service reaches the request's transaction through the [`Transaction`] the layer
/// puts in the request's extensions (an axum handler takes it, or [`Locked`], as an
/// argument). Its writes through it commit with the key's record and the stored
/// answer; an answer below 500 commits and is replayed, a 5xx (or the service's error)
/// rolls everything back, and the client may retry.
///
/// The fingerprint is the request's method and route (axum's matched path, or the path
/// outside a router) with its query string, and the body: all of its bytes, the values
/// at the JSON pointers given to [`fields`](Self::fields), or what the function given to
/// [`fingerprint`](Self::fingerprint) reads from them. The layer reads bodies up to the
/// route's limit (axum's `DefaultBodyLimit`: 2 MiB unless set; 413 past it).
///
/// Put it on routes (a method router's `layer`, or `Router::route_layer`): on
/// `Router::layer` it also wraps the fallback, and a 404 would be stored under its key.
///
/// ```no_run
/// use axum::routing::post;
/// use axum::{Json, Router};
/// use idem::layer::{IdempotencyLayer, Locked};
/// use idem::Store;
/// use serde_json::{json, Value};
///
/// async fn create_charge(mut locked: Locked, Json(req): Json<Value>) -> Result<Json<Value>, String> {
///     let mut tx = locked.tx();
///     let id: i64 = sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
///         .bind(req["amount"].as_i64())
///         .fetch_one(&mut *tx)
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok(Json(json!({ "id": id })))
/// }
///
/// fn app(store: Store) -> Router {
///     let charges = IdempotencyLayer::new(store, "charges").fields(["/amount", "/currency"]);
///     Router::new().route("/charges", post(create_charge).layer(charges))
/// }
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    store: Store,
    scope: &'static str,
    ttl: Duration,
    body: BodyFingerprint,
}

/// What of the body is fingerprinted.
#[derive(Clone)]
enum BodyFingerprint {
    /// Every byte.
    Whole,
    /// The values at these JSON pointers (RFC 6901); null where the body has none.
    Pointers(Vec<&'static str>),
    /// The value a function of the user's reads from the bytes.
    Function(Arc<ReadFields>),
}

/// [`IdempotencyLayer::fingerprint`]'s function, adding its value to the fields, or
/// saying why the body has none.
type ReadFields = dyn Fn(&[u8], &mut Fields) -> Result<(), String> + Send + Sync;

impl IdempotencyLayer {
    /// A layer whose keys live in `scope` on `store`, replayed for a day, with the whole
    /// body fingerprinted.
    ///
    /// # Panics
    ///
    /// When `scope` is not 1 to 64 characters of ASCII letters, digits, `_`, `-`, `.`,
    /// `:` or `/` (what `#[idempotent]` checks at compile time): a mistake in the
    /// service's code, found where the router is built.
    pub fn new(store: Store, scope: &'static str) -> Self {
        // The attribute's check (`idem-macros/src/attr.rs`, `parse_scope`), at run time.
        let valid = !scope.is_empty()
            && scope.len() <= 64
            && scope.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':' | b'/')
            });
        assert!(
            valid,
            "IdempotencyLayer::new: the scope {scope:?} must be 1 to 64 characters of ASCII letters, digits, `_`, `-`, `.`, `:` or `/`, such as \"charges\""
        );
        Self {
            store,
            scope,
            ttl: Duration::from_secs(24 * 60 * 60),
            body: BodyFingerprint::Whole,
        }
    }

    /// How long a stored answer is replayed (the attribute's `ttl`).
    ///
    /// # Panics
    ///
    /// When `ttl` is under a second or over 100 years, which `#[idempotent]` refuses
    /// at compile time: an answer kept for less is no answer, and one kept for more is
    /// past what PostgreSQL's timestamps hold.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        // The attribute's bounds (`idem-macros/src/attr.rs`, `parse_ttl`).
        const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);
        assert!(
            (Duration::from_secs(1)..=CENTURY).contains(&ttl),
            "IdempotencyLayer::ttl: {ttl:?} is not between one second and 100 years"
        );
        self.ttl = ttl;
        self
    }

    /// Fingerprints the values at these JSON pointers (RFC 6901: `"/amount"`,
    /// `"/customer/id"`) of a JSON body instead of its bytes, as the attribute's
    /// `fields = [..]` does: a retry that spells the body otherwise, or changes what no
    /// pointer names, is the same request. A pointer the body lacks counts as `null`; a
    /// body that is not JSON is answered 400.
    ///
    /// # Panics
    ///
    /// When no pointer is given, one is given twice, or one is not a JSON pointer (RFC
    /// 6901: empty, for the whole body, or `/`-separated tokens in which `~` only begins
    /// `~0` or `~1`).
    pub fn fields(mut self, pointers: impl IntoIterator<Item = &'static str>) -> Self {
        let pointers: Vec<_> = pointers.into_iter().collect();
        assert!(
            !pointers.is_empty(),
            "IdempotencyLayer::fields: name at least one JSON pointer, or leave `fields` out to fingerprint the whole body"
        );
        for (n, pointer) in pointers.iter().enumerate() {
            assert!(
                is_pointer(pointer),
                "IdempotencyLayer::fields: {pointer:?} is not a JSON pointer (RFC 6901), such as \"/amount\""
            );
            assert!(
                !pointers[..n].contains(pointer),
                "IdempotencyLayer::fields: {pointer:?} is given twice"
            );
        }
        self.body = BodyFingerprint::Pointers(pointers);
        self
    }

    /// Fingerprints what `read` makes of the body's bytes instead of the bytes: the
    /// fields of a form, a protobuf message's, a JSON body's in a shape pointers cannot
    /// name. Its error is answered 400, with its text as the problem's detail, and
    /// nothing runs.
    pub fn fingerprint<F, V, E>(mut self, read: F) -> Self
    where
        F: Fn(&[u8]) -> Result<V, E> + Send + Sync + 'static,
        V: Serialize,
        E: fmt::Display,
    {
        let read = move |bytes: &[u8], fields: &mut Fields| match read(bytes) {
            Ok(value) => {
                fields.add(BY_FUNCTION, &value);
                Ok(())
            }
            Err(error) => Err(error.to_string()),
        };
        self.body = BodyFingerprint::Function(Arc::new(read));
        self
    }
}

/// Whether `pointer` is a JSON pointer (RFC 6901): empty, or tokens after `/` in which
/// `~` only begins `~0` or `~1`.
fn is_pointer(pointer: &str) -> bool {
    let escapes_ok = |token: &str| {
        let mut bytes = token.bytes();
        while let Some(b) = bytes.next() {
            if b == b'~' && !matches!(bytes.next(), Some(b'0' | b'1')) {
                return false;
            }
        }
        true
    };
    pointer.is_empty() || (pointer.starts_with('/') && pointer[1..].split('/').all(escapes_ok))
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let body = match &self.body {
            BodyFingerprint::Whole => "the whole body",
            BodyFingerprint::Pointers(_) => "JSON pointers",
            BodyFingerprint::Function(_) => "a function of the body",
        };
        f.debug_struct("IdempotencyLayer")
            .field("scope", &self.scope)
            .field("ttl", &self.ttl)
            .field("fingerprint", &body)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        let spec = Spec {
            scope: self.scope,
            ttl: self.ttl,
            required: true,
            conflict_wait: None,
            isolation: Isolation::ReadCommitted,
            statement_timeout: None,
        };
        let settings = Settings {
            store: self.store.clone(),
            spec,
            body: self.body.clone(),
        };
        Idempotency {
            inner,
            settings: Arc::new(settings),
        }
    }
}

/// What every request through one layered service shares.
struct Settings {
    store: Store,
    spec: Spec,
    body: BodyFingerprint,
}

/// The service [`IdempotencyLayer`] wraps around another.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("scope", &self.settings.spec.scope)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Service<Request<B>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service that was made ready is the one called (tower's `Service` docs).
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let settings = Arc::clone(&self.settings);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let grpc = super::response::is_grpc(&parts.headers);
            let answer = match settings.claim(parts, Body::new(body)).await {
                Ok((claimed, request)) => {
                    run(claimed, inner, request, settings.spec.scope, grpc).await?
                }
                Err(answer) => answer,
            };
            // A gRPC client reads statuses, not problems.
            #[cfg(feature = "tonic")]
            if grpc {
                return Ok(super::grpc::in_grpc(answer).await);
            }
            Ok(answer)
        })
    }
}

impl Settings {
    /// Claims the request's key: the request to run, with its [`Transaction`] in its
    /// extensions, or the answer that ends it (a replay, a problem).
    async fn claim(
        &self,
        mut parts: Parts,
        body: Body,
    ) -> Result<(Claimed, Request<Body>), Response> {
        let problems = Problems::of(&self.store);
        // The route is part of what a key is reused for; a service no router matched
        // has only its path to tell one endpoint from another.
        let path = parts.uri.path().to_owned();
        let guard = Guard::<()>::read(self.store.clone(), &mut parts).await?;
        let guard = guard.unrouted(&path);
        // The route's own body limit (axum's `DefaultBodyLimit`), as its extractors
        // would read the body.
        let (parts, body) = Request::from_parts(parts, body)
            .with_limited_body()
            .into_parts();
        let bytes = match axum::body::to_bytes(body, usize::MAX).await {
            Ok(bytes) => bytes,
            Err(error) => return Err(unread(problems, &error)),
        };
        let mut fields = guard.fingerprint(&self.spec);
        if let Err(detail) = self.body.add(&bytes, &mut fields) {
            let problem = problems.invalid_request(StatusCode::BAD_REQUEST);
            return Err(problem.with_detail(detail).into_response());
        }
        let claimed = guard.claim(&self.spec, None, None, fields).await?;
        Ok((claimed, Request::from_parts(parts, Body::from(bytes))))
    }
}

impl BodyFingerprint {
    /// Adds what this layer fingerprints of `bytes`, or says why it cannot.
    fn add(&self, bytes: &[u8], fields: &mut Fields) -> Result<(), String> {
        match self {
            Self::Whole => {
                fields.bytes(bytes);
                Ok(())
            }
            Self::Pointers(pointers) => {
                let body: serde_json::Value = serde_json::from_slice(bytes)
                    .map_err(|e| format!("the body is not JSON ({e}); nothing was done"))?;
                for pointer in pointers {
                    let value = body.pointer(pointer).unwrap_or(&serde_json::Value::Null);
                    fields.add(pointer, value);
                }
                Ok(())
            }
            Self::Function(read) => read(bytes, fields),
        }
    }
}

/// A body the layer could not read whole: over its limit (413), or broken off (400).
fn unread(problems: Problems<'_>, error: &axum::Error) -> Response {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = cause {
        if error.is::<http_body_util::LengthLimitError>() {
            let detail = "the body is over the route's limit (axum's DefaultBodyLimit, 2 MiB unless set); nothing was done";
            let problem = problems.invalid_request(StatusCode::PAYLOAD_TOO_LARGE);
            return problem.with_detail(detail).into_response();
        }
        cause = error.source();
    }
    let detail = format!("the body could not be read ({error}); nothing was done");
    problems
        .invalid_request(StatusCode::BAD_REQUEST)
        .with_detail(detail)
        .into_response()
}

/// Runs the claimed request through `inner`, then takes the transaction back from the
/// [`Transaction`] it lent (from then on, a copy kept past the answer finds it ended)
/// and commits or rolls back with the answer (a `grpc` one by its status).
async fn run<S, ResBody>(
    claimed: Claimed,
    mut inner: S,
    mut request: Request<Body>,
    scope: &'static str,
    grpc: bool,
) -> Result<Response, S::Error>
where
    S: Service<Request<Body>, Response = http::Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    let span = claimed.span();
    let store = claimed.store.clone();
    // The only strong reference but a held `Locked`'s: if this future is dropped (a
    // client gone, a timeout), the transaction rolls back once no `Locked` holds it
    // (invariant 7), whatever copies of the `Transaction` live on.
    let slot = Arc::new(Mutex::new(Some(claimed)));
    let ended = Arc::new(AtomicBool::new(false));
    request.extensions_mut().insert(Transaction {
        slot: Arc::downgrade(&slot),
        ended: Arc::clone(&ended),
    });
    let service = super::escape::running(scope, inner.call(request));
    let answered = service.instrument(span).await;
    // From the answer on, no one gets the transaction, even one who asked for it
    // before; this waits for a `Locked` still held, whose writes are the request's.
    ended.store(true, Ordering::Release);
    let Some(claimed) = slot.lock().await.take() else {
        // Only this function takes it, once: never reached.
        let problem =
            Problems::of(&store).internal("the request's transaction was taken before its answer");
        return Ok(problem.into_response());
    };
    match answered {
        Ok(response) if grpc => {
            let answer = grpc_answer(response, &store).await;
            Ok(claimed.finish(answer).await)
        }
        Ok(response) => Ok(claimed.finish(Answer::ok(response.map(Body::new))).await),
        Err(error) => {
            let _ = claimed
                .finish(Answer::err(StatusCode::INTERNAL_SERVER_ERROR))
                .await;
            Err(error)
        }
    }
}

/// A gRPC reply as an [`Answer`]: it commits if its status, in its trailers (or its
/// headers, for a reply without a message), is OK. Its body is read here, for its
/// trailers, up to the store's cap on a stored response; one over it, or one that breaks
/// off, rolls back, as `Claimed::finish` answers such a body.
async fn grpc_answer<ResBody>(response: http::Response<ResBody>, store: &Store) -> Answer
where
    ResBody: http_body::Body<Data = Bytes>,
    ResBody::Error: Into<axum::BoxError>,
{
    use http_body_util::{BodyExt, LengthLimitError, Limited};

    let limit = store.inner.max_response_bytes;
    let (parts, body) = response.into_parts();
    let collected = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected,
        Err(error) => {
            let error = if error.is::<LengthLimitError>() {
                CaptureError::TooLarge { limit }
            } else {
                CaptureError::Body(error)
            };
            tracing::warn!(%error, "idem: a gRPC reply cannot be stored; rolled back");
            return Answer::err(Problems::of(store).capture_error(&error));
        }
    };
    let trailers = collected.trailers().cloned();
    let status = trailers
        .as_ref()
        .and_then(|trailers| trailers.get(GRPC_STATUS))
        .or_else(|| parts.headers.get(GRPC_STATUS));
    let ok = status.is_some_and(|status| status == "0");
    let body = super::response::body(collected.to_bytes(), trailers);
    Answer::rpc(Response::from_parts(parts, body), ok)
}

/// The request's transaction, lent by [`IdempotencyLayer`] to the service it wraps, in
/// the request's extensions: an axum handler takes it as an argument. Writes through it
/// commit with the key's record and the stored answer, or not at all.
///
/// The layer takes the transaction back when the service answers, after any [`Locked`]
/// still held is dropped (a write made through it commits with the request): a copy
/// kept past the answer (moved to a spawned task, say) then finds it [`Ended`], even if
/// it asked before the answer, so a write can never land outside its request. A copy
/// does not keep the transaction open: a request dropped before its answer rolls back
/// as soon as no `Locked` holds it.
///
/// Around a service that is not an axum handler:
///
/// ```no_run
/// use axum::body::Body;
/// use http::{Request, Response};
/// use idem::layer::{IdempotencyLayer, Transaction};
/// use tower::ServiceBuilder;
///
/// # fn f(store: idem::Store) {
/// let service = ServiceBuilder::new()
///     .layer(IdempotencyLayer::new(store, "notes"))
///     .service_fn(|request: Request<Body>| async move {
///         let transaction = request.extensions().get::<Transaction>().cloned();
///         let mut locked = transaction.ok_or("no layer")?.lock().await?;
///         sqlx::query("INSERT INTO notes (body) VALUES ('a note')")
///             .execute(&mut *locked.tx())
///             .await?;
///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Response::new(Body::empty()))
///     });
/// # }
/// ```
///
/// [`lock`](Self::lock) waits while the transaction is held: a task that holds a
/// `Locked` and locks again waits forever.
#[derive(Clone)]
pub struct Transaction {
    slot: Weak<Mutex<Option<Claimed>>>,
    /// Set when the service has answered.
    ended: Arc<AtomicBool>,
}

impl Transaction {
    /// Waits for the transaction (one user at a time), or says that its request has
    /// been answered.
    pub async fn lock(&self) -> Result<Locked, Ended> {
        let slot = self.slot.upgrade().ok_or(Ended)?.lock_owned().await;
        self.locked(slot)
    }

    /// The transaction in `slot`, unless the request has been answered.
    fn locked(&self, slot: OwnedMutexGuard<Option<Claimed>>) -> Result<Locked, Ended> {
        if self.ended.load(Ordering::Acquire) {
            return Err(Ended);
        }
        let guard = OwnedMutexGuard::try_map(slot, Option::as_mut).map_err(|_| Ended)?;
        Ok(Locked { guard })
    }
}

impl fmt::Debug for Transaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transaction").finish_non_exhaustive()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Transaction {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            lent_problem(
                "No idempotency layer",
                "the handler takes idem's Transaction or Locked, and no IdempotencyLayer wraps its route",
            )
        })
    }
}

/// A 500 problem of a handler's `Transaction` or `Locked`, which no store's settings
/// shape: a route without the layer has none.
fn lent_problem(title: &'static str, detail: &'static str) -> Problem {
    let kind = format!(
        "{}{}",
        crate::problem::DEFAULT_PROBLEM_BASE,
        problem_type::INTERNAL
    );
    Problem::new(StatusCode::INTERNAL_SERVER_ERROR, kind, title).with_detail(detail)
}

/// The request's transaction, held: [`tx`](Self::tx) lends it to the service's
/// statements until this is dropped. An axum handler under the layer takes it as an
/// argument, and holds the transaction while it runs:
///
/// ```no_run
/// # use axum::{http::StatusCode, Json};
/// # use serde_json::Value;
/// use idem::layer::Locked;
///
/// async fn create_charge(mut locked: Locked, Json(req): Json<Value>) -> Result<StatusCode, String> {
///     let mut tx = locked.tx();
///     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
///         .bind(req["amount"].as_i64())
///         .execute(&mut *tx)
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
pub struct Locked {
    guard: OwnedMappedMutexGuard<Option<Claimed>, Claimed>,
}

impl Locked {
    /// The transaction, as `#[idempotent]` lends it to a handler: `&mut *tx` is an
    /// sqlx executor, and [`Tx::step`] records a call to another service.
    pub fn tx(&mut self) -> Tx<'_> {
        self.guard.tx()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Locked {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        let transaction = Transaction::from_request_parts(parts, state).await?;
        // Not `lock`, which would wait forever for a `Locked` this request already
        // holds (two `Locked` arguments, a middleware's): one holder at a time.
        let held = || {
            lent_problem("Transaction held", "the request's transaction is already held (two Locked arguments, or a middleware's): take it once")
        };
        let slot = transaction.slot.upgrade().ok_or_else(|| {
            lent_problem("Transaction ended", "the request's transaction has ended")
        })?;
        let slot = slot.try_lock_owned().map_err(|_| held())?;
        transaction.locked(slot).map_err(|Ended| {
            lent_problem("Transaction ended", "the request's transaction has ended")
        })
    }
}

impl fmt::Debug for Locked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locked").finish_non_exhaustive()
    }
}

/// The request whose [`Transaction`] this was has been answered: its transaction is
/// committed or rolled back, and takes no more writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ended;

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the request's transaction has ended: its answer was given, and it takes no more writes")
    }
}

impl std::error::Error for Ended {}
