//! What a step tells operators: one `idem.step` span per step with its `outcome`, and
//! the `idem_steps_total` counter and `idem_step_duration_seconds` histogram by scope,
//! step and outcome (the `metrics` feature). A binary of its own: it installs the
//! process's one metrics recorder and tracing subscriber.

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, ClosedSpans, TestApp};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing_subscriber::prelude::*;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
}

#[derive(Deserialize, Serialize)]
struct Order {
    amount: i64,
    /// What the call does: "ok", "err" or "slow".
    #[serde(default)]
    call: String,
    /// Whether the handler fails after its step.
    #[serde(default)]
    fail: bool,
}

#[idempotent(scope = "orders", fields = [amount])]
async fn order(mut tx: Tx, Json(order): Json<Order>) -> Result<StatusCode, Response> {
    let call = order.call.clone();
    let charged: i64 = tx
        .step("processor", |_key| async move {
            match call.as_str() {
                "err" => Err(StatusCode::BAD_GATEWAY),
                "slow" => {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok(order.amount)
                }
                _ => Ok(order.amount),
            }
        })
        .await
        .map_err(IntoResponse::into_response)?;
    if order.fail {
        return Err(StatusCode::SERVICE_UNAVAILABLE.into_response());
    }
    assert_eq!(charged, order.amount);
    Ok(StatusCode::CREATED)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_outcome_is_in_its_span_and_the_metrics() {
    let spans = ClosedSpans::named("idem.step");
    tracing_subscriber::registry().with(spans.clone()).init();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder of this binary");

    with_test_db(async |db| {
        let pool = db.pool(6).await;
        let store = Store::builder(pool.clone())
            .step_timeout(Duration::from_millis(200))
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let app = Router::new()
            .route("/orders", post(order))
            .with_state(AppState { store });
        let s = TestApp::serve(pool, app).await;
        let send = |key: &'static str, body: serde_json::Value| {
            let s = &s;
            async move { s.post("/orders", Some(key), &body).await.status }
        };
        // recorded, then replayed by the retry.
        assert_eq!(send("a", json!({ "amount": 1, "fail": true })).await, 503);
        assert_eq!(send("a", json!({ "amount": 1 })).await, 201);
        // the call's own error, then a mismatch for another payload of key "a"'s kind.
        assert_eq!(send("b", json!({ "amount": 2, "call": "err" })).await, 502);
        assert_eq!(send("c", json!({ "amount": 3, "fail": true })).await, 503);
        assert_eq!(send("c", json!({ "amount": 4 })).await, 422);
        // timed out.
        assert_eq!(send("d", json!({ "amount": 5, "call": "slow" })).await, 504);

        let expected = [
            ("recorded", 2),
            ("replayed", 1),
            ("failed", 1),
            ("mismatch", 1),
            ("timed_out", 1),
        ];
        let mut seen: HashMap<String, u64> = HashMap::new();
        for span in spans.take() {
            assert_eq!(span.get("step"), Some("processor"));
            assert_eq!(span.get("scope"), Some("orders"));
            *seen
                .entry(span.get("outcome").unwrap_or("none").to_owned())
                .or_default() += 1;
        }
        let mut counted: HashMap<String, u64> = HashMap::new();
        let mut timed = 0;
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let label = |name: &str| {
                key.labels()
                    .find(|l| l.key() == name)
                    .map(|l| l.value().to_owned())
            };
            match (key.name(), value) {
                ("idem_steps_total", DebugValue::Counter(n)) => {
                    assert_eq!(label("step").as_deref(), Some("processor"));
                    assert_eq!(label("scope").as_deref(), Some("orders"));
                    *counted.entry(label("outcome").unwrap()).or_default() += n;
                }
                ("idem_step_duration_seconds", DebugValue::Histogram(values)) => {
                    timed += values.len();
                }
                _ => {}
            }
        }
        for (outcome, n) in expected {
            assert_eq!(
                seen.get(outcome).copied().unwrap_or(0),
                n,
                "span {outcome}: {seen:?}"
            );
            assert_eq!(
                counted.get(outcome).copied().unwrap_or(0),
                n,
                "metric {outcome}: {counted:?}"
            );
        }
        assert_eq!(timed, 6);
    })
    .await;
}
