//! What makes a retry "the same request", over real HTTP against a real PostgreSQL.
//! Pins issue 19's `HashSet` in the body fingerprinted in its hash order, so that an
//! identical retry was refused with 422 nearly every time.

use std::collections::{BTreeMap, HashMap, HashSet};

use axum::extract::FromRef;
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

async fn serve(db: &idem_tests::TestDb) -> TestApp {
    let pool = db.pool(5).await;
    let idempotency = Store::new(pool.clone());
    idempotency.migrate().await.unwrap();
    let app = Router::new()
        .route("/orders", post(order))
        .route("/tagged", post(tagged))
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
