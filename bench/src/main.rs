//! idem's load benchmark: the idempotent handler side by side with the bare
//! transactional handler doing the same write, over real HTTP on loopback, against one
//! local PostgreSQL, in one run. See BENCHMARKS.md.
//!
//! ```text
//! cargo run --release -p idem-bench -- [--seconds 5] [--quick] [--no-growth] [--growth-only] [--modes]
//!     [--chart PATH] [--peer-store redis|memory]
//! ```
//!
//! `--modes` runs only the comparison of the store's production modes, `--growth-only`
//! only the claim's latency as the table grows.
//!
//! Every cell states the one status it expects (409 for the duplicates in flight, 201
//! elsewhere; 201 or 409 in idem's duplicate storm). A cell that answered anything else
//! is marked "not a figure" where it is printed, and the run ends with a non-zero exit
//! naming every such cell. The pools are sized from the server's `max_connections`, less
//! what others already hold, and each section closes the pools it opened.
//!
//! The peer cells (`axum-idempotent` on Redis at 127.0.0.1:6379) use Redis databases 10
//! to 14, one per cell, and delete their session at the end. With `--peer-store memory`
//! each peer cell has a `ruts` `MemoryStore` of its own instead.
//!
//! `DATABASE_URL` names the server (default `postgres://postgres@127.0.0.1:5432/postgres`);
//! the benchmark creates its own database there and drops it at the end.

mod chart;
mod load;
mod record;
mod server;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use idem_tests::{percentiles, post, tally, Pgbouncer, TestDb};
use load::{drive, Stats};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{ConnectOptions, PgPool};

struct Options {
    seconds: f64,
    quick: bool,
    growth: bool,
    growth_only: bool,
    modes_only: bool,
    chart: String,
    peer_store: PeerStore,
}

/// Where the peer keeps its responses.
#[derive(Clone, Copy, PartialEq)]
enum PeerStore {
    /// `ruts`' `RedisStore` (through `fred`) on 127.0.0.1:6379: it needs Redis 7.4 or
    /// later (`HEXPIRE`); on an older Redis the run stops and says so.
    Redis,
    /// `ruts`' `MemoryStore`, in the server's process (the peer's own documented
    /// example): for a machine whose Redis is older than 7.4.
    Memory,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut options = Self {
            seconds: 5.0,
            quick: false,
            growth: true,
            growth_only: false,
            modes_only: false,
            chart: concat!(env!("CARGO_MANIFEST_DIR"), "/throughput.svg").to_owned(),
            peer_store: PeerStore::Redis,
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
                "--growth-only" => options.growth_only = true,
                "--modes" => options.modes_only = true,
                "--chart" => options.chart = args.next().ok_or("--chart needs a path")?,
                "--peer-store" => {
                    options.peer_store = match args.next().as_deref() {
                        Some("redis") => PeerStore::Redis,
                        Some("memory") => PeerStore::Memory,
                        _ => return Err("--peer-store needs redis or memory".to_owned()),
                    }
                }
                other => {
                    return Err(format!(
                        "unknown argument {other}; use --seconds N, --quick, --no-growth, --growth-only, --modes, --chart PATH, --peer-store redis|memory"
                    ))
                }
            }
        }
        Ok(options)
    }
}

/// The cells that answered a status they should not have: the run fails with them.
static UNEXPECTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Whether every answer of a cell is one of `expected`; if not, the cell is recorded as
/// failed and its row says so. A cell whose answers are not all the expected status
/// measures something else (errors are cheap), so it is not a figure.
fn verdict(cell: &str, statuses: &BTreeMap<u16, usize>, expected: &[u16]) -> &'static str {
    if statuses.keys().all(|s| expected.contains(s)) {
        ""
    } else {
        let expected: Vec<String> = expected.iter().map(u16::to_string).collect();
        UNEXPECTED.lock().unwrap().push(format!(
            "{cell}: answered {}, expected only {}",
            answers(statuses),
            expected.join(" or ")
        ));
        " **not a figure: unexpected status**"
    }
}

/// How many connections the benchmark may open: the server's `max_connections`, less
/// the superuser reserve, less what other clients hold now, less a margin for the
/// administrative connections (creating and dropping the database).
async fn connection_budget(db: &TestDb) -> Result<u32, Box<dyn std::error::Error>> {
    let mut conn = db.options.connect().await?;
    let max: String = sqlx::query_scalar("SHOW max_connections")
        .fetch_one(&mut conn)
        .await?;
    let reserved: String = sqlx::query_scalar("SHOW superuser_reserved_connections")
        .fetch_one(&mut conn)
        .await?;
    let in_use: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
    )
    .fetch_one(&mut conn)
    .await?;
    let (max, reserved): (i64, i64) = (max.parse()?, reserved.parse()?);
    // This connection is counted in `in_use` and closes now; 4 more for the margin.
    let budget = max - reserved - in_use - 4;
    println!(
        "Connections: max_connections = {max}, {reserved} reserved, {in_use} in use at the start: \
         the benchmark's pools share {budget}.\n"
    );
    if budget < 12 {
        return Err(format!(
            "only {budget} connections free on the server (max_connections = {max}, \
             {reserved} reserved, {in_use} in use): the benchmark needs at least 12"
        )
        .into());
    }
    Ok(budget as u32)
}

fn charge(n: u64) -> serde_json::Value {
    json!({ "amount": 100 + n % 900, "currency": "usd", "customer": format!("cus_{}", n % 97) })
}

/// [`send`] where the answer must be `201`: a setup step that fails makes the run fail.
async fn send_expecting(
    step: &str,
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &serde_json::Value,
) {
    let status = send(client, url, key, body).await;
    if status != 201 {
        UNEXPECTED
            .lock()
            .unwrap()
            .push(format!("{step}: answered {status}, expected 201"));
    }
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
    let dropped = client_rt.block_on(db.drop_database());
    result?;
    dropped.map_err(|e| format!("could not drop the benchmark's database {name}: {e}"))?;
    let unexpected = std::mem::take(&mut *UNEXPECTED.lock().unwrap());
    if !unexpected.is_empty() {
        return Err(format!(
            "{} cell(s) answered unexpected statuses, so their figures are not figures:\n  {}",
            unexpected.len(),
            unexpected.join("\n  ")
        )
        .into());
    }
    Ok(())
}

fn run(
    options: &Options,
    db: &TestDb,
    server_rt: &tokio::runtime::Runtime,
    client_rt: &tokio::runtime::Runtime,
) -> Result<(), Box<dyn std::error::Error>> {
    println!("# idem load benchmark\n");
    let budget = client_rt.block_on(connection_budget(db))?;
    // The main server's pool lives the whole run (throughput, storm, peer, growth) and
    // takes at most half the budget; the counting server's 2 close after their section,
    // the modes' four pools and PgBouncer's server connections (as many as one of them)
    // share the other half while they run.
    let main_size = (budget / 2).min(40);
    let modes_size = ((budget - main_size) / (MODES.len() as u32 + 1)).min(20);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;

    if options.modes_only {
        // The tables the full run's main server would have made (the modes' handlers
        // write the same charges).
        server_rt.block_on(async {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect_with(db.options.clone())
                .await?;
            server::migrate(&pool).await?;
            pool.close().await;
            Ok::<_, Box<dyn std::error::Error>>(())
        })?;
        let modes = server_rt.block_on(serve_modes(db, modes_size))?;
        client_rt.block_on(compare_modes(&client, &modes.servers, options));
        server_rt.block_on(close(modes));
        return Ok(());
    }

    let (addr, pool) = server_rt.block_on(async {
        let pool = PgPoolOptions::new()
            .max_connections(main_size)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(db.options.clone())
            .await?;
        server::migrate(&pool).await?;
        let addr = server::serve(pool.clone()).await?;
        Ok::<_, Box<dyn std::error::Error>>((addr, pool))
    })?;
    let base = format!("http://{addr}");
    machine_line(client_rt, &pool, main_size, modes_size);
    if options.growth_only {
        client_rt.block_on(growth(&client, &base, &pool, options));
        server_rt.block_on(pool.close());
        return Ok(());
    }

    // A second server on a pool that logs its statements, for counting them; the
    // measured server logs nothing.
    let (counting_addr, counting_pool) = server_rt.block_on(async {
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
        let addr = server::serve(counting_pool.clone()).await?;
        Ok::<_, Box<dyn std::error::Error>>((addr, counting_pool))
    })?;
    client_rt.block_on(statement_counts(
        &client,
        &format!("http://{counting_addr}"),
    ));
    server_rt.block_on(counting_pool.close());

    let peers = server_rt.block_on(Peers::serve(&pool, options.peer_store))?;
    println!(
        "Peer: axum-idempotent 0.2.7 keyed by the Idempotency-Key header, TTL 24 h, responses in ruts' {}.\n",
        match options.peer_store {
            PeerStore::Redis => "RedisStore on 127.0.0.1:6379, databases 10-14 (one per cell)",
            PeerStore::Memory => "MemoryStore in the server's process, one per cell (--peer-store memory)",
        }
    );
    let series = client_rt.block_on(throughput(&client, &base, &pool, &peers, options))?;
    chart::write(&options.chart, &series)?;
    println!("Chart: {}\n", options.chart);
    client_rt.block_on(storm(&client, &base, &pool, &peers))?;
    client_rt.block_on(waiting(&client, &base));
    client_rt.block_on(peers.clean())?;

    let modes = server_rt.block_on(serve_modes(db, modes_size))?;
    client_rt.block_on(compare_modes(&client, &modes.servers, options));
    server_rt.block_on(close(modes));
    if options.growth {
        client_rt.block_on(growth(&client, &base, &pool, options));
    }
    server_rt.block_on(pool.close());
    Ok(())
}

/// Closes the pools of a section that is over, so that the next fits the budget.
async fn close(modes: Modes) {
    for (_, pool) in modes.servers {
        pool.close().await;
    }
    drop(modes.bouncer);
}

/// The peer's servers, one per cell, each on a Redis database of its own, and the
/// session cookie each cell's client sends (the peer's cache is per session).
struct Peers {
    /// Fresh keys at c = 1, 16 and 64 (Redis databases 10, 11, 12).
    fresh: Vec<Peer>,
    /// The 2 000 replayed keys (database 13).
    replay: Peer,
    /// The duplicate storm (database 14).
    storm: Peer,
}

struct Peer {
    base: String,
    cookie: String,
    /// The cell's Redis database, to delete its session from; none in memory.
    redis: Option<fred::clients::Client>,
}

/// The version of the Redis at 127.0.0.1:6379, and whether `ruts`' store can run on it:
/// every write of its `RedisStore` calls `HEXPIRE` or `HPERSIST`, new in Redis 7.4.
async fn redis_version(
    redis: &fred::clients::Client,
) -> Result<(String, bool), Box<dyn std::error::Error>> {
    use fred::prelude::ClientLike;
    let info: String = redis.custom(fred::cmd!("INFO"), vec!["server"]).await?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    let parts: Vec<u32> = version.split('.').filter_map(|p| p.parse().ok()).collect();
    let supported = parts
        .first()
        .zip(parts.get(1))
        .is_some_and(|(&major, &minor)| (major, minor) >= (7, 4));
    Ok((version, supported))
}

impl Peer {
    async fn serve(
        pool: &PgPool,
        store: PeerStore,
        redis_db: u8,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        use fred::prelude::{Builder, ClientLike, Config};
        let url = format!("redis://127.0.0.1:6379/{redis_db}");
        let (addr, redis) = match store {
            PeerStore::Redis => {
                let redis = Builder::from_config(Config::from_url(&url)?).build()?;
                redis.init().await?;
                let (version, supported) = redis_version(&redis).await?;
                if !supported {
                    return Err(format!(
                        "the peer cannot run on this Redis ({version}): ruts' RedisStore, which \
                         axum-idempotent 0.2 stores responses in, calls HEXPIRE/HPERSIST (Redis \
                         7.4 or later) on every write, so every write fails and no session \
                         cookie is ever issued; run with --peer-store memory, or a Redis >= 7.4"
                    )
                    .into());
                }
                let pool_of_4 = Builder::from_config(Config::from_url(&url)?).build_pool(4)?;
                pool_of_4.init().await?;
                let store = ruts::store::redis::RedisStore::new(Arc::new(pool_of_4)).await?;
                (
                    server::serve_peer(pool.clone(), Arc::new(store)).await?,
                    Some(redis),
                )
            }
            PeerStore::Memory => {
                let store = Arc::new(ruts::store::memory::MemoryStore::new());
                (server::serve_peer(pool.clone(), store).await?, None)
            }
        };
        let base = format!("http://{addr}");
        // The first stored response opens the session; its cookie is the client's from
        // then on.
        let answer = post(
            &reqwest::Client::new(),
            &format!("{base}/bare"),
            Some(&format!("peer-session-{redis_db}")),
            &charge(0),
            &[],
        )
        .await;
        let cookie = answer
            .headers
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find(|v| v.starts_with("session="))
            .and_then(|v| v.split(';').next())
            .ok_or_else(|| {
                format!(
                    "the peer (cell {redis_db}) set no session cookie (status {})",
                    answer.status
                )
            })?
            .to_owned();
        Ok(Self {
            base,
            cookie,
            redis,
        })
    }

    /// `POST /bare` with the key and the session cookie.
    async fn send(&self, client: &reqwest::Client, key: &str, body: &serde_json::Value) -> u16 {
        post(
            client,
            &format!("{}/bare", self.base),
            Some(key),
            body,
            &[("cookie", &self.cookie)],
        )
        .await
        .status
    }

    /// A copy to move into the load's tasks.
    fn clone_handle(&self) -> Self {
        Self {
            base: self.base.clone(),
            cookie: self.cookie.clone(),
            redis: self.redis.clone(),
        }
    }

    /// Deletes this cell's session from Redis.
    async fn clean(&self) -> Result<(), Box<dyn std::error::Error>> {
        use fred::prelude::KeysInterface;
        if let Some(redis) = &self.redis {
            let id = self.cookie.trim_start_matches("session=");
            let _: i64 = redis.del(id).await?;
        }
        Ok(())
    }
}

impl Peers {
    async fn serve(pool: &PgPool, store: PeerStore) -> Result<Self, Box<dyn std::error::Error>> {
        let mut fresh = Vec::new();
        for db in 10..13 {
            fresh.push(Peer::serve(pool, store, db).await?);
        }
        Ok(Self {
            fresh,
            replay: Peer::serve(pool, store, 13).await?,
            storm: Peer::serve(pool, store, 14).await?,
        })
    }

    async fn clean(&self) -> Result<(), Box<dyn std::error::Error>> {
        for peer in self.fresh.iter().chain([&self.replay, &self.storm]) {
            peer.clean().await?;
        }
        Ok(())
    }
}

/// The store's production modes, each a server of its own with the same handlers.
const MODES: [&str; 4] = [
    "default",
    "transaction pooler (`pooler(Pooler::Transaction)`, statement cache 0)",
    "transaction pooler behind PgBouncer (`pool_mode = transaction`)",
    "portable (`portable()`)",
];

/// The production modes' servers, and the PgBouncer the third one reaches PostgreSQL
/// through.
struct Modes {
    servers: Vec<(String, PgPool)>,
    bouncer: Pgbouncer,
}

/// Serves the benchmark once per mode, each on a pool of `size`: the default store, the
/// transaction-pooler setting (idem's statements unnamed, and the pool's own statement
/// cache off, as behind PgBouncer) straight to PostgreSQL and through a real PgBouncer in
/// transaction mode, and the portable mode (Citus).
async fn serve_modes(db: &TestDb, size: u32) -> Result<Modes, Box<dyn std::error::Error>> {
    // As many server connections as each mode's pool has: the clients do not queue on
    // PgBouncer's pool more than on the others'.
    let bouncer = Pgbouncer::start_sized(db, size);
    let mut servers = Vec::new();
    for (i, _) in MODES.iter().enumerate() {
        let options = match i {
            1 => db.options.clone().statement_cache_capacity(0),
            2 => bouncer.options().statement_cache_capacity(0),
            _ => db.options.clone(),
        };
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        let addr = server::serve_with(pool.clone(), |store| match i {
            1 | 2 => store.pooler(idem::Pooler::Transaction),
            3 => store.portable(true),
            _ => store,
        })
        .await?;
        servers.push((format!("http://{addr}"), pool));
    }
    Ok(Modes { servers, bouncer })
}

/// What each mode costs: the bare handler and idem's fresh and replayed keys on each
/// mode's own server, side by side, the modes interleaved per concurrency.
async fn compare_modes(client: &reqwest::Client, servers: &[(String, PgPool)], options: &Options) {
    let bases: Vec<&String> = servers.iter().map(|(base, _)| base).collect();
    println!(
        "## Production modes ({} s per cell after 0.5 s warm-up)\n",
        options.seconds
    );
    println!("| mode | concurrency | bare req/s | fresh req/s | fresh / bare | replay req/s | replay / fresh |");
    println!("|---|---|---|---|---|---|---|");
    for (mode, base) in bases.iter().enumerate() {
        for n in 0..500_u64 {
            send_expecting(
                "modes: storing the replayed keys",
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
            let mut marks = String::new();
            for (cell, stats) in [("bare", &bare), ("fresh", &fresh), ("replay", &replay)] {
                marks += verdict(
                    &format!("modes: {} {cell} c={concurrency}", MODES[mode]),
                    &stats.statuses,
                    &[201],
                );
            }
            println!(
                "| {}{marks} | {concurrency} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} |",
                MODES[mode],
                bare.throughput(),
                fresh.throughput(),
                fresh.throughput() / bare.throughput(),
                replay.throughput(),
                replay.throughput() / fresh.throughput(),
            );
            if !marks.is_empty() {
                for stats in [&bare, &fresh, &replay] {
                    println!("|  | | answers: {} | | | | |", answers(&stats.statuses));
                }
            }
        }
    }
    println!();
}

fn machine_line(rt: &tokio::runtime::Runtime, pool: &PgPool, main_size: u32, modes_size: u32) {
    let version: String = rt
        .block_on(sqlx::query_scalar("SHOW server_version").fetch_one(pool))
        .unwrap_or_default();
    let sync: String = rt
        .block_on(sqlx::query_scalar("SHOW synchronous_commit").fetch_one(pool))
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    println!(
        "PostgreSQL {version} (synchronous_commit = {sync}), {cores} cores, load average {} at the start; \
         server pool {main_size} connections, each production mode's {modes_size}\n",
        load.join(" ")
    );
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
            let (statements, status) =
                record::statements_of(send(client, &format!("{base}{path}"), key, &charge(1)))
                    .await;
            verdict(
                &format!("statements per request: {label}"),
                &tally([status]),
                &[201],
            );
            statements
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

/// The cells drawn in the chart, in its legend's order, and their throughput at each
/// concurrency.
pub type Series = Vec<(&'static str, Vec<(usize, f64)>)>;

/// Drives `concurrency` clients against `url`, each request with `key(n)` (none if it
/// gives `None`) and the body of `body_n(n)`.
async fn cell(
    client: &reqwest::Client,
    url: String,
    concurrency: usize,
    seconds: f64,
    key: impl Fn(u64) -> Option<String> + Clone + Send + Sync + 'static,
    body_n: fn(u64) -> u64,
) -> Stats {
    let client = client.clone();
    drive(concurrency, seconds, move |n| {
        let (client, url, key) = (client.clone(), url.clone(), key(n));
        async move { send(&client, &url, key.as_deref(), &charge(body_n(n))).await }
    })
    .await
}

/// The replayed keys' spread: request `n` replays key `replayed(n)` of 2 000.
fn replayed(n: u64) -> u64 {
    (n * 7919) % 2_000
}

async fn throughput(
    client: &reqwest::Client,
    base: &str,
    pool: &PgPool,
    peers: &Peers,
    options: &Options,
) -> Result<Series, Box<dyn std::error::Error>> {
    println!(
        "## Throughput and latency ({} s per cell after 0.5 s warm-up)\n",
        options.seconds
    );
    println!("| scenario | concurrency | req/s | p50 ms | p99 ms | CPU µs/req: PostgreSQL + app | answers |");
    println!("|---|---|---|---|---|---|---|");
    // Keys for the replay scenarios, stored once: idem's, and the peer's in its session.
    for n in 0..2_000_u64 {
        send_expecting(
            "storing idem's replayed keys",
            client,
            &format!("{base}/idem"),
            Some(&format!("replay-{n}")),
            &charge(n),
        )
        .await;
        let status = peers
            .replay
            .send(client, &format!("peer-replay-{n}"), &charge(n))
            .await;
        if status != 201 {
            UNEXPECTED.lock().unwrap().push(format!(
                "storing the peer's replayed keys: answered {status}, expected 201"
            ));
        }
    }
    let mut summary = Vec::new();
    let mut series: Series = [
        "bare",
        "floor",
        "idem fresh",
        "idem replay",
        "peer fresh",
        "peer replay",
    ]
    .into_iter()
    .map(|name| (name, Vec::new()))
    .collect();
    for (i, concurrency) in [1, 16, 64].into_iter().enumerate() {
        let run_id = format!("c{concurrency}");
        let seconds = options.seconds;
        let bare = cell(
            client,
            format!("{base}/bare"),
            concurrency,
            seconds,
            |_| None,
            |n| n,
        )
        .await;
        let floor = {
            let run_id = run_id.clone();
            cell(
                client,
                format!("{base}/floor"),
                concurrency,
                seconds,
                move |n| Some(format!("floor-{run_id}-{n}")),
                |n| n,
            )
            .await
        };
        let fresh = {
            let run_id = run_id.clone();
            cell(
                client,
                format!("{base}/idem"),
                concurrency,
                seconds,
                move |n| Some(format!("fresh-{run_id}-{n}")),
                |n| n,
            )
            .await
        };
        let replay = cell(
            client,
            format!("{base}/idem"),
            concurrency,
            seconds,
            |n| Some(format!("replay-{}", replayed(n))),
            replayed,
        )
        .await;
        let conflict = {
            // One request holds the key (it sleeps in its transaction); the load is its
            // duplicates.
            let held = format!("held-{run_id}");
            let holder = tokio::spawn({
                let (client, url, held) = (client.clone(), format!("{base}/hold"), held.clone());
                async move { send(&client, &url, Some(&held), &charge(1)).await }
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            let stats = cell(
                client,
                format!("{base}/hold"),
                concurrency,
                seconds,
                move |_| Some(held.clone()),
                |_| 1,
            )
            .await;
            holder.abort();
            stats
        };
        let naive = {
            let run_id = run_id.clone();
            cell(
                client,
                format!("{base}/naive"),
                concurrency,
                seconds,
                move |n| Some(format!("naive-{run_id}-{n}")),
                |n| n,
            )
            .await
        };
        let peer_fresh = {
            let (client, peer) = (client.clone(), Arc::new(peers.fresh[i].clone_handle()));
            drive(concurrency, seconds, move |n| {
                let (client, peer) = (client.clone(), Arc::clone(&peer));
                async move {
                    peer.send(&client, &format!("peer-fresh-{n}"), &charge(n))
                        .await
                }
            })
            .await
        };
        let peer_replay = {
            let (client, peer) = (client.clone(), Arc::new(peers.replay.clone_handle()));
            drive(concurrency, seconds, move |n| {
                let (client, peer) = (client.clone(), Arc::clone(&peer));
                let k = replayed(n);
                async move {
                    peer.send(&client, &format!("peer-replay-{k}"), &charge(k))
                        .await
                }
            })
            .await
        };
        for (label, stats, expected) in [
            ("(a) bare transactional handler", &bare, 201),
            ("(f) floor: bare + one complete key row", &floor, 201),
            ("(b) idem, fresh keys", &fresh, 201),
            ("(c) idem, replays", &replay, 201),
            ("(d) idem, duplicates in flight", &conflict, 409),
            ("(e) non-atomic check/write/save", &naive, 201),
            ("(p) peer `axum-idempotent`, fresh keys", &peer_fresh, 201),
            ("(q) peer `axum-idempotent`, replays", &peer_replay, 201),
        ] {
            let mark = verdict(
                &format!("{label} c={concurrency}"),
                &stats.statuses,
                &[expected],
            );
            println!(
                "| {label} | {concurrency} | {:.0} | {:.2} | {:.2} | {:.0} + {:.0} | {}{mark} |",
                stats.throughput(),
                stats.p50_ms,
                stats.p99_ms,
                stats.cpu_us.0,
                stats.cpu_us.1,
                answers(&stats.statuses)
            );
        }
        for ((_, points), stats) in
            series
                .iter_mut()
                .zip([&bare, &floor, &fresh, &replay, &peer_fresh, &peer_replay])
        {
            points.push((concurrency, stats.throughput()));
        }
        summary.push(format!(
            "| {concurrency} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | **{:.2}** | {:.2} | {:.2} | {:.2} | {:.0} / {:.0} / {:.0} |",
            bare.throughput(),
            floor.throughput(),
            fresh.throughput(),
            replay.throughput(),
            peer_fresh.throughput(),
            peer_replay.throughput(),
            fresh.throughput() / floor.throughput(),
            fresh.throughput() / bare.throughput(),
            replay.throughput() / bare.throughput(),
            peer_fresh.throughput() / fresh.throughput(),
            bare.cpu_us.0,
            floor.cpu_us.0,
            fresh.cpu_us.0,
        ));
    }
    println!("\n## Side by side (req/s; the same cells as above)\n");
    println!("| c | bare | floor | idem fresh | idem replay | peer fresh | peer replay | fresh / floor | fresh / bare | replay / bare | peer fresh / idem fresh | PostgreSQL CPU µs/req: bare / floor / fresh |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for line in summary {
        println!("{line}");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await?;
    println!("\n({rows} charges written in this section)\n");
    Ok(series)
}

/// The same storm against the non-atomic pattern, idem and the peer: duplicates counted.
async fn storm(
    client: &reqwest::Client,
    base: &str,
    pool: &PgPool,
    peers: &Peers,
) -> Result<(), Box<dyn std::error::Error>> {
    const KEYS: u64 = 200;
    const COPIES: u64 = 10;
    println!(
        "## Duplicate storm: {KEYS} keys × {COPIES} concurrent copies, 20 ms processor delay\n"
    );
    println!("| handler | charges written | duplicates | answers |");
    println!("|---|---|---|---|");
    let peer = Arc::new(peers.storm.clone_handle());
    for (label, path, expected) in [
        ("(e) non-atomic check/write/save", "naive", &[201][..]),
        ("(b) idem", "idem", &[201, 409][..]),
        ("(p) peer `axum-idempotent`", "peer", &[201][..]),
    ] {
        let before: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(pool)
            .await?;
        let url = format!("{base}/{path}");
        let requests = (0..KEYS).flat_map(|k| (0..COPIES).map(move |_| k)).map(|k| {
            let (client, url, peer) = (client.clone(), url.clone(), Arc::clone(&peer));
            async move {
                let body = json!({ "amount": 500, "currency": "usd", "customer": "storm", "delay_ms": 20 });
                let key = format!("storm-{path}-{k}");
                if path == "peer" {
                    peer.send(&client, &key, &body).await
                } else {
                    send(&client, &url, Some(&key), &body).await
                }
            }
        });
        let statuses = tally(join_all(requests).await);
        let after: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(pool)
            .await?;
        let written = after - before;
        let mark = verdict(&format!("storm {label}"), &statuses, expected);
        println!(
            "| {label} | {written} | {} | {}{mark} |",
            written - KEYS as i64,
            answers(&statuses)
        );
    }
    println!();
    Ok(())
}

/// How soon a duplicate that waits (`concurrency = wait(..)`) gets its replay after the
/// first request commits: the first holds its key for 50 ms (a processor call in its
/// transaction), its duplicate arrives 20 ms in and waits; the figure is the time from
/// the first's answer (sent once it committed) to the duplicate's.
async fn waiting(client: &reqwest::Client, base: &str) {
    let url = format!("{base}/wait");
    let mut after = Vec::new();
    let mut statuses = Vec::new();
    for n in 0..200_u64 {
        let key = format!("wait-{n}");
        let mut body = charge(n);
        body["delay_ms"] = json!(50);
        let first = async {
            let status = send(client, &url, Some(&key), &body).await;
            (status, Instant::now())
        };
        let duplicate = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let status = send(client, &url, Some(&key), &body).await;
            (status, Instant::now())
        };
        let ((s1, t1), (s2, t2)) = tokio::join!(first, duplicate);
        statuses.extend([s1, s2]);
        after.push(t2.saturating_duration_since(t1));
    }
    let (p50, p99) = percentiles(&mut after);
    let statuses = tally(statuses);
    let mark = verdict("waiting duplicates", &statuses, &[201]);
    println!(
        "## Waiting duplicates (`concurrency = wait(\"10s\")`), 200 pairs
"
    );
    println!("| | p50 ms | p99 ms | answers |");
    println!("|---|---|---|---|");
    println!(
        "| the duplicate's replay after the first's answer{mark} | {p50:.2} | {p99:.2} | {} |\n",
        answers(&statuses)
    );
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
    // Warm the server, its pool's statements and PostgreSQL's caches first, so that the
    // empty table's figures are not a cold start's.
    for n in 0..500 {
        send(
            client,
            &format!("{base}/idem"),
            Some(&format!("grow-warm-{n}")),
            &charge(n),
        )
        .await;
    }
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
    let removed = store
        .operate()
        .audited(idem_tests::operator())
        .purge_expired(1_000)
        .await
        .expect("purge");
    let secs = started.elapsed().as_secs_f64();
    println!(
        "\nSweeper: {removed} of {expired} expired rows deleted in {secs:.1} s, {:.0} rows/s (batches of 1000).\n",
        removed as f64 / secs
    );
}
