//! `tx` by value where sqlx wants an executor: the error lists `&mut Tx` (`&mut tx`) among
//! the executors.
use axum::Json;
use idem::{idempotent, Tx};
use serde_json::Value;

#[idempotent(scope = "charges")]
async fn create(tx: Tx, Json(v): Json<Value>) -> Result<Json<Value>, String> {
    sqlx::query("INSERT INTO charges DEFAULT VALUES")
        .execute(tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Json(v))
}

fn main() {}
