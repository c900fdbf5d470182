use super::*;

/// Regression (issue 27, 4): every spelling PostgreSQL casts to one value is one
/// principal to idem, which hashes the text.
#[test]
fn a_principal_has_one_spelling() {
    let lower = "3f2504e0-4f89-41d3-9a0c-0305e82c3301";
    for spelling in [
        lower,
        "3F2504E0-4F89-41D3-9A0C-0305E82C3301",
        "{3f2504e0-4f89-41d3-9a0c-0305e82c3301}",
        "3F2504E04F8941D39A0C0305E82C3301",
    ] {
        assert_eq!(
            PrincipalType::Uuid.canonical(spelling).as_deref(),
            Some(lower)
        );
    }
    for spelling in ["7", "007", "+7"] {
        assert_eq!(
            PrincipalType::Bigint.canonical(spelling).as_deref(),
            Some("7")
        );
    }
    assert_eq!(
        PrincipalType::Text.canonical("Acct_1").as_deref(),
        Some("Acct_1")
    );
}

#[test]
fn principal_types_accept_what_postgres_casts() {
    let uuid = "6f1c8a52-3b7e-4a59-9a1d-2f0c5e9b7d41";
    for ok in [
        uuid,
        &uuid.to_uppercase(),
        &uuid.replace('-', ""),
        &format!("{{{uuid}}}"),
    ] {
        assert!(PrincipalType::Uuid.canonical(ok).is_some(), "{ok}");
    }
    for bad in [
        "",
        "acct_1",
        &uuid[1..],
        &format!("{uuid}0"),
        "6f1c8a52-3b7e4a59-9a1d-2f0c5e9b7d41",
        "{6f1c8a523b7e4a599a1d2f0c5e9b7d41",
    ] {
        assert!(PrincipalType::Uuid.canonical(bad).is_none(), "{bad}");
    }
    for ok in ["1", "42", "-7", "9223372036854775807"] {
        assert!(PrincipalType::Bigint.canonical(ok).is_some(), "{ok}");
    }
    for bad in ["", "4.2", "acct_1", "9223372036854775808", "0x10"] {
        assert!(PrincipalType::Bigint.canonical(bad).is_none(), "{bad}");
    }
    assert!(PrincipalType::Text.canonical("anything at all").is_some());
}

/// Regression (issue 19, 7): a resolver answering the nil UUID or 0 shared the
/// namespace of keys without a principal (global keys), and so their responses.
#[test]
fn no_principal_can_equal_the_value_of_none() {
    let nil = "00000000-0000-0000-0000-000000000000";
    for none in [nil, &nil.replace('-', ""), &format!("{{{nil}}}")] {
        assert!(PrincipalType::Uuid.canonical(none).is_none(), "{none}");
    }
    assert_eq!(PrincipalType::Uuid.bound(""), nil);
    for none in ["0", "-0", "+0", "000"] {
        assert!(PrincipalType::Bigint.canonical(none).is_none(), "{none}");
    }
    assert_eq!(PrincipalType::Bigint.bound(""), "0");
}

/// Invariant 5: the request path keeps to SQL that PostgreSQL-compatible distributed
/// engines also run: INSERT .. ON CONFLICT, SELECT, UPDATE, DELETE, and lock_timeout
/// (set through `set_config`, the function form of `SET LOCAL`). A construct outside
/// this set needs a measured reason. In portable mode there is none
/// ([`portable_sql_depends_on_no_setting`]); the default mode has one, the key's
/// advisory lock (BENCHMARKS.md, "The claim path": one row version per request, a
/// 409 without waiting, replays that write nothing), and nothing else.
#[test]
fn request_sql_stays_portable() {
    let table = Table::new(
        &TableName::default(),
        Dialect::default(),
        Duration::from_secs(3),
    );
    assert_eq!(
        Isolation::default().begin(),
        "BEGIN ISOLATION LEVEL READ COMMITTED"
    );
    let request_path = [
        &table.try_lock,
        &table.take,
        &table.wait,
        &table.insert,
        &table.overwrite,
    ];
    for statement in request_path {
        let statement = statement.as_str();
        let first = statement.split_whitespace().next().unwrap_or_default();
        assert!(
            ["WITH", "SELECT", "INSERT"].contains(&first),
            "unexpected statement: {statement}"
        );
        let lower = statement
            .to_lowercase()
            .replace("pg_try_advisory_xact_lock($1)", "")
            .replace("pg_advisory_xact_lock($1)", "");
        for exotic in [
            "pg_",
            "advisory",
            "skip locked",
            "for update",
            "xmin",
            "ctid",
            "notify",
            "listen",
            "make_interval",
        ] {
            assert!(!lower.contains(exotic), "{exotic:?} in: {statement}");
        }
        let settings: Vec<&str> = lower
            .match_indices("set_config('")
            .map(|(i, _)| &lower[i + 12..])
            .collect();
        assert!(
            settings
                .iter()
                .all(|s| s.starts_with("lock_timeout'") || s.starts_with("statement_timeout'")),
            "only lock_timeout and statement_timeout are ever set: {statement}"
        );
        assert!(!statement.contains('{'), "unrendered: {statement}");
    }
    // Only the lock is taken by a key, and only transaction-scoped: it cannot outlive
    // the request's transaction (invariant 2).
    let locks: String = request_path.iter().map(|s| s.as_str()).collect();
    assert_eq!(locks.matches("advisory").count(), 2);
    assert_eq!(locks.matches("advisory_xact_lock(").count(), 2);
    // The key's row is written by one statement, once.
    assert!(table
        .insert
        .as_str()
        .starts_with("INSERT INTO \"idempotency_keys\" ("));
    assert!(!table.insert.as_str().contains("ON CONFLICT"));
}

/// The lock of a key spreads over the `bigint` space, and depends on every part of
/// the key and on the table.
#[test]
fn keys_lock_by_their_hash() {
    let key = |scope: &'static str, principal: &str, key: &str| KeyInScope {
        scope: scope.into(),
        principal: principal.into(),
        key: crate::header::IdempotencyKey::parse(key.as_bytes()).unwrap(),
        place: crate::identity::Place::Principal,
    };
    let table = Table::new(
        &TableName::default(),
        Dialect::default(),
        Duration::from_secs(3),
    );
    let other = Table::new(
        &TableName::parse("ops.keys").unwrap(),
        Dialect::default(),
        Duration::from_secs(3),
    );
    let base = table.lock_id(&key("charges", "acct_1", "k1"));
    assert_eq!(base, table.lock_id(&key("charges", "acct_1", "k1")));
    for different in [
        table.lock_id(&key("refunds", "acct_1", "k1")),
        table.lock_id(&key("charges", "acct_2", "k1")),
        table.lock_id(&key("charges", "acct_1", "k2")),
        // Length-prefixed parts: moving a character between parts is another key.
        table.lock_id(&key("charges", "acct_1k", "1")),
        other.lock_id(&key("charges", "acct_1", "k1")),
    ] {
        assert_ne!(base, different);
    }
    let negative = (0..64)
        .filter(|i| table.lock_id(&key("charges", "", &format!("k{i}"))) < 0)
        .count();
    assert!((16..=48).contains(&negative), "{negative} of 64 negative");
}

/// Portable mode reads and sets no setting in its statements (a distributed engine
/// runs them on nodes where a custom setting was never set), sweeps without row
/// locks, and binds the principal as the column's type.
#[test]
fn portable_sql_depends_on_no_setting() {
    for principal_type in [
        PrincipalType::Text,
        PrincipalType::Uuid,
        PrincipalType::Bigint,
    ] {
        let dialect = Dialect {
            pooler: Pooler::Transaction,
            portable: true,
            principal_type,
        };
        let table = Table::new(&TableName::default(), dialect, Duration::from_secs(3));
        for statement in [
            &table.claim,
            &table.read,
            &table.reclaim,
            &table.store,
            &table.expired,
            &table.forget,
            &table.purge,
            &table.sweep_one,
            &table.inspect,
        ] {
            let is_purge = *statement == table.purge;
            let statement = statement.as_str();
            let lower = statement.to_lowercase();
            for setting in [
                "set_config",
                "current_setting",
                "for update",
                "skip locked",
                "pg_",
                "advisory",
            ] {
                assert!(!lower.contains(setting), "{setting:?} in: {statement}");
            }
            assert!(!statement.contains('{'), "unrendered: {statement}");
            assert!(
                is_purge || statement.contains(principal_type.parameter()),
                "{statement}"
            );
        }
        let column = format!("principal    {:<11} NOT NULL", principal_type.sql());
        assert!(table.ddl().contains(&column), "{}", table.ddl());
        assert!(table.ddl().contains(
            "create_distributed_table('idempotency_keys', 'principal', colocate_with =>"
        ));
        assert!(table.ddl().contains("`Store::distribute` runs this"));
    }
    assert_eq!(
        PrincipalType::Uuid.bound(""),
        "00000000-0000-0000-0000-000000000000"
    );
    assert_eq!(PrincipalType::Bigint.bound(""), "0");
    assert_eq!(PrincipalType::Text.bound(""), "");
    assert_eq!(PrincipalType::Bigint.bound("42"), "42");
}

#[test]
fn the_shipped_sql_is_the_default_table() {
    assert_eq!(TableName::parse(DEFAULT_TABLE), Some(TableName::default()));
    assert_eq!(
        Table::new(
            &TableName::default(),
            Dialect::default(),
            Duration::from_secs(3)
        )
        .ddl(),
        SCHEMA_SQL
    );
}

#[test]
fn table_names() {
    let name = TableName::parse("ops.idem_keys").unwrap();
    assert_eq!(name.qualified(), "\"ops\".\"idem_keys\"");
    assert_eq!(name.to_string(), "ops.idem_keys");
    let table = Table::new(&name, Dialect::default(), Duration::from_secs(3));
    assert_eq!(table.primary_key, "idem_keys_pkey");
    assert!(table.ddl().starts_with("-- idem"));
    assert!(table.ddl().contains("CREATE SCHEMA IF NOT EXISTS \"ops\";"));
    assert!(table
        .ddl()
        .contains("CONSTRAINT \"idem_keys_pkey\" PRIMARY KEY"));
    assert!(table
        .claim
        .as_str()
        .contains("INSERT INTO \"ops\".\"idem_keys\""));
    for bad in [
        "",
        "Keys",
        "a.b.c",
        "1keys",
        "keys; DROP TABLE x",
        "\"keys\"",
        ".keys",
        "keys.",
        &"k".repeat(49),
    ] {
        assert!(TableName::parse(bad).is_none(), "{bad:?}");
    }
}

#[test]
fn a_zero_conflict_wait_never_means_wait_forever() {
    // lock_timeout = 0 disables the timeout in PostgreSQL.
    assert_eq!(lock_timeout(Duration::ZERO), "1ms");
    assert_eq!(lock_timeout(Duration::from_millis(5)), "5ms");
}
