//! Steps (`Tx::step`): a call to another service happens once per request, across
//! failures and retries, against a stand-in processor over real HTTP that counts calls
//! per key (`idem_tests::ProcessorServer`), in every mode: directly, behind PgBouncer
//! in transaction mode, portable on plain PostgreSQL and portable on Citus.
//!
//! The SIGKILL of a service between a step's record and its COMMIT is in
//! `steps_example.rs`, on the charges example.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures::future::join_all;
use idem::{idempotent, Pooler, Store, Tx};
use idem_tests::{count, with_test_db, Answer, Citus, Pgbouncer, ProcessorServer, TestApp};
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    processor: Arc<Outside>,
}

/// Where the handler's step calls.
struct Outside {
    url: String,
    client: reqwest::Client,
}

/// The business table, on the key's shard (`principal`).
const CHARGES: &str = "CREATE TABLE IF NOT EXISTS charges (
    principal text NOT NULL,
    processor_id text NOT NULL,
    amount bigint NOT NULL CHECK (amount < 1000000)
)";

/// The body of `POST /charges`.
#[derive(serde::Deserialize, serde::Serialize)]
struct NewCharge {
    amount: i64,
    /// Makes the handler fail after its step (not fingerprinted).
    #[serde(default)]
    fail: bool,
    /// Makes the processor end the handler's own database session during the call.
    #[serde(default)]
    lose_session: bool,
}

/// Charges `amount` at the processor in a step, then writes the charge.
#[idempotent(scope = "charges", fields = [amount])]
async fn charge(
    State(outside): State<Arc<Outside>>,
    mut tx: Tx,
    Json(body): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), Response> {
    let amount = body.amount;
    let pid: Option<i32> = if body.lose_session {
        Some(
            sqlx::query_scalar("SELECT pg_backend_pid()")
                .persistent(false)
                .fetch_one(&mut *tx)
                .await
                .map_err(internal)?,
        )
    } else {
        None
    };
    let client = outside.client.clone();
    let url = format!("{}/v1/charges", outside.url);
    let charged: Value = tx
        .step("processor", |key| async move {
            let answer = client
                .post(url)
                .header("Idempotency-Key", key)
                .json(&json!({ "amount": amount, "pid": pid }))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !answer.status().is_success() {
                return Err(format!("the processor answered {}", answer.status()));
            }
            answer.json::<Value>().await.map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| match e.into_problem() {
            Ok(problem) => problem.into_response(),
            Err(call) => (StatusCode::BAD_GATEWAY, call).into_response(),
        })?;
    let processor_id = charged["id"].as_str().unwrap_or_default().to_owned();
    let principal = tx.principal().unwrap_or_default().to_owned();
    sqlx::query("INSERT INTO charges (principal, processor_id, amount) VALUES ($1, $2, $3)")
        .bind(principal)
        .bind(&processor_id)
        .bind(amount)
        .persistent(false)
        .execute(&mut *tx)
        .await
        .map_err(internal)?;
    if body.fail {
        return Err(StatusCode::SERVICE_UNAVAILABLE.into_response());
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "processor_id": processor_id })),
    ))
}

fn internal(error: sqlx::Error) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
}

/// Where a mode's service runs: its pool and its store.
struct Service {
    app: TestApp,
    processor: ProcessorServer,
    store: Store,
    /// A pool of the test's own on the database, past any pooler.
    direct: PgPool,
}

impl Service {
    async fn start(pool: PgPool, store: Store) -> Self {
        Self::start_with(pool.clone(), store, pool).await
    }

    async fn start_with(pool: PgPool, store: Store, direct: PgPool) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("idem=warn")
            .try_init();
        let processor = ProcessorServer::start().await;
        let outside = Arc::new(Outside {
            url: processor.url(),
            client: reqwest::Client::new(),
        });
        sqlx::raw_sql(CHARGES)
            .execute(&pool)
            .await
            .expect("charges");
        let app = Router::new()
            .route("/charges", post(charge))
            .with_state(AppState {
                store: store.clone(),
                processor: outside,
            });
        Self {
            app: TestApp::serve(pool, app).await,
            processor,
            store,
            direct,
        }
    }

    async fn charge(&self, key: &str, body: Value) -> Answer {
        self.app.post("/charges", Some(key), &body).await
    }

    async fn steps(&self) -> i64 {
        count(&self.direct, "idempotency_steps").await
    }

    async fn charges(&self) -> i64 {
        count(&self.direct, "charges").await
    }
}

/// The behaviours every mode keeps, on `s`.
async fn the_contract(s: &Service, mode: &str) {
    let p = &s.processor.processor;

    // The handler fails after its step: the retry resumes after it, one call.
    let failed = s.charge("k1", json!({ "amount": 100, "fail": true })).await;
    assert_eq!(failed.status, 503, "{mode}: {failed:?}");
    assert_eq!(s.steps().await, 1, "{mode}: the step is recorded");
    // What an operator sees of it (the CLI's `key status`, the console's key page).
    let seen = s
        .store
        .operate()
        .key_steps("charges", "", "k1", true)
        .await
        .expect("key_steps");
    assert_eq!(seen.len(), 1, "{mode}: {seen:?}");
    assert_eq!(seen[0].step, "processor");
    assert!(!seen[0].expired);
    assert_eq!(
        seen[0].result.as_deref(),
        Some(r#"{"id":"ch_1"}"#),
        "{mode}"
    );
    let hidden = s
        .store
        .operate()
        .key_steps("charges", "", "k1", false)
        .await
        .expect("key_steps");
    assert_eq!(hidden[0].result, None);
    assert_eq!(hidden[0].result_bytes, 13);
    assert_eq!(s.charges().await, 0, "{mode}: the charge rolled back");
    let retried = s.charge("k1", json!({ "amount": 100 })).await;
    assert_eq!(retried.status, 201, "{mode}: {retried:?}");
    assert_eq!(p.total(), 1, "{mode}: one call across the failure");
    assert_eq!(retried.json()["processor_id"], "ch_1", "{mode}");
    assert_eq!(s.steps().await, 0, "{mode}: COMMIT deleted the key's steps");
    assert!(s
        .store
        .operate()
        .key_steps("charges", "", "k1", true)
        .await
        .expect("key_steps")
        .is_empty());
    let replayed = s.charge("k1", json!({ "amount": 100 })).await;
    assert!(replayed.replayed(), "{mode}");
    assert_eq!(p.total(), 1, "{mode}");

    // A processor that ignores keys is not called twice either.
    p.ignore_keys(true);
    let failed = s.charge("k2", json!({ "amount": 200, "fail": true })).await;
    assert_eq!(failed.status, 503, "{mode}");
    let retried = s.charge("k2", json!({ "amount": 200 })).await;
    assert_eq!(retried.status, 201, "{mode}");
    assert_eq!(retried.json()["processor_id"], "ch_2", "{mode}");
    assert_eq!(p.total(), 2, "{mode}");
    p.ignore_keys(false);

    // The processor fails, then answers: two calls, one key.
    p.fail_next(1);
    let failed = s.charge("k3", json!({ "amount": 300 })).await;
    assert_eq!(failed.status, 502, "{mode}: {failed:?}");
    assert_eq!(s.steps().await, 0, "{mode}: a failed call is not recorded");
    let retried = s.charge("k3", json!({ "amount": 300 })).await;
    assert_eq!(retried.status, 201, "{mode}");
    let keys = p.keys();
    assert_eq!(keys.len(), 3, "{mode}: {keys:?}");
    let k3 = keys
        .iter()
        .find(|k| p.calls(k) == 2)
        .expect("a key called twice");
    assert_eq!(k3.len(), 64, "{mode}: the derived key");

    // The handler's own insert fails after its step (the CHECK): the retry with the same
    // payload resumes; another payload gets 422 and no call.
    let refused = s.charge("k4", json!({ "amount": 5_000_000 })).await;
    assert_eq!(refused.status, 500, "{mode}: {refused:?}");
    let total = p.total();
    let other = s.charge("k4", json!({ "amount": 400 })).await;
    other.assert_problem(422, "key-reused");
    assert_eq!(p.total(), total, "{mode}: no call for another payload");

    // 20 concurrent copies of one request: one call.
    let copies = join_all((0..20).map(|_| s.charge("k5", json!({ "amount": 500 })))).await;
    let created = copies.iter().filter(|a| a.status == 201).count();
    assert!(
        copies.iter().all(|a| [201, 409].contains(&a.status)),
        "{mode}: {copies:?}"
    );
    assert!(created >= 1, "{mode}");
    let calls_k5 = p.total() - total;
    assert_eq!(calls_k5, 1, "{mode}: one call for 20 copies");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_calls_once_per_request_directly_and_portable() {
    for portable in [false, true] {
        with_test_db(async |db| {
            let pool = db.pool(30).await;
            let store = idem_tests::migrated_store(pool.clone(), portable).await;
            let s = Service::start(pool, store).await;
            the_contract(&s, if portable { "portable" } else { "default" }).await;
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_calls_once_per_request_behind_pgbouncer() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let pool = charges::connect_with(bouncer.options(), Pooler::Transaction, 30)
            .await
            .expect("connect through PgBouncer");
        let store = Store::builder(pool.clone())
            .pooler(Pooler::Transaction)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let s = Service::start_with(pool, store, db.pool(2).await).await;
        the_contract(&s, "pooler").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_calls_once_per_request_on_citus() {
    let Some(cluster) = Citus::start("steps::citus", 2).await else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(30)
        .connect_with(cluster.options())
        .await
        .expect("connect to the coordinator");
    let store = Store::builder(pool.clone())
        .portable(true)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    store.distribute(None).await.expect("distribute");
    store.verify().await.expect("verify");
    sqlx::raw_sql(CHARGES)
        .execute(&pool)
        .await
        .expect("charges");
    sqlx::raw_sql(
        "SELECT create_distributed_table('charges', 'principal', colocate_with => 'idempotency_keys')",
    )
    .execute(&pool)
    .await
    .expect("distribute charges");
    let colocated: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT colocationid) FROM pg_dist_partition \
          WHERE logicalrelid::text IN ('idempotency_keys', 'idempotency_steps', 'charges')",
    )
    .fetch_one(&pool)
    .await
    .expect("pg_dist_partition");
    assert_eq!(colocated, 1, "the steps live on their key's shard");
    let s = Service::start(pool, store).await;
    the_contract(&s, "citus").await;
}

/// A pool of four connections, four requests in a step at once: each holds its
/// transaction's connection while its step records on the store's own step pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_still_records_its_steps() {
    with_test_db(async |db| {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(PgConnectOptions::from_str(&db.url()).expect("url"))
            .await
            .expect("pool");
        let store = Store::builder(pool.clone())
            .step_connections(1)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let s = Service::start(pool, store).await;
        s.processor.processor.delay(Duration::from_millis(300));
        let keys: Vec<String> = (0..4).map(|i| format!("full-{i}")).collect();
        let answers = join_all(
            keys.iter()
                .map(|key| s.charge(key, json!({ "amount": 10, "fail": true }))),
        )
        .await;
        assert!(answers.iter().all(|a| a.status == 503), "{answers:?}");
        assert_eq!(s.steps().await, 4, "every step recorded");
        assert_eq!(s.processor.processor.total(), 4);
    })
    .await;
}

/// The request loses its database session while its step's call runs: the result is not
/// recorded (the fence), the request answers 503, and its retry calls again with the
/// same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_lost_its_transaction_records_nothing() {
    for portable in [false, true] {
        with_test_db(async |db| {
            let pool = db.pool(10).await;
            let store = idem_tests::migrated_store(pool.clone(), portable).await;
            let s = Service::start(pool.clone(), store).await;
            s.processor.processor.terminate_through(pool);
            let lost = s
                .charge("lost", json!({ "amount": 1, "lose_session": true }))
                .await;
            assert!(
                [503, 500].contains(&lost.status),
                "portable {portable}: {lost:?}"
            );
            assert_eq!(s.steps().await, 0, "portable {portable}: nothing recorded");
            let retried = s.charge("lost", json!({ "amount": 1 })).await;
            assert_eq!(retried.status, 201, "portable {portable}: {retried:?}");
            let p = &s.processor.processor;
            assert_eq!(p.keys().len(), 1, "portable {portable}");
            assert_eq!(p.total(), 2, "portable {portable}: called again, same key");
        })
        .await;
    }
}

/// A step that takes longer than the store's step timeout: 504, nothing recorded, and
/// the retry calls again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_step_ends_its_request_with_a_retryable_answer() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        let store = Store::builder(pool.clone())
            .step_timeout(Duration::from_millis(200))
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        let s = Service::start(pool, store).await;
        s.processor.processor.delay(Duration::from_millis(600));
        let slow = s.charge("slow", json!({ "amount": 7 })).await;
        slow.assert_problem(504, "step-timeout");
        assert_eq!(s.steps().await, 0);
        s.processor.processor.delay(Duration::ZERO);
        let retried = s.charge("slow", json!({ "amount": 7 })).await;
        assert_eq!(retried.status, 201, "{retried:?}");
        assert_eq!(s.processor.processor.total(), 2);
    })
    .await;
}

/// Steps of a request that never committed expire with its key: the sweeper removes
/// them, and a retry after that calls again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_expire_with_their_key() {
    for portable in [false, true] {
        with_test_db(async |db| {
            let pool = db.pool(10).await;
            let store = idem_tests::migrated_store(pool.clone(), portable).await;
            let s = Service::start(pool.clone(), store).await;
            let failed = s.charge("old", json!({ "amount": 9, "fail": true })).await;
            assert_eq!(failed.status, 503);
            assert_eq!(s.steps().await, 1);
            sqlx::query("UPDATE idempotency_steps SET expires_at = now() - interval '1 second'")
                .execute(&pool)
                .await
                .expect("age the step");
            s.store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(100)
                .await
                .expect("purge");
            assert_eq!(s.steps().await, 0, "portable {portable}: swept");
            let retried = s.charge("old", json!({ "amount": 9 })).await;
            assert_eq!(retried.status, 201);
            assert_eq!(s.processor.processor.total(), 2, "portable {portable}");
        })
        .await;
    }
}

/// A definitive outcome is recorded as the step's `Ok` and answered the same on retry;
/// `run_once` work resumes its steps too; a keyless call runs each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_work_resumes_after_its_recorded_steps() {
    with_test_db(async |db| {
        let pool = db.pool(6).await;
        let store = idem_tests::migrated_store(pool.clone(), false).await;
        let calls = std::sync::atomic::AtomicU32::new(0);
        let work = |fail: bool| {
            let store = &store;
            let calls = &calls;
            async move {
                store
                    .run_once("ledger", "msg-1")
                    .run(async |mut tx| {
                        // A declined card is an outcome, recorded as the step's `Ok`.
                        let outcome: Result<String, String> = tx
                            .step("authorize", |key| async move {
                                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                assert_eq!(key.len(), 64);
                                Ok::<_, std::convert::Infallible>(Err("declined".to_owned()))
                            })
                            .await
                            .map_err(|e| e.to_string())?;
                        if fail {
                            return Err("the consumer failed after its step".to_owned());
                        }
                        Ok::<_, String>(outcome)
                    })
                    .await
            }
        };
        assert!(work(true).await.is_err());
        assert_eq!(count(&pool, "idempotency_steps").await, 1);
        let outcome = work(false).await.expect("the retry");
        assert_eq!(outcome, Err("declined".to_owned()));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(count(&pool, "idempotency_steps").await, 0);
    })
    .await;
}
