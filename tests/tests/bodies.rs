//! Every body extractor idem fingerprints, over real HTTP against a real PostgreSQL: the
//! same key with the same payload replays, with another payload is refused with 422.
//! Pins the bug where a `Form`, a `Query` payload, an `Option<Json>`, a
//! `Result<Json, JsonRejection>` or a custom extractor added nothing to the fingerprint,
//! so a reused key with a different payload replayed the first answer; and issue 19's
//! body extractor written for the app's own state (`FromRequest<AppState>`), which the
//! macro now recognises as the body under the router's state (one that is no
//! `FingerprintBody` is a compile error: `ui/fail/body_for_one_state_without_fingerprint.rs`).

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRef, FromRequest, Query, Request};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Form, Json, Router};
use idem::extract::FingerprintBody;
use idem::{idempotent, Store, Tx};
use idem_tests::{send, with_test_db, Answer, TestApp};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    max_amount: i64,
}

#[derive(Deserialize, Serialize)]
struct Charge {
    amount: i64,
}

#[idempotent(scope = "json")]
async fn json(_tx: Tx, Json(charge): Json<Charge>) -> String {
    charge.amount.to_string()
}

#[idempotent(scope = "form")]
async fn form(_tx: Tx, Form(charge): Form<Charge>) -> String {
    charge.amount.to_string()
}

#[idempotent(scope = "query")]
async fn query(_tx: Tx, Query(charge): Query<Charge>) -> String {
    charge.amount.to_string()
}

#[idempotent(scope = "option")]
async fn option(_tx: Tx, body: Option<Json<Value>>) -> String {
    body.map_or_else(|| "none".to_owned(), |Json(v)| v.to_string())
}

#[idempotent(scope = "result")]
async fn result(_tx: Tx, body: Result<Json<Charge>, JsonRejection>) -> String {
    match body {
        Ok(Json(charge)) => charge.amount.to_string(),
        Err(rejection) => rejection.body_text(),
    }
}

#[idempotent(scope = "text")]
async fn text(_tx: Tx, body: String) -> String {
    body
}

#[idempotent(scope = "bytes")]
async fn bytes(_tx: Tx, body: Bytes) -> Bytes {
    body
}

/// A body extractor of the user's own: lines of text.
struct Lines(Vec<String>);

impl<S: Send + Sync> FromRequest<S> for Lines {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &S) -> Result<Self, StatusCode> {
        let text = String::from_request(req, state)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Self(text.lines().map(str::to_owned).collect()))
    }
}

impl FingerprintBody for Lines {
    type Value = [String];

    fn fingerprint_value(&self) -> &[String] {
        &self.0
    }
}

#[idempotent(scope = "lines")]
async fn lines(_tx: Tx, Lines(lines): Lines) -> String {
    lines.len().to_string()
}

/// JSON checked against the app's configuration: a body extractor for `AppState` only.
struct AppJson<T>(T);

impl<T: DeserializeOwned + Send> FromRequest<AppState> for AppJson<T> {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, StatusCode> {
        let Json(value) = Json::<Value>::from_request(req, state)
            .await
            .map_err(|_| StatusCode::BAD_REQUEST)?;
        if value["amount"]
            .as_i64()
            .is_some_and(|a| a > state.max_amount)
        {
            return Err(StatusCode::UNPROCESSABLE_ENTITY);
        }
        serde_json::from_value(value)
            .map(Self)
            .map_err(|_| StatusCode::BAD_REQUEST)
    }
}

impl<T> FingerprintBody for AppJson<T> {
    type Value = T;

    fn fingerprint_value(&self) -> &T {
        &self.0
    }
}

#[idempotent(scope = "app-json")]
async fn app_json(_tx: Tx, AppJson(charge): AppJson<Charge>) -> String {
    charge.amount.to_string()
}

async fn serve(db: &idem_tests::TestDb) -> TestApp {
    let pool = db.pool(5).await;
    let idempotency = Store::new(pool.clone());
    idempotency.migrate().await.unwrap();
    let app = Router::new()
        .route("/json", post(json))
        .route("/form", post(form))
        .route("/query", post(query))
        .route("/option", post(option))
        .route("/result", post(result))
        .route("/text", post(text))
        .route("/bytes", post(bytes))
        .route("/lines", post(lines))
        .route("/app-json", post(app_json))
        .with_state(AppState {
            idempotency,
            max_amount: 1_000,
        });
    TestApp::serve(pool, app).await
}

/// A request as sent: path and query, content type, body.
struct Sent {
    path: &'static str,
    content_type: Option<&'static str>,
    body: &'static str,
}

const JSON: Option<&str> = Some("application/json");
const FORM: Option<&str> = Some("application/x-www-form-urlencoded");
const TEXT: Option<&str> = Some("text/plain; charset=utf-8");
const OCTETS: Option<&str> = Some("application/octet-stream");

const fn sent(path: &'static str, content_type: Option<&'static str>, body: &'static str) -> Sent {
    Sent {
        path,
        content_type,
        body,
    }
}

async fn call(s: &TestApp, key: &str, sent: &Sent) -> Answer {
    let mut request = s
        .client
        .post(s.url(sent.path))
        .header("Idempotency-Key", key)
        .body(sent.body);
    if let Some(content_type) = sent.content_type {
        request = request.header("content-type", content_type);
    }
    send(request).await
}

/// `first` runs, runs again as a replay of itself, and `other` under the same key is
/// refused as a reused key.
async fn assert_told_apart(s: &TestApp, key: &str, first: &Sent, other: &Sent) {
    let a = call(s, key, first).await;
    assert_eq!(
        a.status,
        200,
        "{}: {}",
        first.path,
        String::from_utf8_lossy(&a.body)
    );
    assert!(!a.replayed(), "{}", first.path);
    let b = call(s, key, first).await;
    assert!(b.replayed(), "{}: the same payload replays", first.path);
    assert_eq!(b.body, a.body);
    call(s, key, other).await.assert_problem(422, "key-reused");
}

#[tokio::test]
async fn each_body_extractor_tells_a_reused_key_with_another_payload() {
    with_test_db(async |db| {
        let s = serve(db).await;
        let cases = [
            (
                sent("/json", JSON, r#"{"amount":1}"#),
                sent("/json", JSON, r#"{"amount":2}"#),
            ),
            (
                sent("/form", FORM, "amount=1"),
                sent("/form", FORM, "amount=2"),
            ),
            (
                sent("/query?amount=1", None, ""),
                sent("/query?amount=2", None, ""),
            ),
            (
                sent("/option", JSON, r#"{"amount":1}"#),
                sent("/option", JSON, r#"{"amount":2}"#),
            ),
            (
                sent("/result", JSON, r#"{"amount":1}"#),
                sent("/result", JSON, r#"{"amount":2}"#),
            ),
            (sent("/text", TEXT, "one"), sent("/text", TEXT, "two")),
            (sent("/bytes", OCTETS, "one"), sent("/bytes", OCTETS, "two")),
            (sent("/lines", TEXT, "a\nb"), sent("/lines", TEXT, "a\nc")),
            (
                sent("/app-json", JSON, r#"{"amount":1}"#),
                sent("/app-json", JSON, r#"{"amount":2}"#),
            ),
        ];
        for (i, (first, other)) in cases.iter().enumerate() {
            assert_told_apart(&s, &format!("key-{i}"), first, other).await;
        }
    })
    .await;
}

/// An absent body (`None`) is told apart from every present one, even `null`; and a
/// rejected body (`Err`) from a valid one.
#[tokio::test]
async fn an_absent_or_rejected_body_is_not_a_present_one() {
    with_test_db(async |db| {
        let s = serve(db).await;
        let none = sent("/option", None, "");
        assert_told_apart(&s, "absent", &none, &sent("/option", JSON, "null")).await;
        assert_told_apart(&s, "null", &sent("/option", JSON, "null"), &none).await;
        let rejected = sent("/result", JSON, "{");
        let valid = sent("/result", JSON, r#"{"amount":1}"#);
        assert_told_apart(&s, "rejected", &rejected, &valid).await;
        assert_told_apart(&s, "valid", &valid, &rejected).await;
    })
    .await;
}
