//! A handler that takes `Tx` but lacks `#[idempotent]`: rustc's E0726 (with its `Tx<'_>`
//! suggestion) and axum's unsatisfied `Handler` bound. Pinned as it is: no message of
//! idem's can reach this error (the function is the user's own, and axum's `Handler`
//! impls are `do_not_recommend`); `Tx`'s docs say where it comes from.
use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::{Store, Tx};
use serde_json::Value;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
}

async fn create(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

fn app(state: AppState) -> Router {
    Router::new().route("/charges", post(create)).with_state(state)
}

fn main() {
    let _ = app;
}
