//! `&mut tx` and `&mut *tx` as an sqlx executor (issue 40: `.fetch_one(&mut tx)` was two
//! errors from sqlx's trait bounds), and a `Tx` handed to functions written for plain
//! sqlx: ones taking `&mut PgConnection` (`&mut tx` coerces) and ones taking
//! `impl PgExecutor`.
use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgExecutor};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
}

async fn insert(db: impl PgExecutor<'_>, amount: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
        .bind(amount)
        .fetch_one(db)
        .await
}

async fn total(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT sum(amount)::bigint FROM charges").fetch_one(conn).await
}

#[idempotent(scope = "charges", fields = [amount])]
async fn create(mut tx: Tx, Json(req): Json<NewCharge>) -> Result<String, String> {
    sqlx::query("SELECT 1").execute(&mut *tx).await.map_err(|e| e.to_string())?;
    sqlx::query("SELECT 1").execute(&mut tx).await.map_err(|e| e.to_string())?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut tx).await.map_err(|e| e.to_string())?;
    let id = insert(&mut tx, req.amount + i64::from(one)).await.map_err(|e| e.to_string())?;
    let again = insert(&mut *tx, req.amount).await.map_err(|e| e.to_string())?;
    let sum = total(&mut tx).await.map_err(|e| e.to_string())?;
    Ok(format!("{id} {again} {sum}"))
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/charges", post(create))
        .with_state(AppState { idempotency: Store::new(pool) })
}

fn main() {
    let _ = app;
}
