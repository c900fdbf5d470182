//! The `Idempotency-Key` request header: syntax and validation.
//!
//! Two spellings are accepted and mean the same key:
//!
//! * an RFC 8941 sf-string, the IETF draft's form: `"a1b2-c3"` (inside the quotes,
//!   visible ASCII and space, with `\"` and `\\` as the only escapes);
//! * a bare value, as Stripe's clients send it: `a1b2-c3`, visible ASCII (0x21–0x7E)
//!   not starting with `"`. This is deliberately wider than the RFC 8941 token
//!   grammar, which would refuse the many UUIDs that start with a digit.
//!
//! Either way the key itself, after unquoting, is 1 to [`MAX_KEY_LEN`] characters.
//!
//! Only header values are sf-strings. A key that is plain text (a body field's value
//! with `key = field`, a message id given to `Store::run_once`) is read by
//! [`IdempotencyKey::from_text`]: never unquoted, and never refused for its length or
//! characters, since a provider's event id cannot be changed by the receiver.

use std::borrow::Cow;
use std::fmt;

use http::header::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters, counted after unquoting.
pub const MAX_KEY_LEN: usize = 255;

/// The prefix of a plain-text key that was hashed: see [`IdempotencyKey::from_text`].
pub const HASHED_KEY_PREFIX: &str = "sha256:";

/// A validated idempotency key, as the client meant it (sf-string quotes removed).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Box<str>);

impl IdempotencyKey {
    /// Parses one header value in either accepted spelling.
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let key = match value.first() {
            None => return Err(KeyError::Empty),
            Some(b'"') => unquote(value)?,
            Some(_) => bare(value)?,
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: key.len() });
        }
        Ok(Self(key.into_boxed_str()))
    }

    /// A key that is plain text, not a header value: a body field's value
    /// (`key = field`) or a message id ([`Store::run_once`](crate::Store::run_once)).
    ///
    /// Nothing is unquoted: `"m1"` and `m1` are two keys. Text of 1 to [`MAX_KEY_LEN`]
    /// visible ASCII characters (0x21–0x7E) is the key as it is. Any other non-empty
    /// text (longer, or with spaces, control characters or non-ASCII) is hashed to
    /// `sha256:` followed by the 64 lower-case hex digits of SHA-256 over its UTF-8
    /// bytes, so every event id a provider can send is a key, and a redelivery maps to
    /// the same one. Text that already has exactly that hashed form is hashed as well,
    /// so no two texts share a key. Only empty text is refused ([`KeyError::Empty`]).
    pub fn from_text(text: &str) -> Result<Self, KeyError> {
        Self::from_bytes(text.as_bytes())
    }

    /// [`Self::from_text`] of bytes that need not be UTF-8 (a header value).
    fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        if bytes.is_empty() {
            return Err(KeyError::Empty);
        }
        let verbatim = bytes.len() <= MAX_KEY_LEN
            && bytes.iter().all(|b| (0x21..=0x7e).contains(b))
            && std::str::from_utf8(bytes).is_ok_and(|text| !looks_hashed(text));
        if verbatim {
            // Visible ASCII, so UTF-8; the fallback is never taken.
            if let Ok(text) = std::str::from_utf8(bytes) {
                return Ok(Self(text.into()));
            }
        }
        let digest = Sha256::digest(bytes);
        let hashed = format!("{HASHED_KEY_PREFIX}{}", crate::fingerprint::hex(&digest));
        Ok(Self(hashed.into_boxed_str()))
    }

    /// The key `sha256:<64 hex digits>` of a digest (`key = digest(body)`), as it is:
    /// a digest is already of the hashed form, so it is not hashed again.
    pub(crate) fn from_digest(digest: &[u8; 32]) -> Self {
        let key = format!("{HASHED_KEY_PREFIX}{}", crate::fingerprint::hex(digest));
        Self(key.into_boxed_str())
    }

    /// A key as a table stores it, read back (the completer's, the operators'): already
    /// validated when it was stored.
    pub(crate) fn stored(key: &str) -> Self {
        Self(key.into())
    }

    /// Reads the key from the `Idempotency-Key` header: `Ok(None)` when it is absent, an
    /// error when it is malformed or given more than once (two keys for one request
    /// would make its identity ambiguous).
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyError> {
        Self::from_header(headers, IDEMPOTENCY_KEY)
    }

    /// Reads the key from another header, by the same rules.
    pub fn from_header(
        headers: &HeaderMap,
        name: impl http::header::AsHeaderName,
    ) -> Result<Option<Self>, KeyError> {
        only_value(headers, name)?
            .map(|value| Self::parse(value.as_bytes()))
            .transpose()
    }

    /// Reads the key from a header a webhook's signature covers (`key =
    /// header("webhook-id")` on a signed body) as plain text, by the rules of
    /// [`Self::from_text`]: the sender signed the id, so an id the header rules would
    /// refuse (over 255 bytes, a tab, a byte above 0x7E) is hashed rather than refused,
    /// which would refuse every redelivery of a correctly signed event.
    pub(crate) fn from_signed_header(
        headers: &HeaderMap,
        name: &str,
    ) -> Result<Option<Self>, KeyError> {
        only_value(headers, name)?
            .map(|value| Self::from_bytes(value.as_bytes()))
            .transpose()
    }

    /// The key as the client meant it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey")
            .field(&self.as_str())
            .finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The value of header `name`: `None` when it is absent, an error when it is given more
/// than once (two keys for one request would make its identity ambiguous).
fn only_value(
    headers: &HeaderMap,
    name: impl http::header::AsHeaderName,
) -> Result<Option<&http::HeaderValue>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    Ok(first)
}

/// Whether `text` has the form [`IdempotencyKey::from_text`] gives hashed keys.
fn looks_hashed(text: &str) -> bool {
    text.strip_prefix(HASHED_KEY_PREFIX).is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// Where a key was read from. A refused key's message names it, so that a client of a
/// webhook or of `key = header("..")` is not told about an `Idempotency-Key` it never
/// sent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyOrigin {
    /// A request header: `Idempotency-Key`, or the one named by `key = header("..")`.
    Header(Cow<'static, str>),
    /// A field of the request body (`key = field`).
    Field,
    /// The key given to [`Store::run_once`](crate::Store::run_once).
    Message,
    /// The digest of the request body (`key = digest(body)`).
    Digest,
}

impl KeyOrigin {
    /// The `Idempotency-Key` header, the default source.
    pub const IDEMPOTENCY_KEY: Self = Self::Header(Cow::Borrowed("Idempotency-Key"));
}

impl fmt::Display for KeyOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => write!(f, "the {name} header"),
            Self::Field => f.write_str("the key field of the request body"),
            Self::Message => f.write_str("the run_once key"),
            Self::Digest => f.write_str("the digest of the request body"),
        }
    }
}

fn bare(value: &[u8]) -> Result<String, KeyError> {
    if let Some(at) = value.iter().position(|b| !(0x21..=0x7e).contains(b)) {
        return Err(KeyError::InvalidCharacter {
            at,
            byte: value[at],
        });
    }
    // Every byte is ASCII, so this cannot fail; the error arm keeps it panic-free.
    String::from_utf8(value.to_vec()).map_err(|_| KeyError::InvalidCharacter {
        at: 0,
        byte: value[0],
    })
}

/// RFC 8941 section 4.2.5, "Parsing a String", for a value that starts with `"`.
fn unquote(value: &[u8]) -> Result<String, KeyError> {
    let mut key = String::with_capacity(value.len());
    let mut bytes = value.iter().copied().enumerate().skip(1);
    while let Some((at, byte)) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some((_, escaped @ (b'"' | b'\\'))) => key.push(char::from(escaped)),
                _ => return Err(KeyError::BadEscape { at }),
            },
            b'"' if at + 1 == value.len() => return Ok(key),
            b'"' => return Err(KeyError::TrailingCharacters { at: at + 1 }),
            0x20..=0x7e => key.push(char::from(byte)),
            _ => return Err(KeyError::InvalidCharacter { at, byte }),
        }
    }
    Err(KeyError::UnterminatedString)
}

/// Why a key header was refused. Each answers 400 with a problem body that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The header is absent on an endpoint that requires it.
    Missing,
    /// The header appears more than once.
    Repeated,
    /// The header, or the quoted string, is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    TooLong {
        /// The key's length after unquoting.
        len: usize,
    },
    /// A byte outside what the spelling allows.
    InvalidCharacter {
        /// Byte offset in the header value.
        at: usize,
        /// The offending byte.
        byte: u8,
    },
    /// A backslash not followed by `"` or `\` inside a quoted key.
    BadEscape {
        /// Byte offset of the backslash.
        at: usize,
    },
    /// A quoted key without its closing quote.
    UnterminatedString,
    /// Characters after the closing quote of a quoted key.
    TrailingCharacters {
        /// Byte offset of the first character after the closing quote.
        at: usize,
    },
}

impl KeyError {
    /// The error's explanation, naming the source the key was read from.
    pub fn describe(&self, origin: &KeyOrigin) -> String {
        const SPELLINGS: &str = "send 1 to 255 visible ASCII characters (0x21-0x7E), \
                                 or an RFC 8941 quoted string";
        let spellings = match origin {
            KeyOrigin::Header(_) => SPELLINGS,
            KeyOrigin::Field | KeyOrigin::Message | KeyOrigin::Digest => "send a non-empty key",
        };
        match (self, origin) {
            (Self::Missing, KeyOrigin::Header(name)) => {
                format!("this endpoint requires the {name} header; {spellings}")
            }
            (Self::Missing, KeyOrigin::Field) => {
                "this endpoint reads its idempotency key from a field of the request body, \
                 and the request has none"
                    .to_owned()
            }
            (Self::Repeated, KeyOrigin::Header(name)) => {
                format!("send exactly one {name} header")
            }
            (Self::Missing | Self::Repeated, _) => format!("{origin} is missing or repeated"),
            (Self::Empty, _) => format!("{origin} is empty; {spellings}"),
            (Self::TooLong { len }, _) => {
                format!("{origin} is {len} characters long; the limit is {MAX_KEY_LEN}")
            }
            (Self::InvalidCharacter { at, byte }, _) => format!(
                "{origin} has byte 0x{byte:02X} at offset {at}, which is not allowed; {spellings}"
            ),
            (Self::BadEscape { at }, _) => format!(
                "{origin} is a quoted string with a backslash at offset {at} not followed by '\"' or '\\'"
            ),
            (Self::UnterminatedString, _) => {
                format!("{origin} is a quoted string without its closing '\"'")
            }
            (Self::TrailingCharacters { at }, _) => format!(
                "{origin} is a quoted string with characters after its closing '\"' at offset {at}"
            ),
        }
    }
}

/// The explanation for a key read from the `Idempotency-Key` header; see
/// [`KeyError::describe`] for other sources.
impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(&KeyOrigin::IDEMPOTENCY_KEY))
    }
}

impl std::error::Error for KeyError {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse(s.as_bytes()).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn bare_keys() {
        assert_eq!(parse("abc").unwrap(), "abc");
        // Most UUIDs start with a digit: the RFC 8941 token grammar would refuse them.
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(parse(uuid).unwrap(), uuid);
        assert_eq!(parse("a\"b").unwrap(), "a\"b");
        assert_eq!(parse(&"k".repeat(255)).unwrap().len(), 255);
    }

    #[test]
    fn quoted_keys_mean_the_same_key() {
        assert_eq!(parse("\"abc\"").unwrap(), "abc");
        assert_eq!(
            IdempotencyKey::parse(b"\"abc\""),
            IdempotencyKey::parse(b"abc")
        );
        assert_eq!(parse(r#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(parse("\"with space\"").unwrap(), "with space");
        // The limit counts the key, not its quotes.
        assert!(parse(&format!("\"{}\"", "k".repeat(255))).is_ok());
    }

    #[test]
    fn malformed_keys() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
        assert_eq!(parse(&"k".repeat(256)), Err(KeyError::TooLong { len: 256 }));
        assert_eq!(
            parse(&format!("\"{}\"", "k".repeat(256))),
            Err(KeyError::TooLong { len: 256 })
        );
        assert_eq!(
            parse("a b"),
            Err(KeyError::InvalidCharacter { at: 1, byte: b' ' })
        );
        assert_eq!(
            parse("a\tb"),
            Err(KeyError::InvalidCharacter { at: 1, byte: b'\t' })
        );
        assert_eq!(
            IdempotencyKey::parse("clé".as_bytes()),
            Err(KeyError::InvalidCharacter { at: 2, byte: 0xC3 })
        );
        assert_eq!(parse("\"abc"), Err(KeyError::UnterminatedString));
        assert_eq!(parse("\""), Err(KeyError::UnterminatedString));
        assert_eq!(parse("\"a\"b"), Err(KeyError::TrailingCharacters { at: 3 }));
        assert_eq!(parse(r#""a\x""#), Err(KeyError::BadEscape { at: 2 }));
        assert_eq!(parse(r#""a\"#), Err(KeyError::BadEscape { at: 2 }));
        assert_eq!(
            IdempotencyKey::parse(b"\"a\x7fb\""),
            Err(KeyError::InvalidCharacter { at: 2, byte: 0x7f })
        );
    }

    fn text(s: &str) -> Result<String, KeyError> {
        IdempotencyKey::from_text(s).map(|k| k.as_str().to_owned())
    }

    /// Pins the hardening issue's "sf-string unquoting is applied to keys that are not
    /// headers" and "provider event ids over 255 characters, or with spaces or non-ASCII,
    /// can never be processed".
    #[test]
    fn plain_text_keys() {
        // Not unquoted: two keys.
        assert_eq!(text("\"m1\"").unwrap(), "\"m1\"");
        assert_eq!(text("m1").unwrap(), "m1");
        assert_eq!(text(&"k".repeat(255)).unwrap(), "k".repeat(255));
        assert_eq!(text(""), Err(KeyError::Empty));
        // Hashed, stably, into a fixed form.
        let long = "e".repeat(300);
        let hashed = text(&long).unwrap();
        assert_eq!(hashed, text(&long).unwrap());
        assert!(looks_hashed(&hashed), "{hashed}");
        assert_eq!(hashed.len(), HASHED_KEY_PREFIX.len() + 64);
        assert_eq!(
            text("a b").unwrap(),
            // printf 'a b' | sha256sum
            "sha256:c8687a08aa5d6ed2044328fa6a697ab8e96dc34291e8c2034ae8c38e6fcc6d65"
        );
        assert_ne!(text("clé").unwrap(), text("cle").unwrap());
        assert!(looks_hashed(&text("tab\there").unwrap()));
        // A text that looks hashed is hashed again: no two texts share a key.
        assert_ne!(text(&hashed).unwrap(), hashed);
        assert_eq!(text("sha256:short").unwrap(), "sha256:short");
    }

    /// Pins the hardening issue's "`KeyError` names Idempotency-Key when the key came
    /// from elsewhere".
    #[test]
    fn errors_name_their_source() {
        let header = KeyOrigin::Header("X-Event-Id".into());
        assert_eq!(
            KeyError::Missing.describe(&header),
            "this endpoint requires the X-Event-Id header; send 1 to 255 visible ASCII \
             characters (0x21-0x7E), or an RFC 8941 quoted string"
        );
        assert!(KeyError::Empty
            .describe(&header)
            .starts_with("the X-Event-Id header is empty"));
        assert!(KeyError::Empty
            .describe(&KeyOrigin::Field)
            .starts_with("the key field of the request body is empty"));
        assert!(KeyError::Empty
            .describe(&KeyOrigin::Message)
            .starts_with("the run_once key is empty"));
        for origin in [header, KeyOrigin::Field, KeyOrigin::Message] {
            for error in [KeyError::Missing, KeyError::Repeated, KeyError::Empty] {
                assert!(!error.describe(&origin).contains("Idempotency-Key"));
            }
        }
        assert!(KeyError::Empty.to_string().contains("Idempotency-Key"));
    }

    #[test]
    fn header_absent_repeated_or_present() {
        let mut headers = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&headers), Ok(None));
        headers.append(IDEMPOTENCY_KEY, "k1".parse().unwrap());
        assert_eq!(
            IdempotencyKey::from_headers(&headers)
                .unwrap()
                .unwrap()
                .as_str(),
            "k1"
        );
        headers.append(IDEMPOTENCY_KEY, "k1".parse().unwrap());
        assert_eq!(
            IdempotencyKey::from_headers(&headers),
            Err(KeyError::Repeated)
        );
    }

    proptest! {
        #[test]
        fn never_panics_and_accepts_only_valid_keys(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(key) = IdempotencyKey::parse(&bytes) {
                let key = key.as_str();
                prop_assert!(!key.is_empty() && key.len() <= MAX_KEY_LEN);
                prop_assert!(key.bytes().all(|b| (0x20..=0x7e).contains(&b)));
            }
        }

        #[test]
        fn quoting_round_trips(key in "[\\x20-\\x7e]{1,255}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(parse(&quoted).unwrap(), key.clone());
            if !key.starts_with('"') && !key.contains(' ') {
                prop_assert_eq!(parse(&key).unwrap(), key);
            }
        }
    }

    /// Regression (issue 27, 8): a correctly signed Standard Webhooks delivery whose id
    /// the header rules refuse (256 bytes, a tab) was answered 400 on every redelivery.
    #[test]
    fn a_signed_id_the_header_rules_refuse_is_hashed() {
        let mut headers = HeaderMap::new();
        let long = "m".repeat(256);
        for (id, hashed) in [("msg_1", false), (long.as_str(), true), ("msg\t1", true)] {
            headers.insert("webhook-id", http::HeaderValue::from_str(id).unwrap());
            let key = IdempotencyKey::from_signed_header(&headers, "webhook-id")
                .unwrap()
                .unwrap();
            assert_eq!(
                key.as_str().starts_with(HASHED_KEY_PREFIX),
                hashed,
                "{id:?}"
            );
            assert_eq!(key, IdempotencyKey::from_text(id).unwrap());
        }
        headers.insert(
            "webhook-id",
            http::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        );
        let key = IdempotencyKey::from_signed_header(&headers, "webhook-id");
        assert!(key
            .unwrap()
            .unwrap()
            .as_str()
            .starts_with(HASHED_KEY_PREFIX));
        headers.append("webhook-id", http::HeaderValue::from_static("again"));
        assert_eq!(
            IdempotencyKey::from_signed_header(&headers, "webhook-id"),
            Err(KeyError::Repeated)
        );
    }
}
