//! A body extractor of the user's own, fingerprinted through `FingerprintBody`: one
//! written for any state, and one written for the app's own state only
//! (`FromRequest<AppState>`), which needs the state to be recognised as the body.
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem::extract::FingerprintBody;
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    max_amount: i64,
}

struct Validated<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Validated<T> {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &S) -> Result<Self, StatusCode> {
        let Json(value) = Json::<T>::from_request(req, state).await.map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Self(value))
    }
}

impl<T> FingerprintBody for Validated<T> {
    type Value = T;

    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

/// JSON checked against the app's configuration: a body for `AppState` only.
struct AppJson<T>(T);

impl<T: serde::de::DeserializeOwned + Send> FromRequest<AppState> for AppJson<T> {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, StatusCode> {
        let Json(value) = Json::<T>::from_request(req, state).await.map_err(|_| StatusCode::BAD_REQUEST)?;
        let _ = state.max_amount;
        Ok(Self(value))
    }
}

impl<T> FingerprintBody for AppJson<T> {
    type Value = T;

    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    memo: String,
}

#[idempotent(scope = "charges", fields = [amount])]
async fn create(_tx: Tx, Validated(req): Validated<NewCharge>) -> String {
    format!("{} {}", req.amount, req.memo)
}

#[idempotent(scope = "whole")]
async fn whole(_tx: Tx, Validated(req): Validated<NewCharge>) -> String {
    req.memo
}

#[idempotent(scope = "app-json")]
async fn app_json(_tx: Tx, AppJson(req): AppJson<NewCharge>) -> String {
    req.memo
}

#[idempotent(scope = "app-json-fields", fields = [amount])]
async fn app_json_fields(_tx: Tx, AppJson(req): AppJson<NewCharge>) -> String {
    req.memo
}

#[idempotent(scope = "app-json-checked")]
#[axum::debug_handler(state = AppState)]
async fn app_json_checked(_tx: Tx, AppJson(req): AppJson<NewCharge>) -> String {
    req.memo
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/", post(create))
        .route("/whole", post(whole))
        .route("/app-json", post(app_json))
        .route("/app-json-fields", post(app_json_fields))
        .route("/app-json-checked", post(app_json_checked))
        .with_state(AppState { idempotency: Store::new(pool), max_amount: 100 })
}

fn main() {
    let _ = app;
}
