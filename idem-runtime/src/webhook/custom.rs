//! Custom senders: Stripe's `t=<seconds>,v1=<hex>` format over `{t}.{body}` (read and
//! written in `stripe.rs`), with the raw secret as the key, under a header you name
//! (default `X-Webhook-Signature`).

use std::time::{Duration, SystemTime};

use http::header::HeaderName;
use http::HeaderMap;

use super::stripe::{timestamped_hex_candidates, timestamped_hex_sign};
use super::{sealed, Candidates, Scheme, SignatureError};

/// Stripe's format, `t=<seconds>,v1=<hex>[,v1=...]` over `{t}.{body}` with the raw
/// secret as the key, under a header you name with [`Verifier::header`] (default
/// `X-Webhook-Signature`): for senders of your own.
///
/// [`Verifier::header`]: super::Verifier::header
#[derive(Debug, Clone, Copy)]
pub struct Custom;

impl sealed::Sealed for Custom {}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::parse_timestamped_hex;
    use crate::webhook::tests::{at, custom, custom_header, headers, signed, v1, SECRET};

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
}
