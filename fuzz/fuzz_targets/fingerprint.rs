//! The canonical fingerprint encoder on JSON-like values built from arbitrary input:
//! a value and the same value printed, its objects' keys put in another order and
//! parsed back have the same fingerprint; two values have the same fingerprint exactly
//! when they are equal as `serde_json::Value`s. The second value is often the first
//! with one node replaced, so near misses (`1` and `1.0`, `{}` and `[]`, a key moved one
//! level up) are tried, not only unrelated pairs.
//!
//! Unordered sets (issue 19): a `HashSet` serializes in its hasher's order, so two sets
//! of the same elements, built in other orders with other hasher keys, alone and nested
//! in a sequence and a map, must fingerprint alike; and two sets fingerprint alike
//! exactly when they are equal (the second is often the first with one element added or
//! removed).
#![no_main]

use std::collections::{BTreeMap, HashSet};
use std::hash::{BuildHasher, DefaultHasher, Hasher};

use arbitrary::{Arbitrary, Result, Unstructured};
use idem::__private::Fingerprint;
use libfuzzer_sys::fuzz_target;
use serde::Serialize;
use serde_json::{Map, Number, Value};

const MAX_DEPTH: u32 = 5;
const MAX_LEN: usize = 6;

/// A few short strings, so that equal and nearly equal keys and values are common.
const WORDS: &[&str] = &[
    "", "a", "b", "ab", "\"", "\\", ".", "a\"b", "é", "\0", "1", "null",
];

fn string(u: &mut Unstructured<'_>) -> Result<String> {
    if u.ratio(3, 4)? {
        Ok((*u.choose(WORDS)?).to_owned())
    } else {
        String::arbitrary(u)
    }
}

fn value(u: &mut Unstructured<'_>, depth: u32) -> Result<Value> {
    let kinds = if depth >= MAX_DEPTH { 7 } else { 9 };
    Ok(match u.choose_index(kinds)? {
        0 => Value::Null,
        1 => Value::Bool(bool::arbitrary(u)?),
        2 => Value::from(u.int_in_range(-3_i64..=3)?),
        3 => Value::from(i64::arbitrary(u)?),
        4 => Value::from(u64::arbitrary(u)?),
        5 => {
            let f = if u.ratio(1, 2)? {
                *u.choose(&[0.0, -0.0, 1.0, -1.0, 0.5, 1e300, f64::MIN_POSITIVE])?
            } else {
                f64::arbitrary(u)?
            };
            // JSON has no NaN or infinity; serde_json makes them null.
            Number::from_f64(f).map_or(Value::Null, Value::Number)
        }
        6 => Value::String(string(u)?),
        7 => {
            let len = u.int_in_range(0..=MAX_LEN)?;
            Value::Array(
                (0..len)
                    .map(|_| value(u, depth + 1))
                    .collect::<Result<_>>()?,
            )
        }
        _ => {
            let len = u.int_in_range(0..=MAX_LEN)?;
            let mut map = Map::new();
            for _ in 0..len {
                map.insert(string(u)?, value(u, depth + 1)?);
            }
            Value::Object(map)
        }
    })
}

/// The value with every object's keys in another order: reversed, or rotated by `turn`.
fn reorder(value: &Value, turn: usize) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map
                .iter()
                .map(|(k, v)| (k.clone(), reorder(v, turn)))
                .collect();
            if turn % 2 == 0 {
                entries.reverse();
            } else if !entries.is_empty() {
                let by = turn % entries.len();
                entries.rotate_left(by);
            }
            Value::Object(entries.into_iter().collect())
        }
        Value::Array(items) => Value::Array(items.iter().map(|v| reorder(v, turn)).collect()),
        other => other.clone(),
    }
}

/// Replaces the `n`th node (depth first) of `value` by `with`; returns whether it did.
fn replace(value: &mut Value, n: &mut usize, with: &Value) -> bool {
    if *n == 0 {
        *value = with.clone();
        return true;
    }
    *n -= 1;
    match value {
        Value::Array(items) => items.iter_mut().any(|v| replace(v, n, with)),
        Value::Object(map) => map.values_mut().any(|v| replace(v, n, with)),
        _ => false,
    }
}

fn fingerprint<T: Serialize + ?Sized>(value: &T) -> Fingerprint {
    let mut builder = Fingerprint::builder("fuzz", "POST", "/fuzz/{id}", [("id", "1")]);
    builder
        .whole_body(value)
        .expect("these values always serialize");
    builder.finish()
}

/// A set element: text or an integer, so that `"1"` and `1` meet.
type Element = std::result::Result<String, i64>;

fn element(u: &mut Unstructured<'_>) -> Result<Element> {
    Ok(if u.ratio(2, 3)? {
        Ok(string(u)?)
    } else {
        Err(u.int_in_range(-3_i64..=3)?)
    })
}

/// Hasher keys from a seed: each seed iterates a set in its own order.
#[derive(Clone, Copy, Debug)]
struct Seeded(u64);

impl BuildHasher for Seeded {
    type Hasher = DefaultHasher;

    fn build_hasher(&self) -> DefaultHasher {
        let mut hasher = DefaultHasher::new();
        hasher.write_u64(self.0);
        hasher
    }
}

type Set = HashSet<Element, Seeded>;

fn set<'e>(elements: impl Iterator<Item = &'e Element>, seed: u64) -> Set {
    let mut set = HashSet::with_hasher(Seeded(seed));
    set.extend(elements.cloned());
    set
}

/// A body that holds a set at three depths: itself, in a sequence, in a map.
#[derive(Serialize)]
struct WithSets<'a> {
    alone: &'a Set,
    listed: Vec<&'a Set>,
    mapped: BTreeMap<&'a str, (&'a Set, &'a Set)>,
}

fn with_sets<'a>(a: &'a Set, b: &'a Set) -> WithSets<'a> {
    WithSets {
        alone: a,
        listed: vec![b, a],
        mapped: [("k", (a, b))].into(),
    }
}

struct Sets {
    a: Vec<Element>,
    b: Vec<Element>,
    seeds: [u64; 4],
}

impl<'a> Arbitrary<'a> for Sets {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let len = u.int_in_range(0..=3 * MAX_LEN)?;
        let a = (0..len).map(|_| element(u)).collect::<Result<Vec<_>>>()?;
        let mut b = a.clone();
        if u.ratio(1, 4)? {
            b = (0..u.int_in_range(0..=MAX_LEN)?)
                .map(|_| element(u))
                .collect::<Result<_>>()?;
        } else if !b.is_empty() && u.ratio(1, 2)? {
            let at = u.choose_index(b.len())?;
            let _ = b.remove(at);
        } else {
            b.push(element(u)?);
        }
        Ok(Self {
            a,
            b,
            seeds: u.arbitrary()?,
        })
    }
}

struct Input {
    a: Value,
    b: Value,
    turn: usize,
    sets: Sets,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let a = value(u, 0)?;
        let turn = u.arbitrary()?;
        let other = value(u, 0)?;
        let b = if u.ratio(3, 4)? {
            // `a` with one node replaced by `other`.
            let mut b = a.clone();
            let mut n = u.arbitrary::<u8>()?.into();
            if !replace(&mut b, &mut n, &other) {
                b = other;
            }
            b
        } else {
            other
        };
        let sets = u.arbitrary()?;
        Ok(Self { a, b, turn, sets })
    }
}

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a = {}\nb = {}\nturn = {}", self.a, self.b, self.turn)?;
        let Sets { a, b, seeds } = &self.sets;
        write!(f, "\nset a = {a:?}\nset b = {b:?}\nseeds = {seeds:?}")
    }
}

/// The set properties of the module docs.
fn check_sets(sets: &Sets) {
    let [s1, s2, s3, s4] = sets.seeds;
    let a = set(sets.a.iter(), s1);
    let a_again = set(sets.a.iter().rev(), s2);
    assert_eq!(a, a_again);
    let fa = fingerprint(&a);
    assert_eq!(
        fa.combined(),
        fingerprint(&a_again).combined(),
        "one set, two iteration orders: {:?} and {:?}",
        a,
        a_again
    );

    let b = set(sets.b.iter(), s3);
    let b_again = set(sets.b.iter().rev(), s4);
    assert_eq!(
        fingerprint(&with_sets(&a, &b)).combined(),
        fingerprint(&with_sets(&a_again, &b_again)).combined(),
        "nested sets, two iteration orders: {a:?} and {b:?}"
    );

    let fb = fingerprint(&b);
    assert_eq!(
        a == b,
        fa.combined() == fb.combined(),
        "{a:?} and {b:?}: equal as sets {}, equal fingerprints {}",
        a == b,
        fa.combined() == fb.combined()
    );
    assert_eq!(
        a == b,
        fingerprint(&with_sets(&a, &a)).combined() == fingerprint(&with_sets(&b, &b)).combined(),
        "nested: {a:?} and {b:?}"
    );
}

fuzz_target!(|input: Input| {
    let Input { a, b, turn, sets } = input;
    check_sets(&sets);
    let fa = fingerprint(&a);

    // Equal values encode alike: printed, keys reordered, parsed back.
    let text = serde_json::to_string(&reorder(&a, turn)).unwrap();
    let reparsed: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(reparsed, a, "the round trip changed the value: {text}");
    assert_eq!(
        fingerprint(&reparsed).combined(),
        fa.combined(),
        "{a} and {text} are equal but fingerprint apart"
    );

    // Different values do not. `Value`'s equality ignores key order and treats
    // -0.0 as 0.0, as the encoder does; integers and floats stay apart in both.
    let fb = fingerprint(&b);
    assert_eq!(
        a == b,
        fa.combined() == fb.combined(),
        "{a} and {b}: equal as values {}, equal fingerprints {}",
        a == b,
        fa.combined() == fb.combined()
    );
});
