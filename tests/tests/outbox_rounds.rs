//! The relay's work, counted (issue 36): a drain's rounds per event, each round one take
//! and one delete. Counts, not time, so that a slower machine passes as a fast one does.
//! One ordering key drained one event per round (a take, a publish and a delete: about
//! 900 events/s), whatever its backlog; a take now leases the events behind a key's head,
//! and the gate fails if a drain of one key takes more than a round per hundred events.
//! One test in its own binary: it installs the process-wide subscriber.

use std::sync::{Arc, Mutex};

use idem::outbox::{OutboxEvent, PublishError, Publisher};
use idem::Store;
use idem_tests::{count, with_test_db, ClosedSpans};
use tracing_subscriber::prelude::*;

/// Keeps each payload it publishes, in order.
#[derive(Clone, Default)]
struct Kept(Arc<Mutex<Vec<i64>>>);

impl Publisher for Kept {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        let n = std::str::from_utf8(&event.payload)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| PublishError::permanent("not a number"))?;
        self.0.lock().unwrap().push(n);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_backlog_drains_in_a_round_per_batch() {
    let seen = ClosedSpans::named("idem.relay");
    tracing_subscriber::registry().with(seen.clone()).init();
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        const EVENTS: i64 = 2_000;
        for key in ["'k'", "'k' || (g % 1000)", "NULL"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO idem_outbox (id, topic, ordering_key, payload)
                 SELECT md5(g::text), 't', {key}, convert_to(g::text, 'UTF8')
                   FROM generate_series(1, $1) AS g"
            )))
            .bind(EVENTS)
            .execute(&pool)
            .await
            .unwrap();
            let kept = Kept::default();
            let stats = store
                .relay(kept.clone())
                .batch(256)
                .run_until_idle()
                .await
                .unwrap();
            assert_eq!(stats.published, EVENTS as u64, "{key}");
            assert_eq!(count(&pool, "idem_outbox").await, 0, "{key}");
            let rounds = seen
                .take()
                .iter()
                .filter(|round| round.number("taken").is_some_and(|n| n > 0.0))
                .count() as i64;
            assert!(
                rounds * 100 <= EVENTS,
                "ordering key {key}: {EVENTS} events in {rounds} rounds"
            );
            if key == "'k'" {
                let order = kept.0.lock().unwrap().clone();
                assert_eq!(order, (1..=EVENTS).collect::<Vec<_>>(), "one key's order");
            }
        }
    })
    .await;
}
