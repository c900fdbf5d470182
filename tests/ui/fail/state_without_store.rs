//! A router whose state holds no `idem::Store`: the error lands on the idempotent
//! handler's route, `post(create)`, with idem's message naming the state, `FromRef` and
//! `idem::Store`; no longer axum's unsatisfied `Handler` bound there, nor "expected
//! `Store`, found `AppState`" on `with_state`, nor an error on an unrelated handler.
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Tx};
use serde_json::Value;

#[derive(Clone)]
struct AppState {
    pool: sqlx::PgPool,
}

#[idempotent(scope = "charges")]
async fn create(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

async fn health() -> &'static str {
    "ok"
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/health", post(health))
        .route("/charges", post(create))
        .with_state(AppState { pool })
}

fn main() {
    let _ = app;
}
