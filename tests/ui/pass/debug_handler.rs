//! `#[axum::debug_handler]` below `#[idempotent]` checks the generated handler: with a
//! `State<T>` parameter it is given `state = T`, and it may name the state itself.
//! (A sub-state `State<T>` needs the explicit form: `T` is then not the router's state.)
use axum::extract::{FromRef, State};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde_json::Value;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    name: String,
}

#[idempotent(scope = "with-state")]
#[axum::debug_handler]
async fn with_state(State(state): State<AppState>, _tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(serde_json::json!({ "name": state.name, "v": v }))
}

#[idempotent(scope = "named-state")]
#[axum::debug_handler(state = AppState)]
async fn named_state(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

fn main() {
    let _: fn(AppState) -> Router = |state| {
        Router::new()
            .route("/a", post(with_state))
            .route("/b", post(named_state))
            .with_state(state)
    };
}
