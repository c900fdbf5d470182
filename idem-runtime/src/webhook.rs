//! Signed webhook deliveries: the signature is checked over the raw body before the
//! JSON is parsed and before the key is claimed, so a forged delivery never touches the
//! idempotency table.
//!
//! The scheme is the common one: a header (default `Webhook-Signature`) of the form
//! `t=<unix seconds>,v1=<hex>[,v1=<hex>...]`, each `v1` an HMAC-SHA256 of
//! `"{t}.{raw body}"` under a shared secret. Several `v1` values are allowed (a sender
//! rotating its secret signs with both), and several secrets may be configured (a
//! receiver rotating its secret accepts both); one match is enough. Timestamps outside
//! the tolerance (default 5 minutes) are refused, which bounds replays of captured
//! deliveries; within it, idempotency takes care of duplicates.
//!
//! Sign a test delivery from a shell:
//!
//! ```sh
//! t=$(date +%s); body='{"id":"evt_1","type":"charge.refunded","data":{}}'
//! sig=$(printf '%s.%s' "$t" "$body" | openssl dgst -sha256 -hmac "$WEBHOOK_SECRET" -r | cut -d' ' -f1)
//! curl localhost:3000/webhooks/payments -H "Webhook-Signature: t=$t,v1=$sig" \
//!   -H 'Content-Type: application/json' -d "$body"
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{FromRef, FromRequest, Request};
use axum::response::{IntoResponse, Response};
use hmac::digest::CtOutput;
use hmac::{Hmac, Mac};
use http::header::HeaderName;
use serde::de::DeserializeOwned;
use sha2::Sha256;

use crate::fingerprint::hex;
use crate::web::problem::Problems;
use crate::{FingerprintBody, Store};

/// The default signature header.
pub const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

/// The most `v1` signatures one header may carry. A sender rotating its secret signs
/// with two; eight leaves room, and bounds what an unsigned request can make the
/// receiver check.
pub const MAX_SIGNATURES: usize = 8;

/// The shortest secret a [`WebhookVerifier`] accepts, in bytes.
///
/// 16 bytes are 128 bits when the secret is random, the usual floor for a symmetric
/// key. It refuses the mistakes that matter (an empty `WEBHOOK_SECRET=`, which would
/// verify deliveries signed with the empty key, or a word typed by hand) and accepts the
/// secrets payment providers issue, which are longer (`whsec_` and 32 characters or
/// more). A length cannot measure entropy: use a random secret.
pub const MIN_SECRET_LEN: usize = 16;

/// Checks signatures of webhook deliveries. Put it in the router's state, reachable
/// with [`FromRef`], for [`Signed`] to find.
#[derive(Clone)]
pub struct WebhookVerifier {
    inner: Arc<Settings>,
}

#[derive(Clone)]
struct Settings {
    secrets: Vec<Vec<u8>>,
    header: HeaderName,
    tolerance: Duration,
}

/// A signature header that is well formed and fresh: what is left to check needs the
/// body.
#[derive(Debug)]
struct Candidates {
    timestamp: u64,
    signatures: Vec<[u8; 32]>,
}

impl WebhookVerifier {
    /// A verifier with one secret (its raw bytes are the HMAC key), the
    /// `Webhook-Signature` header and a 5-minute tolerance.
    ///
    /// A secret shorter than [`MIN_SECRET_LEN`] bytes is refused: an empty one would
    /// verify deliveries signed with the empty key.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, WebhookSecretError> {
        Ok(Self {
            inner: Arc::new(Settings {
                secrets: vec![checked(secret.into())?],
                header: WEBHOOK_SIGNATURE,
                tolerance: Duration::from_secs(300),
            }),
        })
    }

    /// Accepts signatures made with another secret too (while rotating secrets); the
    /// same length rule as [`WebhookVerifier::new`].
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Result<Self, WebhookSecretError> {
        let secret = checked(secret.into())?;
        Arc::make_mut(&mut self.inner).secrets.push(secret);
        Ok(self)
    }

    /// Reads the signature from another header.
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

    /// The header this verifier reads.
    pub fn header_name(&self) -> &HeaderName {
        &self.inner.header
    }

    /// The header value that signs `body` at `timestamp` with the first secret: for tests
    /// and for services that send webhooks themselves.
    pub fn sign(&self, timestamp: u64, body: &[u8]) -> String {
        let first = &self.inner.secrets[0];
        format!(
            "t={timestamp},v1={}",
            hex(&mac(first, timestamp, body).finalize().into_bytes())
        )
    }

    /// Checks one header value against the raw body, at `now`.
    pub fn verify(
        &self,
        header: &[u8],
        body: &[u8],
        now: SystemTime,
    ) -> Result<(), SignatureError> {
        let candidates = self.candidates(header, now)?;
        self.check(&candidates, body)
    }

    /// Everything that can be judged without the body: the form of the header, the
    /// number and form of its signatures, the timestamp. [`Signed`] calls it before it
    /// reads the body, so a hostile header costs neither the read nor a MAC.
    fn candidates(&self, header: &[u8], now: SystemTime) -> Result<Candidates, SignatureError> {
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
        let now = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if now.abs_diff(timestamp) > self.inner.tolerance.as_secs() {
            return Err(SignatureError::Stale { timestamp, now });
        }
        Ok(Candidates {
            timestamp,
            signatures,
        })
    }

    /// One MAC over the body per secret, compared in constant time with each candidate.
    fn check(&self, candidates: &Candidates, body: &[u8]) -> Result<(), SignatureError> {
        for secret in &self.inner.secrets {
            let expected = mac(secret, candidates.timestamp, body).finalize();
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

impl fmt::Debug for WebhookVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookVerifier")
            .field("secrets", &self.inner.secrets.len())
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

fn mac(secret: &[u8], timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// Unix seconds: ASCII digits only (no sign, no spaces).
fn decode_seconds(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
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

/// Why a secret was refused by [`WebhookVerifier::new`] or
/// [`WebhookVerifier::with_secret`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WebhookSecretError {
    /// Shorter than [`MIN_SECRET_LEN`] bytes (an empty secret included).
    TooShort {
        /// The secret's length in bytes.
        len: usize,
    },
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
        }
    }
}

impl std::error::Error for WebhookSecretError {}

/// Why a delivery's signature was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureError {
    /// No signature header.
    Missing,
    /// The header is not `t=<seconds>,v1=<64 hex digits>...` with one `t` and one to
    /// [`MAX_SIGNATURES`] `v1` values.
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
            Self::Missing => f.write_str("the delivery has no signature header"),
            Self::Malformed => write!(
                f,
                "the signature header is not of the form t=<unix seconds>,v1=<64 hex digits>, \
                 with one to {MAX_SIGNATURES} v1 values"
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

/// A signed JSON body: the signature is verified over the raw bytes first, then the
/// JSON is parsed. Use it as the last parameter of a webhook handler; with
/// `#[idempotent(key = id, ...)]` the event's own id is the idempotency key.
///
/// A missing or malformed signature header, or a stale timestamp, answers 400 before
/// the body is read; a signature that matches no secret answers 401; both as
/// problem+json, and nothing is claimed or stored.
#[derive(Debug, Clone)]
pub struct Signed<T>(pub T);

impl<S, T> FromRequest<S> for Signed<T>
where
    T: DeserializeOwned,
    WebhookVerifier: FromRef<S>,
    Store: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let verifier = WebhookVerifier::from_ref(state);
        let store = Store::from_ref(state);
        let problems = Problems::of(&store);
        let refuse = |error: SignatureError| {
            tracing::warn!(%error, "idem: webhook delivery refused");
            problems.signature(&error).into_response()
        };
        // The header first: a delivery that cannot verify is refused before its body
        // is read or any MAC is computed.
        let candidates = match req.headers().get(verifier.header_name()) {
            None => Err(SignatureError::Missing),
            Some(value) => verifier.candidates(value.as_bytes(), SystemTime::now()),
        }
        .map_err(refuse)?;
        let body = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        verifier.check(&candidates, &body).map_err(refuse)?;
        serde_json::from_slice(&body).map(Self).map_err(|error| {
            problems
                .invalid_request(format!("the delivery's JSON body is invalid: {error}"))
                .into_response()
        })
    }
}

impl<T> FingerprintBody for Signed<T> {
    type Value = T;

    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_0123456789abcdef";

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn verifier(secret: &str) -> WebhookVerifier {
        WebhookVerifier::new(secret).unwrap()
    }

    /// The `v1` value of a signed header.
    fn v1(header: &str) -> &str {
        header.split_once(",v1=").unwrap().1
    }

    #[test]
    fn signed_deliveries_verify() {
        let v = verifier(SECRET);
        let body = br#"{"id":"evt_1"}"#;
        let header = v.sign(1_700_000_000, body);
        assert!(header.starts_with("t=1700000000,v1="));
        assert_eq!(v.verify(header.as_bytes(), body, at(1_700_000_100)), Ok(()));
        // Hex digits in either case.
        let upper = header
            .to_uppercase()
            .replace("T=", "t=")
            .replace("V1=", "v1=");
        assert_eq!(v.verify(upper.as_bytes(), body, at(1_700_000_000)), Ok(()));
        // One changed byte in the body, or another secret: refused.
        assert_eq!(
            v.verify(header.as_bytes(), br#"{"id":"evt_2"}"#, at(1_700_000_000)),
            Err(SignatureError::Mismatch)
        );
        let forged = verifier("whsec_guessed_secret").sign(1_700_000_000, body);
        assert_eq!(
            v.verify(forged.as_bytes(), body, at(1_700_000_000)),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn stale_and_malformed_headers() {
        let v = verifier(SECRET);
        let body = b"{}";
        let header = v.sign(1_000, body);
        let sig = v1(&header);
        assert!(matches!(
            v.verify(header.as_bytes(), body, at(1_000 + 301)),
            Err(SignatureError::Stale { .. })
        ));
        assert!(matches!(
            v.verify(header.as_bytes(), body, at(1_000 - 301)),
            Err(SignatureError::Stale { .. })
        ));
        assert_eq!(
            v.clone().tolerance(Duration::from_secs(600)).verify(
                header.as_bytes(),
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
                v.verify(bad.as_bytes(), body, at(1_000)),
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
        let v = verifier(SECRET);
        let body = b"{}";
        let good = v.sign(1_000, body);
        let sig = v1(&good);
        let flood = format!("t=1000{}", ",v1=".repeat(5_000));
        let misshapen = [
            "".to_owned(),
            sig[..63].to_owned(),       // odd length
            sig[..62].to_owned(),       // too short
            format!("{sig}00"),         // too long
            format!("{}g", &sig[..63]), // not hex
            format!("+{}", &sig[..63]), // a sign, which `from_str_radix` would take
            format!("{}é", &sig[..62]), // not ASCII
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
                v.verify(header.as_bytes(), body, at(1_000)),
                Err(SignatureError::Malformed),
                "{}",
                &header[..header.len().min(120)]
            );
        }
        // Eight, the good one last: accepted.
        let eight = format!(
            "t=1000{},v1={sig}",
            format!(",v1={}", "0".repeat(64)).repeat(7)
        );
        assert_eq!(v.verify(eight.as_bytes(), body, at(1_000)), Ok(()));
    }

    #[test]
    fn the_header_is_judged_without_the_body() {
        let v = verifier(SECRET);
        let flood = format!("t=1000{}", ",v1=".repeat(5_000));
        assert_eq!(
            v.candidates(flood.as_bytes(), at(1_000)).unwrap_err(),
            SignatureError::Malformed
        );
        let good = v.sign(1_000, b"{}");
        let candidates = v.candidates(good.as_bytes(), at(1_000)).unwrap();
        assert_eq!(candidates.signatures.len(), 1);
        assert_eq!(v.check(&candidates, b"{}"), Ok(()));
        assert_eq!(v.check(&candidates, b"[]"), Err(SignatureError::Mismatch));
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
            verifier(SECRET).with_secret("old").unwrap_err(),
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
        let old = verifier("whsec_old_0123456789");
        let new = verifier("whsec_new_0123456789");
        // The sender signs with both secrets during its rotation.
        let both = format!("{},v1={}", old.sign(10, body), v1(&new.sign(10, body)));
        assert_eq!(new.verify(both.as_bytes(), body, at(10)), Ok(()));
        assert_eq!(old.verify(both.as_bytes(), body, at(10)), Ok(()));
        // The receiver accepts both secrets during its rotation.
        let receiver = verifier("whsec_new_0123456789")
            .with_secret("whsec_old_0123456789")
            .unwrap();
        assert_eq!(
            receiver.verify(old.sign(10, body).as_bytes(), body, at(10)),
            Ok(())
        );
        assert_eq!(
            receiver.verify(new.sign(10, body).as_bytes(), body, at(10)),
            Ok(())
        );
        assert_eq!(receiver.verify(both.as_bytes(), body, at(10)), Ok(()));
        // Unknown scheme versions are ignored, not fatal.
        let with_v0 = format!("{},v0=abcd", new.sign(10, body));
        assert_eq!(new.verify(with_v0.as_bytes(), body, at(10)), Ok(()));
    }
}
