//! Where PostgreSQL spends a request, and what the claim and the sweeper cost as the key
//! table grows (BENCHMARKS.md, "The claim's profile and cost curve"), in one run on a
//! database of its own:
//!
//! 1. the profile: `--requests N` requests of each kind, `--concurrency C` at a time
//!    (the bench's server over HTTP on loopback): the bare handler, the floor (the bare
//!    handler and one complete key row), idem's fresh request (by the attribute, and by
//!    `IdempotencyLayer`), its replay, its replay
//!    from a store with a replay cache (`StoreBuilder::replay_cache`) and its 409.
//!    For each, PostgreSQL's CPU per request (the time of its processes, from `/proc`),
//!    and where the server loads `pg_stat_statements`, each statement's calls, execution
//!    and planning time and shared buffers per request (planning time needs
//!    `pg_stat_statements.track_planning`);
//! 2. the cost curve: the key table filled to each of `--sizes` rows, half of them
//!    expired, then fresh requests and replays at that size (buffers, statements and
//!    PostgreSQL's CPU per request), and the sweeper deleting the expired half (rows per
//!    second, buffers per row); each figure also as the ratio of the largest size to the
//!    smallest.
//!
//! `cargo run --release -p idem-bench --bin claim -- [--requests 20000] [--concurrency 16]
//! [--sizes 1000000,10000000] [--profile-only] [--kinds bare,floor,fresh,layer,replay,cached,409]`
//!
//! `DATABASE_URL` names the server (default `postgres://postgres@127.0.0.1:5432/postgres`).

#[path = "../args.rs"]
mod args;
#[path = "../load.rs"]
#[allow(dead_code)]
mod load;
#[path = "../server.rs"]
#[allow(dead_code)]
mod server;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use idem::Store;
use idem_tests::{percentiles, post, tally, TestDb};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Row};

use args::{arg, list, value_of};

fn main() -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("claim bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(bench()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("claim bench: {e}");
            ExitCode::FAILURE
        }
    }
}

type Error = Box<dyn std::error::Error>;

async fn bench() -> Result<(), Error> {
    let requests = arg("--requests", 20_000);
    let concurrency = arg("--concurrency", 16) as usize;
    let sizes = list("--sizes", &[1_000_000, 10_000_000]);
    let db = TestDb::create().await;
    let result = run(&db, requests, concurrency, &sizes).await;
    let dropped = db.drop_database().await;
    result?;
    dropped?;
    Ok(())
}

async fn run(db: &TestDb, requests: u64, concurrency: usize, sizes: &[i64]) -> Result<(), Error> {
    let pool = PgPoolOptions::new()
        .max_connections(concurrency as u32 + 4)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone())
        .await?;
    server::migrate(&pool).await?;
    let statements = Statements::open(&pool).await;
    let addr = server::serve(pool.clone()).await?;
    let base = format!("http://{addr}");
    let cached = server::serve_with(pool.clone(), |store| {
        store.replay_cache(64 << 20, Duration::from_secs(5))
    })
    .await?;
    let cached = format!("http://{cached}");
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let load = Load {
        client,
        base,
        cached,
        concurrency,
        statements,
    };

    println!("# The claim's profile and cost curve\n");
    println!(
        "{requests} requests of each kind, {concurrency} at a time, over HTTP on loopback; \
         PostgreSQL CPU from /proc (all its processes); {}.\n",
        match &load.statements {
            Some(_) => "statements from pg_stat_statements",
            None => {
                "no statement profile: the server does not load pg_stat_statements \
                 (shared_preload_libraries)"
            }
        }
    );
    profile(&load, &pool, requests).await?;
    if args::flag("--profile-only") {
        return Ok(());
    }
    curve(&load, &pool, requests, sizes).await?;
    pool.close().await;
    Ok(())
}

/// The bench's load: its client, its server and the statement counter, if any.
struct Load {
    client: reqwest::Client,
    base: String,
    /// The same service, its store with a replay cache.
    cached: String,
    concurrency: usize,
    statements: Option<Statements>,
}

/// One kind of request: where it goes and the key of its `n`-th copy.
#[derive(Clone, Copy)]
enum Kind {
    Bare,
    Floor,
    Fresh,
    /// Fresh requests through `IdempotencyLayer` instead of the attribute.
    Layer,
    /// Replays of the keys `replayed-0..n` (the 201s of a fresh batch before).
    Replay(u64),
    /// The same, to a server whose store keeps answers in memory
    /// (`StoreBuilder::replay_cache`), warmed by one replay of each key.
    Cached(u64),
    /// Duplicates of a key held by a request in flight.
    Conflict,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Self::Bare => "/bare",
            Self::Floor => "/floor",
            Self::Fresh | Self::Replay(_) | Self::Cached(_) => "/idem",
            Self::Layer => "/layer",
            Self::Conflict => "/hold",
        }
    }

    fn key(self, run: u64, n: u64) -> Option<String> {
        match self {
            Self::Bare => None,
            Self::Floor | Self::Fresh | Self::Layer => Some(format!("k-{run}-{n}")),
            Self::Replay(keys) | Self::Cached(keys) => Some(format!("replayed-{}", n % keys)),
            Self::Conflict => Some("held".to_owned()),
        }
    }

    /// The body of the `n`-th copy: a replay's is its key's.
    fn body(self, n: u64) -> u64 {
        match self {
            Self::Replay(keys) | Self::Cached(keys) => n % keys,
            Self::Conflict => 0,
            _ => n,
        }
    }

    fn expected(self) -> u16 {
        match self {
            Self::Conflict => 409,
            _ => 201,
        }
    }
}

fn charge(n: u64) -> serde_json::Value {
    json!({ "amount": 100 + n % 900, "currency": "usd", "customer": format!("cus_{}", n % 97) })
}

/// What a batch of requests cost.
struct Batch {
    requests: u64,
    elapsed: Duration,
    p50_ms: f64,
    statuses: BTreeMap<u16, usize>,
    /// PostgreSQL's CPU per request, µs.
    pg_cpu_us: f64,
    /// The statements the batch ran, if counted.
    statements: Option<Vec<Statement>>,
}

impl Batch {
    fn per_request<F: Fn(&Statement) -> f64>(&self, f: F) -> Option<f64> {
        let statements = self.statements.as_ref()?;
        Some(statements.iter().map(f).sum::<f64>() / self.requests as f64)
    }

    fn verdict(&self, expected: u16) -> &'static str {
        if self.statuses.keys().all(|s| *s == expected) {
            ""
        } else {
            " (not a figure: unexpected statuses)"
        }
    }
}

/// A distinguishing number per batch, so that fresh keys never repeat.
static RUN: AtomicU64 = AtomicU64::new(0);

impl Load {
    /// `requests` of `kind`, `concurrency` at a time, counted from a reset of the
    /// statements and a reading of PostgreSQL's CPU.
    async fn batch(&self, kind: Kind, requests: u64) -> Result<Batch, Error> {
        let run = RUN.fetch_add(1, Ordering::Relaxed);
        if let Some(statements) = &self.statements {
            statements.reset().await?;
        }
        let next = Arc::new(AtomicU64::new(0));
        let cpu = load::cpu_ticks().0;
        let started = Instant::now();
        let workers = (0..self.concurrency).map(|_| {
            let next = Arc::clone(&next);
            let client = self.client.clone();
            let base = match kind {
                Kind::Cached(_) => &self.cached,
                _ => &self.base,
            };
            let url = format!("{base}{}", kind.path());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut statuses = Vec::new();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= requests {
                        break;
                    }
                    let at = Instant::now();
                    let key = kind.key(run, n);
                    let body = charge(kind.body(n));
                    let answer = post(&client, &url, key.as_deref(), &body, &[]).await;
                    latencies.push(at.elapsed());
                    statuses.push(answer.status);
                }
                (latencies, statuses)
            })
        });
        let mut latencies = Vec::new();
        let mut statuses = Vec::new();
        for worker in join_all(workers).await {
            let (l, s) = worker?;
            latencies.extend(l);
            statuses.extend(s);
        }
        let elapsed = started.elapsed();
        // Linux counts CPU time in ticks of 10 ms.
        let pg_cpu_us = (load::cpu_ticks().0 - cpu) as f64 * 10_000.0 / requests as f64;
        let statements = match &self.statements {
            Some(statements) => Some(statements.read().await?),
            None => None,
        };
        Ok(Batch {
            requests,
            elapsed,
            p50_ms: percentiles(&mut latencies).0,
            statuses: tally(statuses),
            pg_cpu_us,
            statements,
        })
    }

    /// Fresh requests for the keys `replayed-0..keys`, so that [`Kind::Replay`] finds them.
    async fn record_replayed(&self, keys: u64) -> Result<(), Error> {
        for n in 0..keys {
            let url = format!("{}/idem", self.base);
            let key = format!("replayed-{n}");
            let status = post(&self.client, &url, Some(&key), &charge(n), &[])
                .await
                .status;
            if status != 201 {
                return Err(format!("recording {key} answered {status}").into());
            }
        }
        Ok(())
    }

    /// A request that holds the key `held` for as long as the bench runs, so that its
    /// duplicates answer 409; returns once it holds it (its transaction waits in the
    /// handler) and a duplicate answers 409.
    async fn hold(&self, pool: &PgPool) -> Result<(), Error> {
        let client = self.client.clone();
        let url = format!("{}/hold", self.base);
        tokio::spawn(async move { post(&client, &url, Some("held"), &charge(0), &[]).await });
        let url = format!("{}/hold", self.base);
        for _ in 0..500 {
            let holding: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND state = 'idle in transaction'",
            )
            .fetch_one(pool)
            .await?;
            if holding > 0 {
                let status = post(&self.client, &url, Some("held"), &charge(0), &[]).await;
                if status.status == 409 {
                    return Ok(());
                }
                return Err(
                    format!("a duplicate of the held key answered {}", status.status).into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err("the held request never reached its handler".into())
    }
}

/// `pg_stat_statements` in the bench's database.
struct Statements {
    pool: PgPool,
}

/// One statement's totals over a batch.
struct Statement {
    query: String,
    calls: f64,
    exec_ms: f64,
    plan_ms: f64,
    buffers: f64,
}

impl Statements {
    /// The counter, where the server loads `pg_stat_statements`.
    async fn open(pool: &PgPool) -> Option<Self> {
        let loaded: Option<String> =
            sqlx::query_scalar("SELECT current_setting('shared_preload_libraries')")
                .fetch_one(pool)
                .await
                .ok();
        if !loaded.is_some_and(|l| l.contains("pg_stat_statements")) {
            return None;
        }
        sqlx::raw_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(pool)
            .await
            .ok()?;
        Some(Self { pool: pool.clone() })
    }

    async fn reset(&self) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&self.pool)
            .await
            .map(drop)
    }

    /// The statements run in this database since the last reset, but this reading's.
    async fn read(&self) -> Result<Vec<Statement>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT regexp_replace(query, '\\s+', ' ', 'g') AS query, calls::float8 AS calls,
                    total_exec_time AS exec_ms, total_plan_time AS plan_ms,
                    (shared_blks_hit + shared_blks_read + shared_blks_dirtied)::float8 AS buffers
               FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND query NOT LIKE '%pg_stat_statements%'
              ORDER BY total_exec_time + total_plan_time DESC",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(Statement {
                    query: row.try_get("query")?,
                    calls: row.try_get("calls")?,
                    exec_ms: row.try_get("exec_ms")?,
                    plan_ms: row.try_get("plan_ms")?,
                    buffers: row.try_get("buffers")?,
                })
            })
            .collect()
    }
}

/// A statement's text, short enough for a table cell.
fn short(query: &str) -> String {
    let query = query.replace('|', "\\|");
    if query.chars().count() <= 90 {
        return query;
    }
    let cut: String = query.chars().take(87).collect();
    format!("{cut}…")
}

async fn profile(load: &Load, pool: &PgPool, requests: u64) -> Result<(), Error> {
    // Connections opened, statements prepared, caches warm: not measured.
    for kind in [Kind::Bare, Kind::Floor, Kind::Fresh, Kind::Layer] {
        load.batch(kind, 500).await?;
    }
    let keys = 256;
    load.record_replayed(keys).await?;
    load.batch(Kind::Cached(keys), keys).await?;
    load.hold(pool).await?;
    let kinds = [
        ("bare", Kind::Bare),
        ("floor", Kind::Floor),
        ("idem fresh", Kind::Fresh),
        ("idem layer", Kind::Layer),
        ("idem replay", Kind::Replay(keys)),
        ("idem replay, cached", Kind::Cached(keys)),
        ("idem 409", Kind::Conflict),
    ];
    // `--kinds fresh,replay`: only those (for a profiler attached to PostgreSQL).
    let only = value_of("--kinds");
    let chosen = |name: &str| {
        only.as_deref()
            .is_none_or(|only| only.split(',').any(|k| name.ends_with(k.trim())))
    };
    let mut batches = Vec::new();
    for (name, kind) in kinds.into_iter().filter(|(name, _)| chosen(name)) {
        batches.push((name, kind, load.batch(kind, requests).await?));
    }

    println!("## PostgreSQL's work per request\n");
    println!("| request | requests/s | p50 ms | PostgreSQL CPU µs | statements | exec µs | plan µs | buffers |");
    println!("|---|---|---|---|---|---|---|---|");
    for (name, kind, batch) in &batches {
        let cell =
            |v: Option<f64>, digits: usize| v.map_or("—".to_owned(), |v| format!("{v:.digits$}"));
        println!(
            "| {name}{} | {:.0} | {:.2} | {:.0} | {} | {} | {} | {} |",
            batch.verdict(kind.expected()),
            batch.requests as f64 / batch.elapsed.as_secs_f64(),
            batch.p50_ms,
            batch.pg_cpu_us,
            cell(batch.per_request(|s| s.calls), 1),
            cell(batch.per_request(|s| s.exec_ms * 1000.0), 1),
            cell(batch.per_request(|s| s.plan_ms * 1000.0), 1),
            cell(batch.per_request(|s| s.buffers), 1),
        );
    }
    println!();
    for (name, _, batch) in &batches {
        let Some(statements) = &batch.statements else {
            continue;
        };
        println!("### {name}: its statements, per request\n");
        println!("| statement | calls | exec µs | plan µs | buffers |");
        println!("|---|---|---|---|---|");
        let per = |v: f64| v / batch.requests as f64;
        for s in statements
            .iter()
            .filter(|s| s.calls >= batch.requests as f64 / 10.0)
        {
            println!(
                "| `{}` | {:.2} | {:.1} | {:.1} | {:.1} |",
                short(&s.query),
                per(s.calls),
                per(s.exec_ms * 1000.0),
                per(s.plan_ms * 1000.0),
                per(s.buffers),
            );
        }
        println!();
    }
    Ok(())
}

/// Fills the key table to `size` rows, the even ones expired, each at an instant of its
/// own (as records written one by one are): the rows deleted by a sweep before are
/// written again, the others left as they are.
async fn fill(pool: &PgPool, size: i64) -> Result<Duration, Error> {
    let started = Instant::now();
    let chunk = 500_000;
    let mut from = 1;
    while from <= size {
        let to = (from + chunk - 1).min(size);
        sqlx::query(
            "INSERT INTO idempotency_keys
                   (scope, principal, key, fingerprint, field_hashes, status, headers, body,
                    created_at, expires_at)
             SELECT 'charges', '', 'filled-' || g, sha256(g::text::bytea),
                    sha256(g::text::bytea) || sha256(g::text::bytea) || sha256(g::text::bytea),
                    201, convert_to('content-type: application/json', 'UTF8'),
                    convert_to('{\"id\":' || g || ',\"amount\":100,\"currency\":\"usd\",\
                               \"customer\":\"cus_1\",\"created_at\":\"2026-11-27\"}', 'UTF8'),
                    now(),
                    CASE WHEN g % 2 = 0 THEN now() - interval '1 hour'
                         ELSE now() + interval '24 hours' END + g * interval '1 microsecond'
               FROM generate_series($1::bigint, $2::bigint) AS g
             ON CONFLICT DO NOTHING",
        )
        .bind(from)
        .bind(to)
        .execute(pool)
        .await?;
        from = to + 1;
    }
    sqlx::raw_sql("VACUUM ANALYZE idempotency_keys")
        .execute(pool)
        .await?;
    Ok(started.elapsed())
}

/// One size's figures.
struct Point {
    size: i64,
    fresh: Batch,
    replay: Batch,
    sweep_rows_per_s: f64,
    sweep_buffers_per_row: Option<f64>,
}

async fn curve(load: &Load, pool: &PgPool, requests: u64, sizes: &[i64]) -> Result<(), Error> {
    let store = Store::new(pool.clone());
    let mut points = Vec::new();
    for &size in sizes {
        let took = fill(pool, size).await?;
        eprintln!("filled {size} rows in {:.1} s", took.as_secs_f64());
        let fresh = load.batch(Kind::Fresh, requests).await?;
        let replay = load.batch(Kind::Replay(256), requests).await?;
        if let Some(statements) = &load.statements {
            statements.reset().await?;
        }
        let started = Instant::now();
        let swept = store
            .operate()
            .audited(idem_tests::operator())
            .purge_expired(1000)
            .await?;
        let sweep_s = started.elapsed().as_secs_f64();
        let sweep_buffers = match &load.statements {
            Some(statements) => Some(
                statements
                    .read()
                    .await?
                    .iter()
                    .filter(|s| s.query.starts_with("DELETE"))
                    .map(|s| s.buffers)
                    .sum::<f64>()
                    / swept.max(1) as f64,
            ),
            None => None,
        };
        points.push(Point {
            size,
            fresh,
            replay,
            sweep_rows_per_s: swept as f64 / sweep_s,
            sweep_buffers_per_row: sweep_buffers,
        });
    }

    println!("## The cost curve: the key table at each size, half of its rows expired\n");
    println!(
        "| rows | fresh/s | fresh PG CPU µs | fresh buffers | replay/s | replay PG CPU µs | replay buffers | sweep rows/s | sweep buffers/row |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let cell = |v: Option<f64>| v.map_or("—".to_owned(), |v| format!("{v:.1}"));
    for p in &points {
        println!(
            "| {} | {:.0}{} | {:.0} | {} | {:.0}{} | {:.0} | {} | {:.0} | {} |",
            p.size,
            p.fresh.requests as f64 / p.fresh.elapsed.as_secs_f64(),
            p.fresh.verdict(201),
            p.fresh.pg_cpu_us,
            cell(p.fresh.per_request(|s| s.buffers)),
            p.replay.requests as f64 / p.replay.elapsed.as_secs_f64(),
            p.replay.verdict(201),
            p.replay.pg_cpu_us,
            cell(p.replay.per_request(|s| s.buffers)),
            p.sweep_rows_per_s,
            cell(p.sweep_buffers_per_row),
        );
    }
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if a > 0.0 => format!("{:.2}", b / a),
            _ => "—".to_owned(),
        };
        println!(
            "| {} / {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            last.size,
            first.size,
            ratio(
                Some(first.fresh.throughput()),
                Some(last.fresh.throughput())
            ),
            ratio(Some(first.fresh.pg_cpu_us), Some(last.fresh.pg_cpu_us)),
            ratio(
                first.fresh.per_request(|s| s.buffers),
                last.fresh.per_request(|s| s.buffers)
            ),
            ratio(
                Some(first.replay.throughput()),
                Some(last.replay.throughput())
            ),
            ratio(Some(first.replay.pg_cpu_us), Some(last.replay.pg_cpu_us)),
            ratio(
                first.replay.per_request(|s| s.buffers),
                last.replay.per_request(|s| s.buffers)
            ),
            ratio(Some(first.sweep_rows_per_s), Some(last.sweep_rows_per_s)),
            ratio(first.sweep_buffers_per_row, last.sweep_buffers_per_row),
        );
    }
    println!();
    Ok(())
}

impl Batch {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}
