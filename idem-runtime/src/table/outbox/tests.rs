use super::*;

#[test]
fn the_shipped_sql_is_the_default_table() {
    let table = OutboxTable::new(
        TableName::parse(DEFAULT_OUTBOX_TABLE).unwrap(),
        Dialect::default(),
        true,
        Duration::ZERO,
    );
    assert_eq!(table.ddl().as_str(), OUTBOX_SCHEMA_SQL);
}

/// The relay's statements keep to SQL a distributed engine runs (invariant 5): no
/// row-lock clauses, and in portable mode no NOTIFY and no advisory lock.
#[test]
fn statements_stay_portable() {
    let dialect = Dialect {
        portable: true,
        ..Dialect::default()
    };
    let table = OutboxTable::new(
        TableName::parse("ops.events").unwrap(),
        dialect,
        true,
        Duration::ZERO,
    );
    for statement in [
        &table.write,
        &table.claim,
        &table.done,
        &table.release,
        &table.failed,
        &table.errors,
        &table.lag,
    ] {
        let lower = statement.as_str().to_lowercase();
        for exotic in ["for update", "skip locked", "notify", "advisory", "xmin"] {
            assert!(!lower.contains(exotic), "{exotic:?} in: {lower}");
        }
        assert!(!lower.contains('{'), "unrendered: {lower}");
        assert!(lower.contains("\"ops\".\"events\""), "{lower}");
    }
    assert!(!table.can_listen());
    assert!(!table.can_tie());
    let table = OutboxTable::new(
        TableName::parse("ops.events").unwrap(),
        Dialect::default(),
        true,
        Duration::ZERO,
    );
    assert!(table.write.as_str().contains("pg_notify('ops.events', '')"));
    assert!(table.can_listen());
    assert!(table.can_tie());
    let class = lock_class(&TableName::parse("ops.events").unwrap());
    assert!(class >= 0);
    assert!(table
        .claim
        .as_str()
        .contains(&format!("l.classid = {class}::oid")));
    assert!(table
        .lock
        .as_str()
        .contains(&format!("pg_try_advisory_lock({class}, $1)")));
    let table = OutboxTable::new(
        TableName::parse("ops.events").unwrap(),
        Dialect::default(),
        false,
        Duration::ZERO,
    );
    assert!(!table.write.as_str().contains("notify"));
    assert!(!table.can_listen());
    assert!(table
        .ddl()
        .as_str()
        .contains("CREATE SCHEMA IF NOT EXISTS \"ops\";"));
}

/// Regression (issue 27, finding 7): a name the builder accepts (48 + 1 + 48
/// characters) was the NOTIFY channel, which PostgreSQL limits to 63 bytes, and every
/// write failed. A name that fits is its own channel (as before); a longer one gets a
/// channel derived from it, the same for every instance.
#[test]
fn every_channel_fits_an_identifier() {
    let short = TableName::parse("ops.events").unwrap();
    assert_eq!(channel(&short), "ops.events");
    let long_text = format!("{}.{}", "s".repeat(48), "t".repeat(48));
    let long = TableName::parse(&long_text).unwrap();
    let derived = channel(&long);
    assert!(derived.len() <= 63, "{derived}");
    assert!(derived.starts_with("idem_outbox_"), "{derived}");
    assert_eq!(derived, channel(&TableName::parse(&long_text).unwrap()));
    let other = TableName::parse(&format!("{}.{}", "s".repeat(48), "u".repeat(48))).unwrap();
    assert_ne!(channel(&other), derived);
    let table = OutboxTable::new(long, Dialect::default(), true, Duration::ZERO);
    assert!(table
        .write
        .as_str()
        .contains(&format!("pg_notify('{derived}', '')")));
    assert_eq!(table.channel(), derived);
}

/// One NOTIFY per interval: the first goes, the ones right after it do not, one goes
/// again once the interval has passed; an interval of zero lets every one go.
#[test]
fn the_wake_gate_lets_one_notify_through_per_interval() {
    let gate = WakeGate::new(Duration::from_millis(50));
    assert!(gate.open());
    assert!(!gate.open());
    assert!(!gate.open());
    std::thread::sleep(Duration::from_millis(60));
    assert!(gate.open());
    assert!(!gate.open());
    let every = WakeGate::new(Duration::ZERO);
    assert!((0..5).all(|_| every.open()));
    // Concurrent callers: exactly one of them.
    let gate = std::sync::Arc::new(WakeGate::new(Duration::from_secs(60)));
    let opened: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let gate = std::sync::Arc::clone(&gate);
                scope.spawn(move || (0..100).filter(|_| gate.open()).count())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(opened, 1);
    // No NOTIFY where writes do not notify, whatever the gate says.
    let quiet = OutboxTable::new(
        TableName::parse("ops.events").unwrap(),
        Dialect::default(),
        false,
        Duration::ZERO,
    );
    assert_eq!(quiet.wake(), None);
    let table = OutboxTable::new(
        TableName::parse("ops.events").unwrap(),
        Dialect::default(),
        true,
        Duration::from_secs(60),
    );
    assert_eq!(table.wake(), Some("SELECT pg_notify('ops.events', '')"));
    assert_eq!(table.wake(), None);
}
