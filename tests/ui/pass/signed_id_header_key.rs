//! Standard Webhooks signs `webhook-id` with the body: a key taken from that header
//! cannot be swapped for another without breaking the signature, so it is allowed.
use axum::extract::FromRef;
use axum::routing::post;
use axum::Router;
use idem::webhook::{Signed, StandardWebhooks, Verifier};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
}

#[idempotent(scope = "events", key = header("webhook-id"))]
async fn receive(_tx: Tx, Signed(event, _): Signed<Event>) -> String {
    event.kind
}

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    webhooks: Verifier<StandardWebhooks>,
}

fn main() {
    let _: fn(AppState) -> Router = |state| Router::new().route("/", post(receive)).with_state(state);
}
