//! The example's webhook endpoints, driven with deliveries signed by each provider's
//! official library (`idem_tests::Signers`): Standard Webhooks on `/webhooks/payments`,
//! Stripe on `/webhooks/stripe`, GitHub on `/webhooks/github`; Slack and Shopify on a
//! service of the test's own. For each: a valid
//! delivery, a redelivery (one effect), concurrent copies (one effect, every copy 2xx),
//! a forged and a stale one, rotated secrets, the same id with another payload (422,
//! logged), and deliveries of one scheme sent to another's endpoint. One binary with a
//! process-wide subscriber, so that what is logged can be read back.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use charges::Config;
use futures::future::join_all;
use idem::webhook::{Shopify, Signed, Slack, Verifier};
use idem::{idempotent, Store, Tx};
use idem_tests::{with_test_db, Answer, Signers, SpanFields, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// Standard Webhooks secrets, as `standardwebhooks` issues them: `whsec_` and base64.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const PREVIOUS: &str = "whsec_cHJldmlvdXMtc2VjcmV0LWJ5dGVzLTI0";
const NEXT: &str = "whsec_dGhlLW5leHQtc2VjcmV0LWJ5dGVzLTI0";
const FORGED: &str = "whsec_YS1mb3JnZXItZ3Vlc3NlZC10aGlzLTI0";
const STRIPE: &str = "whsec_stripe_current_0123456789abcdef";
const STRIPE_PREVIOUS: &str = "whsec_stripe_previous_0123456789abcdef";
const GITHUB: &str = "github-hook-secret-0123456789";
const GITHUB_PREVIOUS: &str = "github-hook-secret-previous-0123456789";

/// The example with these secrets, each endpoint still accepting a previous one, its
/// webhook handlers taking `delay`.
async fn start(db: &TestDb, delay: Duration) -> TestApp {
    let config = Config {
        payments: Verifier::new(SECRET)
            .and_then(|v| v.with_secret(PREVIOUS))
            .unwrap(),
        stripe: Verifier::new(STRIPE)
            .and_then(|v| v.with_secret(STRIPE_PREVIOUS))
            .unwrap(),
        github: Verifier::new(GITHUB)
            .and_then(|v| v.with_secret(GITHUB_PREVIOUS))
            .unwrap(),
        webhook_delay: delay,
        ..Config::default()
    };
    TestApp::charges(db, 30, config).await
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `POST path` with `body` and `headers`, as a provider sends it.
async fn deliver(s: &TestApp, path: &str, body: &str, headers: &[(String, String)]) -> Answer {
    s.deliver_to(
        path,
        body,
        headers.iter().map(|(name, value)| (name, value)),
    )
    .await
}

/// Concurrent copies of one delivery: every copy 200, one of them run, the others
/// replayed.
fn every_copy_acknowledged_one_ran(answers: &[Answer]) {
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert!(statuses.iter().all(|&st| st == 200), "{statuses:?}");
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
}

/// What a provider's endpoint wrote: (its rows, idempotency keys).
async fn effects(s: &TestApp, provider: &str) -> (i64, i64) {
    (
        s.count(&format!("webhook_events WHERE provider = '{provider}'"))
            .await,
        s.keys().await,
    )
}

/// The outcome fields of every "idem request done" event logged by this process.
fn outcomes() -> &'static Events {
    static EVENTS: OnceLock<Events> = OnceLock::new();
    EVENTS.get_or_init(|| {
        let events = Events::default();
        tracing_subscriber::registry()
            .with(events.clone())
            .try_init()
            .expect("the only subscriber of this binary");
        events
    })
}

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<SpanFields>>>);

impl Events {
    /// How many requests ended with `outcome` and `status`.
    fn count(&self, outcome: &str, status: &str) -> usize {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter(|e| e.get("outcome") == Some(outcome) && e.get("status") == Some(status))
            .count()
    }
}

impl<S: Subscriber> Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = SpanFields::default();
        event.record(&mut fields);
        if fields.get("message") == Some("idem request done") {
            self.0.lock().unwrap().push(fields);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_webhooks_deliveries() {
    let events = outcomes();
    let sign = Signers::get();
    with_test_db(async |db| {
        let s = start(db, Duration::from_millis(200)).await;
        let path = "/webhooks/payments";
        let body = json!({ "type": "payment.succeeded", "timestamp": "2026-11-23T17:00:00Z",
                           "data": { "amount": 500 } })
        .to_string();

        // Valid, then redelivered later and signed afresh: one effect, the same answer.
        let first = deliver(
            &s,
            path,
            &body,
            &sign.standard_webhooks(&[SECRET], "msg_1", now(), &body),
        )
        .await;
        assert_eq!(
            first.status,
            200,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        assert_eq!(first.json(), json!({ "received": "msg_1" }));
        let again = deliver(
            &s,
            path,
            &body,
            &sign.standard_webhooks(&[SECRET], "msg_1", now() + 1, &body),
        )
        .await;
        assert_eq!((again.status, again.replayed()), (200, true));
        assert_eq!(again.body, first.body);
        assert_eq!(effects(&s, "payments").await, (1, 1));
        // Keyed by the signed webhook-id; without an account in the event, kept under a
        // hash of it (the example's `spread`), not under no principal.
        let key: String = sqlx::query_scalar(
            "SELECT split_part(scope, chr(31), 1) || '/' || (principal LIKE '~%') || '/' || key FROM idempotency_keys",
        )
        .fetch_one(&s.pool)
        .await
        .unwrap();
        assert_eq!(
            key, "payment_events/true/msg_1",
            "keyed by the signed webhook-id"
        );

        // Concurrent copies: every copy 200, one effect.
        let headers = sign.standard_webhooks(&[SECRET], "msg_2", now(), &body);
        let answers = join_all((0..12).map(|_| deliver(&s, path, &body, &headers))).await;
        every_copy_acknowledged_one_ran(&answers);
        assert_eq!(effects(&s, "payments").await, (2, 2));

        // Forged (a guessed secret), stale (ten minutes old), and another id under a
        // genuine signature: nothing claimed.
        deliver(
            &s,
            path,
            &body,
            &sign.standard_webhooks(&[FORGED], "msg_3", now(), &body),
        )
        .await
        .assert_problem(401, "invalid-signature");
        deliver(
            &s,
            path,
            &body,
            &sign.standard_webhooks(&[SECRET], "msg_3", now() - 600, &body),
        )
        .await
        .assert_problem(400, "stale-signature");
        let mut renamed = sign.standard_webhooks(&[SECRET], "msg_3", now(), &body);
        renamed.retain(|(name, _)| name != "webhook-id");
        renamed.push(("webhook-id".into(), "msg_4".into()));
        deliver(&s, path, &body, &renamed)
            .await
            .assert_problem(401, "invalid-signature");
        assert_eq!(effects(&s, "payments").await, (2, 2));

        // Rotation: a sender signing with its next and current secrets, and one still on
        // the previous secret, both verify.
        let rotating = sign.standard_webhooks(&[NEXT, SECRET], "msg_5", now(), &body);
        assert_eq!(deliver(&s, path, &body, &rotating).await.status, 200);
        let previous = sign.standard_webhooks(&[PREVIOUS], "msg_6", now(), &body);
        assert_eq!(deliver(&s, path, &body, &previous).await.status, 200);
        assert_eq!(effects(&s, "payments").await, (4, 4));

        // The same id with another payload: 422, logged, nothing written.
        let before = events.count("mismatch", "422");
        let other = json!({ "type": "payment.failed", "data": {} }).to_string();
        deliver(
            &s,
            path,
            &other,
            &sign.standard_webhooks(&[SECRET], "msg_1", now(), &other),
        )
        .await
        .assert_problem(422, "key-reused");
        assert_eq!(events.count("mismatch", "422"), before + 1);
        assert_eq!(effects(&s, "payments").await, (4, 4));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_deliveries() {
    let events = outcomes();
    let sign = Signers::get();
    with_test_db(async |db| {
        let s = start(db, Duration::from_millis(200)).await;
        let path = "/webhooks/stripe";
        let event = |id: &str, kind: &str| {
            json!({ "id": id, "object": "event", "type": kind, "api_version": "2024-06-20",
                    "data": { "object": { "id": "pi_1", "amount": 500 } } })
            .to_string()
        };
        let header = |signature: String| vec![("Stripe-Signature".to_owned(), signature)];
        let body = event("evt_1", "payment_intent.succeeded");

        let first = deliver(&s, path, &body, &header(sign.stripe(STRIPE, now(), &body))).await;
        assert_eq!(
            first.status,
            200,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        assert_eq!(first.json(), json!({ "received": "evt_1" }));
        let again = deliver(
            &s,
            path,
            &body,
            &header(sign.stripe(STRIPE, now() + 1, &body)),
        )
        .await;
        assert_eq!((again.status, again.replayed()), (200, true));
        assert_eq!(effects(&s, "stripe").await, (1, 1));

        let body = event("evt_2", "payment_intent.succeeded");
        let signed = header(sign.stripe(STRIPE, now(), &body));
        let answers = join_all((0..12).map(|_| deliver(&s, path, &body, &signed))).await;
        every_copy_acknowledged_one_ran(&answers);
        assert_eq!(effects(&s, "stripe").await, (2, 2));

        let body = event("evt_3", "charge.refunded");
        deliver(
            &s,
            path,
            &body,
            &header(sign.stripe("whsec_guessed_0123456789abcdef", now(), &body)),
        )
        .await
        .assert_problem(401, "invalid-signature");
        deliver(
            &s,
            path,
            &body,
            &header(sign.stripe(STRIPE, now() - 600, &body)),
        )
        .await
        .assert_problem(400, "stale-signature");
        assert_eq!(effects(&s, "stripe").await, (2, 2));
        assert_eq!(
            deliver(
                &s,
                path,
                &body,
                &header(sign.stripe(STRIPE_PREVIOUS, now(), &body))
            )
            .await
            .status,
            200,
            "the previous secret still verifies"
        );

        let before = events.count("mismatch", "422");
        let other = event("evt_1", "payment_intent.payment_failed");
        deliver(
            &s,
            path,
            &other,
            &header(sign.stripe(STRIPE, now(), &other)),
        )
        .await
        .assert_problem(422, "key-reused");
        assert_eq!(events.count("mismatch", "422"), before + 1);
        assert_eq!(effects(&s, "stripe").await, (3, 3));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_deliveries() {
    let sign = Signers::get();
    with_test_db(async |db| {
        let s = start(db, Duration::from_millis(200)).await;
        let path = "/webhooks/github";
        let body = json!({ "action": "opened", "number": 7,
                           "repository": { "full_name": "idem-rs/idem" } })
        .to_string();
        let headers = |secret: &str, delivery: &str, body: &str| {
            vec![
                ("X-Hub-Signature-256".to_owned(), sign.github(secret, body)),
                ("X-GitHub-Delivery".to_owned(), delivery.to_owned()),
                ("X-GitHub-Event".to_owned(), "pull_request".to_owned()),
            ]
        };
        let guid = "72d3162e-cc78-11e3-81ab-4c9367dc0958";

        let first = deliver(&s, path, &body, &headers(GITHUB, guid, &body)).await;
        assert_eq!(
            first.status,
            200,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        assert_eq!(
            first.json(),
            json!({ "received": guid, "event": "pull_request" })
        );
        // GitHub's redelivery: the same delivery id and body.
        let again = deliver(&s, path, &body, &headers(GITHUB, guid, &body)).await;
        assert_eq!((again.status, again.replayed()), (200, true));
        // A captured delivery sent again under a fresh id: the id is not signed, the
        // body is, so it is the same delivery.
        let replay = deliver(
            &s,
            path,
            &body,
            &headers(GITHUB, "0f00ba11-0000-4000-8000-000000000000", &body),
        )
        .await;
        assert_eq!((replay.status, replay.replayed()), (200, true));
        assert_eq!(effects(&s, "github").await, (1, 1));

        let body = json!({ "action": "closed", "number": 7 }).to_string();
        let signed = headers(GITHUB, "8a0f8a40-cc78-11e3-81ab-4c9367dc0958", &body);
        let answers = join_all((0..12).map(|_| deliver(&s, path, &body, &signed))).await;
        every_copy_acknowledged_one_ran(&answers);
        assert_eq!(effects(&s, "github").await, (2, 2));

        let body = json!({ "action": "reopened", "number": 7 }).to_string();
        deliver(
            &s,
            path,
            &body,
            &headers("guessed-github-secret-0123", "a1", &body),
        )
        .await
        .assert_problem(401, "invalid-signature");
        assert_eq!(effects(&s, "github").await, (2, 2));
        assert_eq!(
            deliver(&s, path, &body, &headers(GITHUB_PREVIOUS, "a2", &body))
                .await
                .status,
            200,
            "the previous secret still verifies"
        );
        assert_eq!(effects(&s, "github").await, (3, 3));
    })
    .await;
}

/// Each endpoint takes its own provider's scheme only: a genuine delivery of another
/// provider, signed with the very secret the endpoint holds, is refused as malformed
/// before its body is read, and nothing is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheme_is_refused_on_another_providers_endpoint() {
    let sign = Signers::get();
    with_test_db(async |db| {
        let s = start(db, Duration::ZERO).await;
        let body = json!({ "id": "evt_x", "type": "payment.succeeded", "data": {} }).to_string();
        let standard = sign.standard_webhooks(&[SECRET], "msg_x", now(), &body);
        let stripe = vec![(
            "Stripe-Signature".to_owned(),
            sign.stripe(SECRET, now(), &body),
        )];
        let github = vec![("X-Hub-Signature-256".to_owned(), sign.github(SECRET, &body))];
        for (path, headers) in [
            ("/webhooks/payments", &stripe),
            ("/webhooks/payments", &github),
            ("/webhooks/stripe", &standard),
            ("/webhooks/stripe", &github),
            ("/webhooks/github", &standard),
            ("/webhooks/github", &stripe),
        ] {
            let answer = deliver(&s, path, &body, headers).await;
            answer.assert_problem(400, "malformed-signature");
        }
        assert_eq!((s.count("webhook_events").await, s.keys().await), (0, 0));
    })
    .await;
}

// Slack and Shopify, which the example does not take: a service of this test's own.

#[derive(Clone, FromRef)]
struct Hooks {
    idempotency: Store,
    slack: Verifier<Slack>,
    shopify: Verifier<Shopify>,
}

const SLACK: &str = "8f742231b10e8888abcd99yyyzzz85a5";
const SHOPIFY: &str = "shpss_0123456789abcdef0123456789ab";

/// A Slack Events API delivery.
#[derive(Deserialize, Serialize)]
struct SlackEvent {
    event_id: String,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    event: Value,
}

/// Slack signs no id: its Events API deliveries carry `event_id` in the signed body,
/// and a retry (`X-Slack-Retry-Num`) has the same one.
#[idempotent(scope = "slack", ttl = "1h", key = event_id)]
async fn slack_event(mut tx: Tx, Signed(event, ..): Signed<SlackEvent, Slack>) -> Json<Value> {
    record(&mut tx, "slack", &event.kind).await;
    Json(json!({ "ok": event.event_id }))
}

/// Shopify signs only the body, and not its `X-Shopify-Webhook-Id`: keyed by the body.
#[idempotent(scope = "shopify", ttl = "1h", key = digest(body))]
async fn shopify_event(mut tx: Tx, Signed(order, ..): Signed<Value, Shopify>) -> Json<Value> {
    record(&mut tx, "shopify", &order["id"].to_string()).await;
    Json(json!({ "ok": order["id"] }))
}

async fn record(tx: &mut Tx<'_>, provider: &str, what: &str) {
    sqlx::query("INSERT INTO deliveries (provider, what) VALUES ($1, $2)")
        .bind(provider)
        .bind(what)
        .execute(&mut **tx)
        .await
        .expect("insert");
}

async fn hooks(db: &TestDb) -> TestApp {
    let pool = db.pool(10).await;
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE deliveries (provider text NOT NULL, what text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let app = Router::new()
        .route("/slack", post(slack_event))
        .route("/shopify", post(shopify_event))
        .with_state(Hooks {
            idempotency: store,
            slack: Verifier::new(SLACK).unwrap(),
            shopify: Verifier::new(SHOPIFY).unwrap(),
        });
    TestApp::serve(pool, app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slack_and_shopify_deliveries() {
    let sign = Signers::get();
    with_test_db(async |db| {
        let s = hooks(db).await;
        let body = json!({ "token": "unused", "team_id": "T1DC2JH3J", "type": "event_callback",
                           "event_id": "Ev08MFMKH6", "event_time": 1_531_420_618,
                           "event": { "type": "app_mention", "text": "hi" } })
        .to_string();
        let first = deliver(&s, "/slack", &body, &sign.slack(SLACK, now(), &body)).await;
        assert_eq!(
            first.status,
            200,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        // Slack's retry, signed afresh, with its retry headers.
        let mut retry = sign.slack(SLACK, now() + 1, &body);
        retry.push(("X-Slack-Retry-Num".into(), "1".into()));
        retry.push(("X-Slack-Retry-Reason".into(), "http_timeout".into()));
        let again = deliver(&s, "/slack", &body, &retry).await;
        assert_eq!((again.status, again.replayed()), (200, true));
        deliver(
            &s,
            "/slack",
            &body,
            &sign.slack("0000000000000000forged0000000000", now(), &body),
        )
        .await
        .assert_problem(401, "invalid-signature");
        deliver(&s, "/slack", &body, &sign.slack(SLACK, now() - 600, &body))
            .await
            .assert_problem(400, "stale-signature");
        assert_eq!(s.count("deliveries WHERE provider = 'slack'").await, 1);

        let order = json!({ "id": 820_982_911_946_154_508_u64, "email": "jon@example.com",
                            "total_price": "199.65" })
        .to_string();
        let headers = |secret: &str, id: &str| {
            vec![
                (
                    "X-Shopify-Hmac-SHA256".to_owned(),
                    sign.shopify(secret, &order),
                ),
                ("X-Shopify-Topic".to_owned(), "orders/create".to_owned()),
                ("X-Shopify-Webhook-Id".to_owned(), id.to_owned()),
            ]
        };
        let first = deliver(
            &s,
            "/shopify",
            &order,
            &headers(SHOPIFY, "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043"),
        )
        .await;
        assert_eq!(
            first.status,
            200,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        // A redelivery, and the captured delivery under a fresh (unsigned) webhook id.
        for id in [
            "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
            "00000000-0000-4000-8000-000000000000",
        ] {
            let again = deliver(&s, "/shopify", &order, &headers(SHOPIFY, id)).await;
            assert_eq!((again.status, again.replayed()), (200, true));
        }
        deliver(
            &s,
            "/shopify",
            &order,
            &headers("shpss_forged_0123456789abcdef", "x"),
        )
        .await
        .assert_problem(401, "invalid-signature");
        assert_eq!(s.count("deliveries WHERE provider = 'shopify'").await, 1);
    })
    .await;
}
