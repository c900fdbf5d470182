//! `spread = key` and `spread = function` (issue 23): keys without a principal kept
//! under a hash of the key, or under the tenant the body concerns, on a signed body and
//! a plain one; the handler reads the value back with `tx.principal()`.
use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::webhook::{Custom, Signed, WebhookVerifier};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    webhooks: WebhookVerifier,
}

#[derive(Deserialize, Serialize)]
struct Event {
    id: String,
    account: Option<String>,
}

fn account_of(event: &Event) -> Option<&str> {
    event.account.as_deref()
}

fn owned_account(event: &Event) -> Option<String> {
    event.account.clone()
}

#[idempotent(scope = "events", ttl = "7d", key = id, spread = account_of)]
async fn receive(tx: Tx, Signed(event, ..): Signed<Event, Custom>) -> Json<String> {
    Json(format!("{} {}", event.id, tx.principal().unwrap_or_default()))
}

#[idempotent(scope = "copies", key = id, spread = owned_account)]
async fn copy(_tx: Tx, Json(event): Json<Event>) -> Json<String> {
    Json(event.id)
}

#[idempotent(scope = "deliveries", key = header("Delivery-Id"), spread = key)]
async fn by_header(_tx: Tx) -> &'static str {
    "ok"
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/events", post(receive))
        .route("/copies", post(copy))
        .route("/deliveries", post(by_header))
        .with_state(AppState {
            idempotency: Store::new(pool),
            webhooks: WebhookVerifier::new("whsec_0123456789abcdef").expect("16 bytes or more"),
        })
}

fn main() {
    let _ = app;
}
