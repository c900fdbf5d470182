//! A body extractor of the user's own, fingerprinted through `FingerprintBody`.
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, FingerprintBody, Store, Tx};
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
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

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/", post(create))
        .route("/whole", post(whole))
        .with_state(AppState { idempotency: Store::new(pool) })
}

fn main() {
    let _ = app;
}
