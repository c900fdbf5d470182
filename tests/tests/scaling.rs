//! The measurements behind SCALING.md (issue 23), run by hand:
//!
//! ```sh
//! cargo test --release -p idem-tests --test scaling -- --ignored --nocapture --test-threads 1
//! ```
//!
//! What one PostgreSQL node does per idempotent request of the charges example in each
//! mode (statements, rows and their WAL by `pg_stat_statements`, all WAL by the insert
//! position), on a private node;
//! and what a Citus cluster of a coordinator and one, then two workers does and
//! sustains, on the same machine. They print figures and check only what the model rests
//! on (no two-phase commit, the statement counts it uses); they are `#[ignore]`d because
//! they take minutes and their figures belong to the machine.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use charges::Config;
use futures::future::join_all;
use idem::Pooler;
use idem_tests::{Citus, Node, TestApp};
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

/// What the statements of one node did over a window: (calls, rows, WAL bytes) per
/// statement text, the transaction-control statements included.
async fn statements(options: &PgConnectOptions) -> Vec<(String, i64, i64, i64)> {
    let mut conn = PgConnection::connect_with(options).await.unwrap();
    let rows = sqlx::query_as(
        "SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, rows, wal_bytes::bigint \
           FROM pg_stat_statements \
          WHERE query ~* '(idempotency_keys|charges|refunds|^ *(BEGIN|COMMIT|ROLLBACK|SET|PREPARE|COMMIT PREPARED))' \
            AND query !~* 'pg_stat' \
          ORDER BY calls DESC",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.ok();
    rows
}

/// Where the node's WAL stands (its insert position, in bytes): exact at once, where
/// `pg_stat_wal` waits for backends to report.
async fn wal(options: &PgConnectOptions) -> i64 {
    let mut conn = PgConnection::connect_with(options).await.unwrap();
    let bytes: i64 =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    conn.close().await.ok();
    bytes
}

async fn reset(options: &PgConnectOptions) {
    let mut conn = PgConnection::connect_with(options).await.unwrap();
    for sql in [
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements",
        "SELECT pg_stat_statements_reset()",
    ] {
        // On a Citus worker the extension comes from the coordinator.
        let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut conn).await;
    }
    conn.close().await.ok();
}

/// Totals over a window, per request: (statements, rows, WAL bytes by the statements).
fn per_request(rows: &[(String, i64, i64, i64)], requests: u64) -> (f64, f64, f64) {
    let n = requests as f64;
    let sum = |f: fn(&(String, i64, i64, i64)) -> i64| rows.iter().map(f).sum::<i64>() as f64 / n;
    (sum(|r| r.1), sum(|r| r.2), sum(|r| r.3))
}

fn print_statements(rows: &[(String, i64, i64, i64)], requests: u64) {
    for (query, calls, rows_, wal) in rows {
        let text: String = query.chars().take(110).collect();
        eprintln!(
            "    {:>5.2} calls {:>6.2} rows {:>7.1} B WAL  {text}",
            *calls as f64 / requests as f64,
            *rows_ as f64 / requests as f64,
            *wal as f64 / requests as f64
        );
    }
}

async fn charge(s: &TestApp, account: &str, key: &str) -> u16 {
    s.post_with(
        "/charges",
        Some(key),
        &json!({ "amount": 100, "currency": "usd", "customer": key }),
        &[("authorization", &format!("Bearer {account}"))],
    )
    .await
    .status
}

/// How many idle sweeps a measurement averages.
const SWEEPS: u64 = 20;

fn config_of(pooler: Pooler, portable: bool) -> Config {
    Config {
        pooler,
        portable,
        ..Config::default()
    }
}

/// Sequential fresh requests, then their replays, then idle sweeps, on one node, in each
/// mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement for SCALING.md; run by hand"]
async fn per_request_costs_on_one_node() {
    let node = Node::plain().expect("PostgreSQL binaries");
    const N: u64 = 300;
    for (name, pooler, portable) in [
        ("default", Pooler::Session, false),
        ("pooler", Pooler::Transaction, false),
        ("portable", Pooler::Session, true),
    ] {
        node.run(&format!("CREATE DATABASE m_{name}")).await;
        let options = node.options().database(&format!("m_{name}"));
        let pool: PgPool = charges::connect_with(options.clone(), pooler, 4)
            .await
            .unwrap();
        charges::migrate(&pool).await.unwrap();
        let s = TestApp::serve(
            pool.clone(),
            charges::app(pool, config_of(pooler, portable)),
        )
        .await;
        for i in 0..20 {
            assert_eq!(charge(&s, "acct_w", &format!("warm-{i}")).await, 201);
        }
        for (path, replay) in [("fresh", false), ("replay", true)] {
            reset(&options).await;
            let wal_before = wal(&options).await;
            let started = Instant::now();
            for i in 0..N {
                let status = charge(&s, &format!("acct_{}", i % 16), &format!("k-{i}")).await;
                assert_eq!(status, 201);
            }
            let elapsed = started.elapsed();
            let wal_after = wal(&options).await;
            let rows = statements(&options).await;
            let (calls, rows_n, stmt_wal) = per_request(&rows, N);
            eprintln!(
                "{name} {path}: {calls:.2} statements/request, {rows_n:.2} rows, \
                 {stmt_wal:.0} B WAL by statements, {:.0} B WAL in all, {:.2} ms/request \
                 (sequential, over HTTP)",
                (wal_after - wal_before) as f64 / N as f64,
                elapsed.as_secs_f64() * 1000.0 / N as f64
            );
            print_statements(&rows, N);
            if replay {
                // Nothing but the odd page prune of a read.
                assert!(stmt_wal < 50.0, "a replay writes nothing: {stmt_wal} B");
            }
        }
        // The locks a fresh request holds while its handler runs (the "processor" waits
        // 500 ms inside the transaction), sampled from pg_locks.
        let slow = TestApp::serve(
            s.pool.clone(),
            charges::app(
                s.pool.clone(),
                Config {
                    processor_delay: Duration::from_millis(500),
                    ..config_of(pooler, portable)
                },
            ),
        )
        .await;
        let (status, locks) = tokio::join!(charge(&slow, "acct_l", "locks"), async {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let locks: Vec<(String, String, String)> = sqlx::query_as(
                "SELECT l.locktype, l.mode, coalesce(c.relname::text, '') \
                   FROM pg_locks l LEFT JOIN pg_class c ON c.oid = l.relation \
                  WHERE l.pid IN (SELECT pid FROM pg_stat_activity \
                                   WHERE datname = current_database() \
                                     AND state = 'idle in transaction') \
                  ORDER BY 3, 1, 2",
            )
            .fetch_all(&s.pool)
            .await
            .unwrap();
            locks
        });
        assert_eq!(status, 201);
        eprintln!("{name} fresh, locks held while the handler runs: {locks:?}");
        // The sweeper when nothing has expired.
        let store = charges::store(s.pool.clone(), &config_of(pooler, portable));
        // The first reads after the load prune the pages it left (a little WAL, once).
        for _ in 0..SWEEPS {
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(1_000)
                .await
                .unwrap();
        }
        reset(&options).await;
        let wal_before = wal(&options).await;
        for _ in 0..SWEEPS {
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
        let rows = statements(&options).await;
        let (calls, _, stmt_wal) = per_request(&rows, SWEEPS);
        eprintln!(
            "{name} idle sweep: {calls:.2} statements/sweep, {stmt_wal:.0} B WAL by \
             statements, {:.0} B WAL in all",
            (wal(&options).await - wal_before) as f64 / SWEEPS as f64
        );
        print_statements(&rows, SWEEPS);
        assert_eq!(stmt_wal, 0.0, "an idle sweep writes nothing");
    }
}

/// Fresh charges from `concurrency` clients over many accounts, for `seconds`: how many
/// the cluster answered, and what each node did per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement for SCALING.md; run by hand"]
async fn throughput_on_citus_by_workers() {
    const CONCURRENCY: usize = 16;
    const SECONDS: u64 = 8;
    for workers in [1, 2] {
        let cluster = Citus::start("scaling", workers)
            .await
            .expect("Citus is installed");
        let pool = charges::connect_with(cluster.options(), Pooler::Session, 32)
            .await
            .unwrap();
        let config = Config {
            portable: true,
            ..Config::default()
        };
        charges::migrate(&pool).await.unwrap();
        charges::distribute(&charges::store(pool.clone(), &config))
            .await
            .unwrap();
        let s = TestApp::serve(pool.clone(), charges::app(pool.clone(), config)).await;
        for i in 0..50 {
            assert_eq!(charge(&s, &format!("acct_{i}"), "warm").await, 201);
        }
        let nodes: Vec<(&str, PgConnectOptions)> =
            std::iter::once(("coordinator", cluster.options()))
                .chain(cluster.workers.iter().map(|w| ("worker", w.options())))
                .collect();
        let two_pc = || async { idem_tests::count(&pool, "pg_dist_transaction").await };
        for (path, replay) in [("fresh", false), ("replay", true)] {
            for (_, options) in &nodes {
                reset(options).await;
            }
            let mut wal_before = Vec::new();
            for (_, options) in &nodes {
                wal_before.push(wal(options).await);
            }
            let commits_before = two_pc().await;
            let done = AtomicU64::new(0);
            let deadline = Instant::now() + Duration::from_secs(SECONDS);
            let started = Instant::now();
            join_all((0..CONCURRENCY).map(|c| {
                let (s, done) = (&s, &done);
                async move {
                    let mut i = 0;
                    while Instant::now() < deadline {
                        // Replays repeat the first 200 keys of each client.
                        let n = if replay { i % 200 } else { i };
                        let key = format!("c{c}-{n}");
                        let status = charge(s, &format!("acct_{}", (c * 7 + n) % 64), &key).await;
                        assert!(status == 201, "{status}");
                        done.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                }
            }))
            .await;
            let elapsed = started.elapsed().as_secs_f64();
            let n = done.load(Ordering::Relaxed);
            eprintln!(
                "citus, {workers} worker(s), {path}: {n} requests in {elapsed:.1} s = {:.0}/s \
                 ({CONCURRENCY} clients); two-phase commits: {}",
                n as f64 / elapsed,
                two_pc().await - commits_before
            );
            assert_eq!(
                two_pc().await,
                commits_before,
                "no request commits across workers"
            );
            for ((role, options), before) in nodes.iter().zip(&wal_before) {
                let rows = statements(options).await;
                let (calls, rows_n, stmt_wal) = per_request(&rows, n);
                eprintln!(
                    "  {role} :{}: {calls:.2} statements/request, {rows_n:.2} rows, \
                     {stmt_wal:.0} B WAL by statements, {:.0} B WAL in all",
                    options.get_port(),
                    (wal(options).await - before) as f64 / n as f64
                );
                print_statements(&rows[..rows.len().min(12)], n);
            }
        }
        // The sweeper when nothing has expired.
        let store = charges::store(
            pool.clone(),
            &Config {
                portable: true,
                ..Config::default()
            },
        );
        // The first reads after the load prune the pages it left (a little WAL, once).
        for _ in 0..SWEEPS {
            store
                .operate()
                .audited(idem_tests::operator())
                .purge_expired(1_000)
                .await
                .unwrap();
        }
        for (_, options) in &nodes {
            reset(options).await;
        }
        let mut wal_before = Vec::new();
        for (_, options) in &nodes {
            wal_before.push(wal(options).await);
        }
        let commits_before = two_pc().await;
        let started = Instant::now();
        for _ in 0..SWEEPS {
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
        eprintln!(
            "citus, {workers} worker(s), idle sweep: {:.2} ms/sweep; two-phase commits: {}",
            started.elapsed().as_secs_f64() * 1000.0 / SWEEPS as f64,
            two_pc().await - commits_before
        );
        for ((role, options), before) in nodes.iter().zip(&wal_before) {
            let rows = statements(options).await;
            let (calls, _, stmt_wal) = per_request(&rows, SWEEPS);
            eprintln!(
                "  {role} :{}: {calls:.2} statements/sweep, {stmt_wal:.0} B WAL by statements, \
                 {:.0} B WAL in all",
                options.get_port(),
                (wal(options).await - before) as f64 / SWEEPS as f64
            );
            assert_eq!(stmt_wal, 0.0, "an idle sweep writes nothing");
        }
    }
}
