//! The request fingerprint: what makes a retry "the same request".
//!
//! A fingerprint is SHA-256 over a canonical, domain-separated encoding of
//!
//! 1. a format version,
//! 2. the target: scope, method, matched route, the raw path parameters and, when the
//!    request has one, its query string in canonical form ([`FingerprintBuilder::query`]),
//! 3. each named field as (name, value), in declared order.
//!
//! Values are encoded from the typed, deserialized value through `serde`, with a
//! [`Serializer`](serde::Serializer) that writes straight into the hasher: whitespace
//! and key order in the client's JSON never matter, map and struct entries are sorted,
//! and every value is tagged and self-delimiting (strings and bytes are length-prefixed,
//! sequences and maps are bracketed), so no two different values encode alike.
//!
//! Sequences keep their order, except an unordered set's: a `HashSet` serializes in
//! hash order, which differs between two sets of the same elements, so its elements
//! are encoded aside and written sorted by their encodings (see [`is_unordered_set`]).
//!
//! Beside the combined hash, each field keeps its own hash. After a deploy that changes
//! an endpoint's `fields`, a retry is compared on the fields both versions share
//! instead of being refused by the new list ([`Fingerprint::matches`]).

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::ser::{self, Serialize};
use sha2::{Digest, Sha256};

/// A SHA-256 digest.
pub(crate) type Digest32 = [u8; 32];

const VERSION: &[u8] = b"idem.fingerprint.v1";

/// The name under which the whole body is hashed when an endpoint names no fields.
/// No Rust field can be called this, so it never collides with a named field.
pub(crate) const WHOLE_BODY: &str = "";

/// The fingerprint of one request: the combined hash and its parts.
#[derive(Clone, PartialEq, Eq)]
pub struct Fingerprint {
    combined: Digest32,
    target: Digest32,
    /// Named by the endpoint's code, or read back from a stored request
    /// ([`Fingerprint::stored`]).
    fields: Vec<(Cow<'static, str>, Digest32)>,
}

impl Fingerprint {
    /// Starts a fingerprint for a request to `scope`, with the route's method, matched
    /// path and raw path parameters (in route order).
    pub fn builder<'a>(
        scope: &str,
        method: &str,
        matched_path: &str,
        params: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> FingerprintBuilder {
        let mut hasher = domain(b't');
        put_str(&mut hasher, scope.as_bytes());
        put_str(&mut hasher, method.as_bytes());
        put_str(&mut hasher, matched_path.as_bytes());
        for (name, value) in params {
            hasher.put(&[tag::SEQ]);
            put_str(&mut hasher, name.as_bytes());
            put_str(&mut hasher, value.as_bytes());
        }
        hasher.put(&[tag::END]);
        FingerprintBuilder {
            target: hasher.finalize().into(),
            fields: Vec::new(),
        }
    }

    /// The combined hash, compared first.
    pub fn combined(&self) -> &Digest32 {
        &self.combined
    }

    /// The fingerprint a request's steps were stored with, read back (the completer
    /// abandons a request under it): its combined hash and its `parts`
    /// ([`Fingerprint::parts`]), so that it matches a retry as the request it was taken
    /// from does, also across a deploy that changed `fields`. Without readable parts
    /// (a request stored before they were kept), its combined hash alone: it matches the
    /// request it was taken from, and no other.
    pub(crate) fn stored(combined: Digest32, parts: &[u8]) -> Self {
        let (target, fields) = match StoredParts::decode(parts) {
            Some(stored) => (
                stored.target,
                stored
                    .fields
                    .into_iter()
                    .filter_map(|(name, hash)| {
                        Some((Cow::Owned(name.to_owned()), hash.try_into().ok()?))
                    })
                    .collect(),
            ),
            None => ([0; 32], Vec::new()),
        };
        Self {
            combined,
            target,
            fields,
        }
    }

    /// Whether a request with this fingerprint is a retry of the request stored as
    /// (`combined`, `parts`), where `parts` is what [`Fingerprint::parts`] produced.
    ///
    /// Equal combined hashes match. Otherwise the targets must be equal and the field
    /// lists, when they differ (a deploy changed `fields`, or only reordered it), must
    /// share at least one field and agree on every shared one. Fields are compared by
    /// name, as a set: the combined hash follows the declared order, but a retry is the
    /// same request whatever order a deploy lists its fields in. Unreadable stored parts
    /// never match.
    pub fn matches(&self, combined: &[u8], parts: &[u8]) -> bool {
        if combined == self.combined {
            return true;
        }
        let Some(stored) = StoredParts::decode(parts) else {
            return false;
        };
        if stored.target != self.target {
            return false;
        }
        let stored = stored.fields;
        let mut shared = 0;
        for (name, hash) in &self.fields {
            if let Some((_, stored_hash)) = stored.iter().find(|(n, _)| *n == name.as_ref()) {
                if stored_hash != hash {
                    return false;
                }
                shared += 1;
            }
        }
        shared > 0
    }

    /// The target and per-field hashes, in the compact form stored beside the combined
    /// hash: the 32-byte target, then per field a big-endian `u16` name length, the
    /// name and its 32-byte hash.
    pub fn parts(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.fields.len() * 48);
        out.extend_from_slice(&self.target);
        for (name, hash) in &self.fields {
            // Field names are Rust identifiers; a longer name is cut, which can only make
            // a later comparison stricter, never looser.
            let name = &name.as_bytes()[..name.len().min(usize::from(u16::MAX))];
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name);
            out.extend_from_slice(hash);
        }
        out
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fingerprint")
            .field("combined", &hex(&self.combined))
            .field(
                "fields",
                &self.fields.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// [`Fingerprint::parts`] read back.
struct StoredParts<'a> {
    target: Digest32,
    fields: Vec<(&'a str, &'a [u8])>,
}

impl<'a> StoredParts<'a> {
    fn decode(mut parts: &'a [u8]) -> Option<Self> {
        let target: Digest32 = parts.get(..32)?.try_into().ok()?;
        parts = &parts[32..];
        let mut fields = Vec::new();
        while !parts.is_empty() {
            let len = usize::from(u16::from_be_bytes(parts.get(..2)?.try_into().ok()?));
            let name = std::str::from_utf8(parts.get(2..2 + len)?).ok()?;
            let hash = parts.get(2 + len..2 + len + 32)?;
            fields.push((name, hash));
            parts = &parts[2 + len + 32..];
        }
        Some(Self { target, fields })
    }
}

/// Collects the named fields of one request; see [`Fingerprint::builder`].
#[derive(Debug)]
pub struct FingerprintBuilder {
    target: Digest32,
    fields: Vec<(Cow<'static, str>, Digest32)>,
}

impl FingerprintBuilder {
    /// Adds one named field. Fails only when the value's own `Serialize`
    /// implementation reports an error.
    ///
    /// A field's hash has no version of its own: field hashes are only ever compared
    /// between fingerprints whose targets (which carry the version) are equal.
    pub fn field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        let mut hasher = Sha256::new();
        hasher.put(b"f");
        put_str(&mut hasher, name.as_bytes());
        value.serialize(Encoder::of::<T>(&mut hasher))?;
        self.fields
            .push((Cow::Borrowed(name), hasher.finalize().into()));
        Ok(())
    }

    /// Adds the request's raw query string (without `?`) to the target, canonically:
    /// each `name=value` pair percent-decoded with `+` as a space (as HTML forms and
    /// `serde_urlencoded` read it), the pairs sorted by name, a repeated name's values
    /// kept in the order they came. So `?b=2&a=1` and `?a=%31&b=2` are the same target,
    /// and `?amount=1` and `?amount=2` are not, nor `?a=1&a=2` and `?a=2&a=1`: an
    /// extractor that reads a repeated name as a list sees its values in order. (Sorting
    /// by name only changes nothing for a query whose names are all different, so such
    /// targets are as before.)
    ///
    /// A query without pairs (none, `?` or `?&`) leaves the target exactly as it was
    /// before queries were fingerprinted, so keys stored by earlier versions keep
    /// matching; a non-empty one is hashed with the old target under a domain of its own.
    pub fn query(&mut self, raw: &str) {
        let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = raw
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                (form_decode(name), form_decode(value))
            })
            .collect();
        if pairs.is_empty() {
            return;
        }
        // Stable: the values of one name keep their order.
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut hasher = domain(b'q');
        hasher.put(&self.target);
        put_len(&mut hasher, pairs.len());
        for (name, value) in &pairs {
            put_tagged(&mut hasher, tag::BYTES, name);
            put_tagged(&mut hasher, tag::BYTES, value);
        }
        self.target = hasher.finalize().into();
    }

    /// Adds the whole body, for endpoints that name no fields.
    pub fn whole_body<T: Serialize + ?Sized>(&mut self, body: &T) -> Result<(), FingerprintError> {
        self.field(WHOLE_BODY, body)
    }

    /// Combines the target and the fields, in the order they were added. Each field's
    /// digest covers its name; digests are fixed-size, so the count makes it unambiguous.
    pub fn finish(self) -> Fingerprint {
        let mut hasher = domain(b'c');
        hasher.put(&self.target);
        put_len(&mut hasher, self.fields.len());
        for (_, hash) in &self.fields {
            hasher.put(hash);
        }
        Fingerprint {
            combined: hasher.finalize().into(),
            target: self.target,
            fields: self.fields,
        }
    }
}

/// `application/x-www-form-urlencoded` decoding of one name or value: `+` is a space,
/// `%XX` a byte; a `%` not followed by two hex digits stands for itself.
fn form_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = |at: usize| bytes.get(at).and_then(|b| (*b as char).to_digit(16));
                if let (Some(hi), Some(lo)) = (hex(i + 1), hex(i + 2)) {
                    out.push((hi * 16 + lo) as u8);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            byte => out.push(byte),
        }
        i += 1;
    }
    out
}

/// The digest a request is keyed by under `key = digest(body)`: the canonical encoding
/// of the whole body, under a domain of its own, so that it is never equal to a field's
/// or a fingerprint's hash. Fails only when the value's own `Serialize` implementation
/// reports an error.
pub(crate) fn key_digest<T: Serialize + ?Sized>(body: &T) -> Result<Digest32, FingerprintError> {
    let mut hasher = domain(b'k');
    body.serialize(Encoder::of::<T>(&mut hasher))?;
    Ok(hasher.finalize().into())
}

fn domain(kind: u8) -> Sha256 {
    let mut hasher = Sha256::new();
    put_str(&mut hasher, VERSION);
    hasher.put(&[kind]);
    hasher
}

/// The bytes `text` spells in hex digits (either case), two a byte; `None` when it
/// spells none.
pub(crate) fn unhex(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| {
        char::from(c)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    text.chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A value's `Serialize` implementation failed. It carries the implementation's message,
/// all serde passes on (`serde::ser::Error::custom`), and no source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintError(String);

impl fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot fingerprint the request: {}", self.0)
    }
}

impl std::error::Error for FingerprintError {}

impl ser::Error for FingerprintError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

/// One byte in front of every value says what follows. Every encoding starts with a tag
/// and none starts with [`tag::END`], so bracketed sequences are unambiguous.
mod encode;
#[cfg(test)]
mod tests;

use encode::*;
