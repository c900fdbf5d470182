//! A state without an `idem::Store`, checked by `#[axum::debug_handler]`: the errors
//! land on `#[idempotent]` and on the body, naming the state; axum reports its own
//! extractor bounds there, not idem's `HoldsStore` message.
use axum::Json;
use idem::{idempotent, Tx};
use serde_json::Value;

#[derive(Clone)]
struct AppState {
    pool: sqlx::PgPool,
}

#[idempotent(scope = "charges")]
#[axum::debug_handler(state = AppState)]
async fn create(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

fn main() {}
