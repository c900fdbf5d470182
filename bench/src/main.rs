//! idem's load benchmark: the idempotent handler side by side with the bare
//! transactional handler doing the same write, over real HTTP on loopback, against one
//! local PostgreSQL, in one run. See BENCHMARKS.md.
//!
//! ```text
//! cargo run --release -p idem-bench -- [--seconds 5] [--quick] [--no-growth] [--modes]
//! ```
//!
//! `--modes` runs only the comparison of the store's production modes.
//!
//! `DATABASE_URL` names the server (default `postgres://postgres@127.0.0.1:5432/postgres`);
//! the benchmark creates its own database there and drops it at the end.

mod record;
mod server;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use idem_tests::{percentiles, post, tally, TestDb};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{ConnectOptions, PgPool};

struct Options {
    seconds: f64,
    quick: bool,
    growth: bool,
    modes_only: bool,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut options = Self {
            seconds: 5.0,
            quick: false,
            growth: true,
            modes_only: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--seconds" => {
                    let v = args.next().ok_or("--seconds needs a value")?;
                    options.seconds = v
                        .parse()
                        .map_err(|_| format!("--seconds: not a number: {v}"))?;
                }
                "--quick" => options.quick = true,
                "--no-growth" => options.growth = false,
                "--modes" => options.modes_only = true,
                other => {
                    return Err(format!(
                        "unknown argument {other}; use --seconds N, --quick, --no-growth, --modes"
                    ))
                }
            }
        }
        Ok(options)
    }
}

/// The numbers of one scenario at one concurrency.
struct Stats {
    requests: usize,
    elapsed: Duration,
    p50_ms: f64,
    p99_ms: f64,
    statuses: BTreeMap<u16, usize>,
    /// CPU time per request, in microseconds: PostgreSQL's backends, and this process
    /// (server and load generator).
    cpu_us: (f64, f64),
}

/// CPU time so far, in clock ticks: (all `postgres` processes, this process).
fn cpu_ticks() -> (u64, u64) {
    fn ticks(stat: &str) -> Option<(String, u64)> {
        let (head, rest) = stat.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_owned();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        Some((
            comm,
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?,
        ))
    }
    let mut postgres = 0;
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            if let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) {
                if let Some((comm, t)) = ticks(&stat) {
                    if comm == "postgres" {
                        postgres += t;
                    }
                }
            }
        }
    }
    let own = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| ticks(&s))
        .map_or(0, |(_, t)| t);
    (postgres, own)
}

impl Stats {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// Drives `concurrency` clients that each send `request(n)` back to back for `seconds`.
async fn drive<F, Fut>(concurrency: usize, seconds: f64, request: F) -> Stats
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = u16> + Send,
{
    let counter = Arc::new(AtomicU64::new(0));
    // A short warm-up, not measured: connections, caches, statement preparation.
    let warm_until = Instant::now() + Duration::from_millis(500);
    let deadline = warm_until + Duration::from_secs_f64(seconds);
    let workers = (0..concurrency).map(|_| {
        let request = request.clone();
        let counter = Arc::clone(&counter);
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut statuses = Vec::new();
            loop {
                let started = Instant::now();
                if started >= deadline {
                    break;
                }
                let status = request(counter.fetch_add(1, Ordering::Relaxed)).await;
                if started >= warm_until {
                    latencies.push(started.elapsed());
                    statuses.push(status);
                }
            }
            (latencies, statuses)
        })
    });
    tokio::time::sleep_until(warm_until.into()).await;
    let cpu_before = cpu_ticks();
    let mut latencies = Vec::new();
    let mut statuses = Vec::new();
    for worker in join_all(workers).await {
        let (l, s) = worker.expect("worker");
        latencies.extend(l);
        statuses.extend(s);
    }
    let cpu_after = cpu_ticks();
    // Linux counts CPU time in ticks of 10 ms.
    let per_request = |before: u64, after: u64| {
        (after - before) as f64 * 10_000.0 / latencies.len().max(1) as f64
    };
    let cpu_us = (
        per_request(cpu_before.0, cpu_after.0),
        per_request(cpu_before.1, cpu_after.1),
    );
    let requests = latencies.len();
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Stats {
        requests,
        elapsed: Duration::from_secs_f64(seconds),
        p50_ms,
        p99_ms,
        statuses: tally(statuses),
        cpu_us,
    }
}

fn charge(n: u64) -> serde_json::Value {
    json!({ "amount": 100 + n % 900, "currency": "usd", "customer": format!("cus_{}", n % 97) })
}

/// `POST url`, its answer read whole; the status only.
async fn send(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &serde_json::Value,
) -> u16 {
    post(client, url, key, body, &[]).await.status
}

/// Statuses as `n×status`.
fn answers(statuses: &BTreeMap<u16, usize>) -> String {
    let answers: Vec<String> = statuses.iter().map(|(s, n)| format!("{n}×{s}")).collect();
    answers.join(" ")
}

fn main() -> ExitCode {
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line with its causes, not the `Debug` dump of `fn main() -> Result`.
            eprintln!("idem-bench: {}", charges::one_line(&*error));
            ExitCode::FAILURE
        }
    }
}

fn bench() -> Result<(), Box<dyn std::error::Error>> {
    let options = Options::parse()?;
    record::install();
    // The server and the load generator each get their own runtime, as they would be
    // separate processes; both share this machine's cores with PostgreSQL.
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let db = client_rt.block_on(TestDb::create());
    let result = run(&options, &db, &server_rt, &client_rt);
    let name = db.name.clone();
    if let Err(e) = client_rt.block_on(db.drop_database()) {
        eprintln!("could not drop the benchmark's database {name}: {e}");
    }
    result
}

fn run(
    options: &Options,
    db: &TestDb,
    server_rt: &tokio::runtime::Runtime,
    client_rt: &tokio::runtime::Runtime,
) -> Result<(), Box<dyn std::error::Error>> {
    let (addr, counting_addr, pool) = server_rt.block_on(async {
        let pool = PgPoolOptions::new()
            .max_connections(40)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(db.options.clone())
            .await?;
        server::migrate(&pool).await?;
        // A second server on a pool that logs its statements, for counting them; the
        // measured server logs nothing.
        let counting_pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(
                db.options
                    .clone()
                    .log_statements(tracing::log::LevelFilter::Debug)
                    // `disable_statement_logging` made every statement "slow" (threshold 0)
                    // and slow statements silent: undo both.
                    .log_slow_statements(
                        tracing::log::LevelFilter::Debug,
                        Duration::from_secs(3600),
                    ),
            )
            .await?;
        let addr = server::serve(pool.clone()).await?;
        let counting_addr = server::serve(counting_pool).await?;
        Ok::<_, Box<dyn std::error::Error>>((addr, counting_addr, pool))
    })?;
    let base = format!("http://{addr}");
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;

    println!("# idem load benchmark\n");
    machine_line(client_rt, &pool);
    let modes = server_rt.block_on(serve_modes(db))?;
    if options.modes_only {
        client_rt.block_on(compare_modes(&client, &modes, options));
        return Ok(());
    }

    client_rt.block_on(statement_counts(
        &client,
        &format!("http://{counting_addr}"),
    ));
    client_rt.block_on(throughput(&client, &base, &pool, options));
    client_rt.block_on(storm(&client, &base, &pool));
    client_rt.block_on(compare_modes(&client, &modes, options));
    if options.growth {
        client_rt.block_on(growth(&client, &base, &pool, options));
    }
    Ok(())
}

/// The store's production modes, each a server of its own with the same handlers.
const MODES: [&str; 3] = [
    "default",
    "transaction pooler (`pooler(Pooler::Transaction)`, statement cache 0)",
    "portable (`portable()`)",
];

/// Serves the benchmark once per mode: the default store, the transaction-pooler
/// setting (idem's statements unnamed, and the pool's own statement cache off, as behind
/// PgBouncer), and the portable mode (Citus).
async fn serve_modes(db: &TestDb) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let mut bases = Vec::new();
    for (i, _) in MODES.iter().enumerate() {
        let mut options = db.options.clone();
        if i == 1 {
            options = options.statement_cache_capacity(0);
        }
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        let addr = server::serve_with(pool, |store| match i {
            1 => store.pooler(idem::Pooler::Transaction),
            2 => store.portable(),
            _ => store,
        })
        .await?;
        bases.push(format!("http://{addr}"));
    }
    Ok(bases)
}

/// What each mode costs: the bare handler and idem's fresh and replayed keys on each
/// mode's own server, side by side, the modes interleaved per concurrency.
async fn compare_modes(client: &reqwest::Client, bases: &[String], options: &Options) {
    println!(
        "## Production modes ({} s per cell after 0.5 s warm-up)\n",
        options.seconds
    );
    println!("| mode | concurrency | bare req/s | fresh req/s | fresh / bare | replay req/s | replay / fresh |");
    println!("|---|---|---|---|---|---|---|");
    for (mode, base) in bases.iter().enumerate() {
        for n in 0..500_u64 {
            send(
                client,
                &format!("{base}/idem"),
                Some(&format!("mode-replay-{mode}-{n}")),
                &charge(n),
            )
            .await;
        }
    }
    for concurrency in [1, 16] {
        for (mode, base) in bases.iter().enumerate() {
            let cell = |path: &str, key: Option<String>, body: fn(u64) -> serde_json::Value| {
                let (client, url) = (client.clone(), format!("{base}{path}"));
                drive(concurrency, options.seconds, move |n| {
                    let (client, url) = (client.clone(), url.clone());
                    let key = key.as_ref().map(|k| {
                        if k.starts_with("mode-replay") {
                            format!("{k}-{}", (n * 7919) % 500)
                        } else {
                            format!("{k}-{n}")
                        }
                    });
                    let body = body(
                        if key.as_deref().is_some_and(|k| k.starts_with("mode-replay")) {
                            (n * 7919) % 500
                        } else {
                            n
                        },
                    );
                    async move { send(&client, &url, key.as_deref(), &body).await }
                })
            };
            let bare = cell("/bare", None, charge).await;
            let fresh = cell(
                "/idem",
                Some(format!("mode-fresh-{mode}-c{concurrency}")),
                charge,
            )
            .await;
            let replay = cell("/idem", Some(format!("mode-replay-{mode}")), charge).await;
            println!(
                "| {} | {concurrency} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} |",
                MODES[mode],
                bare.throughput(),
                fresh.throughput(),
                fresh.throughput() / bare.throughput(),
                replay.throughput(),
                replay.throughput() / fresh.throughput(),
            );
            for stats in [&bare, &fresh, &replay] {
                let failed: usize = stats
                    .statuses
                    .iter()
                    .filter(|(status, _)| !matches!(status, 200 | 201))
                    .map(|(_, n)| n)
                    .sum();
                if failed > 0 {
                    println!("|  | | answers: {} | | | | |", answers(&stats.statuses));
                }
            }
        }
    }
    println!();
}

fn machine_line(rt: &tokio::runtime::Runtime, pool: &PgPool) {
    let version: String = rt
        .block_on(sqlx::query_scalar("SHOW server_version").fetch_one(pool))
        .unwrap_or_default();
    let sync: String = rt
        .block_on(sqlx::query_scalar("SHOW synchronous_commit").fetch_one(pool))
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    println!("PostgreSQL {version} (synchronous_commit = {sync}), {cores} cores, server pool 40 connections\n");
}

/// Statements per request, as sent by the server, without BEGIN/COMMIT/ROLLBACK.
async fn statement_counts(client: &reqwest::Client, base: &str) {
    println!("## Statements per request (BEGIN/COMMIT/ROLLBACK not counted)\n");
    println!("| path | statements | which |");
    println!("|---|---|---|");
    let cases: [(&str, &str, Option<&str>); 4] = [
        ("bare handler", "/bare", None),
        ("idem, fresh key", "/idem", Some("count-1")),
        ("idem, replay", "/idem", Some("count-1")),
        ("idem, key in flight (409)", "/idem", None),
    ];
    for (label, path, key) in cases {
        let statements = if key.is_none() && path == "/idem" {
            // Hold a key with a slow request, then count the duplicate's statements.
            let url = format!("{base}/hold");
            let holder = tokio::spawn({
                let (client, url) = (client.clone(), url.clone());
                async move { send(&client, &url, Some("count-held"), &charge(1)).await }
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (statements, status) =
                record::statements_of(send(client, &url, Some("count-held"), &charge(1))).await;
            holder.abort();
            assert_eq!(status, 409, "the duplicate of a held key is refused");
            statements
        } else {
            record::statements_of(send(client, &format!("{base}{path}"), key, &charge(1)))
                .await
                .0
        };
        let counted: Vec<String> = statements
            .iter()
            .filter(|s| {
                !["BEGIN", "COMMIT", "ROLLBACK"]
                    .iter()
                    .any(|t| s.starts_with(t))
            })
            .cloned()
            .collect();
        println!("| {label} | {} | {} |", counted.len(), counted.join("; "));
    }
    println!();
}

async fn throughput(client: &reqwest::Client, base: &str, pool: &PgPool, options: &Options) {
    println!(
        "## Throughput and latency ({} s per cell after 0.5 s warm-up)\n",
        options.seconds
    );
    println!("| scenario | concurrency | req/s | p50 ms | p99 ms | CPU µs/req: PostgreSQL + app | answers |");
    println!("|---|---|---|---|---|---|---|");
    // Keys for the replay scenario, stored once.
    for n in 0..2_000_u64 {
        send(
            client,
            &format!("{base}/idem"),
            Some(&format!("replay-{n}")),
            &charge(n),
        )
        .await;
    }
    let mut ratios = Vec::new();
    for concurrency in [1, 16, 64] {
        let run_id = format!("c{concurrency}");
        let bare = {
            let (client, url) = (client.clone(), format!("{base}/bare"));
            drive(concurrency, options.seconds, move |n| {
                let (client, url) = (client.clone(), url.clone());
                async move { send(&client, &url, None, &charge(n)).await }
            })
            .await
        };
        let fresh = {
            let (client, url, run_id) = (client.clone(), format!("{base}/idem"), run_id.clone());
            drive(concurrency, options.seconds, move |n| {
                let (client, url, key) =
                    (client.clone(), url.clone(), format!("fresh-{run_id}-{n}"));
                async move { send(&client, &url, Some(&key), &charge(n)).await }
            })
            .await
        };
        let replay = {
            let (client, url) = (client.clone(), format!("{base}/idem"));
            drive(concurrency, options.seconds, move |n| {
                let (client, url) = (client.clone(), url.clone());
                // Spread over the stored keys; the body matches the stored one.
                let k = (n * 7919) % 2_000;
                async move { send(&client, &url, Some(&format!("replay-{k}")), &charge(k)).await }
            })
            .await
        };
        let conflict = {
            // One request holds the key (it sleeps in its transaction); the load is its
            // duplicates.
            let held = format!("held-{run_id}");
            let holder = tokio::spawn({
                let (client, url, held) = (client.clone(), format!("{base}/hold"), held.clone());
                async move { send(&client, &url, Some(&held), &charge(1)).await }
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (client2, url) = (client.clone(), format!("{base}/hold"));
            let stats = drive(concurrency, options.seconds, move |_| {
                let (client, url, held) = (client2.clone(), url.clone(), held.clone());
                async move { send(&client, &url, Some(&held), &charge(1)).await }
            })
            .await;
            holder.abort();
            stats
        };
        let naive = {
            let (client, url, run_id) = (client.clone(), format!("{base}/naive"), run_id.clone());
            drive(concurrency, options.seconds, move |n| {
                let (client, url, key) =
                    (client.clone(), url.clone(), format!("naive-{run_id}-{n}"));
                async move { send(&client, &url, Some(&key), &charge(n)).await }
            })
            .await
        };
        for (label, stats) in [
            ("(a) bare transactional handler", &bare),
            ("(b) idem, fresh keys", &fresh),
            ("(c) idem, replays", &replay),
            ("(d) idem, duplicates in flight", &conflict),
            ("(e) non-atomic check/write/save", &naive),
        ] {
            println!(
                "| {label} | {concurrency} | {:.0} | {:.2} | {:.2} | {:.0} + {:.0} | {} |",
                stats.throughput(),
                stats.p50_ms,
                stats.p99_ms,
                stats.cpu_us.0,
                stats.cpu_us.1,
                answers(&stats.statuses)
            );
        }
        ratios.push((
            concurrency,
            fresh.throughput() / bare.throughput(),
            replay.throughput() / fresh.throughput(),
        ));
    }
    println!("\n| concurrency | b/a (fresh / bare) | c/b (replay / fresh) |");
    println!("|---|---|---|");
    for (concurrency, ba, cb) in ratios {
        println!("| {concurrency} | {ba:.2} | {cb:.2} |");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .unwrap_or(0);
    println!("\n({rows} charges written in this section)\n");
}

/// The same storm against the non-atomic pattern and against idem: duplicates counted.
async fn storm(client: &reqwest::Client, base: &str, pool: &PgPool) {
    const KEYS: u64 = 200;
    const COPIES: u64 = 10;
    println!(
        "## Duplicate storm: {KEYS} keys × {COPIES} concurrent copies, 20 ms processor delay\n"
    );
    println!("| handler | charges written | duplicates | answers |");
    println!("|---|---|---|---|");
    for (label, path) in [
        ("(e) non-atomic check/write/save", "naive"),
        ("(b) idem", "idem"),
    ] {
        let before: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(pool)
            .await
            .unwrap_or(0);
        let url = format!("{base}/{path}");
        let requests = (0..KEYS).flat_map(|k| (0..COPIES).map(move |_| k)).map(|k| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let body = json!({ "amount": 500, "currency": "usd", "customer": "storm", "delay_ms": 20 });
                send(&client, &url, Some(&format!("storm-{path}-{k}")), &body).await
            }
        });
        let statuses = join_all(requests).await;
        let after: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(pool)
            .await
            .unwrap_or(0);
        let written = after - before;
        println!(
            "| {label} | {written} | {} | {} |",
            written - KEYS as i64,
            answers(&tally(statuses))
        );
    }
    println!();
}

/// Claim latency as the table grows, and the sweeper's rate.
async fn growth(client: &reqwest::Client, base: &str, pool: &PgPool, options: &Options) {
    let sizes: &[i64] = if options.quick {
        &[0, 100_000, 1_000_000]
    } else {
        &[0, 1_000_000, 10_000_000]
    };
    println!("## Growth: claim latency by table size (half expired, half live; random keys)\n");
    println!("| rows | fill s | fresh claim p50 ms | fresh claim p99 ms | replay claim p50 ms | table + indexes |");
    println!("|---|---|---|---|---|---|");
    sqlx::query("TRUNCATE idempotency_keys")
        .execute(pool)
        .await
        .expect("truncate");
    let mut filled = 0_i64;
    for &size in sizes {
        let started = Instant::now();
        while filled < size {
            let batch = (size - filled).min(1_000_000);
            sqlx::query(
                "INSERT INTO idempotency_keys \
                   (scope, principal, key, fingerprint, field_hashes, status, headers, body, created_at, expires_at) \
                 SELECT 'charges', 'p' || (g % 1000), md5(g::text), sha256(g::text::bytea), '\\x00', 201, \
                        'content-type: application/json\n', convert_to(repeat('x', 120), 'UTF8'), \
                        now() - interval '1 hour', \
                        CASE WHEN g % 2 = 0 THEN now() - interval '1 minute' ELSE now() + interval '1 day' END \
                   FROM generate_series($1::int8, $2::int8) AS g",
            )
            .bind(filled + 1)
            .bind(filled + batch)
            .execute(pool)
            .await
            .expect("fill");
            filled += batch;
        }
        sqlx::query("VACUUM ANALYZE idempotency_keys")
            .execute(pool)
            .await
            .expect("vacuum");
        let fill_s = started.elapsed().as_secs_f64();
        let size_text: String =
            sqlx::query_scalar("SELECT pg_size_pretty(pg_total_relation_size('idempotency_keys'))")
                .fetch_one(pool)
                .await
                .unwrap_or_default();

        let url = format!("{base}/idem");
        let samples = 1_000;
        record::claims_start();
        for n in 0..samples {
            send(client, &url, Some(&format!("grow-{size}-{n}")), &charge(n)).await;
        }
        let mut fresh = record::claims_take();
        record::claims_start();
        for n in 0..samples {
            send(client, &url, Some(&format!("grow-{size}-{n}")), &charge(n)).await;
        }
        let mut replay = record::claims_take();
        let (f50, f99) = percentiles(&mut fresh);
        let (r50, _) = percentiles(&mut replay);
        println!("| {size} | {fill_s:.1} | {f50:.3} | {f99:.3} | {r50:.3} | {size_text} |");
        sqlx::query("DELETE FROM idempotency_keys WHERE scope = 'charges' AND key LIKE 'grow-%'")
            .execute(pool)
            .await
            .expect("cleanup");
    }

    // The sweeper's rate on the biggest table: every expired row, in batches of 1000.
    let expired: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE expires_at <= now()")
            .fetch_one(pool)
            .await
            .unwrap_or(0);
    let store = idem::Store::new(pool.clone());
    let started = Instant::now();
    let removed = store.purge_expired(1_000).await.expect("purge");
    let secs = started.elapsed().as_secs_f64();
    println!(
        "\nSweeper: {removed} of {expired} expired rows deleted in {secs:.1} s, {:.0} rows/s (batches of 1000).\n",
        removed as f64 / secs
    );
}
