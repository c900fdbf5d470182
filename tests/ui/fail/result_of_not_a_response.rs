use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

struct Receipt;

#[idempotent(scope = "charges")]
async fn create(_tx: Tx, Json(_req): Json<NewCharge>) -> Result<Receipt, String> {
    Ok(Receipt)
}

fn main() {}
