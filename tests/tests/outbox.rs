//! The transactional outbox without a broker: events written through a handler's `Tx`
//! and through `run_once` commit with the business writes or not at all, replays emit
//! nothing, ids are derived from the attempt; the relay (with publishers of the test's
//! own) publishes every committed event once, never loses a row committed late, keeps
//! per-key order with two relays at once, parks a poison event (or one whose publisher
//! panics) while the rest flow, and works by LISTEN/NOTIFY (under a long table name too),
//! by polling behind PgBouncer, and in portable mode; a relay past its lease marks
//! nothing another relay took, and a dead relay's leases end with its session.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::operate::{DeadSelection, RedriveError};
use idem::outbox::{Event, OutboxEvent, PublishError, Publisher};
use idem::{idempotent, Store, Tx};
use idem_tests::{count, with_test_db, Pgbouncer, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
}

#[derive(Deserialize, Serialize)]
struct NewNote {
    body: String,
    /// The handler fails after writing when set: everything must roll back.
    fail: bool,
}

fn fail(error: String) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, error)
}

/// Writes a note and emits `note.created` with it; fails afterwards when asked.
#[idempotent(scope = "notes", fields = [body])]
async fn create_note(
    mut tx: Tx,
    Json(req): Json<NewNote>,
) -> Result<(StatusCode, Json<serde_json::Value>), (StatusCode, String)> {
    let id: i64 = sqlx::query_scalar("INSERT INTO notes (body) VALUES ($1) RETURNING id")
        .bind(&req.body)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let event = tx
        .emit(
            Event::new("note.created", &json!({ "id": id, "body": req.body }))
                .ordering_key(id.to_string())
                .header("note-id", id.to_string()),
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
    if req.fail {
        return Err(fail("failed after writing".into()));
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": id, "event": event })),
    ))
}

async fn notes_app(pool: PgPool, store: Store) -> TestApp {
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE notes (id bigserial PRIMARY KEY, body text NOT NULL)")
        .execute(&pool)
        .await
        .expect("notes table");
    let app = Router::new()
        .route("/notes", post(create_note))
        .with_state(AppState { store });
    TestApp::serve(pool, app).await
}

/// The events in the outbox, in the order they were written: (id, topic, payload).
async fn outbox(pool: &PgPool) -> Vec<(String, String, serde_json::Value)> {
    let rows: Vec<(String, String, Vec<u8>)> =
        sqlx::query_as("SELECT id, topic, payload FROM idem_outbox ORDER BY seq")
            .fetch_all(pool)
            .await
            .expect("read the outbox");
    rows.into_iter()
        .map(|(id, topic, payload)| (id, topic, serde_json::from_slice(&payload).unwrap()))
        .collect()
}

/// A pool of 8 on `db`, and a default store on it with its tables made.
async fn migrated(db: &TestDb) -> (PgPool, Store) {
    let pool = db.pool(8).await;
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    (pool, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_commits_with_its_request_and_a_replay_emits_nothing() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let app = notes_app(pool.clone(), Store::new(pool.clone())).await;
        let body = json!({ "body": "hello", "fail": false });
        let first = app.post("/notes", Some("k1"), &body).await;
        assert_eq!(first.status, 201, "{:?}", first.json());
        let replay = app.post("/notes", Some("k1"), &body).await;
        assert_eq!(replay.status, 201);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.json(), first.json());
        let events = outbox(&pool).await;
        assert_eq!(events.len(), 1, "the replay emitted nothing: {events:?}");
        let (id, topic, payload) = &events[0];
        assert_eq!(topic, "note.created");
        assert_eq!(payload, &json!({ "id": 1, "body": "hello" }));
        assert_eq!(
            first.json()["event"],
            json!(id),
            "emit returned the stored id"
        );
        let headers: Vec<u8> = sqlx::query_scalar("SELECT headers FROM idem_outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(headers, b"note-id: 1\n");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolled_back_request_emits_nothing_and_its_retry_emits_once() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let app = notes_app(pool.clone(), Store::new(pool.clone())).await;
        let failing = app
            .post("/notes", Some("k1"), &json!({ "body": "x", "fail": true }))
            .await;
        assert_eq!(failing.status, 500);
        assert_eq!(
            count(&pool, "idem_outbox").await,
            0,
            "rolled back with the note"
        );
        assert_eq!(count(&pool, "notes").await, 0);
        let retry = app
            .post("/notes", Some("k1"), &json!({ "body": "x", "fail": false }))
            .await;
        assert_eq!(retry.status, 201);
        assert_eq!(count(&pool, "idem_outbox").await, 1);
    })
    .await;
}

/// The id is SHA-256 over (domain, scope, principal, key, topic, place) and the claiming
/// transaction's start, which the key's row keeps as `created_at`: recomputed here from
/// outside, it is the id the handler got.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_id_is_derived_from_its_attempt() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        let ids: Vec<String> = store
            .run_once("ledger", "msg-1")
            .run(async |mut tx| {
                let a = tx.emit(Event::new("a.b", &1)).await?;
                let b = tx.emit(Event::new("a.b", &1)).await?;
                Ok::<_, sqlx::Error>(vec![a, b])
            })
            .await
            .unwrap();
        assert_ne!(ids[0], ids[1], "two events of one attempt");
        for (place, id) in ids.iter().enumerate() {
            let mut hasher = Sha256::new();
            for part in ["idem.event.v1", "ledger", "", "msg-1", "a.b", &place.to_string()] {
                hasher.update((part.len() as u64).to_be_bytes());
                hasher.update(part.as_bytes());
            }
            let attempt = hasher.finalize().to_vec();
            let expected: String = sqlx::query_scalar(
                "SELECT left(encode(sha256($1 || float8send(extract(epoch FROM created_at)::float8)), 'hex'), 32)
                   FROM idempotency_keys WHERE key = 'msg-1'",
            )
            .bind(attempt)
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!(id, &expected);
            assert_eq!(id.len(), 32);
        }
        // Another key, another id; and replaying the work emits nothing.
        let other: String = store
            .run_once("ledger", "msg-2")
            .run(async |mut tx| Ok::<_, sqlx::Error>(tx.emit(Event::new("a.b", &1)).await?))
            .await
            .unwrap();
        assert!(!ids.contains(&other));
        let again: Vec<String> = store
            .run_once("ledger", "msg-1")
            .run(async |mut tx| {
                let a = tx.emit(Event::new("a.b", &1)).await?;
                Ok::<_, sqlx::Error>(vec![a])
            })
            .await
            .unwrap();
        assert_eq!(again, ids, "the stored result");
        assert_eq!(count(&pool, "idem_outbox").await, 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_once_work_that_fails_emits_nothing_and_bad_events_are_refused() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let store = Store::builder(pool.clone())
            .table("ops.keys")
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        store.migrate().await.expect("migrate is safe to run again");
        assert!(store
            .schema()
            .outbox_sql
            .contains("\"ops\".\"idem_outbox\""));
        let failed = store
            .run_once("ledger", "m")
            .run(async |mut tx| {
                tx.emit(Event::new("x", &1)).await?;
                Err::<(), sqlx::Error>(sqlx::Error::RowNotFound)
            })
            .await;
        assert!(matches!(failed, Err(idem::jobs::OnceError::Work(_))));
        assert_eq!(count(&pool, "ops.idem_outbox").await, 0);
        let refused = store
            .run_once("ledger", "m")
            .run(async |mut tx| {
                let topic = tx.emit(Event::new("has space", &1)).await.unwrap_err();
                let header = tx
                    .emit(Event::new("ok", &1).header("bad:name", "v"))
                    .await
                    .unwrap_err();
                let value = tx
                    .emit(Event::new("ok", &1).header("name", "two\nlines"))
                    .await
                    .unwrap_err();
                Ok::<_, sqlx::Error>([topic, header, value].map(|e| e.to_string()))
            })
            .await
            .unwrap();
        assert!(
            refused[0].contains("invalid event topic \"has space\""),
            "{}",
            refused[0]
        );
        assert!(refused[1].contains("\"bad:name\""), "{}", refused[1]);
        assert!(refused[2].contains("\"name\""), "{}", refused[2]);
        assert_eq!(count(&pool, "ops.idem_outbox").await, 0);
    })
    .await;
}

/// Which events a [`Recorder`] fails, and how.
type Failure = dyn Fn(&OutboxEvent) -> Option<PublishError> + Send + Sync;

/// A publisher that records what it was given, after an optional delay, failing the
/// events `fail` says to.
#[derive(Clone, Default)]
struct Recorder {
    published: Arc<Mutex<Vec<OutboxEvent>>>,
    fail: Option<Arc<Failure>>,
    delay: Duration,
}

impl Recorder {
    fn failing(
        fail: impl Fn(&OutboxEvent) -> Option<PublishError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            fail: Some(Arc::new(fail)),
            ..Self::default()
        }
    }

    fn events(&self) -> Vec<OutboxEvent> {
        self.published.lock().unwrap().clone()
    }

    /// Waits until `n` events were published, for at most `within`.
    async fn wait_for(&self, n: usize, within: Duration) -> Vec<OutboxEvent> {
        let deadline = Instant::now() + within;
        loop {
            let events = self.events();
            if events.len() >= n || Instant::now() > deadline {
                return events;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Publisher for Recorder {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        if let Some(error) = self.fail.as_ref().and_then(|fail| fail(event)) {
            return Err(error);
        }
        self.published.lock().unwrap().push(event.clone());
        Ok(())
    }
}

/// Waits until the outbox holds no row (a relay deletes a row just after its publisher
/// returned).
async fn drained(pool: &PgPool) {
    drained_but(pool, 0).await;
}

/// Waits until the outbox holds `left` rows, for at most 5 s.
async fn drained_but(pool: &PgPool, left: i64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let rows = count(pool, "idem_outbox").await;
        if rows == left {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{rows} rows left in the outbox, not {left}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Emits `n` events on `topic` through `run_once` keys `prefix-0..n`, with the ordering
/// key `key(i)` and payload `i`.
async fn emit_many(store: &Store, prefix: &str, n: usize, key: impl Fn(usize) -> Option<String>) {
    for i in 0..n {
        let ordering_key = key(i);
        store
            .run_once("emit", &format!("{prefix}-{i}"))
            .run(async |mut tx| {
                let mut event = Event::new("t.e", &i);
                if let Some(k) = ordering_key {
                    event = event.ordering_key(k);
                }
                tx.emit(event).await?;
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap();
    }
}

/// Regression (issue 36): a key with a backlog drained one event per round. A take now
/// leases a key's events behind its head, and one task publishes them in order. When one
/// fails, the rest of its chain is given back unpublished, their attempts uncounted: the
/// key's order holds, and only the failed event's attempt counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keys_backlog_goes_in_order_and_a_failure_gives_the_rest_back() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "c", 10, |_| Some("k".into())).await;
        let failed_once = Arc::new(Mutex::new(false));
        let recorder = Recorder::failing(move |e| {
            let mut failed = failed_once.lock().unwrap();
            (e.payload == b"4" && !*failed).then(|| {
                *failed = true;
                PublishError::retry("refused once")
            })
        });
        let relay = store
            .relay(recorder.clone())
            .batch(32)
            .every(Duration::from_millis(20))
            .backoff(Duration::from_millis(10), Duration::from_millis(10))
            .spawn()
            .unwrap();
        let events = recorder.wait_for(10, Duration::from_secs(10)).await;
        drained(&pool).await;
        // The relay counts a round's deletes once its statement has answered.
        let deadline = Instant::now() + Duration::from_secs(5);
        while relay.stats().published < 10 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let stats = relay.stats();
        assert_eq!((stats.published, stats.retried, stats.dead), (10, 1, 0));
        relay.stop();
        let order: Vec<&[u8]> = events.iter().map(|e| e.payload.as_slice()).collect();
        let expected: Vec<Vec<u8>> = (0..10).map(|i: i32| i.to_string().into_bytes()).collect();
        assert_eq!(
            order,
            expected.iter().map(Vec::as_slice).collect::<Vec<_>>()
        );
        let attempts: Vec<u32> = events.iter().map(|e| e.attempt).collect();
        assert_eq!(attempts, [1, 1, 1, 1, 2, 1, 1, 1, 1, 1]);
    })
    .await;
}

/// A round publishes a key's events for about a second, then gives the rest back: an
/// event written meanwhile, without a key, goes out at the next round, not behind the
/// whole backlog of a slow destination (40 events of one key at 100 ms each took one
/// round of four seconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_keys_backlog_does_not_hold_back_the_next_round() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "slow", 40, |_| Some("k".into())).await;
        let recorder = Recorder {
            delay: Duration::from_millis(100),
            ..Recorder::default()
        };
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(20))
            .spawn()
            .unwrap();
        // The first round has begun on the backlog.
        recorder.wait_for(1, Duration::from_secs(10)).await;
        emit_many(&store, "loose", 1, |_| None).await;
        let events = recorder.wait_for(41, Duration::from_secs(30)).await;
        assert_eq!(events.len(), 41);
        let loose = events.iter().position(|e| e.ordering_key.is_none());
        assert!(
            loose.is_some_and(|at| at < 30),
            "the event without a key went out at {loose:?} of 41"
        );
        let keyed: Vec<i64> = events
            .iter()
            .filter(|e| e.ordering_key.is_some())
            .map(|e| serde_json::from_slice(&e.payload).unwrap())
            .collect();
        assert_eq!(keyed, (0..40).collect::<Vec<_>>(), "the key's order");
        drained(&pool).await;
        relay.stop();
    })
    .await;
}

/// An event's attempt history (issue 39): each failed publish is kept with its time, the
/// last ten, oldest first, and through a re-drive, so that an operator sees whether a dead
/// event always failed the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_events_last_ten_failures_are_kept_with_their_times() {
    with_test_db(async |db| {
        let (_pool, store) = migrated(db).await;
        emit_many(&store, "h", 1, |_| None).await;
        let tries = Arc::new(Mutex::new(0));
        let counted = Arc::clone(&tries);
        let recorder = Recorder::failing(move |_| {
            let mut n = counted.lock().unwrap();
            *n += 1;
            Some(PublishError::retry(format!("refused {n}")))
        });
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(10))
            .backoff(Duration::from_millis(1), Duration::from_millis(1))
            .max_attempts(12)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while relay.stats().dead == 0 {
            assert!(Instant::now() < deadline, "{:?}", relay.stats());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        relay.stopped().await;
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1);
        let errors = store.operate().event_errors(&dead[0].id).await.unwrap();
        let said: Vec<&str> = errors.iter().map(|e| e.error.as_str()).collect();
        let expected: Vec<String> = (3..=12).map(|n| format!("refused {n}")).collect();
        assert_eq!(said, expected);
        assert!(errors.windows(2).all(|w| w[0].at <= w[1].at), "{errors:?}");
        assert_eq!(dead[0].last_error, "refused 12");
        // A re-drive keeps them; a gone event has none.
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .redrive_dead(&idem::operate::DeadSelection::All)
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            store.operate().event_errors(&dead[0].id).await.unwrap(),
            errors
        );
        assert!(store
            .operate()
            .event_errors("no-such-event")
            .await
            .unwrap()
            .is_empty());
    })
    .await;
}

/// Issue 39: a lease's owner was a number ("relay 1873542264"). Each relay's session now
/// names its host and process, and `outbox_relays` lists the relays holding their locks,
/// by the owner numbers their leases carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relays_are_listed_with_their_host_and_process() {
    with_test_db(async |db| {
        let (_pool, store) = migrated(db).await;
        assert!(store.operate().outbox_relays().await.unwrap().is_empty());
        let relays: Vec<_> = (0..2)
            .map(|_| {
                store
                    .relay(Recorder::default())
                    .every(Duration::from_millis(20))
                    .spawn()
                    .unwrap()
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let listed = loop {
            let listed = store.operate().outbox_relays().await.unwrap();
            if listed.len() == 2 || Instant::now() > deadline {
                break listed;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(listed.len(), 2, "{listed:?}");
        let pid = format!(" pid {}", std::process::id());
        for relay in &listed {
            assert!(relay.name.starts_with("idem relay "), "{relay:?}");
            assert!(relay.name.ends_with(&pid), "{relay:?}");
        }
        assert_ne!(listed[0].owner, listed[1].owner);
        for relay in relays {
            relay.stopped().await;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !store.operate().outbox_relays().await.unwrap().is_empty() {
            assert!(
                Instant::now() < deadline,
                "the stopped relays' sessions stayed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relay_publishes_each_event_once_and_empties_the_outbox() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "a", 50, |_| None).await;
        let recorder = Recorder::default();
        let stats = store
            .relay(recorder.clone())
            .batch(16)
            .run_until_idle()
            .await
            .unwrap();
        assert_eq!(stats.published, 50);
        let events = recorder.events();
        let mut payloads: Vec<i64> = events
            .iter()
            .map(|e| serde_json::from_slice(&e.payload).unwrap())
            .collect();
        payloads.sort();
        assert_eq!(payloads, (0..50).collect::<Vec<_>>());
        assert!(events.iter().all(|e| e.topic == "t.e" && e.attempt == 1));
        assert_eq!(count(&pool, "idem_outbox").await, 0);
    })
    .await;
}

/// Regression (Watermill's SQL forwarder, issue 311): a relay that cursors on `id >
/// last_seen` skips a row whose transaction commits after rows written later. The relay
/// keeps no cursor: the late row is published at the next round.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_committed_late_is_never_lost() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        let recorder = Recorder::default();
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(50))
            .spawn()
            .unwrap();
        let (written, wait_written) = tokio::sync::oneshot::channel();
        let (commit, wait_commit) = tokio::sync::oneshot::channel::<()>();
        let late = tokio::spawn({
            let store = store.clone();
            async move {
                store
                    .run_once("emit", "late")
                    .run(async |mut tx| {
                        tx.emit(Event::new("t.e", &"late")).await?;
                        written.send(()).unwrap();
                        wait_commit.await.unwrap();
                        Ok::<_, sqlx::Error>(())
                    })
                    .await
                    .unwrap()
            }
        });
        wait_written.await.unwrap();
        emit_many(&store, "early", 3, |_| None).await;
        assert_eq!(recorder.wait_for(3, Duration::from_secs(5)).await.len(), 3);
        // The early rows are deleted; the late one is not visible yet.
        drained(&pool).await;
        commit.send(()).unwrap();
        late.await.unwrap();
        let events = recorder.wait_for(4, Duration::from_secs(5)).await;
        assert_eq!(events.len(), 4);
        assert_eq!(events[3].payload, b"\"late\"");
        relay.stop();
    })
    .await;
}

/// Regression (MassTransit PR 6216): one event that can never be sent looped at full
/// CPU and blocked the others. It is retried with backoff, parked after `max_attempts`,
/// the rest flow, and a re-drive publishes it once the destination takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_event_is_parked_and_the_rest_flow() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "a", 10, |i| Some(format!("k{}", i % 2))).await;
        let poisoned = Arc::new(Mutex::new(true));
        let poison = Arc::clone(&poisoned);
        let recorder = Recorder::failing(move |e| {
            (*poison.lock().unwrap() && e.payload == b"4").then(|| PublishError::retry("refused"))
        });
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(20))
            .backoff(Duration::from_millis(10), Duration::from_millis(40))
            .max_attempts(3)
            .spawn()
            .unwrap();
        let events = recorder.wait_for(9, Duration::from_secs(10)).await;
        assert_eq!(events.len(), 9, "all but the poison event");
        let started = Instant::now();
        while relay.stats().dead == 0 && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drained_but(&pool, 1).await;
        let stats = relay.stats();
        assert_eq!((stats.published, stats.retried, stats.dead), (9, 2, 1));
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].attempts, 3);
        assert_eq!(dead[0].last_error, "refused");
        // Its key's later events were not held back by a parked event.
        let k0: Vec<Vec<u8>> = events
            .iter()
            .filter(|e| e.ordering_key.as_deref() == Some("k0"))
            .map(|e| e.payload.clone())
            .collect();
        assert_eq!(
            k0,
            [b"0".to_vec(), b"2".to_vec(), b"6".to_vec(), b"8".to_vec()]
        );
        *poisoned.lock().unwrap() = false;
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .redrive_dead(&idem::operate::DeadSelection::All)
                .await
                .unwrap(),
            1
        );
        let events = recorder.wait_for(10, Duration::from_secs(5)).await;
        assert_eq!(events[9].payload, b"4");
        assert!(store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .is_empty());
        drained(&pool).await;
        relay.stop();
    })
    .await;
}

/// Issue 37: a consumer's `run_once` record of an event's first delivery expires with its
/// ttl, so re-driving an event written longer ago could apply it twice. A re-drive whose
/// selection holds one moves nothing and says how many and how old; a forced one moves
/// it; events within the window re-drive as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redrive_past_the_window_moves_nothing_unless_forced() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let day = Duration::from_secs(86_400);
        assert_eq!(
            Store::new(pool.clone()).operate().redrive_max_age(),
            day,
            "run_once's ttl"
        );
        let hour = Duration::from_secs(3_600);
        let store = Store::builder(pool.clone())
            .redrive_max_age(hour)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        emit_many(&store, "a", 3, |_| None).await;
        let recorder = Recorder::failing(|_| Some(PublishError::permanent("no such topic")));
        store.relay(recorder).run_until_idle().await.unwrap();
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        let ids: Vec<String> = dead.iter().map(|e| e.id.clone()).collect();
        assert_eq!(ids.len(), 3);
        // The first was written two hours ago, the second 59 minutes ago.
        for (id, age) in [(&ids[0], "2 hours"), (&ids[1], "59 minutes")] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE idem_outbox SET created_at = now() - interval '{age}' WHERE id = $1"
            )))
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
        }
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert!(dead[0].age >= 2 * hour && dead[0].outside_window(hour));
        assert!(!dead[1].outside_window(hour) && !dead[2].outside_window(hour));
        let rows = async || {
            sqlx::query_as::<_, (String, bool, i32)>(
                "SELECT id, dead_at IS NOT NULL, attempts FROM idem_outbox ORDER BY seq",
            )
            .fetch_all(&pool)
            .await
            .unwrap()
        };
        let before = rows().await;

        let error = store
            .operate()
            .audited(idem_tests::operator())
            .redrive_dead(&DeadSelection::All)
            .await
            .unwrap_err();
        let RedriveError::OutsideWindow {
            selected,
            outside,
            oldest,
            max_age,
        } = &error
        else {
            panic!("{error:?}");
        };
        assert_eq!((*selected, *outside, *max_age), (3, 1, hour));
        assert!(
            *oldest >= 2 * hour && *oldest < 2 * hour + hour / 60,
            "{oldest:?}"
        );
        let said = error.to_string();
        assert!(
            said.contains("1 of the 3") && said.contains("(1h)"),
            "{said}"
        );
        assert_eq!(rows().await, before, "nothing moved");
        // The audited re-drive keeps the window too.
        let error = store
            .operate()
            .audited(idem_tests::operator())
            .redrive_dead(&idem::operate::DeadSelection::Ids(ids[..1].to_vec()))
            .await
            .unwrap_err();
        assert!(matches!(
            error,
            RedriveError::OutsideWindow { outside: 1, .. }
        ));
        assert_eq!(rows().await, before, "nothing moved");

        let young = DeadSelection::Ids(ids[1..].to_vec());
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .redrive_dead(&young)
                .await
                .unwrap(),
            2
        );
        assert_eq!(
            store
                .operate()
                .dead_events_in(&idem::operate::DeadSelection::All, 10)
                .await
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .redrive_dead_forced(&DeadSelection::All)
                .await
                .unwrap(),
            1
        );
        let after = rows().await;
        assert!(
            after
                .iter()
                .all(|(_, dead, attempts)| !dead && *attempts == 0),
            "{after:?}"
        );
    })
    .await;
}

/// A permanent failure parks at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_permanent_failure_parks_at_once() {
    with_test_db(async |db| {
        let (_, store) = migrated(db).await;
        emit_many(&store, "a", 1, |_| None).await;
        let recorder = Recorder::failing(|_| Some(PublishError::permanent("no such topic")));
        let stats = store.relay(recorder).run_until_idle().await.unwrap();
        assert_eq!((stats.published, stats.retried, stats.dead), (0, 0, 1));
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert_eq!(
            (dead[0].attempts, dead[0].last_error.as_str()),
            (1, "no such topic")
        );
    })
    .await;
}

/// Two relays on one outbox, publishing slowly and concurrently: every event once, and
/// the events of each ordering key in the order they were written. Each key has one
/// writer, which waits for each commit before its next write, so its write order is its
/// commit order.
async fn two_relays(store: &Store, pool: &PgPool, listen: bool) {
    const WRITERS: usize = 4;
    const PER_WRITER: usize = 30;
    let recorder = Recorder {
        delay: Duration::from_millis(2),
        ..Recorder::default()
    };
    let relays: Vec<_> = (0..2)
        .map(|_| {
            store
                .relay(recorder.clone())
                .batch(4)
                .listen(listen)
                .every(Duration::from_millis(20))
                .spawn()
                .unwrap()
        })
        .collect();
    // Written while the relays run, from four writers at once.
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                emit_many(&store, &format!("w{w}"), PER_WRITER, |i| {
                    Some(format!("w{w}-k{}", i % 3))
                })
                .await;
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let total = WRITERS * PER_WRITER;
    let events = recorder.wait_for(total, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(recorder.events().len(), total, "each event once");
    let mut ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), total, "no duplicate");
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for e in &events {
        let i: i64 = serde_json::from_slice(&e.payload).unwrap();
        per_key
            .entry(e.ordering_key.clone().unwrap())
            .or_default()
            .push(i);
    }
    assert_eq!(per_key.len(), WRITERS * 3);
    for (key, order) in &per_key {
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{key}: {order:?}");
    }
    // A relay counts an event once its mark commits, after the publish the recorder
    // saw: the last marks may still be on their way.
    let deadline = Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let stats: Vec<u64> = relays.iter().map(|r| r.stats().published).collect();
        if stats.iter().sum::<u64>() >= total as u64 || Instant::now() > deadline {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(stats.iter().sum::<u64>(), total as u64);
    assert!(
        stats.iter().all(|&n| n > 0),
        "both relays published: {stats:?}"
    );
    drained(pool).await;
    for relay in relays {
        relay.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_publish_each_event_once_in_key_order() {
    with_test_db(async |db| {
        let pool = db.pool(12).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        two_relays(&store, &pool, true).await;
    })
    .await;
}

/// Portable mode: writes do not NOTIFY, relays poll, the statements take no row-lock
/// clauses; the same guarantees.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_in_portable_mode() {
    with_test_db(async |db| {
        let pool = db.pool(12).await;
        let store = Store::builder(pool.clone()).portable(true).build().unwrap();
        store.migrate().await.unwrap();
        two_relays(&store, &pool, false).await;
    })
    .await;
}

/// Behind PgBouncer in transaction mode, where LISTEN does not work: the relay polls by
/// default, and its statements go unnamed in transactions of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_behind_a_transaction_pooler_poll() {
    with_test_db(async |db| {
        let direct = db.pool(2).await;
        let bouncer = Pgbouncer::start(db);
        let store = bouncer.store(12).await;
        store.migrate().await.unwrap();
        // Left to its default, the relay does not LISTEN here.
        let recorder = Recorder::default();
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(20))
            .spawn()
            .unwrap();
        emit_many(&store, "p", 5, |_| None).await;
        assert_eq!(recorder.wait_for(5, Duration::from_secs(5)).await.len(), 5);
        relay.stop();
        two_relays(&store, &direct, false).await;
    })
    .await;
}

/// With LISTEN/NOTIFY, a committed event is published at once, not at the next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_wakes_the_relay() {
    with_test_db(async |db| {
        let (_, store) = migrated(db).await;
        let recorder = Recorder::default();
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_secs(60))
            .spawn()
            .unwrap();
        // Let it run its first round and start listening.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for n in 1..=3 {
            let started = Instant::now();
            emit_many(&store, &format!("n{n}"), 1, |_| None).await;
            let events = recorder.wait_for(n, Duration::from_secs(5)).await;
            assert_eq!(events.len(), n);
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{:?}",
                started.elapsed()
            );
        }
        relay.stop();
    })
    .await;
}

/// Regression (invariant 10, transient is never final): every failed publish counted
/// toward `max_attempts`, so a broker down for longer than the attempts' backoffs parked
/// its events as dead (this test needed `.max_attempts(1000)`). A destination that is
/// unavailable for many more rounds than `max_attempts` parks nothing, keeps the reason as
/// `last_error`, does not count the attempts, and every event is published once it is
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outage_is_retried_until_it_ends() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        let down = Arc::new(Mutex::new(true));
        let outage = Arc::clone(&down);
        let recorder = Recorder::failing(move |_| {
            (*outage.lock().unwrap()).then(|| PublishError::unavailable("connection refused"))
        });
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(20))
            .backoff(Duration::from_millis(20), Duration::from_millis(100))
            .max_attempts(2)
            .spawn()
            .unwrap();
        emit_many(&store, "o", 20, |i| Some(format!("k{}", i % 4))).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(recorder.events().is_empty());
        let stats = relay.stats();
        // Far more rounds than `max_attempts`: the first of each key every ~100 ms.
        assert!(stats.unavailable >= 4 * 4, "{stats:?}");
        assert_eq!(stats.retried, stats.unavailable);
        assert_eq!(stats.dead, 0);
        assert!(store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .is_empty());
        let errors: Vec<(i32, Option<String>)> =
            sqlx::query_as("SELECT attempts, last_error FROM idem_outbox ORDER BY seq")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(errors.len(), 20);
        for (attempts, last_error) in &errors[..4] {
            // Given back, unless the relay is publishing it this instant.
            assert!(*attempts <= 1, "{errors:?}");
            assert_eq!(last_error.as_deref(), Some("connection refused"));
        }
        // What an operator sees meanwhile: each key held by its first event, whose attempt
        // was given back.
        let blocked = store.operate().outbox_blocked(10).await.unwrap();
        assert_eq!(blocked.len(), 4, "{blocked:?}");
        assert!(blocked.iter().all(|key| key.waiting == 4), "{blocked:?}");
        *down.lock().unwrap() = false;
        let events = recorder.wait_for(20, Duration::from_secs(10)).await;
        assert_eq!(events.len(), 20);
        let mut ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 20, "each event once");
        assert!(events.iter().all(|e| e.attempt == 1), "uncounted attempts");
        drained(&pool).await;
        assert_eq!(relay.stats().dead, 0);
        relay.stop();
    })
    .await;
}

/// An event the destination hangs on (every publish of it times out, which reads as
/// unavailable) while it publishes the other events: that is the event's own failure, not
/// an outage. It counts, the event is parked after `max_attempts`, and the next event of
/// its ordering key is published then. (Counted as an outage, it was tried for ever and
/// held its key back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_the_destination_hangs_on_is_parked_while_others_flow() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "bad", 2, |_| Some("bad".into())).await;
        let hangs = |event: &OutboxEvent| {
            event.ordering_key.as_deref() == Some("bad") && event.payload == b"0"
        };
        let recorder = Recorder::failing(move |event| {
            // The relay's publish timeout cuts the hang short: its own error.
            hangs(event).then(|| PublishError::unavailable("no acknowledgement within 100ms"))
        });
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(20))
            .backoff(Duration::from_millis(20), Duration::from_millis(50))
            .max_attempts(3)
            .spawn()
            .unwrap();
        // The destination serves other events all the while.
        for round in 0..40 {
            emit_many(&store, &format!("good{round}"), 1, |_| {
                Some(format!("g{round}"))
            })
            .await;
            tokio::time::sleep(Duration::from_millis(25)).await;
            if relay.stats().dead == 1 {
                break;
            }
        }
        let started = Instant::now();
        while relay.stats().dead == 0 && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1, "{:?}", relay.stats());
        assert_eq!(dead[0].ordering_key.as_deref(), Some("bad"));
        assert_eq!(dead[0].attempts, 3);
        // Its key moved on.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !recorder
            .events()
            .iter()
            .any(|e| e.payload == b"1" && e.ordering_key.as_deref() == Some("bad"))
        {
            assert!(Instant::now() < deadline, "the key's next event waits");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drained_but(&pool, 1).await;
        relay.stop();
    })
    .await;
}

/// Beside it: an event the destination keeps refusing (`PublishError::retry`) still
/// counts its attempts and is parked after `max_attempts`, and an outage before its
/// refusals does not add to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refusal_still_parks_after_max_attempts() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "r", 1, |_| None).await;
        let answers = Arc::new(Mutex::new(0_u32));
        let answered = Arc::clone(&answers);
        // Unavailable for five attempts, then refused.
        let recorder = Recorder::failing(move |_| {
            let mut n = answered.lock().unwrap();
            *n += 1;
            Some(if *n <= 5 {
                PublishError::unavailable("connection refused")
            } else {
                PublishError::retry("no stream captures the subject")
            })
        });
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(20))
            .backoff(Duration::from_millis(5), Duration::from_millis(20))
            .max_attempts(2)
            .spawn()
            .unwrap();
        let started = Instant::now();
        while relay.stats().dead == 0 && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let stats = relay.stats();
        assert_eq!(
            (
                stats.published,
                stats.retried,
                stats.unavailable,
                stats.dead
            ),
            (0, 6, 5, 1),
            "{stats:?}"
        );
        assert_eq!(*answers.lock().unwrap(), 7);
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (dead[0].attempts, dead[0].last_error.as_str()),
            (2, "no stream captures the subject")
        );
        drained_but(&pool, 1).await;
        relay.stop();
    })
    .await;
}

/// `outbox_notify(false)`: writes send no NOTIFY (PostgreSQL serializes the commits of
/// transactions that notify), the relay does not listen, and polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_notify_the_relay_polls() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let store = Store::builder(pool.clone())
            .outbox_notify(false)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        assert!(!store.schema().outbox_sql.is_empty());
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
            .await
            .unwrap();
        listener.listen("idem_outbox").await.unwrap();
        let recorder = Recorder::default();
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(30))
            .spawn()
            .unwrap();
        emit_many(&store, "q", 5, |_| None).await;
        assert_eq!(recorder.wait_for(5, Duration::from_secs(5)).await.len(), 5);
        let notified = tokio::time::timeout(Duration::from_millis(200), listener.recv()).await;
        assert!(notified.is_err(), "no NOTIFY: {notified:?}");
        relay.stopped().await;
    })
    .await;
}

/// One NOTIFY per interval (`outbox_notify_interval`, issue 28): PostgreSQL serializes the
/// commits of transactions that notify, so a store lets one through per interval. The
/// commits let go without one are published by the relay it woke, which keeps looking for
/// its linger; once that has passed, the relay sleeps until a NOTIFY or its poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_notify_per_interval_and_the_woken_relay_lingers() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let store = Store::builder(pool.clone())
            .outbox_notify_interval(Duration::from_secs(60))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
            .await
            .unwrap();
        listener.listen("idem_outbox").await.unwrap();
        let recorder = Recorder::default();
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_secs(60))
            .linger(Duration::from_secs(2))
            .spawn()
            .unwrap();
        // Let it run its first round and start listening.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        emit_many(&store, "first", 1, |_| None).await;
        assert_eq!(recorder.wait_for(1, Duration::from_secs(5)).await.len(), 1);
        // Within the interval: no NOTIFY, taken by the lingering relay.
        emit_many(&store, "more", 5, |_| None).await;
        assert_eq!(recorder.wait_for(6, Duration::from_secs(5)).await.len(), 6);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "not the 60 s poll: {:?}",
            started.elapsed()
        );
        let mut notified = 0;
        while tokio::time::timeout(Duration::from_millis(200), listener.recv())
            .await
            .is_ok()
        {
            notified += 1;
        }
        assert_eq!(notified, 1, "one NOTIFY for six commits");
        // The linger over, the relay sleeps: an event without a NOTIFY waits for the poll.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        emit_many(&store, "late", 1, |_| None).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(recorder.events().len(), 6, "the relay stopped looking");
        assert_eq!(count(&pool, "idem_outbox").await, 1);
        relay.stopped().await;
    })
    .await;
}

/// Regression (issue 27, finding 7): a name the builder accepts (66 characters, each part
/// under 48) was the NOTIFY channel, which PostgreSQL limits to 63 bytes, and every
/// `Tx::emit` failed. The channel is derived from the name: writes succeed, and a commit
/// still wakes the relay at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_outbox_table_name_emits_and_wakes_the_relay() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let name = format!("{}.{}", "s".repeat(17), "o".repeat(48));
        assert_eq!(name.len(), 66);
        let store = Store::builder(pool.clone())
            .outbox_table(&name)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let recorder = Recorder::default();
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_secs(60))
            .spawn()
            .unwrap();
        // Let it run its first round and start listening.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        emit_many(&store, "long", 1, |_| None).await;
        assert_eq!(recorder.wait_for(1, Duration::from_secs(5)).await.len(), 1);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "woken by the commit, not the 60 s poll: {:?}",
            started.elapsed()
        );
        // Deleted from the long-named table (just after the publisher returned).
        let deadline = Instant::now() + Duration::from_secs(5);
        while count(&pool, &name).await > 0 {
            assert!(Instant::now() < deadline, "the outbox never emptied");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        relay.stopped().await;
    })
    .await;
}

/// A publisher that holds one event (by its payload) until the test lets it go, then
/// answers `answer`; the others it records at once. With `blocking`, it holds the whole
/// thread, as a paused process does (a long GC pause, SIGSTOP, a starved host): no publish
/// timeout cuts that short, so its relay outlives its lease.
struct Holding {
    payload: &'static [u8],
    blocking: bool,
    answer: Result<(), PublishError>,
    reached: tokio::sync::mpsc::UnboundedSender<()>,
    release: Mutex<std::sync::mpsc::Receiver<()>>,
    recorder: Recorder,
}

/// Tells a [`Holding`] publisher's test when it holds its event, and lets it go.
struct Hold {
    reached: tokio::sync::mpsc::UnboundedReceiver<()>,
    release: std::sync::mpsc::Sender<()>,
}

impl Hold {
    /// Waits until the publisher holds its event.
    async fn reached(&mut self) {
        tokio::time::timeout(Duration::from_secs(10), self.reached.recv())
            .await
            .expect("the publisher never got its event")
            .unwrap();
    }

    /// Lets the held event go.
    fn release(&self) {
        self.release.send(()).unwrap();
    }
}

impl Holding {
    fn new(
        payload: &'static [u8],
        blocking: bool,
        answer: Result<(), PublishError>,
        recorder: &Recorder,
    ) -> (Self, Hold) {
        let (reached, reached_rx) = tokio::sync::mpsc::unbounded_channel();
        let (release_tx, release) = std::sync::mpsc::channel();
        let publisher = Self {
            payload,
            blocking,
            answer,
            reached,
            release: Mutex::new(release),
            recorder: recorder.clone(),
        };
        let hold = Hold {
            reached: reached_rx,
            release: release_tx,
        };
        (publisher, hold)
    }
}

impl Publisher for Holding {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        if event.payload == self.payload {
            self.reached.send(()).ok();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let released = self.release.lock().unwrap().try_recv().is_ok();
                if released || Instant::now() > deadline {
                    break;
                }
                if self.blocking {
                    std::thread::sleep(Duration::from_millis(5));
                } else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            self.answer.clone()?;
        }
        self.recorder.publish(event).await
    }
}

/// Waits until `relay`'s stats differ from `before`: its round is over.
async fn round_over<T: PartialEq + std::fmt::Debug>(stats: impl Fn() -> T, before: T) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats() == before {
        assert!(
            Instant::now() < deadline,
            "the round never ended: {before:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Regression (issue 27, finding 10): the relay's delete did not check who held the
/// lease. Relay A stalls past its lease (300 ms) on event 0; relay B takes it and is still
/// publishing it when A wakes up: A's delete freed the ordering key, and event 1 was
/// published before B's event 0. Now A's mark finds the event no longer under its lease
/// and does nothing: the key's order holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_past_its_lease_deletes_nothing_another_relay_took() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "f", 2, |_| Some("k".into())).await;
        let recorder = Recorder::default();
        let (stalling, mut a_hold) = Holding::new(b"0", true, Ok(()), &recorder);
        let a = store
            .relay(stalling)
            .lease(Duration::from_millis(300))
            .publish_timeout(Duration::from_millis(100))
            .every(Duration::from_millis(20))
            .spawn()
            .unwrap();
        a_hold.reached().await;
        let a_before = a.stats();
        // A is alive (its session holds), but its lease runs out.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let (slow, mut b_hold) = Holding::new(b"0", false, Ok(()), &recorder);
        let b = store
            .relay(slow)
            .every(Duration::from_millis(20))
            .spawn()
            .unwrap();
        b_hold.reached().await;
        a_hold.release();
        round_over(|| a.stats(), a_before).await;
        assert_eq!(a.stats().published, 0, "{:?}", a.stats());
        assert_eq!(a.stats().overtaken, 1, "{:?}", a.stats());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(count(&pool, "idem_outbox").await, 2, "event 0 is B's");
        b_hold.release();
        let events = recorder.wait_for(3, Duration::from_secs(5)).await;
        let payloads: Vec<&[u8]> = events.iter().map(|e| &*e.payload).collect();
        assert_eq!(
            payloads,
            [&b"0"[..], b"0", b"1"],
            "A's copy, B's, then the next"
        );
        drained(&pool).await;
        a.stop();
        b.stopped().await;
    })
    .await;
}

/// Regression (issue 27, finding 10): the relay's failure mark did not check who held the
/// lease. Relay A stalls past its lease on an event that then fails; relay B took the
/// event meanwhile and parked it (a permanent failure): A's retry mark un-parked it. Now
/// it does nothing, and the event stays parked with B's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_past_its_lease_cannot_unpark_an_event() {
    with_test_db(async |db| {
        let (_, store) = migrated(db).await;
        emit_many(&store, "u", 1, |_| None).await;
        let recorder = Recorder::default();
        let (stalling, mut a_hold) =
            Holding::new(b"0", true, Err(PublishError::retry("timed out")), &recorder);
        let a = store
            .relay(stalling)
            .lease(Duration::from_millis(300))
            .publish_timeout(Duration::from_millis(100))
            .every(Duration::from_millis(20))
            .spawn()
            .unwrap();
        a_hold.reached().await;
        let a_before = a.stats();
        tokio::time::sleep(Duration::from_millis(400)).await;
        let b = store
            .relay(Recorder::failing(|_| {
                Some(PublishError::permanent("refused"))
            }))
            .every(Duration::from_millis(20))
            .spawn()
            .unwrap();
        round_over(|| b.stats().dead, 0).await;
        a_hold.release();
        round_over(|| a.stats(), a_before).await;
        assert_eq!(a.stats().retried, 0, "{:?}", a.stats());
        assert_eq!(a.stats().overtaken, 1, "{:?}", a.stats());
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1, "still parked");
        assert_eq!(dead[0].last_error, "refused");
        a.stop();
        b.stopped().await;
    })
    .await;
}

/// Regression (issue 27, finding 10): a relay that died kept its leases (30 s by
/// default), and the events of an ordering key it held waited all that time. Its leases
/// end with its session: another relay publishes them at its next round.
async fn a_dead_relays_leases_end_with_it(
    store: &Store,
    pool: &PgPool,
    direct: Option<PgConnectOptions>,
) {
    emit_many(store, "d", 3, |_| Some("k".into())).await;
    let recorder = Recorder::default();
    let (hanging, mut hold) = Holding::new(b"0", false, Ok(()), &recorder);
    let mut a = store.relay(hanging);
    let mut b = store.relay(recorder.clone());
    if let Some(direct) = direct {
        a = a.session(direct.clone());
        b = b.session(direct);
    }
    let a = a.spawn().unwrap();
    hold.reached().await;
    // As a crash: no mark, and its connections drop.
    a.abort();
    let aborted = Instant::now();
    let b = b.every(Duration::from_millis(50)).spawn().unwrap();
    let events = recorder.wait_for(3, Duration::from_secs(10)).await;
    assert_eq!(events.len(), 3, "the key's events: {events:?}");
    assert!(
        aborted.elapsed() < Duration::from_secs(3),
        "well under the 30 s lease: {:?}",
        aborted.elapsed()
    );
    drained(pool).await;
    b.stopped().await;
    drop(hold);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_relays_leases_end_with_its_session() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        a_dead_relays_leases_end_with_it(&store, &pool, None).await;
    })
    .await;
}

/// Behind a transaction pooler a session lock would stay on a server connection the
/// pooler hands to other clients, so by default leases end by their time there; given a
/// direct connection for its session ([`RelayBuilder::session`]), a dead relay's leases
/// end with it there too.
///
/// [`RelayBuilder::session`]: idem::outbox::RelayBuilder::session
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn behind_a_pooler_a_direct_session_ends_a_dead_relays_leases() {
    with_test_db(async |db| {
        let direct = db.pool(2).await;
        let bouncer = Pgbouncer::start(db);
        let store = bouncer.store(8).await;
        store.migrate().await.unwrap();
        a_dead_relays_leases_end_with_it(&store, &direct, Some(db.options.clone())).await;
    })
    .await;
}

/// Behind a transaction pooler `LISTEN` does not work through the pooler, so relays only
/// polled, and the NOTIFY each commit of an event carries went unheard. A relay given a
/// direct connection for its session listens on one of its own: an event committed
/// through the pooler is published at once, long before the relay's next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn behind_a_pooler_a_relay_with_a_direct_session_is_woken() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let store = bouncer.store(4).await;
        store.migrate().await.unwrap();
        let recorder = Recorder::default();
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_secs(60))
            .session(db.options.clone())
            .spawn()
            .unwrap();
        // Past the relay's first round, which finds nothing, and its LISTEN.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let committed = Instant::now();
        emit_many(&store, "w", 1, |_| None).await;
        let events = recorder.wait_for(1, Duration::from_secs(10)).await;
        assert_eq!(events.len(), 1, "woken, not left for the 60 s poll");
        assert!(
            committed.elapsed() < Duration::from_secs(10),
            "{:?}",
            committed.elapsed()
        );
        relay.stop();
    })
    .await;
}

/// Regression (issue 27, finding 12): a publisher that panicked left its event leased:
/// taken again at every lease, panicking again, never parked, and the later events of its
/// ordering key held back for ever. A panic is a failure of its event: retried after a
/// backoff, parked at the limit, and the relay and the other events go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_publisher_fails_its_event_and_the_relay_goes_on() {
    with_test_db(async |db| {
        let (pool, store) = migrated(db).await;
        emit_many(&store, "p", 6, |i| Some(format!("k{}", i % 2))).await;
        let recorder = Recorder::failing(|e| {
            if e.payload == b"2" {
                panic!("a bug in the publisher");
            }
            None
        });
        let relay = store
            .relay(recorder.clone())
            .every(Duration::from_millis(20))
            .backoff(Duration::from_millis(10), Duration::from_millis(40))
            .max_attempts(3)
            .spawn()
            .unwrap();
        let events = recorder.wait_for(5, Duration::from_secs(10)).await;
        let mut payloads: Vec<&[u8]> = events.iter().map(|e| &*e.payload).collect();
        payloads.sort();
        assert_eq!(payloads, [&b"0"[..], b"1", b"3", b"4", b"5"]);
        drained_but(&pool, 1).await;
        let dead = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1, "parked after its attempts");
        assert_eq!(dead[0].attempts, 3);
        assert!(
            dead[0].last_error.contains("panicked") && dead[0].last_error.contains("a bug"),
            "{}",
            dead[0].last_error
        );
        let stats = relay.stats();
        assert_eq!((stats.published, stats.retried, stats.dead), (5, 2, 1));
        relay.stopped().await;
    })
    .await;
}
