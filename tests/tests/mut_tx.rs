//! Regression (issue 40): `.fetch_one(&mut tx)`, for `&mut *tx`, failed to build with
//! errors from sqlx's trait bounds that named neither spelling. `&mut tx` is now an sqlx
//! executor on the request's transaction: its writes commit with the key and roll back
//! with it, as `&mut *tx`'s do.

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::Row;

#[derive(Deserialize, Serialize)]
struct NewNote {
    body: String,
    fail: bool,
}

/// Every sqlx entry point given `&mut tx`, then an `Err` when asked: the rollback shows
/// that they ran in the request's transaction.
#[idempotent(scope = "notes")]
async fn create_note(
    mut tx: Tx,
    Json(note): Json<NewNote>,
) -> Result<String, (StatusCode, String)> {
    let id: i64 = sqlx::query_scalar("INSERT INTO notes (body) VALUES ($1) RETURNING id")
        .bind(&note.body)
        .fetch_one(&mut tx)
        .await
        .map_err(failed)?;
    sqlx::query("UPDATE notes SET body = body || '!' WHERE id = $1")
        .bind(id)
        .execute(&mut tx)
        .await
        .map_err(failed)?;
    let seen: Option<String> = sqlx::query_scalar("SELECT body FROM notes WHERE id = $1")
        .bind(id)
        .fetch_optional(&mut tx)
        .await
        .map_err(failed)?;
    let rows = sqlx::query("SELECT id FROM notes")
        .fetch_all(&mut tx)
        .await
        .map_err(failed)?;
    sqlx::raw_sql("SELECT 1; SELECT 2")
        .execute(&mut tx)
        .await
        .map_err(failed)?;
    if note.fail {
        return Err((StatusCode::SERVICE_UNAVAILABLE, "asked to fail".into()));
    }
    let ids: Vec<i64> = rows.iter().map(|row| row.get("id")).collect();
    Ok(format!("{} {ids:?}", seen.unwrap_or_default()))
}

fn failed(error: sqlx::Error) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mut_tx_runs_in_the_requests_transaction() {
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        sqlx::raw_sql("CREATE TABLE notes (id bigserial PRIMARY KEY, body text)")
            .execute(&pool)
            .await
            .unwrap();
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/notes", post(create_note))
            .with_state(store);
        let s = TestApp::serve(pool, app).await;

        let refused = s
            .post("/notes", Some("n1"), &json!({ "body": "a", "fail": true }))
            .await;
        assert_eq!(refused.status, 503);
        assert_eq!(
            s.count("notes").await,
            0,
            "the Err rolled `&mut tx`'s writes back"
        );
        assert_eq!(s.keys().await, 0);

        let first = s
            .post("/notes", Some("n2"), &json!({ "body": "b", "fail": false }))
            .await;
        assert_eq!(first.status, 200);
        assert_eq!(
            first.body, b"b! [2]",
            "the insert, the update and the reads, in order"
        );
        let retry = s
            .post("/notes", Some("n2"), &json!({ "body": "b", "fail": false }))
            .await;
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
        assert_eq!(
            s.count("notes").await,
            1,
            "one write, committed with the key"
        );
        assert_eq!(s.keys().await, 1);
    })
    .await;
}
