//! `Result`, a `Result` alias, a plain response and `impl IntoResponse` all work.
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Problem, Store, Tx};
use serde_json::Value;

type ApiResult<T> = Result<T, Problem>;

#[idempotent(scope = "a")]
async fn result(_tx: Tx, Json(v): Json<Value>) -> Result<(StatusCode, Json<Value>), Problem> {
    Ok((StatusCode::CREATED, Json(v)))
}

#[idempotent(scope = "b")]
async fn alias(_tx: Tx, Json(v): Json<Value>) -> ApiResult<Json<Value>> {
    if v.is_null() {
        return Err(Problem::new(StatusCode::BAD_REQUEST, "urn:example:null", "Null body"));
    }
    Ok(Json(v))
}

#[idempotent(scope = "c")]
async fn plain(_tx: Tx, Json(v): Json<Value>) -> StatusCode {
    if v.is_null() { StatusCode::NO_CONTENT } else { StatusCode::OK }
}

#[idempotent(scope = "d")]
async fn opaque(_tx: Tx, Json(v): Json<Value>) -> impl IntoResponse {
    Json(v)
}

#[idempotent(scope = "e")]
async fn unit(_tx: Tx) {}

fn main() {
    let _: Router<Store> = Router::new()
        .route("/a", post(result))
        .route("/b", post(alias))
        .route("/c", post(plain))
        .route("/d", post(opaque))
        .route("/e", post(unit));
}
