//! The hardening issue, one test per item, each failing without its fix: reordered
//! `fields`, the query string in the target, plain-text keys (no unquoting, long and
//! non-ASCII ids hashed), refusals that name the key's source, and the example's currency normalised
//! before it is fingerprinted. (The outcome at INFO is tested in `outcome_log.rs`.)

use std::sync::{Arc, Mutex};

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::jobs::OnceError;
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, Answer, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[derive(Debug, Deserialize, Serialize)]
struct Order {
    a: i64,
    b: String,
}

/// The endpoint as one deploy declares it ...
#[idempotent(scope = "orders", fields = [a, b])]
async fn orders_a_b(_tx: Tx, Json(order): Json<Order>) -> (StatusCode, Json<Value>) {
    (
        StatusCode::CREATED,
        Json(json!({ "a": order.a, "deploy": 1 })),
    )
}

/// ... and as the next lists the same fields in another order.
#[idempotent(scope = "orders", fields = [b, a])]
async fn orders_b_a(_tx: Tx, Json(order): Json<Order>) -> (StatusCode, Json<Value>) {
    (
        StatusCode::CREATED,
        Json(json!({ "a": order.a, "deploy": 2 })),
    )
}

#[idempotent(scope = "query")]
async fn query(_tx: Tx, Json(v): Json<Value>) -> (StatusCode, Json<Value>) {
    (StatusCode::CREATED, Json(v))
}

#[derive(Debug, Deserialize, Serialize)]
struct Event {
    #[serde(default)]
    id: Option<String>,
    n: i64,
}

#[idempotent(scope = "events", key = id)]
async fn event(_tx: Tx, Json(event): Json<Event>) -> Json<Value> {
    Json(json!({ "n": event.n }))
}

#[idempotent(scope = "by-header", key = header("X-Event-Id"))]
async fn by_header(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

async fn store(pool: &PgPool) -> Store {
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    store
}

/// This file's endpoints, on `pool`.
async fn start(db: &TestDb) -> TestApp {
    let pool = db.pool(5).await;
    let app = Router::new()
        .route("/orders", post(orders_a_b))
        .route("/q", post(query))
        .route("/events", post(event))
        .route("/by-header", post(by_header))
        .with_state(AppState {
            idempotency: store(&pool).await,
        });
    TestApp::serve(pool, app).await
}

async fn post_raw(s: &TestApp, path: &str, headers: &[(&str, &str)], body: &Value) -> Answer {
    s.post_with(path, None, body, headers).await
}

fn detail(answer: &Answer) -> String {
    answer.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Item 1: a deploy that only reorders `fields` replays retries of requests the old
/// deploy answered (it answered 422 before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deploy_that_reorders_fields_replays() {
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let old = Router::new()
            .route("/orders", post(orders_a_b))
            .with_state(AppState {
                idempotency: store(&pool).await,
            });
        let new = Router::new()
            .route("/orders", post(orders_b_a))
            .with_state(AppState {
                idempotency: store(&pool).await,
            });
        let old = TestApp::serve(pool.clone(), old).await;
        let new = TestApp::serve(pool, new).await;
        let body = json!({ "a": 1, "b": "x" });

        let first = old.post("/orders", Some("k1"), &body).await;
        assert_eq!((first.status, first.replayed()), (201, false));
        let retry = new.post("/orders", Some("k1"), &body).await;
        assert_eq!(
            retry.status,
            201,
            "{}",
            String::from_utf8_lossy(&retry.body)
        );
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        // A shared field that changed is still refused.
        new.post("/orders", Some("k1"), &json!({ "a": 2, "b": "x" }))
            .await
            .assert_problem(422, "key-reused");
        // And the other way round.
        let second = new.post("/orders", Some("k2"), &body).await;
        assert!(!second.replayed());
        assert!(old.post("/orders", Some("k2"), &body).await.replayed());
    })
    .await;
}

/// Item 2: the query string is part of the target, in canonical form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_query_string_is_part_of_the_target() {
    with_test_db(async |db| {
        let s = start(db).await;
        let body = json!({ "note": "x" });
        let first = s.post("/q?amount=1&note=a%20b", Some("k1"), &body).await;
        assert_eq!((first.status, first.replayed()), (201, false));
        // The same query in another order and spelling: a replay.
        let same = s.post("/q?note=a+b&amount=%31", Some("k1"), &body).await;
        assert!(same.replayed(), "{}", String::from_utf8_lossy(&same.body));
        assert_eq!(same.body, first.body);
        // Another query, or none, with the same key and body: 422.
        s.post("/q?amount=2&note=a+b", Some("k1"), &body)
            .await
            .assert_problem(422, "key-reused");
        s.post("/q", Some("k1"), &body)
            .await
            .assert_problem(422, "key-reused");
        // Without a query, and with an empty one, the target is what it always was.
        assert!(!s.post("/q", Some("k2"), &body).await.replayed());
        assert!(s.post("/q?", Some("k2"), &body).await.replayed());
        assert_eq!(s.keys().await, 2);
    })
    .await;
}

/// Item 3: a body field's value is plain text: `"m1"` and `m1` are two keys, and ids
/// that are long, have spaces or are not ASCII are processed once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn field_keys_are_plain_text() {
    with_test_db(async |db| {
        let s = start(db).await;
        let quoted = post_raw(&s, "/events", &[], &json!({ "id": "\"m1\"", "n": 1 })).await;
        let bare = post_raw(&s, "/events", &[], &json!({ "id": "m1", "n": 2 })).await;
        assert_eq!((quoted.status, quoted.replayed()), (200, false));
        assert_eq!(
            (bare.status, bare.replayed()),
            (200, false),
            "{}",
            String::from_utf8_lossy(&bare.body)
        );
        assert_eq!(s.keys().await, 2);

        let long = "e".repeat(300);
        for id in [long.as_str(), "evt 42", "évènement-1"] {
            let body = json!({ "id": id, "n": 3 });
            let first = post_raw(&s, "/events", &[], &body).await;
            assert_eq!(
                (first.status, first.replayed()),
                (200, false),
                "{id}: {}",
                String::from_utf8_lossy(&first.body)
            );
            let again = post_raw(&s, "/events", &[], &body).await;
            assert!(again.replayed(), "{id}");
        }
        assert_eq!(s.keys().await, 5);
        assert_eq!(
            s.count("idempotency_keys WHERE key ~ '^sha256:[0-9a-f]{64}$'")
                .await,
            3
        );
        // An empty id is still refused.
        post_raw(&s, "/events", &[], &json!({ "id": "", "n": 4 }))
            .await
            .assert_problem(400, "malformed-key");
    })
    .await;
}

/// Item 3, without HTTP: `run_once` keys are plain text too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_keys_are_plain_text() {
    with_test_db(async |db| {
        let pool = db.pool(3).await;
        let store = store(&pool).await;
        let runs = Arc::new(Mutex::new(0));
        let run = |key: String| {
            let runs = runs.clone();
            let store = store.clone();
            async move {
                store
                    .run_once("messages", &key)
                    .payload(&1)
                    .run(async |_tx| {
                        *runs.lock().unwrap() += 1;
                        Ok::<_, std::io::Error>(7_i64)
                    })
                    .await
            }
        };
        let long = "m".repeat(300);
        for key in ["\"m1\"", "m1", &long, "message 1", "message 1", &long, "m1"] {
            assert_eq!(run(key.to_owned()).await.unwrap(), 7, "{key}");
        }
        assert_eq!(*runs.lock().unwrap(), 4);
        match run(String::new()).await {
            Err(error @ OnceError::Key(_)) => {
                let text = error.to_string();
                assert!(text.contains("run_once key is empty"), "{text}");
                assert!(!text.contains("Idempotency-Key"), "{text}");
            }
            other => panic!("{other:?}"),
        }
    })
    .await;
}

/// Item 4: a refused key's 400 names where the key was read from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_refusals_name_their_source() {
    with_test_db(async |db| {
        let s = start(db).await;
        let body = json!({ "n": 1 });
        // `key = header("X-Event-Id")`; an Idempotency-Key is not a substitute.
        let missing = s.post("/by-header", Some("k1"), &body).await;
        missing.assert_problem(400, "missing-key");
        // Header names are case-insensitive; the macro hands idem the lower-cased name.
        let named = |a: &Answer| detail(a).to_ascii_lowercase();
        assert!(
            named(&missing).contains("the x-event-id header"),
            "{}",
            detail(&missing)
        );
        assert!(!detail(&missing).contains("Idempotency-Key"));
        let malformed = post_raw(&s, "/by-header", &[("X-Event-Id", "a b")], &body).await;
        malformed.assert_problem(400, "malformed-key");
        assert!(named(&malformed).starts_with("the x-event-id header has byte 0x20"));

        // `key = id`.
        let missing = s.post("/events", Some("k1"), &body).await;
        missing.assert_problem(400, "missing-key");
        assert!(detail(&missing).contains("field of the request body"));
        assert!(!detail(&missing).contains("Idempotency-Key"));
        let empty = post_raw(&s, "/events", &[], &json!({ "id": "", "n": 1 })).await;
        empty.assert_problem(400, "malformed-key");
        assert!(detail(&empty).starts_with("the key field of the request body is empty"));

        // The `Idempotency-Key` header is still named as before.
        let header = s.post("/q", None, &body).await;
        header.assert_problem(400, "missing-key");
        assert!(detail(&header).contains("Idempotency-Key header"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_currency_is_normalised_before_the_fingerprint() {
    with_test_db(async |db| {
        let s = TestApp::charges(db, 5, charges::Config::default()).await;
        let charge =
            |currency: &str| json!({ "amount": 500, "currency": currency, "customer": "c1" });
        let auth = [("authorization", "Bearer acct_1")];
        let first = s
            .post_with("/charges", Some("k1"), &charge("USD"), &auth)
            .await;
        assert_eq!(
            first.status,
            201,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        assert_eq!(first.json()["currency"], "usd");
        let retry = s
            .post_with("/charges", Some("k1"), &charge("usd"), &auth)
            .await;
        assert!(retry.replayed(), "{}", String::from_utf8_lossy(&retry.body));
        assert_eq!(retry.body, first.body);
        assert_eq!(s.count("charges").await, 1);
    })
    .await;
}

/// The transaction's isolation level, as the handler sees it.
async fn isolation_level(tx: &mut Tx<'_>) -> Result<Json<Value>, StatusCode> {
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&mut **tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(Json(json!({ "level": level })))
}

#[idempotent(scope = "level-default")]
async fn default_level(mut tx: Tx, Json(_): Json<Value>) -> Result<Json<Value>, StatusCode> {
    isolation_level(&mut tx).await
}

#[idempotent(scope = "level-serializable", isolation = serializable)]
async fn serializable_level(mut tx: Tx, Json(_): Json<Value>) -> Result<Json<Value>, StatusCode> {
    isolation_level(&mut tx).await
}

#[idempotent(scope = "level-repeatable", isolation = repeatable_read)]
async fn repeatable_level(mut tx: Tx, Json(_): Json<Value>) -> Result<Json<Value>, StatusCode> {
    isolation_level(&mut tx).await
}

/// Regression: the isolation level was forced to READ COMMITTED, and `SET TRANSACTION`
/// inside the handler fails (the claim already ran). An endpoint asks for its level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_chooses_its_isolation_level() {
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/default", post(default_level))
            .route("/serializable", post(serializable_level))
            .route("/repeatable", post(repeatable_level))
            .with_state(IsolationState { store });
        let s = TestApp::serve(pool, app).await;
        for (path, level) in [
            ("/default", "read committed"),
            ("/serializable", "serializable"),
            ("/repeatable", "repeatable read"),
        ] {
            let answer = s.post(path, Some("k1"), &json!({})).await;
            assert_eq!(answer.status, 200, "{path}");
            assert_eq!(answer.json()["level"], level, "{path}");
            let replay = s.post(path, Some("k1"), &json!({})).await;
            assert!(replay.replayed(), "{path}: the claim works at this level");
        }
    })
    .await;
}

#[derive(Clone, FromRef)]
struct IsolationState {
    store: Store,
}

/// Regression: a principal resolver that found nobody silently made keys global to the
/// scope. With `require_principal`, such a keyed request is refused 401 and nothing is
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_store_refuses_a_request_without_a_principal() {
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::builder(pool.clone())
            .principal(|parts| {
                let tenant = parts.headers.get("x-tenant")?;
                tenant.to_str().ok().map(str::to_owned)
            })
            .require_principal(true)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/default", post(default_level))
            .with_state(IsolationState { store });
        let s = TestApp::serve(pool, app).await;
        let anonymous = s.post("/default", Some("k1"), &json!({})).await;
        anonymous.assert_problem(401, "missing-principal");
        assert_eq!(s.count("idempotency_keys").await, 0, "nothing stored");
        let tenant = s
            .post_with("/default", Some("k1"), &json!({}), &[("x-tenant", "t1")])
            .await;
        assert_eq!(tenant.status, 200);
        assert_eq!(
            s.count("idempotency_keys WHERE principal = 't1'").await,
            1,
            "keyed per tenant"
        );
    })
    .await;
}

/// How many times `Tenant` was extracted.
static TENANT_EXTRACTIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A principal from the `x-tenant` header that counts its extractions.
struct Tenant(String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Tenant {
    type Rejection = StatusCode;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, StatusCode> {
        TENANT_EXTRACTIONS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tenant = parts
            .headers
            .get("x-tenant")
            .ok_or(StatusCode::UNAUTHORIZED)?;
        Ok(Self(
            tenant
                .to_str()
                .map_err(|_| StatusCode::BAD_REQUEST)?
                .to_owned(),
        ))
    }
}

impl idem::extract::Principal for Tenant {
    fn principal_id(&self) -> String {
        self.0.clone()
    }
}

#[idempotent(scope = "tenant-notes", principal = Tenant)]
async fn tenant_note(
    mut tx: Tx,
    tenant: Tenant,
    Json(_): Json<Value>,
) -> Result<Json<Value>, StatusCode> {
    let _level = isolation_level(&mut tx).await?;
    Ok(Json(json!({ "tenant": tenant.0 })))
}

/// Regression: the principal extractor ran twice when it was also a handler parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_that_is_also_a_parameter_is_extracted_once() {
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/notes", post(tenant_note))
            .with_state(IsolationState { store });
        let s = TestApp::serve(pool, app).await;
        let before = TENANT_EXTRACTIONS.load(std::sync::atomic::Ordering::SeqCst);
        let answer = s
            .post_with("/notes", Some("k1"), &json!({}), &[("x-tenant", "t1")])
            .await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.json()["tenant"], "t1");
        assert_eq!(
            TENANT_EXTRACTIONS.load(std::sync::atomic::Ordering::SeqCst) - before,
            1
        );
        assert_eq!(s.count("idempotency_keys WHERE principal = 't1'").await, 1);
    })
    .await;
}
