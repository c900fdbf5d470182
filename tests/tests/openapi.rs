//! The example against its own OpenAPI document, fuzzed by schemathesis (PyPI): every
//! operation, with generated valid and invalid requests, must answer without a 5xx and
//! with a status, content type, headers and body the document declares. What
//! `#[idempotent]` adds to each operation (the key header, the problem responses,
//! `Retry-After`, `Idempotent-Replayed`) is part of what is checked.
//!
//! Bounded for the suite (a fixed seed, a few dozen examples per operation);
//! `SCHEMATHESIS_SEED` and `SCHEMATHESIS_MAX_EXAMPLES` make a longer or another run.

use std::process::Command;

use charges::Config;
use idem_tests::{schemathesis, with_test_db, TestApp};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_answers_as_its_document_says() {
    let schemathesis = schemathesis();
    with_test_db(async |db| {
        let s = TestApp::charges(db, 20, Config::default()).await;
        let seed = std::env::var("SCHEMATHESIS_SEED").unwrap_or_else(|_| "20261123".into());
        let examples = std::env::var("SCHEMATHESIS_MAX_EXAMPLES").unwrap_or_else(|_| "40".into());
        // Its example database and reports go to a directory of its own.
        let work = std::env::temp_dir().join(format!("idem-schemathesis-{}", db.name));
        std::fs::create_dir_all(&work).unwrap();
        let mut command = Command::new(schemathesis);
        command
            .current_dir(&work)
            .arg("run")
            .arg(s.url("/openapi.json"))
            .args([
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,\
                 response_headers_conformance,response_schema_conformance",
                "--header",
                "Authorization: Bearer acct_schemathesis",
                "--max-examples",
                &examples,
                "--seed",
                &seed,
                "--workers",
                "2",
                "--generation-database",
                "none",
                "--no-color",
            ]);
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .expect("schemathesis runs");
        std::fs::remove_dir_all(&work).ok();
        let report = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "schemathesis found answers the document does not allow:\n{report}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        // It reached the service: every operation was tested, and requests got through.
        assert!(report.contains("Tested: 6"), "{report}");
        assert!(
            s.keys().await > 0,
            "no request got past validation:\n{report}"
        );
    })
    .await;
}
