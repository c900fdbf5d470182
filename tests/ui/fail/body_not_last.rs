use axum::extract::Path;
use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

#[idempotent(scope = "charges")]
async fn create(Json(_req): Json<NewCharge>, _tx: Tx, Path(id): Path<String>) -> String {
    id
}

fn main() {}
