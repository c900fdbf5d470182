use idem::{idempotent, Tx};

#[idempotent(scope = "events", key = meta.event_id)]
async fn receive(_tx: Tx) -> String {
    String::new()
}

fn main() {}
