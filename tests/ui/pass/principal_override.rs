//! `principal = Type` with an extractor of the user's own.
use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem::extract::Principal;
use serde_json::Value;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

struct Tenant(u64);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let id = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok());
        id.and_then(|v| v.parse().ok()).map(Tenant).ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Principal for Tenant {
    fn principal_id(&self) -> String {
        self.0.to_string()
    }
}

#[idempotent(scope = "tenants", principal = Tenant)]
async fn create(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

fn app(pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/", post(create))
        .with_state(AppState { idempotency: Store::new(pool) })
}

fn main() {
    let _ = app;
}
