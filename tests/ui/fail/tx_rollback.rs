use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

#[idempotent(scope = "charges")]
async fn create(tx: Tx, Json(_req): Json<NewCharge>) -> String {
    tx.rollback().await.ok();
    String::new()
}

fn main() {}
