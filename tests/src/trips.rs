//! A proxy in front of PostgreSQL (or PgBouncer) that counts client round trips: the
//! times a client sends after the server has answered, on each connection. A client
//! that sends several messages before it waits (a pipeline, or a simple-protocol query
//! of several statements) makes one round trip; one that waits for each makes one per
//! message. This is what a request costs on a real network, and unlike a timing it is
//! the same on a quiet machine and a busy one.
//!
//! A round trip that executes nothing is counted apart ([`RoundTrips::idle`]): the
//! preparation of a named statement (Parse with a name, Describe, Sync), a connection's
//! one-time cost, not a request's, which depends on which of a pool's connections a
//! request got; and sqlx's ping of a connection given back to its pool (a Sync alone),
//! which happens after the answer. Parsing an unnamed statement is every execution's
//! cost (behind a transaction pooler), and counts as a round trip.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The proxy; stops when dropped.
pub struct RoundTrips {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Counts {
    trips: AtomicU64,
    idle: AtomicU64,
}

impl RoundTrips {
    /// A proxy on a free loopback port in front of the server `upstream` connects to
    /// (TCP, or a Unix socket directory as the host).
    pub async fn start(upstream: &PgConnectOptions) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let counts = Arc::new(Counts::default());
        let host = upstream.get_host().to_owned();
        let port = upstream.get_port();
        let counted = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let trips = counted.clone();
                let host = host.clone();
                tokio::spawn(async move {
                    if host.starts_with('/') {
                        let path = format!("{host}/.s.PGSQL.{port}");
                        if let Ok(server) = tokio::net::UnixStream::connect(path).await {
                            relay(client, server, trips).await;
                        }
                    } else if let Ok(server) = TcpStream::connect((host.as_str(), port)).await {
                        let _ = server.set_nodelay(true);
                        relay(client, server, trips).await;
                    }
                });
            }
        });
        Self { addr, counts, task }
    }

    /// `options` pointed at the proxy.
    pub fn options(&self, options: PgConnectOptions) -> PgConnectOptions {
        options.host("127.0.0.1").port(self.addr.port())
    }

    /// The round trips counted so far, over every connection, but those that execute
    /// nothing.
    pub fn count(&self) -> u64 {
        self.counts.trips.load(Ordering::SeqCst)
    }

    /// The round trips that execute nothing: named statements prepared, connections
    /// pinged.
    pub fn idle(&self) -> u64 {
        self.counts.idle.load(Ordering::SeqCst)
    }
}

impl Drop for RoundTrips {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies bytes both ways, counting a round trip each time the client sends after the
/// server has spoken (and at the client's first send).
async fn relay<S>(client: TcpStream, server: S, counts: Arc<Counts>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let _ = client.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let answered = Arc::new(AtomicBool::new(true));
    let counts = counts.clone();
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
        let _ = server_write.shutdown().await;
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
        let _ = client_write.shutdown().await;
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
    /// message but the preparation of a named statement (Parse with a name, Describe,
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
                executes = true;
                continue;
            }
            executes |= match message[0] {
                b'P' => message.get(5) == Some(&0),
                b'D' | b'S' | b'H' | b'C' => false,
                _ => true,
            };
        }
        executes
    }
}
