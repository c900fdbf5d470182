//! A duplicate waits as long as its endpoint says (`concurrency = wait(..)`), whatever
//! statement timeout is in force: the endpoint's own, shorter than the wait, or the
//! session's (a role's, a connection's). Regression (issue 27, 3): the duplicate was
//! answered 500 (57014) when the statement timeout ran out first, in both modes.

use std::str::FromStr;
use std::time::Duration;

use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{migrated_store, with_test_db, Answer, TestApp, TestDb};
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[derive(Clone, FromRef)]
struct State {
    store: Store,
}

/// Holds the request's key for `ms` milliseconds.
async fn hold(v: &Value) -> Json<Value> {
    let ms = v["ms"].as_u64().unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Json(json!({ "slept": ms }))
}

#[idempotent(scope = "short", key = header("Job"), concurrency = wait("5s"), statement_timeout = "300ms")]
async fn short(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    hold(&v).await
}

#[idempotent(scope = "session", key = header("Job"), concurrency = wait("5s"))]
async fn session(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    hold(&v).await
}

/// The app on a pool whose sessions have `statement_timeout = 300ms`, in the default or
/// the portable mode.
async fn serve(db: &TestDb, portable: bool) -> TestApp {
    let options = PgConnectOptions::from_str(&db.url())
        .unwrap()
        .options([("statement_timeout", "300ms")]);
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .connect_with(options)
        .await
        .unwrap();
    let store = migrated_store(pool.clone(), portable).await;
    let app = Router::new()
        .route("/short", post(short))
        .route("/session", post(session))
        .with_state(State { store });
    TestApp::serve(pool, app).await
}

async fn job(s: &TestApp, path: &str, job: &str, ms: u64) -> Answer {
    let request = s
        .client
        .post(s.url(path))
        .header("Job", job)
        .json(&json!({ "ms": ms }));
    idem_tests::send(request).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waits_past_a_shorter_statement_timeout_and_replays() {
    for portable in [false, true] {
        with_test_db(async |db| {
            let s = serve(db, portable).await;
            for path in ["/short", "/session"] {
                let first = job(&s, path, "j1", 1500);
                let duplicate = async {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    job(&s, path, "j1", 1500).await
                };
                let (first, duplicate) = tokio::join!(first, duplicate);
                assert_eq!(first.status, 200, "portable {portable} {path}: {first:?}");
                assert_eq!(
                    duplicate.status, 200,
                    "portable {portable} {path}: the duplicate: {duplicate:?}"
                );
                assert!(duplicate.replayed(), "portable {portable} {path}");
                assert_eq!(duplicate.body, first.body);
            }
        })
        .await;
    }
}

#[idempotent(scope = "settings", key = header("Job"), statement_timeout = "2500ms")]
async fn settings(mut tx: Tx, Json(_v): Json<Value>) -> Json<Value> {
    let (lock, statement): (String, String) = sqlx::query_as(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    Json(json!({ "lock_timeout": lock, "statement_timeout": statement }))
}

/// Regression (issue 27, 13): after a portable claim, the handler got the role's
/// `lock_timeout` back instead of the one its session had before the claim. In both
/// modes the handler runs with its session's `lock_timeout` and its endpoint's
/// statement timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_runs_with_the_settings_it_had_before_the_claim() {
    for portable in [false, true] {
        with_test_db(async |db| {
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        sqlx::raw_sql("SET lock_timeout = '4321ms'")
                            .execute(conn)
                            .await
                            .map(drop)
                    })
                })
                .connect_with(PgConnectOptions::from_str(&db.url()).unwrap())
                .await
                .unwrap();
            let store = migrated_store(pool.clone(), portable).await;
            let app = Router::new()
                .route("/settings", post(settings))
                .with_state(State { store });
            let s = TestApp::serve(pool, app).await;
            let answer = job(&s, "/settings", "j1", 0).await;
            assert_eq!(
                answer.json(),
                json!({ "lock_timeout": "4321ms", "statement_timeout": "2500ms" }),
                "portable {portable}"
            );
        })
        .await;
    }
}
