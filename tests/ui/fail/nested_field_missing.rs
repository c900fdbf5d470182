use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Customer {
    id: String,
}

#[derive(Deserialize, Serialize)]
struct Order {
    customer: Customer,
}

#[idempotent(scope = "orders", fields = [customer.idd])]
async fn create(_tx: Tx, Json(_req): Json<Order>) -> String {
    String::new()
}

fn main() {}
