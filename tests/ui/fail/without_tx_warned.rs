//! A handler without `Tx` is warned about: its writes through a pool of its own would
//! commit apart from the key, and a retry would repeat them.
#![deny(deprecated)]

use axum::extract::State;
use axum::Json;
use idem::idempotent;
use serde_json::Value;
use sqlx::PgPool;

#[idempotent(scope = "notes")]
async fn create(State(pool): State<PgPool>, Json(note): Json<Value>) -> String {
    let _ = sqlx::query("INSERT INTO notes (body) VALUES ($1)").bind(note.to_string()).execute(&pool).await;
    "done".to_owned()
}

fn main() {}
