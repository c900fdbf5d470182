//! Regression (issue 31): a ttl written as a number of seconds, as other libraries take
//! it, is answered with the string that means it.
use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
}

#[idempotent(scope = "charges", ttl = 86400)]
async fn create(_tx: Tx, Json(_req): Json<NewCharge>) -> String {
    String::new()
}

fn main() {}
