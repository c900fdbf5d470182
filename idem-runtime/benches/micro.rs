//! Micro-benchmarks of the work idem does per request before touching the database:
//! `cargo bench -p idem-axum --bench micro`.

// `criterion_group!` and `criterion_main!` generate undocumented functions.
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use idem::__private::Fingerprint;
use idem::header::IdempotencyKey;
use serde::Serialize;

#[derive(Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    customer: String,
    description: Option<String>,
    metadata: BTreeMap<String, String>,
}

#[derive(Serialize)]
struct Item {
    sku: String,
    quantity: u32,
    price: i64,
}

#[derive(Serialize)]
struct Order {
    customer: String,
    items: Vec<Item>,
}

fn charge() -> NewCharge {
    NewCharge {
        amount: 1999,
        currency: "usd".into(),
        customer: "cus_9s8d7f6g5h".into(),
        description: Some("Order #1234".into()),
        metadata: [
            ("order".to_owned(), "1234".to_owned()),
            ("channel".to_owned(), "web".to_owned()),
        ]
        .into(),
    }
}

fn fingerprints(c: &mut Criterion) {
    let body = charge();
    c.bench_function("fingerprint: five named fields", |b| {
        b.iter(|| {
            let body = black_box(&body);
            let mut fp = Fingerprint::builder("charges", "POST", "/charges", []);
            fp.field("amount", &body.amount).unwrap();
            fp.field("currency", &body.currency).unwrap();
            fp.field("customer", &body.customer).unwrap();
            fp.field("description", &body.description).unwrap();
            fp.field("metadata", &body.metadata).unwrap();
            black_box(fp.finish())
        });
    });

    let order = Order {
        customer: "cus_1".into(),
        items: (0..1000)
            .map(|i| Item {
                sku: format!("sku-{i:05}"),
                quantity: i % 7 + 1,
                price: 100 + i64::from(i),
            })
            .collect(),
    };
    c.bench_function("fingerprint: whole body with a 1000-element array", |b| {
        b.iter(|| {
            let mut fp = Fingerprint::builder("orders", "POST", "/orders", []);
            fp.whole_body(black_box(&order)).unwrap();
            black_box(fp.finish())
        });
    });
}

fn keys(c: &mut Criterion) {
    c.bench_function("key: bare UUID", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(b"8e03978e-40d5-43e8-bc93-6894a57f9324")));
    });
    c.bench_function("key: quoted sf-string with escapes", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(br#""order-\"1234\"-\\retry""#)));
    });
}

criterion_group!(benches, fingerprints, keys);
criterion_main!(benches);
