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
use hmac::{Hmac, Mac};
use http::header::HeaderName;
use serde::de::DeserializeOwned;
use sha2::Sha256;

use crate::fingerprint::hex;
use crate::web::problem::Problems;
use crate::{FingerprintBody, Store};

/// The default signature header.
pub const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

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

impl WebhookVerifier {
    /// A verifier with one secret (its raw bytes are the HMAC key), the
    /// `Webhook-Signature` header and a 5-minute tolerance.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self {
            inner: Arc::new(Settings {
                secrets: vec![secret.into()],
                header: WEBHOOK_SIGNATURE,
                tolerance: Duration::from_secs(300),
            }),
        }
    }

    /// Accepts signatures made with another secret too (while rotating secrets).
    #[must_use]
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        Arc::make_mut(&mut self.inner).secrets.push(secret.into());
        self
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
        let secret = self.inner.secrets.first().map_or(&[][..], Vec::as_slice);
        format!(
            "t={timestamp},v1={}",
            hex(&mac(secret, timestamp, body).finalize().into_bytes())
        )
    }

    /// Checks one header value against the raw body, at `now`.
    pub fn verify(
        &self,
        header: &[u8],
        body: &[u8],
        now: SystemTime,
    ) -> Result<(), SignatureError> {
        let header = std::str::from_utf8(header).map_err(|_| SignatureError::Malformed)?;
        let mut timestamp = None;
        let mut signatures = Vec::new();
        for part in header.split(',') {
            match part.trim().split_once('=') {
                Some(("t", t)) => {
                    timestamp = Some(t.parse::<u64>().map_err(|_| SignatureError::Malformed)?)
                }
                Some(("v1", sig)) => {
                    signatures.push(decode_hex(sig).ok_or(SignatureError::Malformed)?)
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
        for secret in &self.inner.secrets {
            for signature in &signatures {
                // `verify_slice` compares in constant time.
                if mac(secret, timestamp, body).verify_slice(signature).is_ok() {
                    return Ok(());
                }
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

fn mac(secret: &[u8], timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length.
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Why a delivery's signature was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignatureError {
    /// No signature header.
    Missing,
    /// The header is not `t=<seconds>,v1=<hex>...`.
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
            Self::Malformed => {
                f.write_str("the signature header is not of the form t=<unix seconds>,v1=<hex>")
            }
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
/// A missing or malformed signature header, or a stale timestamp, answers 400; a
/// signature that matches no secret answers 401; both as problem+json, and nothing is
/// claimed or stored.
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
        let signature = req.headers().get(verifier.header_name()).cloned();
        let body = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let verdict = match &signature {
            None => Err(SignatureError::Missing),
            Some(value) => verifier.verify(value.as_bytes(), &body, SystemTime::now()),
        };
        if let Err(error) = verdict {
            tracing::warn!(%error, "idem: webhook delivery refused");
            return Err(problems.signature(&error).into_response());
        }
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

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn signed_deliveries_verify() {
        let v = WebhookVerifier::new("whsec_1");
        let body = br#"{"id":"evt_1"}"#;
        let header = v.sign(1_700_000_000, body);
        assert!(header.starts_with("t=1700000000,v1="));
        assert_eq!(v.verify(header.as_bytes(), body, at(1_700_000_100)), Ok(()));
        // One changed byte in the body, or another secret: refused.
        assert_eq!(
            v.verify(header.as_bytes(), br#"{"id":"evt_2"}"#, at(1_700_000_000)),
            Err(SignatureError::Mismatch)
        );
        let forged = WebhookVerifier::new("guess").sign(1_700_000_000, body);
        assert_eq!(
            v.verify(forged.as_bytes(), body, at(1_700_000_000)),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn stale_and_malformed_headers() {
        let v = WebhookVerifier::new("s");
        let body = b"{}";
        let header = v.sign(1_000, body);
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
            "",
            "v1=00",
            "t=1000",
            "t=x,v1=00",
            "t=1000,v1=zz",
            "t=1000,v1=0",
            "garbage",
        ] {
            assert_eq!(
                v.verify(bad.as_bytes(), body, at(1_000)),
                Err(SignatureError::Malformed),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn rotation_on_both_sides() {
        let body = b"{}";
        let old = WebhookVerifier::new("old");
        let new = WebhookVerifier::new("new");
        // The sender signs with both secrets during its rotation.
        let both = format!(
            "{},{}",
            old.sign(10, body),
            new.sign(10, body).split_once(',').unwrap().1
        );
        assert_eq!(new.verify(both.as_bytes(), body, at(10)), Ok(()));
        // The receiver accepts both secrets during its rotation.
        let receiver = WebhookVerifier::new("new").with_secret("old");
        assert_eq!(
            receiver.verify(old.sign(10, body).as_bytes(), body, at(10)),
            Ok(())
        );
        assert_eq!(
            receiver.verify(new.sign(10, body).as_bytes(), body, at(10)),
            Ok(())
        );
        // Unknown scheme versions are ignored, not fatal.
        let with_v0 = format!("{},v0=abcd", new.sign(10, body));
        assert_eq!(new.verify(with_v0.as_bytes(), body, at(10)), Ok(()));
    }
}
