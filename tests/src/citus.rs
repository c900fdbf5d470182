//! A throwaway Citus cluster of one's own: a coordinator and its workers, each a
//! PostgreSQL made with `initdb` on a free loopback port with `shared_preload_libraries =
//! citus`, as the zero-setup runner (`tests/tools/with-postgres`) makes one node. It
//! never touches the server in `DATABASE_URL`.
//!
//! Citus is in none of the package registries: `.ci/run` builds it from the vendored
//! source and installs it into this machine's PostgreSQL. Where it is not installed,
//! [`Citus::start`] prints one line saying the test was skipped and how to enable it, and
//! answers `None`; with `IDEM_REQUIRE_CITUS=1` (which `.ci/run` sets) it panics instead,
//! so that CI never skips these tests silently.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection};

use crate::pooler::{free_port, running_as_root};

/// The variable that turns a skip into a failure.
pub const REQUIRE_CITUS: &str = "IDEM_REQUIRE_CITUS";

/// One cluster at a time per test binary: three PostgreSQL servers per test on a shared
/// two-core machine are enough.
static TURN: Mutex<()> = Mutex::new(());

/// A running cluster: a coordinator and `workers`, stopped and removed on drop.
#[derive(Debug)]
pub struct Citus {
    /// The coordinator, the node clients connect to.
    pub coordinator: Node,
    /// The workers, which hold the shards.
    pub workers: Vec<Node>,
    _turn: MutexGuard<'static, ()>,
}

/// One PostgreSQL server of the cluster.
#[derive(Debug)]
pub struct Node {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    bindir: PathBuf,
    child: Child,
}

impl Citus {
    /// Starts a coordinator and `workers` workers, with the `citus` extension created in
    /// their `postgres` database and the workers registered. `None`, after one line on
    /// stderr, when Citus is not installed and `IDEM_REQUIRE_CITUS` is not `1`.
    pub async fn start(test: &str, workers: usize) -> Option<Self> {
        let bindir = match installed() {
            Ok(bindir) => bindir,
            Err(missing) => {
                let required = std::env::var(REQUIRE_CITUS).is_ok_and(|v| v == "1");
                let how = "build and install Citus from its vendored source as .ci/run does \
                           (the guide's \"Topologies\", \"Distributed PostgreSQL (Citus)\")";
                assert!(
                    !required,
                    "{test}: {missing}; {REQUIRE_CITUS}=1 requires it: {how}"
                );
                eprintln!(
                    "skipped {test}: {missing}; to run it, {how}, or set {REQUIRE_CITUS}=1 to \
                     make this a failure"
                );
                return None;
            }
        };
        let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // initdb is most of a start: the nodes are made side by side.
        let nodes: Vec<Node> = std::thread::scope(|scope| {
            let made: Vec<_> = (0..=workers)
                .map(|_| scope.spawn(|| Node::start(&bindir, "citus,pg_stat_statements")))
                .collect();
            made.into_iter()
                .map(|node| node.join().expect("start a node"))
                .collect()
        });
        let mut nodes = nodes.into_iter();
        let coordinator = nodes.next().expect("a coordinator");
        let cluster = Self {
            coordinator,
            workers: nodes.collect(),
            _turn: turn,
        };
        for node in std::iter::once(&cluster.coordinator).chain(&cluster.workers) {
            node.run("CREATE EXTENSION IF NOT EXISTS citus").await;
        }
        cluster
            .coordinator
            .run(&format!(
                "SELECT citus_set_coordinator_host('127.0.0.1', {})",
                cluster.coordinator.port
            ))
            .await;
        for worker in &cluster.workers {
            cluster
                .coordinator
                .run(&format!(
                    "SELECT citus_add_node('127.0.0.1', {})",
                    worker.port
                ))
                .await;
        }
        Some(cluster)
    }

    /// Options that connect to the coordinator's `postgres` database.
    pub fn options(&self) -> PgConnectOptions {
        self.coordinator.options()
    }

    /// The coordinator's `postgres` database as a URL, for processes of their own.
    pub fn url(&self) -> String {
        self.coordinator.url()
    }
}

impl Node {
    /// A plain PostgreSQL of the same kind, without Citus (with `pg_stat_statements`
    /// loaded), for measuring what one node does; `None` as for [`Citus::start`] when the
    /// binaries are missing. Stopped and removed on drop.
    pub fn plain() -> Option<Self> {
        let bindir = bindir().ok()?;
        Some(Self::start(&bindir, "pg_stat_statements"))
    }

    fn start(bindir: &Path, libraries: &str) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("idem-citus-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the node's directory");
        if running_as_root() {
            // PostgreSQL refuses to run as root: the node belongs to the postgres user.
            let status = Command::new("chown")
                .args(["postgres"])
                .arg(&dir)
                .status()
                .expect("run chown");
            assert!(status.success(), "chown postgres {}", dir.display());
        }
        let data = dir.join("data");
        let initdb = as_postgres(&bindir.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(
            initdb.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&initdb.stderr)
        );
        let log = std::fs::File::create(dir.join("postgres.log")).expect("create the log");
        if running_as_root() {
            let _ = Command::new("chown")
                .arg("postgres")
                .arg(dir.join("postgres.log"))
                .status();
        }
        let child = as_postgres(&bindir.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(&dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                &format!("shared_preload_libraries={libraries}"),
                "-c",
                "max_connections=300",
                "-c",
                "max_prepared_transactions=300",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "pg_stat_statements.track=all",
                // Two-phase commits stay in pg_dist_transaction for the tests to count.
                "-c",
                "citus.recover_2pc_interval=-1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start postgres");
        let mut node = Self {
            port,
            dir,
            bindir: bindir.to_owned(),
            child,
        };
        node.wait_ready();
        node
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new(self.bindir.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "a Citus node exited at start ({status}); its log:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "a Citus node does not answer on port {} after 30 s; its log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the node logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    /// Options that connect to the node's `postgres` database.
    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .disable_statement_logging()
    }

    /// The node's `postgres` database as a URL.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs `sql` (by the simple protocol, so several statements at once) on a connection
    /// of its own, panicking with the node's answer when it fails.
    pub async fn run(&self, sql: &str) {
        let mut conn = PgConnection::connect_with(&self.options())
            .await
            .unwrap_or_else(|e| panic!("connect to the node on port {}: {e}", self.port));
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        conn.close().await.ok();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = as_postgres(&self.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "-t", "10", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `program`, run as the postgres user when this process is root.
fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// `pg_config --<flag>` of the installation `pg_config` (or `PG_CONFIG`) names, as for
/// the zero-setup runner.
fn pg_config(flag: &str) -> Option<PathBuf> {
    let pg_config = std::env::var_os("PG_CONFIG").unwrap_or_else(|| "pg_config".into());
    let output = Command::new(&pg_config).arg(flag).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    Some(PathBuf::from(text.trim())).filter(|p| output.status.success() && p.is_dir())
}

/// The installation's binaries, or what is missing.
fn bindir() -> Result<PathBuf, String> {
    let bindir = pg_config("--bindir").ok_or("no PostgreSQL installation found (pg_config)")?;
    if !bindir.join("initdb").is_file() {
        return Err(format!("no initdb in {}", bindir.display()));
    }
    Ok(bindir)
}

/// The PostgreSQL binaries of an installation that has Citus, or what is missing.
fn installed() -> Result<PathBuf, String> {
    let bindir = bindir()?;
    let (Some(libdir), Some(sharedir)) = (pg_config("--pkglibdir"), pg_config("--sharedir")) else {
        return Err("no PostgreSQL installation found (pg_config)".into());
    };
    let library = libdir.join("citus.so");
    let control = sharedir.join("extension/citus.control");
    if !library.is_file() || !control.is_file() {
        return Err(format!(
            "the Citus extension is not installed in this PostgreSQL ({} or {} is missing)",
            library.display(),
            control.display()
        ));
    }
    Ok(bindir)
}
