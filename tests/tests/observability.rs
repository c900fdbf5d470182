//! Observability: every idempotent request leaves one `idem.request` span with its
//! scope, outcome and timings (and never a key), and the `metrics` counters agree.
//! One test in its own binary: it installs the process-wide subscriber and recorder.

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{post as send, with_test_db, ClosedSpans, TestApp};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use serde_json::{json, Value};
use tracing_subscriber::prelude::*;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[idempotent(scope = "obs")]
async fn handler(
    mut tx: Tx,
    Json(v): Json<Value>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    if v["fail"] == true {
        return Err(StatusCode::BAD_REQUEST);
    }
    if v["escape"] == true {
        // A COMMIT would be refused (the handler's own Err); a ROLLBACK ends idem's
        // transaction, which idem catches after the handler: the "failed" outcome.
        sqlx::Executor::execute(&mut *tx, "ROLLBACK")
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    }
    let ms = v["sleep_ms"].as_u64().unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Ok((StatusCode::CREATED, Json(v)))
}

#[idempotent(scope = "obs-optional", required = false)]
async fn optional(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_is_recorded_in_the_span_and_the_metrics() {
    let spans = ClosedSpans::default();
    tracing_subscriber::registry().with(spans.clone()).init();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder of this binary");

    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let app = |idempotency: Store| {
            Router::new()
                .route("/", post(handler))
                .route("/optional", post(optional))
                .with_state(AppState { idempotency })
        };
        let server = TestApp::serve(pool, app(store)).await;
        let dead_pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(300))
            .connect_lazy_with(idem_tests::admin_options().port(1));
        let dead = TestApp::serve(dead_pool.clone(), app(Store::new(dead_pool))).await;
        let client = server.client.clone();
        let url = server.url("/");
        let secret = "secret-key-6a1f";

        let fresh = send(&client, &url, Some(secret), &json!({ "n": 1 }), &[]).await;
        assert_eq!(fresh.status, 201);
        assert!(send(&client, &url, Some(secret), &json!({ "n": 1 }), &[])
            .await
            .replayed());
        assert_eq!(
            send(&client, &url, Some(secret), &json!({ "n": 2 }), &[])
                .await
                .status,
            422
        );
        assert_eq!(
            send(&client, &url, Some("k-fail"), &json!({ "fail": true }), &[])
                .await
                .status,
            400
        );
        assert_eq!(send(&client, &url, None, &json!({}), &[]).await.status, 400);
        assert_eq!(
            send(&client, &url, Some("a b"), &json!({}), &[])
                .await
                .status,
            400
        );
        assert_eq!(
            send(
                &client,
                &url,
                Some("k-escape"),
                &json!({ "escape": true }),
                &[]
            )
            .await
            .status,
            500
        );
        assert_eq!(
            send(&client, &dead.url("/"), Some("k-dead"), &json!({}), &[])
                .await
                .status,
            503
        );
        assert_eq!(
            send(&client, &server.url("/optional"), None, &json!({}), &[])
                .await
                .status,
            200
        );
        let slow = json!({ "sleep_ms": 500 });
        let (first, second) =
            tokio::join!(send(&client, &url, Some("k-slow"), &slow, &[]), async {
                tokio::time::sleep(Duration::from_millis(150)).await;
                send(&client, &url, Some("k-slow"), &slow, &[]).await
            });
        assert_eq!((first.status, second.status), (201, 409));

        // Spans close when the last handle goes, just after the answer is written.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let spans = spans.take();
        let mut outcomes: HashMap<String, usize> = HashMap::new();
        for span in &spans {
            *outcomes
                .entry(span.0.get("outcome").cloned().unwrap_or_default())
                .or_default() += 1;
            assert!(
                span.0.get("scope").is_some_and(|s| s.starts_with("obs")),
                "{span:?}"
            );
            assert!(
                span.0.contains_key("total_ms") && span.0.contains_key("status"),
                "{span:?}"
            );
            assert!(
                span.0
                    .values()
                    .all(|v| !v.contains(secret) && !v.contains("k-slow")),
                "no keys in spans: {span:?}"
            );
        }
        let expected = [
            ("fresh", 2),
            ("replayed", 1),
            ("mismatch", 1),
            ("rolled_back", 1),
            ("rejected_key", 2),
            ("failed", 1),
            ("unavailable", 1),
            ("unkeyed", 1),
            ("conflict", 1),
        ];
        for (outcome, n) in expected {
            assert_eq!(
                outcomes.get(outcome).copied().unwrap_or(0),
                n,
                "{outcome}: {outcomes:?}"
            );
        }
        // The handler's own events run inside the span: a fresh request has its timings.
        let fresh_span = spans
            .iter()
            .find(|s| s.0.get("outcome").map(String::as_str) == Some("fresh"))
            .unwrap();
        assert!(fresh_span.0.contains_key("claim_ms") && fresh_span.0.contains_key("handler_ms"));

        let mut counted: HashMap<String, u64> = HashMap::new();
        let mut histograms = 0;
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let outcome = key
                .labels()
                .find(|l| l.key() == "outcome")
                .map(|l| l.value().to_owned());
            match (key.name(), value) {
                ("idem_requests_total", DebugValue::Counter(n)) => {
                    *counted.entry(outcome.unwrap()).or_default() += n
                }
                ("idem_request_duration_seconds", DebugValue::Histogram(values)) => {
                    histograms += values.len()
                }
                _ => {}
            }
        }
        for (outcome, n) in expected {
            assert_eq!(
                counted.get(outcome).copied().unwrap_or(0),
                n as u64,
                "metrics {outcome}: {counted:?}"
            );
        }
        assert_eq!(histograms, expected.iter().map(|(_, n)| n).sum::<usize>());
    })
    .await;
}

/// Logs written to a file or a pipe carry no colour codes: the example's binary, its
/// stdout a pipe, logs its start-up warning (an unset webhook secret) as plain text.
#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_charges-server"))
        .env_remove("WEBHOOK_SECRET")
        .env_remove("WEBHOOK_SECRET_PREVIOUS")
        .env_remove("NO_COLOR")
        .env("RUST_LOG", "info")
        .env("BIND_ADDR", "127.0.0.1:0")
        // Nothing listens there: the service logs, then stops at its first connection.
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .expect("the example's binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success());
    assert!(stdout.contains("WEBHOOK_SECRET"), "{stdout}");
    assert!(stdout.contains(" WARN "), "{stdout}");
    assert!(!stdout.contains('\u{1b}'), "escape codes in {stdout:?}");
}
