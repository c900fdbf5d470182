//! Invariant 12, the same statements in every session (issue 37). Each test here failed on
//! `c696e55`:
//! - the claim rides BEGIN, so its row comes back as text in the session's formats: a
//!   database whose `bytea_output` is `escape` answered every retry 500 and could not
//!   resume a recorded step; one whose `extra_float_digits` is 0 (or a handler that set it
//!   on its connection) answered later keyed requests 500 `transaction-escaped`;
//! - a step's result is written into a statement's text: a `SQL_ASCII` database refused
//!   its non-ASCII characters, a `LATIN1` one those it has not, and every retry called
//!   again;
//! - a handler's `SET LOCAL search_path` moved the key row that the COMMIT message wrote:
//!   it could never commit, or committed where no retry looked.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, with_test_db_encoded, TestApp};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    calls: Arc<AtomicUsize>,
}

#[derive(Debug, Deserialize, Serialize)]
struct Note {
    text: String,
    /// Answer 503 after the step: the transaction rolls back, the step stays recorded.
    #[serde(default)]
    fail: bool,
    /// `SET extra_float_digits = 0` on the request's connection, session-wide, as a
    /// handler may.
    #[serde(default)]
    round_floats: bool,
    /// Echoed by the step's result: what the database stores as the step's record.
    #[serde(default)]
    says: String,
    /// After the business write, `SET LOCAL search_path` to this schema, as a handler of
    /// a service with a schema per tenant may.
    #[serde(default)]
    tenant: Option<String>,
    /// The same, session-wide (`SET search_path`): it stays on the connection.
    #[serde(default)]
    session_tenant: Option<String>,
    /// `SET default_transaction_read_only = on`, session-wide: the connection's later
    /// transactions are read-only.
    #[serde(default)]
    read_only: bool,
}

/// A step (the outside call, counted), then a business write.
#[idempotent(scope = "notes", fields = [text])]
async fn note(
    State(calls): State<Arc<AtomicUsize>>,
    mut tx: Tx,
    Json(note): Json<Note>,
) -> Result<(StatusCode, Json<Value>), (StatusCode, String)> {
    let failed = |e: sqlx::Error| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    if note.round_floats {
        sqlx::query("SET extra_float_digits = 0")
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
    }
    let says = note.says.clone();
    let (call, says): (usize, String) = tx
        .step("processor", |_key| async move {
            Ok::<_, String>((calls.fetch_add(1, Ordering::SeqCst) + 1, says))
        })
        .await
        .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
    sqlx::query("INSERT INTO notes (text) VALUES ($1)")
        .bind(&note.text)
        .persistent(false)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    for (set, schema) in [("SET LOCAL", &note.tenant), ("SET", &note.session_tenant)] {
        if let Some(schema) = schema {
            sqlx::query(AssertSqlSafe(format!("{set} search_path = {schema}")))
                .persistent(false)
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
        }
    }
    if note.read_only {
        sqlx::query("SET default_transaction_read_only = on")
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
    }
    if note.fail {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            "failed after the step".into(),
        ));
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "text": note.text, "call": call, "says": says })),
    ))
}

/// The endpoint on `pool`, and the count of its outside calls.
async fn start(pool: PgPool) -> (TestApp, Arc<AtomicUsize>) {
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS notes (id bigserial PRIMARY KEY, text text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/notes", post(note))
        .with_state(AppState {
            idempotency: store,
            calls: Arc::clone(&calls),
        });
    (TestApp::serve(pool, app).await, calls)
}

/// Fresh, then replayed byte for byte; a request that failed after its step resumes
/// after it on its retry, without calling again.
async fn keeps_the_contract(app: &TestApp, calls: &AtomicUsize, tag: &str) {
    let key = format!("{tag}-done");
    let first = app
        .post("/notes", Some(&key), &json!({ "text": tag }))
        .await;
    assert_eq!(
        first.status,
        201,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let retry = app
        .post("/notes", Some(&key), &json!({ "text": tag }))
        .await;
    assert_eq!(
        retry.status,
        201,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);

    let key = format!("{tag}-resumed");
    let before = calls.load(Ordering::SeqCst);
    let failed = app
        .post("/notes", Some(&key), &json!({ "text": tag, "fail": true }))
        .await;
    failed.assert_status(503);
    let resumed = app
        .post("/notes", Some(&key), &json!({ "text": tag }))
        .await;
    resumed.assert_status(201);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        before + 1,
        "the retry resumed after the recorded step"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_writes_bytea_as_escapes() {
    with_test_db(async |db| {
        db.set_default("bytea_output", "escape").await;
        let (app, calls) = start(db.pool(4).await).await;
        keeps_the_contract(&app, &calls, "escape").await;
        assert_eq!(app.count("notes").await, 2);
    })
    .await;
}

/// sqlx sends `extra_float_digits = 2` when it connects unless told not to (as its docs
/// advise behind some poolers): then the database's setting holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_rounds_floats() {
    with_test_db(async |db| {
        db.set_default("extra_float_digits", "0").await;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(db.options.clone().extra_float_digits(None))
            .await
            .unwrap();
        let digits: String = sqlx::query_scalar("SHOW extra_float_digits")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(digits, "0");
        let (app, calls) = start(pool).await;
        for n in 0..5 {
            keeps_the_contract(&app, &calls, &format!("rounded{n}")).await;
        }
    })
    .await;
}

/// A handler that rounds floats on its connection, session-wide: every later request on
/// that connection (one, here) keeps the contract.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_rounds_floats_on_its_connection() {
    with_test_db(async |db| {
        let (app, calls) = start(db.pool(1).await).await;
        let first = app
            .post(
                "/notes",
                Some("rounds"),
                &json!({ "text": "r", "round_floats": true }),
            )
            .await;
        assert_eq!(
            first.status,
            201,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        for n in 0..5 {
            keeps_the_contract(&app, &calls, &format!("after{n}")).await;
        }
    })
    .await;
}

/// A step's result with characters outside ASCII is recorded, and a retry resumes after
/// it, in a database of each server encoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_records_any_character_in_any_server_encoding() {
    for encoding in ["SQL_ASCII", "LATIN1", "UTF8"] {
        with_test_db_encoded(encoding, async |db| {
            let (app, calls) = start(db.pool(4).await).await;
            let says = "Zo\u{eb} paid \u{20ac}5 \u{1f600}";
            let body = json!({ "text": "t", "says": says, "fail": true });
            app.post("/notes", Some("k"), &body)
                .await
                .assert_status(503);
            let resumed = app
                .post("/notes", Some("k"), &json!({ "text": "t", "says": says }))
                .await;
            resumed.assert_status(201);
            assert_eq!(resumed.json()["says"], says, "{encoding}");
            assert_eq!(calls.load(Ordering::SeqCst), 1, "{encoding}: called again");
        })
        .await;
    }
}

/// idem's tables, in the schema `schema`.
async fn tables_in(pool: &PgPool, schema: &str) {
    Store::builder(pool.clone())
        .table(format!("{schema}.idempotency_keys"))
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
}

/// A handler that moves `search_path` for the rest of its transaction: the key row still
/// lands in the store's table, and its retries replay; with idem's tables in the other
/// schema too (a schema per tenant), as without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_sets_its_search_path() {
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        sqlx::query("CREATE SCHEMA tenant2")
            .execute(&pool)
            .await
            .unwrap();
        let (app, _) = start(pool.clone()).await;
        for (key, tenant_tables) in [("without", false), ("with", true)] {
            if tenant_tables {
                tables_in(&pool, "tenant2").await;
            }
            let body = json!({ "text": key, "tenant": "tenant2" });
            let first = app.post("/notes", Some(key), &body).await;
            first.assert_status(201);
            let retry = app.post("/notes", Some(key), &body).await;
            retry.assert_status(201);
            assert!(retry.replayed(), "{key}");
            assert_eq!(retry.body, first.body);
        }
        assert_eq!(app.count("public.idempotency_keys").await, 2);
        assert_eq!(app.count("tenant2.idempotency_keys").await, 0);
    })
    .await;
}

/// A handler that moves `search_path` on its connection, session-wide: its own request
/// commits where the store's first claim resolved the tables; a later claim on that
/// connection is refused, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_moves_its_connections_search_path() {
    with_test_db(async |db| {
        let pool = db.pool(1).await;
        sqlx::query("CREATE SCHEMA tenant2")
            .execute(&pool)
            .await
            .unwrap();
        let (app, calls) = start(pool.clone()).await;
        tables_in(&pool, "tenant2").await;
        let body = json!({ "text": "moves", "session_tenant": "tenant2" });
        app.post("/notes", Some("moves"), &body)
            .await
            .assert_status(201);
        let later = app
            .post("/notes", Some("later"), &json!({ "text": "later" }))
            .await;
        later.assert_status(500);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the refused request ran");
        assert_eq!(app.count("public.idempotency_keys").await, 1);
        assert_eq!(app.count("tenant2.idempotency_keys").await, 0);
    })
    .await;
}

/// A handler that makes its connection's later transactions read-only: a stored answer
/// still replays (that writes nothing), and a fresh request is refused before its
/// handler runs (500, nothing written, no outside call), with one logged line that names
/// the setting. It failed after the outside call before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_makes_its_connection_read_only() {
    with_test_db(async |db| {
        let (app, calls) = start(db.pool(1).await).await;
        let body = json!({ "text": "frozen", "read_only": true });
        let first = app.post("/notes", Some("frozen"), &body).await;
        first.assert_status(201);
        let retry = app.post("/notes", Some("frozen"), &body).await;
        retry.assert_status(201);
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        let later = app
            .post("/notes", Some("later"), &json!({ "text": "later" }))
            .await;
        later.assert_status(500);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the refused request ran");
        assert_eq!(app.count("idempotency_keys").await, 1);
        assert_eq!(app.count("notes").await, 1);
    })
    .await;
}

/// A step pool of its own (`StoreBuilder::step_pool`), connecting as a role that may not
/// write the steps table, is refused at start with one line that names the role and the
/// table: its first step would have called out, then failed to record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_pool_whose_role_may_not_record_steps_is_refused_at_start() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        Store::new(pool.clone()).migrate().await.unwrap();
        let role = format!("{}_steps", db.name);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE ROLE {role} LOGIN; GRANT SELECT ON idempotency_steps TO {role}"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let steps = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(db.options.clone().username(&role))
            .await
            .unwrap();
        let store = Store::builder(pool.clone())
            .step_pool(steps.clone())
            .build()
            .unwrap();
        let refused = store.verify().await.expect_err("a refusal").to_string();
        steps.close().await;
        assert!(
            refused.contains(&role)
                && refused.contains("INSERT, UPDATE, DELETE on \"idempotency_steps\"")
                && !refused.contains("idempotency_keys"),
            "{refused}"
        );
        assert!(Store::new(pool.clone()).verify().await.is_ok());
        sqlx::raw_sql(AssertSqlSafe(format!(
            "REVOKE ALL ON idempotency_steps FROM {role}; DROP ROLE {role}"
        )))
        .execute(&pool)
        .await
        .unwrap();
    })
    .await;
}
