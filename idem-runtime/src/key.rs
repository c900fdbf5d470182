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

use std::fmt;

use http::header::{HeaderMap, HeaderName};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters, counted after unquoting.
pub const MAX_KEY_LEN: usize = 255;

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
        let mut values = headers.get_all(name).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes()).map(Some)
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

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SPELLINGS: &str = "send 1 to 255 visible ASCII characters (0x21-0x7E), \
                                 or an RFC 8941 quoted string";
        match self {
            Self::Missing => write!(f, "this endpoint requires an Idempotency-Key header; {SPELLINGS}"),
            Self::Repeated => f.write_str("send exactly one Idempotency-Key header"),
            Self::Empty => write!(f, "the Idempotency-Key is empty; {SPELLINGS}"),
            Self::TooLong { len } => write!(
                f,
                "the Idempotency-Key is {len} characters long; the limit is {MAX_KEY_LEN}"
            ),
            Self::InvalidCharacter { at, byte } => write!(
                f,
                "the Idempotency-Key has byte 0x{byte:02X} at offset {at}, which is not allowed; {SPELLINGS}"
            ),
            Self::BadEscape { at } => write!(
                f,
                "the quoted Idempotency-Key has a backslash at offset {at} not followed by '\"' or '\\'"
            ),
            Self::UnterminatedString => {
                f.write_str("the quoted Idempotency-Key has no closing '\"'")
            }
            Self::TrailingCharacters { at } => write!(
                f,
                "the quoted Idempotency-Key has characters after its closing '\"' at offset {at}"
            ),
        }
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
}
