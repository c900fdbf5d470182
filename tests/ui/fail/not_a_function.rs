use idem::idempotent;

#[idempotent(scope = "charges")]
struct Charges;

fn main() {}
