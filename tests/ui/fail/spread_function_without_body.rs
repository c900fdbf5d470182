use idem::{idempotent, Tx};

fn account_of(_: &serde_json::Value) -> Option<String> {
    None
}

#[idempotent(scope = "events", key = header("Delivery-Id"), spread = account_of)]
async fn receive(_tx: Tx) -> &'static str {
    "ok"
}

fn main() {}
