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

#[idempotent(scope = "optional-payments")]
async fn pay_maybe(_tx: Tx, req: Option<Json<Payment>>) -> String {
    req.map_or(0, |Json(req)| req.amount).to_string()
}

fn main() {}
