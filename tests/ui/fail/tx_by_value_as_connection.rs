//! `tx` by value given to a function that takes `&mut PgConnection`.
use axum::Json;
use idem::{idempotent, Tx};
use serde_json::Value;
use sqlx::PgConnection;

async fn insert(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO charges DEFAULT VALUES").execute(conn).await?;
    Ok(())
}

#[idempotent(scope = "charges")]
async fn create(tx: Tx, Json(v): Json<Value>) -> Result<Json<Value>, String> {
    insert(tx).await.map_err(|e| e.to_string())?;
    Ok(Json(v))
}

fn main() {}
