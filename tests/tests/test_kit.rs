//! The test kit (`idem::testing`) catches what it claims: run against handlers written
//! wrong in each of the ways the book names, it reports each, with the property, the
//! history and the advice; run against correct handlers, it reports nothing.

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem::testing::{Broke, Effect, Kit, Report, StandIn};
use idem::{idempotent, Store, Tx};
use idem_tests::with_test_db;
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::PgPool;

#[derive(Clone, axum::extract::FromRef)]
struct App {
    store: Store,
    processor: String,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
    #[serde(default)]
    note: String,
}

type Answer = Result<(StatusCode, Json<Value>), (StatusCode, String)>;

fn bad(e: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// The processor's call, with `key` as its `Idempotency-Key` (none for `None`).
async fn charge_at(app: &App, key: Option<&str>, amount: i64) -> Result<String, reqwest::Error> {
    let mut call = app.http.post(format!("{}/v1/charges", app.processor));
    if let Some(key) = key {
        call = call.header("idempotency-key", key);
    }
    let answer: Value = call
        .json(&json!({ "amount": amount }))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(answer["id"].as_str().unwrap_or_default().to_owned())
}

async fn insert(
    tx: &mut Tx<'_>,
    processor_id: &str,
    amount: i64,
) -> Result<(), (StatusCode, String)> {
    sqlx::query("INSERT INTO charges (processor_id, amount) VALUES ($1, $2)")
        .bind(processor_id)
        .bind(amount)
        .execute(&mut **tx)
        .await
        .map_err(bad)?;
    Ok(())
}

/// Right: the call in a step with the step's key, the write through `tx`.
#[idempotent(scope = "charges", fields = [amount], completable = true)]
async fn correct(State(app): State<App>, mut tx: Tx, Json(req): Json<NewCharge>) -> Answer {
    let id: String = tx
        .step("processor", |key| {
            let app = app.clone();
            async move { charge_at(&app, Some(&key), req.amount).await }
        })
        .await
        .map_err(bad)?;
    insert(&mut tx, &id, req.amount).await?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

/// `correct`'s next version: its `fields` reordered and one added, and a step added
/// after the processor's (a receipt, sent by the same service).
#[idempotent(scope = "charges", fields = [note, amount], completable = true)]
async fn correct_next(State(app): State<App>, mut tx: Tx, Json(req): Json<NewCharge>) -> Answer {
    let id: String = tx
        .step("processor", |key| {
            let app = app.clone();
            async move { charge_at(&app, Some(&key), req.amount).await }
        })
        .await
        .map_err(bad)?;
    let _receipt: String = tx
        .step("receipt", |key| {
            let app = app.clone();
            async move { charge_at(&app, Some(&key), 0).await }
        })
        .await
        .map_err(bad)?;
    insert(&mut tx, &id, req.amount).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": id, "note": req.note })),
    ))
}

/// Wrong: the processor called outside a step.
#[idempotent(scope = "charges", fields = [amount])]
async fn call_outside_a_step(
    State(app): State<App>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Answer {
    let id = charge_at(&app, None, req.amount).await.map_err(bad)?;
    insert(&mut tx, &id, req.amount).await?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

/// Wrong: the charge written through the pool, outside the request's transaction.
#[idempotent(scope = "charges", fields = [amount])]
async fn write_through_the_pool(
    State(app): State<App>,
    _tx: Tx,
    Json(req): Json<NewCharge>,
) -> Answer {
    sqlx::query("INSERT INTO charges (processor_id, amount) VALUES ('none', $1)")
        .bind(req.amount)
        .execute(app.store.pool())
        .await
        .map_err(bad)?;
    Ok((StatusCode::CREATED, Json(json!({ "amount": req.amount }))))
}

/// Wrong: a step that sends a key of its own making, new at each call.
#[idempotent(scope = "charges", fields = [amount])]
async fn step_with_its_own_key(
    State(app): State<App>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Answer {
    let id: String = tx
        .step("processor", |_key| {
            let app = app.clone();
            async move {
                let own = format!(
                    "mine-{}",
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_nanos()
                );
                charge_at(&app, Some(&own), req.amount).await
            }
        })
        .await
        .map_err(bad)?;
    insert(&mut tx, &id, req.amount).await?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

/// Wrong: the write left to a spawned task.
#[idempotent(scope = "charges", fields = [amount])]
async fn write_in_a_spawned_task(
    State(app): State<App>,
    _tx: Tx,
    Json(req): Json<NewCharge>,
) -> Answer {
    let pool = app.store.pool().clone();
    tokio::spawn(async move {
        sqlx::query("INSERT INTO charges (processor_id, amount) VALUES ('later', $1)")
            .bind(req.amount)
            .execute(&pool)
            .await
            .ok();
    });
    Ok((StatusCode::ACCEPTED, Json(json!({ "amount": req.amount }))))
}

async fn kit_for<H, T>(db: &PgPool, processor: &StandIn, handler: H) -> Kit
where
    H: axum::handler::Handler<T, App> + Clone + Send + Sync + 'static,
    T: 'static,
{
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (id bigserial PRIMARY KEY, processor_id text NOT NULL, amount bigint NOT NULL)",
    )
    .execute(db)
    .await
    .unwrap();
    let url = processor.url();
    Kit::new(db.clone(), move |store| {
        Router::new()
            .route("/charges", post(handler.clone()))
            .with_state(App {
                store,
                processor: url.clone(),
                http: reqwest::Client::new(),
            })
    })
    .request(|| {
        Request::post("/charges")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"amount": 100}"#))
            .unwrap()
    })
    .effect(Effect::rows("charges"))
    .outside(processor)
    .histories(4)
}

/// The kit's report on `handler`, run on a database of its own against a stand-in
/// processor that honours keys, or ignores them.
async fn report_on<H, T>(handler: H, honours_keys: bool) -> Report
where
    H: axum::handler::Handler<T, App> + Clone + Send + Sync + 'static,
    T: 'static,
{
    let mut report = None;
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let processor = if honours_keys {
            StandIn::honouring_keys("processor").await
        } else {
            StandIn::ignoring_keys("processor").await
        };
        let processor = processor.unwrap();
        report = Some(kit_for(&pool, &processor, handler).await.run().await);
    })
    .await;
    report.expect("the kit ran")
}

fn assert_reports(report: &Report, what: impl Fn(&Broke) -> bool, advice: &str) {
    let found = report
        .findings()
        .iter()
        .find(|f| what(f.broke()))
        .unwrap_or_else(|| panic!("the kit missed it; it reported:\n{report}"));
    assert!(
        found.advice().contains(advice),
        "advice {:?} does not say {advice:?}\n{report}",
        found.advice()
    );
    assert!(!found.history().is_empty(), "{report}");
    let printed = report.to_string();
    println!("{printed}");
    assert!(
        printed.contains(&format!("IDEM_KIT_SEED={}", report.seed())),
        "{printed}"
    );
}

#[tokio::test]
async fn a_correct_handler_keeps_every_property() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let processor = StandIn::honouring_keys("processor").await.unwrap();
        let report = kit_for(&pool, &processor, correct).await.run().await;
        report.assert_exactly_once();
        // The matrix ran: once, at once, two ways back from each of the five passes a
        // request with one step makes (its call, its record, COMMIT twice), the outage.
        assert!(report.histories() >= 12, "{report}");
        assert!(processor.calls() >= 10, "{processor:?}");
    })
    .await;
}

#[tokio::test]
async fn a_deploy_that_reorders_fields_and_adds_a_step_keeps_every_property() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let processor = StandIn::honouring_keys("processor").await.unwrap();
        let url = processor.url();
        let report = kit_for(&pool, &processor, correct)
            .await
            .deploy(move |store| {
                Router::new()
                    .route("/charges", post(correct_next))
                    .with_state(App {
                        store,
                        processor: url.clone(),
                        http: reqwest::Client::new(),
                    })
            })
            .run()
            .await;
        report.assert_exactly_once();
        // Both versions sent once, and each point of the first died at before a deploy.
        assert!(report.histories() >= 20, "{report}");
    })
    .await;
}

#[tokio::test]
async fn an_outside_call_without_a_step_is_reported() {
    let report = report_on(call_outside_a_step, true).await;
    assert_reports(
        &report,
        |b| matches!(b, Broke::OutsideCalledAgain { service, .. } if service == "processor"),
        "a `tx.step`",
    );
    assert_reports(
        &report,
        |b| matches!(b, Broke::Invisible { service } if service == "processor"),
        "a `tx.step`",
    );
    // The service acted twice too: the advice is the step, not a step's key.
    assert_reports(
        &report,
        |b| matches!(b, Broke::OutsideEffectTwice { service, .. } if service == "processor"),
        "the request makes no step: make the call a `tx.step`",
    );
}

#[tokio::test]
async fn a_write_through_the_pool_is_reported() {
    let report = report_on(write_through_the_pool, true).await;
    assert_reports(
        &report,
        |b| matches!(b, Broke::EffectTwice { effect, .. } if effect == "charges"),
        "through `tx`",
    );
}

#[tokio::test]
async fn a_step_that_sends_its_own_key_is_reported() {
    let report = report_on(step_with_its_own_key, true).await;
    assert_reports(
        &report,
        |b| matches!(b, Broke::OutsideEffectTwice { service, .. } if service == "processor"),
        "send the step's key",
    );
}

#[tokio::test]
async fn a_write_left_to_a_spawned_task_is_reported() {
    let report = report_on(write_in_a_spawned_task, true).await;
    // The task's write is not rolled back with the request that died before its
    // COMMIT, and the retry's task writes again.
    assert_reports(
        &report,
        |b| matches!(b, Broke::EffectTwice { effect, .. } if effect == "charges"),
        "a spawned task",
    );
}

#[tokio::test]
async fn a_service_that_ignores_keys_is_named_as_the_cause() {
    let report = report_on(correct, false).await;
    assert_reports(
        &report,
        |b| matches!(b, Broke::OutsideEffectTwice { service, .. } if service == "processor"),
        "ignores Idempotency-Key",
    );
}

#[tokio::test]
async fn the_same_seed_draws_the_same_histories() {
    with_test_db(async |db| {
        let pool = db.pool(8).await;
        let processor = StandIn::honouring_keys("processor").await.unwrap();
        let first = kit_for(&pool, &processor, call_outside_a_step)
            .await
            .seed(7)
            .run()
            .await;
        // A stand-in of its own, whose answers count from 1 again.
        let processor = StandIn::honouring_keys("processor").await.unwrap();
        let second = kit_for(&pool, &processor, call_outside_a_step)
            .await
            .seed(7)
            .run()
            .await;
        assert_eq!(first.seed(), 7);
        let words = |r: &Report| -> Vec<Vec<String>> {
            r.findings().iter().map(|f| f.history().to_vec()).collect()
        };
        assert_eq!(words(&first), words(&second));
    })
    .await;
}
