use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Reading {
    value: f64,
}

#[idempotent(scope = "readings", key = value)]
async fn receive(_tx: Tx, Json(reading): Json<Reading>) -> String {
    reading.value.to_string()
}

fn main() {}
