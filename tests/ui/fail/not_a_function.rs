use idem_runtime::idempotent;

#[idempotent(scope = "charges")]
struct Charges;

fn main() {}
