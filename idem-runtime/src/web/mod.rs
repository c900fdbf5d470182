//! The HTTP adapter: an idempotent axum request on the [engine](crate::engine).
//!
//! The code `#[idempotent]` generates extracts a [`Guard`] (the store, the key, the
//! request's target), adds the fingerprinted fields to [`Fields`], claims with
//! [`Guard::claim`], runs the handler with the [`Claimed`] transaction and hands its
//! [`Answer`] to [`Claimed::finish`]. This module alone decides what the engine's
//! outcomes look like to a client (with [`problem`]) and records them ([`Observation`]).

pub(crate) mod escape;
pub(crate) mod extract;
#[cfg(feature = "tonic")]
pub(crate) mod grpc;
pub(crate) mod layer;
pub(crate) mod policy;
pub(crate) mod problem;
pub(crate) mod response;
mod step;

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, RawPathParams};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method};
use serde::Serialize;

use crate::complete::{Completable, Completion};
use crate::engine::{self, Alone, Attempt, Begun, Claim, CommitError, Committed, Refusal};
use crate::failpoint::Point;
use crate::fingerprint::{Fingerprint, FingerprintBuilder, FingerprintError};
use crate::identity::{KeyInScope, Place};
use crate::observe::{Observation, Outcome};
use crate::spread::Spread;
use crate::store::Store;
use crate::table::requests::StoredRequest;
use crate::table::Isolation;
use crate::tx::Tx;
use extract::HoldsStore;
use policy::KeyRead;
use problem::Problems;
use response::IDEMPOTENT_RECORDED;

/// An endpoint's settings, checked by the macro at compile time.
#[derive(Debug)]
pub struct Spec {
    /// The scope keys live in.
    pub scope: &'static str,
    /// How long a stored response is replayed.
    pub ttl: Duration,
    /// Whether a request without a key is refused (400) or runs unrecorded.
    pub required: bool,
    /// `concurrency = wait("..")`: how long a duplicate waits for the request in flight;
    /// `None` for the store's setting.
    pub conflict_wait: Option<Duration>,
    /// The transaction's isolation level.
    pub isolation: Isolation,
    /// `statement_timeout = ".."`: the bound on each of the handler's statements; `None`
    /// for the store's setting.
    pub statement_timeout: Option<Duration>,
}

/// What a handler answered, and whether it may commit: `Ok` below 500 commits and is
/// replayed; `Err`, or any 5xx, rolls everything back so the client may retry.
#[derive(Debug)]
pub struct Answer {
    response: Response,
    commit: bool,
    /// Whether every header is stored, not only the store's `replay_headers`: a gRPC
    /// reply's metadata is the method's own, all of it replayed.
    every_header: bool,
}

impl Answer {
    /// An `Ok` answer: final unless it is a 5xx.
    pub fn ok(response: impl IntoResponse) -> Self {
        let response = response.into_response();
        let commit = !response.status().is_server_error();
        Self {
            response,
            commit,
            every_header: false,
        }
    }

    /// An `Err` answer: rolled back, retryable.
    pub fn err(response: impl IntoResponse) -> Self {
        Self {
            response: response.into_response(),
            commit: false,
            every_header: false,
        }
    }

    /// A gRPC reply (`commit`: its status is OK): stored with every header, and with
    /// its trailers, as gRPC sent it.
    pub(crate) fn rpc(response: Response, commit: bool) -> Self {
        Self {
            response,
            commit,
            every_header: true,
        }
    }
}

/// The extractor the macro puts first: the store, the header's key and the request's
/// target.
///
/// It names the router's state `S` and is an extractor for that state only, so that
/// axum's `Handler` impl makes the generated handler's own type parameter the router's
/// state, and the handler's `where S: HoldsStore` is checked on the route with
/// [`HoldsStore`]'s message rather than reported as an unsatisfied `Handler` bound.
#[derive(Debug)]
pub struct Guard<S> {
    store: Store,
    key: KeyRead,
    principal: Option<String>,
    spread: Spread,
    /// Whether the body is signed ([`Guard::signed`]).
    signed: bool,
    method: Method,
    route: Option<MatchedPath>,
    /// The route of a request no router matched: its path ([`Guard::unrouted`]).
    unrouted: Option<String>,
    params: Option<RawPathParams>,
    query: Option<String>,
    /// Whether the endpoint is completable ([`Guard::completable`]).
    completable: bool,
    /// Its request, to store with its first step (`None` for a completion).
    stored: Option<Arc<StoredRequest>>,
    /// The completion this request is, if it is one ([`crate::complete`]).
    completion: Option<Completion>,
    // `fn() -> S`: the guard is `Send` and `Sync` whatever the state.
    state: PhantomData<fn() -> S>,
}

impl<S: HoldsStore> FromRequestParts<S> for Guard<S> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        Self::read(state.store(), parts).await
    }
}

impl<S> Guard<S> {
    /// Reads the key, the principal and the target of the request `parts` begin, for
    /// `store`: the macro's extractor, and the layer's first act (`web::layer`).
    pub(crate) async fn read(store: Store, parts: &mut Parts) -> Result<Self, Response> {
        // One request, one claim (invariant 1): an idempotent endpoint inside an
        // `IdempotencyLayer` would claim in a transaction of its own.
        if parts.extensions.get::<layer::Transaction>().is_some() {
            let detail = "an IdempotencyLayer wraps this route, which is idempotent itself (a second layer, or #[idempotent]): keep one";
            return Err(Problems::of(&store).internal(detail).into_response());
        }
        let params = match RawPathParams::from_request_parts(parts, &()).await {
            Ok(params) => Some(params),
            // No parameters on this route.
            Err(RawPathParamsRejection::MissingPathParams(_)) => None,
            Err(rejection) => {
                return Err(Problems::of(&store)
                    .rejection(rejection.into_response())
                    .await)
            }
        };
        Ok(Self {
            principal: store.resolve_principal(parts),
            spread: Spread::None,
            signed: false,
            // A bad key is answered by `claim`, where the endpoint's key source is known.
            key: KeyRead::idempotency_key(&parts.headers),
            store,
            method: parts.method.clone(),
            route: parts.extensions.get::<MatchedPath>().cloned(),
            unrouted: None,
            params,
            query: parts.uri.query().map(str::to_owned),
            completable: false,
            stored: None,
            completion: None,
            state: PhantomData,
        })
    }

    /// Fingerprints `procedure` (a gRPC method's `Service/method`) as the route,
    /// whatever router matched the request, and no path parameters.
    #[cfg(feature = "tonic")]
    pub(crate) fn procedure(mut self, procedure: &str) -> Self {
        self.route = None;
        self.params = None;
        self.unrouted = Some(procedure.to_owned());
        self
    }

    /// Fingerprints `path` as the route if no router matched the request: a layer
    /// around a service that is not a router.
    pub(crate) fn unrouted(mut self, path: &str) -> Self {
        if self.route.is_none() {
            self.unrouted = Some(path.to_owned());
        }
        self
    }
}

impl<S> Guard<S> {
    /// Starts the fingerprint with the request's target: method, route, path
    /// parameters and query string.
    pub fn fingerprint(&self, spec: &Spec) -> Fields {
        let route = match (&self.route, &self.unrouted) {
            (Some(route), _) => route.as_str(),
            (None, unrouted) => unrouted.as_deref().unwrap_or(""),
        };
        let params = self.params.iter().flat_map(RawPathParams::iter);
        let mut builder = Fingerprint::builder(spec.scope, self.method.as_str(), route, params);
        if let Some(query) = &self.query {
            builder.query(query);
        }
        Fields {
            builder,
            error: None,
        }
    }

    /// Where a key without a principal is kept (`spread = ..`; see the `spread` module).
    pub fn spread(mut self, spread: Spread) -> Self {
        self.spread = spread;
        self
    }

    /// Whether the request's body is signed (a webhook delivery): its principal then
    /// comes from the endpoint's own `principal = ..` alone (`web::policy::principal`).
    pub fn signed(mut self, signed: bool) -> Self {
        self.signed = signed;
        self
    }

    /// Makes the request completable (`completable = true`): it is stored with its first
    /// step, with the allowed headers and `key_header`, the one its key is read from
    /// (`None`: `Idempotency-Key`). A request that is a completion runs under its stored
    /// principal, and only for its stored key.
    pub fn completable(mut self, capture: Completable, key_header: Option<&str>) -> Self {
        if let Some(completion) = capture.completion() {
            self.principal = completion.principal().map(str::to_owned);
            self.completion = Some(completion.clone());
        }
        let key_header = key_header
            .and_then(|name| HeaderName::try_from(name).ok())
            .unwrap_or(crate::key::IDEMPOTENCY_KEY);
        self.completable = true;
        self.stored = capture
            .stored(&self.store.inner.stored_headers, &key_header)
            .map(Arc::new);
        self
    }

    /// Claims the key: `Ok` when the handler is to run, `Err` with the answer when not
    /// (a replay, 400, 409, 422, 503). `principal` is the handler's own
    /// `principal = ...`, and `key` the endpoint's own key source (`key = ...`), when it
    /// has them (`web::policy` says which wins).
    pub async fn claim(
        self,
        spec: &Spec,
        principal: Option<String>,
        key: Option<KeyRead>,
        fields: Fields,
    ) -> Result<Claimed, Response> {
        let observation = Observation::start(spec.scope.into());
        let problems = Problems::of(&self.store);
        let limit = self.store.inner.max_response_bytes;
        if self
            .stored
            .as_ref()
            .is_some_and(|stored| stored.body.len() > limit)
        {
            let problem = problems.request_too_large(limit).into_response();
            return Err(observation.answer(Outcome::RejectedKey, problem));
        }
        let key = match policy::key(key, self.key, spec.required) {
            Ok(key) => key,
            Err(refused) => {
                let problem = problems
                    .key_error(&refused.error, &refused.origin)
                    .into_response();
                return Err(observation.answer(Outcome::RejectedKey, problem));
            }
        };
        let (place, principal) = match &key {
            None => (Place::Nobody, String::new()),
            Some(claimed) => match policy::principal(
                principal,
                self.principal,
                self.store.inner.require_principal,
                self.signed,
            ) {
                // No principal (empty): the key is kept under its spread (crate::spread).
                Some(principal) if principal.is_empty() => self
                    .spread
                    .place(self.store.inner.dialect, claimed.as_str()),
                Some(principal) => {
                    let principal_type = self.store.inner.dialect.principal_type;
                    match principal_type.canonical(&principal) {
                        Some(canonical) => (Place::Principal, canonical),
                        None => {
                            let expected = principal_type.sql();
                            tracing::warn!(
                                scope = spec.scope,
                                expected,
                                "idem: the request's principal is not of the principal column's type; refused"
                            );
                            let problem = problems.invalid_principal(expected).into_response();
                            return Err(observation.answer(Outcome::RejectedKey, problem));
                        }
                    }
                }
                None => {
                    tracing::warn!(
                        scope = spec.scope,
                        "idem: no principal for a keyed request; refused"
                    );
                    let problem = problems.missing_principal().into_response();
                    return Err(observation.answer(Outcome::RejectedKey, problem));
                }
            },
        };
        let claim = match (key, fields.error) {
            (None, _) => None,
            (Some(_), Some(error)) => {
                tracing::error!(%error, scope = spec.scope, "idem: fingerprint failed");
                let problem = problems.internal(error.to_string()).into_response();
                return Err(observation.answer(Outcome::Failed, problem));
            }
            (Some(key), None) => Some(Claim {
                key: KeyInScope {
                    scope: spec.scope.into(),
                    principal,
                    key,
                    place,
                },
                ttl: spec.ttl,
                fingerprint: fields.builder.finish(),
                conflict_wait: spec.conflict_wait,
                statement_timeout: spec.statement_timeout,
            }),
        };
        // A completion claims the key it was stored under, and no other.
        if let Some(completion) = &self.completion {
            if !claim
                .as_ref()
                .is_some_and(|claim| completion.is_for(&claim.key))
            {
                tracing::warn!(
                    scope = spec.scope,
                    "idem: a completion reached an endpoint that claims another key; refused"
                );
                let problem = problems.key_reused().into_response();
                return Err(observation.answer(Outcome::Mismatch, problem));
            }
        }
        let mut claimed = claimed(self.store, claim, spec.isolation, observation).await?;
        if self.completable {
            claimed.attempt.capture(self.stored);
        }
        Ok(claimed)
    }
}

/// Begins the attempt: the claimed transaction, or the answer that ends the request.
async fn claimed(
    store: Store,
    claim: Option<Claim>,
    isolation: Isolation,
    mut observation: Observation,
) -> Result<Claimed, Response> {
    match engine::begin(&store, claim, isolation).await {
        Ok(Begun::Run(attempt)) => {
            observation.claimed();
            Ok(Claimed {
                store,
                attempt,
                observation,
            })
        }
        Ok(Begun::Replay(record)) => {
            Err(observation.answer(Outcome::Replayed, response::replay(record)))
        }
        Err(refusal) => Err(refused(&store, observation, &refusal)),
    }
}

/// The answer to a refusal of the engine, logged and observed.
fn refused(store: &Store, observation: Observation, refusal: &Refusal) -> Response {
    let outcome = match refusal {
        Refusal::InUse | Refusal::Abandoning => Outcome::Conflict,
        Refusal::Mismatch => Outcome::Mismatch,
        Refusal::Unavailable(error) => {
            tracing::warn!(parent: observation.span(), %error, "idem: database unavailable");
            Outcome::Unavailable
        }
        Refusal::Database(error) => {
            tracing::error!(parent: observation.span(), %error, "idem: database error");
            Outcome::Failed
        }
        Refusal::Unreadable => {
            tracing::error!(parent: observation.span(), "idem: stored row has an invalid status");
            Outcome::Failed
        }
    };
    let problem = Problems::of(store).refusal(refusal).into_response();
    observation.answer(outcome, problem)
}

/// The fingerprint under construction; the first serialization error is kept and
/// answered as a 500 before anything runs.
#[derive(Debug)]
pub struct Fields {
    builder: FingerprintBuilder,
    error: Option<FingerprintError>,
}

impl Fields {
    /// Adds a named field (`fields = [...]`); `tag`, from the probe of the field's type,
    /// says whether that type is `Serialize`.
    pub fn field<T: ?Sized, Tag: Fingerprintable<T>>(
        &mut self,
        name: &'static str,
        value: &T,
        tag: Tag,
    ) {
        tag.add(self, name, value);
    }

    /// Adds the whole body's bytes, as bytes (not as a sequence of numbers), under
    /// [`crate::fingerprint::WHOLE_BODY`].
    pub(crate) fn bytes(&mut self, bytes: &[u8]) {
        struct Raw<'a>(&'a [u8]);

        impl Serialize for Raw<'_> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_bytes(self.0)
            }
        }

        self.add(crate::fingerprint::WHOLE_BODY, &Raw(bytes));
    }

    /// Adds a named field, or the whole body under [`crate::fingerprint::WHOLE_BODY`].
    pub(crate) fn add<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) {
        if self.error.is_none() {
            self.error = self.builder.field(name, value).err();
        }
    }
}

/// Adds a named field whose type was probed to [`Fields`]: implemented by the probe's
/// tag for a `Serialize` type, and by no other, so that a field that cannot be
/// fingerprinted is a compile error on the user's own token.
#[diagnostic::on_unimplemented(
    message = "`{T}` cannot be fingerprinted: it does not implement `serde::Serialize`",
    label = "this field's type must implement `Serialize`",
    note = "derive `serde::Serialize` for it, or leave this field out of `fields = [...]`"
)]
pub trait Fingerprintable<T: ?Sized> {
    /// Adds the field.
    fn add(self, fields: &mut Fields, name: &'static str, value: &T);
}

/// The open transaction the handler runs in, lent to it as [`Tx`], then finished with
/// its [`Answer`]. Dropping it (a client that disconnects, a timeout, a panic) rolls
/// everything back.
pub struct Claimed {
    store: Store,
    attempt: Attempt,
    observation: Observation,
}

impl std::fmt::Debug for Claimed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimed")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl Claimed {
    /// The transaction, lent to the handler.
    pub fn tx(&mut self) -> Tx<'_> {
        self.attempt.tx()
    }

    /// The request's span, for the handler to run in.
    pub fn span(&self) -> tracing::Span {
        self.observation.span().clone()
    }

    /// Commits the handler's answer with its stored response, or rolls it back.
    pub async fn finish(self, answer: Answer) -> Response {
        let Self {
            store,
            attempt,
            observation,
        } = self;
        let settings = &store.inner;
        let problems = Problems::of(&store);

        if !answer.commit {
            return match attempt.rollback().await {
                Ok(()) => observation.answer(Outcome::RolledBack, answer.response),
                // The handler's error may be the symptom (its query failed because the
                // connection died); the failed rollback tells us the database is gone.
                Err(e) if crate::sqlstate::is_unavailable(&e) => {
                    observation.answer(Outcome::Unavailable, problems.unavailable().into_response())
                }
                Err(e) => {
                    tracing::warn!(parent: observation.span(), error = %e, "idem: rollback failed");
                    observation.answer(Outcome::RolledBack, answer.response)
                }
            };
        }

        if attempt.key().is_none() {
            // `required = false` and no key: the handler's writes commit, nothing is
            // recorded, and the response says so.
            let status = answer.response.status();
            let claims_success = status.is_success() || status.is_redirection();
            if let Err(error) = attempt.commit_unrecorded(claims_success).await {
                return commit_failed(&store, observation, &error);
            }
            let mut response = answer.response;
            response
                .headers_mut()
                .insert(IDEMPOTENT_RECORDED, HeaderValue::from_static("false"));
            return observation.answer(Outcome::Unkeyed, response);
        }

        let allow = (!answer.every_header).then_some(&settings.replay_headers[..]);
        let captured = response::capture(answer.response, allow, settings.max_response_bytes).await;
        let (record, parts, trailers) = match captured {
            Ok(captured) => captured,
            Err(error) => {
                tracing::error!(parent: observation.span(), %error, "idem: the response cannot be stored; rolled back");
                let problem = problems.capture_error(&error).into_response();
                return observation.answer(Outcome::RolledBack, problem);
            }
        };
        store.failpoint(Point::BeforeCommit).await;
        let committed = attempt.commit(&record).await;
        store.failpoint(Point::AfterCommit).await;
        match committed {
            Ok(Committed::Stored) => {}
            // Another attempt with this key committed first: its answer is the key's.
            Ok(Committed::Superseded(record)) => {
                return observation.answer(Outcome::Replayed, response::replay(record))
            }
            // A final 4xx after a failed statement (a unique violation answered 409, say):
            // PostgreSQL rolled back whatever the handler wrote, and the rejection is
            // stored by itself, so that its retries replay it rather than fail forever.
            Err(CommitError::Aborted(Some(retake))) if parts.status.is_client_error() => {
                tracing::info!(
                    parent: observation.span(),
                    status = parts.status.as_u16(),
                    "idem: the handler answered after a failed statement; its writes were rolled back and its answer is stored alone"
                );
                match retake.store_alone(&record).await {
                    Ok(Alone::Stored) => {}
                    Ok(Alone::Replay(record)) => {
                        return observation.answer(Outcome::Replayed, response::replay(record))
                    }
                    Err(refusal) => return refused(&store, observation, &refusal),
                }
            }
            Err(error) => return commit_failed(&store, observation, &error),
        }
        let status = parts.status;
        observation.finish(Outcome::Fresh, Some(status.as_u16()));
        Response::from_parts(parts, response::body(record.body, trailers))
    }
}

/// The answer to a commit that failed, logged and observed.
fn commit_failed(store: &Store, observation: Observation, error: &CommitError) -> Response {
    let outcome = match error {
        // The engine logged it where it happened.
        CommitError::Escaped => Outcome::Failed,
        CommitError::Aborted(_) => {
            tracing::error!(
                parent: observation.span(),
                "idem: the handler answered a success after one of its statements failed; PostgreSQL rolled back its writes; nothing was stored"
            );
            Outcome::Failed
        }
        CommitError::Unavailable(error) => {
            tracing::warn!(parent: observation.span(), %error, "idem: database unavailable");
            Outcome::Unavailable
        }
        CommitError::Serialization(error) => {
            tracing::info!(parent: observation.span(), %error, "idem: serialization failure at commit; rolled back");
            Outcome::RolledBack
        }
        CommitError::Database(error) => {
            tracing::error!(parent: observation.span(), %error, "idem: database error");
            Outcome::Failed
        }
        CommitError::Refused(refusal) => return refused(store, observation, refusal),
    };
    let problem = Problems::of(store).commit_error(error).into_response();
    observation.answer(outcome, problem)
}

impl Observation {
    /// Records how a request ended with `response`, and returns it.
    fn answer(self, outcome: Outcome, response: Response) -> Response {
        self.finish(outcome, Some(response.status().as_u16()));
        response
    }
}
