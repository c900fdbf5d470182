//! A mistake in the attribute of a handler that is routed is one error, on the
//! mistaken token: not also a "`Handler` is not implemented" error at the route (the
//! function as written takes a `Tx`, which is no extractor), whose advice to try
//! `#[axum::debug_handler]` leads away from the real one. A misspelt option is named.
use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
}

#[idempotent(scope = "charges", tll = "24h")]
async fn create(_tx: Tx, Json(charge): Json<NewCharge>) -> String {
    charge.amount.to_string()
}

/// Documented as usual.
#[idempotent(scope = "refunds", ttl = "forever")]
pub async fn refund(_tx: Tx, Json(charge): Json<NewCharge>) -> String {
    charge.amount.to_string()
}

fn app(state: AppState) -> Router {
    Router::new()
        .route("/charges", post(create))
        .route("/refunds", post(refund))
        .with_state(state)
}

fn main() {
    let _ = app;
}
