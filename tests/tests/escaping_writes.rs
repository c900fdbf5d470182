//! Regression: writes that escape the transaction went unnoticed. A handler that wrote
//! through `State<PgPool>` compiled silently, and after two rolled-back attempts two rows
//! were left. Now (debug builds) a pool built with `idem::extract::warn_on_escaping_writes` logs
//! a warning naming the handler. One test in its own binary: it installs the
//! process-wide subscriber.

use std::sync::{Arc, Mutex};

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp};
use serde_json::{json, Value};
use sqlx::PgPool;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    pool: PgPool,
}

/// Writes around its `Tx`, then fails: the row escapes the rollback.
#[idempotent(scope = "leaky")]
async fn leaky(
    _tx: Tx,
    State(pool): State<PgPool>,
    Json(v): Json<Value>,
) -> Result<StatusCode, StatusCode> {
    sqlx::query("INSERT INTO notes (body) VALUES ($1)")
        .bind(v.to_string())
        .execute(&pool)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Err(StatusCode::SERVICE_UNAVAILABLE)
}

/// Writes through its `Tx`: nothing to warn about.
#[idempotent(scope = "tight")]
async fn tight(mut tx: Tx, Json(v): Json<Value>) -> Result<StatusCode, StatusCode> {
    sqlx::query("INSERT INTO notes (body) VALUES ($1)")
        .bind(v.to_string())
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(StatusCode::CREATED)
}

/// The `handler` field of every WARN event.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

struct HandlerField(Option<String>);

impl Visit for HandlerField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "handler" {
            self.0 = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            let mut field = HandlerField(None);
            event.record(&mut field);
            if let Some(handler) = field.0 {
                self.0.lock().unwrap().push(handler);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_around_tx_is_flagged_with_the_handlers_name() {
    let warnings = Warnings::default();
    tracing_subscriber::registry().with(warnings.clone()).init();
    with_test_db(async |db| {
        let pool = idem::extract::warn_on_escaping_writes(sqlx::postgres::PgPoolOptions::new())
            .max_connections(5)
            .connect_with(db.options.clone())
            .await
            .unwrap();
        sqlx::raw_sql("CREATE TABLE notes (body text)")
            .execute(&pool)
            .await
            .unwrap();
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/leaky", post(leaky))
            .route("/tight", post(tight))
            .with_state(AppState {
                store,
                pool: pool.clone(),
            });
        let s = TestApp::serve(pool, app).await;

        assert_eq!(s.post("/tight", Some("t1"), &json!(1)).await.status, 201);
        assert!(
            warnings.0.lock().unwrap().is_empty(),
            "writes through Tx are fine"
        );
        for _ in 0..2 {
            assert_eq!(s.post("/leaky", Some("k1"), &json!(1)).await.status, 503);
        }
        assert_eq!(
            s.count("notes").await,
            3,
            "the escaped rows are still there"
        );
        let flagged = warnings.0.lock().unwrap().clone();
        assert_eq!(
            flagged,
            ["leaky", "leaky"],
            "one warning per escaping acquire"
        );
    })
    .await;
}
