//! GitHub: `X-Hub-Signature-256: sha256=<hex>`, an HMAC-SHA256 over the body alone
//! under the raw secret, with no timestamp and no signed id.

use std::time::{Duration, SystemTime};

use http::header::HeaderName;
use http::HeaderMap;

use super::{body_only, decode_sha256_hex, sealed, signed_mac, Candidates, Scheme, SignatureError};
use crate::fingerprint::hex;

/// GitHub: `X-Hub-Signature-256: sha256=<hex>`, an HMAC-SHA256 over the body. There is
/// no timestamp, and `X-GitHub-Delivery` is not signed: the key must come from the
/// body (a field, or the body's digest), and a captured delivery verifies forever.
#[derive(Debug, Clone, Copy)]
pub struct GitHub;

impl sealed::Sealed for GitHub {}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::tests::{at, headers};
    use crate::webhook::Verifier;

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
}
