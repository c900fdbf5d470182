//! Keys without a principal spread by what they are about (issue 23), on plain
//! PostgreSQL: `#[idempotent(spread = ..)]` and `RunOnce::spread_by{,_key}` keep such
//! keys under the tenant the event concerns or a hash of the key, instead of the one
//! "nobody" value that a distributed engine puts on one shard; without the option, a
//! portable store keeps them under a hash of the key, the other modes as before. The example's webhooks and ledger use it, in the default and the
//! portable mode. (On Citus: `tests/tests/citus.rs`.)

use std::collections::BTreeSet;

use axum::extract::FromRef;
use axum::routing::post;
use axum::{Json, Router};
use charges::consumer::{self, Credit};
use charges::Config;
use futures::future::join_all;
use idem::schema::PrincipalType;
use idem::webhook::{GitHub, StandardWebhooks, Stripe, Verifier};
use idem::{idempotent, Store, Tx};
use idem_tests::{send, with_test_db, Answer, TestApp};
use serde_json::{json, Value};
use sqlx::PgPool;

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// One delivery to each of the example's webhook endpoints, `copies` concurrent copies
/// each: a refund event naming acct_1's charge, a payment event naming no account, a
/// Stripe event and a GitHub delivery. Every copy is answered 200.
async fn deliver_all(s: &TestApp, charge_id: &str, copies: usize) {
    let t = now();
    let refund = json!({ "type": "charge.refunded",
                         "data": { "account": "acct_1", "charge_id": charge_id } })
    .to_string();
    let payment = json!({ "type": "payment.succeeded", "data": { "amount": 5 } }).to_string();
    let stripe = json!({ "id": "evt_s1", "type": "charge.succeeded" }).to_string();
    let github = json!({ "action": "opened", "number": 7 }).to_string();
    let payments = Verifier::<StandardWebhooks>::new(charges::TEST_WEBHOOK_SECRET).unwrap();
    let mut sends = Vec::new();
    for _ in 0..copies {
        sends.push(s.deliver_to(
            "/webhooks/payments",
            &refund,
            payments.sign("msg_refund", t, refund.as_bytes()),
        ));
        sends.push(s.deliver_to(
            "/webhooks/payments",
            &payment,
            payments.sign("msg_pay", t, payment.as_bytes()),
        ));
        sends.push(
            s.deliver_to(
                "/webhooks/stripe",
                &stripe,
                Verifier::<Stripe>::new(charges::TEST_STRIPE_SECRET)
                    .unwrap()
                    .sign("", t, stripe.as_bytes()),
            ),
        );
        sends.push(
            s.deliver_to(
                "/webhooks/github",
                &github,
                Verifier::<GitHub>::new(charges::TEST_GITHUB_SECRET)
                    .unwrap()
                    .sign("", t, github.as_bytes()),
            ),
        );
    }
    for answer in join_all(sends).await {
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    }
}

/// (scope, principal) of every stored key but the charges', the scope as the endpoint
/// names it (a spread key's stored scope is marked, `identity.rs`).
async fn webhook_keys(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT split_part(scope, chr(31), 1), principal FROM idempotency_keys WHERE scope <> 'charges' ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The example's webhooks, in the default mode and the portable one: each key is kept
/// under the account its event names, else a hash of its own, never under `''`; the
/// event's row is kept under the same value (the distribution column of
/// `webhook_events`), and concurrent copies still take effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_webhook_keys_spread_by_account_or_key_in_both_modes() {
    for portable in [false, true] {
        with_test_db(async |db| {
            let config = Config {
                portable,
                ..Config::default()
            };
            let s = TestApp::charges(db, 20, config).await;
            let charge = s
                .post_with(
                    "/charges",
                    Some("c1"),
                    &json!({ "amount": 100, "currency": "usd", "customer": "cus_1" }),
                    &[("authorization", "Bearer acct_1")],
                )
                .await;
            let charge_id = charge.json()["id"].as_str().unwrap().to_owned();
            deliver_all(&s, &charge_id, 4).await;
            // And again: every one a replay of the first.
            deliver_all(&s, &charge_id, 1).await;

            let keys = webhook_keys(&s.pool).await;
            assert_eq!(keys.len(), 4, "{keys:?}");
            let refund = keys
                .iter()
                .filter(|(scope, _)| scope == "payment_events")
                .map(|(_, p)| p.as_str())
                .collect::<BTreeSet<_>>();
            assert!(
                refund.contains("acct_1"),
                "kept on the account's shard: {keys:?}"
            );
            for (scope, principal) in &keys {
                assert!(
                    !principal.is_empty(),
                    "{scope}: no key keeps the nobody value"
                );
                assert!(
                    principal == "acct_1" || (principal.starts_with('~') && principal.len() == 17),
                    "{scope}: {principal}"
                );
            }
            let tenants: BTreeSet<String> = sqlx::query_scalar("SELECT tenant FROM webhook_events")
                .fetch_all(&s.pool)
                .await
                .unwrap()
                .into_iter()
                .collect();
            let principals: BTreeSet<String> = keys.into_iter().map(|(_, p)| p).collect();
            assert_eq!(tenants, principals, "each event's row beside its key");
            assert_eq!(
                s.count("webhook_events").await,
                4,
                "once each (portable: {portable})"
            );
            let refunded: bool =
                sqlx::query_scalar("SELECT refunded_by_provider FROM charges WHERE id = $1")
                    .bind(&charge_id)
                    .fetch_one(&s.pool)
                    .await
                    .unwrap();
            assert!(refunded);
        })
        .await;
    }
}

#[derive(Clone, FromRef)]
struct State {
    store: Store,
}

#[derive(serde::Deserialize, serde::Serialize)]
struct Event {
    id: String,
    #[serde(default)]
    account: Option<String>,
}

fn account_of(event: &Event) -> Option<&str> {
    event.account.as_deref()
}

#[idempotent(scope = "plain", key = id)]
async fn plain(tx: Tx, Json(_event): Json<Event>) -> Json<Value> {
    Json(json!({ "principal": tx.principal() }))
}

#[idempotent(scope = "by_account", key = id, spread = account_of)]
async fn by_account(tx: Tx, Json(_event): Json<Event>) -> Json<Value> {
    Json(json!({ "principal": tx.principal() }))
}

#[idempotent(scope = "by_key", key = id, spread = key)]
async fn by_key(tx: Tx, Json(_event): Json<Event>) -> Json<Value> {
    Json(json!({ "principal": tx.principal() }))
}

/// The option on an endpoint of one's own: without it the key keeps the nobody value,
/// as before; with it, the value the handler sees in `tx.principal()` is the one stored.
/// A spread key is still global to its scope: the same id with another payload is 422.
/// A principal from the store's resolver wins over the spread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_spreads_only_when_it_says_so_and_a_principal_wins() {
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::builder(pool.clone())
            .principal(|parts| {
                let auth = parts.headers.get("authorization")?.to_str().ok()?;
                auth.strip_prefix("Bearer ").map(str::to_owned)
            })
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let app = Router::new()
            .route("/plain", post(plain))
            .route("/by_account", post(by_account))
            .route("/by_key", post(by_key))
            .with_state(State { store });
        let s = TestApp::serve(pool.clone(), app).await;
        let call = async |path: &str, body: Value, auth: Option<&str>| {
            let mut request = s.client.post(s.url(path)).json(&body);
            if let Some(auth) = auth {
                request = request.bearer_auth(auth);
            }
            send(request).await
        };
        let principal = |a: &Answer| a.json()["principal"].as_str().unwrap().to_owned();

        let plain = call("/plain", json!({ "id": "e1" }), None).await;
        assert_eq!(principal(&plain), "", "unchanged without the option");
        let named = call(
            "/by_account",
            json!({ "id": "e1", "account": "acct_7" }),
            None,
        )
        .await;
        assert_eq!(principal(&named), "acct_7");
        let unnamed = call("/by_account", json!({ "id": "e2" }), None).await;
        let hashed = principal(&unnamed);
        assert!(hashed.starts_with('~'), "{hashed}");
        let by_key = call("/by_key", json!({ "id": "e2" }), None).await;
        assert_eq!(principal(&by_key), hashed, "the same hash of the same key");
        let again = call("/by_key", json!({ "id": "e2" }), None).await;
        assert!(again.replayed());
        call("/by_key", json!({ "id": "e2", "account": "x" }), None)
            .await
            .assert_problem(422, "key-reused");
        let resolved = call("/by_key", json!({ "id": "e3" }), Some("acct_9")).await;
        assert_eq!(principal(&resolved), "acct_9", "a request's principal wins");

        let stored: Vec<(String, String)> = sqlx::query_as(
            "SELECT split_part(scope, chr(31), 1), principal FROM idempotency_keys ORDER BY 1, key, principal",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(
            stored,
            [
                ("by_account".to_owned(), "acct_7".to_owned()),
                ("by_account".to_owned(), hashed.clone()),
                ("by_key".to_owned(), hashed.clone()),
                ("by_key".to_owned(), "acct_9".to_owned()),
                ("plain".to_owned(), String::new()),
            ]
        );
    })
    .await;
}

/// `run_once`: `spread_by(tenant)` keeps the key under the tenant, `spread_by_key()`
/// under a hash of the key (of the principal column's type), neither under the nobody
/// value as before; `tx.principal()` gives the value to the work. The example's ledger
/// consumer keeps each credit on its account.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_once_spreads_by_tenant_or_key() {
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::builder(pool.clone())
            .principal_type(PrincipalType::Uuid)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let tenant = "6f1c8a52-3b7e-4a59-9a1d-2f0c5e9b7d41";
        let seen = async |once: idem::jobs::RunOnce<'_>| -> String {
            once.run(async |tx| Ok::<_, sqlx::Error>(tx.principal().unwrap().to_owned()))
                .await
                .unwrap()
        };
        assert_eq!(
            seen(store.run_once("jobs", "m1").spread_by(tenant)).await,
            tenant
        );
        let hashed = seen(store.run_once("jobs", "m2").spread_by_key()).await;
        assert_eq!(hashed.len(), 36, "a UUID: {hashed}");
        assert_ne!(hashed, "00000000-0000-0000-0000-000000000000");
        // A tenant that is not a UUID cannot key this column: the key's hash instead.
        assert_eq!(
            seen(store.run_once("jobs", "m2").spread_by("acct_1")).await,
            hashed
        );
        let plain = seen(store.run_once("jobs", "m3")).await;
        assert_eq!(
            plain, "",
            "no spread: the nobody value, stored as the nil UUID"
        );
        let stored: Vec<(String, String)> =
            sqlx::query_as("SELECT key, principal::text FROM idempotency_keys ORDER BY key")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            stored,
            [
                ("m1".to_owned(), tenant.to_owned()),
                ("m2".to_owned(), hashed.clone()),
                (
                    "m3".to_owned(),
                    "00000000-0000-0000-0000-000000000000".to_owned()
                ),
            ]
        );
    })
    .await;

    with_test_db(async |db| {
        let pool = db.pool(5).await;
        charges::migrate(&pool).await.unwrap();
        let store = charges::store(pool.clone(), &Config::default());
        let credit = Credit {
            message_id: "m-1".into(),
            account: "acct_3".into(),
            amount: 5,
        };
        for _ in 0..3 {
            assert_eq!(consumer::handle(&store, &credit).await.unwrap().balance, 5);
        }
        let keys: Vec<(String, String)> =
            sqlx::query_as("SELECT principal, key FROM idempotency_keys")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(keys, [("acct_3".to_owned(), "m-1".to_owned())]);
    })
    .await;
}

/// A portable store keeps every key without a principal under a hash of the key, with no
/// option on the endpoint or the consumer: no key shares one shard by construction. A
/// key kept before that, under the nobody value (by an earlier version, or by a store of
/// the default mode), is still answered from there until it expires: a retry after the
/// upgrade replays, or is a 422, and never runs again; once expired, the key runs under
/// its spread. (The default mode keeps the nobody value: the tests above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portable_store_spreads_every_key_and_answers_records_kept_before() {
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let runs = std::sync::atomic::AtomicUsize::new(0);
        let once = async |store: &Store, key: &str, n: u32, ttl: u64| {
            store
                .run_once("jobs", key)
                .payload(&json!({ "n": n }))
                .ttl(std::time::Duration::from_secs(ttl))
                .run(async |tx| {
                    let run = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    Ok::<_, sqlx::Error>((run, tx.principal().unwrap().to_owned()))
                })
                .await
        };
        let before = Store::new(pool.clone());
        before.migrate().await.unwrap();
        assert_eq!(once(&before, "m1", 1, 60).await.unwrap(), (1, String::new()));
        assert_eq!(once(&before, "m2", 1, 1).await.unwrap(), (2, String::new()));

        let after = Store::builder(pool.clone()).portable(true).build().unwrap();
        assert_eq!(
            once(&after, "m1", 1, 60).await.unwrap(),
            (1, String::new()),
            "the record kept before the upgrade is replayed"
        );
        assert!(
            matches!(
                once(&after, "m1", 2, 60).await,
                Err(idem::jobs::OnceError::Mismatch)
            ),
            "and its payload still decides"
        );
        let (run, fresh) = once(&after, "m3", 1, 60).await.unwrap();
        assert_eq!(run, 3);
        assert!(fresh.starts_with('~') && fresh.len() == 17, "{fresh}");
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        let (run, expired) = once(&after, "m2", 1, 60).await.unwrap();
        assert_eq!(run, 4, "an expired record kept before runs again");
        assert!(expired.starts_with('~'), "{expired}");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 4);

        let app = Router::new()
            .route("/plain", post(plain))
            .with_state(State {
                store: after.clone(),
            });
        let s = TestApp::serve(pool.clone(), app).await;
        let answer = send(s.client.post(s.url("/plain")).json(&json!({ "id": "e1" }))).await;
        let principal = answer.json()["principal"].as_str().unwrap().to_owned();
        assert_eq!(principal, fresh_hash(&after, "e1").await);

        // An operator finds each key with no principal given, wherever it is kept, the
        // live record before the expired one in either mode.
        for store in [&after, &before] {
            for key in ["m1", "m2", "m3"] {
                let record = store.inspect("jobs", "", key).await.unwrap();
                assert!(record.is_some_and(|r| !r.expired), "{key}");
            }
            assert!(store.inspect("jobs", "", "m4").await.unwrap().is_none());
        }

        // A key derives the same downstream key wherever it is kept: an attempt that
        // failed before the upgrade and runs after it calls the processor with the same
        // idempotency key.
        let failed = before
            .run_once("jobs", "m5")
            .run(async |tx| Err::<(), _>(tx.derived_key("processor").unwrap()))
            .await;
        let Err(idem::jobs::OnceError::Work(derived)) = failed else {
            panic!("the work failed");
        };
        let after_upgrade = after
            .run_once("jobs", "m5")
            .run(async |tx| {
                Ok::<_, sqlx::Error>((
                    tx.principal().unwrap().to_owned(),
                    tx.derived_key("processor").unwrap(),
                ))
            })
            .await
            .unwrap();
        assert!(after_upgrade.0.starts_with('~'));
        assert_eq!(after_upgrade.1, derived);

        let stored: Vec<(String, String)> =
            sqlx::query_as("SELECT key, principal FROM idempotency_keys WHERE split_part(scope, chr(31), 1) <> 'probe' ORDER BY key, principal")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            stored,
            [
                ("e1".to_owned(), principal),
                ("m1".to_owned(), String::new()),
                ("m2".to_owned(), String::new()),
                ("m2".to_owned(), expired),
                ("m3".to_owned(), fresh),
                ("m5".to_owned(), after_upgrade.0),
            ]
        );
    })
    .await;
}

/// The value a portable store keeps `key` under in scope "probe": what `run_once`
/// hands its work.
async fn fresh_hash(store: &Store, key: &str) -> String {
    store
        .run_once("probe", key)
        .run(async |tx| Ok::<_, sqlx::Error>(tx.principal().unwrap().to_owned()))
        .await
        .unwrap()
}
