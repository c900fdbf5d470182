//! Issue 19, the review's holes, where they show over HTTP: a final 4xx answered after
//! a failed statement (item 6), and principals that equal "no principal" (item 7). The
//! engine-level items are tested in `idem-runtime/src/engine/tests.rs`, the compile errors in
//! `ui/fail`.

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::schema::PrincipalType;
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A store's settings beyond the defaults.
type Configure = fn(idem::StoreBuilder) -> idem::StoreBuilder;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

#[derive(Deserialize, Serialize)]
struct Signup {
    email: String,
}

/// Inserts the address; a taken one is a deliberate, final 409, as the docs advise.
#[idempotent(scope = "signups", fields = [email])]
async fn signup(mut tx: Tx, Json(signup): Json<Signup>) -> (StatusCode, Json<Value>) {
    let inserted = sqlx::query("INSERT INTO emails (address) VALUES ($1)")
        .bind(&signup.email)
        .execute(&mut *tx)
        .await;
    match inserted {
        Ok(_) => (StatusCode::CREATED, Json(json!({ "email": signup.email }))),
        Err(_) => (StatusCode::CONFLICT, Json(json!({ "error": "taken" }))),
    }
}

/// Writes, then ignores a failed statement and answers a success.
#[idempotent(scope = "lenient", fields = [email])]
async fn lenient(tx: Tx, body: Json<Signup>) -> (StatusCode, Json<Value>) {
    lenient_body(tx, body).await
}

/// The same without a key: `required = false`.
#[idempotent(scope = "lenient_optional", fields = [email], required = false)]
async fn lenient_optional(tx: Tx, body: Json<Signup>) -> (StatusCode, Json<Value>) {
    lenient_body(tx, body).await
}

/// What both lenient endpoints do: write, then ignore a failed statement and answer a
/// success.
async fn lenient_body(mut tx: Tx<'_>, Json(signup): Json<Signup>) -> (StatusCode, Json<Value>) {
    sqlx::query("INSERT INTO audit (note) VALUES ('lenient')")
        .execute(&mut *tx)
        .await
        .expect("audit");
    let _ignored = sqlx::query("INSERT INTO emails (address) VALUES ($1)")
        .bind(&signup.email)
        .execute(&mut *tx)
        .await;
    (StatusCode::OK, Json(json!({ "email": signup.email })))
}

async fn start(db: &TestDb) -> TestApp {
    let pool = db.pool(5).await;
    sqlx::raw_sql(
        "CREATE TABLE emails (address text PRIMARY KEY); CREATE TABLE audit (note text);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    let app = Router::new()
        .route("/signups", post(signup))
        .route("/lenient", post(lenient))
        .route("/lenient_optional", post(lenient_optional))
        .with_state(AppState { idempotency: store });
    TestApp::serve(pool, app).await
}

/// Item 6: a handler that catches a unique violation and answers `Ok(409)` left the
/// transaction aborted; storing the answer failed with 25P02, and every retry of the key
/// answered 500 for ever. The rejection is now stored alone and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_4xx_after_a_failed_statement_is_stored_and_replayed() {
    with_test_db(async |db| {
        let s = start(db).await;
        let taken = json!({ "email": "a@example.com" });
        let first = s.post("/signups", Some("k1"), &taken).await;
        assert_eq!((first.status, first.replayed()), (201, false));

        let conflict = s.post("/signups", Some("k2"), &taken).await;
        assert_eq!(
            conflict.status,
            409,
            "{}",
            String::from_utf8_lossy(&conflict.body)
        );
        assert_eq!(conflict.json(), json!({ "error": "taken" }));
        assert!(!conflict.replayed());
        for _ in 0..3 {
            let retry = s.post("/signups", Some("k2"), &taken).await;
            assert_eq!((retry.status, retry.replayed()), (409, true));
            assert_eq!(retry.body, conflict.body);
        }
        assert_eq!(s.count("emails").await, 1);
        assert_eq!(s.keys().await, 2);
    })
    .await;
}

/// Item 6, the other half: a success answered after a failed statement would claim
/// writes that PostgreSQL rolled back. It is a 500 with its own type; nothing is
/// stored, so the key stays retryable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_after_a_failed_statement_is_refused_and_retryable() {
    with_test_db(async |db| {
        let s = start(db).await;
        let taken = json!({ "email": "a@example.com" });
        s.post("/signups", Some("k1"), &taken).await;
        for _ in 0..2 {
            s.post("/lenient", Some("k2"), &taken)
                .await
                .assert_problem(500, "transaction-aborted");
        }
        assert_eq!(s.count("audit").await, 0, "the writes before the failure");
        assert_eq!(s.keys().await, 1, "only k1's record");
        // Once the address is free, the same key runs and succeeds.
        sqlx::query("DELETE FROM emails")
            .execute(&s.pool)
            .await
            .unwrap();
        let answer = s.post("/lenient", Some("k2"), &taken).await;
        assert_eq!((answer.status, answer.replayed()), (200, false));
        assert_eq!(s.count("audit").await, 1);
    })
    .await;
}

/// The same without a key (`required = false`): PostgreSQL answers the COMMIT of the
/// aborted transaction with a silent ROLLBACK, so the success was untrue; it is the same
/// 500. Without a failed statement the request commits and says it was not recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_after_a_failed_statement_without_a_key_is_refused() {
    with_test_db(async |db| {
        let s = start(db).await;
        let taken = json!({ "email": "a@example.com" });
        s.post("/signups", Some("k1"), &taken).await;
        s.post("/lenient_optional", None, &taken)
            .await
            .assert_problem(500, "transaction-aborted");
        assert_eq!(s.count("audit").await, 0);
        let free = json!({ "email": "b@example.com" });
        let answer = s.post("/lenient_optional", None, &free).await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("idempotent-recorded"), Some("false"));
        assert_eq!(s.count("audit").await, 1);
        assert_eq!(s.count("emails").await, 2);
        assert_eq!(s.keys().await, 1, "only k1's record");
    })
    .await;
}

#[idempotent(scope = "notes")]
async fn note(mut tx: Tx, Json(v): Json<Value>) -> (StatusCode, Json<Value>) {
    sqlx::query("INSERT INTO audit (note) VALUES ($1)")
        .bind(v.to_string())
        .execute(&mut *tx)
        .await
        .expect("audit");
    (StatusCode::CREATED, Json(v))
}

/// The `/notes` endpoint on a store whose principal is the `X-Tenant` header, as given.
async fn tenants(db: &TestDb, table: &str, configure: Configure) -> TestApp {
    let pool = db.pool(5).await;
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS audit (note text)")
        .execute(&pool)
        .await
        .unwrap();
    let builder = Store::builder(pool.clone())
        .table(table)
        .principal(|parts| {
            let tenant = parts.headers.get("x-tenant")?;
            Some(tenant.to_str().ok()?.to_owned())
        });
    let store = configure(builder).build().unwrap();
    store.migrate().await.unwrap();
    let app = Router::new()
        .route("/notes", post(note))
        .with_state(AppState { idempotency: store });
    TestApp::serve(pool, app).await
}

/// Item 7: a resolver that answered `Some("")` passed strict mode and put the request
/// among the global keys, where two such tenants replayed each other's responses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_principal_is_no_principal() {
    with_test_db(async |db| {
        let strict = tenants(db, "strict_keys", |b| b.require_principal(true)).await;
        let body = json!({ "n": 1 });
        strict
            .post_with("/notes", Some("k1"), &body, &[("X-Tenant", "")])
            .await
            .assert_problem(401, "missing-principal");
        let ok = strict
            .post_with("/notes", Some("k1"), &body, &[("X-Tenant", "acct_1")])
            .await;
        assert_eq!(ok.status, 201);
        assert_eq!(strict.count("strict_keys WHERE principal = ''").await, 0);
    })
    .await;
}

/// Item 7: with a `uuid` or `bigint` principal column, keys without a principal are kept
/// under the nil UUID or 0, so a tenant whose id is that value shared their namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_principal_equals_the_value_that_keeps_global_keys() {
    with_test_db(async |db| {
        let cases: [(&str, Configure, &str, &str); 2] = [
            (
                "uuid_keys",
                |b| b.principal_type(PrincipalType::Uuid),
                "00000000-0000-0000-0000-000000000000",
                "6f1c8a52-3b7e-4a59-9a1d-2f0c5e9b7d41",
            ),
            (
                "bigint_keys",
                |b| b.principal_type(PrincipalType::Bigint),
                "0",
                "42",
            ),
        ];
        for (table, configure, none, tenant) in cases {
            let s = tenants(db, table, configure).await;
            let body = json!({ "table": table });
            // A request without a principal: a global key, kept under the zero value.
            let global = s.post("/notes", Some("k1"), &body).await;
            assert_eq!(global.status, 201);
            // A tenant whose id is the zero value must not replay it.
            s.post_with("/notes", Some("k1"), &body, &[("X-Tenant", none)])
                .await
                .assert_problem(400, "invalid-principal");
            let own = s
                .post_with("/notes", Some("k1"), &body, &[("X-Tenant", tenant)])
                .await;
            assert_eq!((own.status, own.replayed()), (201, false), "{table}");
        }
    })
    .await;
}
