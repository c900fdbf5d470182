//! Where two features meet (issue 48), each finding of the review of `a3c0460` pinned by
//! a test that failed there:
//!
//! - a deploy that reorders or adds `fields` stranded a request that had recorded a step:
//!   its client's identical retry answered 422, and the completer parked it (a step's
//!   record was compared on the combined hash alone);
//! - an abandon and a late retry both won: while an undo waited out its backoff, the key
//!   was free, and the client's retry replayed the steps and committed 201 beside the
//!   refund (the abandon is now decided under the key before its first undo: 409, then
//!   410, to everyone);
//! - an abandon claimed undos that never ran (a step with no compensation registered):
//!   the 410, the log line and the audit trail now name what was not undone;
//! - undos ran in the heap order of the steps' rows: now the last step's first.
//!
//! (sqlx's nested unit of work committing the request's transaction is pinned in
//! `mut_tx.rs`.)

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::complete::{Completed, Completer};
use idem::operate::Operator;
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    /// Whether the handlers fail after their steps.
    failing: Arc<AtomicBool>,
    /// How often each step's call ran.
    calls: Arc<Mutex<Vec<String>>>,
}

impl AppState {
    fn new(store: Store) -> Self {
        Self {
            store,
            failing: Arc::new(AtomicBool::new(true)),
            calls: Arc::default(),
        }
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    #[serde(default)]
    customer: String,
}

/// The steps `names`, in order, then a charge written, or a 500 while failing.
async fn steps_then_charge(
    tx: &mut Tx<'_>,
    state: &AppState,
    names: &[&str],
    req: &NewCharge,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    for name in names {
        let calls = Arc::clone(&state.calls);
        let step = (*name).to_owned();
        tx.step(name, |_key| async move {
            calls.lock().unwrap().push(step.clone());
            Ok::<_, std::convert::Infallible>(step)
        })
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    }
    if state.failing.load(Ordering::SeqCst) {
        return Err(StatusCode::INTERNAL_SERVER_ERROR);
    }
    sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
        .bind(req.amount)
        .execute(&mut **tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(json!({ "amount": req.amount }))))
}

/// The version before the deploy.
#[idempotent(scope = "charges", fields = [amount, currency], completable = true)]
async fn charge_v1(
    State(state): State<AppState>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    steps_then_charge(&mut tx, &state, &["processor"], &req).await
}

/// The version after it: `fields` reordered, and one added.
#[idempotent(scope = "charges", fields = [currency, amount, customer], completable = true)]
async fn charge_v2(
    State(state): State<AppState>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    steps_then_charge(&mut tx, &state, &["processor"], &req).await
}

/// Two steps, then the charge.
#[idempotent(scope = "orders", completable = true)]
async fn order(
    State(state): State<AppState>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    steps_then_charge(&mut tx, &state, &["reserve", "processor"], &req).await
}

async fn setup(pool: &sqlx::PgPool) -> Store {
    sqlx::raw_sql("CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let store = Store::new(pool.clone());
    store.migrate().await.expect("migrate");
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deploy_that_reorders_or_adds_fields_resumes_a_request_with_a_recorded_step() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let store = setup(&pool).await;
        let state = AppState::new(store.clone());
        let v1 = TestApp::serve(
            pool.clone(),
            Router::new()
                .route("/charges", post(charge_v1))
                .with_state(state.clone()),
        )
        .await;
        let v2_router = Router::new()
            .route("/charges", post(charge_v2))
            .with_state(state.clone());
        let v2 = TestApp::serve(pool.clone(), v2_router.clone()).await;
        let body = json!({ "amount": 5, "currency": "eur" });

        // Before the deploy: the step is recorded, then the handler fails.
        assert_eq!(v1.post("/charges", Some("k1"), &body).await.status, 500);
        assert_eq!(v1.post("/charges", Some("k2"), &body).await.status, 500);
        assert_eq!(state.calls().len(), 2);
        state.failing.store(false, Ordering::SeqCst);

        // After it: the client's identical retry resumes after the step.
        let retry = v2.post("/charges", Some("k1"), &body).await;
        assert_eq!(retry.status, 201, "{retry:?}");
        assert_eq!(
            state.calls().len(),
            2,
            "the step replayed, not called again"
        );
        // Another payload under the key is still another request: its step refuses it
        // (`StepError::Mismatch`, which this handler answers 502), and calls nobody.
        let other = json!({ "amount": 6, "currency": "eur" });
        let refused = v2.post("/charges", Some("k2"), &other).await;
        assert_eq!(refused.status, 502, "{refused:?}");
        assert_eq!(state.calls().len(), 2);

        // The completer of the new version finishes the other one, stored by the old.
        let completer = Completer::new(store.clone(), v2_router).after(Duration::ZERO);
        let done = completer.run_due().await.expect("a look");
        assert_eq!(done, [("k2".to_owned(), Completed::Completed)]);
        assert_eq!(state.calls().len(), 2, "no step ran again");
        assert_eq!(v2.count("charges").await, 2);
        let late = v2.post("/charges", Some("k2"), &body).await;
        assert_eq!(late.status, 201);
        assert!(late.replayed());
    })
    .await;
}

/// The orders service, on a fresh store, and its request `k1`, failed after both steps:
/// the store, the state, the router, the served app and the request's body.
async fn a_failed_order(db: &TestDb) -> (Store, AppState, Router, TestApp, Value) {
    let pool = db.pool(8).await;
    let store = setup(&pool).await;
    let state = AppState::new(store.clone());
    let app = Router::new()
        .route("/orders", post(order))
        .with_state(state.clone());
    let served = TestApp::serve(pool.clone(), app.clone()).await;
    let body = json!({ "amount": 9, "currency": "eur" });
    assert_eq!(served.post("/orders", Some("k1"), &body).await.status, 500);
    (store, state, app, served, body)
}

/// A completer whose undo of `failing_once` fails the first time, recording each undo.
fn completer(
    store: &Store,
    app: Router,
    undos: &Arc<Mutex<Vec<String>>>,
    failing_once: &str,
    with_undo: &[&str],
) -> Completer {
    let refused = Arc::new(AtomicU32::new(0));
    let mut completer = Completer::new(store.clone(), app)
        .after(Duration::from_secs(3600))
        .backoff(Duration::from_millis(1), Duration::from_millis(1));
    for step in with_undo {
        let (undos, refused) = (Arc::clone(undos), Arc::clone(&refused));
        let fails = *step == failing_once;
        completer = completer.compensate(step, move |undo| {
            let (undos, refused) = (Arc::clone(&undos), Arc::clone(&refused));
            async move {
                if fails && refused.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err("the processor is down");
                }
                undos.lock().unwrap().push(undo.step().to_owned());
                Ok(())
            }
        });
    }
    completer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandon_is_decided_before_its_first_undo_and_a_late_retry_never_wins() {
    with_test_db(async |db| {
        let (store, state, app, served, body) = a_failed_order(db).await;
        assert_eq!(state.calls(), ["reserve", "processor"]);

        let undos = Arc::default();
        let completer = completer(&store, app, &undos, "reserve", &["reserve", "processor"]);
        let operator = store.operate().audited(Operator::new("ops", "test"));
        assert!(operator
            .abandon_request("orders", "", "k1")
            .await
            .expect("abandon"));
        // The processor's undo runs (the last step's first), the reservation's fails.
        let first = completer.run_due().await.expect("a look");
        assert!(
            matches!(&first[..], [(_, Completed::Retrying(e))] if e.contains("down")),
            "{first:?}"
        );
        assert_eq!(*undos.lock().unwrap(), ["processor"]);

        // The client comes back now, its handler healed: the key is being abandoned.
        state.failing.store(false, Ordering::SeqCst);
        for _ in 0..2 {
            let late = served.post("/orders", Some("k1"), &body).await;
            late.assert_problem(409, "request-abandoning");
            assert!(late.header("retry-after").is_some());
        }
        assert_eq!(
            served.count("charges").await,
            0,
            "the late retry wrote nothing"
        );
        assert_eq!(state.calls().len(), 2, "and called nobody");

        tokio::time::sleep(Duration::from_millis(10)).await;
        let second = completer.run_due().await.expect("a look");
        assert_eq!(second, [("k1".to_owned(), Completed::Abandoned)]);
        assert_eq!(
            *undos.lock().unwrap(),
            ["processor", "reserve"],
            "each undone once, in reverse order of the steps"
        );
        let late = served.post("/orders", Some("k1"), &body).await;
        late.assert_problem(410, "request-abandoned");
        assert!(late.replayed());
        let again = served.post("/orders", Some("k1"), &body).await;
        assert_eq!(again.body, late.body, "the 410, byte for byte");
        assert_eq!(served.count("charges").await, 0);
        assert_eq!(served.count("idempotency_steps").await, 0);
        assert_eq!(served.count("idempotency_requests").await, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandon_names_every_step_it_did_not_undo() {
    with_test_db(async |db| {
        let (store, _state, app, served, body) = a_failed_order(db).await;

        // Only the processor's step has an undo registered.
        let undos = Arc::default();
        let completer = completer(&store, app, &undos, "", &["processor"]);
        let operator = store.operate().audited(Operator::new("ops", "test"));
        assert!(operator
            .abandon_request("orders", "", "k1")
            .await
            .expect("abandon"));
        let done = completer.run_due().await.expect("a look");
        assert_eq!(done, [("k1".to_owned(), Completed::Abandoned)]);
        assert_eq!(*undos.lock().unwrap(), ["processor"]);

        let late = served.post("/orders", Some("k1"), &body).await;
        late.assert_problem(410, "request-abandoned");
        let detail = late.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            detail.contains("undone elsewhere: \"processor\"")
                && detail.contains("NOT undone (no undo registered): \"reserve\""),
            "{detail}"
        );
        let audit = store
            .operate()
            .audit_log(10, None)
            .await
            .expect("the audit trail");
        let abandoned = audit
            .iter()
            .find(|row| row.action == "abandoned")
            .expect("the completer's row");
        assert!(
            abandoned
                .filter
                .contains("not undone (no undo registered): [\"reserve\"]")
                && abandoned.filter.contains("undone: [\"processor\"]"),
            "{abandoned:?}"
        );
        assert!(
            audit.iter().any(|row| row.action == "abandon"),
            "the operator's row"
        );
    })
    .await;
}

/// Issue 48 (a new user's trial): "Complete now" (the console, `idem key complete`)
/// waited for the completer's window (`Completer::after`), though the docs say "at the
/// next look".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_now_runs_at_the_completers_next_look() {
    with_test_db(async |db| {
        let (store, state, app, served, body) = a_failed_order(db).await;
        state.failing.store(false, Ordering::SeqCst);
        // A window of an hour: the request is not due by age.
        let completer = completer(&store, app, &Arc::default(), "", &[]);
        assert_eq!(completer.run_due().await.expect("a look"), []);
        let operator = store.operate().audited(Operator::new("ops", "test"));
        assert!(operator
            .complete_request("orders", "", "k1")
            .await
            .expect("complete"));
        let done = completer.run_due().await.expect("a look");
        assert_eq!(done, [("k1".to_owned(), Completed::Completed)]);
        assert_eq!(state.calls().len(), 2, "its steps replayed");
        let late = served.post("/orders", Some("k1"), &body).await;
        assert_eq!(late.status, 201);
        assert!(late.replayed());
    })
    .await;
}
