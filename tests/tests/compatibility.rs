//! The compatibility promise (README, "Supported versions"), held: a throwaway crate made
//! of exactly the guide's `Cargo.toml`, `src/main.rs`, `src/bin/events.rs` and
//! `src/bin/steps.rs` (read from its chapters by their markers, so they cannot drift),
//! with idem from this checkout and no lockfile, so cargo resolves the newest releases
//! the stated ranges allow. It must build, the service of `main.rs` serve and replay a
//! retry, and the one of `steps.rs` call a processor once for a charge and its retry.
//! The day a new axum, sqlx, tokio, async-nats or reqwest release breaks the promise,
//! this test says so.
//!
//! Needs crates.io (the newest releases are the point). Its build directory is kept in
//! `target/compatibility`, so a later run only rebuilds what a new release changed.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem_tests::{with_test_db, ProcessorServer, TestDb};

mod docs;

use docs::{program, PROGRAMS, README};

/// The guide's dependency on idem, as published: the package `idem-axum` under the name
/// `idem`. Its version requirement gets this checkout's path beside it.
const GUIDE_IDEM: &str = r#"idem = { package = "idem-axum", version = "0.1""#;

/// The first ```rust block of the README, the one a reader meets first.
fn first_rust_example() -> &'static str {
    let start = README.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let end = README[start..].find("\n```").expect("its end");
    &README[start..=start + end]
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_owned()
}

#[test]
fn the_first_example_is_part_of_the_program_the_suite_builds() {
    let main = program("src/main.rs");
    let first = first_rust_example();
    assert!(
        main.contains(first),
        "the README's first example is not in the guide's `main.rs`, so it is not compiled:\n{first}"
    );
    let manifest = program("Cargo.toml");
    assert!(
        manifest.contains(GUIDE_IDEM),
        "the guide's Cargo.toml does not depend on idem as {GUIDE_IDEM}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guides_new_service_builds_with_the_newest_releases_and_serves() {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir =
        std::env::temp_dir().join(format!("idem-compatibility-{}-{nanos}", std::process::id()));
    let idem = workspace().join("idem-runtime");
    let idem = idem.to_str().expect("a UTF-8 checkout path");
    for file in PROGRAMS {
        let text = program(file);
        let text = if file == "Cargo.toml" {
            // `path` beside `version`: cargo also checks that the checkout's version
            // meets the guide's requirement.
            text.replace(
                GUIDE_IDEM,
                &GUIDE_IDEM.replace("version", &format!("path = {idem:?}, version")),
            )
        } else {
            text.to_owned()
        };
        let path = dir.join(file);
        std::fs::create_dir_all(path.parent().expect("a directory")).unwrap();
        std::fs::write(path, text).unwrap();
    }

    let target = workspace().join("target/compatibility");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let dir_for_build = dir.clone();
    let target_for_build = target.clone();
    let build = tokio::task::spawn_blocking(move || {
        Command::new(cargo)
            .args(["build", "--quiet"])
            .current_dir(&dir_for_build)
            .env("CARGO_TARGET_DIR", &target_for_build)
            // The outer `cargo test`'s settings are not a new service's.
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_BUILD_TARGET_DIR")
            .stdout(Stdio::inherit())
            .output()
    })
    .await
    .unwrap()
    .expect("run cargo");
    let lockfile = std::fs::read_to_string(dir.join("Cargo.lock")).unwrap_or_default();
    assert!(
        build.status.success(),
        "the guide's service does not build with today's releases:\n{}\nresolved:\n{}",
        String::from_utf8_lossy(&build.stderr),
        resolved(&lockfile)
    );
    eprintln!("built with: {}", resolved(&lockfile));

    with_test_db(async |db| {
        let (mut service, addr) = start(&target.join("debug/charges-service"), db, &[]).await;
        let client = reqwest::Client::new();
        let post = |description: &'static str| {
            client
                .post(format!("http://{addr}/charges"))
                .header("idempotency-key", "compat-1")
                .json(&serde_json::json!({
                    "amount": 1000, "currency": "usd", "customer": "cus_42",
                    "description": description,
                }))
                .send()
        };
        let first = post("first").await.unwrap();
        assert_eq!(first.status(), 201);
        assert!(first.headers().get("idempotent-replayed").is_none());
        let first_body = first.text().await.unwrap();
        // Another description is not in `fields`: the retry replays.
        let retry = post("second").await.unwrap();
        assert_eq!(retry.status(), 201);
        assert_eq!(replayed(&retry), Some(&b"true"[..]));
        assert_eq!(retry.text().await.unwrap(), first_body);
        service.kill().unwrap();
        service.wait().unwrap();

        // `steps.rs`, as its chapter runs it: a charge made at a processor once, its
        // retry answered from the stored response without a second call.
        let processor = ProcessorServer::start().await;
        let url = processor.url();
        let (mut service, addr) =
            start(&target.join("debug/steps"), db, &[("PROCESSOR_URL", &url)]).await;
        let post = || {
            client
                .post(format!("http://{addr}/charges"))
                .header("idempotency-key", "compat-steps-1")
                .json(
                    &serde_json::json!({ "amount": 1000, "currency": "usd", "customer": "cus_42" }),
                )
                .send()
        };
        let first = post().await.unwrap();
        assert_eq!(first.status(), 201);
        let first_body = first.text().await.unwrap();
        let charge: serde_json::Value = serde_json::from_str(&first_body).unwrap();
        assert!(
            charge["processor_id"]
                .as_str()
                .is_some_and(|id| id.starts_with("ch_")),
            "the processor's id in the charge: {first_body}"
        );
        let retry = post().await.unwrap();
        assert_eq!(retry.status(), 201);
        assert_eq!(replayed(&retry), Some(&b"true"[..]));
        assert_eq!(retry.text().await.unwrap(), first_body);
        assert_eq!(
            processor.processor.total(),
            1,
            "one call for the charge and its retry"
        );
        service.kill().unwrap();
        service.wait().unwrap();
    })
    .await;
    std::fs::remove_dir_all(&dir).ok();
}

/// Starts a built program of the new service on `db` and a free port, with `env`, and
/// waits until it listens.
async fn start(binary: &Path, db: &TestDb, env: &[(&str, &str)]) -> (Child, SocketAddr) {
    let addr = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    let mut service = Command::new(binary)
        .env("DATABASE_URL", db.url())
        .env("BIND_ADDR", addr.to_string())
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            service.try_wait().unwrap().is_none(),
            "the guide's {} stopped at start",
            binary.display()
        );
        assert!(
            Instant::now() < deadline,
            "{} does not listen",
            binary.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (service, addr)
}

/// The `Idempotent-Replayed` header's value.
fn replayed(response: &reqwest::Response) -> Option<&[u8]> {
    response
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.as_bytes())
}

/// The versions of the crates the promise is about, from a lockfile.
fn resolved(lockfile: &str) -> String {
    let mut found = Vec::new();
    let mut name = "";
    for line in lockfile.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = n.trim_matches('"');
        } else if let Some(version) = line.strip_prefix("version = ") {
            if [
                "axum",
                "sqlx",
                "tokio",
                "serde",
                "utoipa",
                "async-nats",
                "reqwest",
            ]
            .contains(&name)
            {
                found.push(format!("{name} {}", version.trim_matches('"')));
            }
        }
    }
    found.join(", ")
}
