use idem::{idempotent, Tx};

#[idempotent(scope = "deliveries", key = digest(body))]
async fn receive(_tx: Tx) -> String {
    String::new()
}

#[idempotent(scope = "deliveries", key = digest(payload))]
async fn receive_other(_tx: Tx, axum::Json(_v): axum::Json<serde_json::Value>) -> String {
    String::new()
}

fn main() {}
