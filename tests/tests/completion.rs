//! Requests their clients abandoned, finished by the service (issue 38): the charges
//! example's binary (`POST /charges` is `completable`) against the suite's stand-in
//! processor, counting calls per key, in each mode: directly on PostgreSQL, behind
//! PgBouncer in transaction mode and portable on Citus.
//!
//! Each mode: the service is killed by SIGKILL after the processor step's record and
//! restarted, and no client retries: within `COMPLETE_AFTER_MS` and a bound the charge
//! exists once with the processor's id, the processor was called once, and the client's
//! retries, sent while the completion runs, get 409 and then the replay. Two instances
//! complete six abandoned charges, each once. A charge whose handler fails for ever is
//! parked as `failed` and listed; the operator's abandon refunds it once, and its key
//! answers 410 from then on.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem::operate::Operator;
use idem_tests::{count, post, with_test_db, Answer, Citus, Pgbouncer, ProcessorServer};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

/// The account every request of these tests charges.
const ACCOUNT: &str = "acct_complete";

/// The completion's settings every server of these tests runs with: a three-second
/// window, retries from 100 ms, parked after three failures.
const COMPLETION: [(&str, &str); 3] = [
    ("COMPLETE_AFTER_MS", "3000"),
    ("COMPLETE_BACKOFF_MS", "100"),
    ("COMPLETE_LIMIT", "3"),
];

/// Where one mode's service runs.
struct Mode {
    name: &'static str,
    database_url: String,
    env: &'static [(&'static str, &'static str)],
    /// The test's own pool on the database, past any pooler.
    direct: PgPool,
    portable: bool,
}

/// The example's binary, as a process of its own.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    async fn start(mode: &Mode, env: &[(&str, &str)]) -> Self {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_charges-server"));
        command
            .env("BIND_ADDR", addr.to_string())
            .env("DATABASE_URL", &mode.database_url)
            .env_remove("DB_POOLER")
            .env_remove("DB_PORTABLE")
            .env_remove("NATS_URL")
            .stderr(Stdio::inherit());
        // The servers' logs, on this test's output, at the level `IDEM_SERVER_LOG` names
        // (`warn,idem=info` says what each completer did); none by default.
        match std::env::var("IDEM_SERVER_LOG") {
            Ok(level) => command.env("RUST_LOG", level).stdout(Stdio::inherit()),
            Err(_) => command.env("RUST_LOG", "error").stdout(Stdio::null()),
        };
        for (name, value) in mode.env.iter().chain(&COMPLETION).chain(env) {
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
            assert!(Instant::now() < deadline, "{}: no server", mode.name);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// SIGKILL: no shutdown, no rollback by the process.
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

fn body(customer: &str) -> Value {
    json!({ "amount": 700, "currency": "usd", "customer": customer })
}

async fn charge(client: &reqwest::Client, server: &Server, key: &str, customer: &str) -> Answer {
    let bearer = format!("Bearer {ACCOUNT}");
    post(
        client,
        &server.url("/charges"),
        Some(key),
        &body(customer),
        &[("authorization", bearer.as_str())],
    )
    .await
}

/// Waits up to `within` for `done`, polled every 50 ms.
async fn eventually<F, Fut>(what: &str, within: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The charges of `customer`: their processor ids.
async fn charges_of(direct: &PgPool, customer: &str) -> Vec<Option<String>> {
    sqlx::query_scalar("SELECT processor_id FROM charges WHERE customer = $1")
        .bind(customer)
        .fetch_all(direct)
        .await
        .expect("the charges")
}

/// The completer's state of the stored request with `key`, if it has one.
async fn request_state(direct: &PgPool, key: &str) -> Option<(String, i32)> {
    sqlx::query_as("SELECT state, tries FROM idempotency_requests WHERE key = $1")
        .bind(key)
        .fetch_optional(direct)
        .await
        .expect("the stored request")
}

/// Makes the example's charge insert fail for customers starting with `prefix`, as a
/// handler that fails after its step; `None` lets them through again.
async fn refuse(direct: &PgPool, name: &str, prefix: Option<&str>) {
    let sql = match prefix {
        Some(prefix) => format!(
            "ALTER TABLE charges ADD CONSTRAINT {name} CHECK (customer NOT LIKE '{prefix}%')"
        ),
        None => format!("ALTER TABLE charges DROP CONSTRAINT {name}"),
    };
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(direct)
        .await
        .expect("the constraint");
}

async fn the_contract(mode: &Mode) {
    let name = mode.name;
    let direct = &mode.direct;
    let processor = ProcessorServer::start().await;
    let p = &processor.processor;
    let url = processor.url();
    let client = reqwest::Client::new();
    // A repeated call makes a second charge: only idem stands between it and the money.
    p.ignore_keys(true);

    // SIGKILL after the step's record, before COMMIT: the handler sleeps in its
    // transaction after the processor's call.
    let mut doomed = Server::start(
        mode,
        &[("PROCESSOR_URL", &url), ("PROCESSOR_DELAY_MS", "30000")],
    )
    .await;
    let in_flight = tokio::spawn({
        let (client, url) = (client.clone(), doomed.url("/charges"));
        async move {
            let bearer = format!("Bearer {ACCOUNT}");
            post(
                &client,
                &url,
                Some("k-kill"),
                &body("cus_kill"),
                &[("authorization", bearer.as_str())],
            )
            .await
        }
    });
    eventually(
        &format!("{name}: the step's record"),
        Duration::from_secs(20),
        || async { count(direct, "idempotency_requests").await == 1 },
    )
    .await;
    doomed.kill();
    assert_eq!(in_flight.await.expect("the request").status, 0, "{name}");
    assert_eq!(p.total(), 1, "{name}");

    // Restarted, with a slow handler, so that the completion is seen in flight. Nobody
    // retries until the completer holds the request.
    let slow = Server::start(
        mode,
        &[("PROCESSOR_URL", &url), ("PROCESSOR_DELAY_MS", "1500")],
    )
    .await;
    eventually(
        &format!("{name}: the completion's start"),
        Duration::from_secs(30),
        || async {
            request_state(direct, "k-kill")
                .await
                .is_some_and(|(_, tries)| tries >= 1)
                || !charges_of(direct, "cus_kill").await.is_empty()
        },
    )
    .await;
    let mut answers = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = charge(&client, &slow, "k-kill", "cus_kill").await;
        let replayed = answer.replayed();
        answers.push((
            answer.status,
            replayed,
            answer.json()["processor_id"].clone(),
        ));
        if replayed || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (last, before) = answers.split_last().expect("an answer");
    assert_eq!(
        (last.0, last.1, &last.2),
        (201, true, &json!("ch_1")),
        "{name}: the completion's answer, replayed: {answers:?}"
    );
    assert!(
        before.iter().all(|(status, _, _)| *status == 409),
        "{name}: 409 while the completion runs: {answers:?}"
    );
    assert!(
        !before.is_empty(),
        "{name}: a retry met the completion in flight"
    );
    assert_eq!(
        charges_of(direct, "cus_kill").await,
        [Some("ch_1".to_owned())],
        "{name}"
    );
    assert_eq!(p.total(), 1, "{name}: the processor was called once");
    assert_eq!(count(direct, "idempotency_requests").await, 0, "{name}");
    assert_eq!(count(direct, "idempotency_steps").await, 0, "{name}");

    // Two instances: six charges whose handler failed after the step, and whose clients
    // went away; both completers run, each charge is completed once.
    let fast = Server::start(mode, &[("PROCESSOR_URL", &url)]).await;
    refuse(direct, "two_fail", Some("cus_two_")).await;
    let before = p.total();
    for n in 0..6 {
        let answer = charge(
            &client,
            &fast,
            &format!("k-two-{n}"),
            &format!("cus_two_{n}"),
        )
        .await;
        assert_eq!(answer.status, 500, "{name}: {answer:?}");
    }
    refuse(direct, "two_fail", None).await;
    assert_eq!(p.total(), before + 6, "{name}");
    eventually(
        &format!("{name}: six completions"),
        Duration::from_secs(40),
        || async { count(direct, "charges WHERE customer LIKE 'cus_two_%'").await == 6 },
    )
    .await;
    for n in 0..6 {
        let ids = charges_of(direct, &format!("cus_two_{n}")).await;
        assert_eq!(ids.len(), 1, "{name}: cus_two_{n} charged once: {ids:?}");
        let late = charge(
            &client,
            &fast,
            &format!("k-two-{n}"),
            &format!("cus_two_{n}"),
        )
        .await;
        assert!(late.replayed(), "{name}: {late:?}");
        assert_eq!(late.json()["processor_id"], json!(ids[0]), "{name}");
    }
    assert_eq!(p.total(), before + 6, "{name}: no second call");
    eventually(
        &format!("{name}: no stored request left"),
        Duration::from_secs(5),
        || async { count(direct, "idempotency_requests").await == 0 },
    )
    .await;

    // A handler that fails for ever: parked after three failures, listed; the
    // operator's abandon refunds the processor's charge once, and the key answers 410.
    refuse(direct, "forever", Some("cus_forever")).await;
    let failed = charge(&client, &fast, "k-forever", "cus_forever").await;
    assert_eq!(failed.status, 500, "{name}: {failed:?}");
    let charged = p
        .keys()
        .into_iter()
        .find(|key| p.bodies(key).iter().any(|b| b["customer"] == "cus_forever"))
        .expect("the processor's call");
    eventually(
        &format!("{name}: parked"),
        Duration::from_secs(30),
        || async {
            request_state(direct, "k-forever")
                .await
                .is_some_and(|(state, _)| state == "failed")
        },
    )
    .await;
    let builder = idem::Store::builder(direct.clone());
    let store = if mode.portable {
        builder.portable(true)
    } else {
        builder
    }
    .build()
    .expect("a store");
    let listed = store
        .operate()
        .abandoned(Duration::ZERO, 100)
        .await
        .expect("the abandoned requests");
    let parked = listed
        .iter()
        .find(|a| a.key == "k-forever")
        .unwrap_or_else(|| panic!("{name}: listed: {listed:?}"));
    let completion = parked.completion.as_ref().expect("its completion");
    assert_eq!(completion.state, "failed", "{name}");
    assert_eq!(completion.failures, 3, "{name}");
    assert!(
        completion
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("500")),
        "{name}: {completion:?}"
    );
    assert!(
        p.refunds().is_empty(),
        "{name}: nothing refunded before the abandon"
    );
    let operator = store.operate().audited(Operator::new("ops", "test"));
    assert!(operator
        .abandon_request("charges", ACCOUNT, "k-forever")
        .await
        .expect("abandon"));
    assert!(
        !operator
            .abandon_request("charges", ACCOUNT, "k-nothing")
            .await
            .expect("abandon"),
        "{name}: nothing to abandon"
    );
    eventually(
        &format!("{name}: abandoned"),
        Duration::from_secs(30),
        || async { count(direct, "idempotency_requests").await == 0 },
    )
    .await;
    let refunds = p.refunds();
    assert_eq!(refunds.len(), 1, "{name}: one refund: {refunds:?}");
    let charge_id = p.bodies(&charged).len();
    assert_eq!(charge_id, 1, "{name}");
    assert_eq!(
        refunds[0].1["charge"]
            .as_str()
            .map(|c| c.starts_with("ch_")),
        Some(true)
    );
    assert_eq!(
        refunds[0].0.len(),
        64,
        "{name}: the compensation's derived key"
    );
    assert_ne!(refunds[0].0, charged, "{name}: a key of its own");
    let late = charge(&client, &fast, "k-forever", "cus_forever").await;
    assert_eq!(late.status, 410, "{name}: {late:?}");
    assert!(late.replayed(), "{name}");
    assert!(charges_of(direct, "cus_forever").await.is_empty(), "{name}");
    // The operator's abandon, then the completer's, naming what it undid: written after
    // the abandon's COMMIT, in a transaction of its own, so it may follow the 410 by a
    // moment.
    let trail = || async {
        sqlx::query_scalar::<_, String>("SELECT action FROM idem_audit ORDER BY id")
            .fetch_all(direct)
            .await
            .expect("the audit trail")
    };
    eventually(
        &format!("{name}: the audit trail"),
        Duration::from_secs(10),
        || async { trail().await.len() >= 2 },
    )
    .await;
    assert_eq!(trail().await, ["abandon", "abandoned"], "{name}");
    refuse(direct, "forever", None).await;
    drop((slow, fast));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_charges_are_completed_once() {
    with_test_db(async |db| {
        let mode = Mode {
            name: "default",
            database_url: db.url(),
            env: &[],
            direct: db.pool(4).await,
            portable: false,
        };
        the_contract(&mode).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_charges_are_completed_once_behind_pgbouncer() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let mode = Mode {
            name: "pooler",
            database_url: bouncer.url(),
            env: &[("DB_POOLER", "transaction")],
            direct: db.pool(4).await,
            portable: false,
        };
        the_contract(&mode).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_charges_are_completed_once_on_citus() {
    let Some(cluster) = Citus::start("completion::citus", 2).await else {
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
        portable: true,
    };
    the_contract(&mode).await;
}
