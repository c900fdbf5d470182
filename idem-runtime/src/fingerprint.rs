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

/// A value's `Serialize` implementation failed.
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
mod tag {
    pub(super) const UNIT: u8 = b'u';
    pub(super) const NONE: u8 = b'n';
    pub(super) const SOME: u8 = b'o';
    pub(super) const BOOL: u8 = b'B';
    /// Any integer in `i128`'s range, whatever its Rust type: 16 bytes, big-endian.
    pub(super) const INT: u8 = b'i';
    /// A `u128` above `i128::MAX`.
    pub(super) const BIG: u8 = b'I';
    /// Any float, widened to `f64`.
    pub(super) const FLOAT: u8 = b'F';
    pub(super) const STR: u8 = b's';
    pub(super) const BYTES: u8 = b'b';
    pub(super) const SEQ: u8 = b'l';
    pub(super) const MAP: u8 = b'm';
    pub(super) const VARIANT: u8 = b'v';
    pub(super) const END: u8 = b'.';
}

trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Lengths are big-endian `u32`: no request body comes near 4 GiB.
fn put_len(out: &mut impl Sink, len: usize) {
    out.put(&(len as u32).to_be_bytes());
}

/// A tag and a length in one write: the hasher's per-call cost matters at this size.
fn put_tagged(out: &mut impl Sink, tag: u8, bytes: &[u8]) {
    let mut head = [tag, 0, 0, 0, 0];
    head[1..].copy_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.put(&head);
    out.put(bytes);
}

fn put_str(out: &mut impl Sink, bytes: &[u8]) {
    put_tagged(out, tag::STR, bytes);
}

fn put_int(out: &mut impl Sink, value: i128) {
    let mut encoded = [tag::INT; 17];
    encoded[1..].copy_from_slice(&value.to_be_bytes());
    out.put(&encoded);
}

/// Encodes one value into `out`. `ty` is the name of the value's Rust type, which
/// `serde` does not pass on: the one thing it tells is whether a sequence is an
/// unordered set (see [`is_unordered_set`]).
struct Encoder<'a, W> {
    out: &'a mut W,
    ty: &'static str,
}

impl<'a, W> Encoder<'a, W> {
    /// The encoder of a value of type `T`. Wherever a value's type is known (a field, an
    /// element, a map's key or value, inside `Some` or a newtype), it is encoded with
    /// this, so that a set is recognised at any depth.
    fn of<T: ?Sized>(out: &'a mut W) -> Self {
        Self {
            out,
            ty: std::any::type_name::<T>(),
        }
    }
}

/// Whether `ty`, a [`type_name`](std::any::type_name), names a set whose `Serialize`
/// iterates in an order that is not the elements' own: `std`'s and `hashbrown`'s
/// `HashSet` (with any hasher), `ahash`'s `AHashSet`, `dashmap`'s `DashSet`, also
/// behind `&`, `Box`, `Rc`, `Arc` or `Cow`, whose `Serialize` is the set's.
///
/// Two sets of the same elements iterate in different orders (each `HashSet` has its
/// own random hasher keys), so encoded in iteration order the same request would
/// fingerprint differently nearly every time. Ordered sets (`BTreeSet`) and sets kept
/// in insertion order (`IndexSet`, whose order a handler can see) keep their order.
/// A set whose type the encoder does not see is not recognised: one behind
/// `#[serde(transparent)]`, `serialize_with` or a `Serialize` impl of one's own;
/// a `BTreeSet` is canonical there.
fn is_unordered_set(ty: &str) -> bool {
    let mut ty = ty;
    loop {
        if let Some(rest) = ty.strip_prefix("&mut ").or_else(|| ty.strip_prefix('&')) {
            ty = rest;
            continue;
        }
        let (path, args) = ty.split_once('<').unwrap_or((ty, ""));
        // `Serialize` of these is their content's: look inside.
        if matches!(
            path,
            "alloc::boxed::Box" | "alloc::rc::Rc" | "alloc::sync::Arc" | "alloc::borrow::Cow"
        ) {
            // `Cow<'_, T>`: past the lifetime.
            ty = match args.strip_prefix('\'') {
                Some(lifetime) => lifetime.split_once(", ").map_or("", |(_, rest)| rest),
                None => args,
            };
            continue;
        }
        // A slice, array, tuple, pointer or `dyn` is no set, whatever it holds.
        if !path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
        {
            return false;
        }
        let name = path.rsplit("::").next().unwrap_or(path);
        return matches!(name, "HashSet" | "AHashSet" | "DashSet");
    }
}

#[cfg(test)]
fn encode_to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, FingerprintError> {
    let mut buf = Vec::new();
    value.serialize(Encoder::of::<T>(&mut buf))?;
    Ok(buf)
}

impl<'a, W: Sink> ser::Serializer for Encoder<'a, W> {
    type Ok = ();
    type Error = FingerprintError;
    type SerializeSeq = Seq<'a, W>;
    type SerializeTuple = Seq<'a, W>;
    type SerializeTupleStruct = Seq<'a, W>;
    type SerializeTupleVariant = Seq<'a, W>;
    type SerializeMap = Map<'a, W>;
    type SerializeStruct = Map<'a, W>;
    type SerializeStructVariant = Map<'a, W>;

    fn serialize_bool(self, v: bool) -> Result<(), FingerprintError> {
        self.out.put(&[tag::BOOL, u8::from(v)]);
        Ok(())
    }

    fn serialize_i8(self, v: i8) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i16(self, v: i16) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i32(self, v: i32) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i64(self, v: i64) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_i128(self, v: i128) -> Result<(), FingerprintError> {
        put_int(self.out, v);
        Ok(())
    }

    fn serialize_u8(self, v: u8) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_u16(self, v: u16) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_u32(self, v: u32) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_u64(self, v: u64) -> Result<(), FingerprintError> {
        self.serialize_i128(v.into())
    }

    fn serialize_u128(self, v: u128) -> Result<(), FingerprintError> {
        match i128::try_from(v) {
            Ok(v) => put_int(self.out, v),
            Err(_) => {
                self.out.put(&[tag::BIG]);
                self.out.put(&v.to_be_bytes());
            }
        }
        Ok(())
    }

    fn serialize_f32(self, v: f32) -> Result<(), FingerprintError> {
        self.serialize_f64(v.into())
    }

    fn serialize_f64(self, v: f64) -> Result<(), FingerprintError> {
        // -0.0 == 0.0: equal values encode alike.
        let v = if v == 0.0 { 0.0 } else { v };
        let mut encoded = [tag::FLOAT; 9];
        encoded[1..].copy_from_slice(&v.to_bits().to_be_bytes());
        self.out.put(&encoded);
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result<(), FingerprintError> {
        self.serialize_str(v.encode_utf8(&mut [0; 4]))
    }

    fn serialize_str(self, v: &str) -> Result<(), FingerprintError> {
        put_str(self.out, v.as_bytes());
        Ok(())
    }

    fn serialize_bytes(self, v: &[u8]) -> Result<(), FingerprintError> {
        put_tagged(self.out, tag::BYTES, v);
        Ok(())
    }

    fn serialize_none(self) -> Result<(), FingerprintError> {
        self.out.put(&[tag::NONE]);
        Ok(())
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), FingerprintError> {
        self.out.put(&[tag::SOME]);
        value.serialize(Encoder::of::<T>(self.out))
    }

    fn serialize_unit(self) -> Result<(), FingerprintError> {
        self.out.put(&[tag::UNIT]);
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), FingerprintError> {
        self.serialize_unit()
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), FingerprintError> {
        put_variant(self.out, variant);
        self.out.put(&[tag::UNIT]);
        Ok(())
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        value.serialize(Encoder::of::<T>(self.out))
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        put_variant(self.out, variant);
        value.serialize(Encoder::of::<T>(self.out))
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<Seq<'a, W>, FingerprintError> {
        self.out.put(&[tag::SEQ]);
        let unordered = is_unordered_set(self.ty).then(|| Elements {
            buf: Vec::new(),
            ranges: Vec::with_capacity(len.unwrap_or(0)),
        });
        Ok(Seq {
            out: self.out,
            unordered,
        })
    }

    fn serialize_tuple(self, _len: usize) -> Result<Seq<'a, W>, FingerprintError> {
        Ok(Seq::ordered(self.out))
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Seq<'a, W>, FingerprintError> {
        Ok(Seq::ordered(self.out))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Seq<'a, W>, FingerprintError> {
        put_variant(self.out, variant);
        Ok(Seq::ordered(self.out))
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Map<'a, W>, FingerprintError> {
        let len = len.unwrap_or(0);
        Ok(Map {
            out: self.out,
            buf: Vec::with_capacity(len * 24),
            entries: Vec::with_capacity(len),
            key: None,
        })
    }

    fn serialize_struct(
        self,
        _name: &'static str,
        len: usize,
    ) -> Result<Map<'a, W>, FingerprintError> {
        self.serialize_map(Some(len))
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Map<'a, W>, FingerprintError> {
        put_variant(self.out, variant);
        self.serialize_map(Some(len))
    }
}

/// Variants are identified by name, so reordering an enum keeps its fingerprints.
fn put_variant(out: &mut impl Sink, variant: &str) {
    put_tagged(out, tag::VARIANT, variant.as_bytes());
}

/// Sequences and tuples: `[tag::SEQ]`, the elements, `[tag::END]`. The elements of an
/// unordered set are encoded aside and written sorted by their encodings, which are
/// self-delimiting: equal sets write the same bytes whatever their iteration order, and
/// different sets different bytes. So a set encodes like the sequence of its elements
/// in that order.
struct Seq<'a, W> {
    out: &'a mut W,
    unordered: Option<Elements>,
}

/// An unordered set's elements, encoded one after another in `buf`; `ranges` holds
/// each one's place in it.
struct Elements {
    buf: Vec<u8>,
    ranges: Vec<Range<usize>>,
}

impl<'a, W: Sink> Seq<'a, W> {
    fn ordered(out: &'a mut W) -> Self {
        out.put(&[tag::SEQ]);
        Self {
            out,
            unordered: None,
        }
    }

    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FingerprintError> {
        match &mut self.unordered {
            None => value.serialize(Encoder::of::<T>(&mut *self.out)),
            Some(elements) => {
                let start = elements.buf.len();
                value.serialize(Encoder::of::<T>(&mut elements.buf))?;
                elements.ranges.push(start..elements.buf.len());
                Ok(())
            }
        }
    }

    fn close(mut self) -> Result<(), FingerprintError> {
        if let Some(Elements { buf, mut ranges }) = self.unordered.take() {
            ranges.sort_unstable_by(|a, b| buf[a.clone()].cmp(&buf[b.clone()]));
            for range in ranges {
                self.out.put(&buf[range]);
            }
        }
        self.out.put(&[tag::END]);
        Ok(())
    }
}

impl<W: Sink> ser::SerializeSeq for Seq<'_, W> {
    type Ok = ();
    type Error = FingerprintError;

    fn serialize_element<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.element(value)
    }

    fn end(self) -> Result<(), FingerprintError> {
        self.close()
    }
}

impl<W: Sink> ser::SerializeTuple for Seq<'_, W> {
    type Ok = ();
    type Error = FingerprintError;

    fn serialize_element<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.element(value)
    }

    fn end(self) -> Result<(), FingerprintError> {
        self.close()
    }
}

impl<W: Sink> ser::SerializeTupleStruct for Seq<'_, W> {
    type Ok = ();
    type Error = FingerprintError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.element(value)
    }

    fn end(self) -> Result<(), FingerprintError> {
        self.close()
    }
}

impl<W: Sink> ser::SerializeTupleVariant for Seq<'_, W> {
    type Ok = ();
    type Error = FingerprintError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.element(value)
    }

    fn end(self) -> Result<(), FingerprintError> {
        self.close()
    }
}

/// Maps and structs alike: entries are encoded aside, sorted by their encoded key, then
/// written. A struct therefore encodes like a map with its field names as string keys,
/// so the body type may move between the two without changing fingerprints. All of a
/// map's entries share one buffer; `entries` holds their ranges in it.
struct Map<'a, W> {
    out: &'a mut W,
    buf: Vec<u8>,
    entries: Vec<(Range<usize>, Range<usize>)>,
    key: Option<Range<usize>>,
}

impl<W: Sink> Map<'_, W> {
    fn close(mut self) -> Result<(), FingerprintError> {
        let buf = &self.buf;
        self.entries
            .sort_unstable_by(|a, b| buf[a.0.clone()].cmp(&buf[b.0.clone()]));
        self.out.put(&[tag::MAP]);
        put_len(self.out, self.entries.len());
        for (key, value) in &self.entries {
            self.out.put(&buf[key.clone()]);
            self.out.put(&buf[value.clone()]);
        }
        Ok(())
    }

    fn encode<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<Range<usize>, FingerprintError> {
        let start = self.buf.len();
        value.serialize(Encoder::of::<T>(&mut self.buf))?;
        Ok(start..self.buf.len())
    }

    fn struct_field<T: Serialize + ?Sized>(
        &mut self,
        name: &str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        let start = self.buf.len();
        put_str(&mut self.buf, name.as_bytes());
        let key = start..self.buf.len();
        let value = self.encode(value)?;
        self.entries.push((key, value));
        Ok(())
    }
}

impl<W: Sink> ser::SerializeMap for Map<'_, W> {
    type Ok = ();
    type Error = FingerprintError;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), FingerprintError> {
        self.key = Some(self.encode(key)?);
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<(), FingerprintError> {
        let key = self
            .key
            .take()
            .ok_or_else(|| FingerprintError("map value serialized before its key".into()))?;
        let value = self.encode(value)?;
        self.entries.push((key, value));
        Ok(())
    }

    fn end(self) -> Result<(), FingerprintError> {
        self.close()
    }
}

impl<W: Sink> ser::SerializeStruct for Map<'_, W> {
    type Ok = ();
    type Error = FingerprintError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.struct_field(name, value)
    }

    fn end(self) -> Result<(), FingerprintError> {
        self.close()
    }
}

impl<W: Sink> ser::SerializeStructVariant for Map<'_, W> {
    type Ok = ();
    type Error = FingerprintError;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.struct_field(name, value)
    }

    fn end(self) -> Result<(), FingerprintError> {
        self.close()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

    use proptest::prelude::*;
    use serde::{Deserialize, Serialize};
    use serde_json::{json, Value};

    use super::*;

    fn encode(value: &impl Serialize) -> Vec<u8> {
        encode_to_vec(value).unwrap()
    }

    fn fingerprint(fields: &[(&'static str, &Value)]) -> Fingerprint {
        let mut builder = Fingerprint::builder("charges", "POST", "/charges", []);
        for (name, value) in fields {
            builder.field(name, value).unwrap();
        }
        builder.finish()
    }

    #[derive(Deserialize, Serialize)]
    struct Charge {
        amount: i64,
        currency: String,
        customer: String,
        metadata: HashMap<String, Value>,
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a: Charge = serde_json::from_str(
            r#"{"amount":100,"currency":"usd","customer":"c1","metadata":{"x":1,"y":{"b":2,"a":[1,2]}}}"#,
        )
        .unwrap();
        let b: Charge = serde_json::from_str(
            "{ \"metadata\" : { \"y\": {\"a\": [1, 2], \"b\": 2}, \"x\": 1 },\n  \"customer\": \"c1\", \"currency\": \"usd\", \"amount\": 100 }",
        )
        .unwrap();
        assert_eq!(encode(&a), encode(&b));
    }

    #[test]
    fn structs_encode_like_maps() {
        let charge = Charge {
            amount: 1,
            currency: "usd".into(),
            customer: "c".into(),
            metadata: HashMap::new(),
        };
        let map: BTreeMap<&str, Value> = [
            ("customer", json!("c")),
            ("amount", json!(1)),
            ("metadata", json!({})),
            ("currency", json!("usd")),
        ]
        .into();
        assert_eq!(encode(&charge), encode(&map));
    }

    #[test]
    fn integer_types_agree_but_never_with_strings_or_floats() {
        assert_eq!(encode(&1_u8), encode(&1_i64));
        assert_eq!(encode(&u64::MAX), encode(&u128::from(u64::MAX)));
        assert_ne!(encode(&u128::MAX), encode(&-1_i128));
        assert_ne!(encode(&1_i64), encode(&"1"));
        assert_ne!(encode(&1_i64), encode(&1.0_f64));
        assert_ne!(encode(&true), encode(&1));
        assert_ne!(encode(&Option::<i32>::None), encode(&()));
        assert_ne!(encode(&Some(())), encode(&()));
    }

    #[test]
    fn strings_that_contain_separators_stay_apart() {
        // Without length prefixes these pairs would concatenate to the same bytes.
        assert_ne!(encode(&("ab", "c")), encode(&("a", "bc")));
        assert_ne!(encode(&vec!["a.", "b"]), encode(&vec!["a", ".b"]));
        assert_ne!(
            encode(&json!({"a": "b\"c"})),
            encode(&json!({"a\":\"b": "c"}))
        );
        assert_ne!(encode(&json!([["a"], []])), encode(&json!([[], ["a"]])));
        assert_ne!(
            encode(&json!({"a": {"b": 1}})),
            encode(&json!({"a": {}, "b": 1}))
        );
    }

    #[test]
    fn field_names_and_values_are_bound_together() {
        let one = json!(1);
        let two = json!(2);
        assert_ne!(
            fingerprint(&[("amount", &one), ("fee", &two)]),
            fingerprint(&[("amount", &two), ("fee", &one)])
        );
        assert_ne!(
            fingerprint(&[("amount", &one)]),
            fingerprint(&[("fee", &one)])
        );
        assert_eq!(
            fingerprint(&[("amount", &one)]),
            fingerprint(&[("amount", &json!(1))])
        );
    }

    #[test]
    fn the_target_is_part_of_the_fingerprint() {
        let build = |scope, method, path, id| {
            let mut b = Fingerprint::builder(scope, method, path, [("id", id)]);
            b.field("amount", &5).unwrap();
            b.finish()
        };
        let base = build("refunds", "POST", "/charges/{id}/refunds", "ch_1");
        assert_eq!(
            base,
            build("refunds", "POST", "/charges/{id}/refunds", "ch_1")
        );
        assert_ne!(
            base,
            build("refunds", "POST", "/charges/{id}/refunds", "ch_2")
        );
        assert_ne!(
            base,
            build("refunds", "PUT", "/charges/{id}/refunds", "ch_1")
        );
        assert_ne!(
            base,
            build("other", "POST", "/charges/{id}/refunds", "ch_1")
        );
        assert!(!base.matches(
            build("refunds", "POST", "/charges/{id}/refunds", "ch_2").combined(),
            &build("refunds", "POST", "/charges/{id}/refunds", "ch_2").parts()
        ));
    }

    #[test]
    fn a_changed_field_list_compares_the_shared_fields() {
        let (amount, currency, customer) = (json!(100), json!("usd"), json!("c1"));
        let old = fingerprint(&[("amount", &amount), ("currency", &currency)]);
        let new = fingerprint(&[
            ("amount", &amount),
            ("currency", &currency),
            ("customer", &customer),
        ]);
        assert_ne!(old.combined(), new.combined());
        assert!(new.matches(old.combined(), &old.parts()));
        assert!(old.matches(new.combined(), &new.parts()));

        let changed = fingerprint(&[
            ("amount", &json!(200)),
            ("currency", &currency),
            ("customer", &customer),
        ]);
        assert!(!changed.matches(old.combined(), &old.parts()));
        // Same names, one value differs: no match.
        let other = fingerprint(&[("amount", &amount), ("currency", &json!("eur"))]);
        assert!(!other.matches(old.combined(), &old.parts()));
        // Nothing shared: no match.
        let disjoint = fingerprint(&[("customer", &customer)]);
        assert!(!disjoint.matches(old.combined(), &old.parts()));
        // Garbage parts never match.
        assert!(!new.matches(&[0; 32], b"short"));
    }

    /// Pins the hardening issue's "reordering `fields` in a deploy turns every retry
    /// into 422": shared fields are compared as a set, by name.
    #[test]
    fn a_reordered_field_list_still_matches() {
        let (amount, currency, customer) = (json!(100), json!("usd"), json!("c1"));
        let old = fingerprint(&[("amount", &amount), ("currency", &currency)]);
        let reordered = fingerprint(&[("currency", &currency), ("amount", &amount)]);
        assert_ne!(old.combined(), reordered.combined());
        assert!(reordered.matches(old.combined(), &old.parts()));
        assert!(old.matches(reordered.combined(), &reordered.parts()));
        // Reordered and extended.
        let grown = fingerprint(&[
            ("customer", &customer),
            ("currency", &currency),
            ("amount", &amount),
        ]);
        assert!(grown.matches(old.combined(), &old.parts()));
        // Reordered with one value changed: still a mismatch.
        let changed = fingerprint(&[("currency", &json!("eur")), ("amount", &amount)]);
        assert!(!changed.matches(old.combined(), &old.parts()));
    }

    /// Pins the hardening issue's "the query string is not part of the target".
    #[test]
    fn the_query_is_part_of_the_target_canonically() {
        let build = |query: Option<&str>| {
            let mut b = Fingerprint::builder("q", "POST", "/q", []);
            if let Some(query) = query {
                b.query(query);
            }
            b.field("note", &"x").unwrap();
            b.finish()
        };
        let plain = build(None);
        // No pairs: byte-identical to a target built without a query.
        for empty in ["", "&", "&&"] {
            assert_eq!(build(Some(empty)), plain, "{empty:?}");
        }
        let one = build(Some("amount=1"));
        assert_ne!(one, plain);
        assert_ne!(one, build(Some("amount=2")));
        assert!(!one.matches(
            build(Some("amount=2")).combined(),
            &build(Some("amount=2")).parts()
        ));
        assert_eq!(build(Some("a=1&b=x y")), build(Some("b=x+y&a=%31")));
        assert_eq!(build(Some("b=x%20y&a=1")), build(Some("a=1&b=x+y")));
        assert_eq!(build(Some("a=%e2%82%AC")), build(Some("a=%E2%82%ac")));
        // A literal plus and a space differ; a stray percent stands for itself.
        assert_ne!(build(Some("a=%2B")), build(Some("a=+")));
        assert_eq!(build(Some("a=%zz%")), build(Some("a=%25zz%25")));
        // Separators inside names and values stay apart.
        assert_ne!(build(Some("a=b%26c")), build(Some("a=b&c")));
        assert_ne!(build(Some("a%3Db=c")), build(Some("a=b%3Dc")));
        assert_ne!(build(Some("a=1&a=2")), build(Some("a=1")));
    }

    /// Pins issue 19's "repeated query names are sorted with their values": `?a=1&a=2`
    /// was the target of `?a=2&a=1`, while an extractor that reads `a` as a list sees
    /// `[1, 2]` and `[2, 1]`.
    #[test]
    fn a_repeated_query_name_keeps_its_values_in_order() {
        let build = |query: &str| {
            let mut b = Fingerprint::builder("q", "POST", "/q", []);
            b.query(query);
            b.finish()
        };
        assert_ne!(build("a=1&a=2"), build("a=2&a=1"));
        assert_ne!(build("a=1&b=x&a=2"), build("a=2&b=x&a=1"));
        // Other names still move freely around them, and the values' order survives.
        assert_eq!(build("a=1&b=x&a=2"), build("b=x&a=1&a=2"));
        assert_eq!(build("a=1&a=2&b=x"), build("a=1&b=x&a=2"));
        assert_eq!(build("b=x&a=1&c=y&a=2"), build("c=y&a=1&a=2&b=x"));
        // Decoding comes first: the same value spelt two ways is one value.
        assert_eq!(build("a=%31&a=2"), build("a=1&a=2"));
    }

    #[test]
    fn enums_are_encoded_by_variant_name() {
        #[derive(Serialize)]
        enum A {
            X,
            Y(i32),
            Z { v: i32 },
        }
        assert_ne!(encode(&A::X), encode(&A::Y(0)));
        assert_ne!(encode(&A::Y(1)), encode(&A::Z { v: 1 }));
        assert_ne!(encode(&A::X), encode(&"X"));
    }

    /// A hasher whose keys are fixed by a seed: two sets built with different seeds
    /// iterate in different orders, deterministically.
    #[derive(Clone, Default)]
    struct Seeded(u64);

    impl std::hash::BuildHasher for Seeded {
        type Hasher = std::hash::DefaultHasher;

        fn build_hasher(&self) -> Self::Hasher {
            let mut hasher = std::hash::DefaultHasher::new();
            std::hash::Hasher::write_u64(&mut hasher, self.0);
            hasher
        }
    }

    fn set<T: std::hash::Hash + Eq>(
        items: impl IntoIterator<Item = T>,
        seed: u64,
    ) -> HashSet<T, Seeded> {
        let mut set = HashSet::with_hasher(Seeded(seed));
        set.extend(items);
        set
    }

    fn words(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("w{i}")).collect()
    }

    /// Pins issue 19's "a `HashSet` fingerprints differently on every request": a set
    /// serializes in hash order, and the encoder wrote sequences in the order given.
    #[test]
    fn a_set_encodes_alike_whatever_its_iteration_order() {
        let a = set(words(64), 1);
        let b = set(words(64).into_iter().rev(), 2);
        assert_eq!(a, b);
        assert!(
            a.iter().ne(b.iter()),
            "the two sets must iterate in different orders for this test to mean anything"
        );
        assert_eq!(encode(&a), encode(&b));

        // At any depth where the set's type is known.
        #[derive(Serialize)]
        struct Order {
            tags: HashSet<String, Seeded>,
            by_kind: HashMap<String, HashSet<String, Seeded>>,
            batches: Vec<HashSet<String, Seeded>>,
            maybe: Option<HashSet<String, Seeded>>,
            // A set behind a pointer, as a body may hold one (`Box`'s `Serialize` is
            // the set's).
            #[allow(clippy::box_collection)]
            boxed: Box<HashSet<String, Seeded>>,
            wrapped: Tags,
            tuple: (u8, HashSet<String, Seeded>),
            variant: Holder,
        }
        #[derive(Serialize)]
        struct Tags(HashSet<String, Seeded>);
        #[derive(Serialize)]
        enum Holder {
            Set(HashSet<String, Seeded>),
        }
        let order = |seed: u64| Order {
            tags: set(words(20), seed),
            by_kind: [("k".to_owned(), set(words(20), seed + 1))]
                .into_iter()
                .collect(),
            batches: vec![set(words(20), seed + 2), set(words(3), seed + 3)],
            maybe: Some(set(words(20), seed + 4)),
            boxed: Box::new(set(words(20), seed + 5)),
            wrapped: Tags(set(words(20), seed + 6)),
            tuple: (1, set(words(20), seed + 7)),
            variant: Holder::Set(set(words(20), seed + 8)),
        };
        assert_eq!(encode(&order(10)), encode(&order(100)));
        assert_eq!(encode(&&order(10)), encode(&order(100)));

        // The fingerprint, and `key = digest(body)`, alike.
        let fingerprint = |seed| {
            let mut builder = Fingerprint::builder("s", "POST", "/s", []);
            builder.whole_body(&order(seed)).unwrap();
            builder.field("tags", &set(words(20), seed)).unwrap();
            builder.finish()
        };
        assert_eq!(fingerprint(10), fingerprint(100));
        assert_eq!(
            key_digest(&order(10)).unwrap(),
            key_digest(&order(100)).unwrap()
        );

        // hashbrown's set too.
        let mut c = hashbrown::HashSet::with_hasher(Seeded(3));
        c.extend(words(64));
        let mut d = hashbrown::HashSet::with_hasher(Seeded(4));
        d.extend(words(64).into_iter().rev());
        assert!(c.iter().ne(d.iter()));
        assert_eq!(encode(&c), encode(&d));
        assert_eq!(encode(&c), encode(&a));
    }

    /// A set encodes like the sequence of its elements sorted by their encodings, so two
    /// different sets encode apart, and nested sets are canonical at every level.
    #[test]
    fn a_set_encodes_as_its_sorted_elements() {
        let by_encoding = |mut items: Vec<Vec<u8>>| {
            items.sort();
            let mut out = vec![tag::SEQ];
            items.into_iter().for_each(|item| out.extend(item));
            out.push(tag::END);
            out
        };
        let strings = ["b", "aa", "", "ab\"", "é"];
        assert_eq!(
            encode(&set(strings, 7)),
            by_encoding(strings.iter().map(encode).collect())
        );
        let numbers = [-1_i64, 0, 1, i64::MIN, i64::MAX, 256];
        assert_eq!(
            encode(&set(numbers, 7)),
            by_encoding(numbers.iter().map(encode).collect())
        );
        assert_ne!(encode(&set(["a", "b"], 1)), encode(&set(["a"], 1)));
        assert_ne!(encode(&set(["a", "b"], 1)), encode(&set(["ab"], 1)));
        assert_ne!(encode(&set(["a", "b"], 1)), encode(&set(["a", "c"], 1)));
        assert_ne!(
            encode(&vec![set(["a"], 1), set(["b"], 1)]),
            encode(&vec![set(["a", "b"], 1), set([], 1)])
        );
        assert_ne!(
            encode(&set(Vec::<&str>::new(), 1)),
            encode(&Option::<()>::None)
        );
        // Sets of sets (an ordered inner set, as a `HashSet` is no `Hash`).
        let nested = |seed| {
            set(
                (0..8).map(|i| (0..i).map(|j| j * 3).collect::<BTreeSet<i32>>()),
                seed,
            )
        };
        assert_eq!(encode(&nested(1)), encode(&nested(2)));
    }

    /// Ordered collections keep their order; a set that only `serde` sees (behind
    /// `#[serde(transparent)]`) is not recognised, as the docs say.
    #[test]
    fn only_unordered_sets_are_sorted() {
        assert_ne!(encode(&vec!["b", "a"]), encode(&vec!["a", "b"]));
        assert_ne!(encode(&("b", "a")), encode(&("a", "b")));
        let ordered: BTreeSet<&str> = ["b", "aa"].into_iter().collect();
        assert_eq!(encode(&ordered), encode(&vec!["aa", "b"]));
        assert_eq!(encode(&set(["b", "aa"], 1)), encode(&vec!["b", "aa"]));

        for unordered in [
            std::any::type_name::<HashSet<String>>(),
            std::any::type_name::<&HashSet<String, Seeded>>(),
            std::any::type_name::<&mut HashSet<Vec<u8>>>(),
            std::any::type_name::<Box<HashSet<String>>>(),
            std::any::type_name::<std::sync::Arc<HashSet<String>>>(),
            std::any::type_name::<std::rc::Rc<&HashSet<String>>>(),
            std::any::type_name::<std::borrow::Cow<'_, HashSet<String>>>(),
            std::any::type_name::<hashbrown::HashSet<String>>(),
            "ahash::hash_set::AHashSet<alloc::string::String>",
            "dashmap::set::DashSet<u64>",
        ] {
            assert!(is_unordered_set(unordered), "{unordered}");
        }
        for ordered in [
            std::any::type_name::<Vec<HashSet<String>>>(),
            std::any::type_name::<BTreeSet<String>>(),
            std::any::type_name::<Option<HashSet<String>>>(),
            std::any::type_name::<HashMap<String, String>>(),
            std::any::type_name::<[u8]>(),
            std::any::type_name::<Box<[HashSet<u8>]>>(),
            std::any::type_name::<[HashSet<u8>; 2]>(),
            std::any::type_name::<(HashSet<u8>,)>(),
            std::any::type_name::<*const HashSet<u8>>(),
            "indexmap::set::IndexSet<u64>",
            "my_app::HashSetLike",
        ] {
            assert!(!is_unordered_set(ordered), "{ordered}");
        }
    }

    /// The encoding of every value that was already canonical is unchanged by issue 19
    /// (sets, query names): fingerprints stored before keep matching. The digests were
    /// taken from the code before it.
    #[test]
    fn encodings_of_canonical_values_are_unchanged() {
        #[derive(Serialize)]
        enum Kind {
            Card,
            Bank { iban: String },
            Wallet(u8, bool),
        }
        #[derive(Serialize)]
        struct Cents(i64);
        #[derive(Serialize)]
        struct Body {
            amount: Cents,
            currency: &'static str,
            tags: BTreeSet<&'static str>,
            lines: Vec<(u32, f64)>,
            meta: HashMap<&'static str, BTreeMap<&'static str, i32>>,
            note: Option<String>,
            kinds: Vec<Kind>,
            raw: Value,
        }
        let body = Body {
            amount: Cents(-1250),
            currency: "eur",
            tags: ["b", "aa", "c"].into_iter().collect(),
            lines: vec![(2, 0.5), (1, -0.0)],
            meta: [("x", [("k", 1), ("j", 2)].into()), ("a", BTreeMap::new())].into(),
            note: None,
            kinds: vec![
                Kind::Card,
                Kind::Bank { iban: "DE1".into() },
                Kind::Wallet(7, true),
            ],
            raw: json!({"z": [1, "2", null, {"b": true, "a": 1.5}], "y": u64::MAX}),
        };
        let mut builder =
            Fingerprint::builder("charges", "POST", "/charges/{id}", [("id", "ch_1")]);
        builder.query("b=2&a=1");
        builder.whole_body(&body).unwrap();
        builder.field("tags", &body.tags).unwrap();
        let fingerprint = builder.finish();
        assert_eq!(
            hex(fingerprint.combined()),
            "5e711f03ceab0aed1e82f859bab8e0d46620b0cbbabab964e2333727d26f4ce5"
        );
        assert_eq!(hex(&fingerprint.parts()), "e0dbe8a0f08034f39f73cc04aa58ce8ed277bcdbf52a94497e70b57c24a2455b000073bc5aa6ac07fb1ef32ecca6d55efbff824ea508c52293142b5e7096b16b21060004746167737aa68ba9ac649c5afd0b6de57b6fbdf67b8a1f2d4bee92e43419fd61b124ec90");
        assert_eq!(hex(&encode(&body)), "6d0000000873000000037261776d00000002730000000179690000000000000000ffffffffffffffff73000000017a6c6900000000000000000000000000000001730000000132756d00000002730000000161463ff800000000000073000000016242012e73000000046d6574616d000000027300000001616d000000007300000001786d0000000273000000016a690000000000000000000000000000000273000000016b690000000000000000000000000000000173000000046e6f74656e7300000004746167736c730000000261617300000001627300000001632e73000000056b696e64736c76000000044361726475760000000442616e6b6d0000000173000000046962616e7300000003444531760000000657616c6c65746c690000000000000000000000000000000742012e2e73000000056c696e65736c6c6900000000000000000000000000000002463fe00000000000002e6c69000000000000000000000000000000014600000000000000002e2e7300000006616d6f756e7469fffffffffffffffffffffffffffffb1e730000000863757272656e63797300000003657572");
        assert_eq!(
            hex(&key_digest(&body).unwrap()),
            "aefc8a6fe21fc6c5a335fde8faa9c1b87bf4ae8df5937df6b32e0bdcd088b747"
        );
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            (-1e6_f64..1e6).prop_map(|f| json!(f)),
            "[a-c\\\\\" .:]{0,4}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                proptest::collection::vec(("[a-c\" .:]{0,3}", inner), 0..5)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    /// A set element: text, an integer, or a pair, with near misses (`"1"` and `1`,
    /// `"ab"` and `("a", "b")`) common.
    #[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
    enum SetItem {
        Text(String),
        Number(i64),
        Pair(String, String),
        Unit,
    }

    fn set_item() -> impl Strategy<Value = SetItem> {
        prop_oneof![
            "[ab1\\\" .]{0,3}".prop_map(SetItem::Text),
            (-2_i64..300).prop_map(SetItem::Number),
            ("[ab]{0,2}", "[ab]{0,2}").prop_map(|(a, b)| SetItem::Pair(a, b)),
            Just(SetItem::Unit),
        ]
    }

    fn ordered(items: &[i64], rev: bool) -> Vec<i64> {
        let mut items = items.to_vec();
        if rev {
            items.reverse();
        }
        items
    }

    /// The same value with every object's entries in reverse insertion order.
    fn reorder(value: &Value) -> Value {
        match value {
            Value::Object(map) => Value::Object(
                map.iter()
                    .rev()
                    .map(|(k, v)| (k.clone(), reorder(v)))
                    .collect(),
            ),
            Value::Array(items) => Value::Array(items.iter().map(reorder).collect()),
            other => other.clone(),
        }
    }

    proptest! {
        #[test]
        fn equal_values_encode_alike(value in json_value()) {
            let reordered = reorder(&value);
            prop_assert_eq!(encode(&value), encode(&reordered));
            let reparsed: Value = serde_json::from_str(&serde_json::to_string_pretty(&value).unwrap()).unwrap();
            prop_assert_eq!(encode(&value), encode(&reparsed));
        }

        #[test]
        fn different_values_encode_apart(a in json_value(), b in json_value()) {
            // serde_json compares objects regardless of entry order, as the encoding does.
            prop_assert_eq!(a == b, encode(&a) == encode(&b));
            prop_assert_eq!(a == b, fingerprint(&[("f", &a)]) == fingerprint(&[("f", &b)]));
        }

        /// A set, alone or nested in a map, a sequence or a struct, encodes alike
        /// whatever order its elements were inserted in and its hasher iterates them.
        #[test]
        fn sets_encode_alike_whatever_their_order(
            items in proptest::collection::vec(set_item(), 0..24),
            nested in proptest::collection::vec(proptest::collection::vec(any::<i64>(), 0..6), 0..5),
            seeds in (any::<u64>(), any::<u64>()),
        ) {
            let reversed: Vec<_> = items.iter().rev().cloned().collect();
            prop_assert_eq!(encode(&set(items.clone(), seeds.0)), encode(&set(reversed.clone(), seeds.1)));

            #[derive(Serialize)]
            struct Body {
                items: HashSet<SetItem, Seeded>,
                groups: BTreeMap<usize, HashSet<i64, Seeded>>,
                lists: Vec<HashSet<i64, Seeded>>,
            }
            let body = |items: &[SetItem], seed: u64, rev: bool| Body {
                items: set(items.iter().cloned(), seed),
                groups: nested
                    .iter()
                    .enumerate()
                    .map(|(i, group)| (i, set(ordered(group, rev), seed ^ i as u64)))
                    .collect(),
                lists: nested.iter().map(|group| set(ordered(group, rev), !seed)).collect(),
            };
            prop_assert_eq!(encode(&body(&items, seeds.0, false)), encode(&body(&reversed, seeds.1, true)));
        }

        /// Two sets encode alike exactly when they are equal.
        #[test]
        fn different_sets_encode_apart(
            a in proptest::collection::vec(set_item(), 0..8),
            b in proptest::collection::vec(set_item(), 0..8),
            seeds in (any::<u64>(), any::<u64>()),
        ) {
            let (a, b) = (set(a, seeds.0), set(b, seeds.1));
            prop_assert_eq!(a == b, encode(&a) == encode(&b));
            let (a, b) = (vec![a], vec![b]);
            prop_assert_eq!(a == b, encode(&a) == encode(&b));
        }
    }
}
