//! The outage tests' helpers around idem's own gate (`idem::testing::Gate`, the TCP proxy
//! the test kit shuts for an outage): how long an outage lasts, and a store through a
//! gate. The tests name the gate themselves: this library is also the benchmark's, which
//! builds idem without the test kit.

use std::time::Duration;

use idem::Store;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// How long the outage tests keep the database away: `OUTBOX_OUTAGE_SECS`, else 15 s
/// (RELIABILITY.md has the figures of a 90 s one).
pub fn outage() -> Duration {
    let secs = std::env::var("OUTBOX_OUTAGE_SECS")
        .ok()
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("OUTBOX_OUTAGE_SECS is not a number of seconds: {s:?}"))
        })
        .unwrap_or(15);
    Duration::from_secs(secs)
}

/// A store on `options`, a gate's (`gate.options(db.options.clone())`), with a pool of 4
/// made lazily, which gives up on a connection after 250 ms: a shut gate fails a delivery
/// in a quarter of a second, as a refusing database does.
pub fn gated_store(options: PgConnectOptions) -> Store {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(options);
    Store::builder(pool)
        .acquire_timeout(Duration::from_millis(250))
        .build()
        .expect("a store through the gate")
}
