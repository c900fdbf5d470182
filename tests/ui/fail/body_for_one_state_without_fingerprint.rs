//! Pins issue 19's "a body extractor bound to one state drops out of the fingerprint":
//! an extractor written for the app's own state (`FromRequest<AppState>`), which is no
//! `FingerprintBody`, was classed as a parameter that reads no body, so the whole-body
//! fingerprint added nothing and a reused key with another payload replayed. It is a
//! compile error where the handler is routed, and under `#[axum::debug_handler]`.
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    max_amount: i64,
}

/// JSON checked against the app's configuration.
struct AppJson<T>(T);

impl<T: DeserializeOwned + Send> FromRequest<AppState> for AppJson<T> {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, StatusCode> {
        let Json(value) = Json::<T>::from_request(req, state)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        let _ = state.max_amount;
        Ok(Self(value))
    }
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
}

#[idempotent(scope = "charges")]
async fn create(_tx: Tx, AppJson(charge): AppJson<NewCharge>) -> String {
    charge.amount.to_string()
}

#[idempotent(scope = "checked")]
#[axum::debug_handler(state = AppState)]
async fn checked(_tx: Tx, AppJson(charge): AppJson<NewCharge>) -> String {
    charge.amount.to_string()
}

fn app(state: AppState) -> Router {
    Router::new()
        .route("/charges", post(create))
        .route("/checked", post(checked))
        .with_state(state)
}

fn main() {
    let _ = app;
}
