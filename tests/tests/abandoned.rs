//! Abandoned requests, visible (issue 38, its first part): a request that recorded a
//! step and has not committed is listed by `Operate::abandoned` and on the console's
//! `/abandoned` page once it has made no step for the window asked, and the sweeper
//! counts it in the gauge `idem_abandoned_requests`; its client's retry, which commits,
//! takes it off. And found (issue 39): `Operate::abandoned_page` filters them and reads them
//! a page at a time by keyset, on a principal column of another type than text too (the
//! list read a `uuid` principal as text and failed).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::operate::{AbandonedCursor, AbandonedFilter, CompletionStage};
use idem::schema::PrincipalType;
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, TestApp};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    calls: Arc<AtomicUsize>,
}

#[derive(Deserialize)]
struct Charge {
    amount: i64,
    /// Answer 503 after the step: the transaction rolls back, the step stays recorded.
    #[serde(default)]
    fail: bool,
}

/// A step (the outside call, counted), then a business write.
#[idempotent(scope = "charges", fields = [amount])]
async fn charge(
    State(calls): State<Arc<AtomicUsize>>,
    mut tx: Tx,
    Json(charge): Json<Charge>,
) -> Result<(StatusCode, Json<Value>), (StatusCode, String)> {
    let call: usize = tx
        .step("processor", |_key| async move {
            Ok::<_, String>(calls.fetch_add(1, Ordering::SeqCst) + 1)
        })
        .await
        .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
    sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
        .bind(charge.amount)
        .execute(&mut tx)
        .await
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    if charge.fail {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            "failed after the step".into(),
        ));
    }
    Ok((StatusCode::CREATED, Json(json!({ "call": call }))))
}

/// GET `path`: the status and the page.
async fn get(app: &TestApp, path: &str) -> (u16, String) {
    let response = app.client.get(app.url(path)).send().await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

/// Waits, 5 s at most, for the sweeper to set the gauge to `expected`.
async fn gauge_reaches(snapshotter: &Snapshotter, expected: f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let value =
            snapshotter.snapshot().into_vec().into_iter().find_map(
                |(key, _, _, value)| match value {
                    DebugValue::Gauge(v) if key.key().name() == "idem_abandoned_requests" => {
                        Some(v.into_inner())
                    }
                    _ => None,
                },
            );
        if value == Some(expected) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "idem_abandoned_requests: {value:?}, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_stopped_after_its_steps_is_listed_until_it_commits() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder of this binary");
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        let store = Store::builder(pool.clone())
            .abandoned_after(Duration::from_millis(100))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let sweeper = store.spawn_sweeper(Duration::from_millis(50), 100).unwrap();
        sqlx::query("CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let app = Router::new()
            .route("/charges", post(charge))
            .nest("/ops", idem::console::Console::new(store.clone()).router())
            .with_state(AppState {
                idempotency: store.clone(),
                calls: Arc::clone(&calls),
            });
        let app = TestApp::serve(pool.clone(), app).await;

        let failed = app
            .post(
                "/charges",
                Some("ch-1"),
                &json!({ "amount": 100, "fail": true }),
            )
            .await;
        assert_eq!(failed.status, 503, "{failed:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // A request that committed, with a step of its own, is not listed.
        let done = app
            .post("/charges", Some("ch-2"), &json!({ "amount": 200 }))
            .await;
        assert_eq!(done.status, 201, "{done:?}");

        let listed = store.operate().abandoned(Duration::ZERO, 10).await.unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");
        let first = &listed[0];
        assert_eq!(
            (
                first.scope.as_str(),
                first.principal.as_str(),
                first.key.as_str()
            ),
            ("charges", "", "ch-1")
        );
        let steps: Vec<&str> = first.steps.iter().map(|s| s.step.as_str()).collect();
        assert_eq!(steps, ["processor"]);
        gauge_reaches(&snapshotter, 1.0).await;
        // Within the window it may still be working: not listed.
        let recent = store
            .operate()
            .abandoned(Duration::from_secs(3_600), 10)
            .await
            .unwrap();
        assert!(recent.is_empty(), "{recent:?}");

        let (status, page) = get(&app, "/ops/abandoned?idle=0s").await;
        assert_eq!(status, 200);
        assert!(
            page.contains(">ch-1</code>") && page.contains("<code>processor</code>"),
            "{page}"
        );
        assert!(!page.contains("ch-2"), "{page}");
        assert_eq!(get(&app, "/ops/abandoned?idle=soon").await.0, 400);

        // The client comes back: the step replays (no second call), the request commits,
        // and it is no longer abandoned.
        let retried = app
            .post("/charges", Some("ch-1"), &json!({ "amount": 100 }))
            .await;
        assert_eq!(retried.status, 201, "{retried:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one call per request");
        assert!(store
            .operate()
            .abandoned(Duration::ZERO, 10)
            .await
            .unwrap()
            .is_empty());
        assert!(get(&app, "/ops/abandoned?idle=0s")
            .await
            .1
            .contains("None."));
        gauge_reaches(&snapshotter, 0.0).await;
        sweeper.stop();
    })
    .await;
}

/// Issue 39: abandoned requests found by their filter and read a page at a time, on a
/// store whose principal column is a `uuid`: oldest first step first, two that share
/// their first step's instant in the order of their principal; each row's cursor and the
/// page's `next` start the page after it; a principal that is not a UUID finds none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_requests_are_found_a_page_at_a_time() {
    const A: &str = "0b4f2c1e-0000-4000-8000-00000000000a";
    const B: &str = "0b4f2c1e-0000-4000-8000-00000000000b";
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        let store = Store::builder(pool.clone())
            .principal_type(PrincipalType::Uuid)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        sqlx::query(
            "INSERT INTO idempotency_steps
                 (scope, principal, key, step, fingerprint, result, created_at, expires_at)
             SELECT scope, CAST(principal AS uuid), key, step, decode('00', 'hex'), '7',
                    now() - make_interval(mins => ago), now() + interval '1 day'
               FROM (VALUES ('charges', $1, 'p-1', 'processor', 60),
                            ('charges', $1, 'p-1', 'ledger', 50),
                            ('charges', $2, 'p-2', 'processor', 60),
                            ('charges', $1, 'p-3', 'processor', 40),
                            ('mail', $2, 'q-4', 'processor', 30),
                            ('charges', $2, 'p-5', 'processor', 2))
                    AS s (scope, principal, key, step, ago)",
        )
        .bind(A)
        .bind(B)
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO idempotency_requests
                 (scope, principal, key, fingerprint, method, target, headers, body, state,
                  expires_at)
             VALUES ('charges', CAST($1 AS uuid), 'p-1', decode('00', 'hex'), 'POST', '/charges', '[]',
                     convert_to('{}', 'UTF8'), 'failed', now() + interval '1 day')",
        )
        .bind(A)
        .execute(&pool)
        .await
        .unwrap();
        let keys = |rows: &[idem::operate::Abandoned]| -> Vec<String> {
            rows.iter().map(|r| r.key.clone()).collect()
        };

        // The store's window (5 minutes) by default: p-5, 2 minutes idle, is not listed.
        let all = AbandonedFilter::default();
        let mut after: Option<AbandonedCursor> = None;
        let mut seen = Vec::new();
        // Bounded: a cursor that does not move on repeats a page.
        for _ in 0..10 {
            let page = store.operate().abandoned_page(&all, after.as_ref(), 1).await.unwrap();
            assert_eq!(page.rows.len(), 1, "{page:?}");
            assert_eq!(
                page.next.as_ref().map(ToString::to_string),
                page.next.as_ref().map(|_| page.rows[0].cursor.to_string())
            );
            seen.extend(keys(&page.rows));
            // The cursor goes through its text, as a link or a flag carries it.
            match page.next {
                Some(next) => after = Some(next.to_string().parse().unwrap()),
                None => break,
            }
        }
        assert_eq!(seen, ["p-1", "p-2", "p-3", "q-4"]);
        let first = &store.operate().abandoned_page(&all, None, 1).await.unwrap().rows[0];
        assert_eq!((first.principal.as_str(), first.steps.len()), (A, 2));
        assert_eq!(
            first.completion.as_ref().map(|c| c.state.as_str()),
            Some("failed")
        );

        let find = async |edit: &dyn Fn(&mut AbandonedFilter)| {
            let mut filter = AbandonedFilter::default();
            edit(&mut filter);
            keys(&store.operate().abandoned_page(&filter, None, 10).await.unwrap().rows)
        };
        assert_eq!(
            find(&|f| f.scope = Some("charges".into())).await,
            ["p-1", "p-2", "p-3"]
        );
        // Written another way, as canonical as the column keeps it.
        assert_eq!(
            find(&|f| f.principal = Some(B.to_uppercase())).await,
            ["p-2", "q-4"]
        );
        assert!(find(&|f| f.principal = Some("acct_1".into()))
            .await
            .is_empty());
        assert_eq!(find(&|f| f.key_prefix = Some("q-".into())).await, ["q-4"]);
        assert_eq!(
            find(&|f| f.completion = Some(CompletionStage::Failed)).await,
            ["p-1"]
        );
        assert_eq!(
            find(&|f| f.completion = Some(CompletionStage::NotCompletable)).await,
            ["p-2", "p-3", "q-4"]
        );
        assert_eq!(
            find(&|f| f.idle_for = Some(Duration::ZERO)).await,
            ["p-1", "p-2", "p-3", "q-4", "p-5"]
        );
        assert_eq!(
            find(&|f| f.idle_for = Some(Duration::from_secs(45 * 60))).await,
            ["p-1", "p-2"]
        );
        // The old signature reads the first page of the same list.
        assert_eq!(
            keys(&store.operate().abandoned(Duration::ZERO, 2).await.unwrap()),
            ["p-1", "p-2"]
        );
    })
    .await;
}
