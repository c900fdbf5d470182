//! What an idempotent handler's parameters give idem: the body to fingerprint, the
//! principal, a key from the body or a header; and every extractor's rejection as
//! problem+json.

use std::borrow::Cow;
use std::marker::PhantomData;

use axum::body::Bytes;
use axum::extract::{FromRef, FromRequest, FromRequestParts, Query, Request};
use axum::response::{IntoResponse, Response};
use axum::{Form, Json};
use http::request::Parts;
use http::HeaderMap;
use serde::Serialize;

use crate::complete::CaptureBody;
use crate::store::Store;
use crate::web::policy::KeyRead;
use crate::web::problem::Problems;

/// A request body idem can fingerprint: the last parameter of an `#[idempotent]`
/// handler whose payload identifies the request.
///
/// With `fields = [...]` the named fields are read from [`fingerprint_value`] (and only
/// they need to be `Serialize`); without, the whole value is fingerprinted and must be
/// `Serialize`. Implemented for [`Json<T>`], [`Form<T>`], [`Query<T>`] (a query string
/// as the payload), [`String`] and [`Bytes`]; an `Option` or `Result` of one of these
/// (`Option<Json<T>>`, `Result<Json<T>, JsonRejection>`) is fingerprinted whole too, an
/// absent or rejected body apart from every present one. Implement it for your own body
/// extractors, whatever state their `FromRequest` is written for: a last parameter that
/// reads the body and is none of these is a compile error (where the handler is routed,
/// since whether it reads the body depends on the router's state), since a payload left
/// out of the fingerprint would let a reused key with another payload replay the first
/// answer.
///
/// [`fingerprint_value`]: FingerprintBody::fingerprint_value
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a request body idem can fingerprint",
    label = "idem fingerprints this parameter, to tell a retry from another request under the same key",
    note = "implement `idem::extract::FingerprintBody` for it, then name `fields = [...]` or let its whole value identify the request; or make it a `Json<T>`, `Form<T>`, `Query<T>`, `String` or `Bytes`"
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

impl<T> FingerprintBody for Form<T> {
    type Value = T;

    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

impl<T> FingerprintBody for Query<T> {
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
/// use idem::extract::Principal;
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
    note = "`principal = Type` needs an extractor that implements `idem::extract::Principal`"
)]
pub trait Principal {
    /// The principal's identifier: keys are looked up per (scope, principal, key).
    fn principal_id(&self) -> String;
}

/// A body field that can be an idempotency key (`key = field`): text, or an integer.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an idempotency key",
    label = "`key = ...` names this field",
    note = "a key comes from a text field (`String`, `&str`), an integer, or an `Option` of one"
)]
pub trait KeySource {
    /// The key's text; `None` when the field is absent.
    fn key_text(&self) -> Option<Cow<'_, str>>;
}

impl KeySource for str {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(self.into())
    }
}

impl KeySource for String {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(self.as_str().into())
    }
}

impl<K: KeySource + ?Sized> KeySource for &K {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        (**self).key_text()
    }
}

impl<K: KeySource> KeySource for Option<K> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        self.as_ref().and_then(KeySource::key_text)
    }
}

macro_rules! integer_keys {
    ($($t:ty),*) => {$(
        impl KeySource for $t {
            fn key_text(&self) -> Option<Cow<'_, str>> {
                Some(self.to_string().into())
            }
        }
    )*};
}

integer_keys!(u32, u64, i32, i64, u128, i128);

/// The key of `key = field`: a body field's value, as an idempotency key. The value is
/// plain text, not a header: it is not unquoted, and an id that is too long or not
/// visible ASCII is hashed rather than refused
/// ([`IdempotencyKey::from_text`](crate::header::IdempotencyKey::from_text)).
pub fn key_of<K: KeySource + ?Sized>(value: &K) -> KeyRead {
    KeyRead::field(value.key_text().as_deref())
}

/// The key of `key = digest(body)`: `sha256:` and the hex SHA-256 of the body's
/// canonical encoding (the encoding fingerprints use), so that a redelivery of the same
/// content, however its JSON is spaced or its keys ordered, has the same key.
pub fn key_of_digest<V: Serialize + ?Sized>(body: &V) -> KeyRead {
    match crate::fingerprint::key_digest(body) {
        Ok(digest) => KeyRead::digest(Some(&digest)),
        Err(error) => {
            tracing::error!(%error, "idem: the body's digest failed");
            KeyRead::digest(None)
        }
    }
}

/// The key of `key = header("..")`: that header, in either spelling.
pub fn key_from_header(headers: &HeaderMap, name: &'static str, signed: bool) -> KeyRead {
    KeyRead::header(headers, name, signed)
}

/// Takes the value out of the handler's own `principal = Type` extractor.
pub fn principal_of<P: Principal>(principal: &P) -> Option<String> {
    Some(principal.principal_id())
}

/// The value `fields = [...]` reads from; spanned on the body's type by the macro, so a
/// parameter that is not a body is reported there.
pub fn body_of<B: FingerprintBody>(body: &B) -> &B::Value {
    body.fingerprint_value()
}

/// A router state an `#[idempotent]` handler can take idem's [`Store`] from: any state
/// `S` with `Store: FromRef<S>`, such as a `#[derive(Clone, FromRef)]` struct with a
/// `Store` field, or the `Store` itself.
///
/// The generated handler's extractors require it rather than `Store: FromRef<S>`
/// directly: `FromRef`'s one blanket impl (`T: FromRef<T>`) would otherwise make rustc
/// infer the router's state to be `Store`, and report a state without one as
/// "expected `Store`, found `AppState`" on `with_state`. The generated handler is
/// generic over the state with a `where S: HoldsStore` of its own, checked on the route
/// (`post(handler)`), so this message is the one a route on a state without a store
/// gets: inside axum's traits the bound would be reported as axum's own `Handler`,
/// `FromRequestParts` or `FromRequest` bound (`do_not_recommend` impls), as it still is
/// under `#[axum::debug_handler]`, which checks no generic handler. Implemented by the
/// blanket impl only.
#[diagnostic::on_unimplemented(
    message = "the router's state `{Self}` holds no `idem::Store`",
    label = "an `#[idempotent]` handler takes idem's store from this state",
    note = "`#[idempotent]` handlers take idem's store from the router's state through `FromRef`: add a `store: idem::Store` field to `{Self}` and `#[derive(Clone, FromRef)]` on it, or implement `FromRef<{Self}>` for `idem::Store`"
)]
pub trait HoldsStore: Send + Sync {
    /// The store, from the state.
    fn store(&self) -> Store;
}

// `do_not_recommend`: an error names the state, not the `FromRef` bound within.
#[diagnostic::do_not_recommend]
impl<S> HoldsStore for S
where
    Store: FromRef<S>,
    S: Send + Sync,
{
    fn store(&self) -> Store {
        Store::from_ref(self)
    }
}

/// Wraps each of the handler's extractors so that its rejection is answered as
/// `application/problem+json`, like every other error of an idempotent endpoint.
#[derive(Debug)]
pub struct Extract<T>(pub T);

impl<S, T> FromRequestParts<S> for Extract<T>
where
    T: FromRequestParts<S> + Send,
    S: HoldsStore,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        // The rejection becomes a `Response` first: rejection types need not be `Send`.
        match T::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)
        {
            Ok(value) => Ok(Self(value)),
            Err(rejection) => Err(rejected(state, rejection).await),
        }
    }
}

impl<S, T> FromRequest<S> for Extract<T>
where
    T: FromRequest<S> + Send,
    S: HoldsStore,
{
    type Rejection = Response;

    async fn from_request(mut req: Request, state: &S) -> Result<Self, Response> {
        // A completable endpoint's body is read once, kept, and handed on.
        if let Some(capture) = req.extensions().get::<CaptureBody>().cloned() {
            req = match capture.read(req, state).await {
                Ok(req) => req,
                Err(rejection) => return Err(rejected(state, rejection).await),
            };
        }
        // The rejection becomes a `Response` first: rejection types need not be `Send`.
        match T::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)
        {
            Ok(value) => Ok(Self(value)),
            Err(rejection) => Err(rejected(state, rejection).await),
        }
    }
}

/// The last parameter of a handler that names no fields, extracted as [`Extract`] does.
/// `M` says how: from the request's head ([`ReadsHead`]) or from its body
/// ([`ReadsBody`]), whichever impl holds under the router's state. The generated handler
/// is generic over `M`, so rustc infers it together with axum's own choice, and bounds
/// the state by the probes' `ExtractsLast<T, M>`: a body idem cannot fingerprint is
/// refused whatever state its extractor is written for.
#[derive(Debug)]
pub struct LastExtract<T, M>(pub T, pub PhantomData<fn() -> M>);

/// [`LastExtract`]'s `M` for a parameter that reads the request's head only.
#[derive(Debug)]
pub enum ReadsHead {}

/// [`LastExtract`]'s `M` for a parameter that reads the body.
#[derive(Debug)]
pub enum ReadsBody {}

impl<S, T> FromRequestParts<S> for LastExtract<T, ReadsHead>
where
    T: FromRequestParts<S> + Send,
    S: HoldsStore,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let Extract(value) = Extract::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value, PhantomData))
    }
}

impl<S, T> FromRequest<S> for LastExtract<T, ReadsBody>
where
    T: FromRequest<S> + Send,
    S: HoldsStore,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let Extract(value) = <Extract<T> as FromRequest<S>>::from_request(req, state).await?;
        Ok(Self(value, PhantomData))
    }
}

async fn rejected<S: HoldsStore>(state: &S, rejection: Response) -> Response {
    let store = state.store();
    Problems::of(&store).rejection(rejection).await
}
