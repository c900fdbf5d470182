//! `&mut tx` given to a function written for `&mut Transaction<'_, Postgres>`: a `Tx`
//! is no `Transaction` (idem owns the commit), and the fix is a `&mut PgConnection`
//! parameter.
use axum::Json;
use idem::{idempotent, Tx};
use serde_json::Value;
use sqlx::{Postgres, Transaction};

async fn insert(tx: &mut Transaction<'_, Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO charges DEFAULT VALUES").execute(&mut **tx).await?;
    Ok(())
}

#[idempotent(scope = "charges")]
async fn create(mut tx: Tx, Json(v): Json<Value>) -> Result<Json<Value>, String> {
    insert(&mut tx).await.map_err(|e| e.to_string())?;
    Ok(Json(v))
}

fn main() {}
