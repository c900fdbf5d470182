//! Regression: a request that axum or tower cancelled (a timeout layer dropped its
//! future) kept its key answering 409 until PostgreSQL finished the abandoned
//! statement, and nothing was logged or counted. With the store's `statement_timeout`
//! the server ends that statement, the key is free again, and the span says
//! `cancelled`. One test in its own binary: it installs the process-wide subscriber.

use std::time::Duration;

use axum::extract::{FromRef, Request};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, ClosedSpans, TestApp};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing_subscriber::prelude::*;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
}

#[derive(Deserialize, Serialize)]
struct Job {
    id: i64,
    sleep: bool,
}

/// Sleeps in PostgreSQL when asked: a statement that outlives the request.
async fn work(tx: &mut Tx<'_>, job: &Job) -> Result<StatusCode, String> {
    if job.sleep {
        sqlx::query("SELECT pg_sleep(5)")
            .execute(&mut **tx)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(StatusCode::CREATED)
}

/// Bounded by the store's `statement_timeout`.
#[idempotent(scope = "jobs", fields = [id])]
async fn run_job(mut tx: Tx, Json(job): Json<Job>) -> Result<StatusCode, String> {
    work(&mut tx, &job).await
}

/// Bounded by the endpoint itself, on a store without a statement timeout.
#[idempotent(scope = "own-jobs", fields = [id], statement_timeout = "400ms")]
async fn run_own_job(mut tx: Tx, Json(job): Json<Job>) -> Result<StatusCode, String> {
    work(&mut tx, &job).await
}

/// A request the layer drops mid-statement, then its retry past the statement timeout:
/// the abandoned `pg_sleep` has been cancelled and the transaction rolled back, so the
/// retry runs (201) instead of answering 409 for 5 s.
async fn dropped_then_retried(s: &TestApp, key: &str, id: i64) {
    let first = s
        .post("/jobs", Some(key), &json!({ "id": id, "sleep": true }))
        .await;
    assert_eq!(first.status, 504, "the layer gave up on it");
    tokio::time::sleep(Duration::from_millis(700)).await;
    // The retry goes through the same 150 ms deadline: on a busy machine its first claim
    // on a new connection (which prepares idem's statements) may outlast it, and the
    // layer answers 504 again. Retried, as a client would; a key still held by the
    // abandoned statement would answer 409 (or time out) until its 5 s were over.
    let started = std::time::Instant::now();
    let mut retry = s
        .post("/jobs", Some(key), &json!({ "id": id, "sleep": false }))
        .await;
    for _ in 0..5 {
        if retry.status != 504 {
            break;
        }
        retry = s
            .post("/jobs", Some(key), &json!({ "id": id, "sleep": false }))
            .await;
    }
    let body = String::from_utf8_lossy(&retry.body);
    assert_eq!(retry.status, 201, "body: {body}");
    assert!(!retry.replayed());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// What `tower_http::timeout::TimeoutLayer` does: drop the request's future after a
/// deadline and answer for it.
async fn deadline(request: Request, next: Next) -> Response {
    match tokio::time::timeout(Duration::from_millis(150), next.run(request)).await {
        Ok(response) => response,
        Err(_) => StatusCode::GATEWAY_TIMEOUT.into_response(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_frees_its_key_and_is_recorded() {
    let spans = ClosedSpans::default();
    tracing_subscriber::registry().with(spans.clone()).init();
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::builder(pool.clone())
            .statement_timeout(Duration::from_millis(400))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/jobs", post(run_job))
            .layer(middleware::from_fn(deadline))
            .with_state(AppState { store });
        let s = TestApp::serve(pool, app).await;

        dropped_then_retried(&s, "k1", 1).await;

        // An endpoint's own `statement_timeout`, on a store without one.
        let plain = Store::new(s.pool.clone());
        let own = Router::new()
            .route("/jobs", post(run_own_job))
            .layer(middleware::from_fn(deadline))
            .with_state(AppState { store: plain });
        let o = TestApp::serve(s.pool.clone(), own).await;
        dropped_then_retried(&o, "k2", 2).await;

        let outcomes: Vec<String> = spans
            .take()
            .iter()
            .filter_map(|span| span.get("outcome").map(str::to_owned))
            .collect();
        assert_eq!(
            outcomes,
            ["cancelled", "fresh", "cancelled", "fresh"],
            "spans: {outcomes:?}"
        );
    })
    .await;
}
