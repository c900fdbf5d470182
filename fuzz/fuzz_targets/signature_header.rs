//! `WebhookVerifier::verify` on signature headers: arbitrary bytes never panic and are
//! never accepted without the delivery's MAC; headers assembled from well-formed parts
//! (the right MAC, a MAC with one bit flipped, cut short, made for another body or
//! timestamp, other schemes, whitespace) are accepted exactly when one `v1` is the
//! right MAC, every `v1` is well formed (64 hex digits, at most eight of them) and the
//! timestamp is within the tolerance. The MAC is computed here with
//! `hmac`/`sha2`, independently of the verifier's own code.
#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, UNIX_EPOCH};

use arbitrary::Arbitrary;
use hmac::{Hmac, Mac};
use idem::webhook::WebhookVerifier;
use libfuzzer_sys::fuzz_target;
use sha2::Sha256;

const SECRET: &[u8; 32] = b"whsec_fuzz_0123456789abcdefghijk";
const OTHER_SECRET: &[u8; 32] = b"whsec_fuzz_other_secret_01234567";
/// The verifier's default tolerance.
const TOLERANCE: u64 = 300;
/// The receiver's clock in the structured case: late 2026.
const NOW: u64 = 1_795_000_000;

fn verifier() -> &'static WebhookVerifier {
    static VERIFIER: OnceLock<WebhookVerifier> = OnceLock::new();
    // The one line to adapt when the constructor becomes fallible.
    VERIFIER.get_or_init(|| WebhookVerifier::new(SECRET.to_vec()).expect("a 32-byte secret"))
}

fn mac(secret: &[u8], timestamp: &str, body: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap();
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.finalize().into_bytes().into()
}

fn hex(bytes: &[u8], upper: bool) -> String {
    bytes
        .iter()
        .map(|b| {
            if upper {
                format!("{b:02X}")
            } else {
                format!("{b:02x}")
            }
        })
        .collect()
}

#[derive(Debug, Arbitrary)]
enum Input<'a> {
    /// Any header, any body, any clock.
    Raw {
        header: &'a [u8],
        body: &'a [u8],
        now: u32,
    },
    /// A header assembled from parts.
    Built {
        body: &'a [u8],
        /// Seconds between the signature's timestamp and the receiver's clock.
        skew: i16,
        /// Where `t=` goes among the parts.
        t_at: u8,
        parts: Vec<Part>,
    },
}

#[derive(Debug, Arbitrary)]
enum Part {
    /// The right MAC.
    Right { upper: bool, pad: bool },
    /// The right MAC with one bit flipped.
    Flipped { bit: u8 },
    /// The right MAC cut to `len` bytes (fewer than 32).
    Short { len: u8 },
    /// A MAC of the body with one more byte.
    OtherBody { extra: u8 },
    /// A MAC for the timestamp one second later.
    OtherTimestamp,
    /// The right MAC under another secret.
    OtherSecret,
    /// Another scheme's value, which the verifier skips.
    OtherScheme { name: Scheme, value: u64 },
}

#[derive(Debug, Arbitrary)]
enum Scheme {
    V0,
    V2,
    Long,
}

fuzz_target!(|input: Input<'_>| match input {
    Input::Raw { header, body, now } => raw(header, body, u64::from(now)),
    Input::Built {
        body,
        skew,
        t_at,
        parts,
    } => built(body, skew, t_at, &parts),
});

fn raw(header: &[u8], body: &[u8], now: u64) {
    let at = UNIX_EPOCH + Duration::from_secs(now);
    if verifier().verify(&headers(header), body, at).is_err() {
        return;
    }
    // Accepted: the header must carry the MAC of some `t=` value it holds, in hex.
    let text = std::str::from_utf8(header).expect("accepted a header that is not UTF-8");
    let carries_mac = text
        .split(',')
        .filter_map(|part| part.trim().strip_prefix("t="))
        .filter_map(|t| t.parse::<u64>().ok())
        .any(|t| {
            let right = hex(&mac(SECRET, &t.to_string(), body), false);
            text.to_ascii_lowercase().contains(&right)
        });
    assert!(carries_mac, "accepted {text:?} without the body's MAC");
}

fn built(body: &[u8], skew: i16, t_at: u8, parts: &[Part]) {
    let t = NOW.checked_add_signed(i64::from(skew)).unwrap();
    let ts = t.to_string();
    let right = mac(SECRET, &ts, body);
    let mut texts = Vec::with_capacity(parts.len() + 1);
    let mut any_right = false;
    // A `v1` that is not 64 hex digits, or more than eight of them, makes the whole
    // header malformed, whatever else it holds.
    let mut malformed = false;
    let mut v1s = 0;
    for part in parts {
        if !matches!(part, Part::OtherScheme { .. }) {
            v1s += 1;
        }
        let text = match *part {
            Part::Right { upper, pad } => {
                any_right = true;
                let v = format!("v1={}", hex(&right, upper));
                if pad {
                    format!("  {v}\t")
                } else {
                    v
                }
            }
            Part::Flipped { bit } => {
                let mut wrong = right;
                wrong[usize::from(bit / 8)] ^= 1 << (bit % 8);
                format!("v1={}", hex(&wrong, false))
            }
            Part::Short { len } => {
                malformed = true;
                format!("v1={}", hex(&right[..usize::from(len % 32)], false))
            }
            Part::OtherBody { extra } => {
                let mut longer = body.to_vec();
                longer.push(extra);
                format!("v1={}", hex(&mac(SECRET, &ts, &longer), false))
            }
            Part::OtherTimestamp => {
                format!(
                    "v1={}",
                    hex(&mac(SECRET, &(t + 1).to_string(), body), false)
                )
            }
            Part::OtherSecret => format!("v1={}", hex(&mac(OTHER_SECRET, &ts, body), false)),
            Part::OtherScheme { ref name, value } => {
                let name = match name {
                    Scheme::V0 => "v0",
                    Scheme::V2 => "v2",
                    Scheme::Long => "v1x",
                };
                format!("{name}={value:x}")
            }
        };
        texts.push(text);
    }
    let t_at = usize::from(t_at) % (texts.len() + 1);
    texts.insert(t_at, format!("t={ts}"));
    let header = texts.join(",");

    let at = UNIX_EPOCH + Duration::from_secs(NOW);
    let fresh = NOW.abs_diff(t) <= TOLERANCE;
    let verdict = verifier().verify(&headers(header.as_bytes()), body, at);
    assert_eq!(
        verdict.is_ok(),
        any_right && fresh && !malformed && v1s <= idem::webhook::MAX_SIGNATURES,
        "{header:?} over {body:?}: {verdict:?}"
    );
    // The verifier's own signature is one of the accepted forms.
    if fresh {
        let signed = verifier().sign("", t, body).remove(0).1;
        assert_eq!(signed, format!("t={ts},v1={}", hex(&right, false)));
        assert!(verifier().verify(&headers(signed.as_bytes()), body, at).is_ok());
    }
}

/// The header map of a delivery whose signature header holds `value` (an invalid
/// header value is sent as an empty one, which is malformed too).
fn headers(value: &[u8]) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    map.insert(
        "x-webhook-signature",
        http::HeaderValue::from_bytes(value).unwrap_or(http::HeaderValue::from_static("")),
    );
    map
}
