use axum::Json;
use idem::{idempotent, Tx};
use serde::Deserialize;

#[derive(Deserialize)]
struct Payment {
    amount: i64,
}

#[idempotent(scope = "payments")]
async fn pay(_tx: Tx, Json(req): Json<Payment>) -> String {
    req.amount.to_string()
}

fn main() {}
