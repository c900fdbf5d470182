//! The relay reports like the rest of idem: counters of published, retried and parked
//! events, the lag gauge and the publish delay histogram (feature `metrics`), an
//! `idem.relay` span per round with its counts, and an ERROR line naming a parked event;
//! and `run_once` scopes, which a caller may build from data, stay a bounded label.
//! One test in its own binary: it installs the process-wide subscriber and recorder.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem::outbox::{Event, OutboxEvent, PublishError, Publisher};
use idem::Store;
use idem_tests::{with_test_db, ClosedSpans};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tracing_subscriber::prelude::*;

/// Refuses event 2 for good and event 3 once; publishes the rest.
#[derive(Default)]
struct Picky {
    refused_three: Mutex<bool>,
}

impl Publisher for Picky {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        match &*event.payload {
            b"2" => Err(PublishError::permanent("no such destination")),
            b"3" if !std::mem::replace(&mut *self.refused_three.lock().unwrap(), true) => {
                Err(PublishError::retry("timed out"))
            }
            _ => Ok(()),
        }
    }
}

/// Publishes each event after a pause: a relay kept busy by a backlog.
struct Slow;

impl Publisher for Slow {
    async fn publish(&self, _event: &OutboxEvent) -> Result<(), PublishError> {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok(())
    }
}

/// Emits `n` events on `t.e` (payload `i`), each through `run_once` in `scope` with the
/// key `prefix` and `i`.
async fn emit(store: &Store, scope: &str, prefix: &str, n: u32) {
    for i in 0..n {
        store
            .run_once(scope, &format!("{prefix}{i}"))
            .run(async |mut tx| {
                tx.emit(Event::new("t.e", &i)).await?;
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap();
    }
}

/// The lag gauge's last value.
fn lag_gauge(snapshotter: &metrics_util::debugging::Snapshotter) -> Option<f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find_map(|(key, _, _, value)| match value {
            DebugValue::Gauge(v) if key.key().name() == "idem_outbox_lag_seconds" => {
                Some(v.into_inner())
            }
            _ => None,
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_counts_and_traces_what_it_does() {
    let seen = ClosedSpans::named("idem.relay");
    tracing_subscriber::registry().with(seen.clone()).init();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder of this binary");

    with_test_db(async |db| {
        let pool = db.pool(6).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        emit(&store, "emit", "m", 5).await;
        let relay = store
            .relay(Picky::default())
            .every(Duration::from_millis(20))
            .backoff(Duration::from_millis(10), Duration::from_millis(10))
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while relay.stats().published < 4 || relay.stats().dead < 1 {
            assert!(Instant::now() < deadline, "{:?}", relay.stats());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Idle: the next wait records the lag.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        relay.stopped().await;
        // Regression (issue 27, finding 13): a scope is a metrics label, and `run_once`
        // scopes can come from data (one per tenant): each became a label of its own.
        for tenant in 0..100 {
            store
                .run_once(&format!("tenant-{tenant}"), "m")
                .run(async |_tx| Ok::<_, sqlx::Error>(()))
                .await
                .unwrap();
        }

        let mut counters: HashMap<String, u64> = HashMap::new();
        let mut scopes: HashMap<String, u64> = HashMap::new();
        let mut delays = 0;
        let mut lag = None;
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let name = key.key().name().to_owned();
            if let (true, DebugValue::Counter(n)) = (name == "idem_requests_total", &value) {
                let scope = key.key().labels().find(|l| l.key() == "scope").unwrap();
                *scopes.entry(scope.value().to_owned()).or_default() += n;
            }
            match value {
                DebugValue::Counter(n) => *counters.entry(name).or_default() += n,
                DebugValue::Histogram(values) if name == "idem_outbox_publish_delay_seconds" => {
                    delays += values.len()
                }
                DebugValue::Gauge(v) if name == "idem_outbox_lag_seconds" => {
                    lag = Some(v.into_inner())
                }
                _ => {}
            }
        }
        assert_eq!(
            counters.get("idem_outbox_published_total"),
            Some(&4),
            "{counters:?}"
        );
        assert_eq!(
            counters.get("idem_outbox_retried_total"),
            Some(&1),
            "{counters:?}"
        );
        assert_eq!(
            counters.get("idem_outbox_dead_total"),
            Some(&1),
            "{counters:?}"
        );
        assert_eq!(delays, 4);
        // The first 64 scopes made at run time are labels; the rest count as `other`.
        assert_eq!(scopes.values().sum::<u64>(), 105, "{scopes:?}");
        assert_eq!(scopes.get("emit"), Some(&5), "{scopes:?}");
        assert_eq!(scopes.len(), 65, "{scopes:?}");
        assert_eq!(scopes.get("other"), Some(&37), "{scopes:?}");
        // Nothing pending but the parked event, which does not count.
        assert_eq!(lag, Some(0.0));

        let rounds = seen.take();
        let sum = |field: &str| -> f64 { rounds.iter().filter_map(|r| r.number(field)).sum() };
        assert_eq!(
            (sum("published"), sum("retried"), sum("dead")),
            (4.0, 1.0, 1.0)
        );
        assert!(rounds.iter().all(|r| r.number("round_ms").is_some()));
        let errors = seen.errors();
        let parked: Vec<_> = errors
            .iter()
            .filter(|e| {
                e.get("message")
                    .is_some_and(|m| m.contains("parked as dead"))
            })
            .collect();
        assert_eq!(parked.len(), 1, "{errors:?}");
        assert_eq!(parked[0].get("error"), Some("no such destination"));
        assert!(parked[0].get("event_id").is_some_and(|id| id.len() == 32));

        // Regression: the gauge was only set in rounds that found nothing, so under a
        // steady backlog it kept its last idle value (0) until the backlog was gone.
        emit(&store, "backlog", "b", 30).await;
        let busy = store
            .relay(Slow)
            .batch(1)
            .every(Duration::from_millis(20))
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(2000)).await;
        let during = lag_gauge(&snapshotter);
        let published = busy.stats().published;
        busy.abort();
        assert!(published < 30, "the backlog was gone: {published}");
        assert!(
            during.is_some_and(|lag| lag >= 0.5),
            "lag during a backlog: {during:?}"
        );
    })
    .await;
}
