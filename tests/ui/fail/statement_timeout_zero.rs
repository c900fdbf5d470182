use axum::http::StatusCode;
use idem::{idempotent, Tx};

#[idempotent(scope = "charges", statement_timeout = "0s")]
async fn create(_tx: Tx) -> StatusCode {
    StatusCode::CREATED
}

fn main() {}
