//! ARCHITECTURE.md's invariants, each pinned by a test that fails if it is lost, with handlers
//! written for the purpose and served over real HTTP against a real PostgreSQL.

use std::time::{Duration, Instant};

use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use futures::future::join_all;
use idem::extract::Principal;
use idem::{idempotent, Problem, Store, StoreBuilder, Tx};
use idem_tests::{count, send, with_test_db, Answer, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::{AssertSqlSafe, PgPool};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    pool: PgPool,
}

#[derive(Debug, Deserialize, Serialize)]
struct Effect {
    note: String,
    #[serde(default)]
    sleep_ms: u64,
}

async fn write_effect(tx: &mut Tx<'_>, note: &str) -> Result<i64, Problem> {
    sqlx::query_scalar("INSERT INTO effects (note) VALUES ($1) RETURNING id")
        .bind(note)
        .fetch_one(&mut **tx)
        .await
        .map_err(db_problem)
}

fn db_problem(e: sqlx::Error) -> Problem {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "https://example.com/db",
        "Database error",
    )
    .with_detail(e.to_string())
}

/// Writes an effect, optionally sleeps inside the transaction, answers 201.
#[idempotent(scope = "effects")]
async fn effect(mut tx: Tx, Json(req): Json<Effect>) -> Result<(StatusCode, Json<Value>), Problem> {
    let id = write_effect(&mut tx, &req.note).await?;
    tokio::time::sleep(Duration::from_millis(req.sleep_ms)).await;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": id, "note": req.note })),
    ))
}

/// Writes an effect, then commits idem's transaction behind its back.
#[idempotent(scope = "escape")]
async fn escape(mut tx: Tx, Json(req): Json<Effect>) -> Result<StatusCode, Problem> {
    write_effect(&mut tx, &req.note).await?;
    // The note is the test's own SQL (a COMMIT): the simple query protocol, as a user's
    // raw `COMMIT` would go.
    sqlx::raw_sql(AssertSqlSafe(req.note))
        .execute(&mut *tx)
        .await
        .map_err(db_problem)?;
    Ok(StatusCode::CREATED)
}

/// Writes an effect and panics.
#[idempotent(scope = "panic")]
async fn panics(mut tx: Tx, Json(req): Json<Effect>) -> StatusCode {
    if write_effect(&mut tx, &req.note).await.is_ok() {
        panic!("handler bug after a write");
    }
    StatusCode::CREATED
}

/// Writes an effect and answers a 5xx as `Ok`.
#[idempotent(scope = "five")]
async fn server_error(mut tx: Tx, Json(req): Json<Effect>) -> Result<StatusCode, Problem> {
    write_effect(&mut tx, &req.note).await?;
    Ok(StatusCode::BAD_GATEWAY)
}

/// Writes an effect and answers a body over the store's cap.
#[idempotent(scope = "large")]
async fn too_large(mut tx: Tx, Json(req): Json<Effect>) -> Result<String, Problem> {
    write_effect(&mut tx, &req.note).await?;
    Ok("x".repeat(4096))
}

/// Waits for a row lock held elsewhere: the claim's short lock_timeout must be lifted.
#[idempotent(scope = "locks")]
async fn lock_wait(mut tx: Tx, Json(req): Json<Effect>) -> Result<StatusCode, Problem> {
    sqlx::query("SELECT id FROM effects WHERE note = $1 FOR UPDATE")
        .bind(&req.note)
        .fetch_all(&mut *tx)
        .await
        .map_err(db_problem)?;
    Ok(StatusCode::OK)
}

/// A long query, to be cut off by the test; maps its error like an ordinary handler.
#[idempotent(scope = "sleepy")]
async fn sleepy(mut tx: Tx, Json(req): Json<Effect>) -> Result<StatusCode, Problem> {
    write_effect(&mut tx, &req.note).await?;
    sqlx::query("SELECT pg_sleep($1::float8 / 1000)")
        .bind(req.sleep_ms as f64)
        .execute(&mut *tx)
        .await
        .map_err(db_problem)?;
    Ok(StatusCode::CREATED)
}

/// Reports the lock_timeout the handler's statements run with.
#[idempotent(scope = "timeouts")]
async fn show_lock_timeout(mut tx: Tx) -> Result<String, Problem> {
    sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *tx)
        .await
        .map_err(db_problem)
}

/// Echoes the key the handler sees.
#[idempotent(scope = "echo")]
async fn key_echo(tx: Tx) -> Json<Value> {
    Json(json!({ "key": tx.idempotency_key(), "derived": tx.derived_key("processor") }))
}

/// No `Tx`, a plain return type: the key row still commits alone.
#[idempotent(scope = "plain", ttl = "90s")]
#[allow(deprecated)] // writes nothing
async fn plain(Json(req): Json<Effect>) -> String {
    format!("hello {}", req.note)
}

struct Tenant(String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(|t| Tenant(t.to_owned()))
            .ok_or_else(|| {
                Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "https://example.com/no-tenant",
                    "No tenant",
                )
            })
    }
}

impl Principal for Tenant {
    fn principal_id(&self) -> String {
        self.0.clone()
    }
}

/// Keys per tenant, by the handler's own `principal = ...`.
#[idempotent(scope = "tenants", fields = [note], principal = Tenant)]
async fn per_tenant(
    State(pool): State<PgPool>,
    mut tx: Tx,
    Json(req): Json<Effect>,
) -> Result<Json<Value>, Problem> {
    let id = write_effect(&mut tx, &req.note).await?;
    let _ = pool.size();
    Ok(Json(json!({ "id": id })))
}

async fn start(db: &TestDb, configure: impl FnOnce(StoreBuilder) -> StoreBuilder) -> TestApp {
    serve(db.pool(10).await, configure).await
}

/// Serves this file's handlers on `pool`, with idem configured by `configure`.
async fn serve(pool: PgPool, configure: impl FnOnce(StoreBuilder) -> StoreBuilder) -> TestApp {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS effects (id bigserial PRIMARY KEY, note text NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let idempotency = configure(Store::builder(pool.clone())).build().unwrap();
    idempotency.migrate().await.unwrap();
    let app = Router::new()
        .route("/effect", post(effect))
        .route("/escape", post(escape))
        .route("/panic", post(panics))
        .route("/five", post(server_error))
        .route("/large", post(too_large))
        .route("/locks", post(lock_wait))
        .route("/timeouts", post(show_lock_timeout))
        .route("/sleepy", post(sleepy))
        .route("/echo", post(key_echo))
        .route("/plain", post(plain))
        .route("/tenants", post(per_tenant))
        .with_state(AppState {
            idempotency,
            pool: pool.clone(),
        });
    TestApp::serve(pool, app).await
}

fn note(note: &str) -> Value {
    json!({ "note": note })
}

/// Invariant 1: one transaction. A request whose response cannot be stored leaves no
/// business write either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_transaction_a_response_that_cannot_be_stored_takes_the_writes_with_it() {
    with_test_db(async |db| {
        let s = start(db, |b| b.max_response_bytes(1024)).await;
        let a = s.post("/large", Some("k1"), &note("big")).await;
        a.assert_problem(500, "response-too-large");
        assert!(a.json()["detail"].as_str().unwrap().contains("1024"));
        assert_eq!((s.count("effects").await, s.keys().await), (0, 0));
    })
    .await;
}

/// Invariant 1, and the contract's "any 5xx rolls back".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_answered_as_ok_rolls_back_and_stays_retryable() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        for _ in 0..2 {
            let a = s.post("/five", Some("k1"), &note("x")).await;
            assert_eq!(a.status, 502);
            assert!(!a.replayed());
        }
        assert_eq!((s.count("effects").await, s.keys().await), (0, 0));
    })
    .await;
}

/// Invariant 1: a handler's `Err` rolls back its writes and the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_err_rolls_back_every_write() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        // The second statement fails (a syntax error) after the effect was written.
        let a = s.post("/escape", Some("k1"), &note("NOT SQL")).await;
        assert_eq!(a.status, 500);
        assert_eq!((s.count("effects").await, s.keys().await), (0, 0));
    })
    .await;
}

/// Invariant 2 and 7: a handler that panics after writing leaves nothing, and its key is
/// free for the retry at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_leaves_no_write_and_no_stuck_key() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        let a = s.post("/panic", Some("k1"), &note("boom")).await;
        assert!(a.status == 0 || a.status == 500, "status {}", a.status);
        // The key is not stuck: the same key runs again (and panics again), never 409.
        let b = s.post("/panic", Some("k1"), &note("boom")).await;
        assert!(b.status == 0 || b.status == 500, "status {}", b.status);
        assert_eq!((s.count("effects").await, s.keys().await), (0, 0));
    })
    .await;
}

/// Invariants 3 and 4: a duplicate that waits on the first request's uncommitted claim
/// sees its commit with a fresh statement and replays it: no 500, no second effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_replays_the_winner() {
    with_test_db(async |db| {
        let s = start(db, |b| b.conflict_wait(Duration::from_secs(10))).await;
        assert_waiting_duplicate_replays(&s).await;
    })
    .await;
}

/// Invariant 4: the same under a database whose default isolation is REPEATABLE READ,
/// where an implicit BEGIN would make the waiting claim fail with 40001.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_replays_under_a_repeatable_read_default() {
    with_test_db(async |db| {
        db.set_default("default_transaction_isolation", "repeatable read")
            .await;
        let pool = db.pool(10).await;
        let level: String = sqlx::query_scalar("SHOW default_transaction_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(level, "repeatable read");
        let s = serve(pool, |b| b.conflict_wait(Duration::from_secs(10))).await;
        assert_waiting_duplicate_replays(&s).await;
    })
    .await;
}

async fn assert_waiting_duplicate_replays(s: &TestApp) {
    let body = json!({ "note": "slow", "sleep_ms": 400 });
    let first = s.post("/effect", Some("k1"), &body);
    let second = async {
        // Start once the first request holds its claim.
        wait_for_claim(&s.pool).await;
        s.post("/effect", Some("k1"), &body).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(
        second.status,
        201,
        "{}",
        String::from_utf8_lossy(&second.body)
    );
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(s.count("effects").await, 1);
}

/// Waits until some transaction holds an uncommitted claim (a row lock on the table).
async fn wait_for_claim(pool: &PgPool) {
    let sql = "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
               WHERE c.relname = 'effects' AND l.granted";
    for _ in 0..300 {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
        if n > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("no claim appeared");
}

/// Invariant 3: with the default (reject) policy the loser of a race gets 409 with
/// `Retry-After`, then the replay once the winner committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_gets_409_then_the_replay() {
    with_test_db(async |db| {
        let s = start(db, |b| b.retry_after(Duration::from_secs(2))).await;
        let body = json!({ "note": "slow", "sleep_ms": 400 });
        let first = s.post("/effect", Some("k1"), &body);
        let second = async {
            wait_for_claim(&s.pool).await;
            s.post("/effect", Some("k1"), &body).await
        };
        let (first, second) = tokio::join!(first, second);
        assert_eq!(first.status, 201);
        second.assert_problem(409, "key-in-use");
        assert_eq!(second.header("retry-after"), Some("2"));
        let third = s.post("/effect", Some("k1"), &body).await;
        assert!(third.replayed());
        assert_eq!(third.body, first.body);
    })
    .await;
}

/// Invariant 6: a raw COMMIT inside the handler is refused before anything commits (the
/// handler's statement fails, its `Err` answers), a raw ROLLBACK is caught (500), and
/// neither leaves a key row behind, half-written or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_commit_in_the_handler_is_refused_and_a_rollback_caught() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        for (key, statement) in [
            ("k1", "COMMIT"),
            ("k2", "ROLLBACK"),
            ("k3", "COMMIT; BEGIN"),
        ] {
            for _ in 0..2 {
                let a = s.post("/escape", Some(key), &note(statement)).await;
                if statement == "ROLLBACK" {
                    a.assert_problem(500, "transaction-escaped");
                } else {
                    assert_eq!(a.status, 500, "{statement}: the handler's Err");
                    let detail = a.json()["detail"].as_str().unwrap_or_default().to_owned();
                    assert!(
                        detail.contains("idem refused this COMMIT"),
                        "{statement}: the refusal says why: {detail}"
                    );
                }
                assert_eq!(
                    s.keys().await,
                    0,
                    "{statement}: no key row, complete or not"
                );
            }
        }
        // The COMMITs were refused with the writes before them; the ROLLBACK took its
        // write back. Nothing escaped.
        assert_eq!(s.count("effects").await, 0, "no write committed");
    })
    .await;
}

/// Regression: a fresh claim must not answer 409 because its short lock_timeout expired
/// on a lock unrelated to its key (found by the load benchmark: relation-extension locks
/// of concurrent inserts gave 2 spurious 409s in 11 000 fresh requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passing_unrelated_lock_does_not_make_a_fresh_key_409() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        // Stand-in for an extension lock: a lock the insert itself takes (in a BEFORE
        // trigger, so after the claim has set its 1 ms lock_timeout), held elsewhere for
        // 15 ms: longer than the claim's wait, shorter than its retries.
        sqlx::raw_sql(
            "CREATE FUNCTION passing_lock() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN PERFORM pg_advisory_xact_lock_shared(42); RETURN NEW; END $$; \
             CREATE TRIGGER passing_lock BEFORE INSERT ON idempotency_keys \
               FOR EACH ROW EXECUTE FUNCTION passing_lock();",
        )
        .execute(&s.pool)
        .await
        .unwrap();
        let mut holder = s.pool.begin().await.unwrap();
        sqlx::query("SELECT pg_advisory_xact_lock(42)")
            .execute(&mut *holder)
            .await
            .unwrap();
        let body = note("x");
        let answer = released_after(
            holder,
            Duration::from_millis(15),
            s.post("/effect", Some("fresh-key"), &body),
        )
        .await;
        assert_eq!(
            answer.status,
            201,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    })
    .await;
}

/// No false 409 (issue 21): 10 000 fresh keys at 64 concurrent requests, while both the
/// business table and idem's grow (relation extension, page splits), are all stored;
/// a 409 is only ever the answer to a duplicate in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_fresh_keys_at_64_concurrent_get_no_409() {
    with_test_db(async |db| {
        let s = serve(db.pool(32).await, |b| b).await;
        let url = s.url("/effect");
        let next = std::sync::atomic::AtomicUsize::new(0);
        let workers = (0..64).map(|_| async {
            let mut statuses = Vec::new();
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= 10_000 {
                    return statuses;
                }
                let request = s
                    .client
                    .post(&url)
                    .header("idempotency-key", format!("fresh-{n}"))
                    .json(&note(&format!("n{n}")));
                statuses.push(send(request).await.status);
            }
        });
        let statuses: Vec<u16> = join_all(workers).await.into_iter().flatten().collect();
        let tally = idem_tests::tally(statuses);
        assert_eq!(tally.get(&201), Some(&10_000), "answers: {tally:?}");
        assert_eq!(s.count("effects").await, 10_000);
        assert_eq!(s.keys().await, 10_000);
    })
    .await;
}

/// Runs `request` while `holder` keeps its locks for `hold`, then rolls it back.
async fn released_after(
    holder: sqlx::Transaction<'static, sqlx::Postgres>,
    hold: Duration,
    request: impl std::future::Future<Output = Answer>,
) -> Answer {
    let release = async {
        tokio::time::sleep(hold).await;
        holder.rollback().await.unwrap();
    };
    let (answer, ()) = tokio::join!(request, release);
    answer
}

/// The claim's short lock_timeout is lifted before the handler runs: the handler's own
/// lock waits are not cut to the claim's millisecond.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_does_not_inherit_the_claims_lock_timeout() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        sqlx::query("INSERT INTO effects (note) VALUES ('locked')")
            .execute(&s.pool)
            .await
            .unwrap();
        let mut holder = s.pool.begin().await.unwrap();
        sqlx::query("SELECT id FROM effects WHERE note = 'locked' FOR UPDATE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let body = note("locked");
        let answer = released_after(
            holder,
            Duration::from_millis(300),
            s.post("/locks", Some("k1"), &body),
        )
        .await;
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    })
    .await;
}

/// The session's own lock_timeout (here set per connection) is what the handler sees,
/// after a fresh claim and after a reclaim of an expired key alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_keeps_the_sessions_own_lock_timeout() {
    with_test_db(async |db| {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(conn, "SET lock_timeout = '250ms'").await?;
                    Ok(())
                })
            })
            .connect_with(db.options.clone())
            .await
            .unwrap();
        let s = serve(pool, |b| b).await;
        let fresh = s.post("/timeouts", Some("k1"), &json!(null)).await;
        assert_eq!(fresh.body, b"250ms");
        sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
            .execute(&s.pool)
            .await
            .unwrap();
        let reclaimed = s.post("/timeouts", Some("k1"), &json!(null)).await;
        assert!(!reclaimed.replayed());
        assert_eq!(reclaimed.body, b"250ms");
    })
    .await;
}

/// 503: the handler never runs without a claim, and the answer comes quickly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_answers_503_quickly() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        let s = serve(pool, |b| b).await;
        // A second store on a pool that can never connect.
        let dead = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(500))
            .connect_lazy_with(idem_tests::admin_options().port(1));
        let app = Router::new()
            .route("/effect", post(effect))
            .with_state(AppState {
                idempotency: Store::builder(dead.clone())
                    .retry_after(Duration::from_secs(3))
                    .build()
                    .unwrap(),
                pool: dead.clone(),
            });
        let server = TestApp::serve(dead, app).await;
        let started = Instant::now();
        let a = send(
            s.client
                .post(server.url("/effect"))
                .header("Idempotency-Key", "k1")
                .json(&note("x")),
        )
        .await;
        a.assert_problem(503, "unavailable");
        assert_eq!(a.header("retry-after"), Some("3"));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "took {:?}",
            started.elapsed()
        );
    })
    .await;
}

/// 503 when the connection dies under the handler and its `Err` is the only symptom;
/// and the service recovers by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_mid_handler_answers_503_and_the_service_recovers() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        let body = json!({ "note": "n", "sleep_ms": 10_000 });
        let request = s.post("/sleepy", Some("k1"), &body);
        let kill = async {
            let admin = db.pool(1).await;
            let sql = "SELECT count(*) FROM pg_stat_activity \
                       WHERE query LIKE 'SELECT pg_sleep%' AND pid <> pg_backend_pid()";
            for _ in 0..500 {
                let n: i64 = sqlx::query_scalar(sql).fetch_one(&admin).await.unwrap();
                if n > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE query LIKE 'SELECT pg_sleep%' AND pid <> pg_backend_pid()",
            )
            .execute(&admin)
            .await
            .unwrap();
        };
        let (answer, ()) = tokio::join!(request, kill);
        answer.assert_problem(503, "unavailable");
        assert!(answer.header("retry-after").is_some());
        assert_eq!((s.count("effects").await, s.keys().await), (0, 0));

        let retry = s
            .post(
                "/sleepy",
                Some("k1"),
                &json!({ "note": "n", "sleep_ms": 1 }),
            )
            .await;
        assert_eq!(
            retry.status,
            201,
            "{}",
            String::from_utf8_lossy(&retry.body)
        );
    })
    .await;
}

/// The handler can read its key and derive a stable key for a downstream API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_reads_its_key_and_derives_downstream_keys() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        let a = s
            .post("/echo", Some("\"order-1\""), &json!(null))
            .await
            .json();
        assert_eq!(a["key"], "order-1");
        let derived = a["derived"].as_str().unwrap();
        assert_eq!(derived.len(), 64);
        assert!(derived.bytes().all(|b| b.is_ascii_hexdigit()));
        // Another key derives another downstream key; a retry replays the same.
        let b = s.post("/echo", Some("order-2"), &json!(null)).await.json();
        assert_ne!(b["derived"], a["derived"]);
        let replay = s.post("/echo", Some("order-1"), &json!(null)).await;
        assert!(replay.replayed());
        assert_eq!(replay.json(), a);
    })
    .await;
}

/// A handler without `Tx` and with a plain return type: the key still commits, replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_without_tx_is_idempotent_too() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        let a = s.post("/plain", Some("k1"), &note("world")).await;
        assert_eq!(
            (a.status, a.body.as_slice()),
            (200, b"hello world".as_slice())
        );
        let b = s.post("/plain", Some("k1"), &note("world")).await;
        assert!(b.replayed());
        assert_eq!(b.body, a.body);
        // No `fields`: the whole body is the fingerprint.
        s.post(
            "/plain",
            Some("k1"),
            &json!({ "note": "world", "sleep_ms": 1 }),
        )
        .await
        .assert_problem(422, "key-reused");
        let ttl: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM expires_at - created_at)::float8 FROM idempotency_keys",
        )
        .fetch_one(&s.pool)
        .await
        .unwrap();
        // Counted from the commit: the claim's time plus the handler's.
        assert!((90.0..90.0 + 10.0).contains(&ttl), "{ttl} s");
    })
    .await;
}

/// `principal = Tenant` keys requests per tenant; the extractor's rejection is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_principal_separates_tenants() {
    with_test_db(async |db| {
        let s = start(db, |b| b).await;
        let a = s
            .post_with("/tenants", Some("k1"), &note("a"), &[("x-tenant", "t1")])
            .await;
        let b = s
            .post_with("/tenants", Some("k1"), &note("b"), &[("x-tenant", "t2")])
            .await;
        assert_eq!((a.status, b.status), (200, 200));
        assert!(!b.replayed());
        assert_eq!(s.count("effects").await, 2);
        let principals: Vec<String> =
            sqlx::query_scalar("SELECT principal FROM idempotency_keys ORDER BY principal")
                .fetch_all(&s.pool)
                .await
                .unwrap();
        assert_eq!(principals, ["t1", "t2"]);
        s.post("/tenants", Some("k1"), &note("a"))
            .await
            .assert_problem(401, "no-tenant");
    })
    .await;
}

/// Table creation is safe when several processes start at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_all_succeed() {
    with_test_db(async |db| {
        let pools = join_all((0..8).map(|_| db.pool(1))).await;
        let results = join_all(
            pools
                .iter()
                .map(|p| async move { Store::new(p.clone()).migrate().await }),
        )
        .await;
        for r in results {
            r.expect("every concurrent migrate succeeds");
        }
        assert_eq!(count(&pools[0], "idempotency_keys").await, 0);
        let charges = join_all(pools.iter().map(charges::migrate)).await;
        for r in charges {
            r.expect("the example's migrate too");
        }
    })
    .await;
}
