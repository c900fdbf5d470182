//! An associated function (no `self`) in an `impl` block, routed by path.
use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde_json::Value;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

struct Charges;

impl Charges {
    #[idempotent(scope = "charges")]
    async fn create(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
        Json(v)
    }
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/", post(Charges::create))
        .with_state(AppState { idempotency: Store::new(pool) })
}

fn main() {
    let _ = app;
}
