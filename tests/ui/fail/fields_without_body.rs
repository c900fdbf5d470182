use idem::{idempotent, Tx};

#[idempotent(scope = "charges", fields = [amount])]
async fn create(_tx: Tx) -> String {
    String::new()
}

fn main() {}
