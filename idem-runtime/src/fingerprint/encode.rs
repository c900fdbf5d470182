//! The canonical encoding a fingerprint hashes: serde's data model written as tagged,
//! length-prefixed bytes, maps and structs by sorted key, unordered sets by sorted
//! element, so that two values equal as data encode alike whatever their order.

use super::*;

pub(super) mod tag {
    pub(in crate::fingerprint) const UNIT: u8 = b'u';
    pub(in crate::fingerprint) const NONE: u8 = b'n';
    pub(in crate::fingerprint) const SOME: u8 = b'o';
    pub(in crate::fingerprint) const BOOL: u8 = b'B';
    /// Any integer in `i128`'s range, whatever its Rust type: 16 bytes, big-endian.
    pub(in crate::fingerprint) const INT: u8 = b'i';
    /// A `u128` above `i128::MAX`.
    pub(in crate::fingerprint) const BIG: u8 = b'I';
    /// Any float, widened to `f64`.
    pub(in crate::fingerprint) const FLOAT: u8 = b'F';
    pub(in crate::fingerprint) const STR: u8 = b's';
    pub(in crate::fingerprint) const BYTES: u8 = b'b';
    pub(in crate::fingerprint) const SEQ: u8 = b'l';
    pub(in crate::fingerprint) const MAP: u8 = b'm';
    pub(in crate::fingerprint) const VARIANT: u8 = b'v';
    pub(in crate::fingerprint) const END: u8 = b'.';
}

pub(super) trait Sink {
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
pub(super) fn put_len(out: &mut impl Sink, len: usize) {
    out.put(&(len as u32).to_be_bytes());
}

/// A tag and a length in one write: the hasher's per-call cost matters at this size.
pub(super) fn put_tagged(out: &mut impl Sink, tag: u8, bytes: &[u8]) {
    let mut head = [tag, 0, 0, 0, 0];
    head[1..].copy_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.put(&head);
    out.put(bytes);
}

pub(super) fn put_str(out: &mut impl Sink, bytes: &[u8]) {
    put_tagged(out, tag::STR, bytes);
}

pub(super) fn put_int(out: &mut impl Sink, value: i128) {
    let mut encoded = [tag::INT; 17];
    encoded[1..].copy_from_slice(&value.to_be_bytes());
    out.put(&encoded);
}

/// Encodes one value into `out`. `ty` is the name of the value's Rust type, which
/// `serde` does not pass on: the one thing it tells is whether a sequence is an
/// unordered set (see [`is_unordered_set`]).
pub(super) struct Encoder<'a, W> {
    out: &'a mut W,
    ty: &'static str,
}

impl<'a, W> Encoder<'a, W> {
    /// The encoder of a value of type `T`. Wherever a value's type is known (a field, an
    /// element, a map's key or value, inside `Some` or a newtype), it is encoded with
    /// this, so that a set is recognised at any depth.
    pub(super) fn of<T: ?Sized>(out: &'a mut W) -> Self {
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
pub(super) fn is_unordered_set(ty: &str) -> bool {
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
pub(super) fn encode_to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, FingerprintError> {
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
pub(super) fn put_variant(out: &mut impl Sink, variant: &str) {
    put_tagged(out, tag::VARIANT, variant.as_bytes());
}

/// Sequences and tuples: `[tag::SEQ]`, the elements, `[tag::END]`. The elements of an
/// unordered set are encoded aside and written sorted by their encodings, which are
/// self-delimiting: equal sets write the same bytes whatever their iteration order, and
/// different sets different bytes. So a set encodes like the sequence of its elements
/// in that order.
pub(super) struct Seq<'a, W> {
    out: &'a mut W,
    unordered: Option<Elements>,
}

/// An unordered set's elements, encoded one after another in `buf`; `ranges` holds
/// each one's place in it.
pub(super) struct Elements {
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
pub(super) struct Map<'a, W> {
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
