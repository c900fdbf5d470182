//! A request's identity (ARCHITECTURE.md, invariants 8 and 9; issue 27, findings 1, 2, 4, 5):
//! a signed delivery is named by what its signature covers, whatever unsigned header
//! comes with it; a tenant read from a body never names an authenticated principal's
//! record; one principal spelled two ways is one principal; and a change of where keys
//! are kept (a spread added or changed, the mode changed) keeps every live record
//! answering its retries. Against a real PostgreSQL, over real HTTP.

use std::time::Duration;

use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use futures::future::join_all;
use idem::schema::PrincipalType;
use idem::webhook::{Signed, StandardWebhooks, Verifier};
use idem::{idempotent, Store, StoreBuilder, Tx};
use idem_tests::{count, migrated_store, send, with_test_db, Answer, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[derive(Clone, FromRef)]
struct State {
    store: Store,
    payments: Verifier<StandardWebhooks>,
}

#[derive(Deserialize, Serialize)]
struct Event {
    id: String,
    #[serde(default)]
    account: Option<String>,
    amount: i64,
}

fn account_of(event: &Event) -> Option<&str> {
    event.account.as_deref()
}

#[derive(Deserialize, Serialize)]
struct Payment {
    amount: i64,
}

/// One effect of a request, written in its transaction.
async fn act(tx: &mut Tx<'_>, what: &str) -> Json<Value> {
    sqlx::query("INSERT INTO effects (what) VALUES ($1)")
        .bind(what)
        .execute(&mut **tx)
        .await
        .unwrap();
    Json(json!({ "principal": tx.principal(), "derived": tx.derived_key("processor") }))
}

#[idempotent(scope = "payments", key = header("webhook-id"))]
async fn payment(mut tx: Tx, Signed(p, ..): Signed<Payment, StandardWebhooks>) -> Json<Value> {
    act(&mut tx, &format!("payment {}", p.amount)).await
}

// One scope, three ways to keep its keys: the same endpoint before and after a change.
#[idempotent(scope = "events", key = id)]
async fn events_plain(mut tx: Tx, Json(e): Json<Event>) -> Json<Value> {
    act(&mut tx, &e.id).await
}

#[idempotent(scope = "events", key = id, spread = key)]
async fn events_by_key(mut tx: Tx, Json(e): Json<Event>) -> Json<Value> {
    act(&mut tx, &e.id).await
}

#[idempotent(scope = "events", key = id, spread = account_of)]
async fn events_by_account(mut tx: Tx, Json(e): Json<Event>) -> Json<Value> {
    act(&mut tx, &e.id).await
}

/// A handler that calls an outside service: the call is recorded outside the request's
/// transaction (`outside`), as a payment processor would see it, with its derived key.
#[idempotent(scope = "calls", key = id)]
async fn call_outside(
    tx: Tx,
    axum::extract::State(outside): axum::extract::State<Outside>,
    Json(e): Json<Event>,
) -> Json<Value> {
    let derived = tx.derived_key("processor");
    sqlx::query("INSERT INTO outside_calls (derived) VALUES ($1)")
        .bind(&derived)
        .execute(&outside.0)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(e.amount as u64)).await;
    Json(json!({ "derived": derived }))
}

#[derive(Clone)]
struct Outside(PgPool);

#[derive(Clone, FromRef)]
struct CallState {
    store: Store,
    outside: Outside,
}

async fn tables(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE effects (what text NOT NULL);
         CREATE TABLE outside_calls (derived text);",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// `Authorization: Bearer <principal>` as the store's principal, `X-Account` otherwise.
fn resolving(pool: PgPool) -> StoreBuilder {
    Store::builder(pool).principal(|parts| {
        let header = |name: &str| parts.headers.get(name)?.to_str().ok();
        header("authorization")
            .and_then(|a| a.strip_prefix("Bearer "))
            .or_else(|| header("x-account"))
            .map(str::to_owned)
    })
}

async fn serve(db: &TestDb, store: StoreBuilder, routes: Router<State>) -> TestApp {
    let pool = db.pool(10).await;
    let store = store.build().unwrap();
    store.migrate().await.unwrap();
    let payments = Verifier::new(SECRET).unwrap();
    TestApp::serve(pool, routes.with_state(State { store, payments })).await
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Regression (issue 27, 1): a captured Standard Webhooks delivery sent again with
/// another `X-Account` took that header as its principal and ran again each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_signed_delivery_acts_once_under_any_unsigned_header() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        tables(&pool).await;
        for strict in [false, true] {
            let mut store = resolving(pool.clone());
            if strict {
                store = store.require_principal(true);
            }
            let s = serve(db, store, Router::new().route("/payments", post(payment))).await;
            let body = json!({ "amount": 500 }).to_string();
            let id = format!("msg_strict_{strict}");
            let signed = Verifier::<StandardWebhooks>::new(SECRET).unwrap().sign(
                &id,
                now(),
                body.as_bytes(),
            );
            let mut answers = Vec::new();
            for account in [None, Some("acct_1"), Some("acct_2"), Some("acct_3")] {
                let mut headers = signed.clone();
                if let Some(account) = account {
                    headers.push((http_name("x-account"), account.to_owned()));
                }
                let headers = headers.iter().map(|(n, v)| (n, v));
                answers.push(s.deliver_to("/payments", &body, headers).await);
            }
            for (i, answer) in answers.iter().enumerate() {
                assert_eq!(answer.status, 200, "strict {strict}, copy {i}: {answer:?}");
                assert_eq!(answer.replayed(), i > 0, "strict {strict}, copy {i}");
                assert_eq!(
                    answer.json()["principal"],
                    "",
                    "no principal of the header's"
                );
            }
        }
        assert_eq!(count(&pool, "effects").await, 2, "one effect per delivery");
    })
    .await;
}

fn http_name(name: &'static str) -> axum::http::HeaderName {
    axum::http::HeaderName::from_static(name)
}

/// Posts `body` to `path`, as `principal` if given.
async fn post_as(s: &TestApp, path: &str, body: &Value, principal: Option<&str>) -> Answer {
    let mut request = s.client.post(s.url(path)).json(body);
    if let Some(principal) = principal {
        request = request.bearer_auth(principal);
    }
    send(request).await
}

/// Regression (issue 27, 5): an anonymous request whose body named account X was kept
/// in X's namespace: X's own request with that key replayed the stranger's answer, and
/// a stranger who knew X's key and body read X's stored response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_named_by_a_body_never_shares_an_authenticated_record() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        tables(&pool).await;
        let routes = Router::new().route("/events", post(events_by_account));
        let s = serve(db, resolving(pool.clone()), routes).await;
        let body = |id: &str| json!({ "id": id, "account": "acct_1", "amount": 5 });

        // X first, then a stranger naming X with X's key and body.
        let own = post_as(&s, "/events", &body("k1"), Some("acct_1")).await;
        let stranger = post_as(&s, "/events", &body("k1"), None).await;
        assert_eq!(own.status, 200);
        assert!(
            !stranger.replayed(),
            "a stranger read acct_1's stored response"
        );
        // A stranger first, then X.
        let stranger = post_as(&s, "/events", &body("k2"), None).await;
        let own = post_as(&s, "/events", &body("k2"), Some("acct_1")).await;
        assert!(!stranger.replayed());
        assert!(!own.replayed(), "acct_1 was answered a stranger's response");
        // Each is its own request, and each replays its own.
        assert!(post_as(&s, "/events", &body("k2"), Some("acct_1"))
            .await
            .replayed());
        assert!(post_as(&s, "/events", &body("k2"), None).await.replayed());
        assert_eq!(count(&pool, "effects").await, 4);
    })
    .await;
}

/// Regression (issue 27, 4): with a `uuid` principal column, one principal in lower and
/// upper case took two locks: both copies ran, and the processor got two keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_principal_spelled_two_ways_is_one_request() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        tables(&pool).await;
        let store = resolving(pool.clone())
            .principal_type(PrincipalType::Uuid)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/calls", post(call_outside))
            .with_state(CallState {
                store,
                outside: Outside(pool.clone()),
            });
        let s = TestApp::serve(pool.clone(), app).await;
        let lower = "3f2504e0-4f89-41d3-9a0c-0305e82c3301";
        let upper = lower.to_uppercase();
        let braced = format!("{{{lower}}}");
        let body = json!({ "id": "k1", "amount": 400 });
        let answers = join_all(
            [lower, &upper, &braced].map(|principal| post_as(&s, "/calls", &body, Some(principal))),
        )
        .await;
        let ran = answers.iter().filter(|a| a.status == 200 && !a.replayed());
        assert_eq!(ran.count(), 1, "{answers:?}");
        for answer in &answers {
            assert!(answer.status == 409 || answer.status == 200, "{answer:?}");
        }
        let again = post_as(&s, "/calls", &body, Some(&upper)).await;
        assert!(again.replayed());
        let derived: Vec<String> = sqlx::query_scalar("SELECT DISTINCT derived FROM outside_calls")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(derived.len(), 1, "one call, one derived key: {derived:?}");
        assert_eq!(again.json()["derived"], derived[0]);
    })
    .await;
}

/// The same endpoint before and after a change of where its keys are kept, as two
/// instances of the service on one database.
async fn change(db: &TestDb, portable: bool, before: Router<State>, after: Router<State>) {
    let pool = db.pool(2).await;
    let store = |pool: PgPool| {
        let builder = Store::builder(pool);
        if portable {
            builder.portable(true)
        } else {
            builder
        }
    };
    let first = serve(db, store(pool.clone()), before).await;
    let event = json!({ "id": "evt_1", "account": "acct_1", "amount": 5 });
    let answered = post_as(&first, "/events", &event, None).await;
    assert_eq!(answered.status, 200);
    drop(first);
    let second = serve(db, store(pool.clone()), after).await;
    let retry = post_as(&second, "/events", &event, None).await;
    assert!(
        retry.replayed(),
        "portable {portable}: the retry ran again: {retry:?}"
    );
    assert_eq!(retry.body, answered.body);
    let changed = json!({ "id": "evt_1", "account": "acct_1", "amount": 6 });
    post_as(&second, "/events", &changed, None)
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(count(&pool, "effects").await, 1);
}

/// Regression (issue 27, 2): an endpoint that gained `spread = tenant_fn` (as the guide
/// suggests), or whose `spread = key` became a tenant function, ran a retry of an event
/// taken before the change again, in the portable and in the default mode; so did going
/// back from a hash to none. (A tenant function removed is not covered: nothing finds the
/// tenant then; the guide's "Changing where keys are kept" says to keep it until its records expire.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_spread_keeps_answering_earlier_records() {
    let plain = || Router::new().route("/events", post(events_plain));
    let by_key = || Router::new().route("/events", post(events_by_key));
    let by_account = || Router::new().route("/events", post(events_by_account));
    for portable in [false, true] {
        for (before, after) in [
            (plain(), by_account()),
            (by_key(), by_account()),
            (plain(), by_key()),
            (by_key(), plain()),
        ] {
            with_test_db(async |db| {
                tables(&db.pool(1).await).await;
                change(db, portable, before, after).await;
            })
            .await;
        }
    }
}

/// Regression (issue 27, 2): a consumer that gained `.spread_by(..)` booked a
/// redelivery of a message taken before the change again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_gains_a_spread_keeps_answering_earlier_records() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        tables(&pool).await;
        for portable in [false, true] {
            let store = migrated_store(pool.clone(), portable).await;
            let id = format!("msg_{portable}");
            let book = async |tenant: Option<&str>| {
                let mut once = store.run_once("ledger", &id).payload(&5);
                if let Some(tenant) = tenant {
                    once = once.spread_by(tenant);
                }
                once.run(async |mut tx| {
                    let _ = act(&mut tx, "booked").await;
                    Ok::<_, sqlx::Error>(5)
                })
                .await
                .unwrap()
            };
            book(None).await;
            book(Some("acct_1")).await;
        }
        assert_eq!(count(&pool, "effects").await, 2, "one booking per message");
        // A scope with a control character would be stored where a spread is.
        let refused = Store::new(pool.clone())
            .run_once("ledger\u{1f}key", "m")
            .run(async |_tx| Ok::<_, sqlx::Error>(()))
            .await;
        assert!(matches!(refused, Err(idem::jobs::OnceError::Scope(_))));
    })
    .await;
}

/// Regression (issue 27, 8): a correctly signed Standard Webhooks delivery with an id of
/// 256 bytes, or with a tab, was verified and then refused with 400 by the key rules, on
/// every redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_id_the_key_rules_would_refuse_is_acted_on_once() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        tables(&pool).await;
        let routes = Router::new().route("/payments", post(payment));
        let s = serve(db, Store::builder(pool.clone()), routes).await;
        let body = json!({ "amount": 7 }).to_string();
        let verifier = Verifier::<StandardWebhooks>::new(SECRET).unwrap();
        for id in ["m".repeat(256), "msg\t1".to_owned()] {
            for copy in 0..2 {
                let headers = verifier.sign(&id, now(), body.as_bytes());
                let headers = headers.iter().map(|(n, v)| (n, v));
                let answer = s.deliver_to("/payments", &body, headers).await;
                assert_eq!(answer.status, 200, "{id:?}: {answer:?}");
                assert_eq!(answer.replayed(), copy == 1, "{id:?}");
            }
        }
        assert_eq!(count(&pool, "effects").await, 2);
    })
    .await;
}
