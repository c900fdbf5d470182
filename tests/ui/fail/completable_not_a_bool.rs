use axum::http::StatusCode;
use idem::{idempotent, Tx};

#[idempotent(scope = "charges", completable = "yes")]
async fn create(_tx: Tx) -> StatusCode {
    StatusCode::CREATED
}

fn main() {}
