//! The charges example behind PgBouncer in transaction mode (`pool_mode = transaction`,
//! four server connections shared by twenty client connections), the topology
//! `Pooler::Transaction` is for: duplicate storms and killed server connections keep the
//! contract (one charge per key, nothing but 503 among the 5xx), and the migration,
//! the table check and the sweeper work through the pooler too. A control run with the
//! default `Pooler::Session` and sqlx's statement cache shows what the setting prevents,
//! and that `Store::verify` (so the example, at its start) refuses it with one line.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use charges::Config;
use futures::future::join_all;
use futures::stream::{self, StreamExt};
use idem::{Pooler, Store, VerifyError};
use idem_tests::{
    admin_options, example_deliveries, tally, with_test_db, Answer, Pgbouncer, SpanFields, TestApp,
    TestDb,
};
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// The example's pool size: five clients per server connection of the pooler.
const CLIENT_CONNECTIONS: u32 = 20;

/// The charges example with `pooler`, its pool connected through `bouncer` and migrated
/// through it; the "processor" takes 10 ms inside each charge's transaction, so that
/// duplicates overlap.
async fn through(bouncer: &Pgbouncer, pooler: Pooler) -> TestApp {
    let pool = charges::connect_with(bouncer.options(), pooler, CLIENT_CONNECTIONS)
        .await
        .expect("connect through pgbouncer");
    charges::migrate(&pool)
        .await
        .expect("migrate through pgbouncer");
    let config = Config {
        pooler,
        processor_delay: Duration::from_millis(10),
        ..Config::default()
    };
    TestApp::serve(pool.clone(), charges::app(pool, config)).await
}

/// The charge of `key`: the key is also the customer, so that the database says which
/// key each charge belongs to.
async fn charge(s: &TestApp, key: &str) -> Answer {
    let body = json!({ "amount": 100, "currency": "usd", "customer": key });
    s.post_with(
        "/charges",
        Some(key),
        &body,
        &[("authorization", "Bearer acct_1")],
    )
    .await
}

/// `copies` concurrent `POST /charges` for each of `keys`, twenty keys at a time: the
/// answers by key.
async fn storm(s: &TestApp, keys: &[String], copies: usize) -> HashMap<String, Vec<Answer>> {
    stream::iter(keys)
        .map(|key| async move {
            let answers = join_all((0..copies).map(|_| charge(s, key))).await;
            (key.clone(), answers)
        })
        .buffer_unordered(20)
        .collect()
        .await
}

fn key_names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:03}")).collect()
}

/// Charges per customer (= key), read directly from PostgreSQL, not through the pooler.
async fn charges_per_key(db: &TestDb) -> BTreeMap<String, i64> {
    let pool = db.pool(1).await;
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT customer, count(*) FROM charges GROUP BY customer")
            .fetch_all(&pool)
            .await
            .expect("count charges");
    pool.close().await;
    rows.into_iter().collect()
}

/// Every answer is a charge (201), a duplicate in flight (409) or "unavailable" (503);
/// every 201 of one key is the same charge, byte for byte. The keys without a 201.
#[track_caller]
fn only_503_among_5xx(answers: &HashMap<String, Vec<Answer>>) -> Vec<String> {
    let statuses = tally(answers.values().flatten().map(|a| a.status));
    let mut unanswered = Vec::new();
    for (key, answers) in answers {
        for a in answers {
            match a.status {
                201 | 409 | 503 => {}
                other => panic!(
                    "{key}: {other} {} (all answers: {statuses:?})",
                    String::from_utf8_lossy(&a.body)
                ),
            }
            if a.status == 503 {
                a.assert_problem(503, "unavailable");
                assert!(a.header("retry-after").is_some());
            }
        }
        let mut created = answers.iter().filter(|a| a.status == 201);
        match created.next() {
            Some(first) => assert!(
                created.all(|a| a.body == first.body),
                "{key}: every 201 is the same charge"
            ),
            None => unanswered.push(key.clone()),
        }
    }
    unanswered.sort();
    unanswered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_through_pgbouncer_makes_one_charge_per_key() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let s = through(&bouncer, Pooler::Transaction).await;
        // Two more service instances start through the same pooler.
        for _ in 0..2 {
            charges::migrate(&s.pool).await.expect("migrate again");
        }

        let started = Instant::now();
        let keys = key_names("storm", 100);
        let answers = storm(&s, &keys, 5).await;
        let elapsed = started.elapsed();
        let unanswered = only_503_among_5xx(&answers);
        let statuses = tally(answers.values().flatten().map(|a| a.status));
        eprintln!("storm: 100 keys x 5 in {elapsed:?}: {statuses:?}");
        // A client retries what was not answered.
        for key in &unanswered {
            assert_eq!(charge(&s, key).await.status, 201, "{key}: retry");
        }
        let per_key = charges_per_key(db).await;
        assert_eq!(per_key.len(), keys.len(), "a charge for every key");
        assert!(per_key.values().all(|&n| n == 1), "{per_key:?}");

        // Reads (outside any request transaction) and replays, through the pooler.
        for key in &keys[..10] {
            let created = charge(&s, key).await;
            assert!(created.replayed());
            let id = created.json()["id"].as_str().unwrap().to_owned();
            let read = idem_tests::send(
                s.client
                    .get(s.url(&format!("/charges/{id}")))
                    .bearer_auth("acct_1"),
            )
            .await;
            assert_eq!(read.status, 200);
            assert_eq!(read.body, created.body);
        }

        // The table check and the sweeper, through the pooler, from two instances.
        let store = || {
            Store::builder(s.pool.clone())
                .pooler(Pooler::Transaction)
                .build()
                .unwrap()
        };
        for _ in 0..3 {
            store().verify().await.expect("verify through pgbouncer");
        }
        let direct = db.pool(1).await;
        sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
            .execute(&direct)
            .await
            .unwrap();
        let sweepers = [store(), store()].map(|store| {
            store
                .spawn_sweeper(Duration::from_millis(20), 7)
                .expect("sweeper")
        });
        // A sweeper counts a batch once its transaction has committed.
        let removed = || sweepers.iter().map(|s| s.removed()).sum::<u64>();
        let deadline = Instant::now() + Duration::from_secs(10);
        while removed() < 100 {
            assert!(Instant::now() < deadline, "the sweepers do not finish");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(removed(), 100, "each expired record swept once");
        assert_eq!(idem_tests::count(&direct, "idempotency_keys").await, 0);
        sweepers.iter().for_each(|s| s.stop());
        direct.close().await;
    })
    .await;
}

/// The three webhook endpoints through the pooler: concurrent copies of each delivery,
/// every copy 200, one row per event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_deliveries_through_pgbouncer_take_effect_once() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let s = through(&bouncer, Pooler::Transaction).await;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let deliver =
            |path: &'static str, body: String, headers: Vec<(axum::http::HeaderName, String)>| {
                let s = &s;
                async move { s.deliver_to(path, &body, headers).await }
            };
        let mut sends = Vec::new();
        for n in 0..10 {
            let body = json!({ "type": "payment.succeeded", "data": { "n": n } }).to_string();
            for (path, body, headers) in example_deliveries(n, body, now) {
                for _ in 0..3 {
                    sends.push(deliver(path, body.clone(), headers.clone()));
                }
            }
        }
        let answers = join_all(sends).await;
        let statuses = tally(answers.iter().map(|a| a.status));
        assert!(answers.iter().all(|a| a.status == 200), "{statuses:?}");
        let direct = db.pool(1).await;
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT provider, count(*) FROM webhook_events GROUP BY provider ORDER BY provider",
        )
        .fetch_all(&direct)
        .await
        .unwrap();
        assert_eq!(
            rows,
            [
                ("github".into(), 10),
                ("payments".into(), 10),
                ("stripe".into(), 10)
            ]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_server_connections_answer_503_and_never_charge_twice() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let s = through(&bouncer, Pooler::Transaction).await;
        let keys = key_names("kill", 150);

        let killing = async {
            // A direct connection to the server, not to the test database.
            let mut admin = PgConnection::connect_with(&admin_options()).await.unwrap();
            let mut terminated = 0;
            for round in 0..10 {
                tokio::time::sleep(Duration::from_millis(60)).await;
                if round == 5 {
                    // PgBouncer drops every client and server connection of the
                    // database; new clients wait until RESUME.
                    bouncer.admin(&format!("KILL {}", db.name)).await.expect("KILL");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    bouncer.admin(&format!("RESUME {}", db.name)).await.expect("RESUME");
                    continue;
                }
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE datname = $1 AND pid <> pg_backend_pid()",
                )
                .bind(&db.name)
                .fetch_one(&mut admin)
                .await
                .unwrap();
                terminated += n;
            }
            admin.close().await.ok();
            terminated
        };
        let started = Instant::now();
        let (answers, terminated) = tokio::join!(storm(&s, &keys, 2), killing);
        let elapsed = started.elapsed();
        let statuses = tally(answers.values().flatten().map(|a| a.status));
        eprintln!(
            "kill round: 150 keys x 2 in {elapsed:?}, {terminated} backends terminated: {statuses:?}"
        );
        assert!(terminated > 0, "the round terminated server connections");
        let unanswered = only_503_among_5xx(&answers);
        assert!(
            !unanswered.is_empty() || statuses.contains_key(&503),
            "the round failed no request: it tested nothing ({statuses:?})"
        );

        // Retries succeed: a fresh charge, or the replay of one whose answer was lost.
        let mut after = HashMap::new();
        for key in &keys {
            let retry = charge(&s, key).await;
            assert_eq!(retry.status, 201, "{key}: {}", String::from_utf8_lossy(&retry.body));
            after.insert(key.clone(), retry);
        }
        for (key, answers) in &answers {
            if let Some(first) = answers.iter().find(|a| a.status == 201) {
                assert!(after[key].replayed());
                assert_eq!(after[key].body, first.body, "{key}: the same charge");
            }
        }
        let per_key = charges_per_key(db).await;
        assert_eq!(per_key.len(), keys.len(), "a charge for every key");
        assert!(per_key.values().all(|&n| n == 1), "{per_key:?}");
    })
    .await;
}

/// The `error` fields of the events logged while this test binary runs.
#[derive(Clone, Default)]
struct LoggedErrors(Arc<Mutex<Vec<String>>>);

impl<S: Subscriber> Layer<S> for LoggedErrors {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut fields = SpanFields::default();
        event.record(&mut fields);
        if let Some(error) = fields.get("error") {
            self.0.lock().unwrap().push(error.to_owned());
        }
    }
}

/// Collects errors for the whole binary (a global subscriber can be set once).
fn logged_errors() -> &'static LoggedErrors {
    static ERRORS: OnceLock<LoggedErrors> = OnceLock::new();
    ERRORS.get_or_init(|| {
        let errors = LoggedErrors::default();
        tracing_subscriber::registry().with(errors.clone()).init();
        errors
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_pooler_setting_named_statements_collide_through_pgbouncer() {
    let errors = logged_errors();
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        // The default: idem and sqlx prepare named statements, cached per connection.
        let s = through(&bouncer, Pooler::Session).await;
        let keys = key_names("control", 40);
        let answers = storm(&s, &keys, 5).await;
        let statuses = tally(answers.values().flatten().map(|a| a.status));
        eprintln!("control: 40 keys x 5 with Pooler::Session: {statuses:?}");
        assert!(
            statuses.get(&500).is_some_and(|&n| n > 0),
            "named statements through a transaction pooler failed no request: {statuses:?}"
        );
        let collisions = errors
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.contains("prepared statement \"sqlx_s_"))
            .count();
        assert!(collisions > 0, "the 500s are prepared statement collisions");
        // Even so, no key is charged twice: the failures roll back.
        let per_key = charges_per_key(db).await;
        assert!(per_key.values().all(|&n| n == 1), "{per_key:?}");
    })
    .await;
}

/// Issue 20: a store in the default mode behind a transaction pooler is refused by
/// `verify`, in one line that names the pooler, the setting and the README section,
/// before a request can fail; the same store reaching PostgreSQL directly verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_refuses_a_session_store_behind_a_transaction_pooler() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let pool = charges::connect_with(bouncer.options(), Pooler::Session, 4)
            .await
            .expect("connect through pgbouncer");
        charges::migrate(&pool)
            .await
            .expect("migrate through pgbouncer");
        // Every time, not only when a collision happens to occur.
        for _ in 0..3 {
            let error = Store::new(pool.clone())
                .verify()
                .await
                .expect_err("a session store behind a transaction pooler");
            assert!(
                matches!(error, VerifyError::TransactionPooler { .. }),
                "{error:?}"
            );
            let line = error.to_string();
            assert!(!line.contains('\n'), "{line}");
            for part in [
                "pooler in transaction mode (PgBouncer `pool_mode = transaction`",
                "server process",
                "`.pooler(Pooler::Transaction)`",
                "`statement_cache_capacity(0)`",
                "the guide's \"Topologies\", \"Behind a transaction pooler\"",
            ] {
                assert!(line.contains(part), "{part:?} not in: {line}");
            }
        }
        Store::new(db.pool(2).await)
            .verify()
            .await
            .expect("the same store, directly on PostgreSQL");
    })
    .await;
}

/// Issue 20: the example started behind PgBouncer without `DB_POOLER=transaction` stops
/// at once with one line saying what is wrong and which setting fixes it, instead of
/// answering 500s (or dumping a driver struct on its next start); with the setting, it
/// serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_refuses_to_start_behind_a_transaction_pooler_without_its_setting() {
    use std::process::{Command, Stdio};
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let start = |pooler: Option<&str>| {
            let addr = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .unwrap();
            let mut command = Command::new(env!("CARGO_BIN_EXE_charges-server"));
            command
                .env("BIND_ADDR", addr.to_string())
                .env("DATABASE_URL", bouncer.url())
                .env("RUST_LOG", "error")
                .env_remove("DB_POOLER")
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            if let Some(pooler) = pooler {
                command.env("DB_POOLER", pooler);
            }
            (command.spawn().expect("start the charges server"), addr)
        };

        let (child, _) = start(None);
        let output = tokio::task::spawn_blocking(move || child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line: {stderr}");
        for part in [
            "charges: ",
            "(DB_POOLER=session, DB_PORTABLE=false)",
            "pooler in transaction mode",
            "`.pooler(Pooler::Transaction)`",
            "\"Behind a transaction pooler\"",
        ] {
            assert!(lines[0].contains(part), "{part:?} not in: {stderr}");
        }

        let (mut child, addr) = start(Some("transaction"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the service stopped with DB_POOLER=transaction"
            );
            assert!(Instant::now() < deadline, "the service does not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        child.kill().unwrap();
        child.wait().unwrap();
    })
    .await;
}

/// The completer behind PgBouncer with one server connection, shared with a client that
/// parses unnamed statements of its own as fast as it can: each of the completer's
/// statements with arguments (the look for due requests, the lease, the state read and
/// the failure's record) reaches the server connection its parse reached. Outside a
/// transaction, sqlx's parse and its execute are two exchanges, and the other client's
/// statement could come between them (the bind then meets the other's statement, with
/// the wrong arguments): found as a completion that stayed leased for a minute in CI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completers_statements_keep_their_parse_and_execute_together_through_pgbouncer() {
    const REQUESTS: i64 = 20;
    const ROUNDS: i32 = 15;
    with_test_db(async |db| {
        let direct = db.pool(2).await;
        Store::new(direct.clone()).migrate().await.expect("migrate");
        sqlx::query(
            "INSERT INTO idempotency_requests (scope, principal, key, fingerprint, method, target,
                                               headers, body, created_at, expires_at)
             SELECT 'pooled', '', 'k-' || n, sha256('x'), 'POST', '/pooled', '[]', '',
                    now() - interval '1 hour', now() + interval '1 day'
               FROM generate_series(1, $1) AS n",
        )
        .bind(REQUESTS)
        .execute(&direct)
        .await
        .expect("the stored requests");

        let bouncer = Pgbouncer::start_sized(db, 1);
        let store = bouncer.store(4).await;
        // Every run fails, is counted and is due again at once, never parked: each round
        // leases, reads and records a failure for every request.
        let router = axum::Router::new()
            .fallback(|| async { axum::http::StatusCode::INTERNAL_SERVER_ERROR });
        let completer = idem::complete::Completer::new(store, router)
            .after(Duration::ZERO)
            .backoff(Duration::ZERO, Duration::ZERO)
            .max_attempts(1_000_000)
            .batch(100);

        let other = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(bouncer.options().statement_cache_capacity(0))
            .await
            .expect("the other client's pool");
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let others: Vec<_> = (0..4)
            .map(|n| {
                let (pool, done) = (other.clone(), Arc::clone(&done));
                tokio::spawn(async move {
                    let mut ran = 0_u64;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        let mut tx = pool.begin().await.expect("the other's transaction");
                        let got: i64 = sqlx::query_scalar("SELECT $1::int8 + 1")
                            .bind(n)
                            .persistent(false)
                            .fetch_one(&mut *tx)
                            .await
                            .expect("the other's statement");
                        assert_eq!(got, n + 1);
                        tx.commit().await.expect("the other's commit");
                        ran += 1;
                    }
                    ran
                })
            })
            .collect();

        let mut failures = Vec::new();
        for round in 0..ROUNDS {
            match completer.run_due().await {
                Ok(ran) => assert_eq!(ran.len(), REQUESTS as usize, "round {round}: {ran:?}"),
                Err(error) => failures.push(format!("round {round}: {error}")),
            }
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut interleaved = 0;
        for other in others {
            interleaved += other.await.expect("the other client");
        }
        assert!(interleaved > 0, "the other client ran no statement");
        assert!(failures.is_empty(), "{failures:#?}");
        // Every lease counted a try and every failure was recorded under it.
        let progress: Vec<(i32, i32)> = sqlx::query_as(
            "SELECT DISTINCT tries, failures FROM idempotency_requests WHERE scope = 'pooled'",
        )
        .fetch_all(&direct)
        .await
        .expect("the requests' progress");
        assert_eq!(
            progress,
            [(ROUNDS, ROUNDS)],
            "{interleaved} statements between"
        );
    })
    .await;
}
