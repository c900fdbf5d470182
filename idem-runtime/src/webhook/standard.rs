//! Standard Webhooks v1 (`StandardWebhooks`) and Svix's spelling of it (`Svix`): an
//! HMAC-SHA256 over `{id}.{timestamp}.{body}` under the decoded `whsec_<base64>` secret,
//! with the id, the timestamp and the signatures in three headers; the id is signed.

use std::time::{Duration, SystemTime};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use http::header::HeaderName;
use http::HeaderMap;

use super::{
    checked, decode_seconds, decode_sha256_base64, fresh, sealed, signed_mac, Candidates, Scheme,
    SignatureError, SignsIdHeader, WebhookSecretError, MAX_ID_LEN, MAX_SIGNATURES,
};
use crate::header_hash::header_hash;

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

impl sealed::Sealed for StandardWebhooks {}
impl sealed::Sealed for Svix {}

impl SignsIdHeader<{ header_hash("webhook-id") }> for StandardWebhooks {}
impl SignsIdHeader<{ header_hash("svix-id") }> for Svix {}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::tests::{at, headers, STANDARD};
    use crate::webhook::{Stripe, Verifier};

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
}
