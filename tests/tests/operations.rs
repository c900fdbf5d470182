//! Running idem in production: expiry, configuration and inspection, against a real
//! PostgreSQL over real HTTP.

use std::time::{Duration, Instant, SystemTime};

use axum::extract::FromRef;
use axum::http::{HeaderName, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, StoreBuilder, Tx};
use idem_tests::{percentiles, send, with_test_db, TestApp, TestDb};
use serde_json::{json, Value};
use sqlx::{AssertSqlSafe, PgPool};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

/// Writes one row, answers 201 with a custom header beside the usual ones.
#[idempotent(scope = "notes")]
async fn create_note(
    mut tx: Tx,
    Json(note): Json<Value>,
) -> Result<(StatusCode, [(HeaderName, String); 2], Json<Value>), String> {
    let id: i64 = sqlx::query_scalar("INSERT INTO notes (body) VALUES ($1) RETURNING id")
        .bind(note.to_string())
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    let headers = [
        (HeaderName::from_static("x-note-version"), "7".to_owned()),
        (HeaderName::from_static("location"), format!("/notes/{id}")),
    ];
    Ok((StatusCode::CREATED, headers, Json(json!({ "id": id }))))
}

/// The same, for gradual rollout: a key is welcome but not required.
#[idempotent(scope = "optional", required = false)]
async fn optional_key(
    mut tx: Tx,
    Json(note): Json<Value>,
) -> Result<(StatusCode, Json<Value>), String> {
    let id: i64 = sqlx::query_scalar("INSERT INTO notes (body) VALUES ($1) RETURNING id")
        .bind(note.to_string())
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": id, "key": tx.idempotency_key() })),
    ))
}

/// This file's handlers on `db`, and the store they use, configured by `configure`.
async fn start(
    db: &TestDb,
    configure: impl FnOnce(StoreBuilder) -> StoreBuilder,
) -> (TestApp, Store) {
    let pool = db.pool(10).await;
    sqlx::raw_sql("CREATE TABLE notes (id bigserial PRIMARY KEY, body text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = configure(Store::builder(pool.clone())).build().unwrap();
    store.migrate().await.unwrap();
    let app = Router::new()
        .route("/notes", post(create_note))
        .route("/optional", post(optional_key))
        .with_state(AppState {
            idempotency: store.clone(),
        });
    (TestApp::serve(pool, app).await, store)
}

/// Fills the table with `expired` expired rows and `live` live ones, as fast as
/// PostgreSQL can write them.
async fn backlog(pool: &PgPool, table: &str, expired: i64, live: i64) {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, principal, key, fingerprint, field_hashes, status, headers, body, created_at, expires_at) \
         SELECT 'backlog', 'p', 'k' || g, '\\x00', '\\x00', 201, '', 'x', now() - interval '2 days', \
                CASE WHEN g <= $1 THEN now() - interval '1 day' - g * interval '1 millisecond' ELSE now() + interval '1 day' END \
           FROM generate_series(1, $1 + $2) AS g"
    )))
    .bind(expired)
    .bind(live)
    .execute(pool)
    .await
    .unwrap();
}

/// Expiry: a large backlog of expired rows is removed in small batches while live
/// requests go on; live records stay. Prints live latency before and during the sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_expired_rows_is_swept_while_requests_go_on() {
    with_test_db(async |db| {
        const EXPIRED: i64 = 200_000;
        let (s, store) = start(db, |b| b).await;
        backlog(&s.pool, "idempotency_keys", EXPIRED, 1_000).await;

        let measure = |label: &'static str, n: usize| {
            let s = &s;
            async move {
                let mut latencies = Vec::with_capacity(n);
                for i in 0..n {
                    let started = Instant::now();
                    let a = s
                        .post("/notes", Some(&format!("{label}-{i}")), &json!({ "i": i }))
                        .await;
                    latencies.push(started.elapsed());
                    assert_eq!(a.status, 201);
                }
                percentiles(&mut latencies)
            }
        };
        let (before_p50, before_p99) = measure("before", 200).await;

        let sweeper = store
            .spawn_sweeper(Duration::from_millis(10), 1_000)
            .unwrap();
        let started = Instant::now();
        let during = async {
            let mut rounds = Vec::new();
            // Requests while the backlog is being deleted.
            while s.count("idempotency_keys WHERE expires_at <= now()").await > 0 {
                rounds.push(measure("during", 20).await);
            }
            rounds
        };
        let rounds = during.await;
        let swept_in = started.elapsed();
        // The sweeper's count catches up once its current purge call returns.
        for _ in 0..500 {
            if sweeper.removed() >= EXPIRED as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        sweeper.stop();
        assert_eq!(
            sweeper.removed(),
            EXPIRED as u64,
            "the sweeper reports what it removed"
        );
        assert_eq!(
            s.count("idempotency_keys WHERE scope = 'backlog'").await,
            1_000,
            "live rows stay"
        );

        let worst_p50 = rounds.iter().map(|r| r.0).fold(0.0, f64::max);
        let worst_p99 = rounds.iter().map(|r| r.1).fold(0.0, f64::max);
        println!(
            "sweep of {EXPIRED} expired rows in batches of 1000: {:.2}s ({:.0} rows/s); \
             live request latency before p50 {before_p50:.2} ms p99 {before_p99:.2} ms, \
             during (worst of {} rounds) p50 {worst_p50:.2} ms p99 {worst_p99:.2} ms",
            swept_in.as_secs_f64(),
            EXPIRED as f64 / swept_in.as_secs_f64(),
            rounds.len()
        );

        // A replay of a key written before the sweep still works: live records are intact.
        let replay = s.post("/notes", Some("before-3"), &json!({ "i": 3 })).await;
        assert!(replay.replayed());
    })
    .await;
}

/// Expiry for cron: one call, reporting how many rows it removed; nothing live goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_reports_what_it_removed() {
    with_test_db(async |db| {
        let (s, store) = start(db, |b| b).await;
        backlog(&s.pool, "idempotency_keys", 2_500, 10).await;
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(1_000)
                .await
                .unwrap(),
            2_500
        );
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(1_000)
                .await
                .unwrap(),
            0
        );
        assert_eq!(s.count("idempotency_keys").await, 10);
    })
    .await;
}

/// Expiry never takes a row a request is reclaiming, and never waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_skips_a_row_being_reclaimed() {
    with_test_db(async |db| {
        let (s, store) = start(db, |b| b).await;
        backlog(&s.pool, "idempotency_keys", 3, 0).await;
        // A request in flight has locked one expired row (as a reclaim does).
        let mut reclaiming = s.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = 'k1' FOR UPDATE")
            .execute(&mut *reclaiming)
            .await
            .unwrap();
        let started = Instant::now();
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(10)
                .await
                .unwrap(),
            2
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "purge did not wait for the lock"
        );
        reclaiming.rollback().await.unwrap();
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(10)
                .await
                .unwrap(),
            1
        );
    })
    .await;
}

/// Configuration: another schema and table name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_can_live_elsewhere() {
    with_test_db(async |db| {
        let (s, store) = start(db, |b| b.table("ops.idem_records")).await;
        assert!(store.schema().keys_sql.contains("\"ops\".\"idem_records\""));
        let first = s.post("/notes", Some("k1"), &json!(1)).await;
        let replay = s.post("/notes", Some("k1"), &json!(1)).await;
        assert_eq!(replay.body, first.body);
        assert_eq!(s.count("ops.idem_records").await, 1);
        let default_exists: bool =
            sqlx::query_scalar("SELECT to_regclass('idempotency_keys') IS NOT NULL")
                .fetch_one(&s.pool)
                .await
                .unwrap();
        assert!(!default_exists);
        // The sweeper and the inspection use it too.
        backlog(&s.pool, "ops.idem_records", 5, 0).await;
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(2)
                .await
                .unwrap(),
            5
        );
        assert!(store.inspect("notes", "", "k1").await.unwrap().is_some());
        // A name that would need quoting is refused up front.
        assert!(Store::builder(s.pool.clone())
            .table("Ops.Keys; --")
            .build()
            .is_err());
    })
    .await;
}

/// Configuration: the replayed-header allow-list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replayed_headers_are_an_allow_list() {
    // Three configurations, each with a database of its own.
    with_test_db(async |db| {
        let (by_default, _) = start(db, |b| b).await;
        by_default.post("/notes", Some("k1"), &json!(1)).await;
        let replay = by_default.post("/notes", Some("k1"), &json!(1)).await;
        assert!(replay.replayed());
        assert_eq!(replay.header("location"), Some("/notes/1"));
        assert_eq!(replay.header("content-type"), Some("application/json"));
        assert_eq!(
            replay.header("x-note-version"),
            None,
            "not on the default list"
        );
    })
    .await;
    with_test_db(async |db| {
        let (extended, _) = start(db, |b| {
            b.replay_header(HeaderName::from_static("x-note-version"))
        })
        .await;
        let first = extended.post("/notes", Some("k1"), &json!(1)).await;
        assert_eq!(first.header("x-note-version"), Some("7"));
        let replay = extended.post("/notes", Some("k1"), &json!(1)).await;
        assert_eq!(replay.header("x-note-version"), Some("7"));
    })
    .await;
    with_test_db(async |db| {
        let (only_type, _) = start(db, |b| {
            b.replay_headers([HeaderName::from_static("content-type")])
        })
        .await;
        only_type.post("/notes", Some("k1"), &json!(1)).await;
        let replay = only_type.post("/notes", Some("k1"), &json!(1)).await;
        assert_eq!(replay.header("content-type"), Some("application/json"));
        assert_eq!(replay.header("location"), None);
    })
    .await;
}

/// Configuration: `required = false` lets clients without a key through, unrecorded,
/// and says so; clients with a key get the full guarantee.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_optional_key_runs_unrecorded_without_one() {
    with_test_db(async |db| {
        let (s, _) = start(db, |b| b).await;
        let a = s.post("/optional", None, &json!("a")).await;
        let b = s.post("/optional", None, &json!("a")).await;
        assert_eq!((a.status, b.status), (201, 201));
        assert_eq!(a.header("idempotent-recorded"), Some("false"));
        assert!(!b.replayed());
        assert_eq!(a.json()["key"], Value::Null);
        assert_eq!(s.count("notes").await, 2, "both ran and committed");
        assert_eq!(s.count("idempotency_keys").await, 0);

        let keyed = s.post("/optional", Some("k1"), &json!("a")).await;
        assert_eq!(keyed.header("idempotent-recorded"), None);
        assert_eq!(keyed.json()["key"], "k1");
        assert!(s
            .post("/optional", Some("k1"), &json!("a"))
            .await
            .replayed());
        // A malformed key is still refused: optional is not anything-goes.
        s.post("/optional", Some("a b"), &json!("a"))
            .await
            .assert_problem(400, "malformed-key");
        // And the required endpoint still requires one.
        s.post("/notes", None, &json!("a"))
            .await
            .assert_problem(400, "missing-key");
    })
    .await;
}

/// Configuration: the base of idem's problem `type` URIs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn problem_types_use_the_configured_base() {
    with_test_db(async |db| {
        let (s, _) = start(db, |b| b.problem_base("https://api.example.com/problems/")).await;
        let missing = s.post("/notes", None, &json!(1)).await;
        assert_eq!(
            missing.json()["type"],
            "https://api.example.com/problems/missing-key"
        );
        s.post("/notes", Some("k1"), &json!(1)).await;
        let reused = s.post("/notes", Some("k1"), &json!(2)).await;
        assert_eq!(
            reused.json()["type"],
            "https://api.example.com/problems/key-reused"
        );
        let bad_body = send(
            s.client
                .post(s.url("/notes"))
                .header("Idempotency-Key", "k2")
                .header("content-type", "application/json")
                .body("{"),
        )
        .await;
        assert_eq!(
            bad_body.json()["type"],
            "https://api.example.com/problems/invalid-request"
        );
    })
    .await;
}

/// Inspection: did key K of principal P in scope S run, when, and with what status?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_can_inspect_a_key() {
    with_test_db(async |db| {
        let (s, store) = start(db, |b| b).await;
        let before = SystemTime::now() - Duration::from_secs(5);
        s.post("/notes", Some("\"order-7\""), &json!(1)).await;
        let record = store
            .inspect("notes", "", "order-7")
            .await
            .unwrap()
            .expect("a record");
        assert_eq!(record.status, StatusCode::CREATED);
        assert!(!record.expired);
        assert!(
            record.created_at >= before
                && record.created_at <= SystemTime::now() + Duration::from_secs(5)
        );
        let ttl = record.expires_at.duration_since(record.created_at).unwrap();
        // The ttl counts from the commit: the claim's time plus the handler's.
        let day = Duration::from_secs(24 * 3600);
        assert!(ttl >= day && ttl < day + Duration::from_secs(10), "{ttl:?}");
        assert_eq!(record.body_bytes, "{\"id\":1}".len());

        assert!(store
            .inspect("notes", "", "order-8")
            .await
            .unwrap()
            .is_none());
        assert!(store
            .inspect("notes", "someone-else", "order-7")
            .await
            .unwrap()
            .is_none());
        assert!(store
            .inspect("other-scope", "", "order-7")
            .await
            .unwrap()
            .is_none());
    })
    .await;
}

/// Regression: sweeps made idle keys answer 409. A purge batch holds the row locks of
/// the expired rows it deletes for as long as its statement runs, longer than a claim's
/// short wait; 145 of 600 retries of expired keys got 409 with nothing in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_never_answers_409() {
    with_test_db(async |db| {
        const EXPIRED: i64 = 60_000;
        let (s, store) = start(db, |b| b).await;
        // Expired records of this endpoint's own keys, k1 .. k60000.
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, principal, key, fingerprint, field_hashes, status, headers, body, expires_at) \
             SELECT 'notes', '', 'k' || g, '\\x00', '\\x00', 201, '', 'x', now() - interval '1 day' \
               FROM generate_series(1, $1) AS g",
        )
        .bind(EXPIRED)
        .execute(&s.pool)
        .await
        .unwrap();
        let sweep = tokio::spawn(async move { store.operate().audited(idem_tests::operator()).purge_expired(20_000).await.unwrap() });
        // Retries of those keys while the batches delete them: each is treated as new.
        let requests = (0..600).map(|i| {
            let key = format!("k{}", 1 + (i * 7919) % EXPIRED);
            let s = &s;
            async move { s.post("/notes", Some(&key), &json!(i)).await.status }
        });
        let statuses = futures::future::join_all(requests).await;
        let removed = sweep.await.unwrap();
        let counts = idem_tests::tally(statuses);
        assert_eq!(counts.get(&409), None, "answers: {counts:?}");
        assert_eq!(counts.get(&201), Some(&600), "answers: {counts:?}");
        assert!(removed >= EXPIRED as u64 - 600, "the sweep ran: {removed}");
    })
    .await;
}

/// Issue 23: the example's sweeper period and batch are settings (`SWEEP_PERIOD_SECS`,
/// `SWEEP_BATCH`): the real binary refuses a zero period in one line before it connects,
/// and with a one-second period and batches of 2 it empties expired records by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_sweeper_period_and_batch_are_settings() {
    let refusal = |name: &str, value: &str| {
        let refused = std::process::Command::new(env!("CARGO_BIN_EXE_charges-server"))
            .env(name, value)
            .env("BIND_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
            .output()
            .unwrap();
        assert!(!refused.status.success(), "{name}={value} was taken");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        stderr.lines().last().unwrap_or_default().to_owned()
    };
    assert_eq!(
        refusal("SWEEP_PERIOD_SECS", "0"),
        "charges: SWEEP_PERIOD_SECS must be at least 1: a sweep every 0 s would never pause"
    );
    // Out of range is refused, not quietly clamped.
    assert_eq!(
        refusal("SWEEP_BATCH", "0"),
        "charges: SWEEP_BATCH must be from 1 to 100000, not 0"
    );
    assert_eq!(
        refusal("SWEEP_BATCH", "100001"),
        "charges: SWEEP_BATCH must be from 1 to 100000, not 100001"
    );
    assert_eq!(
        refusal("DB_POOL_SIZE", "0"),
        "charges: DB_POOL_SIZE must be from 1 to 1000, not 0"
    );

    with_test_db(async |db| {
        let pool = db.pool(2).await;
        charges::migrate(&pool).await.unwrap();
        sqlx::query(
            "INSERT INTO idempotency_keys (scope, principal, key, fingerprint, field_hashes, \
                                           status, expires_at) \
             SELECT 'charges', 'acct', 'old-' || n, '\\x00', '\\x00', 201, \
                    now() - interval '1 hour' FROM generate_series(1, 7) AS n",
        )
        .execute(&pool)
        .await
        .unwrap();
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_charges-server"))
            .env("SWEEP_PERIOD_SECS", "1")
            .env("SWEEP_BATCH", "2")
            .env("BIND_ADDR", addr.to_string())
            .env("DATABASE_URL", db.url())
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut left = i64::MAX;
        while Instant::now() < deadline {
            left = idem_tests::count(&pool, "idempotency_keys").await;
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = server.kill();
        let _ = server.wait();
        assert_eq!(left, 0, "the sweeper emptied the expired records");
    })
    .await;
}
