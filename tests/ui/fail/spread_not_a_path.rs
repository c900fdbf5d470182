use axum::Json;
use idem::{idempotent, Tx};

#[idempotent(scope = "events", key = header("Delivery-Id"), spread = "key")]
async fn receive(_tx: Tx, Json(v): Json<serde_json::Value>) -> Json<serde_json::Value> {
    Json(v)
}

fn main() {}
