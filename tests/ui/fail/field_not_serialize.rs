use axum::Json;
use idem::idempotent;
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
async fn pay(Json(req): Json<Payment>) -> String {
    req.card.number
}

fn main() {}
