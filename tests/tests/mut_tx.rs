//! Regression (issue 40): `.fetch_one(&mut tx)`, for `&mut *tx`, failed to build with
//! errors from sqlx's trait bounds that named neither spelling. `&mut tx` is now an sqlx
//! executor on the request's transaction: its writes commit with the key and roll back
//! with it, as `&mut *tx`'s do.

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{Connection, PgConnection, Row};

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

/// A helper with a unit of work of its own, sqlx's idiom, given `&mut tx`.
async fn add_note(conn: &mut PgConnection, body: &str) -> Result<(), sqlx::Error> {
    let mut unit = conn.begin().await?;
    sqlx::query("INSERT INTO notes (body) VALUES ($1)")
        .bind(body)
        .execute(&mut *unit)
        .await?;
    unit.commit().await
}

#[idempotent(scope = "nested")]
async fn nested(mut tx: Tx, Json(note): Json<NewNote>) -> Result<StatusCode, (StatusCode, String)> {
    add_note(&mut tx, &note.body).await.map_err(failed)?;
    sqlx::query("INSERT INTO notes (body) VALUES ('after')")
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    Ok(StatusCode::CREATED)
}

/// `routes` on a store of their own, over a `notes` table.
async fn serve_notes(db: &TestDb, routes: Router<Store>) -> TestApp {
    serve_notes_on(db, routes, false).await
}

/// [`serve_notes`], the store `portable` or not.
async fn serve_notes_on(db: &TestDb, routes: Router<Store>, portable: bool) -> TestApp {
    let pool = db.pool(4).await;
    sqlx::raw_sql("CREATE TABLE notes (id bigserial PRIMARY KEY, body text)")
        .execute(&pool)
        .await
        .unwrap();
    let builder = Store::builder(pool.clone());
    let store = if portable {
        builder.portable(true)
    } else {
        builder
    }
    .build()
    .expect("a store");
    store.migrate().await.unwrap();
    TestApp::serve(pool, routes.with_state(store)).await
}

fn failed(error: sqlx::Error) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mut_tx_runs_in_the_requests_transaction() {
    with_test_db(async |db| {
        let s = serve_notes(db, Router::new().route("/notes", post(create_note))).await;

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

/// Regression (issue 48): sqlx's nested unit of work, `conn.begin()` … `commit()` on the
/// request's connection, sent a real COMMIT (sqlx does not see idem's BEGIN): the write
/// committed without the key, and each retry wrote again. The COMMIT is now refused
/// before anything commits, and says what to write instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_unit_of_work_never_commits_the_requests_transaction() {
    // The default mode, and the portable one (whose guard rides its claim's message).
    for portable in [false, true] {
        with_test_db(async |db| {
            let routes = Router::new().route("/nested", post(nested));
            let s = serve_notes_on(db, routes, portable).await;
            for _ in 0..3 {
                let answer = s
                    .post(
                        "/nested",
                        Some("n1"),
                        &json!({ "body": "a", "fail": false }),
                    )
                    .await;
                assert_eq!(answer.status, 500, "portable: {portable}");
                let text = String::from_utf8_lossy(&answer.body).into_owned();
                assert!(
                    text.contains("idem refused this COMMIT") && text.contains("without begin()"),
                    "portable: {portable}: {text}"
                );
            }
            assert_eq!(
                s.count("notes").await,
                0,
                "portable: {portable}: no write committed, once or thrice"
            );
            assert_eq!(s.keys().await, 0, "portable: {portable}");
        })
        .await;
    }
}
