//! What makes a retry "the same request", over real HTTP against a real PostgreSQL.
//! Pins two of issue 19's fingerprint holes: a `HashSet` in the body fingerprinted in
//! its hash order, so an identical retry was refused with 422 nearly every time; and a
//! repeated query name sorted with its values, so `?tag=a&tag=b` replayed the answer to
//! `?tag=b&tag=a` although a handler reading `tag` as a list sees them apart. And the
//! documented gap of `#[serde(skip_serializing)]`, with its remedy: `fields = [...]`.

use std::collections::{BTreeMap, HashMap, HashSet};

use axum::extract::{FromRef, RawQuery};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{send, with_test_db, Answer, TestApp};
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[derive(Deserialize, Serialize)]
struct Order {
    customer: String,
    tags: HashSet<String>,
    by_region: HashMap<String, HashSet<u32>>,
    batches: Vec<HashSet<String>>,
}

/// The whole body identifies the request.
#[idempotent(scope = "orders")]
async fn order(_tx: Tx, Json(order): Json<Order>) -> String {
    format!("{} {}", order.customer, order.tags.len())
}

/// A set named in `fields`.
#[idempotent(scope = "tagged", fields = [tags, by_region])]
async fn tagged(_tx: Tx, Json(order): Json<Order>) -> String {
    order.customer
}

/// Reads a repeated query name as a list, in order.
#[idempotent(scope = "ranked")]
async fn ranked(_tx: Tx, RawQuery(query): RawQuery) -> String {
    let query = query.unwrap_or_default();
    let ranked: Vec<&str> = query
        .split('&')
        .filter_map(|pair| pair.strip_prefix("tag="))
        .collect();
    ranked.join(">")
}

#[derive(Deserialize, Serialize)]
struct Transfer {
    amount: i64,
    /// Read by the handler, never serialized (kept out of responses and logs).
    #[serde(skip_serializing)]
    account: String,
}

/// The whole body, through its `Serialize`: `account` is not compared.
#[idempotent(scope = "transfers")]
async fn transfer(_tx: Tx, Json(t): Json<Transfer>) -> String {
    format!("{} to {}", t.amount, t.account)
}

/// The remedy: the field named, hashed from its own value.
#[idempotent(scope = "named-transfers", fields = [amount, account])]
async fn named_transfer(_tx: Tx, Json(t): Json<Transfer>) -> String {
    format!("{} to {}", t.amount, t.account)
}

async fn serve(db: &idem_tests::TestDb) -> TestApp {
    let pool = db.pool(5).await;
    let idempotency = Store::new(pool.clone());
    idempotency.migrate().await.unwrap();
    let app = Router::new()
        .route("/orders", post(order))
        .route("/tagged", post(tagged))
        .route("/ranked", post(ranked))
        .route("/transfers", post(transfer))
        .route("/named-transfers", post(named_transfer))
        .with_state(AppState { idempotency });
    TestApp::serve(pool, app).await
}

async fn call(s: &TestApp, path: &str, key: &str, body: &str) -> Answer {
    let request = s
        .client
        .post(s.url(path))
        .header("Idempotency-Key", key)
        .header("content-type", "application/json")
        .body(body.to_owned());
    send(request).await
}

/// A body whose sets hold enough elements that two of them iterate in the same order
/// only by a rare chance.
fn body(customer: &str, extra_tag: Option<&str>) -> String {
    let tags: Vec<String> = (0..32)
        .map(|i| format!("tag-{i}"))
        .chain(extra_tag.map(str::to_owned))
        .collect();
    let by_region: BTreeMap<String, Vec<u32>> = (0..4)
        .map(|r| (format!("r{r}"), (0..16).map(|n| n * 7 + r).collect()))
        .collect();
    serde_json::json!({
        "customer": customer,
        "tags": tags,
        "by_region": by_region,
        "batches": [["a", "b", "c", "d", "e", "f", "g", "h"], []],
    })
    .to_string()
}

#[tokio::test]
async fn a_body_with_sets_replays_on_every_identical_retry() {
    with_test_db(async |db| {
        let s = serve(db).await;
        for path in ["/orders", "/tagged"] {
            let key = format!("key{path}");
            let sent = body("c1", None);
            let first = call(&s, path, &key, &sent).await;
            assert_eq!(
                first.status,
                200,
                "{path}: {}",
                String::from_utf8_lossy(&first.body)
            );
            assert!(!first.replayed());
            for retry in 1..=20 {
                let again = call(&s, path, &key, &sent).await;
                assert_eq!(
                    again.status,
                    200,
                    "{path}: retry {retry} of the same body: {}",
                    String::from_utf8_lossy(&again.body)
                );
                assert!(again.replayed(), "{path}: retry {retry} replays");
                assert_eq!(again.body, first.body);
            }
            // Another set is another request.
            call(&s, path, &key, &body("c1", Some("tag-new")))
                .await
                .assert_problem(422, "key-reused");
        }
        // The customer is not among `tagged`'s fields: the same sets replay.
        let other_customer = call(&s, "/tagged", "key/tagged", &body("c2", None)).await;
        assert!(other_customer.replayed());
    })
    .await;
}

#[tokio::test]
async fn a_repeated_query_name_keeps_its_order() {
    with_test_db(async |db| {
        let s = serve(db).await;
        let first = call(&s, "/ranked?tag=a&tag=b", "k", "").await;
        assert_eq!(first.status, 200);
        assert_eq!(first.body, b"a>b");
        // Other names may move around it; the values of `tag` may not.
        let moved = call(&s, "/ranked?tag=a&page=1&tag=b", "k2", "").await;
        assert_eq!(moved.body, b"a>b");
        let again = call(&s, "/ranked?page=1&tag=a&tag=b", "k2", "").await;
        assert!(again.replayed());
        call(&s, "/ranked?tag=b&tag=a", "k", "")
            .await
            .assert_problem(422, "key-reused");
    })
    .await;
}

/// As the fingerprint docs say: a field the body's `Serialize` skips is not part of a
/// whole-body fingerprint, and naming it in `fields` makes it one.
#[tokio::test]
async fn a_skipped_field_counts_only_when_named() {
    with_test_db(async |db| {
        let s = serve(db).await;
        let to_a = r#"{"amount":5,"account":"A"}"#;
        let to_b = r#"{"amount":5,"account":"B"}"#;

        let first = call(&s, "/transfers", "k", to_a).await;
        assert_eq!(first.body, b"5 to A");
        let other = call(&s, "/transfers", "k", to_b).await;
        assert!(other.replayed(), "the documented gap: `account` is skipped");
        assert_eq!(other.body, b"5 to A");

        let first = call(&s, "/named-transfers", "k", to_a).await;
        assert_eq!(first.body, b"5 to A");
        assert!(call(&s, "/named-transfers", "k", to_a).await.replayed());
        call(&s, "/named-transfers", "k", to_b)
            .await
            .assert_problem(422, "key-reused");
    })
    .await;
}
