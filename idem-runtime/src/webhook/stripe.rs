//! Stripe: `Stripe-Signature: t=<seconds>,v1=<hex>[,v1=...]`, an HMAC-SHA256 over
//! `{t}.{body}` whose key is the whole `whsec_...` string. The `t=,v1=` format is read
//! and written here, for `Custom` too.

use std::time::{Duration, SystemTime};

use http::header::HeaderName;
use http::HeaderMap;

use super::{
    decode_seconds, decode_sha256_hex, fresh, sealed, signed_mac, Candidates, Scheme,
    SignatureError, MAX_SIGNATURES,
};
use crate::fingerprint::hex;

/// Stripe: `Stripe-Signature: t=<seconds>,v1=<hex>[,v1=...]`, an HMAC-SHA256 over
/// `{t}.{body}` whose key is the whole `whsec_...` string. Stripe signs no id header:
/// the key comes from the body (`key = id`).
#[derive(Debug, Clone, Copy)]
pub struct Stripe;

impl sealed::Sealed for Stripe {}

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

pub(super) fn timestamped_hex_candidates(
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

pub(super) fn timestamped_hex_sign(
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
