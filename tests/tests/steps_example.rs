//! The charges example with a payment processor (`PROCESSOR_URL`, issue 29): its binary
//! run as a process of its own, against the suite's stand-in processor over real HTTP
//! (`idem_tests::ProcessorServer`, counting calls per `Idempotency-Key`), in each mode:
//! directly on PostgreSQL, behind PgBouncer in transaction mode (`DB_POOLER=transaction`)
//! and portable on Citus (`DB_PORTABLE=true`).
//!
//! Each mode: the service is killed with SIGKILL between the step's record and its
//! COMMIT and restarted, and the retry charges from the recorded answer, with a processor
//! that ignores keys; the handler's own insert fails after the step, and the retry
//! resumes; another payload under that key gets 422 and calls nobody; the processor
//! answers 500, then 200 (two calls, one key); it answers past `PROCESSOR_TIMEOUT_MS`
//! (504, then the retry charges); it declines (402, replayed); 50 copies at once call it
//! once. The OpenAPI document shows `processor_id` and those answers.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use futures::future::join_all;
use idem_tests::{count, post, with_test_db, Answer, Citus, Pgbouncer, ProcessorServer};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// The account every request of these tests charges.
const BEARER: &str = "Bearer acct_steps";

/// Where one mode's service runs.
struct Mode {
    name: &'static str,
    /// The service's `DATABASE_URL`.
    database_url: String,
    /// What the mode sets besides (`DB_POOLER`, `DB_PORTABLE`).
    env: &'static [(&'static str, &'static str)],
    /// The test's own pool on the database, past any pooler.
    direct: PgPool,
}

/// The example's binary, as a process of its own.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    async fn start(mode: &Mode, env: &[(&str, &str)]) -> Self {
        // A free port: bound and released; the server binds it again at once.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_charges-server"));
        command
            .env("BIND_ADDR", addr.to_string())
            .env("DATABASE_URL", &mode.database_url)
            .env("RUST_LOG", "error")
            .env_remove("DB_POOLER")
            .env_remove("DB_PORTABLE")
            .env_remove("NATS_URL")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (name, value) in mode.env.iter().chain(env) {
            command.env(name, value);
        }
        let child = command.spawn().expect("start the charges server");
        let mut server = Self { child, addr };
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!(
                    "{}: the charges server exited at start: {status}",
                    mode.name
                );
            }
            assert!(
                Instant::now() < deadline,
                "{}: the charges server does not listen",
                mode.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// SIGKILL: no shutdown, no rollback by the process; PostgreSQL sees the socket die.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn body(amount: i64, customer: &str) -> Value {
    json!({ "amount": amount, "currency": "usd", "customer": customer })
}

async fn charge(client: &reqwest::Client, server: &Server, key: &str, body: &Value) -> Answer {
    post(
        client,
        &server.url("/charges"),
        Some(key),
        body,
        &[("authorization", BEARER)],
    )
    .await
}

/// [`charge`] until the key is no longer in use (409): a request killed or still in
/// flight holds it until PostgreSQL ends its transaction.
async fn charge_when_free(
    client: &reqwest::Client,
    server: &Server,
    key: &str,
    body: &Value,
) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answer = charge(client, server, key, body).await;
        if answer.status != 409 || Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The keys the processor saw that are not in `before`.
fn new_keys(processor: &idem_tests::Processor, before: &[String]) -> Vec<String> {
    processor
        .keys()
        .into_iter()
        .filter(|key| !before.contains(key))
        .collect()
}

/// The processor's id the charge `id` keeps in its row.
async fn stored_processor_id(direct: &PgPool, id: &str) -> Option<String> {
    sqlx::query_scalar("SELECT processor_id FROM charges WHERE id = $1")
        .bind(id)
        .fetch_one(direct)
        .await
        .expect("the charge's row")
}

/// Everything `POST /charges` promises with a processor, on `mode`.
async fn the_contract(mode: &Mode) {
    let name = mode.name;
    let direct = &mode.direct;
    let processor = ProcessorServer::start().await;
    let p = &processor.processor;
    let processor_url = processor.url();
    let client = reqwest::Client::new();

    // SIGKILL after the step's record, before COMMIT, with a processor that ignores keys:
    // PROCESSOR_DELAY_MS holds the request in its transaction after the call.
    p.ignore_keys(true);
    let mut doomed = Server::start(
        mode,
        &[
            ("PROCESSOR_URL", &processor_url),
            ("PROCESSOR_DELAY_MS", "30000"),
        ],
    )
    .await;
    let killed = body(100, "cus_kill");
    let in_flight = tokio::spawn({
        let (client, url, killed) = (client.clone(), doomed.url("/charges"), killed.clone());
        async move {
            post(
                &client,
                &url,
                Some("k-kill"),
                &killed,
                &[("authorization", BEARER)],
            )
            .await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while count(direct, "idempotency_steps").await == 0 {
        assert!(
            Instant::now() < deadline,
            "{name}: the step was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    doomed.kill();
    let lost = in_flight.await.expect("the request's task");
    assert_eq!(
        lost.status, 0,
        "{name}: killed before it answered: {lost:?}"
    );
    assert_eq!(p.total(), 1, "{name}");
    let kill_key = p.keys().remove(0);
    assert_eq!(kill_key.len(), 64, "{name}: the step's derived key");
    assert_eq!(
        p.bodies(&kill_key),
        std::slice::from_ref(&killed),
        "{name}: what the processor is sent"
    );

    let server = Server::start(
        mode,
        &[
            ("PROCESSOR_URL", &processor_url),
            ("PROCESSOR_TIMEOUT_MS", "500"),
        ],
    )
    .await;
    let resumed = charge_when_free(&client, &server, "k-kill", &killed).await;
    assert_eq!(resumed.status, 201, "{name}: {resumed:?}");
    assert!(!resumed.replayed(), "{name}: nothing had committed");
    let charged = resumed.json();
    assert_eq!(
        charged["processor_id"], "ch_1",
        "{name}: the recorded answer, not a second charge"
    );
    assert_eq!(p.total(), 1, "{name}: one call across the crash");
    assert_eq!(
        count(direct, "idempotency_steps").await,
        0,
        "{name}: COMMIT deleted the key's steps"
    );
    let id = charged["id"].as_str().expect("an id");
    assert_eq!(
        stored_processor_id(direct, id).await.as_deref(),
        Some("ch_1"),
        "{name}"
    );
    let read = idem_tests::send(
        client
            .get(server.url(&format!("/charges/{id}")))
            .header("authorization", BEARER),
    )
    .await;
    assert_eq!(read.json()["processor_id"], "ch_1", "{name}: {read:?}");
    p.ignore_keys(false);

    // The OpenAPI document says so.
    let document = idem_tests::send(client.get(server.url("/openapi.json")))
        .await
        .json();
    assert_eq!(
        document["components"]["schemas"]["Charge"]["properties"]["processor_id"]["type"],
        json!(["string", "null"]),
        "{name}"
    );
    let answers = &document["paths"]["/charges"]["post"]["responses"];
    for status in ["201", "402", "502", "504"] {
        assert!(answers[status].is_object(), "{name}: {status} in {answers}");
    }

    // The handler's own insert fails after the step: the retry resumes from the step;
    // another payload under the key meanwhile gets 422 and calls nobody.
    sqlx::raw_sql(
        "ALTER TABLE charges ADD CONSTRAINT refuse_first CHECK (customer <> 'cus_refused')",
    )
    .execute(direct)
    .await
    .expect("refuse the insert");
    let refused = body(200, "cus_refused");
    let failed = charge(&client, &server, "k-refused", &refused).await;
    assert_eq!(failed.status, 500, "{name}: {failed:?}");
    assert_eq!(count(direct, "idempotency_steps").await, 1, "{name}");
    assert_eq!(p.total(), 2, "{name}");
    let other = charge(&client, &server, "k-refused", &body(201, "cus_refused")).await;
    other.assert_problem(422, "key-reused");
    assert_eq!(p.total(), 2, "{name}: no call for another payload");
    sqlx::raw_sql("ALTER TABLE charges DROP CONSTRAINT refuse_first")
        .execute(direct)
        .await
        .expect("accept the insert");
    let retried = charge(&client, &server, "k-refused", &refused).await;
    assert_eq!(retried.status, 201, "{name}: {retried:?}");
    assert_eq!(retried.json()["processor_id"], "ch_2", "{name}");
    assert_eq!(p.total(), 2, "{name}: one call across the failure");
    assert_eq!(count(direct, "idempotency_steps").await, 0, "{name}");

    // The processor answers 500, then 200: not recorded, so called again, with the
    // same key.
    let before = p.keys();
    p.fail_next(1);
    let flaky = body(300, "cus_500");
    let failed = charge(&client, &server, "k-500", &flaky).await;
    failed.assert_problem(502, "processor-failed");
    assert!(
        failed.json()["type"]
            .as_str()
            .is_some_and(|t| t.starts_with(charges::PROBLEM_BASE)),
        "{name}: the service's own problem: {failed:?}"
    );
    assert_eq!(count(direct, "idempotency_steps").await, 0, "{name}");
    let retried = charge(&client, &server, "k-500", &flaky).await;
    assert_eq!(retried.status, 201, "{name}: {retried:?}");
    let keys = new_keys(p, &before);
    assert_eq!(keys.len(), 1, "{name}: one key for both calls: {keys:?}");
    assert_eq!(p.calls(&keys[0]), 2, "{name}");

    // Slower than PROCESSOR_TIMEOUT_MS: 504, rolled back; the retry charges.
    let before = p.keys();
    p.delay(Duration::from_millis(1500));
    let slow = body(400, "cus_slow");
    let timed_out = charge(&client, &server, "k-slow", &slow).await;
    timed_out.assert_problem(504, "processor-timeout");
    p.delay(Duration::ZERO);
    let retried = charge_when_free(&client, &server, "k-slow", &slow).await;
    assert_eq!(retried.status, 201, "{name}: {retried:?}");
    let keys = new_keys(p, &before);
    assert_eq!(keys.len(), 1, "{name}: {keys:?}");
    assert_eq!(p.calls(&keys[0]), 2, "{name}: called again, same key");

    // A declined card is the processor's final word: 402, committed, replayed.
    let before = p.keys();
    p.fail_next_with(StatusCode::PAYMENT_REQUIRED, 1);
    let declined_body = body(500, "cus_declined");
    let declined = charge(&client, &server, "k-402", &declined_body).await;
    declined.assert_problem(402, "payment-declined");
    assert!(
        declined.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("card declined")),
        "{name}: {declined:?}"
    );
    let again = charge(&client, &server, "k-402", &declined_body).await;
    assert_eq!(again.status, 402, "{name}");
    assert!(again.replayed(), "{name}: the stored answer");
    assert_eq!(again.body, declined.body, "{name}");
    let keys = new_keys(p, &before);
    assert_eq!(keys.len(), 1, "{name}");
    assert_eq!(p.calls(&keys[0]), 1, "{name}: declined once, never again");
    assert_eq!(
        count(direct, "charges WHERE customer = 'cus_declined'").await,
        0,
        "{name}"
    );

    // 50 copies at once: one call.
    let total = p.total();
    let copies = body(600, "cus_copies");
    let answers = join_all((0..50).map(|_| charge(&client, &server, "k-50", &copies))).await;
    assert!(
        answers.iter().all(|a| [201, 409].contains(&a.status)),
        "{name}: {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    let created: Vec<&Answer> = answers.iter().filter(|a| a.status == 201).collect();
    assert!(!created.is_empty(), "{name}");
    assert_eq!(p.total(), total + 1, "{name}: one call for 50 copies");
    let last = charge_when_free(&client, &server, "k-50", &copies).await;
    assert_eq!(last.status, 201, "{name}");
    assert_eq!(last.body, created[0].body, "{name}: the same charge");
    assert_eq!(p.total(), total + 1, "{name}");
    assert_eq!(
        count(direct, "charges WHERE customer = 'cus_copies'").await,
        1,
        "{name}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_calls_its_processor_once_per_request() {
    with_test_db(async |db| {
        let mode = Mode {
            name: "default",
            database_url: db.url(),
            env: &[],
            direct: db.pool(4).await,
        };
        the_contract(&mode).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_calls_its_processor_once_per_request_behind_pgbouncer() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let mode = Mode {
            name: "pooler",
            database_url: bouncer.url(),
            env: &[("DB_POOLER", "transaction")],
            direct: db.pool(4).await,
        };
        the_contract(&mode).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_calls_its_processor_once_per_request_on_citus() {
    let Some(cluster) = Citus::start("steps_example::citus", 2).await else {
        return;
    };
    let mode = Mode {
        name: "citus",
        database_url: cluster.url(),
        env: &[("DB_PORTABLE", "true")],
        direct: PgPoolOptions::new()
            .max_connections(4)
            .connect_with(cluster.options())
            .await
            .expect("connect to the coordinator"),
    };
    the_contract(&mode).await;
}
