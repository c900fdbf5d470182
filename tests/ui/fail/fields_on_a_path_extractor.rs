use axum::extract::Path;
use idem::{idempotent, Tx};

#[idempotent(scope = "charges", fields = [amount])]
async fn create(_tx: Tx, Path(id): Path<String>) -> String {
    id
}

fn main() {}
