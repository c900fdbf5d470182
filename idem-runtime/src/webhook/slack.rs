//! Slack: `X-Slack-Signature: v0=<hex>`, an HMAC-SHA256 over `v0:{timestamp}:{body}`
//! with `X-Slack-Request-Timestamp`, under the app's signing secret as it is.

use std::time::{Duration, SystemTime};

use http::header::HeaderName;
use http::HeaderMap;

use super::{
    decode_seconds, decode_sha256_hex, fresh, sealed, signed_mac, Candidates, Scheme,
    SignatureError,
};
use crate::fingerprint::hex;

/// Slack: `X-Slack-Signature: v0=<hex>`, an HMAC-SHA256 over `v0:{timestamp}:{body}`
/// with `X-Slack-Request-Timestamp`, under the app's signing secret as it is. Slack signs
/// no id: an Events API delivery is keyed by its `event_id` (`key = event_id`).
#[derive(Debug, Clone, Copy)]
pub struct Slack;

impl sealed::Sealed for Slack {}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::tests::{at, headers};
    use crate::webhook::Verifier;

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
}
