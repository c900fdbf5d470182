use axum::Json;
use idem::idempotent;
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Event {
    event_id: String,
}

#[idempotent(scope = "events", key = evnt_id)]
async fn receive(Json(event): Json<Event>) -> String {
    event.event_id
}

fn main() {}
