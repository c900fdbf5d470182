//! The macro's compile-time guard rails: every misuse of `#[idempotent]` fails to build
//! with a clear message on the user's token (`ui/fail`), every supported form builds
//! (`ui/pass`). Regenerate snapshots with `TRYBUILD=overwrite` and read the diff.

use std::io::Write;
use std::process::Command;

/// The stable rustc, `major.minor`, that the `ui/fail` snapshots were recorded with.
/// They hold rustc's own wording, which changes between releases, so they are compared
/// on that toolchain only; update this when regenerating them on another.
const SNAPSHOTS_RUSTC: &str = "1.95";

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("ui/pass/*.rs");
    let rustc = rustc_version();
    let rustc = rustc.as_deref().unwrap_or("of unknown version");
    let overwrite = std::env::var_os("TRYBUILD").is_some_and(|v| v == "overwrite");
    let note_after = if is_snapshots_rustc(rustc) {
        cases.compile_fail("ui/fail/*.rs");
        None
    } else if overwrite {
        cases.compile_fail("ui/fail/*.rs");
        Some(format!(
            "ui/fail snapshots written by rustc {rustc}: set SNAPSHOTS_RUSTC in tests/tests/ui.rs to match"
        ))
    } else {
        Some(format!(
            "ui/fail skipped: its snapshots hold stable rustc {SNAPSHOTS_RUSTC}'s wording, and this is rustc {rustc}"
        ))
    };
    // trybuild runs the cases when dropped: the note follows its report.
    drop(cases);
    if let Some(message) = note_after {
        note(&message);
    }
}

/// The running rustc's version, `1.95.0` or `1.96.0-nightly`. Cargo, and so trybuild,
/// runs `$RUSTC` when it is set.
fn rustc_version() -> Option<String> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let output = Command::new(rustc).arg("--version").output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    text.split_whitespace().nth(1).map(str::to_owned)
}

/// Whether `version` is a stable release of [`SNAPSHOTS_RUSTC`], such as `1.95.0`; a
/// beta or nightly of it (`1.95.0-beta.3`) may word things differently.
fn is_snapshots_rustc(version: &str) -> bool {
    version
        .strip_prefix(SNAPSHOTS_RUSTC)
        .and_then(|rest| rest.strip_prefix('.'))
        .is_some_and(|patch| !patch.is_empty() && patch.bytes().all(|b| b.is_ascii_digit()))
}

/// Written to stderr itself, not through `eprintln!`, which the test harness captures:
/// a skipped check must be seen.
fn note(message: &str) {
    let _ = writeln!(std::io::stderr(), "note: {message}");
}

#[test]
fn snapshots_are_compared_on_their_stable_release_only() {
    for same in [".0", ".12"] {
        assert!(is_snapshots_rustc(&format!("{SNAPSHOTS_RUSTC}{same}")));
    }
    for other in ["0.0", ".0-beta.3", ".0-nightly", ".", ""] {
        assert!(!is_snapshots_rustc(&format!("{SNAPSHOTS_RUSTC}{other}")));
    }
    assert!(!is_snapshots_rustc("of unknown version"));
}
