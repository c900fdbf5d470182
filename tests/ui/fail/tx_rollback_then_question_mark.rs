//! `tx.rollback()` whose result goes on through `?`: the refusal is the only error (the
//! function emitted beside it calls a stand-in with `rollback`'s output).
use axum::Json;
use idem::{idempotent, Tx};
use serde_json::Value;

#[idempotent(scope = "charges")]
async fn create(tx: Tx, Json(v): Json<Value>) -> Result<Json<Value>, String> {
    if v.is_null() {
        tx.rollback().await.map_err(|e| e.to_string())?;
    }
    Ok(Json(v))
}

fn main() {}
