//! `IdempotencyLayer` holds the attribute's contract for a service it does not rewrite, in
//! the store's three modes (the default, the portable mode, behind PgBouncer): replay
//! byte for byte, 422 on another payload, 409 while in flight, a failure rolls back and
//! stays retryable, 400 without a key, 503 with the database away. And what only a layer
//! has: JSON pointers and a function as the fingerprint, a path outside a router, the
//! service's error, and a `Transaction` kept past its answer, which finds it ended.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem::layer::{Ended, IdempotencyLayer, Locked, Transaction};
use idem::testing::{Effect, Gate, Kit, StandIn};
use idem::Store;
use idem_tests::{gated_store, with_test_db, Pgbouncer, TestApp, TestDb};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tower::ServiceExt;

/// A hand-written handler under the layer: writes a row through the transaction it holds,
/// can sleep, and answers 502 (rolled back) when asked to fail.
async fn note(mut locked: Locked, Json(v): Json<Value>) -> (StatusCode, Json<Value>) {
    let mut tx = locked.tx();
    let id: i64 = sqlx::query_scalar("INSERT INTO notes (body) VALUES ($1) RETURNING id")
        .bind(v.to_string())
        // Unnamed, as a statement behind a transaction pooler must be.
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .expect("a note");
    if let Some(ms) = v["sleep_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if v["fail"] == true {
        return (StatusCode::BAD_GATEWAY, Json(json!({ "failed": true })));
    }
    (StatusCode::CREATED, Json(json!({ "id": id, "n": v["n"] })))
}

/// The notes table, and `store` migrated.
async fn prepare(db: &TestDb, store: &Store) {
    store.migrate().await.expect("migrate");
    sqlx::raw_sql("CREATE TABLE notes (id bigserial PRIMARY KEY, body text NOT NULL)")
        .execute(&db.pool(1).await)
        .await
        .expect("notes table");
}

/// `/notes` (pointers: `/n`) and `/whole` (the body's bytes), each under its own layer.
fn app(store: &Store) -> Router {
    let pointers = IdempotencyLayer::new(store.clone(), "notes").fields(["/n"]);
    let whole = IdempotencyLayer::new(store.clone(), "whole").ttl(Duration::from_secs(60));
    Router::new()
        .route("/notes", post(note).layer(pointers))
        .route("/whole", post(note).layer(whole))
}

/// The attribute's contract, through the layer.
async fn holds_the_contract(s: &TestApp) {
    let fresh = s.post("/notes", Some("k-1"), &json!({ "n": 1 })).await;
    assert_eq!(fresh.status, 201, "{:?}", fresh.json());
    let again = s
        .post("/notes", Some("k-1"), &json!({ "n": 1, "note": "unnamed" }))
        .await;
    assert!(again.replayed(), "{:?}", again.json());
    assert_eq!(again.body, fresh.body, "replayed byte for byte");
    s.post("/notes", Some("k-1"), &json!({ "n": 2 }))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(s.count("notes").await, 1);

    // A failure rolls back and stays retryable.
    let failed = s
        .post("/notes", Some("k-2"), &json!({ "n": 3, "fail": true }))
        .await;
    assert_eq!(failed.status, 502);
    assert_eq!(s.count("notes").await, 1);
    assert_eq!(
        s.post("/notes", Some("k-2"), &json!({ "n": 3 }))
            .await
            .status,
        201
    );

    // Duplicates while the first is in flight: 409, and one effect.
    let slow = json!({ "n": 4, "sleep_ms": 600 });
    let (first, second, third) = tokio::join!(
        s.post("/notes", Some("k-3"), &slow),
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            s.post("/notes", Some("k-3"), &slow).await
        },
        async {
            tokio::time::sleep(Duration::from_millis(250)).await;
            s.post("/notes", Some("k-3"), &slow).await
        },
    );
    assert_eq!(first.status, 201);
    second.assert_problem(409, "key-in-use");
    third.assert_problem(409, "key-in-use");
    assert_eq!(s.count("notes").await, 3);

    s.post("/notes", None, &json!({ "n": 5 }))
        .await
        .assert_problem(400, "missing-key");
    // Pointers need JSON; nothing ran.
    let text = s
        .client
        .post(s.url("/notes"))
        .header("idempotency-key", "k-4")
        .header("content-type", "application/json")
        .body("{not json");
    idem_tests::send(text)
        .await
        .assert_problem(400, "invalid-request");

    // The whole body: another spelling is another payload (the client sends
    // `{"m":2,"n":1}`).
    let whole = s
        .post("/whole", Some("k-1"), &json!({ "n": 1, "m": 2 }))
        .await;
    assert_eq!(whole.status, 201, "{:?}", whole.json());
    let respelt = s
        .client
        .post(s.url("/whole"))
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .body(r#"{"m": 2, "n": 1}"#);
    idem_tests::send(respelt)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(s.count("notes").await, 4);
    assert_eq!(s.keys().await, 4);
}

/// [`holds_the_contract`] through `store`, on `db`.
async fn serves_the_contract(db: &TestDb, store: Store) {
    prepare(db, &store).await;
    holds_the_contract(&TestApp::serve(db.pool(4).await, app(&store)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_holds_the_contract_in_the_default_mode() {
    with_test_db(async |db| {
        let store = Store::builder(db.pool(8).await).build().unwrap();
        serves_the_contract(db, store).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_holds_the_contract_in_the_portable_mode() {
    with_test_db(async |db| {
        let store = Store::builder(db.pool(8).await).portable(true).build();
        serves_the_contract(db, store.unwrap()).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_holds_the_contract_behind_a_transaction_pooler() {
    with_test_db(async |db| {
        let pgbouncer = Pgbouncer::start(db);
        serves_the_contract(db, pgbouncer.store(8).await).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_database_away_the_layer_answers_503_and_runs_nothing() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        prepare(db, &Store::builder(pool.clone()).build().unwrap()).await;
        let mut gate = Gate::start(&db.options).await;
        let store = gated_store(gate.options(db.options.clone()));
        let s = TestApp::serve(pool, app(&store)).await;
        gate.shut().await;
        s.post("/notes", Some("k-1"), &json!({ "n": 1 }))
            .await
            .assert_problem(503, "unavailable");
        gate.open().await;
        assert_eq!(s.count("notes").await, 0);
        assert_eq!(
            s.post("/notes", Some("k-1"), &json!({ "n": 1 }))
                .await
                .status,
            201
        );
    })
    .await;
}

/// A copy of the `Transaction` moved to a task that outlives the answer finds it ended:
/// its write never lands, in this request or outside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_kept_past_its_answer_has_ended() {
    async fn leaks(transaction: Transaction, Json(_): Json<Value>) -> StatusCode {
        let (tell, told) = oneshot::channel::<Result<(), Ended>>();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let locked = transaction.lock().await.map(drop);
            let _ = tell.send(locked);
        });
        LATE.lock().unwrap().replace(told);
        StatusCode::CREATED
    }
    static LATE: std::sync::Mutex<Option<oneshot::Receiver<Result<(), Ended>>>> =
        std::sync::Mutex::new(None);

    with_test_db(async |db| {
        let pool = db.pool(4).await;
        let store = Store::builder(pool.clone()).build().unwrap();
        prepare(db, &store).await;
        let layer = IdempotencyLayer::new(store, "leaks");
        let s = TestApp::serve(
            pool,
            Router::new().route("/leaks", post(leaks).layer(layer)),
        )
        .await;
        assert_eq!(s.post("/leaks", Some("k-1"), &json!({})).await.status, 201);
        let told = LATE.lock().unwrap().take().expect("the handler ran");
        assert!(matches!(
            told.await.expect("the task ran"),
            Err(Ended { .. })
        ));
    })
    .await;
}

/// Around a tower service that is no axum router: the path is fingerprinted (no route
/// matched it), a function reads the fingerprint, and the service's error rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn around_any_tower_service() {
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        let store = Store::builder(pool.clone()).build().unwrap();
        prepare(db, &store).await;
        // The fingerprint: the body's first line; a body without one is refused.
        let layer = IdempotencyLayer::new(store, "lines").fingerprint(|bytes: &[u8]| {
            let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
            text.lines()
                .next()
                .map(str::to_owned)
                .ok_or("an empty body".to_owned())
        });
        let service = tower::ServiceBuilder::new().layer(layer).service_fn(
            |request: Request<Body>| async move {
                let transaction = request.extensions().get::<Transaction>().cloned().unwrap();
                let path = request.uri().path().to_owned();
                let mut locked = transaction.lock().await.unwrap();
                sqlx::query("INSERT INTO notes (body) VALUES ($1)")
                    .bind(&path)
                    .execute(&mut *locked.tx())
                    .await
                    .unwrap();
                if path == "/fails" {
                    return Err("the service failed");
                }
                Ok::<_, &str>(axum::http::Response::new(Body::from(path)))
            },
        );
        let call = |path: &str, key: &str, body: &'static str| {
            let request = Request::post(path)
                .header("idempotency-key", key)
                .body(Body::from(body))
                .unwrap();
            service.clone().oneshot(request)
        };
        let first = call("/a", "k-1", "one\ntwo").await.unwrap();
        assert_eq!(first.status(), 200);
        let again = call("/a", "k-1", "one\nthree").await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        // Another path under the key: another request.
        assert_eq!(call("/b", "k-1", "one").await.unwrap().status(), 422);
        assert_eq!(call("/a", "k-2", "").await.unwrap().status(), 400);
        assert_eq!(
            call("/fails", "k-3", "one").await.unwrap_err(),
            "the service failed"
        );
        assert_eq!(idem_tests::count(&pool, "notes").await, 1);
        assert_eq!(idem_tests::count(&pool, "idempotency_keys").await, 1);
    })
    .await;
}

/// A handler that takes `Locked` on a route no layer wraps is answered 500, a
/// problem that names the mistake.
#[tokio::test]
async fn a_transaction_without_its_layer_is_a_problem() {
    async fn unwrapped(_: Locked) -> StatusCode {
        StatusCode::OK
    }
    let app: Router = Router::new().route("/", post(unwrapped));
    let response = app
        .oneshot(Request::post("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), 500);
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("no IdempotencyLayer"));
}

/// A layered charge: the processor called in a step (`in_a_step`) or straight (wrong),
/// then a row written through the transaction.
async fn charge(in_a_step: bool, mut locked: Locked, v: Value) -> (StatusCode, Json<Value>) {
    let url = v["processor"].as_str().unwrap_or_default().to_owned();
    let call = |key: Option<String>| async move {
        let mut sent = reqwest::Client::new().post(url);
        if let Some(key) = key {
            sent = sent.header("idempotency-key", key);
        }
        sent.send().await?.error_for_status()?.json::<Value>().await
    };
    let mut tx = locked.tx();
    let charged = if in_a_step {
        tx.step("processor", |key| call(Some(key)))
            .await
            .map_err(drop)
    } else {
        call(None).await.map_err(drop)
    };
    let Ok(charged) = charged else {
        return (StatusCode::BAD_GATEWAY, Json(json!({})));
    };
    let id = charged["id"].as_str().unwrap_or_default().to_owned();
    let inserted = sqlx::query("INSERT INTO notes (body) VALUES ($1)")
        .bind(&id)
        .execute(&mut *tx)
        .await;
    match inserted {
        Ok(_) => (StatusCode::CREATED, Json(json!({ "id": id }))),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({}))),
    }
}

/// The test kit's report on the layered charge, on a database of its own.
async fn kit_over_the_layer(in_a_step: bool) -> idem::testing::Report {
    let mut report = None;
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        sqlx::raw_sql("CREATE TABLE notes (id bigserial PRIMARY KEY, body text NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let processor = StandIn::honouring_keys("processor").await.unwrap();
        let body = json!({ "amount": 100, "processor": processor.url() }).to_string();
        let handler = move |locked: Locked, Json(v): Json<Value>| charge(in_a_step, locked, v);
        let run = Kit::new(pool, move |store| {
            let layer = IdempotencyLayer::new(store, "charges").fields(["/amount"]);
            Router::new().route("/charges", post(handler).layer(layer))
        })
        .request(move || {
            Request::post("/charges")
                .header("content-type", "application/json")
                .body(Body::from(body.clone()))
                .unwrap()
        })
        .effect(Effect::rows("notes"))
        .outside(&processor)
        .histories(4)
        .run();
        report = Some(run.await);
    })
    .await;
    report.expect("the kit ran")
}

/// The test kit over a layered handler: with its call in a step, every death at every
/// durable point, copies at once and the outage, each ending in the client's retry, keep
/// exactly-once; with the call outside a step, the kit's deaths make it again. The layer
/// and the attribute commit through the same `Claimed`, past the same failpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_kit_proves_a_layered_handler_and_catches_a_wrong_one() {
    let (right, wrong) = tokio::join!(kit_over_the_layer(true), kit_over_the_layer(false));
    right.assert_exactly_once();
    assert!(right.histories() > 8, "{right}");
    let again = |f: &idem::testing::Finding| {
        matches!(f.broke(), idem::testing::Broke::OutsideCalledAgain { .. })
    };
    assert!(wrong.findings().iter().any(again), "{wrong}");
}

/// A request dropped while its service runs (a client gone, a timeout) rolls back and
/// frees its key, though a copy of its `Transaction` lives on in a task, which then finds
/// it ended (invariant 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_request_frees_its_key_whatever_copy_of_its_transaction_lives_on() {
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        let store = Store::builder(pool.clone()).build().unwrap();
        prepare(db, &store).await;
        let (tell, told) = tokio::sync::mpsc::unbounded_channel::<Result<(), Ended>>();
        let service = tower::ServiceBuilder::new()
            .layer(IdempotencyLayer::new(store, "dropped"))
            .service_fn(move |request: Request<Body>| {
                let tell = tell.clone();
                async move {
                    let transaction = request.extensions().get::<Transaction>().cloned().unwrap();
                    {
                        let mut locked = transaction.lock().await.unwrap();
                        sqlx::query("INSERT INTO notes (body) VALUES ('dropped')")
                            .execute(&mut *locked.tx())
                            .await
                            .unwrap();
                    }
                    let late = transaction.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(800)).await;
                        let _ = tell.send(late.lock().await.map(drop));
                    });
                    if request.uri().path() == "/slow" {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                    Ok::<_, Infallible>(axum::http::Response::new(Body::empty()))
                }
            });
        let call = |path: &str| {
            let request = Request::post(path)
                .header("idempotency-key", "k-1")
                .body(Body::empty())
                .unwrap();
            service.clone().oneshot(request)
        };
        let dropped = tokio::time::timeout(Duration::from_millis(300), call("/slow")).await;
        assert!(dropped.is_err(), "the slow request was dropped");
        // The key is free at once: no 409 while the copy lives.
        let retried = call("/fast").await.unwrap();
        assert_eq!(retried.status(), 200);
        assert_eq!(
            idem_tests::count(&pool, "notes").await,
            1,
            "the dropped request's write rolled back"
        );
        let mut told = told;
        assert!(matches!(told.recv().await, Some(Err(Ended { .. }))));
        assert!(matches!(told.recv().await, Some(Err(Ended { .. }))));
    })
    .await;
}

/// What the layer refuses before it claims: a body over its limit (413), two `Locked`
/// in one handler, which would wait for each other (500), a layer around an idempotent
/// endpoint, another layer or `#[idempotent]`, which would claim twice (500).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_refuses_what_it_cannot_hold() {
    async fn twice(_: Locked, _: Locked) -> StatusCode {
        StatusCode::CREATED
    }
    #[idem::idempotent(scope = "attribute")]
    async fn attribute(mut tx: idem::Tx, Json(_): Json<Value>) -> StatusCode {
        let _ = sqlx::query("INSERT INTO notes (body) VALUES ('attribute')")
            .execute(&mut *tx)
            .await;
        StatusCode::CREATED
    }
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        let store = Store::builder(pool.clone()).build().unwrap();
        prepare(db, &store).await;
        let layer = |scope| IdempotencyLayer::new(store.clone(), scope);
        let app = Router::new()
            .route("/notes", post(note).layer(layer("notes")))
            .route("/twice", post(twice).layer(layer("twice")))
            .route(
                "/stacked",
                post(note).layer(
                    tower::ServiceBuilder::new()
                        .layer(layer("outer"))
                        .layer(layer("inner")),
                ),
            )
            .route("/attribute", post(attribute).layer(layer("outer")))
            .route(
                "/small",
                post(note).layer(
                    tower::ServiceBuilder::new()
                        .layer(axum::extract::DefaultBodyLimit::max(64))
                        .layer(layer("small")),
                ),
            )
            .with_state(store.clone());
        let s = TestApp::serve(pool, app).await;
        let big = s
            .client
            .post(s.url("/notes"))
            .header("idempotency-key", "k-1")
            .body(vec![b' '; 2 * 1024 * 1024 + 1]);
        idem_tests::send(big)
            .await
            .assert_problem(413, "invalid-request");
        // The route's own limit, as its extractors read it.
        let n = "1".repeat(80);
        s.post("/small", Some("k-1"), &json!({ "n": n }))
            .await
            .assert_problem(413, "invalid-request");
        assert_eq!(
            s.post("/small", Some("k-2"), &json!({ "n": 1 }))
                .await
                .status,
            201
        );
        let held = s.post("/twice", Some("k-1"), &json!({})).await;
        assert_eq!(held.status, 500);
        assert!(held.json()["detail"]
            .as_str()
            .unwrap()
            .contains("already held"));
        for path in ["/stacked", "/attribute"] {
            let stacked = s.post(path, Some("k-1"), &json!({ "n": 1 })).await;
            assert_eq!(stacked.status, 500, "{path}");
            let detail = stacked.json()["detail"].as_str().unwrap().to_owned();
            assert!(detail.contains("idempotent itself"), "{path}: {detail}");
        }
        assert_eq!(s.count("notes").await, 1, "the one that fitted");
    })
    .await;
}

/// A store on a pool that never connects: the layer's settings are checked where it is
/// made.
fn unconnected() -> Store {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .unwrap();
    Store::new(pool)
}

#[tokio::test]
#[should_panic(expected = "must be 1 to 64 characters")]
async fn a_scope_the_attribute_would_refuse_panics_where_the_layer_is_made() {
    let _ = IdempotencyLayer::new(unconnected(), "two words");
}

#[tokio::test]
#[should_panic(expected = "is not between one second and 100 years")]
async fn a_ttl_of_nothing_panics_where_the_layer_is_made() {
    let _ = IdempotencyLayer::new(unconnected(), "notes").ttl(Duration::ZERO);
}

#[tokio::test]
async fn pointers_are_checked_where_the_layer_is_made() {
    for (pointers, message) in [
        (vec!["amount"], "is not a JSON pointer"),
        (vec!["/a~2"], "is not a JSON pointer"),
        (vec!["/amount", "/amount"], "is given twice"),
        (vec![], "name at least one JSON pointer"),
    ] {
        let made = std::panic::catch_unwind(|| {
            IdempotencyLayer::new(unconnected(), "notes").fields(pointers.clone())
        });
        let panic = made.expect_err("refused");
        let text = match panic.downcast_ref::<String>() {
            Some(text) => text.as_str(),
            None => panic.downcast_ref::<&str>().copied().unwrap_or_default(),
        };
        assert!(text.contains(message), "{pointers:?}: {text}");
    }
    let _ = IdempotencyLayer::new(unconnected(), "notes").fields(["", "/a~0b/~1c/0"]);
}
