//! A TCP proxy in front of PostgreSQL (or PgBouncer) that a test shuts and opens again,
//! as a restart or a failover does to a service: shut, every connection through it is cut
//! and new ones are refused (nothing listens on its port); open, it listens on the same
//! port again. The test kit shuts it for its outage; idem's own tests use it the same way.
//!
//! It also counts client round trips ([`Gate::round_trips`]): the times a client sends
//! after the server has answered, on each connection. A client that sends several
//! messages before it waits (a pipeline, or a simple-query message of several statements)
//! makes one round trip; one that waits for each makes one per message. This is what a
//! request costs on a real network, and unlike a timing it is the same on a quiet machine
//! and a busy one. A round trip that executes nothing is counted apart
//! ([`Gate::idle_trips`]): the preparation of a named statement (Parse with a name,
//! Describe, Sync), a connection's one-time cost, which depends on which of a pool's
//! connections a request got; a connection's opening (its startup and authentication),
//! which depends on whether the pool had one idle at that moment (a connection given back
//! in a task of its own may not be yet, on a busy machine); and sqlx's ping of a
//! connection given back to its pool (a Sync alone), which happens after the answer. Parsing an unnamed statement is every
//! execution's cost (behind a transaction pooler), and counts as a round trip.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::task::{JoinHandle, JoinSet};

/// A TCP proxy in front of a PostgreSQL server, on a loopback port: open when started,
/// shut and opened again by the test, stopped when dropped.
pub struct Gate {
    port: u16,
    upstream: Upstream,
    serving: Option<JoinHandle<()>>,
    counts: Arc<Counts>,
}

/// Round trips through the gate, over every connection.
#[derive(Default)]
struct Counts {
    trips: AtomicU64,
    idle: AtomicU64,
}

/// Where the server listens: a host and port, or a Unix socket's path.
#[derive(Clone)]
enum Upstream {
    Tcp(String, u16),
    Unix(String),
}

impl Gate {
    /// An open gate on a free loopback port in front of the server `upstream` connects to
    /// (by TCP or by its Unix socket). Call it on the runtime that should serve it.
    ///
    /// # Panics
    ///
    /// If no loopback port can be bound.
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
        let counts = Arc::new(Counts::default());
        let serving = Some(tokio::spawn(serve(
            listener,
            upstream.clone(),
            counts.clone(),
        )));
        Self {
            port,
            upstream,
            serving,
            counts,
        }
    }

    /// The round trips counted so far, but those that execute nothing.
    pub fn round_trips(&self) -> u64 {
        self.counts.trips.load(Ordering::SeqCst)
    }

    /// The round trips that execute nothing: named statements prepared, connections
    /// pinged.
    pub fn idle_trips(&self) -> u64 {
        self.counts.idle.load(Ordering::SeqCst)
    }

    /// `options` pointed at the gate.
    pub fn options(&self, options: PgConnectOptions) -> PgConnectOptions {
        options.host("127.0.0.1").port(self.port)
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
    ///
    /// # Panics
    ///
    /// If the port was taken meanwhile.
    pub async fn open(&mut self) {
        if self.serving.is_some() {
            return;
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        // tokio binds with SO_REUSEADDR: the cut connections' TIME_WAIT does not hold the
        // port.
        let listener = TcpListener::bind(addr).await.expect("bind the gate again");
        let counts = self.counts.clone();
        self.serving = Some(tokio::spawn(serve(listener, self.upstream.clone(), counts)));
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("port", &self.port)
            .field("open", &self.serving.is_some())
            .finish_non_exhaustive()
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
async fn serve(listener: TcpListener, upstream: Upstream, counts: Arc<Counts>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let upstream = upstream.clone();
        let counts = counts.clone();
        connections.spawn(async move {
            client.set_nodelay(true).ok();
            match upstream {
                Upstream::Tcp(host, port) => {
                    if let Ok(server) = TcpStream::connect((host.as_str(), port)).await {
                        server.set_nodelay(true).ok();
                        relay(client, server, counts).await;
                    }
                }
                Upstream::Unix(path) => {
                    if let Ok(server) = UnixStream::connect(path).await {
                        relay(client, server, counts).await;
                    }
                }
            }
        });
        while connections.try_join_next().is_some() {}
    }
}

/// Copies bytes both ways, counting a round trip each time the client sends a message
/// that executes something after the server has spoken (and at its first send).
async fn relay<S>(client: TcpStream, server: S, counts: Arc<Counts>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let answered = Arc::new(AtomicBool::new(true));
    let heard = answered.clone();
    let up = async move {
        let mut buf = vec![0; 64 * 1024];
        let mut messages = Messages::default();
        // Whether the current burst made a round trip that executes something.
        let mut executes = false;
        loop {
            match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if answered.swap(false, Ordering::SeqCst) {
                        executes = false;
                        counts.idle.fetch_add(1, Ordering::SeqCst);
                    }
                    if !executes && messages.read(&buf[..n]) {
                        executes = true;
                        counts.idle.fetch_sub(1, Ordering::SeqCst);
                        counts.trips.fetch_add(1, Ordering::SeqCst);
                    }
                    if server_write.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        server_write.shutdown().await.ok();
    };
    let down = async move {
        let mut buf = vec![0; 64 * 1024];
        loop {
            match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    heard.store(true, Ordering::SeqCst);
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        client_write.shutdown().await.ok();
    };
    tokio::join!(up, down);
}

/// The frontend messages of one connection, read as they arrive.
#[derive(Default)]
struct Messages {
    pending: Vec<u8>,
    /// Past the startup message: every message has a type byte.
    started: bool,
}

impl Messages {
    /// Reads `bytes`; whether a complete message among them executes something: any
    /// message but a connection's opening (the startup message, a password or SASL
    /// answer) and the preparation of a named statement (Parse with a name, Describe,
    /// Sync, Flush, Close).
    fn read(&mut self, bytes: &[u8]) -> bool {
        self.pending.extend_from_slice(bytes);
        let mut executes = false;
        loop {
            let typed = usize::from(self.started);
            if self.pending.len() < typed + 4 {
                break;
            }
            let len = u32::from_be_bytes(self.pending[typed..typed + 4].try_into().unwrap());
            let end = typed + len as usize;
            if self.pending.len() < end {
                break;
            }
            let message: Vec<u8> = self.pending.drain(..end).collect();
            if !self.started {
                // SSLRequest and GSSENCRequest come before the StartupMessage (3.0).
                let code = u32::from_be_bytes(message[4..8].try_into().unwrap_or_default());
                self.started = code == 196_608;
                continue;
            }
            executes |= match message[0] {
                b'P' => message.get(5) == Some(&0),
                b'p' | b'D' | b'S' | b'H' | b'C' => false,
                _ => true,
            };
        }
        executes
    }
}
