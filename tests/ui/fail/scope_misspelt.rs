//! Regression (issue 31): a misspelt `scope` is one error, the unknown option with its
//! near miss, not also "missing `scope`".
use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
}

#[idempotent(scpoe = "charges", ttl = "24h")]
async fn create(_tx: Tx, Json(_req): Json<NewCharge>) -> String {
    String::new()
}

fn main() {}
