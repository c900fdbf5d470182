use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Event {
    id: String,
}

struct Other;

fn account_of(_: &Other) -> Option<String> {
    None
}

#[idempotent(scope = "events", key = id, spread = account_of)]
async fn receive(_tx: Tx, Json(event): Json<Event>) -> Json<String> {
    Json(event.id)
}

fn main() {}
