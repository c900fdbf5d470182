//! Signed webhook deliveries, as real providers send them. The signature is checked
//! over the raw body before the JSON is parsed and before the key is claimed, so a
//! forged delivery never touches the idempotency table.
//!
//! | Scheme | Headers | Signed bytes | Secret | Key |
//! |---|---|---|---|---|
//! | [`StandardWebhooks`] (default) | `webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64> ...` | `{id}.{timestamp}.{body}` | `whsec_<base64>`, decoded | `key = header("webhook-id")` (signed) or a body field |
//! | [`Svix`] | the same with `svix-` | the same | the same | `key = header("svix-id")` or a body field |
//! | [`Stripe`] | `Stripe-Signature: t=..,v1=<hex>,...` | `{t}.{body}` | the whole `whsec_...` string | a body field, `key = id` |
//! | [`GitHub`] | `X-Hub-Signature-256: sha256=<hex>` | `{body}` | the raw secret | a body field or the body's digest: `X-GitHub-Delivery` is not signed |
//! | [`Custom`] | `t=..,v1=<hex>` under a header you name (default `X-Webhook-Signature`) | `{t}.{body}` | the raw secret | a body field |
//!
//! Each signature is an HMAC-SHA256, compared in constant time; a header carries at most
//! [`MAX_SIGNATURES`] of them (a sender rotating its secret signs with two), and a
//! [`Verifier`] may hold several secrets (a receiver rotating its own); one match is
//! enough. Schemes with a timestamp refuse one further than the tolerance (default 5
//! minutes) from the receiver's clock, which bounds replays of captured deliveries;
//! within it, idempotency takes care of duplicates. The headers are judged before the
//! body is read, and one MAC per secret is computed over the body.
//!
//! A key from a header is only safe when the signature covers that header: with
//! `key = header("webhook-id")` on a [`Signed`] body of a scheme that does not sign
//! `webhook-id`, the handler does not compile.
//!
//! ```
//! use axum::extract::FromRef;
//! use axum::{routing::post, Json, Router};
//! use idem::webhook::{GitHub, Signed, StandardWebhooks, Verifier};
//! use idem::{idempotent, Store, Tx};
//!
//! #[derive(Clone, FromRef)]
//! struct AppState {
//!     store: Store,
//!     payments: Verifier<StandardWebhooks>,
//!     github: Verifier<GitHub>,
//! }
//!
//! #[derive(serde::Deserialize, serde::Serialize)]
//! struct Event {
//!     r#type: String,
//! }
//!
//! // Standard Webhooks signs `webhook-id`: the provider's id is the key.
//! #[idempotent(scope = "payments", ttl = "7d", key = header("webhook-id"))]
//! async fn payment(_tx: Tx, Signed(event, ..): Signed<Event>) -> Json<String> {
//!     Json(event.r#type)
//! }
//!
//! #[derive(serde::Deserialize, serde::Serialize)]
//! struct Push {
//!     after: String,
//! }
//!
//! // GitHub signs only the body: the key comes from it.
//! #[idempotent(scope = "pushes", ttl = "7d", key = after)]
//! async fn push(_tx: Tx, Signed(push, ..): Signed<Push, GitHub>) -> Json<String> {
//!     Json(push.after)
//! }
//!
//! fn app(store: Store) -> Result<Router, idem::webhook::WebhookSecretError> {
//!     let state = AppState {
//!         store,
//!         payments: Verifier::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?,
//!         github: Verifier::new("a GitHub secret, 16 bytes or more")?,
//!     };
//!     Ok(Router::new()
//!         .route("/webhooks/payments", post(payment))
//!         .route("/webhooks/github", post(push))
//!         .with_state(state))
//! }
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{FromRef, FromRequest, Request};
use axum::response::{IntoResponse, Response};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::digest::CtOutput;
use hmac::{Hmac, Mac};
use http::header::HeaderName;
use http::{HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use sha2::Sha256;

use crate::extract::FingerprintBody;
use crate::web::problem::{problem_type, Problem, Problems};
use crate::Store;

mod custom;
mod github;
mod shopify;
mod slack;
mod standard;
mod stripe;

pub use custom::Custom;
pub use github::{parse_github, GitHub};
pub use shopify::Shopify;
pub use slack::Slack;
pub use standard::{StandardWebhooks, Svix};
pub use stripe::{parse_timestamped_hex, Stripe};

/// The most signatures one header may carry. A sender rotating its secret signs with
/// two; eight leaves room, and bounds what an unsigned request can make the receiver
/// check.
pub const MAX_SIGNATURES: usize = 8;

/// The shortest secret a [`Verifier`] accepts, in bytes (after decoding, for the
/// schemes whose secrets are encoded).
///
/// 16 bytes are 128 bits when the secret is random, the usual floor for a symmetric
/// key. It refuses the mistakes that matter (an empty `WEBHOOK_SECRET=`, which would
/// verify deliveries signed with the empty key, or a word typed by hand) and accepts the
/// secrets providers issue, which are longer. A length cannot measure entropy: use a
/// random secret.
pub const MIN_SECRET_LEN: usize = 16;

/// The longest message id or timestamp a header may carry, in bytes: Standard Webhooks
/// ids are short (`msg_` and 27 characters); this bounds what goes into the MAC.
pub const MAX_ID_LEN: usize = 256;

mod sealed {
    pub trait Sealed {}
}

/// What the headers alone established: the bytes the MAC covers before the body, and
/// the signatures to compare with.
#[derive(Debug)]
#[doc(hidden)]
pub struct Candidates {
    prefix: Vec<u8>,
    signatures: Vec<[u8; 32]>,
}

/// A provider's signature scheme: which headers carry what, and which bytes are
/// signed. Implemented by [`StandardWebhooks`], [`Svix`], [`Stripe`], [`GitHub`],
/// [`Slack`], [`Shopify`] and [`Custom`].
pub trait Scheme: sealed::Sealed + Send + Sync + 'static {
    /// The scheme's name, for logs and errors.
    const NAME: &'static str;
    /// The header the signature is read from, unless [`Verifier::header`] names another.
    const SIGNATURE_HEADER: &'static str;
    /// The secret as the HMAC key.
    #[doc(hidden)]
    fn key(secret: Vec<u8>) -> Result<Vec<u8>, WebhookSecretError> {
        checked(secret)
    }
    /// Everything that can be judged without the body.
    #[doc(hidden)]
    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<Candidates, SignatureError>;
    /// The signature header's value that signs `body` with `key` (for tests and senders).
    #[doc(hidden)]
    fn sign(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> Vec<(HeaderName, String)>;
}

/// Implemented by the schemes whose signature covers an id header, named by `H`, a hash
/// of the lowercased header name that `#[idempotent(key = header(..))]` computes: only
/// such a header may key a [`Signed`] body.
#[diagnostic::on_unimplemented(
    message = "the key header is not covered by the `{Self}` signature: a captured delivery could be replayed under fresh keys",
    label = "this scheme does not sign that header",
    note = "take the key from the signed body (`key = id`); only Standard Webhooks signs its id header (`key = header(\"webhook-id\")`, or `svix-id` with `Svix`)"
)]
pub trait SignsIdHeader<const H: u64> {}

/// The candidates of a scheme that signs the body alone, under one header that `parse`
/// reads (GitHub, Shopify).
fn body_only(
    headers: &HeaderMap,
    signature: &HeaderName,
    parse: fn(&[u8]) -> Result<[u8; 32], SignatureError>,
) -> Result<Candidates, SignatureError> {
    let value = headers.get(signature).ok_or(SignatureError::Missing)?;
    Ok(Candidates {
        prefix: Vec::new(),
        signatures: vec![parse(value.as_bytes())?],
    })
}

/// The HMAC-SHA256 of what a scheme signs: `prefix` (what it signs before the body,
/// as [`Candidates`] keeps it for checking; empty for a body alone), then the body.
fn signed_mac(key: &[u8], prefix: &[u8], body: &[u8]) -> [u8; 32] {
    let mut mac = hmac(key);
    mac.update(prefix);
    mac.update(body);
    mac.finalize().into_bytes().into()
}

/// Checks the signatures of one scheme's deliveries. Put it in the router's state,
/// reachable with [`FromRef`], for [`Signed`] to find; a state may hold one per scheme.
pub struct Verifier<S: Scheme = StandardWebhooks> {
    inner: Arc<Settings>,
    scheme: PhantomData<fn() -> S>,
}

/// The verifier of [`Custom`] deliveries, under its earlier name.
pub type WebhookVerifier = Verifier<Custom>;

#[derive(Clone)]
struct Settings {
    keys: Vec<Vec<u8>>,
    header: HeaderName,
    tolerance: Duration,
}

impl<S: Scheme> Clone for Verifier<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            scheme: PhantomData,
        }
    }
}

impl<S: Scheme> Verifier<S> {
    /// A verifier with one secret, in the form the scheme's provider issues it (for
    /// Standard Webhooks `whsec_<base64>`, decoded; for Stripe the whole `whsec_...`
    /// string; otherwise the raw bytes), the scheme's header and a 5-minute tolerance.
    ///
    /// A secret shorter than [`MIN_SECRET_LEN`] bytes is refused: an empty one would
    /// verify deliveries signed with the empty key.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, WebhookSecretError> {
        Ok(Self {
            inner: Arc::new(Settings {
                keys: vec![S::key(secret.into())?],
                header: HeaderName::from_static(S::SIGNATURE_HEADER),
                tolerance: Duration::from_secs(300),
            }),
            scheme: PhantomData,
        })
    }

    /// Accepts signatures made with another secret too (while rotating secrets); the
    /// same rules as [`Verifier::new`].
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Result<Self, WebhookSecretError> {
        let key = S::key(secret.into())?;
        Arc::make_mut(&mut self.inner).keys.push(key);
        Ok(self)
    }

    /// Reads the signature from another header (for [`Custom`] senders).
    #[must_use]
    pub fn header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.inner).header = name;
        self
    }

    /// How far a delivery's timestamp may be from now, either way (default 5 minutes).
    #[must_use]
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        Arc::make_mut(&mut self.inner).tolerance = tolerance;
        self
    }

    /// The header the signature is read from.
    pub fn header_name(&self) -> &HeaderName {
        &self.inner.header
    }

    /// The headers that sign `body` as delivery `id` at `timestamp` with the first
    /// secret, as the provider would send them: for tests and for services that send
    /// webhooks themselves. Schemes without an id or a timestamp ignore them.
    pub fn sign(&self, id: &str, timestamp: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        let mut headers = S::sign(&self.inner.keys[0], id, timestamp, body);
        if let Some(last) = headers.last_mut() {
            last.0 = self.inner.header.clone();
        }
        headers
    }

    /// Checks a delivery's headers against its raw body, at `now`.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: SystemTime,
    ) -> Result<(), SignatureError> {
        let candidates = self.candidates(headers, now)?;
        self.check(&candidates, body)
    }

    /// Everything that can be judged without the body. [`Signed`] calls it before it
    /// reads the body, so a hostile header costs neither the read nor a MAC.
    #[doc(hidden)]
    pub fn candidates(
        &self,
        headers: &HeaderMap,
        now: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        S::candidates(headers, &self.inner.header, self.inner.tolerance, now)
    }

    /// One MAC over the body per secret, compared in constant time with each candidate.
    fn check(&self, candidates: &Candidates, body: &[u8]) -> Result<(), SignatureError> {
        for key in &self.inner.keys {
            let expected: CtOutput<Hmac<Sha256>> =
                CtOutput::new(signed_mac(key, &candidates.prefix, body).into());
            // `CtOutput`'s `==` compares in constant time.
            if candidates
                .signatures
                .iter()
                .any(|signature| expected == CtOutput::new((*signature).into()))
            {
                return Ok(());
            }
        }
        Err(SignatureError::Mismatch)
    }
}

impl<S: Scheme> fmt::Debug for Verifier<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("scheme", &S::NAME)
            .field("secrets", &self.inner.keys.len())
            .field("header", &self.inner.header)
            .field("tolerance", &self.inner.tolerance)
            .finish()
    }
}

fn checked(secret: Vec<u8>) -> Result<Vec<u8>, WebhookSecretError> {
    if secret.len() < MIN_SECRET_LEN {
        return Err(WebhookSecretError::TooShort { len: secret.len() });
    }
    Ok(secret)
}

fn hmac(key: &[u8]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length")
}

fn fresh(timestamp: u64, tolerance: Duration, now: SystemTime) -> Result<(), SignatureError> {
    let now = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if now.abs_diff(timestamp) > tolerance.as_secs() {
        return Err(SignatureError::Stale { timestamp, now });
    }
    Ok(())
}

/// Unix seconds: ASCII digits only (no sign, no spaces).
fn decode_seconds(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A SHA-256 MAC in base64: exactly 44 characters that decode to 32 bytes.
fn decode_sha256_base64(text: &str) -> Option<[u8; 32]> {
    if text.len() != 44 {
        return None;
    }
    BASE64.decode(text).ok()?.try_into().ok()
}

/// A SHA-256 MAC in hex: exactly 64 hex digits, either case.
fn decode_sha256_hex(text: &str) -> Option<[u8; 32]> {
    crate::fingerprint::unhex(text)?.try_into().ok()
}

/// Why a secret was refused by [`Verifier::new`] or [`Verifier::with_secret`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WebhookSecretError {
    /// Shorter than [`MIN_SECRET_LEN`] bytes (an empty secret included).
    TooShort {
        /// The secret's length in bytes.
        len: usize,
    },
    /// A Standard Webhooks secret that is not `whsec_<base64>`.
    NotBase64,
}

impl fmt::Display for WebhookSecretError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort { len: 0 } => write!(
                f,
                "the webhook secret is empty; it must be at least {MIN_SECRET_LEN} bytes"
            ),
            Self::TooShort { len } => write!(
                f,
                "the webhook secret is {len} bytes long; it must be at least {MIN_SECRET_LEN} bytes"
            ),
            Self::NotBase64 => f.write_str(
                "the webhook secret is not of the form whsec_<base64> (a Standard Webhooks secret)",
            ),
        }
    }
}

impl std::error::Error for WebhookSecretError {}

/// Why a delivery's signature was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureError {
    /// A header of the scheme is missing.
    Missing,
    /// A header is not of the scheme's form, or carries no or more than
    /// [`MAX_SIGNATURES`] signatures.
    Malformed,
    /// The timestamp is outside the tolerance.
    Stale {
        /// The delivery's timestamp.
        timestamp: u64,
        /// The receiver's clock.
        now: u64,
    },
    /// No signature matches any secret.
    Mismatch,
}

impl fmt::Display for SignatureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => f.write_str("the delivery lacks a header of its signature scheme"),
            Self::Malformed => write!(
                f,
                "a signature header is not of its scheme's form, or carries none or more than \
                 {MAX_SIGNATURES} signatures"
            ),
            Self::Stale { timestamp, now } => write!(
                f,
                "the signature's timestamp {timestamp} is too far from the receiver's clock ({now})"
            ),
            Self::Mismatch => f.write_str("no signature matches"),
        }
    }
}

impl std::error::Error for SignatureError {}

impl SignatureError {
    /// The refusal as the delivery's sender sees it: 401 when no secret matches, 400
    /// when a header is missing, malformed or stale.
    fn problem(&self, problems: Problems<'_>) -> Problem {
        let (status, slug, title) = match self {
            Self::Mismatch => (
                StatusCode::UNAUTHORIZED,
                "invalid-signature",
                "Invalid signature",
            ),
            Self::Stale { .. } => (
                StatusCode::BAD_REQUEST,
                "stale-signature",
                "Stale signature",
            ),
            Self::Missing | Self::Malformed => (
                StatusCode::BAD_REQUEST,
                "malformed-signature",
                "Malformed signature",
            ),
        };
        problems
            .problem(status, slug, title)
            .with_detail(self.to_string())
    }
}

/// A signed JSON body, verified with the state's [`Verifier<S>`] (by default Standard
/// Webhooks): the signature is checked over the raw bytes first, then the JSON is
/// parsed. Use it as the last parameter of a webhook handler.
///
/// A missing or malformed signature header, or a stale timestamp, answers 400 before
/// the body is read; a signature that matches no secret answers 401; both as
/// problem+json, and nothing is claimed or stored.
///
/// Take it apart with `Signed(event, ..)`.
pub struct Signed<T, S: Scheme = StandardWebhooks>(pub T, pub PhantomData<fn() -> S>);

impl<T, S: Scheme> Signed<T, S> {
    /// The verified value.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T: fmt::Debug, S: Scheme> fmt::Debug for Signed<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Signed")
            .field(&S::NAME)
            .field(&self.0)
            .finish()
    }
}

impl<St, T, S> FromRequest<St> for Signed<T, S>
where
    T: DeserializeOwned,
    S: Scheme,
    Verifier<S>: FromRef<St>,
    Store: FromRef<St>,
    St: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &St) -> Result<Self, Response> {
        let verifier = Verifier::<S>::from_ref(state);
        let store = Store::from_ref(state);
        let problems = Problems::of(&store);
        let refuse = |error: SignatureError| {
            tracing::warn!(%error, scheme = S::NAME, "idem: webhook delivery refused");
            error.problem(problems).into_response()
        };
        // The headers first: a delivery that cannot verify is refused before its body
        // is read or any MAC is computed.
        let candidates = verifier
            .candidates(req.headers(), SystemTime::now())
            .map_err(refuse)?;
        let body = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        verifier.check(&candidates, &body).map_err(refuse)?;
        serde_json::from_slice(&body)
            .map(|value| Self(value, PhantomData))
            .map_err(|error| {
                problems
                    .problem(
                        StatusCode::BAD_REQUEST,
                        problem_type::INVALID_REQUEST,
                        "Invalid request",
                    )
                    .with_detail(format!("the delivery's JSON body is invalid: {error}"))
                    .into_response()
            })
    }
}

impl<T, S: Scheme> FingerprintBody for Signed<T, S> {
    type Value = T;

    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const SECRET: &str = "whsec_0123456789abcdef";
    /// 24 random bytes, as `standardwebhooks` issues them.
    pub(super) const STANDARD: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    pub(super) fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    pub(super) fn custom(secret: &str) -> Verifier<Custom> {
        Verifier::new(secret).unwrap()
    }

    pub(super) fn headers(pairs: &[(HeaderName, String)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| (name.clone(), value.parse().unwrap()))
            .collect()
    }

    /// The one signature header of a custom delivery.
    pub(super) fn custom_header(value: &str) -> HeaderMap {
        headers(&[(HeaderName::from_static("x-webhook-signature"), value.into())])
    }

    pub(super) fn signed(v: &Verifier<Custom>, t: u64, body: &[u8]) -> String {
        v.sign("", t, body).remove(0).1
    }

    /// The `v1` value of a signed header.
    pub(super) fn v1(header: &str) -> &str {
        header.split_once(",v1=").unwrap().1
    }

    #[test]
    fn the_header_is_judged_without_the_body() {
        let v = custom(SECRET);
        let flood = format!("t=1000{}", ",v1=".repeat(5_000));
        assert_eq!(
            v.candidates(&custom_header(&flood), at(1_000)).unwrap_err(),
            SignatureError::Malformed
        );
        let good = signed(&v, 1_000, b"{}");
        let candidates = v.candidates(&custom_header(&good), at(1_000)).unwrap();
        assert_eq!(candidates.signatures.len(), 1);
        assert_eq!(v.check(&candidates, b"{}"), Ok(()));
        assert_eq!(v.check(&candidates, b"[]"), Err(SignatureError::Mismatch));
        // A Standard Webhooks id longer than the cap is refused before any MAC.
        let s = Verifier::<StandardWebhooks>::new(STANDARD).unwrap();
        let long = s.sign(&"x".repeat(MAX_ID_LEN + 1), 1_000, b"{}");
        assert_eq!(
            s.candidates(&headers(&long), at(1_000)).unwrap_err(),
            SignatureError::Malformed
        );
    }

    /// Pins the empty-key bug: `WEBHOOK_SECRET=` verified deliveries signed with the
    /// empty key.
    #[test]
    fn short_secrets_are_refused() {
        assert_eq!(
            WebhookVerifier::new("").unwrap_err(),
            WebhookSecretError::TooShort { len: 0 }
        );
        assert_eq!(
            WebhookVerifier::new(vec![b'x'; MIN_SECRET_LEN - 1]).unwrap_err(),
            WebhookSecretError::TooShort { len: 15 }
        );
        assert!(WebhookVerifier::new(vec![b'x'; MIN_SECRET_LEN]).is_ok());
        assert_eq!(
            custom(SECRET).with_secret("old").unwrap_err(),
            WebhookSecretError::TooShort { len: 3 }
        );
        assert_eq!(
            WebhookSecretError::TooShort { len: 0 }.to_string(),
            "the webhook secret is empty; it must be at least 16 bytes"
        );
    }

    #[test]
    fn rotation_on_both_sides() {
        let body = b"{}";
        let old = custom("whsec_old_0123456789");
        let new = custom("whsec_new_0123456789");
        // The sender signs with both secrets during its rotation.
        let both = format!(
            "{},v1={}",
            signed(&old, 10, body),
            v1(&signed(&new, 10, body))
        );
        assert_eq!(new.verify(&custom_header(&both), body, at(10)), Ok(()));
        assert_eq!(old.verify(&custom_header(&both), body, at(10)), Ok(()));
        // The receiver accepts both secrets during its rotation.
        let receiver = custom("whsec_new_0123456789")
            .with_secret("whsec_old_0123456789")
            .unwrap();
        for header in [signed(&old, 10, body), signed(&new, 10, body), both] {
            assert_eq!(
                receiver.verify(&custom_header(&header), body, at(10)),
                Ok(())
            );
        }
        // Unknown scheme versions are ignored, not fatal.
        let with_v0 = format!("{},v0=abcd", signed(&new, 10, body));
        assert_eq!(new.verify(&custom_header(&with_v0), body, at(10)), Ok(()));
    }
}
