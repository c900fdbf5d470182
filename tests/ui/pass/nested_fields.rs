//! Nested field paths are fingerprinted, and only those fields need `Serialize`.
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Customer {
    id: String,
    email: String,
}

struct NotSerialize;

#[derive(Deserialize)]
struct Order {
    customer: Customer,
    amount: u64,
    #[serde(skip)]
    #[allow(dead_code)]
    scratch: Option<NotSerialize>,
}

#[idempotent(scope = "orders", ttl = "7d", fields = [customer.id, amount])]
async fn create_order(tx: Tx, Json(order): Json<Order>) -> String {
    let _ = tx.idempotency_key();
    format!("{} {} {}", order.customer.id, order.customer.email, order.amount)
}

fn main() {
    let _: Router<Store> = Router::new().route("/orders", post(create_order));
}
