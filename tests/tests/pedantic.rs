//! Generated code fires no lint in the user's crate, clippy's pedantic group included:
//! `cargo clippy --all-targets -- -D warnings` (run by `.ci/run`) lints this file.
#![warn(clippy::pedantic)]

use std::collections::HashMap;

use axum::extract::{FromRef, FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::routing::post;
use axum::{Json, Router};
use idem::extract::Principal;
use idem::{idempotent, Problem, Store, Tx};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    pool: PgPool,
}

#[derive(Deserialize, Serialize)]
struct Customer {
    id: String,
}

#[derive(Deserialize, Serialize)]
struct NewOrder {
    amount: u32,
    customer: Customer,
    note: Option<String>,
}

/// Creates an order.
#[idempotent(scope = "orders", ttl = "7d", fields = [amount, customer.id])]
async fn create(
    State(pool): State<PgPool>,
    Path(shop): Path<String>,
    mut tx: Tx,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<String>), Problem> {
    let _ = pool.size();
    sqlx::query("SELECT $1::int8, $2, $3")
        .bind(i64::from(order.amount))
        .bind(&order.customer.id)
        .bind(&order.note)
        .execute(&mut *tx)
        .await
        .map_err(|e| {
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "urn:example:db",
                "Database",
            )
            .with_detail(e.to_string())
        })?;
    Ok((StatusCode::CREATED, Json(shop)))
}

/// Whole body, no `Tx`, plain return.
#[idempotent(scope = "notes")]
// Nothing to await: `clippy::unused_async` is this handler's own lint, which the
// expansion leaves to its author; allowed here, it reaches the body as written.
#[allow(clippy::unused_async)]
// No `Tx`, and it writes nothing: the warning about writes escaping the transaction is
// allowed, as its docs say.
#[allow(deprecated)]
async fn note(Json(body): Json<serde_json::Value>) -> String {
    body.to_string()
}

/// The tenant a request acts for.
struct Tenant(String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let tenant = parts
            .headers
            .get("tenant")
            .ok_or(StatusCode::UNAUTHORIZED)?;
        let tenant = tenant.to_str().map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Self(tenant.to_owned()))
    }
}

impl Principal for Tenant {
    fn principal_id(&self) -> String {
        self.0.clone()
    }
}

/// Seven extractors of its own, plus idem's guard, header and principal: the wrapper
/// needs no `clippy::too_many_arguments` allowance, which would reach this body too.
#[idempotent(scope = "imports", key = header("Import-Id"), principal = Tenant)]
// No `Tx`, and it writes nothing: the warning about writes escaping the transaction is
// allowed, as its docs say.
#[allow(deprecated)]
async fn import(
    State(pool): State<PgPool>,
    Path(shop): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    Json(order): Json<NewOrder>,
) -> String {
    let _ = (pool.size(), method, uri, headers.len(), query.len());
    std::future::ready(format!("{shop}: {}", order.amount)).await
}

#[test]
fn handlers_route() {
    fn app(pool: PgPool) -> Router {
        Router::new()
            .route("/shops/{shop}/orders", post(create))
            .route("/notes", post(note))
            .route("/shops/{shop}/imports", post(import))
            .with_state(AppState {
                idempotency: Store::new(pool.clone()),
                pool,
            })
    }
    let _ = app;
}
