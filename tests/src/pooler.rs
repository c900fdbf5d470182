//! A PgBouncer of one's own in front of a test database, in transaction mode: consecutive
//! transactions of one client connection run on whichever server connection is free, as
//! in the production topologies idem's `Pooler::Transaction` is for.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection};

use crate::TestDb;

/// How many server connections PgBouncer opens to the test database: few, so that the
/// clients of a test really take turns on them.
pub const SERVER_CONNECTIONS: u32 = 4;

/// Where Debian and most distributions install PgBouncer (outside a non-root `PATH`).
const SYSTEM_PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// A `pgbouncer` process in front of one [`TestDb`], in `pool_mode = transaction` with
/// [`SERVER_CONNECTIONS`] server connections, listening on a free loopback port, with its
/// files (`pgbouncer.ini`, `userlist.txt`, `pgbouncer.log`) in a directory of its own.
/// Killed and its directory removed on drop.
#[derive(Debug)]
pub struct Pgbouncer {
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
    database: String,
    user: String,
    dir: PathBuf,
    child: Child,
}

impl Pgbouncer {
    /// Starts PgBouncer in front of `db` and waits until it accepts connections.
    ///
    /// Panics, saying how to install it, when `pgbouncer` is not installed. PgBouncer
    /// refuses to run as root: as root, it is started with `-u postgres` and its
    /// directory is made that user's to read and write.
    pub fn start(db: &TestDb) -> Self {
        Self::start_sized(db, SERVER_CONNECTIONS)
    }

    /// [`Pgbouncer::start`] with `server_connections` server connections instead of
    /// [`SERVER_CONNECTIONS`]: for a benchmark, whose clients should not queue on four.
    pub fn start_sized(db: &TestDb, server_connections: u32) -> Self {
        let program = find_pgbouncer();
        let version = version(&program);
        let server = &db.options;
        let user = server.get_username().to_owned();
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("idem-pgbouncer-{}-{port}", db.name));
        std::fs::create_dir_all(&dir).expect("create pgbouncer's directory");

        let mut target = format!(
            "host={} port={} dbname={} user={user}",
            server.get_host(),
            server.get_port(),
            db.name
        );
        if let Some(password) = db_password(db) {
            write!(target, " password={password}").unwrap();
        }
        let mut ini = format!(
            "[databases]\n\
             {name} = {target}\n\
             \n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             admin_users = {user}\n\
             pool_mode = transaction\n\
             default_pool_size = {server_connections}\n\
             min_pool_size = 0\n\
             reserve_pool_size = 0\n\
             max_client_conn = 500\n\
             ; sqlx sends it at startup; PgBouncer does not track it.\n\
             ignore_startup_parameters = extra_float_digits\n\
             server_login_retry = 1\n\
             query_wait_timeout = 20\n\
             logfile = {dir}/pgbouncer.log\n\
             log_connections = 0\n\
             log_disconnections = 0\n",
            name = db.name,
            dir = dir.display(),
        );
        // From 1.21 on, PgBouncer can track named prepared statements itself (and does by
        // default from 1.22); off, so that every version shows what a plain transaction
        // pooler does with them.
        if version >= (1, 21) {
            ini.push_str("max_prepared_statements = 0\n");
        }
        std::fs::write(dir.join("pgbouncer.ini"), ini).expect("write pgbouncer.ini");
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n"))
            .expect("write userlist.txt");

        let mut command = Command::new(&program);
        if running_as_root() {
            // Its files must be readable, and its log writable, by that user.
            for (file, mode) in [
                ("", 0o777),
                ("pgbouncer.ini", 0o644),
                ("userlist.txt", 0o644),
            ] {
                std::fs::set_permissions(dir.join(file), std::fs::Permissions::from_mode(mode))
                    .expect("open pgbouncer's directory to the postgres user");
            }
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        let mut bouncer = Self {
            port,
            database: db.name.clone(),
            user,
            dir,
            child,
        };
        bouncer.wait_until_listening();
        bouncer
    }

    /// Options that connect to the test database through PgBouncer.
    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username(&self.user)
            .database(&self.database)
            .disable_statement_logging()
    }

    /// A store through this PgBouncer, as the guide's "Behind a transaction pooler" says to build one: a pool of
    /// `connections` with no statement cache, `Pooler::Transaction`. Not migrated.
    pub async fn store(&self, connections: u32) -> idem::Store {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(connections)
            .connect_with(self.options().statement_cache_capacity(0))
            .await
            .expect("connect through PgBouncer");
        idem::Store::builder(pool)
            .pooler(idem::Pooler::Transaction)
            .build()
            .expect("a store behind a transaction pooler")
    }

    /// A URL of the test database through PgBouncer, for processes of their own (trust
    /// authentication: no password).
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{}",
            self.user, self.port, self.database
        )
    }

    /// Runs `command` on PgBouncer's admin console (`SHOW POOLS`, `RECONNECT`, `KILL`,
    /// `RESUME` ...), which speaks only the simple query protocol.
    pub async fn admin(&self, command: &str) -> Result<(), sqlx::Error> {
        let mut console = PgConnection::connect_with(&self.options().database("pgbouncer")).await?;
        sqlx::raw_sql(AssertSqlSafe(command))
            .execute(&mut console)
            .await?;
        console.close().await
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn wait_until_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_ok() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "pgbouncer exited at start ({status}); its log:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer does not listen on port {} after 10 s; its log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Pgbouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `pgbouncer` program: on `PATH`, or where Debian puts it.
fn find_pgbouncer() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("pgbouncer"))
            .find(|program| program.is_file())
    });
    on_path
        .or_else(|| Some(PathBuf::from(SYSTEM_PGBOUNCER)).filter(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "pgbouncer is not installed (not on PATH, nor at {SYSTEM_PGBOUNCER}): the \
                 pooler tests run the charges example through it; install it with \
                 `apt-get install pgbouncer` (.ci/run does)"
            )
        })
}

/// PgBouncer's version, as (major, minor), from `pgbouncer --version`
/// ("PgBouncer 1.18.0").
fn version(program: &Path) -> (u32, u32) {
    let output = Command::new(program)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} --version: {e}", program.display()));
    let text = String::from_utf8_lossy(&output.stdout);
    let parsed = text.split_whitespace().nth(1).and_then(|v| {
        let mut parts = v.split('.').map(str::parse::<u32>);
        Some((parts.next()?.ok()?, parts.next()?.ok()?))
    });
    parsed.unwrap_or_else(|| panic!("unexpected `pgbouncer --version` output: {text:?}"))
}

/// A port nobody listens on now.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .expect("find a free port")
        .port()
}

/// Whether this process runs as root (the owner of `/proc/self` is the effective user).
pub(crate) fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The password in `DATABASE_URL`, if it has one.
fn db_password(db: &TestDb) -> Option<String> {
    let url = reqwest::Url::parse(&db.url()).ok()?;
    url.password().map(str::to_owned)
}
