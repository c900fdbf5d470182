//! A TCP proxy in front of PostgreSQL that a test shuts and opens again, as a restart or
//! a failover does to a service: shut, every connection through it is cut and new ones
//! are refused (nothing listens on its port); open, it listens on the same port again.
//! And how long a test's outage lasts (`OUTBOX_OUTAGE_SECS`).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use idem::Store;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::task::{JoinHandle, JoinSet};

use crate::TestDb;

/// How long the outage tests keep the database away: `OUTBOX_OUTAGE_SECS`, else 15 s
/// (RELIABILITY.md has the figures of a 90 s one).
pub fn outage() -> Duration {
    let secs = std::env::var("OUTBOX_OUTAGE_SECS")
        .ok()
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("OUTBOX_OUTAGE_SECS is not a number of seconds: {s:?}"))
        })
        .unwrap_or(15);
    Duration::from_secs(secs)
}

/// The proxy. Open when started; stops when dropped.
pub struct Gate {
    port: u16,
    upstream: Upstream,
    serving: Option<JoinHandle<()>>,
}

/// Where the server listens: a host and port, or a Unix socket's path.
#[derive(Clone)]
enum Upstream {
    Tcp(String, u16),
    Unix(String),
}

impl Gate {
    /// An open gate on a free loopback port in front of the server `upstream` connects to.
    pub async fn start(upstream: &PgConnectOptions) -> Self {
        let host = upstream.get_host().to_owned();
        let port = upstream.get_port();
        let upstream = if host.starts_with('/') {
            Upstream::Unix(format!("{host}/.s.PGSQL.{port}"))
        } else {
            Upstream::Tcp(host, port)
        };
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind the gate");
        let port = listener.local_addr().expect("the gate's address").port();
        let serving = Some(tokio::spawn(serve(listener, upstream.clone())));
        Self {
            port,
            upstream,
            serving,
        }
    }

    /// `options` pointed at the gate.
    pub fn options(&self, options: PgConnectOptions) -> PgConnectOptions {
        options.host("127.0.0.1").port(self.port)
    }

    /// A store on `db` through the gate (a pool of 4, made lazily), which gives up on a
    /// connection after 250 ms: a shut gate fails a delivery in a quarter of a second,
    /// as a refusing database does.
    pub fn store(&self, db: &TestDb) -> Store {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(self.options(db.options.clone()));
        Store::builder(pool)
            .acquire_timeout(Duration::from_millis(250))
            .build()
            .expect("a store through the gate")
    }

    /// Cuts every connection through the gate and refuses new ones.
    pub async fn shut(&mut self) {
        if let Some(serving) = self.serving.take() {
            // Aborting drops the listener and the connections' tasks with their sockets.
            serving.abort();
            serving.await.ok();
        }
    }

    /// Listens again, on the same port.
    pub async fn open(&mut self) {
        if self.serving.is_some() {
            return;
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        // tokio binds with SO_REUSEADDR: the cut connections' TIME_WAIT does not hold the
        // port.
        let listener = TcpListener::bind(addr).await.expect("bind the gate again");
        self.serving = Some(tokio::spawn(serve(listener, self.upstream.clone())));
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if let Some(serving) = self.serving.take() {
            serving.abort();
        }
    }
}

/// Accepts connections and copies each both ways to the server, until aborted; the
/// connections' tasks are aborted with it (a `JoinSet` aborts its tasks when dropped).
async fn serve(listener: TcpListener, upstream: Upstream) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((mut client, _)) = listener.accept().await else {
            continue;
        };
        let upstream = upstream.clone();
        connections.spawn(async move {
            client.set_nodelay(true).ok();
            match upstream {
                Upstream::Tcp(host, port) => {
                    if let Ok(mut server) = TcpStream::connect((host.as_str(), port)).await {
                        server.set_nodelay(true).ok();
                        tokio::io::copy_bidirectional(&mut client, &mut server)
                            .await
                            .ok();
                    }
                }
                Upstream::Unix(path) => {
                    if let Ok(mut server) = UnixStream::connect(path).await {
                        tokio::io::copy_bidirectional(&mut client, &mut server)
                            .await
                            .ok();
                    }
                }
            }
        });
        while connections.try_join_next().is_some() {}
    }
}
