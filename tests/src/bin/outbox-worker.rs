//! An outbox relay to JetStream, or a JetStream consumer crediting a ledger, as a real
//! OS process that the outbox tests kill with SIGKILL at a chosen point
//! (`CARGO_BIN_EXE_outbox-worker`):
//!
//! - `outbox-worker relay`: relays the outbox of `DATABASE_URL` to `NATS_URL`, with a
//!   lease of `LEASE_MS` (default 2000) and a publish timeout of `PUBLISH_TIMEOUT_MS`
//!   (default 1000); with `HANG_AFTER=n`, every publish from the n-th
//!   on waits forever once JetStream has acknowledged it, before the relay can mark it
//!   (the test kills it there).
//! - `outbox-worker consume`: consumes `STREAM`'s durable consumer `CONSUMER`, crediting
//!   `credits` once per event through `run_once`; with `HANG_AFTER=n`, the n-th delivery
//!   waits forever after its commit, before its ack.
//!
//! It prints `HUNG` on stdout when it reaches the point.

use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem::outbox::nats::{JetStreamConsumer, JetStreamPublisher};
use idem::outbox::{OutboxEvent, PublishError, Publisher, Received};
use idem::Store;
use idem_tests::ledger::{book, Credit};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

fn hang_after() -> u64 {
    std::env::var("HANG_AFTER")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}

/// The duration in milliseconds of the variable `name`, or `default`.
fn millis(name: &str, default: u64) -> Duration {
    let ms = std::env::var(name).ok().and_then(|ms| ms.parse().ok());
    Duration::from_millis(ms.unwrap_or(default))
}

async fn hang() -> ! {
    // Other publishes of the batch may get here after the test closed the pipe.
    let mut stdout = std::io::stdout();
    writeln!(stdout, "HUNG").and_then(|()| stdout.flush()).ok();
    std::future::pending().await
}

struct Hanging {
    inner: JetStreamPublisher,
    published: AtomicU64,
    after: u64,
}

impl Publisher for Hanging {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        self.inner.publish(event).await?;
        if self.published.fetch_add(1, Ordering::SeqCst) + 1 >= self.after {
            hang().await;
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&env("DATABASE_URL"))
        .await
        .expect("connect to PostgreSQL");
    let store = Store::new(pool);
    let client = async_nats::connect(env("NATS_URL"))
        .await
        .expect("connect to NATS");
    let jetstream = async_nats::jetstream::new(client);
    match std::env::args().nth(1).as_deref() {
        Some("relay") => {
            let publisher = Hanging {
                inner: JetStreamPublisher::new(jetstream),
                published: AtomicU64::new(0),
                after: hang_after(),
            };
            let _relay = store
                .relay(publisher)
                .lease(millis("LEASE_MS", 2000))
                .publish_timeout(millis("PUBLISH_TIMEOUT_MS", 1000))
                .every(Duration::from_millis(50))
                .spawn()
                .expect("start the relay");
            std::future::pending::<()>().await;
        }
        Some("consume") => {
            let stream = jetstream
                .get_stream(env("STREAM"))
                .await
                .expect("the stream");
            let consumer = stream
                .get_consumer(&env("CONSUMER"))
                .await
                .expect("the consumer");
            let after = hang_after();
            let handled = AtomicU64::new(0);
            JetStreamConsumer::new(jetstream, consumer)
                .retry_delay(Duration::from_millis(100))
                .run(async |credit: Received<Credit>| {
                    let result = book(&store, &credit).await;
                    if result.is_ok() && handled.fetch_add(1, Ordering::SeqCst) + 1 >= after {
                        hang().await;
                    }
                    result
                })
                .await
                .expect("consume");
        }
        _ => panic!("usage: outbox-worker relay|consume"),
    }
}
