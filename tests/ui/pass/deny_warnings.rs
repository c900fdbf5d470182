//! Generated code fires no lint in the user's crate, even under `deny(warnings)`, and
//! keeps the user's docs, lint attributes and `cfg`.
#![deny(warnings, missing_docs, unused, rust_2018_idioms, unreachable_pub)]

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

/// Creates a charge.
#[idempotent(scope = "charges", ttl = "30m", fields = [amount])]
#[allow(clippy::unused_async)]
#[cfg(all())]
async fn create(mut tx: Tx, Json(req): Json<NewCharge>) -> Result<Json<i64>, String> {
    let id: i64 = sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
        .bind(req.amount)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Json(id))
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/charges", post(create))
        .with_state(AppState { idempotency: Store::new(pool) })
}

fn main() {
    let _ = app;
}
