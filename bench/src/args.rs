//! The command line of the benches that are binaries of their own (`--bin outbox`,
//! `--bin claim`): `--name value` pairs, read where they are needed.

/// The value after `name` on the command line.
pub(crate) fn value_of(name: &str) -> Option<String> {
    let mut args = std::env::args().skip_while(|a| a != name);
    args.next()?;
    args.next()
}

/// The number after `name`, else `default`.
pub(crate) fn arg(name: &str, default: u64) -> u64 {
    value_of(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A comma-separated list of numbers after `name`, else `default`.
pub(crate) fn list(name: &str, default: &[i64]) -> Vec<i64> {
    value_of(name).map_or_else(
        || default.to_vec(),
        |v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
    )
}

/// Whether `name` is on the command line.
pub(crate) fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}
