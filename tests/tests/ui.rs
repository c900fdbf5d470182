//! The macro's compile-time guard rails: every misuse of `#[idempotent]` fails to build
//! with a clear message on the user's token (`ui/fail`), every supported form builds
//! (`ui/pass`). Regenerate snapshots with `TRYBUILD=overwrite` and read the diff.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("ui/pass/*.rs");
    cases.compile_fail("ui/fail/*.rs");
}
