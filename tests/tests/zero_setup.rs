//! Zero-setup start: with no `DATABASE_URL` and nothing answering at the default
//! address, cargo's runner (`tests/tools/with-postgres`, set in `.cargo/config.toml`)
//! gives the command a throwaway PostgreSQL made from this machine's binaries, and
//! removes it when the command ends; without binaries it stops with one line. The
//! "default address" is a port where nothing listens, through `IDEM_LOCAL_POSTGRES`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Where nothing answers.
const NOBODY: &str = "postgres://postgres@127.0.0.1:1/postgres";

fn runner() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/with-postgres")
}

/// `with-postgres` running `args`, as if no PostgreSQL were set up.
fn zero_setup(args: &[&str]) -> Command {
    let mut command = Command::new(runner());
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env("IDEM_LOCAL_POSTGRES", NOBODY);
    command
}

/// The URL and directory of the throwaway cluster, from the runner's line about it.
fn throwaway(stderr: &str) -> (String, PathBuf) {
    let line = stderr
        .lines()
        .find(|l| l.contains("using a throwaway one at"))
        .unwrap_or_else(|| panic!("no throwaway announced: {stderr}"));
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("postgres://"))
        .expect("a URL");
    let dir = line
        .split_once("(in ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .expect("a directory")
        .0;
    (url.to_owned(), PathBuf::from(dir))
}

fn answers(url: &str) -> bool {
    Command::new("psql")
        .args([url, "-Atqc", "SELECT 1"])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn a_command_gets_a_throwaway_postgres_that_is_gone_after_it() {
    let Output {
        status,
        stdout,
        stderr,
    } = zero_setup(&[
        "sh",
        "-c",
        r#"psql "$DATABASE_URL" -Atc 'SELECT current_user, 40 + 2'"#,
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&stderr);
    assert!(status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&stdout).trim(), "postgres|42");
    let (url, dir) = throwaway(&stderr);
    assert!(!answers(&url), "the throwaway server outlived its command");
    assert!(
        !dir.exists(),
        "its directory {} was not removed",
        dir.display()
    );
    // The command's own failure is passed on, and still cleaned up after.
    let failed = zero_setup(&["sh", "-c", "exit 3"]).output().unwrap();
    assert_eq!(failed.status.code(), Some(3));
}

#[test]
fn without_postgres_binaries_it_says_what_to_do() {
    let output = zero_setup(&["true"])
        .env("PG_CONFIG", "/nonexistent/pg_config")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.trim(),
        format!(
            "idem: no PostgreSQL at {NOBODY} and no PostgreSQL binaries to start one: install \
             PostgreSQL (Debian: apt-get install postgresql) or set DATABASE_URL"
        )
    );
}

/// `cargo run -p charges` on such a machine: the real service on a throwaway
/// PostgreSQL, taking a charge, then stopped with Ctrl-C, which removes the cluster.
#[test]
fn the_example_service_starts_on_a_throwaway_postgres() {
    use std::os::unix::process::CommandExt;
    let port = {
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        socket.local_addr().unwrap().port()
    };
    let mut child = zero_setup(&[env!("CARGO_BIN_EXE_charges-server")])
        .env("BIND_ADDR", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let body = r#"{"amount": 1000, "currency": "usd", "customer": "cus_1"}"#;
    let post = || {
        Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .args([
                "-H",
                "Authorization: Bearer acct_1",
                "-H",
                "Idempotency-Key: k1",
            ])
            .args(["-H", "Content-Type: application/json", "-d", body])
            .arg(format!("http://127.0.0.1:{port}/charges"))
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut answer = post();
    while answer != "201" && Instant::now() < deadline {
        assert!(child.try_wait().unwrap().is_none(), "the service stopped");
        std::thread::sleep(Duration::from_millis(100));
        answer = post();
    }
    assert_eq!(answer, "201");
    assert_eq!(post(), "201", "the retry is replayed");
    // Ctrl-C: SIGINT to the foreground process group.
    let group = format!("-{}", child.id());
    assert!(Command::new("kill")
        .args(["-INT", "--", &group])
        .status()
        .unwrap()
        .success());
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    // 130 when the runner acts on the Ctrl-C itself; 0 when the service, which shuts down
    // gracefully on it, ended first and bash let its own SIGINT go (a non-interactive
    // shell does so when its foreground command handled the signal): both are a Ctrl-C
    // that ended the command. What matters is below: the cluster went with it.
    assert!(
        matches!(status.code(), Some(0 | 130)),
        "ended by its Ctrl-C: {status:?}: {stderr}"
    );
    let (url, dir) = throwaway(&stderr);
    assert!(!answers(&url), "the throwaway server outlived the service");
    assert!(
        !dir.exists(),
        "its directory {} was not removed",
        dir.display()
    );
}
