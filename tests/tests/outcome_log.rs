//! Hardening item 5: how a request ended is logged at INFO (it was DEBUG), without its
//! key. One test in its own binary: it installs the process-wide subscriber, so the
//! callsite interest cache cannot be raced by other tests' threads.

use std::sync::{Arc, Mutex};

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, SpanFields, TestApp};
use serde_json::{json, Value};
use tracing::Subscriber;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[idempotent(scope = "query")]
async fn query(_tx: Tx, Json(v): Json<Value>) -> (StatusCode, Json<Value>) {
    (StatusCode::CREATED, Json(v))
}

/// Collects every event's fields.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<SpanFields>>>);

impl<S: Subscriber> Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = SpanFields::default();
        event.record(&mut fields);
        self.0.lock().unwrap().push(fields);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outcome_is_logged_at_info() {
    let events = Events::default();
    tracing_subscriber::registry()
        .with(events.clone().with_filter(LevelFilter::INFO))
        .init();
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/q", post(query))
            .with_state(AppState { idempotency: store });
        let s = TestApp::serve(pool, app).await;
        let secret = "secret-key-91c2";
        let fresh = s.post("/q", Some(secret), &json!({ "n": 1 })).await;
        assert_eq!(fresh.status, 201);
        let reused = s.post("/q", Some(secret), &json!({ "n": 2 })).await;
        assert_eq!(reused.status, 422);
    })
    .await;
    let events = events.0.lock().unwrap().clone();
    let outcomes: Vec<_> = events
        .iter()
        .filter(|e| e.get("message") == Some("idem request done"))
        .map(|e| (e.get("outcome"), e.get("status")))
        .collect();
    assert_eq!(
        outcomes,
        [
            (Some("fresh"), Some("201")),
            (Some("mismatch"), Some("422"))
        ]
    );
    for event in &events {
        assert!(
            event.0.values().all(|v| !v.contains("secret-key-91c2")),
            "no keys in events: {event:?}"
        );
    }
}
