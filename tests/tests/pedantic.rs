//! Generated code fires no lint in the user's crate, clippy's pedantic group included:
//! `cargo clippy --all-targets -- -D warnings` (run by `.ci/run`) lints this file.
#![warn(clippy::pedantic)]

use axum::extract::{FromRef, Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::{idempotent, Idempotency, Problem, Tx};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Idempotency,
    pool: PgPool,
}

#[derive(Deserialize, Serialize)]
struct Customer {
    id: String,
}

#[derive(Deserialize, Serialize)]
struct NewOrder {
    amount: u32,
    customer: Customer,
    note: Option<String>,
}

/// Creates an order.
#[idempotent(scope = "orders", ttl = "7d", fields = [amount, customer.id])]
async fn create(
    State(pool): State<PgPool>,
    Path(shop): Path<String>,
    mut tx: Tx,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<String>), Problem> {
    let _ = pool.size();
    sqlx::query("SELECT $1::int8, $2, $3")
        .bind(i64::from(order.amount))
        .bind(&order.customer.id)
        .bind(&order.note)
        .execute(&mut *tx)
        .await
        .map_err(|e| {
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "urn:example:db",
                "Database",
            )
            .with_detail(e.to_string())
        })?;
    Ok((StatusCode::CREATED, Json(shop)))
}

/// Whole body, no `Tx`, plain return.
#[idempotent(scope = "notes")]
// Nothing to await: `clippy::unused_async` is this handler's own lint, which the
// expansion leaves to its author; allowed here, it reaches the body as written.
#[allow(clippy::unused_async)]
async fn note(Json(body): Json<serde_json::Value>) -> String {
    body.to_string()
}

#[test]
fn handlers_route() {
    fn app(pool: PgPool) -> Router {
        Router::new()
            .route("/shops/{shop}/orders", post(create))
            .route("/notes", post(note))
            .with_state(AppState {
                idempotency: Idempotency::new(pool.clone()),
                pool,
            })
    }
    let _ = app;
}
