//! Proof under fire: the charges example run as real OS processes on loopback ports
//! against one PostgreSQL, broken on purpose, and counted. Every scenario ends with a
//! count in the database and prints its figures.
//!
//! Small sizes run in the README's test command. The full sizes of RELIABILITY.md:
//!
//! ```text
//! RELIABILITY_FULL=1 cargo test --release -p idem-tests --test reliability -- --nocapture --test-threads 1
//! ```

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::future::join_all;
use idem_tests::{count, post, tally, with_test_db, Answer, TestDb};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn full() -> bool {
    std::env::var_os("RELIABILITY_FULL").is_some()
}

/// One server process of the charges example.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    async fn start(db: &TestDb, env: &[(&str, &str)]) -> Self {
        // A free port: bound and released; the server binds it again at once.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_charges-server"));
        command
            .env("BIND_ADDR", addr.to_string())
            .env("DATABASE_URL", db.url())
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command.spawn().expect("start the charges server");
        let server = Self { child, addr };
        server.wait_ready().await;
        server
    }

    async fn wait_ready(&self) {
        for _ in 0..300 {
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the server at {} did not come up", self.addr);
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// SIGKILL: no shutdown, no rollback by the process; PostgreSQL sees the sockets die.
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

fn charge(key: &str) -> Value {
    // The key is also the customer: charges per key are counted by customer.
    json!({ "amount": 100, "currency": "usd", "customer": key })
}

async fn charge_once(client: &reqwest::Client, server: &Server, key: &str) -> Answer {
    post(
        client,
        &server.url("/charges"),
        Some(key),
        &charge(key),
        &[("authorization", "Bearer acct_r")],
    )
    .await
}

/// Charges per key that has more than one: must always be empty.
async fn duplicates(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT customer, count(*) FROM charges GROUP BY customer HAVING count(*) > 1")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn migrated(db: &TestDb) -> PgPool {
    let pool = db.pool(5).await;
    charges::migrate(&pool).await.unwrap();
    pool
}

/// 1. Storm across processes: keys × copies, shuffled across three servers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_across_processes() {
    with_test_db(async |db| {
        let (keys, copies) = if full() { (500, 20) } else { (60, 10) };
        let pool = migrated(db).await;
        let servers = [
            Server::start(db, &[("PROCESSOR_DELAY_MS", "5")]).await,
            Server::start(db, &[("PROCESSOR_DELAY_MS", "5")]).await,
            Server::start(db, &[("PROCESSOR_DELAY_MS", "5")]).await,
        ];
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(512)
            .build()
            .unwrap();
        // A fixed shuffle: request i goes to server (i * 7) % 3, keys interleaved.
        let mut requests: Vec<(usize, String)> = (0..keys * copies)
            .map(|i| ((i * 7) % 3, format!("storm-{}", (i * 31) % keys)))
            .collect();
        requests.sort_by_key(|(server, key)| (key.len() * 13 + server) % 17);
        let started = Instant::now();
        let answers = join_all(requests.iter().map(|(server, key)| {
            let (client, server) = (&client, &servers[*server]);
            async move { (key.clone(), charge_once(client, server, key).await) }
        }))
        .await;
        let elapsed = started.elapsed();

        let mut bodies: HashMap<&str, &[u8]> = HashMap::new();
        for (key, answer) in &answers {
            match answer.status {
                201 => {
                    let body = bodies.entry(key.as_str()).or_insert(answer.body.as_slice());
                    assert_eq!(
                        *body,
                        answer.body.as_slice(),
                        "two different 201 bodies for {key}"
                    );
                }
                409 => answer.assert_problem(409, "key-in-use"),
                other => panic!(
                    "{other} for {key}: {}",
                    String::from_utf8_lossy(&answer.body)
                ),
            }
        }
        let charges = count(&pool, "charges").await;
        assert!(duplicates(&pool).await.is_empty());
        assert_eq!(
            charges,
            bodies.len() as i64,
            "every charge was acknowledged to someone"
        );
        let statuses = tally(answers.iter().map(|(_, a)| a.status));
        println!(
            "storm: 3 processes, {keys} keys x {copies} copies = {} requests in {:.2}s; \
             answers {statuses:?}; charges {charges}, duplicates 0",
            answers.len(),
            elapsed.as_secs_f64()
        );
    })
    .await;
}

/// 2. Crash mid-transaction: SIGKILL with requests in flight, restart, retry all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_mid_transaction() {
    with_test_db(async |db| {
        let requests = if full() { 400 } else { 60 };
        let pool = migrated(db).await;
        let env = [("PROCESSOR_DELAY_MS", "400")];
        let mut server = Server::start(db, &env).await;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(512)
            .build()
            .unwrap();
        let keys: Vec<String> = (0..requests).map(|i| format!("crash-{i}")).collect();

        // Requests arrive over a second; the kill lands in the middle, with some answered
        // and many in flight.
        let sent = join_all(keys.iter().enumerate().map(|(i, key)| {
            let (client, url) = (&client, server.url("/charges"));
            async move {
                tokio::time::sleep(Duration::from_millis((i as u64 * 1000) / requests as u64))
                    .await;
                post(
                    client,
                    &url,
                    Some(key),
                    &charge(key),
                    &[("authorization", "Bearer acct_r")],
                )
                .await
            }
        }));
        let killer = async {
            tokio::time::sleep(Duration::from_millis(700)).await;
            server.kill();
        };
        let (answers, ()) = tokio::join!(sent, killer);
        let acknowledged: HashMap<&str, Value> = keys
            .iter()
            .zip(&answers)
            .filter(|(_, a)| a.status == 201)
            .map(|(k, a)| (k.as_str(), a.json()))
            .collect();
        let lost_in_flight = answers.iter().filter(|a| a.status == 0).count();
        assert!(lost_in_flight > 0, "the kill must hit requests in flight");

        let restart = Instant::now();
        let server = Server::start(db, &env).await;
        // Every request retried with its key, as a client would, until it gets an answer.
        let retries = join_all(keys.iter().map(|key| {
            let (client, server) = (&client, &server);
            async move {
                loop {
                    let answer = charge_once(client, server, key).await;
                    if answer.status != 409 && answer.status != 503 && answer.status != 0 {
                        return answer;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }))
        .await;
        let recovered = restart.elapsed();
        for (key, retry) in keys.iter().zip(&retries) {
            assert_eq!(
                retry.status,
                201,
                "{key}: {}",
                String::from_utf8_lossy(&retry.body)
            );
            if let Some(seen) = acknowledged.get(key.as_str()) {
                assert!(retry.replayed());
                assert_eq!(
                    &retry.json(),
                    seen,
                    "an acknowledged charge is the one replayed"
                );
            }
        }
        assert_eq!(
            count(&pool, "charges").await,
            requests as i64,
            "exactly one charge per key"
        );
        assert!(duplicates(&pool).await.is_empty());
        for seen in acknowledged.values() {
            let id = seen["id"].as_str().unwrap();
            assert_eq!(
                count(&pool, &format!("charges WHERE id = '{id}'")).await,
                1,
                "acknowledged {id} survived"
            );
        }
        println!(
            "crash: {requests} requests, SIGKILL at 0.7s: {} acknowledged before, \
             {lost_in_flight} lost in flight; after restart every key answered 201 within {:.2}s; \
             charges {requests}, duplicates 0, acknowledged lost 0",
            acknowledged.len(),
            recovered.as_secs_f64()
        );
    })
    .await;
}

/// 3. Database connections cut under load: only 503 (or 409) while it lasts, no
/// duplicates, and the service recovers by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_connections_cut_under_load() {
    with_test_db(async |db| {
        let (keys, outage) = if full() {
            (600, Duration::from_secs(3))
        } else {
            (120, Duration::from_millis(800))
        };
        let pool = migrated(db).await;
        let server = Server::start(db, &[("PROCESSOR_DELAY_MS", "20")]).await;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(512)
            .build()
            .unwrap();
        let keys: Vec<String> = (0..keys).map(|i| format!("cut-{i}")).collect();
        let started = Instant::now();
        let load = join_all(keys.iter().enumerate().map(|(i, key)| {
            let (client, server) = (&client, &server);
            async move {
                tokio::time::sleep(Duration::from_millis(i as u64 * 3)).await;
                let mut statuses = Vec::new();
                loop {
                    let answer = charge_once(client, server, key).await;
                    statuses.push((answer.status, started.elapsed()));
                    if answer.status == 201 {
                        return statuses;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
        let cutter = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let until = Instant::now() + outage;
            let mut cuts = 0;
            while Instant::now() < until {
                let cut: i64 = sqlx::query_scalar(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                cuts += cut;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (cuts, started.elapsed())
        };
        let (histories, (cuts, outage_over)) = tokio::join!(load, cutter);
        let all: Vec<(u16, Duration)> = histories.iter().flatten().copied().collect();
        for (status, _) in &all {
            assert!(matches!(status, 201 | 409 | 503), "unexpected {status}");
        }
        assert_eq!(count(&pool, "charges").await, keys.len() as i64);
        assert!(duplicates(&pool).await.is_empty());
        let recovered_at = all
            .iter()
            .filter(|(s, at)| *s == 201 && *at > outage_over)
            .map(|(_, at)| *at)
            .min();
        println!(
            "db cut: {} keys; {cuts} backends terminated over {:.1}s; answers {:?}; \
             first success {:.0} ms after the outage; charges {}, duplicates 0",
            keys.len(),
            outage.as_secs_f64(),
            tally(all.iter().map(|(s, _)| *s)),
            recovered_at.map_or(0.0, |at| at.saturating_sub(outage_over).as_secs_f64()
                * 1000.0),
            keys.len()
        );
    })
    .await;
}

/// 4. Pool exhaustion: far more concurrent requests than connections, duplicates
/// among them: no deadlock, no hang, no 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_exhaustion() {
    with_test_db(async |db| {
        let (keys, copies) = if full() { (100, 5) } else { (30, 4) };
        let pool = migrated(db).await;
        let server =
            Server::start(db, &[("PROCESSOR_DELAY_MS", "100"), ("DB_POOL_SIZE", "3")]).await;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .build()
            .unwrap();
        let started = Instant::now();
        let answers = tokio::time::timeout(
            Duration::from_secs(60),
            join_all((0..keys * copies).map(|i| {
                let (client, server) = (&client, &server);
                async move { charge_once(client, server, &format!("pool-{}", i % keys)).await }
            })),
        )
        .await
        .expect("no hang: every request answered within 60 s");
        let elapsed = started.elapsed();
        let statuses = tally(answers.iter().map(|a| a.status));
        for status in statuses.keys() {
            assert!(
                matches!(status, 201 | 409 | 503),
                "unexpected {status}: {statuses:?}"
            );
        }
        assert!(duplicates(&pool).await.is_empty());
        println!(
            "pool: {} concurrent requests ({keys} keys x {copies}) on a 3-connection pool \
             with a 100 ms handler: all answered in {:.2}s; answers {statuses:?}; charges {}, \
             duplicates 0",
            keys * copies,
            elapsed.as_secs_f64(),
            count(&pool, "charges").await
        );
    })
    .await;
}

/// Sends raw bytes, returns the raw response.
async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(request).await.unwrap();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut response)).await;
    String::from_utf8_lossy(&response).into_owned()
}

fn request(key_header: &[u8], content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(b"POST /charges HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer acct_r\r\n");
    r.extend_from_slice(key_header);
    if !content_type.is_empty() {
        r.extend_from_slice(format!("Content-Type: {content_type}\r\n").as_bytes());
    }
    r.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    r.extend_from_slice(body);
    r
}

/// 5. Bad input: each a 4xx (problem+json wherever the application sees the request),
/// the server never panics, nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_sweep() {
    with_test_db(async |db| {
        let pool = migrated(db).await;
        let server = Server::start(db, &[]).await;
        let good = br#"{"amount":5,"currency":"usd","customer":"c"}"#;
        let key = b"Idempotency-Key: k1\r\n".as_slice();
        let oversized = format!(
            r#"{{"amount":5,"currency":"usd","customer":"{}"}}"#,
            "x".repeat(3 << 20)
        );
        let long_key = format!("Idempotency-Key: {}\r\n", "k".repeat(256));
        let cases: Vec<(&str, Vec<u8>, u16)> = vec![
            (
                "malformed JSON",
                request(key, "application/json", b"{\"amount\": 5,"),
                400,
            ),
            (
                "wrong types",
                request(
                    key,
                    "application/json",
                    br#"{"amount":"5","currency":1,"customer":[]}"#,
                ),
                400,
            ),
            (
                "amount zero",
                request(
                    key,
                    "application/json",
                    br#"{"amount":0,"currency":"usd","customer":"c"}"#,
                ),
                400,
            ),
            ("empty body", request(key, "application/json", b""), 400),
            ("no content type", request(key, "", good), 415),
            (
                "oversized body",
                request(key, "application/json", oversized.as_bytes()),
                413,
            ),
            ("no key", request(b"", "application/json", good), 400),
            (
                "empty key",
                request(b"Idempotency-Key: \"\"\r\n", "application/json", good),
                400,
            ),
            (
                "non-ASCII key",
                request(
                    "Idempotency-Key: clé\r\n".as_bytes(),
                    "application/json",
                    good,
                ),
                400,
            ),
            (
                "tab in key",
                request(b"Idempotency-Key: a\tb\r\n", "application/json", good),
                400,
            ),
            (
                "overlong key",
                request(long_key.as_bytes(), "application/json", good),
                400,
            ),
            (
                "repeated key",
                request(
                    b"Idempotency-Key: a\r\nIdempotency-Key: b\r\n",
                    "application/json",
                    good,
                ),
                400,
            ),
            (
                "bad sf-string",
                request(b"Idempotency-Key: \"a\\x\"\r\n", "application/json", good),
                400,
            ),
        ];
        let mut results = Vec::new();
        for (name, bytes, expected) in &cases {
            let response = raw(server.addr, bytes).await;
            let status: u16 = response
                .get(9..12)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            assert_eq!(status, *expected, "{name}: {response}");
            assert!(
                response
                    .to_ascii_lowercase()
                    .contains("content-type: application/problem+json"),
                "{name}: {response}"
            );
            results.push(format!("{name} {status}"));
        }
        // Control characters never reach the application: the HTTP parser refuses them.
        let control = raw(
            server.addr,
            &request(b"Idempotency-Key: a\x01b\r\n", "application/json", good),
        )
        .await;
        assert!(control.starts_with("HTTP/1.1 400"), "{control}");
        assert_eq!(
            (
                count(&pool, "charges").await,
                count(&pool, "idempotency_keys").await
            ),
            (0, 0),
            "nothing stored"
        );
        // Still alive and well.
        let client = reqwest::Client::new();
        assert_eq!(
            charge_once(&client, &server, "after-sweep").await.status,
            201
        );
        println!(
            "bad input: {}; control character: 400 from the HTTP parser; nothing stored; \
             server alive",
            results.join(", ")
        );
    })
    .await;
}
