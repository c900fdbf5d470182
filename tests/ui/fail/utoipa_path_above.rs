//! `#[utoipa::path]` written above `#[idempotent]`: it expands first and documents the
//! handler without idem's key header and problem responses. A compile error, on
//! `#[idempotent]`, rather than a document silently missing them.
use axum::Json;
use idem::{idempotent, Tx};
use serde_json::Value;

#[utoipa::path(post, path = "/charges", responses((status = 201, description = "Created")))]
#[idempotent(scope = "charges")]
async fn create_charge(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

fn main() {}
