//! idem beside code written for plain sqlx: `&mut *tx` as an executor, and functions
//! taking `&mut PgConnection` (given `&mut tx` or `&mut *tx`) or `impl PgExecutor`, all
//! inside the request's transaction, against a real PostgreSQL over real HTTP.

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp};
use serde_json::{json, Value};
use sqlx::{PgConnection, PgExecutor};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
}

/// Written for sqlx, knowing nothing of idem.
async fn insert(db: impl PgExecutor<'_>, amount: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
        .bind(amount)
        .fetch_one(db)
        .await
}

/// Written for sqlx too, on a connection.
async fn insert_on(conn: &mut PgConnection, amount: i64) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
        .bind(amount)
        .execute(conn)
        .await
        .map(drop)
}

/// Also written for sqlx: sees the transaction's uncommitted rows.
async fn count(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(conn)
        .await
}

/// Writes three rows through the three forms, then fails when the body says so, after
/// the writes: everything must roll back together.
#[idempotent(scope = "charges")]
async fn create(
    mut tx: Tx,
    Json(req): Json<Value>,
) -> Result<(StatusCode, Json<Value>), (StatusCode, String)> {
    let fail = |e: sqlx::Error| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let amount = req["amount"].as_i64().unwrap_or(1);
    sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
        .bind(amount)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    insert(&mut *tx, amount).await.map_err(fail)?;
    insert_on(&mut tx, amount).await.map_err(fail)?;
    let seen = count(&mut tx).await.map_err(fail)?;
    if req["fail"] == true {
        return Err((
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("failing after {seen} rows"),
        ));
    }
    Ok((StatusCode::CREATED, Json(json!({ "seen": seen }))))
}

async fn start(db: &idem_tests::TestDb) -> TestApp {
    let pool = db.pool(5).await;
    sqlx::raw_sql("CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint NOT NULL)")
        .execute(&pool)
        .await
        .expect("create charges");
    let store = Store::new(pool.clone());
    store.migrate().await.expect("migrate");
    let app = Router::new()
        .route("/charges", post(create))
        .with_state(AppState { idempotency: store });
    TestApp::serve(pool, app).await
}

#[tokio::test(flavor = "multi_thread")]
async fn every_executor_form_writes_in_the_request_transaction() {
    with_test_db(async |db| {
        let app = start(db).await;
        let first = app
            .post("/charges", Some("k1"), &json!({"amount": 5}))
            .await;
        assert_eq!(first.status, 201, "{first:?}");
        // The `&mut PgConnection` function saw the three rows written before it.
        assert_eq!(first.json(), json!({ "seen": 3 }));
        assert_eq!(app.count("charges").await, 3);
        let replay = app
            .post("/charges", Some("k1"), &json!({"amount": 5}))
            .await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        assert_eq!(app.count("charges").await, 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn writes_through_every_form_roll_back_together() {
    with_test_db(async |db| {
        let app = start(db).await;
        let failed = app
            .post("/charges", Some("k2"), &json!({"amount": 5, "fail": true}))
            .await;
        assert_eq!(failed.status, 500, "{failed:?}");
        assert_eq!(app.count("charges").await, 0);
        assert_eq!(app.keys().await, 0);
    })
    .await;
}
