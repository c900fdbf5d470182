use axum::Json;
use idem::{idempotent, Tx};
use serde::Deserialize;

#[derive(Deserialize)]
struct Card {
    number: String,
}

#[derive(Deserialize)]
struct Payment {
    card: Card,
}

#[idempotent(scope = "payments", fields = [card])]
async fn pay(_tx: Tx, Json(req): Json<Payment>) -> String {
    req.card.number
}

fn main() {}
