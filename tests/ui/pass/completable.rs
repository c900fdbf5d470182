//! `completable = true` (issue 38) on the handler shapes it expands for: fields of a
//! JSON body, the whole body, a key from a header, a key from the body, no body at all,
//! and a state of the router's own.
use axum::extract::{FromRef, Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    name: String,
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    id: String,
    amount: i64,
}

#[idempotent(scope = "charges", fields = [amount], completable = true)]
async fn fields(_tx: Tx, Json(charge): Json<NewCharge>) -> Json<i64> {
    Json(charge.amount)
}

#[idempotent(scope = "whole", completable = true)]
async fn whole(State(name): State<String>, _tx: Tx, body: String) -> String {
    format!("{name} {body}")
}

#[idempotent(scope = "headers", key = header("X-Request-Id"), completable = true)]
async fn header_key(_tx: Tx, Json(charge): Json<NewCharge>) -> Json<String> {
    Json(charge.id)
}

#[idempotent(scope = "ids", key = id, completable = true)]
async fn body_key(_tx: Tx, Json(charge): Json<NewCharge>) -> Json<String> {
    Json(charge.id)
}

#[idempotent(scope = "paths", completable = false)]
async fn no_body(_tx: Tx, Path(id): Path<String>) -> (StatusCode, String) {
    (StatusCode::CREATED, id)
}

fn main() {
    let _: Router<AppState> = Router::new()
        .route("/fields", post(fields))
        .route("/whole", post(whole))
        .route("/headers", post(header_key))
        .route("/ids", post(body_key))
        .route("/paths/{id}", post(no_body));
}
