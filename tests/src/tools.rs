//! The outside tools the tests check idem against, installed by `tests/tools/install`
//! under `target/test-tools` the first time a test asks (python3 with venv and npm, with
//! their registries, are all it needs; `.ci/run` runs it beforehand):
//!
//! * the providers' own signing libraries, so that deliveries are signed by them and not
//!   by idem: Standard Webhooks' `standardwebhooks` and Slack's `slack_sdk` (PyPI),
//!   Stripe's `stripe`, GitHub's `@octokit/webhooks-methods` and Shopify's
//!   `@shopify/shopify-api` (npm);
//! * `schemathesis` (PyPI), which fuzzes a service against its OpenAPI document.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// Where the tools are, installed on first use by this process.
///
/// # Panics
/// When they cannot be installed, with the installer's output.
fn installed() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools");
        let dir = here.join("../../target/test-tools");
        let output = Command::new(here.join("install"))
            .arg(&dir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run tests/tools/install: {e}"));
        assert!(
            output.status.success(),
            "tests/tools/install failed (it needs python3 with venv, npm, and the PyPI and \
             npm registries):\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        dir
    })
}

/// The `schemathesis` command line, installed.
pub fn schemathesis() -> PathBuf {
    installed().join("venv/bin/schemathesis")
}

/// The installed signing libraries.
#[derive(Debug)]
pub struct Signers {
    dir: PathBuf,
}

impl Signers {
    /// The libraries, installed on first use by this process.
    ///
    /// # Panics
    /// When they cannot be installed, with the installer's output.
    pub fn get() -> &'static Self {
        static SIGNERS: OnceLock<Signers> = OnceLock::new();
        SIGNERS.get_or_init(|| Self {
            dir: installed().to_owned(),
        })
    }

    /// The `webhook-id`, `webhook-timestamp` and `webhook-signature` headers of a
    /// Standard Webhooks delivery, signed with each of `secrets` (`whsec_<base64>`).
    pub fn standard_webhooks(
        &self,
        secrets: &[&str],
        id: &str,
        timestamp: u64,
        body: &str,
    ) -> Vec<(String, String)> {
        self.python(
            &[
                "standard-webhooks",
                &secrets.join(","),
                id,
                &timestamp.to_string(),
            ],
            body,
        )
    }

    /// The `X-Slack-Request-Timestamp` and `X-Slack-Signature` headers `slack_sdk`'s
    /// `SignatureVerifier.generate_signature` makes.
    pub fn slack(&self, secret: &str, timestamp: u64, body: &str) -> Vec<(String, String)> {
        self.python(&["slack", secret, &timestamp.to_string()], body)
    }

    /// The `X-Shopify-Hmac-SHA256` value of `@shopify/shopify-api`'s `createSHA256HMAC`,
    /// the function its webhook validation checks with.
    pub fn shopify(&self, secret: &str, body: &str) -> String {
        self.node(&["shopify", secret], body)
    }

    /// Headers printed as a JSON object by `sign.py`.
    fn python(&self, args: &[&str], body: &str) -> Vec<(String, String)> {
        let out = run(
            Command::new(self.dir.join("venv/bin/python"))
                .arg(self.dir.join("sign.py"))
                .args(args),
            body,
        );
        let headers: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&out).expect("the signer prints a JSON object");
        headers
            .into_iter()
            .map(|(name, value)| (name, value.as_str().unwrap_or_default().to_owned()))
            .collect()
    }

    /// The `Stripe-Signature` value of a delivery made by
    /// `stripe.webhooks.generateTestHeaderString`.
    pub fn stripe(&self, secret: &str, timestamp: u64, body: &str) -> String {
        self.node(&["stripe", secret, &timestamp.to_string()], body)
    }

    /// The `X-Hub-Signature-256` value `@octokit/webhooks-methods`' `sign` makes.
    pub fn github(&self, secret: &str, body: &str) -> String {
        self.node(&["github", secret], body)
    }

    fn node(&self, args: &[&str], body: &str) -> String {
        run(
            Command::new("node")
                .arg(self.dir.join("sign.mjs"))
                .args(args),
            body,
        )
    }
}

/// Runs a signer with `body` on its standard input; its standard output.
fn run(command: &mut Command, body: &str) -> String {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(body.as_bytes())
        .expect("write the body");
    let output = child.wait_with_output().expect("the signer ends");
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8")
}
