//! Every body extractor axum users commonly write is fingerprinted whole: `Form`, a
//! `Query` as the payload, `Option<Json>`, `Result<Json, JsonRejection>`, and the
//! user's own extractor through `FingerprintBody`; a last parameter that reads the
//! request's head only (`Path`, `State`, `HeaderMap`, an extractor for the app's own
//! state) means the handler has no body.
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRef, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Form, Json, Router};
use idem::{idempotent, Store, Tx};
use idem::extract::FingerprintBody;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    pool: PgPool,
}

#[derive(Deserialize, Serialize)]
struct Charge {
    amount: i64,
}

#[idempotent(scope = "form")]
async fn form(_tx: Tx, Form(charge): Form<Charge>) -> String {
    charge.amount.to_string()
}

#[idempotent(scope = "query")]
async fn query(Path(id): Path<i64>, _tx: Tx, Query(charge): Query<Charge>) -> String {
    format!("{id} {}", charge.amount)
}

#[idempotent(scope = "option")]
async fn option(_tx: Tx, charge: Option<Json<Charge>>) -> String {
    charge.map_or_else(|| "none".into(), |Json(c)| c.amount.to_string())
}

#[idempotent(scope = "result")]
async fn result(_tx: Tx, charge: Result<Json<Charge>, JsonRejection>) -> String {
    match charge {
        Ok(Json(c)) => c.amount.to_string(),
        Err(rejection) => rejection.body_text(),
    }
}

/// The user's own body extractor, for any state.
struct Text(String);

impl<S: Send + Sync> FromRequest<S> for Text {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &S) -> Result<Self, StatusCode> {
        let text = String::from_request(req, state).await.map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Self(text))
    }
}

impl FingerprintBody for Text {
    type Value = str;

    fn fingerprint_value(&self) -> &str {
        &self.0
    }
}

#[idempotent(scope = "own")]
async fn own(_tx: Tx, Text(text): Text) -> String {
    text
}

#[idempotent(scope = "path")]
async fn path(_tx: Tx, Path(id): Path<i64>) -> String {
    id.to_string()
}

#[idempotent(scope = "state")]
async fn state(_tx: Tx, State(pool): State<PgPool>) -> String {
    pool.size().to_string()
}

#[idempotent(scope = "headers")]
async fn headers(_tx: Tx, headers: HeaderMap) -> String {
    headers.len().to_string()
}

/// An extractor written for the app's own state: it reads the head only.
struct Account(String);

impl FromRequestParts<AppState> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, StatusCode> {
        let account = parts.headers.get("x-account").and_then(|v| v.to_str().ok());
        account.map(|a| Self(a.to_owned())).ok_or(StatusCode::UNAUTHORIZED)
    }
}

#[idempotent(scope = "account")]
async fn account(_tx: Tx, Account(account): Account) -> String {
    account
}

fn app(pool: PgPool) -> Router {
    Router::new()
        .route("/form", post(form))
        .route("/query/{id}", post(query))
        .route("/option", post(option))
        .route("/result", post(result))
        .route("/own", post(own))
        .route("/path/{id}", post(path))
        .route("/state", post(state))
        .route("/headers", post(headers))
        .route("/account", post(account))
        .with_state(AppState { idempotency: Store::new(pool.clone()), pool })
}

fn main() {
    let _ = app;
}
