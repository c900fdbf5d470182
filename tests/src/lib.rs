//! Test support: a fresh PostgreSQL database per test and a real HTTP server on a
//! loopback port.
//!
//! The server is found through `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); each test creates its own database
//! there and drops it when done, also when the test fails.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The server tests run against.
pub fn admin_options() -> PgConnectOptions {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    PgConnectOptions::from_str(&url)
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL: {e}"))
        .disable_statement_logging()
}

/// A database of one's own, dropped when this value is.
pub struct TestDb {
    /// The database's name.
    pub name: String,
    /// Options that connect to it.
    pub options: PgConnectOptions,
}

impl TestDb {
    /// Creates an empty database.
    pub async fn new() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "idem_test_{}_{}_{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = PgConnection::connect_with(&admin_options())
            .await
            .expect("cannot reach PostgreSQL: is it running, and DATABASE_URL right?");
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .expect("create test database");
        admin.close().await.ok();
        let options = admin_options().database(&name);
        Self { name, options }
    }

    /// A `postgres://` URL of this database, for processes of their own.
    pub fn url(&self) -> String {
        let admin = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let (base, query) = admin
            .split_once('?')
            .map_or((admin.as_str(), None), |(b, q)| (b, Some(q)));
        let authority_end = base.find("://").map_or(0, |i| i + 3);
        let path_start = base[authority_end..]
            .find('/')
            .map_or(base.len(), |i| authority_end + i);
        let mut url = format!("{}/{}", &base[..path_start], self.name);
        if let Some(query) = query {
            url.push('?');
            url.push_str(query);
        }
        url
    }

    /// A pool on this database, with the given size and a short acquire timeout.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(3))
            .connect_with(self.options.clone())
            .await
            .expect("connect to test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs inside the test's runtime, which cannot block on itself: a thread
        // with its own small runtime does the cleanup.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let mut admin = PgConnection::connect_with(&admin_options()).await.ok()?;
                sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut admin)
                    .await
                    .ok()
            })
        })
        .join();
        if !matches!(dropped, Ok(Some(_))) {
            eprintln!("warning: could not drop test database {}", self.name);
        }
    }
}

/// A router served over real HTTP on a loopback port until dropped.
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl TestServer {
    /// Serves `app` on an ephemeral port.
    pub async fn start(app: Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve");
        });
        Self { addr, task }
    }

    /// The absolute URL of `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A response read whole: status, headers and the exact body bytes.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status.
    pub status: u16,
    /// The headers.
    pub headers: reqwest::header::HeaderMap,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

impl Answer {
    /// Reads a response.
    pub async fn read(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("read body").to_vec();
        Self {
            status,
            headers,
            body,
        }
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header as text, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Whether this is a replay.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a problem+json answer with this status and a `type` ending in `slug`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let json = self.json();
        let kind = json["type"].as_str().unwrap_or_default();
        assert!(
            kind.ends_with(slug),
            "problem type {kind:?} does not end in {slug:?}"
        );
        assert_eq!(json["status"], status);
        assert!(json["title"].is_string());
    }
}

/// Counts the rows of a table (or any `FROM` clause).
pub async fn count(pool: &PgPool, from: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {from}"))
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Sends `POST url` with a JSON body, an optional `Idempotency-Key` and extra headers,
/// and reads the answer whole. A connection closed without an answer (a handler that
/// panicked) reads as status 0.
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> Answer {
    let mut request = client.post(url).json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    match request.send().await {
        Ok(response) => Answer::read(response).await,
        Err(_) => Answer {
            status: 0,
            headers: reqwest::header::HeaderMap::new(),
            body: Vec::new(),
        },
    }
}

/// The p50 and p99 of some latencies, in milliseconds.
pub fn percentiles(latencies: &mut [Duration]) -> (f64, f64) {
    if latencies.is_empty() {
        return (0.0, 0.0);
    }
    latencies.sort_unstable();
    let at = |q: f64| {
        let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies[i].as_secs_f64() * 1000.0
    };
    (at(0.50), at(0.99))
}
