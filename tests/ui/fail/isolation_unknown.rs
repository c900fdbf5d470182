use axum::http::StatusCode;
use idem::{idempotent, Tx};

#[idempotent(scope = "charges", isolation = snapshot)]
async fn create(_tx: Tx) -> StatusCode {
    StatusCode::CREATED
}

fn main() {}
