//! `completable = true` and `idem::complete::Completer` on a router of their own (issue
//! 38): what is stored with a request's first step (the client's target under a nested
//! router, the allowed headers and never a credential, the body as sent); a body over
//! the cap answers 413 and runs nothing; a completion runs under the stored principal,
//! whatever a header says, and its answer is the key's; a request of an endpoint that is
//! not completable can only be abandoned, and its abandon runs the compensation once
//! however often it is tried, then answers 410.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Json, Router};
use idem::complete::{Completed, Completer, Completion};
use idem::operate::Operator;
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp};
use serde_json::{json, Value};

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    /// Whether the handlers fail after their step.
    failing: Arc<AtomicBool>,
    /// How often the steps' calls ran.
    calls: Arc<AtomicU32>,
}

#[derive(Clone)]
struct Account(String);

/// `Authorization: Bearer <account>`; a completion under its stored principal.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let account = match req.extensions().get::<Completion>() {
        Some(completion) => completion.principal().map(str::to_owned),
        None => req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_owned),
    };
    match account {
        Some(account) => {
            req.extensions_mut().insert(Account(account));
            next.run(req).await
        }
        None => Response::builder()
            .status(StatusCode::UNAUTHORIZED)
            .body(Default::default())
            .expect("a response"),
    }
}

async fn step_then(
    tx: &mut Tx<'_>,
    state: &AppState,
    account: &str,
    body: &Value,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    let calls = Arc::clone(&state.calls);
    let charged: u32 = tx
        .step("processor", |_key| async move {
            Ok::<_, std::convert::Infallible>(calls.fetch_add(1, Ordering::SeqCst) + 1)
        })
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    if state.failing.load(Ordering::SeqCst) {
        return Err(StatusCode::INTERNAL_SERVER_ERROR);
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "charge": charged, "account": account, "amount": body["amount"] })),
    ))
}

#[idempotent(scope = "charges", completable = true)]
async fn charge(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
    mut tx: Tx,
    Json(body): Json<Value>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    step_then(&mut tx, &state, &account.0, &body).await
}

#[idempotent(scope = "plain")]
async fn plain(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
    mut tx: Tx,
    Json(body): Json<Value>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    step_then(&mut tx, &state, &account.0, &body).await
}

fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/charges", post(charge))
        .route("/plain", post(plain))
        .layer(middleware::from_fn(authenticate))
        .with_state(state);
    Router::new().nest("/api", api)
}

async fn stored(app: &TestApp, key: &str) -> (String, String, Value, Vec<u8>, String) {
    sqlx::query_as(
        "SELECT method, target, headers::json, body, principal FROM idempotency_requests \
         WHERE key = $1",
    )
    .bind(key)
    .fetch_one(&app.pool)
    .await
    .expect("the stored request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completable_request_is_stored_and_completed_under_its_principal() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let store = Store::builder(pool.clone())
            .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
            .max_response_bytes(4_096)
            .build()
            .expect("a store");
        store.migrate().await.expect("migrate");
        let state = AppState {
            store: store.clone(),
            failing: Arc::new(AtomicBool::new(true)),
            calls: Arc::new(AtomicU32::new(0)),
        };
        let app = router(state.clone());
        let served = TestApp::serve(pool.clone(), app.clone()).await;
        let headers = [
            ("authorization", "Bearer acct_1"),
            ("cookie", "session=secret"),
            ("x-other", "not kept"),
        ];
        let body = json!({ "amount": 42 });
        let failed = served
            .post_with("/api/charges?via=test", Some("k-1"), &body, &headers)
            .await;
        assert_eq!(failed.status, 500, "{failed:?}");
        let (method, target, stored_headers, stored_body, principal) = stored(&served, "k-1").await;
        assert_eq!(method, "POST");
        assert_eq!(
            target, "/api/charges?via=test",
            "the client's target, not the nested one"
        );
        assert_eq!(principal, "acct_1");
        let mut names: Vec<&str> = stored_headers
            .as_array()
            .expect("an array")
            .iter()
            .filter_map(|pair| pair[0].as_str())
            .collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["content-type", "idempotency-key"],
            "{stored_headers}"
        );
        assert_eq!(serde_json::from_slice::<Value>(&stored_body).unwrap(), body);

        // Too large to be stored: refused before anything runs.
        let calls = state.calls.load(Ordering::SeqCst);
        let huge = json!({ "amount": 1, "pad": "x".repeat(5_000) });
        let refused = served
            .post_with("/api/charges", Some("k-huge"), &huge, &headers[..1])
            .await;
        refused.assert_problem(413, "request-too-large");
        assert_eq!(state.calls.load(Ordering::SeqCst), calls, "nothing ran");

        // The completion: under the stored principal, its answer the key's.
        state.failing.store(false, Ordering::SeqCst);
        let completer = Completer::new(store.clone(), app.clone()).after(Duration::ZERO);
        let ran = completer.run_due().await.expect("a look");
        assert_eq!(ran, [("k-1".to_owned(), Completed::Completed)]);
        assert_eq!(served.count("idempotency_requests").await, 0);
        assert_eq!(served.count("idempotency_steps").await, 0);
        let late = served
            .post_with("/api/charges?via=test", Some("k-1"), &body, &headers[..1])
            .await;
        assert!(late.replayed(), "{late:?}");
        assert_eq!(late.json()["account"], "acct_1");
        assert_eq!(late.json()["charge"], 1, "the step replayed: one call");
        assert_eq!(state.calls.load(Ordering::SeqCst), calls);
        assert!(completer.run_due().await.expect("a look").is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandon_compensates_once_and_its_key_answers_410() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let store = Store::builder(pool.clone())
            .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
            .build()
            .expect("a store");
        store.migrate().await.expect("migrate");
        let state = AppState {
            store: store.clone(),
            failing: Arc::new(AtomicBool::new(true)),
            calls: Arc::new(AtomicU32::new(0)),
        };
        let app = router(state.clone());
        let served = TestApp::serve(pool.clone(), app.clone()).await;
        let body = json!({ "amount": 7 });
        let bearer = [("authorization", "Bearer acct_2")];
        let failed = served.post_with("/api/plain", Some("k-2"), &body, &bearer).await;
        assert_eq!(failed.status, 500, "{failed:?}");
        assert_eq!(
            served.count("idempotency_requests").await,
            0,
            "not completable: nothing stored"
        );

        // The compensation fails once, then succeeds: it runs once to its end.
        let undone = Arc::new(AtomicU32::new(0));
        let refusals = Arc::new(AtomicU32::new(1));
        let completer = Completer::new(store.clone(), app.clone())
            .after(Duration::ZERO)
            .backoff(Duration::from_millis(1), Duration::from_millis(1))
            .compensate("processor", {
                let (undone, refusals) = (Arc::clone(&undone), Arc::clone(&refusals));
                move |undo| {
                    let (undone, refusals) = (Arc::clone(&undone), Arc::clone(&refusals));
                    async move {
                        assert_eq!(undo.result::<u32>().expect("the step's result"), 1);
                        assert_eq!(undo.principal(), Some("acct_2"));
                        assert_eq!(undo.key().len(), 64);
                        if refusals
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                            .is_ok()
                        {
                            return Err("the processor is down");
                        }
                        undone.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    }
                }
            });
        let operator = store.operate().audited(Operator::new("ops", "test"));
        assert!(!operator
            .complete_request("plain", "acct_2", "k-2")
            .await
            .expect("complete"));
        assert!(operator
            .abandon_request("plain", "acct_2", "k-2")
            .await
            .expect("abandon"));
        let first = completer.run_due().await.expect("a look");
        assert!(
            matches!(&first[..], [(key, Completed::Retrying(error))] if key == "k-2" && error.contains("down")),
            "{first:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        let second = completer.run_due().await.expect("a look");
        assert_eq!(second, [("k-2".to_owned(), Completed::Abandoned)]);
        assert_eq!(undone.load(Ordering::SeqCst), 1);
        assert_eq!(served.count("idempotency_requests").await, 0);
        assert_eq!(served.count("idempotency_steps").await, 0);
        let late = served.post_with("/api/plain", Some("k-2"), &body, &bearer).await;
        late.assert_problem(410, "request-abandoned");
        assert!(late.replayed(), "{late:?}");
        assert_eq!(state.calls.load(Ordering::SeqCst), 1, "the step never ran again");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completer_that_abandons_what_it_parks_compensates_at_once() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let store = Store::builder(pool.clone())
            .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
            .build()
            .expect("a store");
        store.migrate().await.expect("migrate");
        let state = AppState {
            store: store.clone(),
            failing: Arc::new(AtomicBool::new(true)),
            calls: Arc::new(AtomicU32::new(0)),
        };
        let app = router(state.clone());
        let served = TestApp::serve(pool.clone(), app.clone()).await;
        let bearer = [("authorization", "Bearer acct_3")];
        let failed = served
            .post_with("/api/charges", Some("k-3"), &json!({ "amount": 3 }), &bearer)
            .await;
        assert_eq!(failed.status, 500, "{failed:?}");
        let undone = Arc::new(AtomicU32::new(0));
        let completer = Completer::new(store.clone(), app.clone())
            .after(Duration::ZERO)
            .max_attempts(1)
            .abandon_parked(true)
            .compensate("processor", {
                let undone = Arc::clone(&undone);
                move |_undo| {
                    let undone = Arc::clone(&undone);
                    async move {
                        undone.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, std::io::Error>(())
                    }
                }
            });
        let first = completer.run_due().await.expect("a look");
        assert!(
            matches!(&first[..], [(key, Completed::Parked(error))] if key == "k-3" && error.contains("500")),
            "{first:?}"
        );
        assert_eq!(undone.load(Ordering::SeqCst), 0);
        let second = completer.run_due().await.expect("a look");
        assert_eq!(second, [("k-3".to_owned(), Completed::Abandoned)]);
        assert_eq!(undone.load(Ordering::SeqCst), 1);
        let late = served
            .post_with("/api/charges", Some("k-3"), &json!({ "amount": 3 }), &bearer)
            .await;
        late.assert_problem(410, "request-abandoned");
    })
    .await;
}
