//! Webhooks and queue consumers: keys from the payload or a signed header, signed
//! deliveries, the wait policy, and exactly once without HTTP. Against a real
//! PostgreSQL, over real HTTP. The deliveries here are signed by idem's own
//! `Verifier::sign`; `providers.rs` signs them with each provider's official library.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::FromRef;
use axum::http::HeaderName;
use axum::routing::post;
use axum::{Json, Router};
use charges::consumer::{self, Credit, Credited};
use charges::Config;
use futures::future::join_all;
use idem::jobs::OnceError;
use idem::webhook::{Custom, Signed, StandardWebhooks, Stripe, Verifier};
use idem::{idempotent, Store, Tx};
use idem_tests::{count, send, with_test_db, Answer, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Standard Webhooks secrets (`whsec_` and base64) of `/webhooks/payments`.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const PREVIOUS: &str = "whsec_cHJldmlvdXMtc2VjcmV0LWJ5dGVzLTI0";
/// The Stripe secret of `/webhooks/stripe`, used whole as the key.
const STRIPE: &str = "whsec_stripe_current_0123456789abcdef";

/// The charges example with these secrets, its webhooks taking `webhook_delay`.
async fn start(db: &TestDb, webhook_delay: Duration) -> TestApp {
    let config = Config {
        payments: Verifier::new(SECRET)
            .and_then(|v| v.with_secret(PREVIOUS))
            .unwrap(),
        stripe: Verifier::new(STRIPE).unwrap(),
        webhook_delay,
        ..Config::default()
    };
    TestApp::charges(db, 30, config).await
}

/// A payment provider's deliveries to `/webhooks/payments`, and Stripe's to
/// `/webhooks/stripe`.
trait Deliver {
    async fn deliver(&self, body: &str, headers: &[(HeaderName, String)]) -> Answer;
    async fn deliver_stripe(&self, body: &str, signature: &str) -> Answer;
}

impl Deliver for TestApp {
    async fn deliver(&self, body: &str, headers: &[(HeaderName, String)]) -> Answer {
        let headers = headers.iter().map(|(name, value)| (name, value));
        self.deliver_to("/webhooks/payments", body, headers).await
    }

    async fn deliver_stripe(&self, body: &str, signature: &str) -> Answer {
        self.deliver_to("/webhooks/stripe", body, [("Stripe-Signature", signature)])
            .await
    }
}

/// Sends the head of a Stripe delivery announcing `length` bytes of body, sends none of
/// them, and returns what the server answers (within 10 s).
async fn head_only(s: &TestApp, signature: &str, length: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /webhooks/stripe HTTP/1.1\r\nHost: {}\r\nStripe-Signature: {signature}\r\n\
         Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n",
        s.addr
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0; 4096];
    let read = async {
        // Until the head and the problem's closing brace have arrived, or the server closes.
        let complete = |a: &[u8]| {
            let text = String::from_utf8_lossy(a);
            text.split_once("\r\n\r\n")
                .is_some_and(|(_, body)| body.contains('}'))
        };
        while !complete(&answer) {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("answered without the body");
    String::from_utf8_lossy(&answer).into_owned()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The three Standard Webhooks headers of a delivery with `id`.
fn sign(secret: &str, id: &str, timestamp: u64, body: &str) -> Vec<(HeaderName, String)> {
    Verifier::<StandardWebhooks>::new(secret)
        .unwrap()
        .sign(id, timestamp, body.as_bytes())
}

/// The `Stripe-Signature` of a delivery.
fn sign_stripe(secret: &str, timestamp: u64, body: &str) -> String {
    Verifier::<Stripe>::new(secret)
        .unwrap()
        .sign("", timestamp, body.as_bytes())
        .remove(0)
        .1
}

/// A payment event, in the Standard Webhooks payload shape; its id is a header.
fn event() -> String {
    json!({ "type": "payment.succeeded", "data": { "amount": 500 } }).to_string()
}

/// A Stripe event with `id`.
fn stripe_event(id: &str) -> String {
    json!({ "id": id, "type": "payment_intent.succeeded", "data": { "amount": 500 } }).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_event_is_acknowledged_and_processed_once() {
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        let body = event();
        let first = s.deliver(&body, &sign(SECRET, "evt_1", now(), &body)).await;
        assert_eq!(
            first.status,
            200,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        assert_eq!(first.json(), json!({ "received": "evt_1" }));
        // The provider redelivers later, signed afresh.
        let again = s.deliver(&body, &sign(SECRET, "evt_1", now(), &body)).await;
        assert_eq!(again.status, 200);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        assert_eq!(s.count("webhook_events").await, 1);
        let (scope, principal, key): (String, String, String) = sqlx::query_as(
            "SELECT split_part(scope, chr(31), 1), principal, key FROM idempotency_keys",
        )
        .fetch_one(&s.pool)
        .await
        .unwrap();
        assert_eq!(
            (scope.as_str(), key.as_str()),
            ("payment_events", "evt_1"),
            "keyed by the event's own (signed) id"
        );
        // No principal: kept under a hash of the key (`spread = payment_account`, and
        // the event names no account), not the one value all such keys would share.
        assert!(
            principal.starts_with('~') && principal.len() == 17,
            "{principal}"
        );
        let ttl: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM expires_at - created_at)::float8 FROM idempotency_keys",
        )
        .fetch_one(&s.pool)
        .await
        .unwrap();
        // Counted from the commit: the claim's time plus the handler's.
        assert!(
            (7.0 * 86_400.0..7.0 * 86_400.0 + 10.0).contains(&ttl),
            "{ttl} s"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_copies_of_one_event_make_one_row_and_twenty_acks() {
    with_test_db(async |db| {
        let s = start(db, Duration::from_millis(300)).await;
        let body = event();
        let headers = sign(SECRET, "evt_storm", now(), &body);
        let answers = join_all((0..20).map(|_| s.deliver(&body, &headers))).await;
        let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
        assert!(statuses.iter().all(|&st| st == 200), "{statuses:?}");
        assert!(answers.iter().all(|a| a.body == answers[0].body));
        assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
        assert_eq!(s.count("webhook_events").await, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_payload_under_the_same_event_id_is_refused() {
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        let body = event();
        s.deliver(&body, &sign(SECRET, "evt_2", now(), &body)).await;
        let other = json!({ "type": "payment.failed", "data": {} }).to_string();
        s.deliver(&other, &sign(SECRET, "evt_2", now(), &other))
            .await
            .assert_problem(422, "key-reused");
        assert_eq!(s.count("webhook_events").await, 1);
        // The same on Stripe's endpoint, whose key is the body's `id`.
        let body = stripe_event("evt_s");
        s.deliver_stripe(&body, &sign_stripe(STRIPE, now(), &body))
            .await;
        let other = json!({ "id": "evt_s", "type": "payment_intent.payment_failed" }).to_string();
        s.deliver_stripe(&other, &sign_stripe(STRIPE, now(), &other))
            .await
            .assert_problem(422, "key-reused");
        assert_eq!(s.count("webhook_events").await, 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_event_changes_its_charge() {
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        let charge = send(
            s.client
                .post(s.url("/charges"))
                .bearer_auth("acct_1")
                .header("Idempotency-Key", "c1")
                .json(&json!({ "amount": 100, "currency": "usd", "customer": "cus_1" })),
        )
        .await
        .json();
        let id = charge["id"].as_str().unwrap();
        let body = json!({ "type": "charge.refunded",
                           "data": { "account": "acct_1", "charge_id": id } })
        .to_string();
        assert_eq!(
            s.deliver(&body, &sign(SECRET, "evt_r", now(), &body))
                .await
                .status,
            200
        );
        let refunded: bool =
            sqlx::query_scalar("SELECT refunded_by_provider FROM charges WHERE id = $1")
                .bind(id)
                .fetch_one(&s.pool)
                .await
                .unwrap();
        assert!(refunded);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_stale_and_malformed_signatures_leave_nothing() {
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        let body = event();
        let guessed = "whsec_YS1mb3JnZXItZ3Vlc3NlZC10aGlzLTI0";
        s.deliver(&body, &sign(guessed, "evt_3", now(), &body))
            .await
            .assert_problem(401, "invalid-signature");
        // A genuine signature over another body, and over another id.
        let other = json!({ "type": "payment.failed" }).to_string();
        let mut headers = sign(SECRET, "evt_3", now(), &other);
        s.deliver(&body, &headers)
            .await
            .assert_problem(401, "invalid-signature");
        headers = sign(SECRET, "evt_4", now(), &body);
        headers[0].1 = "evt_3".into();
        s.deliver(&body, &headers)
            .await
            .assert_problem(401, "invalid-signature");
        s.deliver(&body, &sign(SECRET, "evt_3", now() - 3600, &body))
            .await
            .assert_problem(400, "stale-signature");
        headers = sign(SECRET, "evt_3", now(), &body);
        headers[2].1 = "sha256=abcdef".into();
        s.deliver(&body, &headers)
            .await
            .assert_problem(400, "malformed-signature");
        // Each of the three headers missing, or the id empty.
        for (missing, empty_id) in [(0, false), (1, false), (2, false), (3, true)] {
            let mut headers = sign(SECRET, "evt_3", now(), &body);
            if empty_id {
                headers[0].1 = String::new();
            } else {
                headers.remove(missing);
            }
            s.deliver(&body, &headers)
                .await
                .assert_problem(400, "malformed-signature");
        }
        assert_eq!(
            (
                s.count("webhook_events").await,
                s.count("idempotency_keys").await
            ),
            (0, 0)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_secrets_verify_on_both_sides() {
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        // The receiver still accepts the previous secret.
        let body = event();
        assert_eq!(
            s.deliver(&body, &sign(PREVIOUS, "evt_old", now(), &body))
                .await
                .status,
            200
        );
        // The sender, rotating, signs with an unknown new secret and the current one.
        let t = now();
        let next = "whsec_dGhlLW5leHQtc2VjcmV0LWJ5dGVzLTI0";
        let mut both = sign(next, "evt_both", t, &body);
        both[2].1 = format!("{} {}", both[2].1, sign(SECRET, "evt_both", t, &body)[2].1);
        assert_eq!(s.deliver(&body, &both).await.status, 200);
        assert_eq!(s.count("webhook_events").await, 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_event_id_is_refused() {
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        let body = json!({ "id": "", "type": "x" }).to_string();
        s.deliver_stripe(&body, &sign_stripe(STRIPE, now(), &body))
            .await
            .assert_problem(400, "malformed-key");
        let body = json!({ "type": "x" }).to_string();
        s.deliver_stripe(&body, &sign_stripe(STRIPE, now(), &body))
            .await
            .assert_problem(400, "invalid-request");
        // A `\u0000` in the payload, which jsonb cannot hold: 400, not 500.
        let body =
            json!({ "id": "evt_nul", "type": "x", "data": { "note": "a\u{0}b" } }).to_string();
        s.deliver_stripe(&body, &sign_stripe(STRIPE, now(), &body))
            .await
            .assert_problem(400, "invalid-request");
        assert_eq!(s.count("webhook_events").await, 0);
    })
    .await;
}

/// Pins the CPU denial of service of signature checks: a header with thousands of (empty)
/// `v1` values cost one MAC over the whole body each. Hostile headers are now refused
/// before the body is read. Stripe's format, as the custom scheme's, has the `v1` lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_signature_headers_are_refused_before_the_body_is_read() {
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        let t = now();
        let body = stripe_event("evt_hostile");
        let good = sign_stripe(STRIPE, t, &body);
        let sig = good.split_once(",v1=").unwrap().1;
        let zeros = "0".repeat(64);
        let hostile = [
            (format!("t={t},v1="), body.clone()),
            (format!("t={t},v1={}", &sig[..63]), body.clone()),
            (format!("t={t},v1={}", &sig[..62]), body.clone()),
            (format!("t={t},v1={sig}ab"), body.clone()),
            (
                format!("{good}{}", format!(",v1={zeros}").repeat(8)),
                body.clone(),
            ),
        ];
        for (header, body) in &hostile {
            s.deliver_stripe(body, header)
                .await
                .assert_problem(400, "malformed-signature");
        }
        // Only the head is sent of a delivery announcing a body beyond the limit, and of
        // one with a flood of empty `v1` values before a megabyte: each is answered
        // without a byte of its body, so no body was read (or MACed).
        for (header, length) in [
            (format!("t={t},v1="), 3 << 20),
            (format!("t={t}{}", ",v1=".repeat(5_000)), 1 << 20),
        ] {
            let answer = head_only(&s, &header, length).await;
            assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
            assert!(answer.contains("malformed-signature"), "{answer}");
        }
        assert_eq!(
            (
                s.count("webhook_events").await,
                s.count("idempotency_keys").await
            ),
            (0, 0),
            "nothing claimed"
        );
        // Eight values, the genuine one among them: accepted, in upper case too.
        let eight = format!(
            "t={t}{},v1={}{}",
            format!(",v1={zeros}").repeat(3),
            sig.to_uppercase(),
            format!(",v1={zeros}").repeat(4)
        );
        assert_eq!(s.deliver_stripe(&body, &eight).await.status, 200);
        assert_eq!(s.count("webhook_events").await, 1);
    })
    .await;
}

/// Pins the empty-key bug: `WEBHOOK_SECRET=` made the example verify deliveries signed
/// with the empty key. It now refuses to start, as it does a secret that is not a
/// Standard Webhooks `whsec_<base64>` one.
#[test]
fn the_example_refuses_an_empty_short_or_malformed_webhook_secret() {
    let refused = |current: Option<&str>, previous: Option<&str>| {
        charges::webhook_verifier(current.map(Into::into), previous.map(Into::into)).unwrap_err()
    };
    let prefix = "a Standard Webhooks secret starts with whsec_ (whsec_<base64>, as the \
                  provider shows it)";
    assert_eq!(refused(Some(""), None), format!("WEBHOOK_SECRET: {prefix}"));
    assert_eq!(
        refused(Some("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), None),
        format!("WEBHOOK_SECRET: {prefix}")
    );
    assert_eq!(
        refused(Some("whsec_"), None),
        "WEBHOOK_SECRET: the webhook secret is empty; it must be at least 16 bytes"
    );
    assert_eq!(
        refused(Some("whsec_c2hvcnQ="), None),
        "WEBHOOK_SECRET: the webhook secret is 5 bytes long; it must be at least 16 bytes"
    );
    assert_eq!(
        refused(Some("whsec_not base64!"), None),
        "WEBHOOK_SECRET: the webhook secret is not of the form whsec_<base64> (a Standard \
         Webhooks secret)"
    );
    assert_eq!(
        refused(Some(SECRET), Some("")),
        format!("WEBHOOK_SECRET_PREVIOUS: {prefix}")
    );
    assert!(charges::webhook_verifier(Some(SECRET.into()), Some(PREVIOUS.into())).is_ok());
    // Unset: a random secret, with a warning.
    assert!(charges::webhook_verifier(None, None).is_ok());
    // Stripe's and GitHub's secrets are taken as they are, at least 16 bytes.
    assert_eq!(
        charges::provider_verifier::<Stripe>("STRIPE_WEBHOOK_SECRET", Some("".into())).unwrap_err(),
        "STRIPE_WEBHOOK_SECRET: the webhook secret is empty; it must be at least 16 bytes"
    );
    assert!(charges::provider_verifier::<Stripe>("STRIPE_WEBHOOK_SECRET", None).is_ok());

    // The real binary stops at once with that message, before it connects.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_charges-server"))
        .env("WEBHOOK_SECRET", "")
        .env_remove("WEBHOOK_SECRET_PREVIOUS")
        .env("BIND_ADDR", "127.0.0.1:0")
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the service started with an empty WEBHOOK_SECRET");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(
        stderr.contains(&format!("WEBHOOK_SECRET: {prefix}")),
        "{stderr}"
    );
}

// The wait policy's limit, a key from another header, and a missing payload key, with
// handlers of this test's own.

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    acme: Verifier<Custom>,
}

/// The custom scheme's secret, and the header this service reads it from.
const ACME: &str = "acme-shared-secret-0123456789";
const ACME_HEADER: &str = "x-acme-signature";

#[derive(Deserialize, Serialize)]
struct Job {
    #[serde(default)]
    job_id: Option<String>,
    sleep_ms: u64,
}

#[idempotent(scope = "slow", key = job_id, concurrency = wait("200ms"))]
async fn slow(_tx: Tx, Json(job): Json<Job>) -> Json<u64> {
    tokio::time::sleep(Duration::from_millis(job.sleep_ms)).await;
    Json(job.sleep_ms)
}

#[idempotent(scope = "by-header", key = header("Delivery-Id"))]
async fn by_header(_tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(v)
}

#[idempotent(scope = "by-digest", key = digest(body))]
async fn by_digest(tx: Tx, Json(v): Json<Value>) -> Json<Value> {
    Json(json!({ "key": tx.idempotency_key(), "body": v }))
}

/// A sender of one's own, signing in Stripe's format under its own header.
#[derive(Deserialize, Serialize)]
struct AcmeEvent {
    id: String,
    kind: String,
}

#[idempotent(scope = "acme", key = id)]
async fn acme(_tx: Tx, Signed(event, ..): Signed<AcmeEvent, Custom>) -> Json<AcmeEvent> {
    Json(event)
}

async fn own_server(db: &TestDb) -> TestApp {
    let pool = db.pool(5).await;
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    let acme_verifier = Verifier::new(ACME)
        .unwrap()
        .header(HeaderName::from_static(ACME_HEADER));
    let app = Router::new()
        .route("/slow", post(slow))
        .route("/by-header", post(by_header))
        .route("/by-digest", post(by_digest))
        .route("/acme", post(acme))
        .with_state(AppState {
            idempotency: store,
            acme: acme_verifier,
        });
    TestApp::serve(pool, app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_policy_answers_409_only_past_its_wait() {
    with_test_db(async |db| {
        let server = own_server(db).await;
        let client = server.client.clone();
        let url = server.url("/slow");
        let long = json!({ "job_id": "j1", "sleep_ms": 1000 });
        let post = |_: u64| idem_tests::post(&client, &url, None, &long, &[]);
        // The first works for 1 s; the duplicate waits 200 ms, then gives up.
        let (first, second) = tokio::join!(post(1000), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let started = std::time::Instant::now();
            let answer = post(1000).await;
            (answer, started.elapsed())
        });
        assert_eq!(first.status, 200);
        let (second, waited) = second;
        second.assert_problem(409, "key-in-use");
        assert!(
            waited >= Duration::from_millis(150),
            "it waited: {waited:?}"
        );
        // Within the wait, the duplicate gets the replay instead.
        let short = json!({ "job_id": "j2", "sleep_ms": 50 });
        let (a, b) = tokio::join!(idem_tests::post(&client, &url, None, &short, &[]), async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            idem_tests::post(&client, &url, None, &short, &[]).await
        });
        assert_eq!((a.status, b.status), (200, 200));
        assert!(b.replayed() || a.replayed());
        // No key in the payload: 400.
        idem_tests::post(&client, &url, None, &json!({ "sleep_ms": 1 }), &[])
            .await
            .assert_problem(400, "missing-key");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_can_come_from_another_header() {
    with_test_db(async |db| {
        let server = own_server(db).await;
        let client = server.client.clone();
        let url = server.url("/by-header");
        let headers = [("Delivery-Id", "d-1")];
        let first = idem_tests::post(&client, &url, None, &json!({ "n": 1 }), &headers).await;
        assert_eq!(first.status, 200);
        let again = idem_tests::post(&client, &url, None, &json!({ "n": 1 }), &headers).await;
        assert!(again.replayed());
        // The Idempotency-Key header means nothing here.
        idem_tests::post(&client, &url, Some("d-1"), &json!({ "n": 1 }), &[])
            .await
            .assert_problem(400, "missing-key");
    })
    .await;
}

/// `key = digest(body)`: the key is the digest of the body's canonical encoding, so the
/// same content however spaced or ordered is one key, and other content another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_can_be_the_digest_of_the_body() {
    with_test_db(async |db| {
        let server = own_server(db).await;
        let url = server.url("/by-digest");
        let raw = |body: &'static str| {
            send(
                server
                    .client
                    .post(&url)
                    .header("Content-Type", "application/json")
                    .body(body),
            )
        };
        let first = raw(r#"{"a":1,"b":[true,null]}"#).await;
        assert_eq!(first.status, 200);
        let key = first.json()["key"].as_str().unwrap().to_owned();
        assert!(key.starts_with("sha256:") && key.len() == 7 + 64, "{key}");
        let again = raw(r#"{ "b": [ true, null ], "a": 1 }"#).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        let other = raw(r#"{"a":2,"b":[true,null]}"#).await;
        assert!(!other.replayed());
        assert_ne!(other.json()["key"], first.json()["key"]);
        assert_eq!(server.keys().await, 2);
        // The Idempotency-Key header means nothing here either.
        let keyed = idem_tests::post(
            &server.client,
            &url,
            Some("k"),
            &json!({ "a": 1, "b": [true, null] }),
            &[],
        )
        .await;
        assert!(keyed.replayed());
    })
    .await;
}

/// `Custom`: Stripe's format under a header the service names, for senders of one's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_sender_signs_under_its_own_header() {
    with_test_db(async |db| {
        let server = own_server(db).await;
        let body = json!({ "id": "acme_1", "kind": "ping" }).to_string();
        let signed = Verifier::<Custom>::new(ACME)
            .unwrap()
            .sign("", now(), body.as_bytes())
            .remove(0)
            .1;
        let deliver = |header: &'static str| {
            send(
                server
                    .client
                    .post(server.url("/acme"))
                    .header(header, &signed)
                    .header("Content-Type", "application/json")
                    .body(body.clone()),
            )
        };
        // Under another header, even Standard Webhooks' own name: not read.
        deliver("webhook-signature")
            .await
            .assert_problem(400, "malformed-signature");
        deliver("x-webhook-signature")
            .await
            .assert_problem(400, "malformed-signature");
        let first = deliver(ACME_HEADER).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.json()["id"], "acme_1");
        assert!(deliver(ACME_HEADER).await.replayed());
        assert_eq!(server.keys().await, 1);
    })
    .await;
}

/// The queue consumer (examples/charges/src/consumer.rs) with a plain in-process
/// queue that redelivers: each message is credited once; every redelivery gets the
/// stored result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_consumer_credits_each_message_once() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        charges::migrate(&pool).await.unwrap();
        let store = Store::builder(pool.clone())
            .conflict_wait(Duration::from_secs(5))
            .build()
            .unwrap();

        let messages: Vec<Credit> = (0..10)
            .map(|i| Credit {
                message_id: format!("msg-{i}"),
                account: format!("acct-{}", i % 3),
                amount: 100 + i,
            })
            .collect();
        // At-least-once delivery: every message three times, two of them at the same time.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for round in 0..3 {
            for m in &messages {
                tx.send((round, m.clone())).unwrap();
            }
        }
        drop(tx);
        let mut deliveries = Vec::new();
        while let Some(delivery) = rx.recv().await {
            deliveries.push(delivery);
        }
        let results = join_all(deliveries.iter().map(|(_, m)| consumer::handle(&store, m))).await;
        let mut by_message: std::collections::HashMap<&str, Vec<Credited>> = Default::default();
        for ((_, m), result) in deliveries.iter().zip(results) {
            by_message
                .entry(&m.message_id)
                .or_default()
                .push(result.expect("handled"));
        }
        for results in by_message.values() {
            assert!(
                results.iter().all(|r| r == &results[0]),
                "every delivery answers the same: {results:?}"
            );
        }
        assert_eq!(count(&pool, "ledger_entries").await, 10);
        let total: i64 = sqlx::query_scalar("SELECT sum(amount)::bigint FROM ledger_entries")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(total, (0..10).map(|i| 100 + i).sum::<i64>());

        // A message whose work fails is rolled back and can be redelivered.
        let broken = Credit {
            message_id: "msg-x".into(),
            account: "x".repeat(2),
            amount: 1,
        };
        sqlx::query("ALTER TABLE ledger_entries ADD CONSTRAINT small CHECK (amount < 1000)")
            .execute(&pool)
            .await
            .unwrap();
        let too_big = Credit {
            amount: 5_000,
            ..broken.clone()
        };
        assert!(matches!(
            consumer::handle(&store, &too_big).await,
            Err(OnceError::Work(_))
        ));
        assert_eq!(
            count(&pool, "idempotency_keys WHERE key = 'msg-x'").await,
            0,
            "nothing stored"
        );
        // The same id with another payload after a failure runs (nothing was stored)...
        assert_eq!(
            consumer::handle(&store, &broken).await.unwrap(),
            Credited { balance: 1 }
        );
        // ...and from then on that id is taken.
        assert!(matches!(
            consumer::handle(&store, &too_big).await,
            Err(OnceError::Mismatch)
        ));
    })
    .await;
}
