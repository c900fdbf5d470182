//! Support shared by idem's behaviour tests and its load benchmark (`bench/`): a fresh
//! PostgreSQL database per test, an app served over real HTTP on a loopback port,
//! requests read whole, latency percentiles, the fields of idem's request spans, a
//! PgBouncer in transaction mode in front of a test database, proxies in front of the
//! database that cut it away for an outage or count a client's round trips, a throwaway
//! Citus cluster, a stand-in payment processor for steps, the outbox's brokers (and a NATS server of a test's own), the outside
//! tools the tests check against (the webhook providers' signing libraries,
//! schemathesis), and the pairwise cover the combination suite runs
//! (`tests/tests/combinations.rs`).
//!
//! The server is found through `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`).

mod answer;
mod app;
mod brokers;
mod citus;
mod database;
mod gate;
pub mod ledger;
pub mod pairwise;
mod pooler;
mod processor;
mod spans;
mod stats;
mod tools;

pub use answer::{post, send, Answer};
pub use app::{example_deliveries, migrated_store, Delivery, TestApp};
pub use brokers::{amqp_url, nats_url, unique, PrivateNats};
pub use citus::{Citus, Node, REQUIRE_CITUS};
pub use database::{admin_options, count, with_test_db, with_test_db_encoded, TestDb};
pub use gate::{gated_store, outage};
pub use pooler::{Pgbouncer, SERVER_CONNECTIONS};
pub use processor::{Processor, ProcessorServer};
pub use spans::{ClosedSpans, SpanFields};
pub use stats::{percentiles, tally};
pub use tools::{schemathesis, Signers};

/// The operator the suite and the benchmark act as when they purge, sweep or re-drive
/// (every such change goes through `Store::operate().audited(..)`).
pub fn operator() -> idem::operate::Operator {
    idem::operate::Operator::new("tests", "test")
}
