//! The charges example on a real Citus cluster (a coordinator and two workers, each a
//! throwaway PostgreSQL with the extension; `idem_tests::Citus`), in portable mode, its
//! tables distributed by the code itself (`Store::distribute`, `charges::distribute`):
//! the contract, a duplicate storm, a SIGKILL of the service mid-request, the three
//! webhook endpoints, the sweeper, and no two-phase commit from any endpoint.
//!
//! Citus is built from the vendored source by `.ci/run`; where it is not installed these
//! tests print one line saying they were skipped (a failure with
//! `IDEM_REQUIRE_CITUS=1`, which `.ci/run` sets).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use charges::Config;
use futures::future::join_all;
use futures::stream::{self, StreamExt};
use idem::schema::Distribution;
use idem::{Store, VerifyError};
use idem_tests::{count, example_deliveries, post, send, tally, Answer, Citus, TestApp};
use serde_json::{json, Value};
use sqlx::PgPool;

/// A pool on the cluster's coordinator.
async fn pool(cluster: &Citus, size: u32) -> PgPool {
    charges::connect_with(cluster.options(), idem::Pooler::Session, size)
        .await
        .expect("connect to the coordinator")
}

/// The example in portable mode on `cluster`, its tables created and distributed as its
/// binary does it at start; the "processor" takes `delay` inside each charge.
async fn service(cluster: &Citus, delay: Duration) -> TestApp {
    let pool = pool(cluster, 20).await;
    let config = Config {
        portable: true,
        processor_delay: delay,
        ..Config::default()
    };
    charges::migrate(&pool).await.expect("migrate");
    let store = charges::store(pool.clone(), &config);
    charges::distribute(&store).await.expect("distribute");
    store.verify().await.expect("verify");
    TestApp::serve(pool.clone(), charges::app(pool, config)).await
}

/// How Citus keeps each of `tables`: (table, method, column, colocation group).
async fn distribution(pool: &PgPool) -> Vec<(String, String, String, i32)> {
    sqlx::query_as(
        "SELECT logicalrelid::text, partmethod::text, \
                coalesce(column_to_column_name(logicalrelid, partkey), ''), colocationid \
           FROM pg_dist_partition ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .expect("read pg_dist_partition")
}

fn charge_body(customer: &str, amount: i64) -> Value {
    json!({ "amount": amount, "currency": "usd", "customer": customer })
}

async fn charge(s: &TestApp, account: &str, key: &str, amount: i64) -> Answer {
    let bearer = format!("Bearer {account}");
    s.post_with(
        "/charges",
        Some(key),
        &charge_body(key, amount),
        &[("authorization", &bearer)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_holds_on_citus_with_tables_distributed_by_the_code() {
    let Some(cluster) = Citus::start("citus::the_contract", 2).await else {
        return;
    };
    let s = service(&cluster, Duration::from_millis(600)).await;

    // The code distributed every table of a request by its tenant, in one colocation
    // group: a request's claim and business writes are one worker's transaction.
    let tables = distribution(&s.pool).await;
    let names: Vec<&str> = tables.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "charges",
            "idempotency_keys",
            "idempotency_requests",
            "idempotency_steps",
            "ledger_entries",
            "refunds",
            "webhook_events"
        ]
    );
    for (table, method, column, group) in &tables {
        assert_eq!(method, "h", "{table}");
        let expected = match table.as_str() {
            "idempotency_keys" | "idempotency_steps" | "idempotency_requests" => "principal",
            "webhook_events" => "tenant",
            _ => "account",
        };
        assert_eq!(column, expected, "{table}");
        assert_eq!(*group, tables[0].3, "{table} is colocated");
    }
    // Another instance starting finds it done.
    let again = charges::store(
        s.pool.clone(),
        &Config {
            portable: true,
            ..Config::default()
        },
    );
    assert_eq!(
        again.distribute(None).await.unwrap(),
        Distribution::Existing
    );
    charges::distribute(&again).await.expect("distribute again");

    // First request, its replay, a reuse with another payload, a missing key.
    let first = charge(&s, "acct_1", "k1", 100).await;
    assert_eq!(
        first.status,
        201,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    assert!(!first.replayed());
    let replay = charge(&s, "acct_1", "k1", 100).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "the stored body, byte for byte");
    charge(&s, "acct_1", "k1", 999)
        .await
        .assert_problem(422, "key-reused");
    let unkeyed = s
        .post_with(
            "/charges",
            None,
            &charge_body("c", 5),
            &[("authorization", "Bearer acct_1")],
        )
        .await;
    unkeyed.assert_problem(400, "missing-key");
    // The same key under another account is another request.
    let other = charge(&s, "acct_2", "k1", 100).await;
    assert_eq!(other.status, 201);
    assert!(!other.replayed());

    // A duplicate of a request in flight is answered 409 at once: the claim's
    // `lock_timeout` reached the worker that holds the key's row.
    // Had the wait bound stayed on the coordinator, the duplicate would have waited on
    // the worker for the first request's commit and been answered its replay (201).
    let (a, b) = tokio::join!(charge(&s, "acct_1", "k2", 100), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let answer = charge(&s, "acct_1", "k2", 100).await;
        (answer, std::time::Instant::now())
    });
    let first_done = std::time::Instant::now();
    assert_eq!(a.status, 201);
    let (b, answered) = b;
    b.assert_problem(409, "key-in-use");
    assert!(
        answered < first_done,
        "answered before the first request finished"
    );

    // A refund, its replay, and the read.
    let id = first.json()["id"].as_str().unwrap().to_owned();
    let refund = |key: &'static str| {
        let url = format!("/charges/{id}/refunds");
        let s = &s;
        async move {
            s.post_with(
                &url,
                Some(key),
                &json!({ "amount": 40 }),
                &[("authorization", "Bearer acct_1")],
            )
            .await
        }
    };
    let r1 = refund("r1").await;
    assert_eq!(r1.status, 201, "{}", String::from_utf8_lossy(&r1.body));
    let r2 = refund("r1").await;
    assert!(r2.replayed());
    assert_eq!(r2.body, r1.body);
    let read = send(
        s.client
            .get(s.url(&format!("/charges/{id}")))
            .bearer_auth("acct_1"),
    )
    .await;
    assert_eq!(read.status, 200);
    assert_eq!(s.count("refunds").await, 1);
    assert_eq!(s.count("charges").await, 3);

    // Abandoned requests are found across the workers (issue 38): steps recorded for two
    // tenants, on their shards, and nothing committed for them.
    for (account, key) in [("acct_7", "gone-1"), ("acct_8", "gone-2")] {
        sqlx::query(
            "INSERT INTO idempotency_steps (scope, principal, key, step, fingerprint, result, expires_at)
             VALUES ('charges', $1, $2, 'processor', '\\x00', '{}', now() + interval '1 hour')",
        )
        .bind(account)
        .bind(key)
        .execute(&s.pool)
        .await
        .unwrap();
    }
    let abandoned = again.operate().abandoned(Duration::ZERO, 10).await.unwrap();
    let found: Vec<(&str, &str)> = abandoned
        .iter()
        .map(|a| (a.principal.as_str(), a.key.as_str()))
        .collect();
    assert_eq!(found, [("acct_7", "gone-1"), ("acct_8", "gone-2")]);
    assert_eq!(abandoned[0].steps[0].step, "processor");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_and_distribute_find_a_table_left_local() {
    let Some(cluster) = Citus::start("citus::verify_and_distribute", 2).await else {
        return;
    };
    let pool = pool(&cluster, 4).await;
    let store = Store::builder(pool.clone())
        .table("ops.keys")
        .portable(true)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let error = store.verify().await.unwrap_err();
    assert!(
        matches!(error, VerifyError::NotDistributed { .. }),
        "{error}"
    );
    let line = error.to_string();
    assert!(!line.contains('\n'), "one line: {line}");
    assert!(line.contains("store.distribute("), "{line}");

    // Several instances at once: one distributes, the others find it done.
    let outcomes = join_all((0..4).map(|_| store.distribute(None))).await;
    let outcomes: Vec<Distribution> = outcomes.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        outcomes
            .iter()
            .filter(|d| **d == Distribution::Created)
            .count(),
        1,
        "{outcomes:?}"
    );
    assert!(outcomes
        .iter()
        .all(|d| matches!(d, Distribution::Created | Distribution::Existing)));
    store.verify().await.expect("distributed now");

    // A store that is not portable is refused, by both.
    let fast = Store::builder(pool.clone())
        .table("ops.keys")
        .build()
        .unwrap();
    assert!(matches!(
        fast.distribute(None).await.unwrap_err(),
        VerifyError::NotPortable { .. }
    ));
    assert!(matches!(
        fast.verify().await.unwrap_err(),
        VerifyError::NotPortable { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_on_citus_makes_one_charge_per_key() {
    let Some(cluster) = Citus::start("citus::a_duplicate_storm", 2).await else {
        return;
    };
    let s = service(&cluster, Duration::from_millis(10)).await;
    let keys: Vec<String> = (0..60).map(|i| format!("storm-{i:03}")).collect();
    let storm = async |keys: &[String]| -> HashMap<String, Vec<Answer>> {
        stream::iter(keys)
            .map(|key| {
                let s = &s;
                async move {
                    // Accounts spread the keys over both workers.
                    let account = format!("acct_{}", key.len() + key.as_bytes()[8] as usize);
                    let copies = (0..5).map(|_| charge(s, &account, key, 100));
                    (key.clone(), join_all(copies).await)
                }
            })
            .buffer_unordered(10)
            .collect()
            .await
    };
    let mut answers = storm(&keys).await;
    let statuses = tally(answers.values().flatten().map(|a| a.status));
    eprintln!("citus storm: 60 keys x 5: {statuses:?}");
    for (key, answers) in &answers {
        for a in answers {
            assert!(
                matches!(a.status, 201 | 409),
                "{key}: {} {}",
                a.status,
                String::from_utf8_lossy(&a.body)
            );
        }
        let mut created = answers.iter().filter(|a| a.status == 201);
        if let Some(first) = created.next() {
            assert!(created.all(|a| a.body == first.body), "{key}: one charge");
        }
    }
    // A client retries what only got 409s.
    let unanswered: Vec<String> = answers
        .iter()
        .filter(|(_, a)| a.iter().all(|a| a.status != 201))
        .map(|(k, _)| k.clone())
        .collect();
    answers.extend(storm(&unanswered).await);
    let per_customer: Vec<(String, i64)> =
        sqlx::query_as("SELECT customer, count(*) FROM charges GROUP BY customer")
            .fetch_all(&s.pool)
            .await
            .unwrap();
    assert_eq!(per_customer.len(), keys.len(), "every key charged");
    assert!(
        per_customer.iter().all(|(_, n)| *n == 1),
        "{per_customer:?}"
    );
    assert_eq!(s.keys().await, keys.len() as i64);
}

/// The example's binary as a process of its own, on the cluster, with `DB_PORTABLE=true`
/// and nothing else set up: it creates and distributes its tables itself.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    async fn start(cluster: &Citus, delay_ms: &str) -> Self {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_charges-server"))
            .env("BIND_ADDR", addr.to_string())
            .env("DATABASE_URL", cluster.url())
            .env("DB_PORTABLE", "true")
            .env("PROCESSOR_DELAY_MS", delay_ms)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the charges server");
        let mut server = Self { child, addr };
        for _ in 0..500 {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return server;
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("the charges server exited at start: {status}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server.kill();
        panic!("the charges server did not come up");
    }

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_killed_mid_request_on_citus_leaves_nothing_and_retries_charge_once() {
    let Some(cluster) = Citus::start("citus::a_service_killed", 2).await else {
        return;
    };
    // A fresh database: the binary alone makes its tables and distributes them.
    let mut server = Server::start(&cluster, "5000").await;
    let direct = pool(&cluster, 2).await;
    let groups: Vec<i32> = distribution(&direct).await.iter().map(|t| t.3).collect();
    assert_eq!(
        groups.len(),
        7,
        "the example's four tables and idem's three distributed"
    );
    assert!(
        groups.iter().all(|g| *g == groups[0]),
        "colocated: {groups:?}"
    );

    let client = reqwest::Client::new();
    let url = format!("http://{}/charges", server.addr);
    let keys: Vec<String> = (0..8).map(|i| format!("kill-{i}")).collect();
    let in_flight = join_all(keys.iter().map(|key| {
        let (client, url) = (&client, &url);
        let account = format!("acct_{key}");
        async move {
            let bearer = format!("Bearer {account}");
            post(
                client,
                url,
                Some(key),
                &charge_body(key, 100),
                &[("authorization", &bearer)],
            )
            .await
        }
    }));
    let killer = async {
        // The claims are made and the handlers are waiting in their transactions.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        server.kill();
    };
    let (answers, ()) = tokio::join!(in_flight, killer);
    assert!(answers.iter().all(|a| a.status == 0), "none was answered");
    // The coordinator notices the dead sockets and aborts; so do the workers.
    let mut left = (0, 0);
    for _ in 0..100 {
        left = (
            count(&direct, "charges").await,
            count(&direct, "idempotency_keys").await,
        );
        if left == (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(left, (0, 0), "(charges, keys) left by the killed requests");

    let server = Server::start(&cluster, "0").await;
    let url = format!("http://{}/charges", server.addr);
    for key in &keys {
        let bearer = format!("Bearer acct_{key}");
        let answer = loop {
            let answer = post(
                &client,
                &url,
                Some(key),
                &charge_body(key, 100),
                &[("authorization", &bearer)],
            )
            .await;
            if answer.status != 409 {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            answer.status,
            201,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        assert!(!answer.replayed(), "{key} ran anew: nothing was stored");
    }
    assert_eq!(count(&direct, "charges").await, keys.len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_deliveries_on_citus_take_effect_once() {
    let Some(cluster) = Citus::start("citus::webhook_deliveries", 2).await else {
        return;
    };
    let s = service(&cluster, Duration::ZERO).await;
    let created = charge(&s, "acct_1", "c1", 100).await.json();
    let charge_id = created["id"].as_str().unwrap().to_owned();
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
    for n in 0..6 {
        let body = if n == 0 {
            json!({ "type": "charge.refunded",
                    "data": { "account": "acct_1", "charge_id": charge_id } })
        } else {
            json!({ "type": "payment.succeeded", "data": { "n": n } })
        }
        .to_string();
        for (path, body, headers) in example_deliveries(n, body, now) {
            for _ in 0..3 {
                sends.push(deliver(path, body.clone(), headers.clone()));
            }
        }
    }
    let answers = join_all(sends).await;
    let statuses = tally(answers.iter().map(|a| a.status));
    assert!(answers.iter().all(|a| a.status == 200), "{statuses:?}");
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT provider, count(*) FROM webhook_events GROUP BY provider ORDER BY provider",
    )
    .fetch_all(&s.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            ("github".into(), 6),
            ("payments".into(), 6),
            ("stripe".into(), 6)
        ]
    );
    let refunded: bool =
        sqlx::query_scalar("SELECT refunded_by_provider FROM charges WHERE id = $1")
            .bind(&charge_id)
            .fetch_one(&s.pool)
            .await
            .unwrap();
    assert!(refunded, "charge.refunded reached its charge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_empties_expired_rows_on_citus() {
    let Some(cluster) = Citus::start("citus::the_sweeper", 2).await else {
        return;
    };
    let s = service(&cluster, Duration::ZERO).await;
    // Live records of a few requests, and expired ones on every shard.
    for i in 0..5 {
        assert_eq!(
            charge(&s, &format!("acct_{i}"), "live", 100).await.status,
            201
        );
    }
    sqlx::query(
        "INSERT INTO idempotency_keys (scope, principal, key, fingerprint, field_hashes, status, \
                                       created_at, expires_at) \
         SELECT 'charges', 'acct_' || n, 'old', '\\x00', '\\x00', 201, \
                now() - interval '2 days', now() - interval '1 day' \
           FROM generate_series(1, 120) AS n",
    )
    .execute(&s.pool)
    .await
    .unwrap();
    let store = charges::store(
        s.pool.clone(),
        &Config {
            portable: true,
            ..Config::default()
        },
    );
    store.verify().await.unwrap();
    // One short single-shard transaction per row (the portable sweep).
    let started = std::time::Instant::now();
    assert_eq!(
        store
            .operate()
            .audited(idem_tests::operator())
            .purge_expired(64)
            .await
            .unwrap(),
        120
    );
    eprintln!(
        "citus: 120 expired rows swept in {:?}, one transaction a row",
        started.elapsed()
    );
    assert_eq!(s.keys().await, 5, "the live records stay");
    assert_eq!(
        store
            .operate()
            .audited(idem_tests::operator())
            .purge_expired(64)
            .await
            .unwrap(),
        0
    );

    // The sweeper task, as the example starts it.
    sqlx::query(
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second' \
          WHERE principal IN ('acct_0', 'acct_1')",
    )
    .execute(&s.pool)
    .await
    .unwrap();
    let sweeper = store
        .spawn_sweeper(Duration::from_millis(100), 1_000)
        .unwrap();
    for _ in 0..100 {
        if sweeper.removed() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sweeper.stop();
    assert_eq!(sweeper.removed(), 2);
    assert_eq!(s.keys().await, 3);

    // With nothing expired, a sweep reads one index probe per shard and writes nothing:
    // no delete on any worker, no WAL, no two-phase commit.
    store
        .operate()
        .audited(idem_tests::operator())
        .purge_expired(1_000)
        .await
        .unwrap(); // prunes what the deletes left, once
    cluster
        .coordinator
        .run("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await;
    for worker in &cluster.workers {
        worker.run("SELECT pg_stat_statements_reset()").await;
    }
    let commits = two_phase_commits(&s.pool).await;
    for _ in 0..5 {
        assert_eq!(
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(1_000)
                .await
                .unwrap(),
            0
        );
    }
    assert_eq!(two_phase_commits(&s.pool).await, commits);
    let mut probes = 0;
    for worker in &cluster.workers {
        let direct = charges::connect_with(worker.options(), idem::Pooler::Session, 1)
            .await
            .unwrap();
        let seen: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT query, calls, wal_bytes::bigint FROM pg_stat_statements \
              WHERE query LIKE '%idempotency_keys%'",
        )
        .fetch_all(&direct)
        .await
        .unwrap();
        for (query, calls, wal) in &seen {
            assert!(query.trim_start().starts_with("SELECT"), "{query}");
            assert_eq!(*wal, 0, "{query}");
            probes += calls;
        }
    }
    // Citus's default: 32 shards, each probed once per sweep.
    assert_eq!(probes, 5 * 32, "one probe per shard and sweep");
}

/// Two-phase commits the coordinator has recorded (the nodes keep them: the harness
/// turns Citus's recovery of them off).
async fn two_phase_commits(pool: &PgPool) -> i64 {
    count(pool, "pg_dist_transaction").await
}

/// Issue 23: with the tables distributed as the code does it, every endpoint of the
/// example, and its queue consumer, commits on one worker: no request makes a two-phase
/// commit, the `charge.refunded` webhook included (its key is kept on the account's
/// shard, beside the charge it updates). A transaction that does write on both workers
/// shows that the count sees two-phase commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_of_the_example_commits_on_one_worker() {
    use idem::webhook::{GitHub, StandardWebhooks, Stripe, Verifier};
    let Some(cluster) = Citus::start("citus::every_endpoint_commits_on_one_worker", 2).await else {
        return;
    };
    let s = service(&cluster, Duration::ZERO).await;
    let before = two_phase_commits(&s.pool).await;

    let mut ids = Vec::new();
    for account in ["acct_1", "acct_2", "acct_3"] {
        let created = charge(&s, account, "c1", 100).await;
        assert_eq!(created.status, 201);
        let id = created.json()["id"].as_str().unwrap().to_owned();
        let refund = s
            .post_with(
                &format!("/charges/{id}/refunds"),
                Some("r1"),
                &json!({ "amount": 10 }),
                &[("authorization", &format!("Bearer {account}"))],
            )
            .await;
        assert_eq!(refund.status, 201);
        ids.push((account, id));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let payments = Verifier::<StandardWebhooks>::new(charges::TEST_WEBHOOK_SECRET).unwrap();
    for (n, (account, id)) in ids.iter().enumerate() {
        let events = [
            json!({ "type": "charge.refunded", "data": { "account": account, "charge_id": id } }),
            json!({ "type": "payment.succeeded", "data": { "n": n } }),
        ];
        for (m, event) in events.iter().enumerate() {
            let body = event.to_string();
            let mut request = s
                .client
                .post(s.url("/webhooks/payments"))
                .header("content-type", "application/json")
                .body(body.clone());
            for (name, value) in payments.sign(&format!("msg_{n}_{m}"), now, body.as_bytes()) {
                request = request.header(name, value);
            }
            assert_eq!(send(request).await.status, 200);
        }
        let stripe = json!({ "id": format!("evt_{n}"), "type": "charge.succeeded" }).to_string();
        let mut request = s
            .client
            .post(s.url("/webhooks/stripe"))
            .header("content-type", "application/json")
            .body(stripe.clone());
        for (name, value) in Verifier::<Stripe>::new(charges::TEST_STRIPE_SECRET)
            .unwrap()
            .sign("", now, stripe.as_bytes())
        {
            request = request.header(name, value);
        }
        assert_eq!(send(request).await.status, 200);
        let github = json!({ "action": "opened", "number": n }).to_string();
        let mut request = s
            .client
            .post(s.url("/webhooks/github"))
            .header("content-type", "application/json")
            .body(github.clone());
        for (name, value) in Verifier::<GitHub>::new(charges::TEST_GITHUB_SECRET)
            .unwrap()
            .sign("", now, github.as_bytes())
        {
            request = request.header(name, value);
        }
        assert_eq!(send(request).await.status, 200);
        let store = charges::store(
            s.pool.clone(),
            &Config {
                portable: true,
                ..Config::default()
            },
        );
        let credit = charges::consumer::Credit {
            message_id: format!("m{n}"),
            account: (*account).to_owned(),
            amount: 5,
        };
        assert_eq!(
            charges::consumer::handle(&store, &credit)
                .await
                .unwrap()
                .balance,
            5
        );
    }
    let refunded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM charges WHERE refunded_by_provider")
            .fetch_one(&s.pool)
            .await
            .unwrap();
    assert_eq!(refunded, 3);
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT principal FROM idempotency_keys WHERE scope <> 'charges'")
            .fetch_all(&s.pool)
            .await
            .unwrap();
    assert!(
        keys.iter().all(|p| !p.is_empty()),
        "no key on the nobody shard: {keys:?}"
    );
    assert_eq!(
        two_phase_commits(&s.pool).await,
        before,
        "a request committed across workers"
    );

    // A consumer that names no tenant: the portable store keeps each key under a hash of
    // itself, so 40 such keys land on many shards, none on the nobody value's.
    let store = charges::store(
        s.pool.clone(),
        &Config {
            portable: true,
            ..Config::default()
        },
    );
    for n in 0..40 {
        store
            .run_once("unnamed", &format!("m{n}"))
            .run(async |_tx| Ok::<_, sqlx::Error>(()))
            .await
            .unwrap();
    }
    let (shards, nobody): (i64, i64) = sqlx::query_as(
        "SELECT count(DISTINCT get_shard_id_for_distribution_column('idempotency_keys', principal)), \
                count(*) FILTER (WHERE principal = '') \
           FROM idempotency_keys WHERE split_part(scope, chr(31), 1) = 'unnamed'",
    )
    .fetch_one(&s.pool)
    .await
    .unwrap();
    assert_eq!(nobody, 0);
    assert!(shards >= 16, "40 keys on {shards} of 32 shards");

    // The control: one transaction writing charges of many accounts spans both workers.
    let mut tx = s.pool.begin().await.unwrap();
    for n in 0..20 {
        sqlx::query(
            "INSERT INTO charges (account, amount, currency, customer) VALUES ($1, 1, 'usd', 'x')",
        )
        .bind(format!("acct_control_{n}"))
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    assert!(
        two_phase_commits(&s.pool).await > before,
        "the count sees a two-phase commit"
    );
}
