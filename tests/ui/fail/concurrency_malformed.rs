use axum::Json;
use idem::idempotent;
use serde_json::Value;

#[idempotent(scope = "a", concurrency = wait("forever"))]
async fn a(Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

#[idempotent(scope = "b", concurrency = queue)]
async fn b(Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

fn main() {}
