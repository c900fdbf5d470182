//! A handler without `Tx`: the key row still commits alone. Whole-body fingerprints of
//! `Json<T>`, `String` and `Bytes` bodies, and a handler without a body. Each is warned
//! about (its writes would escape the transaction) unless, writing nothing, it says
//! `#[allow(deprecated)]`.
#![deny(deprecated)]
use axum::body::Bytes;
use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store};
use serde_json::Value;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[idempotent(scope = "json")]
#[allow(deprecated)]
async fn json(Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

#[idempotent(scope = "text")]
#[allow(deprecated)]
async fn text(body: String) -> String {
    body
}

#[idempotent(scope = "bytes")]
#[allow(deprecated)]
async fn bytes(body: Bytes) -> Bytes {
    body
}

#[idempotent(scope = "nothing")]
#[allow(deprecated)]
async fn nothing() -> &'static str {
    "done"
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/json", post(json))
        .route("/text", post(text))
        .route("/bytes", post(bytes))
        .route("/nothing", post(nothing))
        .with_state(AppState { idempotency: Store::new(pool) })
}

fn main() {
    let _ = app;
}
