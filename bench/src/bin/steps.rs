//! The cost of a step (BENCHMARKS.md, "Steps"), in one run on a database of its own: the
//! same `#[idempotent]` handler, fresh keys over real HTTP, making its outside call
//! directly and inside `tx.step(..)`; the call is either a stand-in processor over HTTP
//! on loopback (`idem_tests::ProcessorServer`) or a local function (no I/O: what the step
//! itself costs). Each cell: requests per second at a fixed concurrency, p50 and p99.
//!
//! `cargo run --release -p idem-bench --bin steps -- [--seconds N] [--step-connections 4,16]`
//! (the step pool's size, `StoreBuilder::step_connections`: a row of cells for each).
//!
//! `-- --step-rows 1000,1000000` instead prints the steps table's cost curve: the table
//! filled to each size with the steps of requests that never committed (half of them
//! expired), then the local step at 16 requests at a time, then the purge of the expired
//! half, with the ratio of the largest size's figures to the smallest's.
//!
//! `-- --completable` instead prints what storing the request costs a step's request
//! (`completable = true`, issue 38): the local step with and without it, alternating, in
//! three rounds at 1 and 16 requests at a time.

#[path = "../args.rs"]
mod args;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{percentiles, ProcessorServer, TestApp, TestDb};
use serde_json::{json, Value};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    outside: Arc<Outside>,
}

struct Outside {
    client: reqwest::Client,
    url: String,
}

impl Outside {
    async fn charge(&self, key: &str, amount: i64) -> Result<Value, String> {
        let answer = self
            .client
            .post(&self.url)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": amount }))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        answer.json().await.map_err(|e| e.to_string())
    }
}

async fn write(tx: &mut Tx<'_>, id: &str) -> Result<StatusCode, StatusCode> {
    sqlx::query("INSERT INTO charges (processor_id) VALUES ($1)")
        .bind(id)
        .execute(&mut **tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(StatusCode::CREATED)
}

#[idempotent(scope = "direct")]
async fn direct(
    State(outside): State<Arc<Outside>>,
    mut tx: Tx,
    Json(v): Json<Value>,
) -> Result<StatusCode, StatusCode> {
    let key = tx.derived_key("processor").unwrap_or_default();
    let charged = outside
        .charge(&key, v["amount"].as_i64().unwrap_or(0))
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    write(&mut tx, charged["id"].as_str().unwrap_or_default()).await
}

#[idempotent(scope = "stepped")]
async fn stepped(
    State(outside): State<Arc<Outside>>,
    mut tx: Tx,
    Json(v): Json<Value>,
) -> Result<StatusCode, StatusCode> {
    let amount = v["amount"].as_i64().unwrap_or(0);
    let charged: Value = tx
        .step("processor", |key| async move {
            outside.charge(&key, amount).await
        })
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    write(&mut tx, charged["id"].as_str().unwrap_or_default()).await
}

#[idempotent(scope = "local")]
async fn local(mut tx: Tx, Json(v): Json<Value>) -> Result<StatusCode, StatusCode> {
    let id = format!("local-{}", v["amount"]);
    write(&mut tx, &id).await
}

#[idempotent(scope = "local_step")]
async fn local_step(mut tx: Tx, Json(v): Json<Value>) -> Result<StatusCode, StatusCode> {
    let amount = v["amount"].clone();
    let id: String = tx
        .step("local", |_key| async move {
            Ok::<_, Infallible>(format!("local-{amount}"))
        })
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    write(&mut tx, &id).await
}

#[idempotent(scope = "completable", completable = true)]
async fn completable_step(mut tx: Tx, Json(v): Json<Value>) -> Result<StatusCode, StatusCode> {
    let amount = v["amount"].clone();
    let id: String = tx
        .step("local", |_key| async move {
            Ok::<_, Infallible>(format!("local-{amount}"))
        })
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    write(&mut tx, &id).await
}

/// Fresh keys on `path` for `seconds` at `concurrency`: requests per second, p50 and p99.
async fn cell(app: &TestApp, path: &str, concurrency: usize, seconds: u64) -> (f64, f64, f64) {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let workers = (0..concurrency).map(|worker| {
        let latencies = Arc::clone(&latencies);
        async move {
            let mut n = 0;
            while Instant::now() < deadline {
                let key = format!("{path}-{concurrency}-{worker}-{n}");
                n += 1;
                let t = Instant::now();
                let answer = app.post(path, Some(&key), &json!({ "amount": n })).await;
                assert_eq!(answer.status, 201, "{path}: {answer:?}");
                latencies.lock().expect("latencies").push(t.elapsed());
            }
        }
    });
    futures::future::join_all(workers).await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies = latencies.lock().expect("latencies").clone();
    let count = latencies.len() as f64;
    let (p50, p99) = percentiles(&mut latencies);
    (count / elapsed, p50, p99)
}

#[tokio::main]
async fn main() {
    let seconds = args::arg("--seconds", 3);
    let db = TestDb::create().await;
    let pool = db.pool(40).await;
    Store::new(pool.clone()).migrate().await.expect("migrate");
    sqlx::raw_sql("CREATE TABLE charges (id bigserial PRIMARY KEY, processor_id text NOT NULL)")
        .execute(&pool)
        .await
        .expect("charges");
    if args::flag("--completable") {
        completable(&pool, seconds).await;
        pool.close().await;
        db.drop_database().await.expect("drop the bench database");
        return;
    }
    if args::value_of("--step-rows").is_some() {
        step_rows(&pool, seconds).await;
        pool.close().await;
        db.drop_database().await.expect("drop the bench database");
        return;
    }
    let processor = ProcessorServer::start().await;
    let outside = Arc::new(Outside {
        client: reqwest::Client::new(),
        url: format!("{}/v1/charges", processor.url()),
    });
    println!("| step pool | concurrency | call | without a step (req/s, p50 ms, p99 ms) | in a step | step / without |");
    println!("|---|---|---|---|---|---|");
    for connections in args::list("--step-connections", &[4, 16]) {
        let store = Store::builder(pool.clone())
            .step_connections(u32::try_from(connections).unwrap_or(4))
            .build()
            .expect("the store");
        let app = Router::new()
            .route("/direct", post(direct))
            .route("/stepped", post(stepped))
            .route("/local", post(local))
            .route("/local_step", post(local_step))
            .with_state(AppState {
                store,
                outside: Arc::clone(&outside),
            });
        let app = TestApp::serve(pool.clone(), app).await;
        // Warm-up: connections open, statements prepared.
        for path in ["/direct", "/stepped", "/local", "/local_step"] {
            cell(&app, path, 4, 1).await;
        }
        for concurrency in [1, 16] {
            for (call, without, with) in [
                ("HTTP processor", "/direct", "/stepped"),
                ("local function", "/local", "/local_step"),
            ] {
                let a = cell(&app, without, concurrency, seconds).await;
                let b = cell(&app, with, concurrency, seconds).await;
                println!(
                    "| {connections} | {concurrency} | {call} | {:.0}, {:.2}, {:.2} | {:.0}, {:.2}, {:.2} | {:.2} |",
                    a.0,
                    a.1,
                    a.2,
                    b.0,
                    b.1,
                    b.2,
                    b.0 / a.0
                );
            }
        }
    }
    pool.close().await;
    db.drop_database().await.expect("drop the bench database");
}

/// The steps table's cost curve (`--step-rows`): a step's request and the steps' purge
/// at each size of the table. Each row expires a microsecond apart from the next, as
/// requests' steps do: a purge's batch starts at the expiry where the last one stopped.
async fn step_rows(pool: &PgPool, seconds: u64) {
    let store = Store::builder(pool.clone())
        .step_connections(16)
        .build()
        .expect("the store");
    let app = Router::new()
        .route("/local", post(local))
        .route("/local_step", post(local_step))
        .with_state(AppState {
            store: store.clone(),
            outside: Arc::new(Outside {
                client: reqwest::Client::new(),
                url: String::new(),
            }),
        });
    let app = TestApp::serve(pool.clone(), app).await;
    println!("| step rows | without a step (req/s) | in a step (req/s, p50 ms) | step / without | purge (expired rows/s) |");
    println!("|---|---|---|---|---|");
    let mut curve = Vec::new();
    for rows in args::list("--step-rows", &[1_000, 1_000_000]) {
        sqlx::raw_sql("TRUNCATE idempotency_steps, idempotency_keys, charges")
            .execute(pool)
            .await
            .expect("empty the tables");
        sqlx::query(
            "INSERT INTO idempotency_steps (scope, principal, key, step, fingerprint, result, expires_at)
             SELECT 'abandoned', '', 'k' || g, 'processor', '\\x00', '1',
                    now() + CASE WHEN g % 2 = 0 THEN interval '-1 hour' ELSE interval '1 day' END
                          - g * interval '1 microsecond'
               FROM generate_series(1, $1) AS g",
        )
        .bind(rows)
        .execute(pool)
        .await
        .expect("fill the steps table");
        sqlx::raw_sql("VACUUM ANALYZE idempotency_steps")
            .execute(pool)
            .await
            .expect("analyze");
        cell(&app, "/local_step", 4, 1).await;
        let without = cell(&app, "/local", 16, seconds).await;
        let with = cell(&app, "/local_step", 16, seconds).await;
        let started = Instant::now();
        store
            .operate()
            .audited(idem_tests::operator())
            .purge_expired(1_000)
            .await
            .expect("purge");
        let purged = (rows / 2) as f64 / started.elapsed().as_secs_f64();
        println!(
            "| {rows} | {:.0} | {:.0}, {:.2} | {:.2} | {purged:.0} |",
            without.0,
            with.0,
            with.1,
            with.0 / without.0
        );
        curve.push((with.0, purged));
    }
    if let (Some(first), Some(last)) = (curve.first(), curve.last()) {
        println!(
            "| largest / smallest | | {:.2} | | {:.2} |",
            last.0 / first.0,
            last.1 / first.1
        );
    }
}

/// What storing the request costs a step's request (`--completable`): the same local
/// step, its endpoint completable or not, alternating.
async fn completable(pool: &PgPool, seconds: u64) {
    let store = Store::builder(pool.clone())
        .step_connections(16)
        .build()
        .expect("the store");
    let app = Router::new()
        .route("/local_step", post(local_step))
        .route("/completable", post(completable_step))
        .with_state(AppState {
            store,
            outside: Arc::new(Outside {
                client: reqwest::Client::new(),
                url: String::new(),
            }),
        });
    let app = TestApp::serve(pool.clone(), app).await;
    for path in ["/local_step", "/completable"] {
        cell(&app, path, 4, 1).await;
    }
    println!("| concurrency | round | in a step (req/s, p50 ms, p99 ms) | completable (req/s, p50 ms, p99 ms) | completable / step |");
    println!("|---|---|---|---|---|");
    for concurrency in [1, 16] {
        for round in 1..=3 {
            let a = cell(&app, "/local_step", concurrency, seconds).await;
            let b = cell(&app, "/completable", concurrency, seconds).await;
            println!(
                "| {concurrency} | {round} | {:.0}, {:.2}, {:.2} | {:.0}, {:.2}, {:.2} | {:.2} |",
                a.0,
                a.1,
                a.2,
                b.0,
                b.1,
                b.2,
                b.0 / a.0
            );
        }
    }
}
