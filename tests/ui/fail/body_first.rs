//! Regression (issue 31): the body extractor written first is one error on it, not also
//! one saying the last parameter (`HeaderMap`) is a body idem cannot fingerprint, and
//! axum's `Handler` error on the route.
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
}

#[idempotent(scope = "charges")]
async fn create(Json(req): Json<NewCharge>, _headers: HeaderMap, _tx: Tx) -> String {
    req.amount.to_string()
}

fn app(store: Store) -> Router {
    Router::new().route("/charges", post(create)).with_state(store)
}

fn main() {
    let _ = app;
}
