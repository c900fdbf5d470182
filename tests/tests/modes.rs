//! The store's production modes on plain PostgreSQL: the portable mode (for Citus: waits
//! by `SET LOCAL`, no custom settings, a sweeper without row locks) with each principal
//! column type, and the transaction-pooler mode (unnamed statements). Each keeps the
//! contract: replay, 422 on another payload, 409 while in flight, a failure stays
//! retryable, expired records are swept; and the handler does not inherit the claim's
//! lock wait.

use std::time::Duration;

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::schema::PrincipalType;
use idem::{idempotent, Pooler, Store, StoreBuilder, Tx};
use idem_tests::{with_test_db, TestApp, TestDb};
use serde_json::{json, Value};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

/// Writes a row, reports the `lock_timeout` the handler runs with, and can sleep or fail.
#[idempotent(scope = "notes", ttl = "1h")]
async fn note(mut tx: Tx, Json(v): Json<Value>) -> Result<(StatusCode, Json<Value>), StatusCode> {
    let fail = |_| StatusCode::INTERNAL_SERVER_ERROR;
    sqlx::query("INSERT INTO notes (body) VALUES ($1)")
        .bind(v.to_string())
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let lock_timeout: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *tx)
        .await
        .map_err(fail)?;
    if let Some(ms) = v["sleep_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if v["fail"] == true {
        return Err(StatusCode::BAD_GATEWAY);
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "n": v["n"], "lock_timeout": lock_timeout })),
    ))
}

/// `configure`'s store on `db`, migrated, serving [`note`]; the principal comes from the
/// `X-Tenant` header when one is sent.
async fn start(db: &TestDb, configure: impl FnOnce(StoreBuilder) -> StoreBuilder) -> TestApp {
    let pool = db.pool(8).await;
    let builder = Store::builder(pool.clone()).principal(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    let store = configure(builder).build().expect("valid settings");
    store.migrate().await.expect("migrate");
    sqlx::raw_sql("CREATE TABLE notes (id bigserial PRIMARY KEY, body text NOT NULL)")
        .execute(&pool)
        .await
        .expect("notes table");
    let app = Router::new()
        .route("/notes", post(note))
        .with_state(AppState { idempotency: store });
    TestApp::serve(pool, app).await
}

/// The contract, as one tenant (`tenant`, or none) sees it.
async fn holds_the_contract(s: &TestApp, tenant: Option<&str>) {
    let headers: Vec<(&str, &str)> = tenant.map(|t| ("x-tenant", t)).into_iter().collect();
    let post = |key: &'static str, body: Value| {
        let headers = headers.clone();
        async move { s.post_with("/notes", Some(key), &body, &headers).await }
    };

    let fresh = post("k-1", json!({ "n": 1 })).await;
    assert_eq!(fresh.status, 201, "{:?}", fresh.json());
    // The claim's short wait is not the handler's: it runs with the session's value.
    assert_eq!(fresh.json()["lock_timeout"], "0");
    let again = post("k-1", json!({ "n": 1 })).await;
    assert!(again.replayed(), "{:?}", again.json());
    assert_eq!(again.json(), fresh.json());
    post("k-1", json!({ "n": 2 }))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(s.count("notes").await, 1);

    // A failure rolls back and stays retryable.
    assert_eq!(
        post("k-2", json!({ "n": 3, "fail": true })).await.status,
        502
    );
    assert_eq!(s.count("notes").await, 1);
    assert_eq!(post("k-2", json!({ "n": 3 })).await.status, 201);

    // A duplicate while the first is in flight: 409, and one effect.
    let slow = json!({ "n": 4, "sleep_ms": 600 });
    let (first, second) = tokio::join!(post("k-3", slow.clone()), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        post("k-3", slow.clone()).await
    });
    assert_eq!((first.status, second.status), (201, 409));
    assert_eq!(s.count("notes").await, 3);
}

/// Expired records go, in batches, and the key is free again.
async fn sweeps(s: &TestApp, store: &Store) {
    sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
        .execute(&s.pool)
        .await
        .unwrap();
    let keys = s.keys().await;
    assert!(keys > 0);
    // Batches of two, until none is left.
    let removed = store
        .operate()
        .audited(idem_tests::operator())
        .purge_expired(2)
        .await
        .expect("purge");
    assert_eq!(i64::try_from(removed).unwrap(), keys);
    assert_eq!(s.keys().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_portable_mode_holds_the_contract_with_every_principal_type() {
    for (principal_type, tenant, column_type) in [
        (PrincipalType::Text, Some("acct_1"), "text"),
        (PrincipalType::Uuid, None, "uuid"),
        (
            PrincipalType::Uuid,
            Some("6f1c8a52-3b7e-4a59-9a1d-2f0c5e9b7d41"),
            "uuid",
        ),
        (PrincipalType::Bigint, Some("42"), "bigint"),
        (PrincipalType::Bigint, None, "bigint"),
    ] {
        with_test_db(async |db| {
            let configure = |b: StoreBuilder| b.portable(true).principal_type(principal_type);
            let s = start(db, configure).await;
            let column: String = sqlx::query_scalar(
                "SELECT data_type FROM information_schema.columns \
                 WHERE table_name = 'idempotency_keys' AND column_name = 'principal'",
            )
            .fetch_one(&s.pool)
            .await
            .unwrap();
            assert_eq!(column, column_type);
            holds_the_contract(&s, tenant).await;
            // A principal the column cannot hold is the request's mistake: 400, not a
            // failed cast.
            if principal_type != PrincipalType::Text {
                s.post_with(
                    "/notes",
                    Some("k-9"),
                    &json!({ "n": 9 }),
                    &[("x-tenant", "acct_1")],
                )
                .await
                .assert_problem(400, "invalid-principal");
            }
            let store = configure(Store::builder(s.pool.clone())).build().unwrap();
            sweeps(&s, &store).await;
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transaction_pooler_mode_holds_the_contract() {
    with_test_db(async |db| {
        let configure = |b: StoreBuilder| b.pooler(Pooler::Transaction);
        let s = start(db, configure).await;
        holds_the_contract(&s, Some("acct_1")).await;
        let store = configure(Store::builder(s.pool.clone())).build().unwrap();
        sweeps(&s, &store).await;
    })
    .await;
}
