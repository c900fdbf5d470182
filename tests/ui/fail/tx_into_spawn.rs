use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

#[idempotent(scope = "charges")]
async fn create(mut tx: Tx, Json(_req): Json<NewCharge>) -> String {
    tokio::spawn(async move {
        sqlx::query("SELECT 1").execute(&mut *tx).await.ok();
    });
    String::new()
}

fn main() {}
