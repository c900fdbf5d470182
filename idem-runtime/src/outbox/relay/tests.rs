use super::running::{backoff, random_u64};
use super::*;

#[test]
fn backoff_doubles_up_to_its_cap() {
    let b = (Duration::from_millis(500), Duration::from_secs(5));
    assert_eq!(backoff(b, 1), Duration::from_millis(500));
    assert_eq!(backoff(b, 2), Duration::from_secs(1));
    assert_eq!(backoff(b, 4), Duration::from_secs(4));
    assert_eq!(backoff(b, 5), Duration::from_secs(5));
    assert_eq!(backoff(b, u32::MAX), Duration::from_secs(5));
}

/// Regression (issue 27, finding 11): the defaults (lease 30 s, backoff up to 5 min)
/// let a copy arrive after JetStream's default duplicate window (2 min), against the
/// guide's own rule ("The outbox and its consumers", "Broker settings").
#[test]
fn the_defaults_keep_copies_inside_jetstreams_default_window() {
    let needed = DEFAULT_LEASE + DEFAULT_PUBLISH_TIMEOUT + DEFAULT_BACKOFF.1;
    assert!(needed <= Duration::from_secs(120), "{needed:?}");
    assert!(DEFAULT_PUBLISH_TIMEOUT < DEFAULT_LEASE);
}

#[test]
fn a_sessions_name_names_the_process_within_63_bytes() {
    let name = super::session_name();
    assert!(name.starts_with("idem relay "), "{name}");
    assert!(
        name.ends_with(&format!(" pid {}", std::process::id())),
        "{name}"
    );
    assert!(name.len() <= 63, "{name}");
}

#[test]
fn random_draws_differ() {
    let draws: std::collections::HashSet<u64> = (0..1000).map(|_| random_u64()).collect();
    assert_eq!(draws.len(), 1000);
}
