//! Compile-time probes on an `#[idempotent]` handler's types, for the code the macro
//! generates: whether the handler returns a `Result` (so `Ok` commits and `Err` rolls
//! back), whether a field or a body is `Serialize`, which parameter is the body.
//!
//! A [`Probe<T>`] holds no value. Method resolution on `&&Probe<T>` picks the first
//! level whose bounds hold (autoref specialization: tried as `&Probe`, `&&Probe`,
//! `Probe`; on `&&&Probe<T>`, as `&&Probe`, `&&&Probe`, `&Probe`, `Probe`), and the tag it returns decides
//! which impl of the next trait applies; a tag with no impl is a compile error, whose
//! `#[diagnostic::on_unimplemented]` message names the user's mistake. Whether the
//! handler returned `Ok` or `Err` is thus decided by type, not by spotting `Result` in
//! the syntax, so aliases such as `type ApiResult<T> = Result<T, ApiError>` work.

use std::marker::PhantomData;

use axum::extract::{FromRequest, FromRequestParts};
use axum::response::IntoResponse;
use serde::Serialize;

use crate::web::extract::{FingerprintBody, ReadsBody, ReadsHead};
use crate::web::{Answer, Fields, Fingerprintable};

/// Asserts that the handler's own future is `Send`, so that a value held across an
/// `.await` that is not is reported on the handler, not as a missing `Handler` impl.
pub fn assert_send<F: std::future::Future + Send>(future: F) -> F {
    future
}

/// Runs the handler's future inside the request's span, and, in debug builds, with its
/// name where [`crate::extract::warn_on_escaping_writes`] finds it.
pub fn in_span<F: std::future::Future>(
    future: F,
    span: tracing::Span,
    handler: &'static str,
) -> impl std::future::Future<Output = F::Output> {
    tracing::Instrument::instrument(crate::web::escape::running(handler, future), span)
}

/// A type-level stand-in for a value of type `T`; `Send` and `Sync` whatever `T` is, so
/// a probe never changes what the handler's future is.
#[derive(Debug)]
pub struct Probe<T: ?Sized>(PhantomData<fn(&T)>);

impl<T: ?Sized> Probe<T> {
    /// The probe.
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T: ?Sized> Default for Probe<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The probe of a value's type, for types the macro cannot name (`impl IntoResponse`).
pub fn probe<T: ?Sized>(_: &T) -> Probe<T> {
    Probe::new()
}

/// A `Result` of two responses: `Ok` commits (below 500), `Err` rolls back.
#[derive(Debug)]
pub struct ResultTag;

/// A plain response: commits unless it is a 5xx.
#[derive(Debug)]
pub struct ResponseTag;

/// Neither: the handler's return type is not a response.
#[derive(Debug)]
pub struct NotAResponse;

/// First choice: a `Result` of two responses.
pub trait ResultLevel {
    /// The tag.
    fn __idem_output(&self) -> ResultTag {
        ResultTag
    }
}

impl<T: IntoResponse, E: IntoResponse> ResultLevel for &Probe<Result<T, E>> {}

/// Second choice: any response.
pub trait ResponseLevel {
    /// The tag.
    fn __idem_output(&self) -> ResponseTag {
        ResponseTag
    }
}

impl<R: IntoResponse> ResponseLevel for &&Probe<R> {}

/// Last choice: not a response.
pub trait NotAResponseLevel {
    /// The tag.
    fn __idem_output(&self) -> NotAResponse {
        NotAResponse
    }
}

impl<R> NotAResponseLevel for Probe<R> {}

/// Turns what the handler returned into an [`Answer`], as its tag says.
#[diagnostic::on_unimplemented(
    message = "`{R}` is not a response an `#[idempotent]` handler can return",
    label = "the handler returns `{R}`",
    note = "return a type that implements axum's `IntoResponse`, such as `(StatusCode, Json<T>)`, or a `Result` whose `Ok` and `Err` both do: `Ok` commits, `Err` rolls back"
)]
pub trait IntoOutcome<R> {
    /// The outcome.
    fn outcome(self, out: R) -> Answer;
}

impl<T: IntoResponse, E: IntoResponse> IntoOutcome<Result<T, E>> for ResultTag {
    fn outcome(self, out: Result<T, E>) -> Answer {
        match out {
            Ok(ok) => Answer::ok(ok),
            Err(err) => Answer::err(err),
        }
    }
}

impl<R: IntoResponse> IntoOutcome<R> for ResponseTag {
    fn outcome(self, out: R) -> Answer {
        Answer::ok(out)
    }
}

/// The handler's outcome; `tag` comes from probing the return type. The value comes
/// first so that a failing bound names the handler's return type.
pub fn outcome<R, Tag: IntoOutcome<R>>(out: R, tag: Tag) -> Answer {
    tag.outcome(out)
}

/// A value that can be fingerprinted.
#[derive(Debug)]
pub struct SerializeTag;

/// A value that cannot: its type is not `Serialize`.
#[derive(Debug)]
pub struct NotSerializeTag;

/// First choice: the value is `Serialize`.
pub trait SerializeLevel {
    /// The tag.
    fn __idem_serialize(&self) -> SerializeTag {
        SerializeTag
    }
}

impl<T: Serialize + ?Sized> SerializeLevel for Probe<T> {}

/// Otherwise.
pub trait NotSerializeLevel {
    /// The tag.
    fn __idem_serialize(&self) -> NotSerializeTag {
        NotSerializeTag
    }
}

impl<T: ?Sized> NotSerializeLevel for &Probe<T> {}

impl<T: Serialize + ?Sized> Fingerprintable<T> for SerializeTag {
    fn add(self, fields: &mut Fields, name: &'static str, value: &T) {
        fields.add(name, value);
    }
}

/// A body extractor whose value is `Serialize`.
#[derive(Debug)]
pub struct BodyParam;

/// A body extractor whose value is not `Serialize`.
#[derive(Debug)]
pub struct UnserializableBodyParam;

/// An extractor that reads the request body but that idem cannot fingerprint: left out,
/// a reused key with another payload would replay the first answer instead of 422.
#[derive(Debug)]
pub struct UnfingerprintedBodyParam;

/// Any other parameter: one that reads the request's head only (`Path`, `HeaderMap`,
/// `State`), so that a handler whose last parameter it is has no body.
#[derive(Debug)]
pub struct OtherParam;

/// What the last parameter adds to the fingerprint when the endpoint names no fields:
/// the value of a [`FingerprintBody`] whose value is `Serialize`; for `Option` and
/// `Result` of such a body, that value, or a mark that no body (`None`, `Err`) came,
/// under a name no field can have, so it tells apart from every present value.
pub trait FingerprintWhole {
    /// Adds the body.
    fn add_whole(&self, fields: &mut Fields);
}

impl<B> FingerprintWhole for B
where
    B: FingerprintBody,
    B::Value: Serialize,
{
    fn add_whole(&self, fields: &mut Fields) {
        fields.add(crate::fingerprint::WHOLE_BODY, self.fingerprint_value());
    }
}

// `Option` and `Result` are not `FingerprintBody`: a missing body has no value for
// `fields = [...]` to read. No crate but this one can make them so (orphan rule), which
// keeps these impls apart from the one above.
impl<B: FingerprintWhole> FingerprintWhole for Option<B> {
    fn add_whole(&self, fields: &mut Fields) {
        match self {
            Some(body) => body.add_whole(fields),
            None => fields.add(NO_BODY, &()),
        }
    }
}

impl<B: FingerprintWhole, E> FingerprintWhole for Result<B, E> {
    fn add_whole(&self, fields: &mut Fields) {
        match self {
            Ok(body) => body.add_whole(fields),
            Err(_) => fields.add(REJECTED_BODY, &()),
        }
    }
}

/// The field an absent body (`None`) adds; not a Rust path, so no `fields = [...]` entry.
const NO_BODY: &str = "<no body>";

/// The field a rejected body (`Err`) adds.
const REJECTED_BODY: &str = "<rejected body>";

/// A body idem knows how to read for the fingerprint, whether or not its value is
/// `Serialize`: a [`FingerprintBody`], or an `Option` or `Result` of one.
pub trait KnownBody {}

impl<B: FingerprintBody> KnownBody for B {}

// Apart from the impl above as `FingerprintWhole`'s are.
impl<B: KnownBody> KnownBody for Option<B> {}

impl<B: KnownBody, E> KnownBody for Result<B, E> {}

/// First choice: a body that can be fingerprinted whole.
pub trait BodyLevel {
    /// The tag.
    fn __idem_param(&self) -> BodyParam {
        BodyParam
    }
}

impl<T: FingerprintWhole> BodyLevel for &&Probe<T> {}

/// Second choice: a body that cannot, as its value is not `Serialize`.
pub trait UnserializableBodyLevel {
    /// The tag.
    fn __idem_param(&self) -> UnserializableBodyParam {
        UnserializableBodyParam
    }
}

impl<T: KnownBody> UnserializableBodyLevel for &&&Probe<T> {}

/// Last choice: nothing to add. Either the parameter reads the request's head only, or
/// it reads the body and is no [`KnownBody`]: [`ExtractsLast`], checked with the router's
/// state, refuses the second.
pub trait OtherLevel {
    /// The tag.
    fn __idem_param(&self) -> OtherParam {
        OtherParam
    }
}

impl<T> OtherLevel for Probe<T> {}

/// Holds for the router's state `Self` when it extracts the last parameter `T` from the
/// request's head (`M` is [`ReadsHead`]), or from the body (`M` is [`ReadsBody`]) and
/// idem knows how to fingerprint it ([`KnownBody`]); checked when the endpoint names no
/// fields.
///
/// The probes above see the parameter's type only. Whether it reads the body depends on
/// the state too: an extractor written `impl FromRequest<AppState> for AppJson<T>`
/// reads it under `AppState` and is no extractor at all under any other state. So this
/// is a bound of the generated handler, which is generic over the state and over `M`,
/// the parameter of its [`LastExtract`](crate::web::extract::LastExtract) that rustc
/// infers with axum's own choice of impl. It is checked where the handler is routed
/// (`post(handler)`), once the state is known, or, under `#[axum::debug_handler]`, in the
/// handler with the state that names. Without it, a body extractor bound to one state
/// added nothing to the fingerprint, and a reused key with another payload replayed the
/// first answer. (The state is `Self` so that the bound waits for it: with the parameter's
/// type as `Self`, rustc would report a failure twice, once before the state is known.)
#[diagnostic::on_unimplemented(
    message = "`{T}` reads the request body, but idem cannot fingerprint it",
    label = "without `fields = [...]`, the whole body identifies the request",
    note = "implement `idem::extract::FingerprintBody` for `{T}`, whatever state its `FromRequest` is written for, so that idem fingerprints its value; or make it a `Json<T>`, `Form<T>`, `Query<T>`, `String` or `Bytes`"
)]
pub trait ExtractsLast<T, M> {}

impl<S, T: FromRequestParts<S>> ExtractsLast<T, ReadsHead> for S {}

// `FromRequest<S>` is `FromRequest<S, ViaRequest>`: what reads the body, never an
// extractor of the head (those are `FromRequest<S, ViaParts>`).
impl<S, T: FromRequest<S> + KnownBody> ExtractsLast<T, ReadsBody> for S {}

/// Asserts [`ExtractsLast`] with the state of a handler written for one (under
/// `#[axum::debug_handler]`, which checks no generic handler), read off its guard so
/// that a failure is reported on the call, which the macro spans on the parameter.
pub fn extracts_last<T, S: ExtractsLast<T, M>, M>(_: &crate::web::Guard<S>) {}

/// An extractor that reads the request's head only: `Path`, `Query`, `HeaderMap` ...
#[derive(Debug)]
pub struct PartsParam;

/// First choice for a parameter before the last: it reads the head only (a `Query` is a
/// [`FingerprintBody`] too, but reads no body).
pub trait PartsLevel {
    /// The tag.
    fn __idem_head(&self) -> PartsParam {
        PartsParam
    }
}

impl<T: FromRequestParts<()>> PartsLevel for &&Probe<T> {}

/// Second choice: it reads the body, state-independently.
pub trait ReadsBodyLevel {
    /// The tag.
    fn __idem_head(&self) -> UnfingerprintedBodyParam {
        UnfingerprintedBodyParam
    }
}

impl<T: FromRequest<()>> ReadsBodyLevel for &&&Probe<T> {}

/// Third choice: a body idem knows (`Signed<T>` needs the state, so the second misses it).
pub trait KnownBodyLevel {
    /// The tag.
    fn __idem_head(&self) -> BodyParam {
        BodyParam
    }
}

impl<T: FingerprintBody> KnownBodyLevel for &Probe<T> {}

/// Last choice: nothing says it reads the body.
pub trait OtherHeadLevel {
    /// The tag.
    fn __idem_head(&self) -> OtherParam {
        OtherParam
    }
}

impl<T> OtherHeadLevel for Probe<T> {}

/// Parameters before the last one must not read the body.
#[diagnostic::on_unimplemented(
    message = "the request body must be the handler's last parameter",
    label = "this parameter reads the request body",
    note = "axum reads the body once, after every other extractor: move this parameter to the end"
)]
pub trait BeforeTheBody {}

impl BeforeTheBody for PartsParam {}
impl BeforeTheBody for OtherParam {}

/// Asserts that a parameter other than the last does not read the body.
pub fn before_the_body<Tag: BeforeTheBody>(_: Tag) {}

/// Fingerprints the whole body, when an endpoint names no fields and its last
/// parameter is a body; a last parameter that reads the head only adds nothing (the
/// target, its method and path, identifies such a request).
#[diagnostic::on_unimplemented(
    message = "the body `{B}` cannot be fingerprinted whole: its value does not implement `serde::Serialize`",
    label = "without `fields = [...]`, the whole body identifies the request",
    note = "derive `serde::Serialize` for the body's type, or name the fields that identify the request with `fields = [...]`"
)]
pub trait WholeBody<B> {
    /// Adds the body, or nothing.
    fn add(self, fields: &mut Fields, body: &B);
}

impl<B: FingerprintWhole> WholeBody<B> for BodyParam {
    fn add(self, fields: &mut Fields, body: &B) {
        body.add_whole(fields);
    }
}

impl<B> WholeBody<B> for OtherParam {
    fn add(self, _: &mut Fields, _: &B) {}
}

/// Adds the last parameter as the whole body, as its tag says.
pub fn whole_body<B, Tag: WholeBody<B>>(fields: &mut Fields, body: &B, tag: Tag) {
    tag.add(fields, body);
}

/// A body whose bytes a signature covers, such as [`Signed<T>`](crate::webhook::Signed):
/// its idempotency key must come from the body itself (`key = field`). A key from a
/// header the signature does not cover would let whoever captured one delivery replay
/// it under fresh keys, each running the effect again.
pub trait SignedBody {
    /// The tag: the body's signature scheme.
    type Tag;
}

#[cfg(feature = "webhook")]
impl<T, S: crate::webhook::Scheme> SignedBody for crate::webhook::Signed<T, S> {
    type Tag = SignedTag<S>;
}

/// A signed body, of scheme `S`.
#[derive(Debug)]
pub struct SignedTag<S>(core::marker::PhantomData<S>);

/// Any other parameter.
#[derive(Debug)]
pub struct UnsignedTag;

/// First choice: a signed body.
pub trait SignedLevel {
    /// The tag.
    type Tag;
    /// The tag.
    fn __idem_signed(&self) -> Self::Tag;
}

impl<T: SignedBody> SignedLevel for &Probe<T>
where
    T::Tag: Default,
{
    type Tag = T::Tag;

    fn __idem_signed(&self) -> T::Tag {
        T::Tag::default()
    }
}

impl<S> Default for SignedTag<S> {
    fn default() -> Self {
        Self(core::marker::PhantomData)
    }
}

/// Whether a body's signature vouches for the request, from its probe's tag. A signed
/// delivery's identity (scope, principal, key) comes from what its signature covers and
/// from the endpoint's own code, never from the store's principal resolver, which reads
/// request data the signature does not cover (ARCHITECTURE.md, invariant 8).
pub trait Vouched {
    /// `true` for a signed body.
    const SIGNED: bool;
}

impl<S> Vouched for SignedTag<S> {
    const SIGNED: bool = true;
}

impl Vouched for UnsignedTag {
    const SIGNED: bool = false;
}

/// Whether the body probed into `tag` is signed ([`Vouched`]).
pub fn signed<Tag: Vouched>(_: Tag) -> bool {
    Tag::SIGNED
}

/// Otherwise.
pub trait UnsignedLevel {
    /// The tag.
    fn __idem_signed(&self) -> UnsignedTag {
        UnsignedTag
    }
}

impl<T> UnsignedLevel for Probe<T> {}

/// A key may come from header `H` (a hash of its name) when the body is not signed, or
/// when its scheme signs that header.
#[diagnostic::on_unimplemented(
    message = "a key from a header the signature does not cover lets a captured delivery run again: take the key from the signed body with `key = field`",
    label = "the body is signed, this header is not",
    note = "name the event's id in the signed body, such as `key = id` or `key = meta.event_id`"
)]
pub trait HeaderKey<const H: u64> {}

impl<const H: u64> HeaderKey<H> for UnsignedTag {}

#[cfg(feature = "webhook")]
impl<const H: u64, S: crate::webhook::SignsIdHeader<H>> HeaderKey<H> for SignedTag<S> {}

/// Asserts that `key = header(..)` keys a signed body only with a header its scheme
/// signs; `tag` comes from probing the last parameter, `H` is the header name's
/// [`header_hash`](crate::header_hash::header_hash).
pub fn header_key<const H: u64, Tag: HeaderKey<H>>(_: Tag) {}

/// Without `key = ..`, a request is keyed by its `Idempotency-Key` header, which no
/// signature scheme covers: a signed body must name a key its scheme signs.
#[diagnostic::on_unimplemented(
    message = "a signed body keyed by the `Idempotency-Key` header, which no signature covers: a captured delivery could run again under fresh keys",
    label = "this body is signed: key it by something its scheme signs",
    note = "take the key from the signed body (`key = id`, `key = meta.event_id`) or from its digest (`key = digest(body)`); Standard Webhooks also signs its id header (`key = header(\"webhook-id\")`, `svix-id` with `Svix`)"
)]
pub trait DefaultKey {}

impl DefaultKey for UnsignedTag {}

/// Asserts that a handler without `key = ..` has no signed body; `tag` comes from
/// probing the last parameter.
pub fn default_key<Tag: DefaultKey>(_: Tag) {}

/// Used, and so warned about, by every handler that takes no `Tx`: its writes through
/// a pool of its own (`State<PgPool>`) commit apart from the key, so a retry after a
/// failure repeats them. `#[allow(deprecated)]` on a handler that writes nothing (or
/// nothing it must not repeat) silences it.
#[deprecated(
    note = "this `#[idempotent]` handler takes no `Tx`: writes through a pool of its own (`State<PgPool>`) commit apart from the key, and a retry repeats them; take `mut tx: Tx` and write through it, or put `#[allow(deprecated)]` on a handler that writes nothing"
)]
pub const fn handler_without_tx() {}

/// What `__path_<handler>` names in the check of the attribute order with
/// `#[utoipa::path]` when the handler's module has no such item: no `#[utoipa::path]`
/// was expanded above `#[idempotent]`.
///
/// `#[utoipa::path]` leaves a `__path_<handler>` struct beside the function it
/// documents. An attribute cannot see the attributes above it, which have already
/// expanded; but a `#[idempotent]` that finds no `#[utoipa::path]` below itself can look
/// for that struct: a block inside the handler names `__path_<handler>` as this type,
/// and a glob import of the module in a block within it shadows that name with utoipa's
/// struct if there is one. [`UtoipaPathBelow`] then holds for this type only.
#[derive(Debug)]
pub struct NoUtoipaPathAbove;

/// Holds when no `#[utoipa::path]` was expanded above `#[idempotent]`, which would
/// document the handler without idem's key header and problem responses.
#[diagnostic::on_unimplemented(
    message = "`#[utoipa::path]` is written above `#[idempotent]`: the OpenAPI operation would lack idem's key header and problem responses",
    label = "move this attribute above `#[utoipa::path(...)]`",
    note = "attributes expand from the top: `#[idempotent]` completes the `#[utoipa::path]` written below it, while one above it has already expanded without idem's parts"
)]
pub trait UtoipaPathBelow {}

#[diagnostic::do_not_recommend]
impl UtoipaPathBelow for NoUtoipaPathAbove {}

/// Asserts that `Path`, what `__path_<handler>` names, is [`NoUtoipaPathAbove`].
pub fn utoipa_path_below<Path: UtoipaPathBelow>() {}
