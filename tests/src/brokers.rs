//! The outbox's brokers: the shared NATS (JetStream) and RabbitMQ servers of the machine
//! (`NATS_URL`, `AMQP_URL`), names no other test uses on them, and a `nats-server` of a
//! test's own, for tests that stop and restart their broker.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `NATS_URL`, or the machine's NATS with JetStream.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// `AMQP_URL`, or the machine's RabbitMQ as guest.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A name no other test, process or run uses: `prefix_<pid>_<n>_<nanos>`, of letters,
/// digits and `_` (a JetStream stream name, a subject token, a queue name).
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Where Debian installs the NATS server (outside a non-root `PATH`).
const SYSTEM_NATS: &str = "/usr/sbin/nats-server";

/// A `nats-server -js` of one's own, on a free loopback port, its JetStream store in a
/// directory of its own that outlives a [`PrivateNats::stop`], so that a restart finds
/// its streams. Killed, and its directory removed, on drop.
#[derive(Debug)]
pub struct PrivateNats {
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl PrivateNats {
    /// Starts one and waits until it accepts connections.
    pub fn start() -> Self {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("find a free port")
            .port();
        let dir = std::env::temp_dir().join(unique("idem-nats"));
        std::fs::create_dir_all(&dir).expect("create nats-server's directory");
        let mut nats = Self {
            port,
            dir,
            child: None,
        };
        nats.restart();
        nats
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills it (SIGKILL): what was not yet stored is lost to it, what was is kept.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().ok();
            child.wait().ok();
        }
    }

    /// Starts it again on the same port and store, and waits until it answers.
    pub fn restart(&mut self) {
        self.stop();
        let program = which("nats-server").unwrap_or_else(|| SYSTEM_NATS.into());
        let child = Command::new(&program)
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {program:?} ({e}): install nats-server (apt-get install nats-server)")
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.stop();
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    })
}
