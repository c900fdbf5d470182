//! `State` and `Extension` next to `Tx`, in any order, registered in a real `Router`.
use axum::extract::{FromRef, State};
use axum::routing::post;
use axum::{Extension, Json, Router};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    pool: PgPool,
}

#[derive(Clone)]
struct Account(String);

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
}

#[idempotent(scope = "charges", fields = [amount])]
async fn create(
    State(pool): State<PgPool>,
    mut tx: Tx,
    Extension(account): Extension<Account>,
    Json(req): Json<NewCharge>,
) -> Result<String, String> {
    let _ = pool.size();
    sqlx::query("INSERT INTO charges (account, amount) VALUES ($1, $2)")
        .bind(&account.0)
        .bind(req.amount)
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok(account.0)
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/charges", post(create))
        .with_state(AppState { idempotency: Store::new(pool.clone()), pool })
}

fn main() {
    let _ = app;
}
