//! Path and query extractors before the body; the path is part of the fingerprint.
use axum::extract::{FromRef, Path, Query};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[derive(Deserialize)]
struct Options {
    notify: Option<bool>,
}

#[derive(Deserialize, Serialize)]
struct NewRefund {
    amount: i64,
}

#[idempotent(scope = "refunds", fields = [amount])]
async fn refund(
    Path(charge_id): Path<String>,
    Query(options): Query<Options>,
    _tx: Tx,
    Json(req): Json<NewRefund>,
) -> String {
    format!("{charge_id} {} {:?}", req.amount, options.notify)
}

#[idempotent(scope = "captures")]
async fn capture(Path((charge_id, step)): Path<(String, u32)>, _tx: Tx) -> String {
    format!("{charge_id} {step}")
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/charges/{id}/refunds", post(refund))
        .route("/charges/{id}/captures/{step}", post(capture))
        .with_state(AppState { idempotency: Store::new(pool) })
}

fn main() {
    let _ = app;
}
