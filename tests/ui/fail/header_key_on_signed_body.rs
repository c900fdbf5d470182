//! A key from a header the signature does not cover, on a signed body: one captured
//! delivery, sent again under fresh ids, would run its effect each time. Stripe's
//! signature covers the timestamp and the body, not any id header.
use idem::webhook::{Signed, Stripe};
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Event {
    id: String,
    amount: i64,
}

#[idempotent(scope = "events", key = header("Webhook-Id"))]
async fn receive(_tx: Tx, Signed(event, _): Signed<Event, Stripe>) -> String {
    event.amount.to_string()
}

fn main() {}
