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
    let mut builder = Fingerprint::builder("charges", "POST", "/charges/{id}", [("id", "ch_1")]);
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
