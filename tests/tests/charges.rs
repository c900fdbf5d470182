//! The charges example against a real PostgreSQL, over real HTTP: every row of the
//! contract table, as a client sees it.

use std::collections::HashSet;
use std::time::Duration;

use charges::Config;
use futures::future::join_all;
use idem_tests::{send, with_test_db, Answer, TestApp, TestDb};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The example's API, as its clients call it.
trait ChargesApi {
    /// `POST /charges` as `account`.
    async fn charge(&self, account: &str, key: &str, body: &Value) -> Answer;
    /// A charge whose JSON body is sent as written.
    async fn charge_text(&self, account: &str, key: &str, body: &'static str) -> Answer;
    /// `POST /charges/{charge_id}/refunds` as `account`.
    async fn refund(&self, account: &str, charge_id: &str, key: &str, amount: i64) -> Answer;
}

impl ChargesApi for TestApp {
    async fn charge(&self, account: &str, key: &str, body: &Value) -> Answer {
        let bearer = format!("Bearer {account}");
        self.post_with("/charges", Some(key), body, &[("authorization", &bearer)])
            .await
    }

    async fn charge_text(&self, account: &str, key: &str, body: &'static str) -> Answer {
        send(
            self.client
                .post(self.url("/charges"))
                .bearer_auth(account)
                .header("Idempotency-Key", key)
                .header("Content-Type", "application/json")
                .body(body),
        )
        .await
    }

    async fn refund(&self, account: &str, charge_id: &str, key: &str, amount: i64) -> Answer {
        let path = format!("/charges/{charge_id}/refunds");
        let bearer = format!("Bearer {account}");
        let body = json!({ "amount": amount });
        self.post_with(&path, Some(key), &body, &[("authorization", &bearer)])
            .await
    }
}

async fn start(db: &TestDb) -> TestApp {
    TestApp::charges(db, 10, Config::default()).await
}

/// The example with its "processor" taking `delay` inside the charge's transaction.
async fn start_with_processor_delay(db: &TestDb, delay: Duration) -> TestApp {
    let config = Config {
        processor_delay: delay,
        ..Config::default()
    };
    TestApp::charges(db, 10, config).await
}

fn new_charge(amount: i64) -> Value {
    json!({ "amount": amount, "currency": "usd", "customer": "cus_1", "description": "first" })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_call_creates_one_charge() {
    with_test_db(async |db| {
        let s = start(db).await;
        let a = s.charge("acct_1", "k1", &new_charge(500)).await;
        assert_eq!(a.status, 201);
        assert!(!a.replayed());
        let charge = a.json();
        assert_eq!(charge["account"], "acct_1");
        assert_eq!(charge["amount"], 500);
        assert_eq!(charge["currency"], "usd");
        assert_eq!(charge["customer"], "cus_1");
        assert_eq!(charge["description"], "first");
        assert!(charge["created_at"].as_str().unwrap().ends_with('Z'));
        let id = charge["id"].as_str().unwrap();
        assert_eq!(
            a.header("location"),
            Some(format!("/charges/{id}").as_str())
        );
        assert_eq!(s.count("charges").await, 1);

        let expiry: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM expires_at - created_at)::float8 FROM idempotency_keys",
        )
        .fetch_one(&s.pool)
        .await
        .unwrap();
        // ttl = "24h", counted from the commit: the claim's time plus the handler's.
        assert!(
            (24.0 * 3600.0..24.0 * 3600.0 + 10.0).contains(&expiry),
            "expires_at - created_at = {expiry} s"
        );

        let read = send(
            s.client
                .get(s.url(&format!("/charges/{id}")))
                .bearer_auth("acct_1"),
        )
        .await;
        assert_eq!(read.status, 200);
        assert_eq!(read.json(), charge);
        let other = send(
            s.client
                .get(s.url(&format!("/charges/{id}")))
                .bearer_auth("acct_2"),
        )
        .await;
        other.assert_problem(404, "not-found");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_replays_the_identical_response() {
    with_test_db(async |db| {
        let s = start(db).await;
        let first = s.charge("acct_1", "k1", &new_charge(500)).await;
        let second = s.charge("acct_1", "k1", &new_charge(500)).await;
        // The quoted (RFC 8941) spelling is the same key.
        let third = s.charge("acct_1", "\"k1\"", &new_charge(500)).await;
        for replay in [&second, &third] {
            assert_eq!(replay.status, first.status);
            assert_eq!(replay.body, first.body, "byte for byte");
            assert_eq!(replay.header("location"), first.header("location"));
            assert_eq!(replay.header("content-type"), first.header("content-type"));
            assert!(replay.replayed());
        }
        assert_eq!(s.count("charges").await, 1);
        assert_eq!(s.keys().await, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_key_is_another_charge() {
    with_test_db(async |db| {
        let s = start(db).await;
        let a = s.charge("acct_1", "k1", &new_charge(500)).await;
        let b = s.charge("acct_1", "k2", &new_charge(500)).await;
        assert_eq!((a.status, b.status), (201, 201));
        assert_ne!(a.json()["id"], b.json()["id"]);
        assert_eq!(s.count("charges").await, 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_with_other_semantic_fields_is_refused() {
    with_test_db(async |db| {
        let s = start(db).await;
        s.charge("acct_1", "k1", &new_charge(500)).await;
        for changed in [
            json!({ "amount": 501, "currency": "usd", "customer": "cus_1" }),
            json!({ "amount": 500, "currency": "eur", "customer": "cus_1" }),
            json!({ "amount": 500, "currency": "usd", "customer": "cus_2" }),
        ] {
            s.charge("acct_1", "k1", &changed)
                .await
                .assert_problem(422, "key-reused");
        }
        assert_eq!(s.count("charges").await, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_unnamed_field_replays() {
    with_test_db(async |db| {
        let s = start(db).await;
        let first = s.charge("acct_1", "k1", &new_charge(500)).await;
        // Another description and another key order and spacing: the same request.
        let body = concat!(
            r#"{ "description": "second",  "customer": "cus_1", "#,
            r#""currency": "usd", "amount": 500 }"#
        );
        let retry = s.charge_text("acct_1", "k1", body).await;
        assert!(retry.replayed());
        assert_eq!(
            retry.body, first.body,
            "the stored response, with the first description"
        );
        assert_eq!(s.count("charges").await, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_make_one_charge() {
    with_test_db(async |db| {
        let s = start_with_processor_delay(db, Duration::from_millis(50)).await;
        let body = new_charge(700);
        let answers = join_all((0..50).map(|_| s.charge("acct_1", "storm", &body))).await;
        assert_eq!(s.count("charges").await, 1);
        let created: Vec<&Answer> = answers.iter().filter(|a| a.status == 201).collect();
        assert!(!created.is_empty(), "someone must have succeeded");
        let body = &created[0].body;
        let mut fresh = 0;
        for a in &answers {
            match a.status {
                201 => {
                    assert_eq!(&a.body, body, "every success is the same charge");
                    fresh += usize::from(!a.replayed());
                }
                409 => {
                    a.assert_problem(409, "key-in-use");
                    assert!(a.header("retry-after").is_some());
                }
                other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&a.body)),
            }
        }
        assert_eq!(fresh, 1, "exactly one answer ran the handler");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_body_stores_nothing_and_a_corrected_retry_runs() {
    with_test_db(async |db| {
        let s = start(db).await;
        s.charge("acct_1", "k1", &new_charge(0))
            .await
            .assert_problem(400, "invalid-request");
        s.charge(
            "acct_1",
            "k1",
            &json!({ "amount": "ten", "currency": "usd", "customer": "c" }),
        )
        .await
        .assert_problem(400, "invalid-request");
        s.charge(
            "acct_1",
            "k1",
            &json!({ "amount": 5, "currency": "dollars", "customer": "c" }),
        )
        .await
        .assert_problem(400, "invalid-request");
        let bad_json = s.charge_text("acct_1", "k1", "{\"amount\": 5,").await;
        bad_json.assert_problem(400, "invalid-request");
        assert_eq!((s.count("charges").await, s.keys().await), (0, 0));

        let corrected = s.charge("acct_1", "k1", &new_charge(5)).await;
        assert_eq!(corrected.status, 201);
        assert!(!corrected.replayed());
        assert_eq!(s.count("charges").await, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_key_runs_again() {
    with_test_db(async |db| {
        let s = start(db).await;
        let first = s.charge("acct_1", "k1", &new_charge(500)).await;
        sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
            .execute(&s.pool)
            .await
            .unwrap();
        // Even with another payload: the old record is gone as far as clients can tell.
        let second = s.charge("acct_1", "k1", &new_charge(900)).await;
        assert_eq!(second.status, 201);
        assert!(!second.replayed());
        assert_ne!(second.json()["id"], first.json()["id"]);
        assert_eq!(s.count("charges").await, 2);
        assert_eq!(s.keys().await, 1, "the expired row was taken over in place");
        let replay = s.charge("acct_1", "k1", &new_charge(900)).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, second.body);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_two_principals_never_meet() {
    with_test_db(async |db| {
        let s = start(db).await;
        let a = s.charge("acct_a", "shared-key", &new_charge(100)).await;
        let b = s.charge("acct_b", "shared-key", &new_charge(999)).await;
        assert_eq!((a.status, b.status), (201, 201));
        assert!(
            !b.replayed(),
            "b never sees a's response, and is no 422 either"
        );
        assert_eq!(b.json()["account"], "acct_b");
        assert_eq!(s.count("charges").await, 2);
        let a_again = s.charge("acct_a", "shared-key", &new_charge(100)).await;
        assert_eq!(a_again.body, a.body);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_malformed_keys_are_refused() {
    with_test_db(async |db| {
        let s = start(db).await;
        let missing = s
            .post_with(
                "/charges",
                None,
                &new_charge(5),
                &[("authorization", "Bearer acct_1")],
            )
            .await;
        missing.assert_problem(400, "missing-key");

        let too_long = "k".repeat(256);
        let quoted_too_long = format!("\"{}\"", "k".repeat(256));
        for key in [
            "",
            "\"\"",
            "a b",
            "\"unterminated",
            "\"a\"b",
            r#""bad\escape""#,
            &too_long,
            &quoted_too_long,
        ] {
            let a = s.charge("acct_1", key, &new_charge(5)).await;
            a.assert_problem(400, "malformed-key");
            assert!(a.json()["detail"]
                .as_str()
                .unwrap()
                .contains("Idempotency-Key"));
        }
        // Non-ASCII bytes, which HTTP allows in header values.
        let non_ascii = reqwest::header::HeaderValue::from_bytes("clé".as_bytes()).unwrap();
        let a = send(
            s.client
                .post(s.url("/charges"))
                .bearer_auth("acct_1")
                .header("Idempotency-Key", non_ascii)
                .json(&new_charge(5)),
        )
        .await;
        a.assert_problem(400, "malformed-key");
        let repeated = s
            .post_with(
                "/charges",
                Some("k1"),
                &new_charge(5),
                &[
                    ("authorization", "Bearer acct_1"),
                    ("Idempotency-Key", "k2"),
                ],
            )
            .await;
        repeated.assert_problem(400, "malformed-key");
        assert_eq!((s.count("charges").await, s.keys().await), (0, 0));

        // The longest key and a UUID, which starts with a digit, are fine.
        for key in [
            "k".repeat(255),
            "8e03978e-40d5-43e8-bc93-6894a57f9324".to_owned(),
        ] {
            assert_eq!(s.charge("acct_1", &key, &new_charge(5)).await.status, 201);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_an_account_is_unauthorized() {
    with_test_db(async |db| {
        let s = start(db).await;
        let a = send(
            s.client
                .post(s.url("/charges"))
                .header("Idempotency-Key", "k1")
                .json(&new_charge(5)),
        )
        .await;
        a.assert_problem(401, "unauthenticated");
        assert_eq!(s.keys().await, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_request_leaves_nothing() {
    with_test_db(async |db| {
        let s = start_with_processor_delay(db, Duration::from_millis(1500)).await;
        let body = new_charge(500).to_string();
        let mut socket = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        let request = format!(
            "POST /charges HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acct_1\r\n\
             Idempotency-Key: gone\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(request.as_bytes()).await.unwrap();
        // The handler has written the charge and now waits for the "processor".
        wait_until(
            &s.pool,
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             WHERE c.relname = 'charges'",
        )
        .await;
        drop(socket);

        // The dropped future rolled back and freed the key. Until the server has noticed the
        // closed socket the key is in use (409), as for any client that retries too early;
        // had the handler gone on, its commit would make the retry a replay.
        let mut retry = s.charge("acct_1", "gone", &new_charge(500)).await;
        while retry.status == 409 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            retry = s.charge("acct_1", "gone", &new_charge(500)).await;
        }
        assert_eq!(retry.status, 201);
        assert!(!retry.replayed());
        assert_eq!(
            s.count("charges").await,
            1,
            "only the retry's charge exists"
        );
    })
    .await;
}

/// Polls `sql` (a count) until it is positive.
async fn wait_until(pool: &PgPool, sql: &'static str) {
    for _ in 0..200 {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
        if n > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {sql}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_over_the_remaining_amount_is_a_final_answer() {
    with_test_db(async |db| {
        let s = start(db).await;
        let charge = s.charge("acct_1", "c1", &new_charge(100)).await.json();
        let id = charge["id"].as_str().unwrap();

        let ok = s.refund("acct_1", id, "r1", 60).await;
        assert_eq!(ok.status, 201);
        let refund = ok.json();
        assert_eq!(refund["charge_id"], id);
        assert_eq!(refund["amount"], 60);
        assert!(refund["id"].as_str().unwrap().starts_with("re_"));

        let over = s.refund("acct_1", id, "r2", 50).await;
        over.assert_problem(400, "refund-exceeds-charge");
        assert!(!over.replayed());
        // Committed: a retry replays the rejection, even after room was made.
        let replay = s.refund("acct_1", id, "r2", 50).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, over.body);
        assert_eq!(s.count("refunds").await, 1);

        // The key belongs to one charge: the same key on another charge is another target.
        let other = s.charge("acct_1", "c2", &new_charge(100)).await.json();
        let other_id = other["id"].as_str().unwrap();
        s.refund("acct_1", other_id, "r1", 60)
            .await
            .assert_problem(422, "key-reused");

        // Another account's charge does not exist for this account; nothing is stored.
        s.refund("acct_2", id, "r3", 1)
            .await
            .assert_problem(404, "not-found");
        assert_eq!(s.count("idempotency_keys WHERE scope = 'refunds'").await, 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_refunds_under_different_keys_never_over_refund() {
    with_test_db(async |db| {
        let s = start(db).await;
        let charge = s.charge("acct_1", "c1", &new_charge(100)).await.json();
        let id = charge["id"].as_str().unwrap().to_owned();
        let keys: Vec<String> = (0..10).map(|i| format!("refund-{i}")).collect();
        let answers = join_all(keys.iter().map(|k| s.refund("acct_1", &id, k, 30))).await;
        let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
        assert_eq!(
            statuses.iter().filter(|&&s| s == 201).count(),
            3,
            "{statuses:?}"
        );
        assert_eq!(
            statuses.iter().filter(|&&s| s == 400).count(),
            7,
            "{statuses:?}"
        );
        let refunded: i64 = sqlx::query_scalar("SELECT sum(amount)::bigint FROM refunds")
            .fetch_one(&s.pool)
            .await
            .unwrap();
        assert_eq!(refunded, 90);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_keys_with_many_copies_each_make_one_charge_per_key() {
    with_test_db(async |db| {
        let s = start(db).await;
        let requests = (0..40).flat_map(|k| (0..5).map(move |_| k));
        let s = &s;
        let answers = join_all(requests.map(|k| async move {
            let key = format!("key-{k}");
            (k, s.charge("acct_1", &key, &new_charge(10 + k)).await)
        }))
        .await;
        assert_eq!(s.count("charges").await, 40);
        let mut bodies = std::collections::HashMap::new();
        for (k, a) in &answers {
            assert!(a.status == 201 || a.status == 409, "status {}", a.status);
            if a.status == 201 {
                let body = bodies.entry(*k).or_insert_with(|| a.body.clone());
                assert_eq!(body, &a.body, "key-{k} answered two different charges");
            }
        }
        let ids: HashSet<String> = bodies
            .values()
            .map(|b| {
                serde_json::from_slice::<Value>(b).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(ids.len(), bodies.len());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_answers_raw_http_without_a_content_type() {
    with_test_db(async |db| {
        let s = start(db).await;
        let mut socket = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        let body = new_charge(5).to_string();
        let request = format!(
            "POST /charges HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer a\r\nIdempotency-Key: k\r\n\
             Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        socket.read_to_string(&mut response).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 415"), "{response}");
        assert!(response.contains("application/problem+json"));
        assert_eq!(s.keys().await, 0);
    })
    .await;
}

/// The example as it runs on Citus (`DB_PORTABLE=true`), here on plain PostgreSQL: the
/// same answers through idem's portable mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_keeps_its_contract_in_portable_mode() {
    with_test_db(async |db| {
        let config = Config {
            portable: true,
            processor_delay: Duration::from_millis(300),
            ..Config::default()
        };
        let s = TestApp::charges(db, 10, config).await;
        let body = json!({ "amount": 500, "currency": "usd", "customer": "cus_p" });
        let (first, duplicate) = tokio::join!(s.charge("acct_p", "p1", &body), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.charge("acct_p", "p1", &body).await
        });
        assert_eq!(first.status, 201);
        duplicate.assert_problem(409, "key-in-use");
        let again = s.charge("acct_p", "p1", &body).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        s.charge(
            "acct_p",
            "p1",
            &json!({ "amount": 501, "currency": "usd", "customer": "cus_p" }),
        )
        .await
        .assert_problem(422, "key-reused");
        let id = first.json()["id"].as_str().unwrap().to_owned();
        assert_eq!(s.refund("acct_p", &id, "r1", 200).await.status, 201);
        assert!(s.refund("acct_p", &id, "r1", 200).await.replayed());
        assert_eq!(s.refund("acct_p", &id, "r2", 400).await.status, 400);
        assert_eq!(s.count("charges").await, 1);
        assert_eq!(s.count("refunds").await, 1);
    })
    .await;
}

/// Pins a 500 schemathesis found (a seeded run of 1 000 examples per operation): a NUL
/// character in a text field failed the insert (PostgreSQL's text takes none). It is
/// the request's mistake, a 400, rolled back and so retryable with the same key; a NUL
/// in a charge id is no such charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_character_in_text_is_a_400_not_a_500() {
    with_test_db(async |db| {
        let s = start(db).await;
        let nul = json!({ "amount": 100, "currency": "usd", "customer": "cus\u{0}1" });
        s.charge("acct_n", "n1", &nul)
            .await
            .assert_problem(400, "invalid-request");
        let described =
            json!({ "amount": 100, "currency": "usd", "customer": "cus_1", "description": "a\u{0}b" });
        s.charge("acct_n", "n2", &described)
            .await
            .assert_problem(400, "invalid-request");
        assert_eq!((s.count("charges").await, s.keys().await), (0, 0));
        let fixed = json!({ "amount": 100, "currency": "usd", "customer": "cus_1" });
        assert_eq!(s.charge("acct_n", "n1", &fixed).await.status, 201);
        let read = send(s.client.get(s.url("/charges/ch_%00")).bearer_auth("acct_n")).await;
        read.assert_problem(404, "not-found");
    })
    .await;
}
