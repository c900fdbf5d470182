//! The `idem` binary itself, run as a user runs it, against a real database on the three
//! topologies: PostgreSQL directly, behind PgBouncer in transaction mode
//! (`--pooler transaction`) and on a Citus cluster (`--portable`). Its keys and events
//! are made by idem itself (`run_once`, `Tx::emit`, and a relay whose publisher fails),
//! then every command reads or moves them; and each way a command can fail says so in one
//! line with its exit code.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idem::outbox::{Event, OutboxEvent, PublishError, Publisher};
use idem::Store;
use idem_tests::{with_test_db, Citus, Pgbouncer, TestDb};
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// Runs `idem` with `DATABASE_URL=url`, `flags` before `args`, nothing on its stdin.
fn idem(url: &str, flags: &[&str], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .env("DATABASE_URL", url)
        .args(flags)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run idem")
}

/// `idem ... --json`, which must succeed: its JSON.
fn json(url: &str, flags: &[&str], args: &[&str]) -> Value {
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let out = idem(url, flags, &with_json);
    assert!(out.status.success(), "idem {args:?}: {}", said(&out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("idem {args:?}: {e}: {}", said(&out)))
}

fn said(out: &Output) -> String {
    format!(
        "exit {:?}, stdout {:?}, stderr {:?}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The ids of the events a JSON list names.
fn ids(list: &Value) -> Vec<&str> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect()
}

/// The highest `seq` of the events `ids`: what the bound of a preview of them names.
async fn highest_seq(pool: &PgPool, ids: &[&str]) -> i64 {
    let ids: Vec<String> = ids.iter().map(|id| (*id).to_owned()).collect();
    sqlx::query_scalar("SELECT max(seq) FROM idem_outbox WHERE id = ANY($1)")
        .bind(ids)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// An audit row's filter with the instant of its preview's bound, when it has one,
/// written `T`: `all; as previewed: seq <= 5, parked by T, 3 previewed`.
fn unstamped(filter: &str) -> String {
    let Some((before, after)) = filter.split_once(", parked by ") else {
        return filter.to_owned();
    };
    let (instant, rest) = after.split_once(',').unwrap_or((after, ""));
    assert!(instant.ends_with('Z'), "an RFC 3339 instant: {filter}");
    format!("{before}, parked by T,{rest}")
}

/// The exit code, and stderr, which must be one line starting with `idem: `.
fn failure(out: &Output) -> (i32, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(stderr.lines().count(), 1, "one line: {}", said(out));
    assert!(stderr.starts_with("idem: "), "{}", said(out));
    (out.status.code().unwrap_or(-1), stderr)
}

/// A publisher that never delivers: `nowhere.*` and `gone.*` fail for good (two
/// reasons), anything else fails for now.
struct Refusing;

impl Publisher for Refusing {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        if event.topic.starts_with("nowhere.") {
            Err(PublishError::permanent("no stream captures the subject"))
        } else if event.topic.starts_with("gone.") {
            Err(PublishError::permanent("the stream was deleted"))
        } else {
            Err(PublishError::retry("broker unavailable"))
        }
    }
}

/// Two keys of scope `jobs`, whose work emits three events that park (two for one
/// reason, one for another) and two of ordering key `acct-1` that the relay holds in a
/// backoff: one leased by the backoff, the other waiting behind it.
async fn seed(store: &Store) {
    for (key, topics) in [
        ("job-1", vec!["nowhere.a", "nowhere.b", "slow.x", "slow.x"]),
        ("job-2", vec!["gone.a"]),
    ] {
        store
            .run_once("jobs", key)
            .run(async |mut tx| {
                for topic in topics {
                    let mut event = Event::new(topic, &serde_json::json!({ "job": key }));
                    if topic == "slow.x" {
                        event = event.ordering_key("acct-1");
                    }
                    tx.emit(event).await?;
                }
                Ok::<_, sqlx::Error>(format!("done {key}"))
            })
            .await
            .expect("run the job");
    }
    store
        .relay(Refusing)
        .max_attempts(3)
        .backoff(Duration::from_secs(3_600), Duration::from_secs(3_600))
        .run_until_idle()
        .await
        .expect("run the relay");
}

/// A fresh database's URL, a pool of `connections` on it, and a store whose tables hold
/// [`seed`]'s rows.
async fn seeded(db: &TestDb, connections: u32) -> (String, PgPool, Store) {
    let pool = db.pool(connections).await;
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    seed(&store).await;
    (db.url(), pool, store)
}

/// Every command on one topology; `flags` say how to reach it (`--pooler transaction`,
/// `--portable`); `store` writes through a direct connection.
async fn every_command(url: &str, flags: &[&str], store: &Store) {
    let printed = idem(url, flags, &["migrate", "--print"]);
    let ddl = String::from_utf8_lossy(&printed.stdout);
    assert!(
        ddl.contains("CREATE TABLE IF NOT EXISTS \"idempotency_keys\""),
        "{ddl}"
    );
    assert!(
        ddl.contains("CREATE TABLE IF NOT EXISTS \"idem_outbox\""),
        "{ddl}"
    );
    assert!(
        ddl.contains("CREATE TABLE IF NOT EXISTS \"idempotency_steps\""),
        "{ddl}"
    );
    assert!(
        ddl.contains("CREATE TABLE IF NOT EXISTS \"idempotency_requests\""),
        "{ddl}"
    );
    assert!(
        ddl.contains("CREATE TABLE IF NOT EXISTS \"idem_audit\""),
        "{ddl}"
    );
    assert_eq!(json(url, flags, &["migrate"])["ok"], true);
    assert_eq!(json(url, flags, &["verify"])["ok"], true);
    seed(store).await;

    // A key: its record, its body only when asked, a missing one (exit 3).
    let key = json(url, flags, &["key", "status", "jobs", "job-1"]);
    assert_eq!(key["status"], 200, "{key}");
    assert_eq!(key["fingerprint"].as_str().unwrap().len(), 64, "{key}");
    assert!(key["body"].is_null(), "hidden unless asked: {key}");
    assert!(key["created_at"].as_str().unwrap().ends_with('Z'), "{key}");
    let with_body = json(url, flags, &["key", "status", "jobs", "job-1", "--body"]);
    assert!(
        with_body["body"].as_str().unwrap().contains("done job-1"),
        "{with_body}"
    );
    let missing = idem(url, flags, &["key", "status", "jobs", "job-9"]);
    let (code, line) = failure(&missing);
    assert_eq!(code, 3, "{line}");
    assert!(line.contains("job-9"), "{line}");

    let listed = json(url, flags, &["key", "list", "--scope", "jobs"]);
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), 2, "{listed}");
    assert!(
        keys.contains(&"job-1") && keys.contains(&"job-2"),
        "{listed}"
    );
    assert!(json(url, flags, &["key", "list", "--older-than", "1h"])
        .as_array()
        .unwrap()
        .is_empty());
    let counts = json(url, flags, &["key", "counts"]);
    assert_eq!(counts[0]["scope"], "jobs", "{counts}");
    assert_eq!(counts[0]["live"], 2, "{counts}");
    assert_eq!(counts[0]["expiring"], 0, "{counts}");
    let table = idem(url, flags, &["key", "counts"]);
    assert!(
        String::from_utf8_lossy(&table.stdout)
            .starts_with("SCOPE  LIVE  EXPIRING  EXPIRED\njobs   2     0         0"),
        "{}",
        said(&table)
    );

    // A request that made its outside call and never committed: abandoned, listed once
    // its newest step is as old as asked.
    let gone = store
        .run_once("jobs", "job-3")
        .run(async |mut tx| {
            tx.step("processor", async |_key| Ok::<_, String>(7_i64))
                .await
                .map_err(|e| e.to_string())?;
            Err::<(), String>("the client went away".into())
        })
        .await;
    assert!(gone.is_err());
    let abandoned = json(url, flags, &["key", "abandoned", "--idle-for", "0s"]);
    assert_eq!(abandoned.as_array().unwrap().len(), 1, "{abandoned}");
    assert_eq!(abandoned[0]["scope"], "jobs", "{abandoned}");
    assert_eq!(abandoned[0]["key"], "job-3", "{abandoned}");
    assert_eq!(abandoned[0]["steps"][0]["step"], "processor", "{abandoned}");
    assert!(
        abandoned[0]["completion"].is_null(),
        "run_once stores no request: {abandoned}"
    );
    assert!(json(url, flags, &["key", "abandoned"])
        .as_array()
        .unwrap()
        .is_empty());
    let table = idem(url, flags, &["key", "abandoned", "--idle-for", "0s"]);
    let printed = String::from_utf8_lossy(&table.stdout);
    assert!(printed.starts_with("SCOPE"), "{}", said(&table));
    assert!(
        printed.contains("job-3")
            && printed.contains("processor at ")
            && printed.contains("not completable"),
        "{printed}"
    );
    // Abandoned for good, found by the key its caller gave (spread by its hash in the
    // portable mode): listed as being abandoned.
    assert_eq!(
        json(
            url,
            flags,
            &[
                "key",
                "abandon",
                "jobs",
                "job-3",
                "--yes",
                "--operator",
                "ana"
            ]
        )["abandoned"],
        1
    );
    let abandoned = json(url, flags, &["key", "abandoned", "--idle-for", "0s"]);
    assert_eq!(
        abandoned[0]["completion"]["state"], "abandoning",
        "{abandoned}"
    );
    assert_eq!(abandoned[0]["completion"]["stored"], false, "{abandoned}");

    // Purging asks first: without a terminal and without --yes, nothing happens.
    let (code, line) = failure(&idem(url, flags, &["key", "purge", "jobs", "job-2"]));
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("--yes"), "{line}");
    let ana = ["--operator", "ana"];
    assert_eq!(
        json(
            url,
            flags,
            &["key", "purge", "jobs", "job-2", "--yes", ana[0], ana[1]]
        )["purged"],
        1
    );
    assert_eq!(
        idem(url, flags, &["key", "status", "jobs", "job-2"])
            .status
            .code(),
        Some(3)
    );
    assert_eq!(
        json(url, flags, &["key", "sweep", ana[0], ana[1]])["swept"],
        0
    );

    // The outbox: two pending `slow.x` events, the first held in its backoff and
    // holding the second.
    let pending = json(url, flags, &["outbox", "pending"]);
    assert_eq!(pending[0]["topic"], "slow.x", "{pending}");
    assert_eq!(pending[0]["events"], 2, "{pending}");
    assert_eq!(pending[0]["held"], 1, "{pending}");
    assert!(
        json(url, flags, &["outbox", "lag"])["lag_secs"]
            .as_f64()
            .unwrap()
            >= 0.0
    );
    let leases = json(url, flags, &["outbox", "leases"]);
    assert_eq!(leases.as_array().unwrap().len(), 1, "{leases}");
    assert_eq!(leases[0]["last_error"], "broker unavailable", "{leases}");
    // No relay runs now: none holds a session.
    assert!(json(url, flags, &["outbox", "relays"])
        .as_array()
        .unwrap()
        .is_empty());
    // Its attempt history: one failed publish so far, with its time.
    let id = leases[0]["id"].as_str().unwrap();
    let errors = json(url, flags, &["outbox", "errors", id]);
    assert_eq!(errors.as_array().unwrap().len(), 1, "{errors}");
    assert_eq!(errors[0]["error"], "broker unavailable", "{errors}");
    assert!(errors[0]["at"].as_str().unwrap().ends_with('Z'), "{errors}");
    let (code, line) = failure(&idem(url, flags, &["outbox", "errors", "deadbeef"]));
    assert_eq!(code, 3, "{line}");
    assert!(
        line.contains("\"deadbeef\"") && line.contains("dead --list"),
        "{line}"
    );
    let printed = idem(url, flags, &["outbox", "errors", id]);
    let printed = String::from_utf8_lossy(&printed.stdout);
    assert!(
        printed.starts_with("AT") && printed.contains("broker unavailable"),
        "{printed}"
    );
    let blocked = json(url, flags, &["outbox", "blocked"]);
    assert_eq!(blocked[0]["ordering_key"], "acct-1", "{blocked}");
    assert_eq!(blocked[0]["waiting"], 1, "{blocked}");
    assert_eq!(blocked[0]["blocking"]["id"], leases[0]["id"], "{blocked}");

    // Dead events by reason; a dry run moves nothing; then by reason, and the rest.
    let reasons = json(url, flags, &["outbox", "dead"]);
    assert_eq!(
        reasons[0]["reason"], "no stream captures the subject",
        "{reasons}"
    );
    assert_eq!(reasons[0]["events"], 2, "{reasons}");
    assert_eq!(
        reasons[0]["topics"],
        serde_json::json!(["nowhere.a", "nowhere.b"])
    );
    assert_eq!(reasons[1]["reason"], "the stream was deleted", "{reasons}");
    let reason = "no stream captures the subject";
    let dry = json(
        url,
        flags,
        &["outbox", "redrive", "--reason", reason, "--dry-run"],
    );
    assert_eq!(dry["events"], 2, "{dry}");
    assert_eq!(dry["list"].as_array().unwrap().len(), 2, "{dry}");
    let counts = |reasons: &Value| -> Vec<(String, u64)> {
        let list = reasons.as_array().unwrap().iter();
        list.map(|r| {
            (
                r["reason"].as_str().unwrap().to_owned(),
                r["events"].as_u64().unwrap(),
            )
        })
        .collect()
    };
    let after = json(url, flags, &["outbox", "dead"]);
    assert_eq!(counts(&after), counts(&reasons), "a dry run moves nothing");
    // Without a terminal to ask on, a re-drive is refused unless --yes, as a discard is.
    let (code, line) = failure(&idem(
        url,
        flags,
        &["outbox", "redrive", "--reason", reason],
    ));
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("--yes"), "{line}");
    let redriven_through = highest_seq(store.pool(), &ids(&dry["list"])).await;
    assert_eq!(
        json(
            url,
            flags,
            &["outbox", "redrive", "--reason", reason, "--yes", ana[0], ana[1]]
        )["redriven"],
        2
    );
    let pending = json(url, flags, &["outbox", "pending"]);
    assert_eq!(
        pending.as_array().unwrap().len(),
        3,
        "re-driven, pending again: {pending}"
    );
    let dead = json(url, flags, &["outbox", "dead", "--list"]);
    assert_eq!(dead.as_array().unwrap().len(), 1, "{dead}");
    assert_eq!(dead[0]["topic"], "gone.a", "{dead}");
    let (code, _) = failure(&idem(url, flags, &["outbox", "discard", "--all"]));
    assert_eq!(code, 2);
    let by_id = dead[0]["id"].as_str().unwrap();
    let discarded_through = highest_seq(store.pool(), &[by_id]).await;
    assert_eq!(
        json(
            url,
            flags,
            &["outbox", "discard", "--id", by_id, "--yes", ana[0], ana[1]]
        )["discarded"],
        1
    );
    assert!(json(url, flags, &["outbox", "dead"])
        .as_array()
        .unwrap()
        .is_empty());
    let table = idem(url, flags, &["outbox", "pending"]);
    assert!(
        String::from_utf8_lossy(&table.stdout).starts_with("TOPIC"),
        "{}",
        said(&table)
    );

    // The audit trail: each action, newest first, with its operator, what it selected and
    // how many rows it moved; the dry run and the actions refused without --yes wrote
    // nothing.
    let trail = json(url, flags, &["audit"]);
    let rows: Vec<(String, String, String, String, u64)> = trail
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let text = |field: &str| e[field].as_str().unwrap().to_owned();
            let rows = e["rows"].as_u64().unwrap();
            (
                text("operator"),
                text("via"),
                text("action"),
                unstamped(&text("filter")),
                rows,
            )
        })
        .collect();
    let row = |action: &str, filter: &str, rows: u64| {
        let ana = "ana".to_owned();
        (
            ana,
            "cli".to_owned(),
            action.to_owned(),
            filter.to_owned(),
            rows,
        )
    };
    assert_eq!(
        rows,
        [
            row(
                "discard",
                &format!("ids {by_id}; as previewed: seq <= {discarded_through}, parked by T, 1 previewed"),
                1
            ),
            row(
                "redrive",
                &format!("reason {reason:?}; as previewed: seq <= {redriven_through}, parked by T, 2 previewed"),
                2
            ),
            row("sweep", "expired, batch 1000", 0),
            row("purge", "scope \"jobs\", key \"job-2\"", 1),
            row("abandon", "scope \"jobs\", key \"job-3\"", 1),
        ],
        "{trail}"
    );
    assert!(trail[0]["at"].as_str().unwrap().ends_with('Z'), "{trail}");
    // A page, and the next one before its last row.
    let first = json(url, flags, &["audit", "--limit", "2"]);
    assert_eq!(first.as_array().unwrap().len(), 2, "{first}");
    let last = first[1]["id"].to_string();
    let next = json(url, flags, &["audit", "--before", &last]);
    let actions: Vec<&str> = next
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["sweep", "purge", "abandon"], "{next}");
    let table = idem(url, flags, &["audit"]);
    let printed = String::from_utf8_lossy(&table.stdout);
    assert!(printed.starts_with("ID"), "{}", said(&table));
    assert!(
        printed.contains("ana") && printed.contains("redrive"),
        "{printed}"
    );

    abandoned_pages(url, flags, store.pool()).await;
}

/// Five abandoned requests for the list's filters and pages, oldest first step first:
/// `p-1` (scope `charges`, principal `acct_1`, its first step an hour ago and its second
/// 50 minutes ago; failed), `p-2` (`charges`, `acct_2`, its first step at the same instant
/// as `p-1`'s, so after it by principal; pending), `p-3` (`charges`, `acct_1`, 40 minutes
/// ago; its endpoint stored nothing), `q-4` (`mail`, no principal, 30 minutes ago;
/// stored nothing), `p-5` (`charges`, `acct_2`, 20 minutes ago; abandoned by an operator,
/// stored nothing).
async fn seed_abandoned_pages(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO idempotency_steps
             (scope, principal, key, step, fingerprint, result, created_at, expires_at)
         SELECT scope, principal, key, step, decode('00', 'hex'), '7',
                now() - make_interval(mins => ago), now() + interval '1 day'
           FROM (VALUES ('charges', 'acct_1', 'p-1', 'processor', 60),
                        ('charges', 'acct_1', 'p-1', 'ledger', 50),
                        ('charges', 'acct_2', 'p-2', 'processor', 60),
                        ('charges', 'acct_1', 'p-3', 'processor', 40),
                        ('mail', '', 'q-4', 'processor', 30),
                        ('charges', 'acct_2', 'p-5', 'processor', 20))
                AS s (scope, principal, key, step, ago)",
    )
    .execute(pool)
    .await
    .expect("the steps");
    sqlx::query(
        "INSERT INTO idempotency_requests
             (scope, principal, key, fingerprint, method, target, headers, body, state,
              expires_at)
         SELECT 'charges', principal, key, decode('00', 'hex'), method, '/charges', '[]',
                convert_to('{}', 'UTF8'), state, now() + interval '1 day'
           FROM (VALUES ('acct_1', 'p-1', 'POST', 'failed'),
                        ('acct_2', 'p-2', 'POST', 'pending'),
                        ('acct_2', 'p-5', NULL, 'abandoning'))
                AS r (principal, key, method, state)",
    )
    .execute(pool)
    .await
    .expect("the requests");
}

/// Issue 39: `idem key abandoned` finds requests by scope, principal, key prefix,
/// completion and idle time, a page at a time by keyset: oldest first step first (ties
/// by scope, principal and key), the next page `--after` the last row's `cursor` in JSON,
/// or the cursor a table's last line names.
async fn abandoned_pages(url: &str, flags: &[&str], pool: &PgPool) {
    seed_abandoned_pages(pool).await;
    let keys = |listed: &Value| -> Vec<String> {
        let rows = listed.as_array().unwrap().iter();
        rows.map(|r| r["key"].as_str().unwrap().to_owned())
            .collect()
    };
    let paged = ["key", "abandoned", "--idle-for", "10m", "--limit", "2"];
    let mut after: Option<String> = None;
    let mut seen = Vec::new();
    // Bounded: a cursor that does not move on repeats a page.
    for _ in 0..10 {
        let mut args = paged.to_vec();
        if let Some(after) = &after {
            args.extend(["--after", after.as_str()]);
        }
        let page = json(url, flags, &args);
        seen.push(keys(&page));
        // A table ends with the next page's flag, the cursor of its last row, while
        // more rows follow.
        let table = idem(url, flags, &args);
        let printed = String::from_utf8_lossy(&table.stdout).into_owned();
        let next = printed
            .lines()
            .last()
            .and_then(|line| line.strip_prefix("next page: --after "))
            .map(str::to_owned);
        match page.as_array().unwrap().last() {
            Some(last) if next.is_some() => {
                assert_eq!(last["cursor"].as_str(), next.as_deref(), "{printed}");
                after = next;
            }
            _ => break,
        }
    }
    // `job-3`, abandoned above a moment ago, is listed whatever its idle time: it is in
    // an operator's hands.
    assert_eq!(
        seen,
        [vec!["p-1", "p-2"], vec!["p-3", "q-4"], vec!["p-5", "job-3"]],
        "{seen:?}"
    );
    for (filter, expected) in [
        (
            &["--scope", "charges"][..],
            &["p-1", "p-2", "p-3", "p-5"][..],
        ),
        (&["--principal", "acct_2"], &["p-2", "p-5"]),
        (&["--prefix", "q-"], &["q-4"]),
        (&["--completion", "failed"], &["p-1"]),
        (&["--completion", "pending"], &["p-2"]),
        (&["--completion", "abandoning"], &["p-5", "job-3"]),
        (
            &["--completion", "not-completable"],
            &["p-3", "q-4", "p-5", "job-3"],
        ),
        (
            &[
                "--scope",
                "charges",
                "--principal",
                "acct_1",
                "--prefix",
                "p-",
            ],
            &["p-1", "p-3"],
        ),
        (&["--scope", "mail", "--completion", "failed"], &[]),
    ] {
        let mut args = vec!["key", "abandoned", "--idle-for", "10m"];
        args.extend(filter);
        assert_eq!(keys(&json(url, flags, &args)), expected, "{filter:?}");
    }
    let idle = json(url, flags, &["key", "abandoned", "--idle-for", "45m"]);
    assert_eq!(keys(&idle), ["p-1", "p-2", "p-5", "job-3"], "{idle}");
    for wrong in [["--completion", "done"], ["--after", "nothing"]] {
        let mut args = vec!["key", "abandoned"];
        args.extend(wrong);
        let out = idem(url, flags, &args);
        assert_eq!(out.status.code(), Some(2), "{wrong:?}: {}", said(&out));
    }
}

async fn direct_pool(options: sqlx::postgres::PgConnectOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(5)
        .connect_with(options)
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_on_postgresql() {
    with_test_db(async |db| {
        let store = Store::new(db.pool(5).await);
        every_command(&db.url(), &[], &store).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_behind_pgbouncer_in_transaction_mode() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let store = Store::new(db.pool(5).await);
        every_command(&bouncer.url(), &["--pooler", "transaction"], &store).await;
        // Without the flag, `verify` sees the pooler and says so.
        let (code, line) = failure(&idem(&bouncer.url(), &[], &["verify"]));
        assert_eq!(code, 4, "{line}");
        assert!(line.contains("pooler in transaction mode"), "{line}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_on_citus() {
    let Some(cluster) = Citus::start("cli::every_command_on_citus", 2).await else {
        return;
    };
    let pool = direct_pool(cluster.options()).await;
    let store = Store::builder(pool).portable(true).build().unwrap();
    every_command(&cluster.url(), &["--portable"], &store).await;
    let listed = json(&cluster.url(), &["--portable"], &["key", "list"]);
    assert_eq!(
        listed[0]["spread"], "key",
        "a portable store spreads keys by their hash: {listed}"
    );
}

/// A `run_once` id that is stored hashed (it has spaces) is found, and purged, by the id
/// the operator knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_found_by_the_text_it_was_given() {
    with_test_db(async |db| {
        let url = db.url();
        let store = Store::new(db.pool(2).await);
        store.migrate().await.unwrap();
        let id = "order 42 from acme";
        store
            .run_once("inbox", id)
            .run(async |_tx| Ok::<_, sqlx::Error>("booked".to_owned()))
            .await
            .unwrap();
        let key = json(&url, &[], &["key", "status", "inbox", id]);
        assert_eq!(key["status"], 200, "{key}");
        let purged = json(&url, &[], &["key", "purge", "inbox", id, "--yes"]);
        assert_eq!(purged["purged"], 1, "{purged}");
        let (code, line) = failure(&idem(&url, &[], &["key", "status", "inbox", id]));
        assert_eq!(code, 3, "{line}");
    })
    .await;
}

/// Issue 37: a dead event written longer ago than the re-drive window (its consumers'
/// `run_once` records may be gone) is listed as outside it, and a re-drive that selects
/// it moves nothing, says why in one line and exits 2, unless `--force`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_past_the_window_needs_force() {
    with_test_db(async |db| {
        let (url, pool, store) = seeded(db, 2).await;
        sqlx::query(
            "UPDATE idem_outbox SET created_at = now() - interval '2 days' WHERE topic = 'gone.a'",
        )
        .execute(&pool)
        .await
        .unwrap();

        let listed = json(&url, &[], &["outbox", "dead", "--list"]);
        let window: Vec<(&str, bool)> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["topic"].as_str().unwrap(), e["outside_window"] == true))
            .collect();
        assert_eq!(
            window,
            [("nowhere.a", false), ("nowhere.b", false), ("gone.a", true)],
            "{listed}"
        );
        assert!(
            listed[2]["age_secs"].as_f64().unwrap() >= 172_800.0,
            "{listed}"
        );
        let table = idem(&url, &[], &["outbox", "dead", "--list"]);
        let text = String::from_utf8_lossy(&table.stdout);
        assert!(
            text.contains("AGE_SECS") && text.contains("OUTSIDE") && text.contains("1d"),
            "{text}"
        );
        let dry = json(&url, &[], &["outbox", "redrive", "--all", "--dry-run"]);
        assert_eq!(dry["outside_window"], 1, "{dry}");
        assert_eq!(dry["needs_force"], true, "{dry}");
        assert_eq!(dry["redrive_max_age_secs"], 86_400.0, "{dry}");

        let (code, line) = failure(&idem(&url, &[], &["outbox", "redrive", "--all"]));
        assert_eq!(code, 2, "{line}");
        assert!(
            line.contains("1 of the 3") && line.contains("--force") && line.contains("(1d)"),
            "{line}"
        );
        let dead = json(&url, &[], &["outbox", "dead", "--list"]);
        assert_eq!(dead.as_array().unwrap().len(), 3, "nothing moved: {dead}");

        // The events within the window re-drive as before.
        let reason = "no stream captures the subject";
        let moved = json(
            &url,
            &[],
            &["outbox", "redrive", "--reason", reason, "--yes"],
        );
        assert_eq!(moved["redriven"], 2, "{moved}");
        // A wider window, as the service configures it, takes the old one in.
        let wider = ["--redrive-max-age", "3d"];
        let dry = json(&url, &wider, &["outbox", "redrive", "--all", "--dry-run"]);
        assert_eq!(dry["outside_window"], 0, "{dry}");
        let dry = json(
            &url,
            &[],
            &["outbox", "redrive", "--all", "--force", "--dry-run"],
        );
        assert_eq!(dry["needs_force"], false, "{dry}");
        let forced = json(
            &url,
            &[],
            &["outbox", "redrive", "--all", "--force", "--yes"],
        );
        assert_eq!(forced["redriven"], 1, "{forced}");
        assert!(store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .is_empty());
        // The refused re-drive moved nothing and recorded nothing; the dry runs neither.
        let trail = json(&url, &[], &["audit"]);
        let actions: Vec<(&str, &str, u64)> = trail
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let text = |field: &str| e[field].as_str().unwrap();
                // What each selected, before the bound of its preview.
                let selected = text("filter").split("; as previewed: ").next().unwrap();
                (text("action"), selected, e["rows"].as_u64().unwrap())
            })
            .collect();
        assert_eq!(
            actions,
            [
                ("redrive_forced", "all", 1),
                ("redrive", "reason \"no stream captures the subject\"", 2),
            ],
            "{trail}"
        );
    })
    .await;
}

/// Each way a command fails: one line, and the exit code scripts rely on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_say_what_is_wrong_in_one_line() {
    with_test_db(async |db| {
        let url = db.url();
        let (code, line) = failure(&idem(&url, &["--table", "nope"], &["key", "list"]));
        assert_eq!(code, 4, "{line}");
        assert!(
            line.contains("\"nope\" does not exist") && line.contains("--table"),
            "{line}"
        );
        let (code, line) = failure(&idem(&url, &["--table", "nope"], &["verify"]));
        assert_eq!(code, 4, "{line}");
        assert!(line.contains("`nope` does not exist"), "{line}");
        let (code, line) = failure(&idem(&url, &["--table", "Bad Name"], &["key", "list"]));
        assert_eq!(code, 2, "{line}");
        // A renamed steps table: its DDL printed under its name, made by `migrate`.
        let flags = ["--steps-table", "ops.call_log"];
        let printed = idem(&url, &flags, &["migrate", "--print"]);
        let ddl = String::from_utf8_lossy(&printed.stdout);
        assert!(
            ddl.contains("CREATE TABLE IF NOT EXISTS \"ops\".\"call_log\""),
            "{ddl}"
        );
        assert_eq!(json(&url, &flags, &["migrate"])["ok"], true);
        let made: bool = sqlx::query_scalar("SELECT to_regclass('ops.call_log') IS NOT NULL")
            .fetch_one(&db.pool(1).await)
            .await
            .unwrap();
        assert!(made);

        // Nothing listens on port 1.
        let (code, line) = failure(&idem(
            "postgres://postgres@127.0.0.1:1/x",
            &[],
            &["key", "list"],
        ));
        assert_eq!(code, 5, "{line}");
        assert!(
            line.contains("cannot reach PostgreSQL at 127.0.0.1:1/x"),
            "{line}"
        );

        // A role that may log in and nothing more.
        assert_eq!(json(&url, &[], &["migrate"])["ok"], true);
        let pool = db.pool(1).await;
        let role = format!("idem_cli_{}", std::process::id());
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let as_role = url.replacen("postgres@", &format!("{role}@"), 1);
        let (code, line) = failure(&idem(&as_role, &[], &["outbox", "dead"]));
        let (code2, line2) = failure(&idem(&as_role, &[], &["key", "status", "jobs", "k"]));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
            .execute(&pool)
            .await
            .ok();
        assert_eq!(code, 6, "{line}");
        assert!(
            line.contains("permission denied") && line.contains(&role),
            "{line}"
        );
        assert_eq!(code2, 6, "{line2}");

        // No database named at all.
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .env_remove("DATABASE_URL")
            .args(["key", "list"])
            .output()
            .unwrap();
        let (code, line) = failure(&out);
        assert_eq!(code, 2, "{line}");
        assert!(line.contains("DATABASE_URL"), "{line}");
    })
    .await;
}

/// Issue 39: a key looked up without `--principal` that exists only under principals
/// says so, naming five of them and how many more, never the value a key without a
/// principal is kept under (here a tenant's spread).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_under_principals_names_them_when_not_found_without_one() {
    with_test_db(async |db| {
        let url = db.url();
        let pool = db.pool(2).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        for spread in [None, Some("tenant-9")] {
            let once = store.run_once("charges", "ch-1");
            let once = match spread {
                Some(tenant) => once.spread_by(tenant),
                None => once,
            };
            once.run(async |_tx| Ok::<_, sqlx::Error>("charged".to_owned()))
                .await
                .unwrap();
        }
        // The record kept under nobody, copied to seven principals, then gone.
        sqlx::raw_sql(
            "CREATE TEMP TABLE held AS SELECT * FROM idempotency_keys
               WHERE scope = 'charges' AND key = 'ch-1';
             INSERT INTO idempotency_keys
             SELECT (jsonb_populate_record(held, jsonb_build_object('principal', 'acct_' || n))).*
               FROM held, generate_series(1, 7) AS n;
             DELETE FROM idempotency_keys
              WHERE scope = 'charges' AND key = 'ch-1' AND principal = ''",
        )
        .execute(&pool)
        .await
        .unwrap();

        let (code, line) = failure(&idem(&url, &[], &["key", "status", "charges", "ch-1"]));
        assert_eq!(code, 3, "{line}");
        assert!(
            line.contains(
                "pass --principal (\"acct_1\", \"acct_2\", \"acct_3\", \"acct_4\", \"acct_5\" and 2 more)"
            ),
            "{line}"
        );
        assert!(!line.contains("tenant-9"), "{line}");
        let (code, line) = failure(&idem(
            &url,
            &[],
            &["key", "purge", "charges", "ch-1", "--yes"],
        ));
        assert_eq!(code, 3, "{line}");
        assert!(line.contains("pass --principal (\"acct_1\""), "{line}");
        // With the principal it is found; a key nobody holds gets no hint.
        let key = json(
            &url,
            &[],
            &["key", "status", "charges", "ch-1", "--principal", "acct_6"],
        );
        assert_eq!(key["status"], 200, "{key}");
        let (code, line) = failure(&idem(&url, &[], &["key", "status", "charges", "ch-2"]));
        assert_eq!(code, 3, "{line}");
        assert!(!line.contains("--principal"), "{line}");
    })
    .await;
}

/// Issue 39: a re-drive or a discard whose filter matches nothing moves nothing, says
/// so with what was asked, and exits 3 (it said "re-drove 0" and exited 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_that_matched_nothing_exits_3() {
    with_test_db(async |db| {
        let (url, _, _) = seeded(db, 2).await;
        let (code, line) = failure(&idem(&url, &[], &["outbox", "redrive", "--id", "deadbeef"]));
        assert_eq!(code, 3, "{line}");
        assert!(
            line.contains("no dead event has the id deadbeef")
                && line.contains("nothing re-driven"),
            "{line}"
        );
        let (code, line) = failure(&idem(
            &url,
            &[],
            &["outbox", "redrive", "--reason", "no such reason", "--force"],
        ));
        assert_eq!(code, 3, "{line}");
        assert!(line.contains("\"no such reason\""), "{line}");
        let (code, line) = failure(&idem(
            &url,
            &[],
            &["outbox", "discard", "--reason", "no such reason", "--yes"],
        ));
        assert_eq!(code, 3, "{line}");
        assert!(line.contains("nothing discarded"), "{line}");
        let dead = json(&url, &[], &["outbox", "dead", "--list"]);
        assert_eq!(dead.as_array().unwrap().len(), 3, "nothing moved: {dead}");
    })
    .await;
}

/// Abandoned requests as idem leaves them, each with a step recorded an hour ago: of
/// principal `acct_1` in scope `charges`, `k-failed` and `k-parked` stored and parked as
/// failed after five runs; `k-plain` in scope `jobs`, of an endpoint that stores no
/// request.
async fn seed_abandoned(pool: &PgPool) {
    for (scope, principal, key) in [
        ("charges", "acct_1", "k-failed"),
        ("charges", "acct_1", "k-parked"),
        ("jobs", "", "k-plain"),
    ] {
        sqlx::query(
            "INSERT INTO idempotency_steps
                 (scope, principal, key, step, fingerprint, result, created_at, expires_at)
             VALUES ($1, $2, $3, 'processor', decode('00', 'hex'), '7',
                     now() - interval '1 hour', now() + interval '1 day')",
        )
        .bind(scope)
        .bind(principal)
        .bind(key)
        .execute(pool)
        .await
        .expect("a step");
    }
    sqlx::query(
        "INSERT INTO idempotency_requests
             (scope, principal, key, fingerprint, method, target, headers, body, state, tries,
              failures, last_error, error_at, expires_at)
         SELECT 'charges', 'acct_1', key, decode('00', 'hex'), 'POST', '/charges', '[]',
                convert_to('{}', 'UTF8'), 'failed', 5, 5,
                'the processor declined:' || chr(10) || 'card expired',
                now() - interval '1 minute', now() + interval '1 day'
           FROM unnest(ARRAY['k-failed', 'k-parked']) AS key",
    )
    .execute(pool)
    .await
    .expect("the stored requests");
}

/// The state and failures of `key`'s row in the requests table, if it has one.
async fn request_state(pool: &PgPool, key: &str) -> Option<(String, i32)> {
    sqlx::query_as("SELECT state, failures FROM idempotency_requests WHERE key = $1")
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Issue 38 and 39: `idem key abandoned` shows where each request's completion stands;
/// `idem key complete` sends a stored one to the completer (a parked one is pending again,
/// its failures forgotten); `idem key abandon` asks first (or `--yes`), says with
/// `--dry-run` which steps it would compensate, and marks the request to be abandoned;
/// both are audited, and one that finds nothing to act on exits 3 in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_request_is_completed_or_abandoned() {
    with_test_db(async |db| {
        let (url, pool) = (db.url(), db.pool(2).await);
        Store::new(pool.clone()).migrate().await.unwrap();
        seed_abandoned(&pool).await;

        let listed = json(&url, &[], &["key", "abandoned", "--idle-for", "0s"]);
        let failed = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["key"] == "k-failed")
            .unwrap_or_else(|| panic!("k-failed in {listed}"));
        let completion = &failed["completion"];
        assert_eq!(completion["state"], "failed", "{completion}");
        assert_eq!(completion["stored"], true, "{completion}");
        assert_eq!(
            (&completion["tries"], &completion["failures"]),
            (&Value::from(5), &Value::from(5)),
            "{completion}"
        );
        assert_eq!(
            completion["last_error"], "the processor declined:\ncard expired",
            "{completion}"
        );
        assert!(
            completion["error_at"].as_str().unwrap().ends_with('Z'),
            "{completion}"
        );
        let plain = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["key"] == "k-plain")
            .unwrap_or_else(|| panic!("k-plain in {listed}"));
        assert!(plain["completion"].is_null(), "{plain}");
        let table = idem(&url, &[], &["key", "abandoned", "--idle-for", "0s"]);
        let printed = String::from_utf8_lossy(&table.stdout);
        let mut lines = printed.lines();
        let header = lines.next().unwrap_or_default();
        assert!(
            header.ends_with("IDLE FOR  STATE            TRIES  FAILURES  LAST ERROR"),
            "{printed}"
        );
        assert_eq!(lines.count(), 3, "one line each: {printed}");
        for expected in [
            "  failed           5      5         at ",
            ": the processor declined: card expired",
            "  not completable  -      -         -",
        ] {
            assert!(printed.contains(expected), "{expected:?} in {printed}");
        }

        // Complete: the parked request is pending again, its failures forgotten.
        let ana = ["--operator", "ana"];
        let done = idem(
            &url,
            &ana,
            &[
                "key",
                "complete",
                "charges",
                "k-parked",
                "--principal",
                "acct_1",
            ],
        );
        assert!(done.status.success(), "{}", said(&done));
        assert!(
            String::from_utf8_lossy(&done.stdout)
                .contains("the completer will run it at its next look"),
            "{}",
            said(&done)
        );
        assert_eq!(
            request_state(&pool, "k-parked").await,
            Some(("pending".to_owned(), 0))
        );
        // A request its endpoint did not store, and a key without live steps: exit 3.
        let (code, line) = failure(&idem(&url, &ana, &["key", "complete", "jobs", "k-plain"]));
        assert_eq!(code, 3, "{line}");
        assert!(
            line.contains("not completable") && line.contains("idem key abandon"),
            "{line}"
        );
        let (code, line) = failure(&idem(
            &url,
            &ana,
            &["key", "complete", "charges", "k-failed"],
        ));
        assert_eq!(code, 3, "without its principal: {line}");
        assert!(
            line.contains("no live steps") && line.contains("nothing completed"),
            "{line}"
        );

        // Abandon: asks first; a dry run names the steps; --yes abandons.
        let abandon = [
            "key",
            "abandon",
            "charges",
            "k-failed",
            "--principal",
            "acct_1",
        ];
        let (code, line) = failure(&idem(&url, &ana, &abandon));
        assert_eq!(code, 2, "{line}");
        assert!(line.contains("--yes"), "{line}");
        let dry = idem(&url, &ana, &[&abandon[..], &["--dry-run"]].concat());
        let said_dry = String::from_utf8_lossy(&dry.stdout);
        assert!(
            dry.status.success()
                && said_dry.contains("would abandon key \"k-failed\"")
                && said_dry.contains("(processor)")
                && said_dry.contains("nothing done (--dry-run)"),
            "{}",
            said(&dry)
        );
        let dry = json(&url, &ana, &[&abandon[..], &["--dry-run"]].concat());
        assert_eq!(dry["steps"], serde_json::json!(["processor"]), "{dry}");
        assert_eq!(
            request_state(&pool, "k-failed").await,
            Some(("failed".to_owned(), 5))
        );
        let done = idem(&url, &ana, &[&abandon[..], &["--yes"]].concat());
        assert!(done.status.success(), "{}", said(&done));
        assert!(
            String::from_utf8_lossy(&done.stdout).contains(
                "the service's completer will undo its steps that have an undo registered and \
                 answer 410 to its key from then on, naming any step it did not undo"
            ),
            "{}",
            said(&done)
        );
        assert_eq!(
            request_state(&pool, "k-failed").await.unwrap().0,
            "abandoning"
        );
        let (code, line) = failure(&idem(
            &url,
            &ana,
            &["key", "abandon", "charges", "k-nothing", "--yes"],
        ));
        assert_eq!(code, 3, "{line}");
        assert!(line.contains("nothing abandoned"), "{line}");

        // The audit trail: the two actions, newest first; what exited 2, 3 or ran dry is
        // not there.
        let trail = json(&url, &[], &["audit"]);
        let rows: Vec<(&str, &str, &str, &str)> = trail
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let text = |field: &str| e[field].as_str().unwrap();
                (
                    text("operator"),
                    text("via"),
                    text("action"),
                    text("filter"),
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                (
                    "ana",
                    "cli",
                    "abandon",
                    "scope \"charges\", principal \"acct_1\", key \"k-failed\""
                ),
                (
                    "ana",
                    "cli",
                    "complete",
                    "scope \"charges\", principal \"acct_1\", key \"k-parked\""
                ),
            ],
            "{trail}"
        );
    })
    .await;
}

/// Issue 39: `verify` on a database without idem's tables names the CLI's own
/// `idem migrate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_without_the_tables_suggests_idem_migrate() {
    with_test_db(async |db| {
        let (code, line) = failure(&idem(&db.url(), &[], &["verify"]));
        assert_eq!(code, 4, "{line}");
        assert!(line.contains("`idem migrate`"), "{line}");
    })
    .await;
}

/// Issue 39: nothing listening, something that is not PostgreSQL on the port, and a URL
/// of another database each say so in one line (they said "pool timed out", "expected
/// to read 1414811696 bytes", or took `mysql://` as PostgreSQL).
#[test]
fn a_connection_that_fails_says_why() {
    // A port that was free a moment ago: nothing listens on it.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let (code, line) = failure(&idem(
        &format!("postgres://postgres@127.0.0.1:{port}/x"),
        &[],
        &["key", "list"],
    ));
    assert_eq!(code, 5, "{line}");
    assert!(line.contains("connection refused"), "{line}");

    // An HTTP server: it answers whatever it is sent with a 400, and hangs up.
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = http.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for stream in http.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut request = [0; 512];
            if stream.read(&mut request).is_err() {
                continue;
            }
            stream
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .ok();
            stream.shutdown(std::net::Shutdown::Write).ok();
            // Read what is still sent, so that the close is not a reset.
            std::io::copy(&mut stream, &mut std::io::sink()).ok();
        }
    });
    let (code, line) = failure(&idem(
        &format!("postgres://postgres@127.0.0.1:{port}/x"),
        &[],
        &["key", "list"],
    ));
    assert_eq!(code, 5, "{line}");
    assert!(line.contains("is not PostgreSQL"), "{line}");

    let (code, line) = failure(&idem(
        "mysql://root@127.0.0.1:3306/x",
        &[],
        &["key", "list"],
    ));
    assert_eq!(code, 2, "{line}");
    assert!(
        line.contains("\"mysql\"") && line.contains("postgres://"),
        "{line}"
    );
}

/// Issue 39: a permission denied names the table (as PostgreSQL does) and the privilege
/// the command needs (which PostgreSQL does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_privilege_is_named_with_its_table() {
    with_test_db(async |db| {
        let (url, pool, _) = seeded(db, 1).await;
        let role = format!("idem_cli_grant_{}", std::process::id());
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN; \
             GRANT SELECT ON idem_outbox TO {role}"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let as_role = url.replacen("postgres@", &format!("{role}@"), 1);
        let (code, line) = failure(&idem(
            &as_role,
            &[],
            &["outbox", "discard", "--all", "--yes"],
        ));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "REVOKE ALL ON idem_outbox FROM {role}; DROP ROLE {role}"
        )))
        .execute(&pool)
        .await
        .ok();
        assert_eq!(code, 6, "{line}");
        assert!(
            line.contains("permission denied for table idem_outbox")
                && line.contains("needs SELECT and DELETE on table idem_outbox"),
            "{line}"
        );
    })
    .await;
}

/// Issue 39: an action's row names the OS user who ran `idem` when `--operator` does not
/// say, `unknown` when the environment names nobody either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_is_the_os_user_unless_named() {
    with_test_db(async |db| {
        let url = db.url();
        assert_eq!(json(&url, &[], &["migrate"])["ok"], true);
        let sweep_as = |user: Option<&str>| {
            let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
            command
                .env("DATABASE_URL", &url)
                .env_remove("USER")
                .env_remove("LOGNAME")
                .args(["key", "sweep", "--json"])
                .stdin(Stdio::null());
            if let Some(user) = user {
                command.env("USER", user);
            }
            let out = command.output().expect("run idem");
            assert!(out.status.success(), "{}", said(&out));
        };
        sweep_as(Some("carol"));
        sweep_as(None);
        let trail = json(&url, &[], &["audit"]);
        assert_eq!(trail[0]["operator"], "unknown", "{trail}");
        assert_eq!(trail[1]["operator"], "carol", "{trail}");
    })
    .await;
}

/// Issue 39: an action and its audit row commit together. A role that may purge keys but
/// not write the audit trail purges nothing, and is told which privilege it lacks where.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_whose_audit_row_cannot_be_written_does_nothing() {
    with_test_db(async |db| {
        let (url, pool, store) = seeded(db, 1).await;
        let role = format!("idem_cli_audit_{}", std::process::id());
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN; \
             GRANT SELECT, DELETE ON idempotency_keys TO {role}"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let as_role = url.replacen("postgres@", &format!("{role}@"), 1);
        let (code, line) = failure(&idem(
            &as_role,
            &[],
            &["key", "purge", "jobs", "job-1", "--yes"],
        ));
        // A sweep commits batch by batch; it tries its audit row before the first.
        sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 hour' WHERE key = 'job-2'")
            .execute(&pool)
            .await
            .unwrap();
        let (sweep_code, sweep_line) = failure(&idem(&as_role, &[], &["key", "sweep"]));
        let expired: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = 'job-2'")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(sweep_code, 6, "{sweep_line}");
        assert!(sweep_line.contains("idem_audit"), "{sweep_line}");
        assert_eq!(expired, 1, "the sweep deleted before it could record itself");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "REVOKE ALL ON idempotency_keys FROM {role}; DROP ROLE {role}"
        )))
        .execute(&pool)
        .await
        .ok();
        assert_eq!(code, 6, "{line}");
        assert!(
            line.contains("permission denied for table idem_audit")
                && line.contains("needs INSERT on table idem_audit"),
            "{line}"
        );
        assert!(
            store.inspect("jobs", "", "job-1").await.unwrap().is_some(),
            "the purge rolled back with its audit row"
        );
        assert!(store.operate().audit_log(10, None).await.unwrap().is_empty());
    })
    .await;
}

/// A reader that goes away (`idem key counts | head -0`) ends the command quietly: it
/// panicked with "failed printing to stdout: Broken pipe" and a backtrace.
#[tokio::test(flavor = "multi_thread")]
async fn a_closed_pipe_ends_the_command_quietly() {
    with_test_db(async |db| {
        let (url, _, _) = seeded(db, 1).await;
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .env("DATABASE_URL", &url)
            .args(["key", "counts"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run idem");
        // Closed before idem has connected, let alone printed.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("idem ends");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}: {stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{stderr}");
    })
    .await;
}

/// Issue 39: a re-drive and a discard with `--yes` still count first, and act on what they
/// counted: the audit row names the filter and the bound of the preview (the highest
/// `seq`, the instant, the count), and only those events moved. A dry run prints that
/// preview: the count and the first 20 events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_action_acts_on_what_its_preview_counted() {
    with_test_db(async |db| {
        let (url, pool, store) = seeded(db, 2).await;
        let reason = "no stream captures the subject";
        // 25 more for the same reason: 27 in all.
        store
            .run_once("jobs", "job-many")
            .run(async |mut tx| {
                for n in 0..25 {
                    tx.emit(Event::new("nowhere.z", &serde_json::json!({ "n": n })))
                        .await?;
                }
                Ok::<_, sqlx::Error>("emitted".to_owned())
            })
            .await
            .unwrap();
        store
            .relay(Refusing)
            .max_attempts(3)
            .run_until_idle()
            .await
            .unwrap();

        let dry = json(
            &url,
            &[],
            &["outbox", "redrive", "--reason", reason, "--dry-run"],
        );
        assert_eq!(dry["events"], 27, "{dry}");
        assert_eq!(dry["list"].as_array().unwrap().len(), 20, "{dry}");
        let text = idem(
            &url,
            &[],
            &["outbox", "redrive", "--reason", reason, "--dry-run"],
        );
        let text = String::from_utf8_lossy(&text.stdout);
        assert!(
            text.starts_with("would re-drive 27 dead event(s); nothing moved (--dry-run)\nEVENT")
                && text.contains("and 7 more (the first 20 are listed"),
            "{text}"
        );

        let counted: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM idem_outbox WHERE dead_at IS NOT NULL AND last_error = $1",
        )
        .bind(reason)
        .fetch_all(&pool)
        .await
        .unwrap();
        let counted: Vec<&str> = counted.iter().map(String::as_str).collect();
        let through = highest_seq(&pool, &counted).await;
        let moved = json(
            &url,
            &[],
            &["outbox", "redrive", "--reason", reason, "--yes"],
        );
        assert_eq!(
            moved,
            serde_json::json!({ "redriven": 27, "previewed": 27, "left": 0 })
        );
        let still_dead = json(&url, &[], &["outbox", "dead", "--list"]);
        assert_eq!(ids(&still_dead).len(), 1, "{still_dead}");
        assert_eq!(still_dead[0]["topic"], "gone.a", "{still_dead}");
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idem_outbox WHERE dead_at IS NULL AND id = ANY($1)",
        )
        .bind(&counted)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(pending, 27, "the counted events are pending again");

        let gone = ids(&still_dead)[0].to_owned();
        let discard_through = highest_seq(&pool, &[&gone]).await;
        let out = idem(&url, &[], &["outbox", "discard", "--all", "--yes"]);
        assert!(out.status.success(), "{}", said(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "discarded 1 dead event(s)\n"
        );

        let trail = json(&url, &[], &["audit"]);
        let rows: Vec<(&str, String, u64)> = trail
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["action"].as_str().unwrap(),
                    unstamped(e["filter"].as_str().unwrap()),
                    e["rows"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                (
                    "discard",
                    format!("all; as previewed: seq <= {discard_through}, parked by T, 1 previewed"),
                    1
                ),
                (
                    "redrive",
                    format!(
                        "reason {reason:?}; as previewed: seq <= {through}, parked by T, 27 previewed"
                    ),
                    27
                ),
            ],
            "{trail}"
        );
    })
    .await;
}

/// `idem` on a terminal of its own (`script`, of util-linux, makes one), so that it shows
/// what it would touch and asks before it acts: the test reads that, changes the outbox
/// meanwhile, then answers.
struct Asking {
    child: std::process::Child,
    printed: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    reader: std::thread::JoinHandle<()>,
}

impl Asking {
    /// `idem args` on a terminal, once it has asked (its question ends with `[y/N] `);
    /// `None`, having said so, where there is no `script` to run it under.
    async fn start(url: &str, args: &[&str]) -> Option<Self> {
        use std::io::Read;
        let line: Vec<String> = std::iter::once(env!("CARGO_BIN_EXE_idem"))
            .chain(args.iter().copied())
            .map(|arg| format!("'{}'", arg.replace('\'', r"'\''")))
            .collect();
        let spawned = Command::new("script")
            .args(["-q", "-e", "-f", "-c", &line.join(" "), "/dev/null"])
            .env("DATABASE_URL", url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!("skipped: no `script` (util-linux) to give idem a terminal");
                return None;
            }
            Err(e) => panic!("run script: {e}"),
        };
        let mut stdout = child.stdout.take().unwrap();
        let printed: std::sync::Arc<std::sync::Mutex<Vec<u8>>> = std::sync::Arc::default();
        let sink = std::sync::Arc::clone(&printed);
        let reader = std::thread::spawn(move || {
            let mut buffer = [0; 4096];
            while let Ok(n @ 1..) = stdout.read(&mut buffer) {
                sink.lock().unwrap().extend_from_slice(&buffer[..n]);
            }
        });
        let mut asking = Self {
            child,
            printed,
            reader,
        };
        for _ in 0..600 {
            if asking.printed().contains("[y/N] ") {
                return Some(asking);
            }
            if let Some(status) = asking.child.try_wait().unwrap() {
                panic!("idem ended ({status}) without asking: {}", asking.printed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("idem did not ask within 30 s: {}", asking.printed());
    }

    /// What it printed so far, stdout and stderr together as a terminal shows them.
    fn printed(&self) -> String {
        terminal_text(&self.printed.lock().unwrap())
    }

    /// Answers `answer`, and waits for it to end: its exit code and all it printed.
    fn answer(mut self, answer: &str) -> (i32, String) {
        use std::io::Write;
        let mut stdin = self.child.stdin.take().unwrap();
        stdin.write_all(format!("{answer}\n").as_bytes()).unwrap();
        let status = self.child.wait().unwrap();
        drop(stdin);
        let printed = self.printed;
        self.reader.join().unwrap();
        let printed = terminal_text(&printed.lock().unwrap());
        (status.code().unwrap_or(-1), printed)
    }
}

/// What a terminal received, its line ends as `\n`.
fn terminal_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).replace("\r\n", "\n")
}

/// Issue 39: a bulk action asked on a terminal shows the count and the first events, asks
/// naming the count, and then acts on the events it counted only. An event parked while
/// it asks matches the filter, and is left as it is; one parked by a transaction that was
/// running during the preview and committed while it asks would make it act on more than
/// it counted, so it acts on nothing and exits 7. Both races are made on purpose: the
/// test changes the outbox while `idem` waits for its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_acts_on_what_it_showed_not_what_matches_later() {
    with_test_db(async |db| {
        let (url, pool, _) = seeded(db, 3).await;
        // The two pending `slow.x` events, in the outbox's order.
        let pending: Vec<String> =
            sqlx::query_scalar("SELECT id FROM idem_outbox WHERE dead_at IS NULL ORDER BY seq")
                .fetch_all(&pool)
                .await
                .unwrap();
        let [first, second] = &pending[..] else {
            panic!("two pending events: {pending:?}");
        };
        let park = "UPDATE idem_outbox SET dead_at = now(), last_error = $2 WHERE id = $1";

        // Parked while idem asks: after the instant of its preview, so outside its bound
        // (though below its highest `seq`, `gone.a`'s).
        let Some(asking) = Asking::start(&url, &["outbox", "discard", "--all"]).await else {
            return;
        };
        let shown = asking.printed();
        let gone: String = sqlx::query_scalar("SELECT id FROM idem_outbox WHERE topic = 'gone.a'")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(
            shown.contains("3 dead event(s) selected (all) as of ")
                && shown.contains(&gone)
                && shown.contains("Discard 3 dead event(s)? They will never be published. [y/N] "),
            "{shown}"
        );
        sqlx::query(park)
            .bind(second)
            .bind("parked while asking")
            .execute(&pool)
            .await
            .unwrap();
        let (code, printed) = asking.answer("y");
        assert_eq!(code, 0, "{printed}");
        assert!(
            printed.contains(
                "discarded 3 dead event(s); 1 dead event(s) parked since the preview match \
                 (all) too: left as they are, run the command again for them"
            ),
            "{printed}"
        );
        let dead = json(&url, &[], &["outbox", "dead", "--list"]);
        assert_eq!(ids(&dead), [second.as_str()], "{dead}");
        let trail = json(&url, &[], &["audit"]);
        assert_eq!(trail[0]["rows"], 3, "{trail}");
        assert!(
            trail[0]["filter"]
                .as_str()
                .unwrap()
                .ends_with(", 3 previewed"),
            "{trail}"
        );

        // Parked by a transaction that began before the preview (its `dead_at` is its
        // start) and committed while idem asks: within the bound (below the highest `seq`,
        // the second's, and parked before the instant), which now holds two events where
        // the preview counted one. Nothing moves.
        let mut running = pool.begin().await.unwrap();
        sqlx::query(park)
            .bind(first)
            .bind("parked during the preview")
            .execute(&mut *running)
            .await
            .unwrap();
        let Some(asking) = Asking::start(&url, &["outbox", "redrive", "--all"]).await else {
            return;
        };
        let shown = asking.printed();
        assert!(
            shown.contains("Re-drive 1 dead event(s)? They will be published again."),
            "{shown}"
        );
        running.commit().await.unwrap();
        let (code, printed) = asking.answer("y");
        assert_eq!(code, 7, "{printed}");
        let last = printed.lines().last().unwrap_or_default();
        assert!(
            last.starts_with(
                "idem: 2 dead event(s) were within the preview's bound when it \
                              acted, not the 1 it counted"
            ) && last.contains("nothing re-driven; run the command again"),
            "{printed}"
        );
        let dead = json(&url, &[], &["outbox", "dead", "--list"]);
        assert_eq!(ids(&dead).len(), 2, "nothing moved: {dead}");
        assert_eq!(
            json(&url, &[], &["audit"]).as_array().unwrap().len(),
            1,
            "nothing recorded"
        );
        // Run again, it counts both, and re-drives both.
        let moved = json(&url, &[], &["outbox", "redrive", "--all", "--yes"]);
        assert_eq!(
            moved,
            serde_json::json!({ "redriven": 2, "previewed": 2, "left": 0 })
        );

        // Answered no: nothing done, as before.
        sqlx::query(park)
            .bind(first)
            .bind("parked again")
            .execute(&pool)
            .await
            .unwrap();
        let Some(asking) = Asking::start(&url, &["outbox", "discard", "--all"]).await else {
            return;
        };
        let (code, printed) = asking.answer("n");
        assert_eq!(code, 2, "{printed}");
        assert!(
            printed.contains("idem: not confirmed: nothing done"),
            "{printed}"
        );
        assert_eq!(
            ids(&json(&url, &[], &["outbox", "dead", "--list"])).len(),
            1
        );
    })
    .await;
}
