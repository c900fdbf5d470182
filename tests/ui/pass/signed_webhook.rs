//! A signed webhook keyed by the event's own (nested) id, waiting for duplicates in
//! flight; a header key; both registered in a real `Router`.
use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::webhook::{Custom, Signed, WebhookVerifier};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    webhooks: WebhookVerifier,
}

#[derive(Deserialize, Serialize)]
struct Meta {
    event_id: String,
    attempt: u32,
}

#[derive(Deserialize, Serialize)]
struct Event {
    meta: Meta,
    kind: String,
}

#[idempotent(scope = "events", ttl = "7d", key = meta.event_id, fields = [kind], concurrency = wait("30s"))]
async fn receive(_tx: Tx, Signed(event, ..): Signed<Event, Custom>) -> Json<u32> {
    Json(event.meta.attempt)
}

#[idempotent(scope = "deliveries", key = header("Delivery-Id"), concurrency = reject)]
async fn by_header(_tx: Tx, Json(v): Json<serde_json::Value>) -> Json<serde_json::Value> {
    Json(v)
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/events", post(receive))
        .route("/deliveries", post(by_header))
        .with_state(AppState {
            idempotency: Store::new(pool),
            webhooks: WebhookVerifier::new("whsec_0123456789abcdef").expect("16 bytes or more"),
        })
}

fn main() {
    let _ = app;
}
