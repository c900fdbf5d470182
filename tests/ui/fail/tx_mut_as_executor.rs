//! `&mut tx` where sqlx wants an executor: `Tx` is not one itself (as sqlx 0.9's own
//! `Transaction` is not); the error lists `&mut PgConnection` (`&mut *tx`) among the executors.
use axum::Json;
use idem::{idempotent, Tx};
use serde_json::Value;

#[idempotent(scope = "charges")]
async fn create(mut tx: Tx, Json(v): Json<Value>) -> Result<Json<Value>, String> {
    sqlx::query("INSERT INTO charges DEFAULT VALUES")
        .execute(&mut tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Json(v))
}

fn main() {}
