//! The opt-in cache of committed answers (`StoreBuilder::replay_cache`, issue 36): a
//! retry whose answer the store keeps is replayed without a round trip to PostgreSQL,
//! byte for byte; everything else still asks PostgreSQL; and what ends an answer (its
//! key's expiry, a purge) ends it in the cache too: at once for an expiry or a purge
//! through the same store, within `max_stale` for a purge elsewhere.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::testing::Gate;
use idem::{idempotent, Store, Tx};
use idem_tests::{gated_store, with_test_db, TestApp, TestDb};
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    calls: Arc<AtomicUsize>,
}

#[derive(Deserialize)]
struct Note {
    text: String,
}

/// One write and a count of the runs.
async fn write(calls: &AtomicUsize, tx: &mut Tx<'_>, note: &Note) -> Json<Value> {
    let run = calls.fetch_add(1, Ordering::SeqCst) + 1;
    sqlx::query("INSERT INTO notes (text) VALUES ($1)")
        .bind(&note.text)
        .execute(&mut **tx)
        .await
        .expect("the write");
    Json(json!({ "text": note.text, "run": run }))
}

#[idempotent(scope = "notes", ttl = "24h", fields = [text])]
async fn note(
    State(calls): State<Arc<AtomicUsize>>,
    mut tx: Tx,
    Json(note): Json<Note>,
) -> (StatusCode, Json<Value>) {
    (StatusCode::CREATED, write(&calls, &mut tx, &note).await)
}

/// The same, kept for one second.
#[idempotent(scope = "brief", ttl = "1s", fields = [text])]
async fn brief(
    State(calls): State<Arc<AtomicUsize>>,
    mut tx: Tx,
    Json(note): Json<Note>,
) -> (StatusCode, Json<Value>) {
    (StatusCode::CREATED, write(&calls, &mut tx, &note).await)
}

/// The service on `store`, and the count of its handlers' runs.
async fn serve(db: &TestDb, store: Store) -> (TestApp, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/notes", post(note))
        .route("/brief", post(brief))
        .with_state(AppState {
            idempotency: store,
            calls: Arc::clone(&calls),
        });
    (TestApp::serve(db.pool(2).await, app).await, calls)
}

/// idem's tables and the notes table on `db`.
async fn migrate(db: &TestDb) {
    let pool = db.pool(1).await;
    Store::new(pool.clone()).migrate().await.unwrap();
    sqlx::query("CREATE TABLE notes (id bigserial PRIMARY KEY, text text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
}

/// A store through `gate` that keeps answers for `max_stale`, and gives up on a
/// connection after 250 ms.
fn cached(gate: &Gate, db: &TestDb, max_stale: Duration) -> Store {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(gate.options(db.options.clone()));
    Store::builder(pool)
        .acquire_timeout(Duration::from_millis(250))
        .replay_cache(1 << 20, max_stale)
        .build()
        .unwrap()
}

/// The gate's round trips once none has passed for 50 ms: what a request sent after its
/// answer (a replay's ROLLBACK) is counted before the next request is.
async fn settled(gate: &Gate) -> u64 {
    loop {
        let trips = gate.round_trips();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if gate.round_trips() == trips {
            return trips;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_kept_answer_asks_the_database_nothing() {
    with_test_db(async |db| {
        migrate(db).await;
        let mut gate = Gate::start(&db.options).await;
        let (app, calls) = serve(db, cached(&gate, db, Duration::from_secs(60))).await;
        let (plain, _) = serve(db, gated_store(gate.options(db.options.clone()))).await;
        let first = app
            .post("/notes", Some("k1"), &json!({ "text": "a" }))
            .await;
        assert_eq!(first.status, 201, "{first:?}");
        let trips = settled(&gate).await;
        let again = app
            .post("/notes", Some("k1"), &json!({ "text": "a" }))
            .await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!((again.status, &again.body), (first.status, &first.body));
        assert_eq!(gate.round_trips(), trips, "round trips for a kept answer");

        // PostgreSQL out of reach: the kept answer is still replayed; another payload
        // under the key, and a store without the cache, ask PostgreSQL, and cannot.
        gate.shut().await;
        let during = app
            .post("/notes", Some("k1"), &json!({ "text": "a" }))
            .await;
        assert_eq!((during.status, &during.body), (first.status, &first.body));
        let other = app
            .post("/notes", Some("k1"), &json!({ "text": "b" }))
            .await;
        assert_eq!(other.status, 503, "another payload: {other:?}");
        let uncached = plain
            .post("/notes", Some("k1"), &json!({ "text": "a" }))
            .await;
        assert_eq!(uncached.status, 503, "without the cache: {uncached:?}");
        gate.open().await;

        // Back: PostgreSQL decides the other payload, as without the cache.
        let other = app
            .post("/notes", Some("k1"), &json!({ "text": "b" }))
            .await;
        assert_eq!(other.status, 422, "{other:?}");
        // A replay PostgreSQL answered is kept too.
        let read = plain
            .post("/notes", Some("k2"), &json!({ "text": "c" }))
            .await;
        assert_eq!(read.status, 201);
        let fetched = app
            .post("/notes", Some("k2"), &json!({ "text": "c" }))
            .await;
        assert_eq!(fetched.body, read.body);
        // That replay's ROLLBACK goes out after its answer: counted before the next.
        let trips = settled(&gate).await;
        let kept = app
            .post("/notes", Some("k2"), &json!({ "text": "c" }))
            .await;
        assert_eq!(kept.body, read.body);
        assert_eq!(
            gate.round_trips(),
            trips,
            "round trips for an answer read before"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "runs");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_elsewhere_is_seen_within_max_stale_and_here_at_once() {
    with_test_db(async |db| {
        migrate(db).await;
        let gate = Gate::start(&db.options).await;
        let store = cached(&gate, db, Duration::from_millis(300));
        let (app, calls) = serve(db, store.clone()).await;
        let elsewhere = Store::new(db.pool(1).await);
        let body = json!({ "text": "a" });
        assert_eq!(app.post("/notes", Some("k"), &body).await.status, 201);
        assert_eq!(
            elsewhere
                .operate()
                .audited(idem_tests::operator())
                .purge_key("notes", "", "k")
                .await
                .unwrap(),
            1
        );
        // Within max_stale the purged answer may still be replayed here ...
        let stale = app.post("/notes", Some("k"), &body).await;
        assert_eq!(stale.header("idempotent-replayed"), Some("true"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // ... and past it, the key runs afresh.
        tokio::time::sleep(Duration::from_millis(350)).await;
        let fresh = app.post("/notes", Some("k"), &body).await;
        assert_eq!(fresh.status, 201);
        assert_eq!(fresh.header("idempotent-replayed"), None);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // A purge through the store that keeps the answer is seen at once.
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_key("notes", "", "k")
                .await
                .unwrap(),
            1
        );
        let again = app.post("/notes", Some("k"), &body).await;
        assert_eq!(again.header("idempotent-replayed"), None);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_answer_ends_at_its_keys_expiry() {
    with_test_db(async |db| {
        migrate(db).await;
        let gate = Gate::start(&db.options).await;
        let (app, calls) = serve(db, cached(&gate, db, Duration::from_secs(60))).await;
        let body = json!({ "text": "a" });
        assert_eq!(app.post("/brief", Some("k"), &body).await.status, 201);
        let kept = app.post("/brief", Some("k"), &body).await;
        assert_eq!(kept.header("idempotent-replayed"), Some("true"));
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let expired = app.post("/brief", Some("k"), &body).await;
        assert_eq!(expired.status, 201);
        assert_eq!(
            expired.header("idempotent-replayed"),
            None,
            "past the key's ttl"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    })
    .await;
}
