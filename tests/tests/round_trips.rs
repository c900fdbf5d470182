//! The round-trip gate (issue 28): what each of idem's paths costs in client round trips
//! to the database, in each mode, counted by a proxy in front of it
//! (`idem_tests::Gate`), against the table below, which SCALING.md carries. A
//! change that adds a round trip to a path fails here, on any machine, however busy:
//! round trips are what a request costs on a real network, and timings on a shared
//! two-core machine are noise. A change that removes one fails too, so that the table
//! stays true: update it (and SCALING.md) in the same change.
//!
//! Each count is one request's, from its first byte to the database until its
//! connection is back in the pool, of the round trips that execute something: not the
//! preparation of a named statement (once per connection) nor sqlx's ping of a released
//! connection (after the answer). The handler writes one row (the business write, one
//! round trip of its own, counted here too); the step's handler runs one step (a call
//! that makes no round trip) before it, and its completable twin stores the request
//! with that step (in the step's own message: no round trip more). The portable mode runs on plain PostgreSQL:
//! its client round trips are the same on Citus's coordinator.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use idem::outbox::Event;
use idem::testing::Gate;
use idem::{idempotent, Pooler, Store, Tx};
use idem_tests::{send, with_test_db, Answer, Pgbouncer, TestApp, TestDb};
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[derive(Clone, FromRef)]
struct State {
    store: Store,
}

/// Whether the handlers' statements must be unnamed: behind a transaction pooler, as
/// the pooler mode's own are. The modes run one after another.
static UNNAMED: AtomicBool = AtomicBool::new(false);

async fn write(tx: &mut Tx<'_>, v: &Value) -> Json<Value> {
    sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
        .persistent(!UNNAMED.load(Ordering::SeqCst))
        .bind(v["amount"].as_i64().unwrap_or(0))
        .execute(&mut **tx)
        .await
        .unwrap();
    let ms = v["ms"].as_u64().unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    Json(v.clone())
}

#[idempotent(scope = "charges")]
async fn charge(mut tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    write(&mut tx, &v).await
}

#[idempotent(scope = "waiting", concurrency = wait("5s"))]
async fn waiting(mut tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    write(&mut tx, &v).await
}

#[idempotent(scope = "optional", required = false)]
async fn optional(mut tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    write(&mut tx, &v).await
}

#[idempotent(scope = "emitting")]
async fn emitting(mut tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    tx.emit(Event::new("charge.created", &v)).await.unwrap();
    write(&mut tx, &v).await
}

#[idempotent(scope = "stepping")]
async fn stepping(mut tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    let amount = v["amount"].as_i64().unwrap_or(0);
    let charged: i64 = tx
        .step("processor", |_key| async move {
            Ok::<_, std::convert::Infallible>(amount)
        })
        .await
        .unwrap();
    write(&mut tx, &json!({ "amount": charged })).await
}

#[idempotent(scope = "completable", completable = true)]
async fn completable(mut tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    let amount = v["amount"].as_i64().unwrap_or(0);
    let charged: i64 = tx
        .step("processor", |_key| async move {
            Ok::<_, std::convert::Infallible>(amount)
        })
        .await
        .unwrap();
    write(&mut tx, &json!({ "amount": charged })).await
}

/// The modes, as the table's columns.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Default,
    Pooler,
    Portable,
}

/// The paths, as the table's rows.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    Fresh,
    Replay,
    Conflict,
    WaitThenReplay,
    Keyless,
    RunOnceFresh,
    RunOnceReplay,
    Emit,
    Step,
    CompletableStep,
}

const MODES: [Mode; 3] = [Mode::Default, Mode::Pooler, Mode::Portable];

/// Round trips by path, in the order of [`MODES`]. SCALING.md, "Round trips".
const EXPECTED: [(Path, [u64; 3]); 10] = [
    (Path::Fresh, [3, 4, 5]),
    (Path::Replay, [2, 2, 3]),
    (Path::Conflict, [2, 2, 10]),
    (Path::WaitThenReplay, [4, 5, 4]),
    (Path::Keyless, [3, 4, 3]),
    (Path::RunOnceFresh, [3, 4, 5]),
    (Path::RunOnceReplay, [2, 2, 3]),
    (Path::Emit, [3, 4, 5]),
    (Path::Step, [6, 7, 8]),
    (Path::CompletableStep, [6, 7, 8]),
];

struct Bench {
    app: TestApp,
    store: Store,
    gate: Gate,
    _pooler: Option<Pgbouncer>,
}

impl Bench {
    async fn start(db: &TestDb, mode: Mode) -> Self {
        let pooler = (mode == Mode::Pooler).then(|| Pgbouncer::start(db));
        UNNAMED.store(pooler.is_some(), Ordering::SeqCst);
        let upstream = match &pooler {
            Some(bouncer) => bouncer.options(),
            None => db.options.clone(),
        };
        let gate = Gate::start(&upstream).await;
        let options: PgConnectOptions = gate.options(upstream);
        // One connection: every statement of a request on it, none opened mid-count.
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .min_connections(2)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::raw_sql("CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint)")
            .execute(&pool)
            .await
            .unwrap();
        let builder = Store::builder(pool.clone());
        let builder = match mode {
            Mode::Default => builder,
            Mode::Pooler => builder.pooler(Pooler::Transaction),
            Mode::Portable => builder.portable(true),
        };
        let store = builder.build().unwrap();
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/charges", post(charge))
            .route("/waiting", post(waiting))
            .route("/optional", post(optional))
            .route("/emitting", post(emitting))
            .route("/stepping", post(stepping))
            .route("/completable", post(completable))
            .with_state(State {
                store: store.clone(),
            });
        let app = TestApp::serve(pool, app).await;
        Self {
            app,
            store,
            gate,
            _pooler: pooler,
        }
    }

    async fn post(&self, path: &str, key: Option<&str>, body: Value) -> Answer {
        let mut request = self.app.client.post(self.app.url(path)).json(&body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        send(request).await
    }

    /// The round trips `work` makes, until its connections are back in the pool.
    async fn count<T>(&self, work: impl std::future::Future<Output = T>) -> (u64, T) {
        settle().await;
        let before = self.gate.round_trips();
        let out = work.await;
        settle().await;
        (self.gate.round_trips() - before, out)
    }

    async fn once(&self, id: &str) -> i64 {
        self.store
            .run_once("ledger", id)
            .payload(&5)
            .run(async |mut tx| {
                sqlx::query("INSERT INTO charges (amount) VALUES (5)")
                    .persistent(!UNNAMED.load(Ordering::SeqCst))
                    .execute(&mut *tx)
                    .await?;
                Ok::<_, sqlx::Error>(5)
            })
            .await
            .unwrap()
    }

    async fn measure(&self, path: Path, n: usize) -> u64 {
        let key = format!("k{n}");
        let body = |ms: u64| json!({ "amount": 5, "ms": ms });
        match path {
            Path::Fresh => {
                let (trips, answer) = self.count(self.post("/charges", Some(&key), body(0))).await;
                assert_eq!(answer.status, 200);
                trips
            }
            Path::Replay => {
                self.post("/charges", Some(&key), body(0)).await;
                let (trips, answer) = self.count(self.post("/charges", Some(&key), body(0))).await;
                assert!(answer.replayed());
                trips
            }
            Path::Conflict => {
                let first = self.post("/charges", Some(&key), body(1500));
                let duplicate = async {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    self.count(self.post("/charges", Some(&key), body(1500)))
                        .await
                };
                let (_, (trips, answer)) = tokio::join!(first, duplicate);
                assert_eq!(answer.status, 409);
                trips
            }
            Path::WaitThenReplay => {
                // Both requests' trips, less a fresh one's.
                let fresh_key = format!("{key}-fresh");
                let (fresh, _) = self
                    .count(self.post("/waiting", Some(&fresh_key), body(0)))
                    .await;
                let first = self.post("/waiting", Some(&key), body(600));
                let duplicate = async {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    self.post("/waiting", Some(&key), body(600)).await
                };
                let (trips, (_, answer)) =
                    self.count(async { tokio::join!(first, duplicate) }).await;
                assert!(answer.replayed(), "{answer:?}");
                trips - fresh
            }
            Path::Keyless => {
                let (trips, answer) = self.count(self.post("/optional", None, body(0))).await;
                assert_eq!(answer.status, 200);
                trips
            }
            Path::RunOnceFresh => self.count(self.once(&key)).await.0,
            Path::RunOnceReplay => {
                self.once(&key).await;
                self.count(self.once(&key)).await.0
            }
            Path::Emit => {
                let (trips, answer) = self
                    .count(self.post("/emitting", Some(&key), body(0)))
                    .await;
                assert_eq!(answer.status, 200);
                trips
            }
            Path::Step => {
                let (trips, answer) = self
                    .count(self.post("/stepping", Some(&key), body(0)))
                    .await;
                assert_eq!(answer.status, 200);
                trips
            }
            Path::CompletableStep => {
                let (trips, answer) = self
                    .count(self.post("/completable", Some(&key), body(0)))
                    .await;
                assert_eq!(answer.status, 200);
                assert_eq!(
                    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idempotency_requests")
                        .fetch_one(&self.app.pool)
                        .await
                        .unwrap(),
                    0,
                    "the COMMIT deleted the stored request"
                );
                trips
            }
        }
    }
}

/// Until the pool's connections are idle again (sqlx pings a released connection in a
/// task of its own).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(150)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_path_makes_the_round_trips_of_its_table() {
    let mut table = Vec::new();
    for (m, mode) in MODES.into_iter().enumerate() {
        with_test_db(async |db| {
            let bench = Bench::start(db, mode).await;
            // Each path once first: the statements are prepared, the scopes known.
            for (n, (path, _)) in EXPECTED.iter().enumerate() {
                bench.measure(*path, 100 + n).await;
            }
            for (n, (path, expected)) in EXPECTED.iter().enumerate() {
                let measured = bench.measure(*path, n).await;
                table.push((*path, mode, measured, expected[m]));
            }
        })
        .await;
    }
    println!("| path | default | pooler | portable |\n|---|---|---|---|");
    for (path, _) in EXPECTED {
        let cells: Vec<String> = table
            .iter()
            .filter(|row| row.0 == path)
            .map(|row| row.2.to_string())
            .collect();
        println!("| {path:?} | {} |", cells.join(" | "));
    }
    let changed: Vec<_> = table.iter().filter(|row| row.2 != row.3).collect();
    assert!(
        changed.is_empty(),
        "round trips changed (path, mode, measured, expected): {changed:?}"
    );
}
