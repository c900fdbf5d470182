use axum::Json;
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Event {
    event_id: String,
}

#[idempotent(scope = "events", key = evnt_id)]
async fn receive(_tx: Tx, Json(event): Json<Event>) -> String {
    event.event_id
}

fn main() {}
