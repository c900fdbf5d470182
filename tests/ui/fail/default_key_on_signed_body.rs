//! Regression (issue 19, 1): without `key = ..`, a signed body was keyed by the
//! `Idempotency-Key` header, which no scheme signs: one captured delivery, sent again
//! under fresh keys, ran its effect each time.
use idem::webhook::{Signed, Stripe};
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Event {
    id: String,
    amount: i64,
}

#[idempotent(scope = "events")]
async fn receive(_tx: Tx, Signed(event, _): Signed<Event, Stripe>) -> String {
    event.amount.to_string()
}

#[idempotent(scope = "events", required = false)]
async fn optional(_tx: Tx, Signed(event, _): Signed<Event, Stripe>) -> String {
    event.amount.to_string()
}

fn main() {}
