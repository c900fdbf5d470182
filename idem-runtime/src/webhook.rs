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
use http::HeaderMap;
use serde::de::DeserializeOwned;
use sha2::Sha256;

use crate::fingerprint::hex;
use crate::web::problem::Problems;
use crate::{FingerprintBody, Store};

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

/// [Standard Webhooks](https://www.standardwebhooks.com/) v1, the default: `webhook-id`,
/// `webhook-timestamp` and `webhook-signature` (space-separated `v1,<base64>`), an
/// HMAC-SHA256 over `{id}.{timestamp}.{body}` under the decoded `whsec_<base64>` secret.
/// The id is signed: `key = header("webhook-id")` is allowed.
#[derive(Debug, Clone, Copy)]
pub struct StandardWebhooks;

/// Standard Webhooks with Svix's header spelling: `svix-id`, `svix-timestamp`,
/// `svix-signature`. `key = header("svix-id")` is allowed.
#[derive(Debug, Clone, Copy)]
pub struct Svix;

/// Stripe: `Stripe-Signature: t=<seconds>,v1=<hex>[,v1=...]`, an HMAC-SHA256 over
/// `{t}.{body}` whose key is the whole `whsec_...` string. Stripe signs no id header:
/// the key comes from the body (`key = id`).
#[derive(Debug, Clone, Copy)]
pub struct Stripe;

/// GitHub: `X-Hub-Signature-256: sha256=<hex>`, an HMAC-SHA256 over the body. There is
/// no timestamp, and `X-GitHub-Delivery` is not signed: the key must come from the
/// body (a field, or the body's digest), and a captured delivery verifies forever.
#[derive(Debug, Clone, Copy)]
pub struct GitHub;

/// Slack: `X-Slack-Signature: v0=<hex>`, an HMAC-SHA256 over `v0:{timestamp}:{body}`
/// with `X-Slack-Request-Timestamp`, under the app's signing secret as it is. Slack signs
/// no id: an Events API delivery is keyed by its `event_id` (`key = event_id`).
#[derive(Debug, Clone, Copy)]
pub struct Slack;

/// Shopify: `X-Shopify-Hmac-SHA256: <base64>`, an HMAC-SHA256 over the body under the
/// app's client secret as it is. There is no timestamp, and `X-Shopify-Webhook-Id` is
/// not signed: key by the body (`key = digest(body)`, or a field).
#[derive(Debug, Clone, Copy)]
pub struct Shopify;

/// Stripe's format, `t=<seconds>,v1=<hex>[,v1=...]` over `{t}.{body}` with the raw
/// secret as the key, under a header you name with [`Verifier::header`] (default
/// `X-Webhook-Signature`): for senders of your own.
#[derive(Debug, Clone, Copy)]
pub struct Custom;

impl sealed::Sealed for StandardWebhooks {}
impl sealed::Sealed for Svix {}
impl sealed::Sealed for Stripe {}
impl sealed::Sealed for GitHub {}
impl sealed::Sealed for Slack {}
impl sealed::Sealed for Shopify {}
impl sealed::Sealed for Custom {}

impl SignsIdHeader<{ crate::probe::header_hash("webhook-id") }> for StandardWebhooks {}
impl SignsIdHeader<{ crate::probe::header_hash("svix-id") }> for Svix {}

/// The three headers of a Standard Webhooks spelling: `webhook-*` or `svix-*`.
struct Spelling {
    id: &'static str,
    timestamp: &'static str,
    signature: &'static str,
}

const WEBHOOK: Spelling = Spelling {
    id: "webhook-id",
    timestamp: "webhook-timestamp",
    signature: "webhook-signature",
};

const SVIX: Spelling = Spelling {
    id: "svix-id",
    timestamp: "svix-timestamp",
    signature: "svix-signature",
};

/// A Standard Webhooks delivery's headers, in `spelling`.
fn standard_headers(
    spelling: &Spelling,
    key: &[u8],
    id: &str,
    timestamp: u64,
    body: &[u8],
) -> Vec<(HeaderName, String)> {
    vec![
        (HeaderName::from_static(spelling.id), id.to_owned()),
        (
            HeaderName::from_static(spelling.timestamp),
            timestamp.to_string(),
        ),
        (
            HeaderName::from_static(spelling.signature),
            standard_sign(key, id, timestamp, body),
        ),
    ]
}

fn standard_candidates(
    spelling: &Spelling,
    headers: &HeaderMap,
    signature: &HeaderName,
    tolerance: Duration,
    now: SystemTime,
) -> Result<Candidates, SignatureError> {
    let text = |name: &str| -> Result<&str, SignatureError> {
        let value = headers.get(name).ok_or(SignatureError::Missing)?;
        if value.len() > MAX_ID_LEN {
            return Err(SignatureError::Malformed);
        }
        value.to_str().map_err(|_| SignatureError::Malformed)
    };
    let value = headers.get(signature).ok_or(SignatureError::Missing)?;
    let id = text(spelling.id)?;
    if id.is_empty() {
        return Err(SignatureError::Malformed);
    }
    let timestamp = decode_seconds(text(spelling.timestamp)?).ok_or(SignatureError::Malformed)?;
    fresh(timestamp, tolerance, now)?;
    let value = std::str::from_utf8(value.as_bytes()).map_err(|_| SignatureError::Malformed)?;
    let mut signatures = Vec::new();
    for part in value.split(' ').filter(|p| !p.is_empty()) {
        let (version, sig) = part.split_once(',').ok_or(SignatureError::Malformed)?;
        if signatures.len() == MAX_SIGNATURES {
            return Err(SignatureError::Malformed);
        }
        // Other versions (`v1a`, asymmetric) are not ours to judge, but count.
        if version == "v1" {
            signatures.push(decode_sha256_base64(sig).ok_or(SignatureError::Malformed)?);
        }
    }
    if signatures.is_empty() {
        return Err(SignatureError::Malformed);
    }
    Ok(Candidates {
        prefix: format!("{id}.{timestamp}.").into_bytes(),
        signatures,
    })
}

/// A `whsec_<base64>` secret, decoded.
fn standard_key(secret: Vec<u8>) -> Result<Vec<u8>, WebhookSecretError> {
    let encoded = secret.strip_prefix(b"whsec_").unwrap_or(&secret);
    let key = BASE64
        .decode(encoded)
        .map_err(|_| WebhookSecretError::NotBase64)?;
    checked(key)
}

fn standard_sign(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let mac = signed_mac(key, format!("{id}.{timestamp}.").as_bytes(), body);
    format!("v1,{}", BASE64.encode(mac))
}

impl Scheme for StandardWebhooks {
    const NAME: &'static str = "Standard Webhooks";
    const SIGNATURE_HEADER: &'static str = WEBHOOK.signature;

    fn key(secret: Vec<u8>) -> Result<Vec<u8>, WebhookSecretError> {
        standard_key(secret)
    }

    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        standard_candidates(&WEBHOOK, headers, signature, tolerance, now)
    }

    fn sign(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        standard_headers(&WEBHOOK, key, id, timestamp, body)
    }
}

impl Scheme for Svix {
    const NAME: &'static str = "Svix";
    const SIGNATURE_HEADER: &'static str = SVIX.signature;

    fn key(secret: Vec<u8>) -> Result<Vec<u8>, WebhookSecretError> {
        standard_key(secret)
    }

    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        standard_candidates(&SVIX, headers, signature, tolerance, now)
    }

    fn sign(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        standard_headers(&SVIX, key, id, timestamp, body)
    }
}

/// Parses `t=<seconds>,v1=<hex>[,v1=<hex>...]` (Stripe's format) and checks the
/// timestamp.
pub fn parse_timestamped_hex(
    header: &[u8],
    tolerance: Duration,
    now: SystemTime,
) -> Result<(u64, Vec<[u8; 32]>), SignatureError> {
    let header = std::str::from_utf8(header).map_err(|_| SignatureError::Malformed)?;
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", t)) => {
                let t = decode_seconds(t).ok_or(SignatureError::Malformed)?;
                if timestamp.replace(t).is_some() {
                    return Err(SignatureError::Malformed);
                }
            }
            Some(("v1", sig)) => {
                if signatures.len() == MAX_SIGNATURES {
                    return Err(SignatureError::Malformed);
                }
                signatures.push(decode_sha256_hex(sig).ok_or(SignatureError::Malformed)?);
            }
            // Other schemes (v0, v2 ...) are not ours to judge.
            Some(_) => {}
            None => return Err(SignatureError::Malformed),
        }
    }
    let timestamp = timestamp.ok_or(SignatureError::Malformed)?;
    if signatures.is_empty() {
        return Err(SignatureError::Malformed);
    }
    fresh(timestamp, tolerance, now)?;
    Ok((timestamp, signatures))
}

fn timestamped_hex_candidates(
    headers: &HeaderMap,
    signature: &HeaderName,
    tolerance: Duration,
    now: SystemTime,
) -> Result<Candidates, SignatureError> {
    let value = headers.get(signature).ok_or(SignatureError::Missing)?;
    let (timestamp, signatures) = parse_timestamped_hex(value.as_bytes(), tolerance, now)?;
    Ok(Candidates {
        prefix: format!("{timestamp}.").into_bytes(),
        signatures,
    })
}

fn timestamped_hex_sign(
    header: &str,
    key: &[u8],
    timestamp: u64,
    body: &[u8],
) -> (HeaderName, String) {
    let mac = signed_mac(key, format!("{timestamp}.").as_bytes(), body);
    (
        HeaderName::from_bytes(header.as_bytes()).expect("a scheme's header name is valid"),
        format!("t={timestamp},v1={}", hex(&mac)),
    )
}

impl Scheme for Stripe {
    const NAME: &'static str = "Stripe";
    const SIGNATURE_HEADER: &'static str = "stripe-signature";

    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        timestamped_hex_candidates(headers, signature, tolerance, now)
    }

    fn sign(key: &[u8], _: &str, timestamp: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        vec![timestamped_hex_sign(
            Self::SIGNATURE_HEADER,
            key,
            timestamp,
            body,
        )]
    }
}

impl Scheme for Custom {
    const NAME: &'static str = "custom t=,v1=";
    const SIGNATURE_HEADER: &'static str = "x-webhook-signature";

    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        timestamped_hex_candidates(headers, signature, tolerance, now)
    }

    fn sign(key: &[u8], _: &str, timestamp: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        vec![timestamped_hex_sign(
            Self::SIGNATURE_HEADER,
            key,
            timestamp,
            body,
        )]
    }
}

/// Parses GitHub's `sha256=<64 hex digits>`.
pub fn parse_github(header: &[u8]) -> Result<[u8; 32], SignatureError> {
    let header = std::str::from_utf8(header).map_err(|_| SignatureError::Malformed)?;
    header
        .strip_prefix("sha256=")
        .and_then(decode_sha256_hex)
        .ok_or(SignatureError::Malformed)
}

impl Scheme for GitHub {
    const NAME: &'static str = "GitHub";
    const SIGNATURE_HEADER: &'static str = "x-hub-signature-256";

    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        _: Duration,
        _: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        body_only(headers, signature, parse_github)
    }

    fn sign(key: &[u8], _: &str, _: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        vec![(
            HeaderName::from_static(Self::SIGNATURE_HEADER),
            format!("sha256={}", hex(&signed_mac(key, &[], body))),
        )]
    }
}

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

impl Scheme for Slack {
    const NAME: &'static str = "Slack";
    const SIGNATURE_HEADER: &'static str = "x-slack-signature";

    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        let value = headers.get(signature).ok_or(SignatureError::Missing)?;
        let timestamp = headers
            .get("x-slack-request-timestamp")
            .ok_or(SignatureError::Missing)?
            .to_str()
            .ok()
            .and_then(decode_seconds)
            .ok_or(SignatureError::Malformed)?;
        let signature = std::str::from_utf8(value.as_bytes())
            .ok()
            .and_then(|v| v.strip_prefix("v0="))
            .and_then(decode_sha256_hex)
            .ok_or(SignatureError::Malformed)?;
        fresh(timestamp, tolerance, now)?;
        Ok(Candidates {
            prefix: format!("v0:{timestamp}:").into_bytes(),
            signatures: vec![signature],
        })
    }

    fn sign(key: &[u8], _: &str, timestamp: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        let mac = signed_mac(key, format!("v0:{timestamp}:").as_bytes(), body);
        vec![
            (
                HeaderName::from_static("x-slack-request-timestamp"),
                timestamp.to_string(),
            ),
            (
                HeaderName::from_static(Self::SIGNATURE_HEADER),
                format!("v0={}", hex(&mac)),
            ),
        ]
    }
}

impl Scheme for Shopify {
    const NAME: &'static str = "Shopify";
    const SIGNATURE_HEADER: &'static str = "x-shopify-hmac-sha256";

    fn candidates(
        headers: &HeaderMap,
        signature: &HeaderName,
        _: Duration,
        _: SystemTime,
    ) -> Result<Candidates, SignatureError> {
        body_only(headers, signature, |value| {
            std::str::from_utf8(value)
                .ok()
                .and_then(decode_sha256_base64)
                .ok_or(SignatureError::Malformed)
        })
    }

    fn sign(key: &[u8], _: &str, _: u64, body: &[u8]) -> Vec<(HeaderName, String)> {
        vec![(
            HeaderName::from_static(Self::SIGNATURE_HEADER),
            BASE64.encode(signed_mac(key, &[], body)),
        )]
    }
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
    let text = text.as_bytes();
    if text.len() != 64 {
        return None;
    }
    let digit = |c: u8| {
        char::from(c)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let mut bytes = [0; 32];
    for (byte, pair) in bytes.iter_mut().zip(text.chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(bytes)
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
            problems.signature(&error).into_response()
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
                    .invalid_request(format!("the delivery's JSON body is invalid: {error}"))
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

    const SECRET: &str = "whsec_0123456789abcdef";
    /// 24 random bytes, as `standardwebhooks` issues them.
    const STANDARD: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn custom(secret: &str) -> Verifier<Custom> {
        Verifier::new(secret).unwrap()
    }

    fn headers(pairs: &[(HeaderName, String)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| (name.clone(), value.parse().unwrap()))
            .collect()
    }

    /// The one signature header of a custom delivery.
    fn custom_header(value: &str) -> HeaderMap {
        headers(&[(HeaderName::from_static("x-webhook-signature"), value.into())])
    }

    fn signed(v: &Verifier<Custom>, t: u64, body: &[u8]) -> String {
        v.sign("", t, body).remove(0).1
    }

    /// The `v1` value of a signed header.
    fn v1(header: &str) -> &str {
        header.split_once(",v1=").unwrap().1
    }

    /// The example of the Standard Webhooks specification's reference test
    /// (`standardwebhooks` python tests): secret, id, timestamp, body and signature.
    #[test]
    fn standard_webhooks_reference_vector() {
        let v = Verifier::<StandardWebhooks>::new(STANDARD).unwrap();
        let body = br#"{"test": 2432232314}"#;
        let sent = v.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1_614_265_330, body);
        assert_eq!(sent[2].1, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        let h = headers(&sent);
        assert_eq!(v.verify(&h, body, at(1_614_265_330)), Ok(()));
        assert_eq!(
            v.verify(&h, br#"{"test": 2432232315}"#, at(1_614_265_330)),
            Err(SignatureError::Mismatch)
        );
        // Another id under the same signature: refused, the id is signed.
        let mut other = h.clone();
        other.insert("webhook-id", "msg_other".parse().unwrap());
        assert_eq!(
            v.verify(&other, body, at(1_614_265_330)),
            Err(SignatureError::Mismatch)
        );
        assert!(matches!(
            v.verify(&h, body, at(1_614_265_330 + 301)),
            Err(SignatureError::Stale { .. })
        ));
        // Several signatures, the good one among unknown versions and other keys.
        let mut many = h.clone();
        many.insert(
            "webhook-signature",
            format!("v1a,abc v1,{} {}", "A".repeat(43) + "=", sent[2].1)
                .parse()
                .unwrap(),
        );
        assert_eq!(v.verify(&many, body, at(1_614_265_330)), Ok(()));
        for bad in ["", "v1", "v1,", "v1,abc", "nocomma", &"v1,x ".repeat(9)] {
            let mut h = h.clone();
            h.insert("webhook-signature", bad.parse().unwrap());
            assert_eq!(
                v.verify(&h, body, at(1_614_265_330)),
                Err(SignatureError::Malformed),
                "{bad:?}"
            );
        }
        let mut no_id = h.clone();
        no_id.remove("webhook-id");
        assert_eq!(
            v.verify(&no_id, body, at(1_614_265_330)),
            Err(SignatureError::Missing)
        );
        // The svix spelling is its own scheme, the webhook- headers do not verify it.
        let svix = Verifier::<Svix>::new(STANDARD).unwrap();
        assert_eq!(
            svix.verify(&h, body, at(1_614_265_330)),
            Err(SignatureError::Missing)
        );
        let sent = svix.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1_614_265_330, body);
        assert_eq!(sent[0].0, "svix-id");
        assert_eq!(
            svix.verify(&headers(&sent), body, at(1_614_265_330)),
            Ok(())
        );
    }

    #[test]
    fn standard_webhooks_secrets_are_decoded() {
        assert_eq!(
            Verifier::<StandardWebhooks>::new("whsec_not base64!").unwrap_err(),
            WebhookSecretError::NotBase64
        );
        assert_eq!(
            Verifier::<StandardWebhooks>::new("whsec_AAAA").unwrap_err(),
            WebhookSecretError::TooShort { len: 3 }
        );
        // Without the prefix, the base64 alone is the same secret.
        assert!(Verifier::<StandardWebhooks>::new("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_ok());
        // Stripe's key is the whole string, not decoded.
        assert!(Verifier::<Stripe>::new("whsec_not base64 at all").is_ok());
    }

    #[test]
    fn github_signs_the_body_alone() {
        let v = Verifier::<GitHub>::new("It's a Secret to Everybody").unwrap();
        // GitHub's documented example ("Validating webhook deliveries").
        let sent = v.sign("", 0, b"Hello, World!");
        assert_eq!(
            sent[0].1,
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        );
        let h = headers(&sent);
        assert_eq!(v.verify(&h, b"Hello, World!", at(0)), Ok(()));
        assert_eq!(
            v.verify(&h, b"Hello, World?", at(0)),
            Err(SignatureError::Mismatch)
        );
        for bad in ["757107ea", "sha1=757107ea", "sha256=zz", "sha256="] {
            let h = headers(&[(HeaderName::from_static("x-hub-signature-256"), bad.into())]);
            assert_eq!(
                v.verify(&h, b"Hello, World!", at(0)),
                Err(SignatureError::Malformed)
            );
        }
    }

    /// Slack's documented example ("Verifying requests from Slack"), which its official
    /// `slack_sdk` reproduces.
    #[test]
    fn slack_signs_version_timestamp_and_body() {
        let v = Verifier::<Slack>::new("8f742231b10e8888abcd99yyyzzz85a5").unwrap();
        let body = "token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&\
                    channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&\
                    command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2F\
                    commands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=\
                    398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
        let sent = v.sign("", 1_531_420_618, body.as_bytes());
        assert_eq!(
            sent[1].1,
            "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
        );
        let h = headers(&sent);
        assert_eq!(v.verify(&h, body.as_bytes(), at(1_531_420_618)), Ok(()));
        assert_eq!(
            v.verify(&h, b"token=other", at(1_531_420_618)),
            Err(SignatureError::Mismatch)
        );
        assert!(matches!(
            v.verify(&h, body.as_bytes(), at(1_531_420_618 + 301)),
            Err(SignatureError::Stale { .. })
        ));
        // The timestamp is signed: another one under the same signature is refused.
        let mut later = h.clone();
        later.insert("x-slack-request-timestamp", "1531420619".parse().unwrap());
        assert_eq!(
            v.verify(&later, body.as_bytes(), at(1_531_420_618)),
            Err(SignatureError::Mismatch)
        );
        let mut untimed = h.clone();
        untimed.remove("x-slack-request-timestamp");
        assert_eq!(
            v.verify(&untimed, body.as_bytes(), at(1_531_420_618)),
            Err(SignatureError::Missing)
        );
        for bad in ["a2114d57", "v1=a2114d57", "v0=zz", "v0="] {
            let mut h = h.clone();
            h.insert("x-slack-signature", bad.parse().unwrap());
            assert_eq!(
                v.verify(&h, body.as_bytes(), at(1_531_420_618)),
                Err(SignatureError::Malformed)
            );
        }
    }

    /// The value `createSHA256HMAC` of Shopify's official `@shopify/shopify-api` (the
    /// function its webhook validation uses) gives for this secret and body.
    #[test]
    fn shopify_signs_the_body_in_base64() {
        let v = Verifier::<Shopify>::new("hush-a-shopify-client-secret").unwrap();
        let sent = v.sign("", 0, br#"{"id":1}"#);
        assert_eq!(sent[0].1, "kGeF77bR0pzMU7UvVG/Hu7DDdcS0OiTiY4Kt6kNH2Kg=");
        let h = headers(&sent);
        assert_eq!(v.verify(&h, br#"{"id":1}"#, at(0)), Ok(()));
        assert_eq!(
            v.verify(&h, br#"{"id":2}"#, at(0)),
            Err(SignatureError::Mismatch)
        );
        for bad in [
            "",
            "kGeF",
            "sha256=kGeF77bR0pzMU7UvVG/Hu7DDdcS0OiTiY4Kt6kNH2Kg=",
        ] {
            let h = headers(&[(HeaderName::from_static("x-shopify-hmac-sha256"), bad.into())]);
            assert_eq!(
                v.verify(&h, br#"{"id":1}"#, at(0)),
                Err(SignatureError::Malformed)
            );
        }
    }

    #[test]
    fn signed_deliveries_verify() {
        let v = custom(SECRET);
        let body = br#"{"id":"evt_1"}"#;
        let header = signed(&v, 1_700_000_000, body);
        assert!(header.starts_with("t=1700000000,v1="));
        assert_eq!(
            v.verify(&custom_header(&header), body, at(1_700_000_100)),
            Ok(())
        );
        // Hex digits in either case.
        let upper = header
            .to_uppercase()
            .replace("T=", "t=")
            .replace("V1=", "v1=");
        assert_eq!(
            v.verify(&custom_header(&upper), body, at(1_700_000_000)),
            Ok(())
        );
        // One changed byte in the body, or another secret: refused.
        assert_eq!(
            v.verify(
                &custom_header(&header),
                br#"{"id":"evt_2"}"#,
                at(1_700_000_000)
            ),
            Err(SignatureError::Mismatch)
        );
        let forged = signed(&custom("whsec_guessed_secret"), 1_700_000_000, body);
        assert_eq!(
            v.verify(&custom_header(&forged), body, at(1_700_000_000)),
            Err(SignatureError::Mismatch)
        );
        // Another header name, for a custom sender.
        let named = custom(SECRET).header(HeaderName::from_static("x-sender-signature"));
        let sent = named.sign("", 1_700_000_000, body);
        assert_eq!(sent[0].0, "x-sender-signature");
        assert_eq!(
            named.verify(&headers(&sent), body, at(1_700_000_000)),
            Ok(())
        );
        assert_eq!(
            named.verify(&custom_header(&header), body, at(1_700_000_000)),
            Err(SignatureError::Missing)
        );
    }

    #[test]
    fn stale_and_malformed_headers() {
        let v = custom(SECRET);
        let body = b"{}";
        let header = signed(&v, 1_000, body);
        let sig = v1(&header);
        assert!(matches!(
            v.verify(&custom_header(&header), body, at(1_000 + 301)),
            Err(SignatureError::Stale { .. })
        ));
        assert!(matches!(
            v.verify(&custom_header(&header), body, at(1_000 - 301)),
            Err(SignatureError::Stale { .. })
        ));
        assert_eq!(
            v.clone().tolerance(Duration::from_secs(600)).verify(
                &custom_header(&header),
                body,
                at(1_500)
            ),
            Ok(())
        );
        for bad in [
            String::new(),
            format!("v1={sig}"),
            "t=1000".into(),
            format!("t=x,v1={sig}"),
            format!("t=+1000,v1={sig}"),
            format!("t=,v1={sig}"),
            format!("t=1000,t=1000,v1={sig}"),
            "t=1000,v1=zz".into(),
            "t=1000,v1=0".into(),
            "garbage".into(),
        ] {
            assert_eq!(
                v.verify(&custom_header(&bad), body, at(1_000)),
                Err(SignatureError::Malformed),
                "{bad:?}"
            );
        }
    }

    /// Pins the CPU denial of service: any number of `v1` entries, empty ones included,
    /// each costing a MAC over the whole body. Only 1 to 8 values of exactly 64 hex
    /// digits are accepted.
    #[test]
    fn many_empty_or_misshapen_signatures_are_malformed() {
        let v = custom(SECRET);
        let body = b"{}";
        let good = signed(&v, 1_000, body);
        let sig = v1(&good);
        let flood = format!("t=1000{}", ",v1=".repeat(5_000));
        let misshapen = [
            "".to_owned(),
            sig[..63].to_owned(),       // odd length
            sig[..62].to_owned(),       // too short
            format!("{sig}00"),         // too long
            format!("{}g", &sig[..63]), // not hex
            format!("+{}", &sig[..63]), // a sign, which `from_str_radix` would take
            "+f".repeat(32),
        ];
        let mut bad: Vec<String> = misshapen.iter().map(|s| format!("t=1000,v1={s}")).collect();
        // A bad value beside a good one is still refused.
        bad.extend(misshapen.iter().map(|s| format!("{good},v1={s}")));
        bad.push(flood);
        // Nine values, the good one among them.
        bad.push(format!(
            "{good}{}",
            format!(",v1={}", "0".repeat(64)).repeat(8)
        ));
        for header in &bad {
            assert_eq!(
                v.verify(&custom_header(header), body, at(1_000)),
                Err(SignatureError::Malformed),
                "{}",
                &header[..header.len().min(120)]
            );
        }
        // Not ASCII.
        assert_eq!(
            parse_timestamped_hex(
                format!("t=1000,v1={}é", &sig[..62]).as_bytes(),
                Duration::from_secs(300),
                at(1_000)
            ),
            Err(SignatureError::Malformed)
        );
        // Eight, the good one last: accepted.
        let eight = format!(
            "t=1000{},v1={sig}",
            format!(",v1={}", "0".repeat(64)).repeat(7)
        );
        assert_eq!(v.verify(&custom_header(&eight), body, at(1_000)), Ok(()));
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
