//! `#[idempotent]` above `#[utoipa::path]`, the order that documents idem's parts, next
//! to a handler without `#[utoipa::path]`: the check of the order fires on neither.
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Problem, Store, Tx};
use serde_json::Value;
use utoipa::OpenApi;

#[idempotent(scope = "charges")]
#[utoipa::path(post, path = "/charges", responses((status = 201, description = "Created")))]
async fn create_charge(_tx: Tx, Json(_v): Json<Value>) -> Result<StatusCode, Problem> {
    Ok(StatusCode::CREATED)
}

#[idempotent(scope = "refunds")]
async fn create_refund(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

#[derive(OpenApi)]
#[openapi(paths(create_charge))]
struct ApiDoc;

fn main() {
    let doc = ApiDoc::openapi();
    assert!(doc.paths.paths.contains_key("/charges"));
    let _: Router<Store> = Router::new().route("/refunds", post(create_refund));
}
