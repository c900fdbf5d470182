use axum::extract::Path;
use idem::{idempotent, Tx};

#[idempotent(scope = "charges", principal = Path<String>)]
async fn create(_tx: Tx) -> String {
    String::new()
}

fn main() {}
