use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

#[idempotent(scope = "charges", fields = [])]
async fn create(_tx: Tx, Json(_req): Json<NewCharge>) -> String {
    String::new()
}

fn main() {}
