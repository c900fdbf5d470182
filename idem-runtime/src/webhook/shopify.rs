//! Shopify: `X-Shopify-Hmac-SHA256: <base64>`, an HMAC-SHA256 over the body alone under
//! the app's client secret as it is, with no timestamp and no signed id.

use std::time::{Duration, SystemTime};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use http::header::HeaderName;
use http::HeaderMap;

use super::{
    body_only, decode_sha256_base64, sealed, signed_mac, Candidates, Scheme, SignatureError,
};

/// Shopify: `X-Shopify-Hmac-SHA256: <base64>`, an HMAC-SHA256 over the body under the
/// app's client secret as it is. There is no timestamp, and `X-Shopify-Webhook-Id` is
/// not signed: key by the body (`key = digest(body)`, or a field).
#[derive(Debug, Clone, Copy)]
pub struct Shopify;

impl sealed::Sealed for Shopify {}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::tests::{at, headers};
    use crate::webhook::Verifier;

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
}
