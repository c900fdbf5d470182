//! The engine alone, on a real PostgreSQL (`DATABASE_URL`), without HTTP. Each test has
//! a schema of its own for idem's table and its business table.

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::{AssertSqlSafe, PgPool};

use super::*;

struct Db {
    pool: PgPool,
    schema: String,
    store: Store,
}

impl Db {
    async fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let pool = pool(4).await;
        let schema = format!(
            "idem_engine_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let store = Store::builder(pool.clone())
            .table(format!("{schema}.keys"))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {schema}.notes (body text)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        Self {
            pool,
            schema,
            store,
        }
    }

    /// A store on this test's table, built with `configure`.
    fn store_with(
        &self,
        configure: impl FnOnce(crate::StoreBuilder) -> crate::StoreBuilder,
    ) -> Store {
        configure(Store::builder(self.pool.clone()).table(format!("{}.keys", self.schema)))
            .build()
            .unwrap()
    }

    fn claim(&self, key: &str, payload: &str) -> Option<Claim> {
        let mut fingerprint = Fingerprint::builder("notes", "", "", []);
        fingerprint.whole_body(payload).unwrap();
        Some(Claim {
            key: KeyInScope {
                scope: "notes".into(),
                principal: String::new(),
                key: crate::header::IdempotencyKey::parse(key.as_bytes()).unwrap(),
                place: crate::identity::Place::Principal,
            },
            ttl: Duration::from_secs(60),
            fingerprint: fingerprint.finish(),
            conflict_wait: None,
            statement_timeout: None,
        })
    }

    async fn begin(&self, key: &str, payload: &str) -> Result<Begun, Refusal> {
        begin(
            &self.store,
            self.claim(key, payload),
            Isolation::ReadCommitted,
        )
        .await
    }

    async fn notes(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.notes",
            self.schema
        )))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn write(&self, attempt: &mut Attempt) {
        let sql = format!("INSERT INTO {}.notes VALUES ('n')", self.schema);
        sqlx::query(AssertSqlSafe(sql.as_str()))
            .execute(&mut *attempt.tx())
            .await
            .unwrap();
    }

    async fn drop_schema(self) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema
        )))
        .execute(&self.pool)
        .await
        .unwrap();
    }
}

/// A pool of `size` connections to the PostgreSQL of `DATABASE_URL`.
async fn pool(size: u32) -> PgPool {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .connect(&url)
        .await
        .expect("PostgreSQL at DATABASE_URL")
}

fn record(body: &'static str) -> Record {
    Record {
        status: 201,
        headers: b"content-type: text/plain\n".to_vec(),
        body: body.into(),
    }
}

fn run(begun: Result<Begun, Refusal>) -> Attempt {
    match begun {
        Ok(Begun::Run(attempt)) => attempt,
        Ok(Begun::Replay(record)) => panic!("replayed {record:?}"),
        Err(refusal) => panic!("refused: {refusal:?}"),
    }
}

#[tokio::test]
async fn a_committed_attempt_is_replayed_and_its_writes_kept() {
    let db = Db::new().await;
    let mut attempt = run(db.begin("k1", "a").await);
    db.write(&mut attempt).await;
    attempt.commit(&record("done")).await.unwrap();
    match db.begin("k1", "a").await {
        Ok(Begun::Replay(stored)) => assert_eq!(stored, record("done")),
        _ => panic!("not a replay"),
    }
    assert_eq!(db.notes().await, 1);
    db.drop_schema().await;
}

/// The default mode's statements are prepared once per connection; a connection
/// that lost them (all: a session pooler's `DISCARD ALL`; some: a handler's
/// `DEALLOCATE`) prepares what it lacks and goes on. Lost between the claim and the
/// commit, the request fails, rolled back and retryable, and the next one commits.
#[tokio::test]
async fn a_connection_without_the_prepared_statements_prepares_them() {
    let db = Db::new().await;
    let one = pool(1).await;
    let store = Store::builder(one.clone())
        .table(format!("{}.keys", db.schema))
        .build()
        .unwrap();
    let begin = |key: &'static str| begin(&store, db.claim(key, "a"), Isolation::ReadCommitted);
    let held = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE 'idem%' ORDER BY name",
        )
        .persistent(false)
        .fetch_all(&one)
        .await
        .unwrap()
    };
    let deallocate = async |names: &[String]| {
        for name in names {
            sqlx::raw_sql(AssertSqlSafe(format!("DEALLOCATE {name}")))
                .execute(&one)
                .await
                .unwrap();
        }
    };
    let fresh = async |key: &'static str| {
        let mut attempt = run(begin(key).await);
        let sql = format!("INSERT INTO {}.notes VALUES ('n')", db.schema);
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *attempt.tx())
            .await
            .unwrap();
        attempt.commit(&record("done")).await
    };

    fresh("p1").await.unwrap();
    let set = held().await;
    // The claim's try and read, the key row (fresh or over an expired one), an event
    // and the delete of the request's steps riding it.
    assert_eq!(set.len(), 6, "{set:?}");
    // All gone, then the claim's alone: prepared again, each request commits.
    deallocate(&set).await;
    fresh("p2").await.unwrap();
    let take: Vec<String> = set
        .iter()
        .filter(|n| n.ends_with("_take"))
        .cloned()
        .collect();
    deallocate(&take).await;
    fresh("p3").await.unwrap();
    assert_eq!(held().await, set);
    // The key row's insert gone while the request runs: that request fails and
    // leaves nothing; the next commits, and the failed key runs again.
    let mut attempt = run(begin("p4").await);
    let insert: Vec<String> = set
        .iter()
        .filter(|n| n.ends_with("_insert"))
        .cloned()
        .collect();
    for name in &insert {
        sqlx::raw_sql(AssertSqlSafe(format!("DEALLOCATE {name}")))
            .execute(&mut *attempt.tx())
            .await
            .unwrap();
    }
    assert!(attempt.commit(&record("done")).await.is_err());
    assert_eq!(db.notes().await, 3);
    assert_eq!(held().await, set);
    fresh("p4").await.unwrap();
    for key in ["p1", "p2", "p3", "p4"] {
        match begin(key).await {
            Ok(Begun::Replay(stored)) => assert_eq!(stored, record("done")),
            _ => panic!("{key} not replayed"),
        }
    }
    assert_eq!(db.notes().await, 4);
    one.close().await;
    db.drop_schema().await;
}

/// A store that never writes an event need not have an outbox table (its owner ran
/// only the keys' DDL): the event's insert is left out of what a connection prepares,
/// and the claim on a connection that prepares goes on. (Prepared with the rest, its
/// missing table failed the first claim on every connection.)
#[tokio::test]
async fn a_store_without_an_outbox_table_prepares_its_own_statements() {
    let db = Db::new().await;
    let drop_outbox = format!("DROP TABLE {}.idem_outbox", db.schema);
    sqlx::raw_sql(AssertSqlSafe(drop_outbox))
        .execute(&db.pool)
        .await
        .unwrap();
    let mut attempt = run(db.begin("o1", "a").await);
    db.write(&mut attempt).await;
    attempt.commit(&record("done")).await.unwrap();
    match db.begin("o1", "a").await {
        Ok(Begun::Replay(stored)) => assert_eq!(stored, record("done")),
        _ => panic!("not a replay"),
    }
    db.drop_schema().await;
}

/// Regression: a table named like a keyword passed validation and then failed in
/// every statement (unqualified names were not quoted).
#[tokio::test]
async fn a_table_named_like_a_keyword_works() {
    let db = Db::new().await;
    // Unqualified names land in the connection's schema: this test's own.
    let options: sqlx::postgres::PgConnectOptions = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
        .parse()
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.options([("search_path", db.schema.as_str())]))
        .await
        .unwrap();
    for name in ["user", "order"] {
        let store = Store::builder(pool.clone()).table(name).build().unwrap();
        store.migrate().await.unwrap();
        run(begin(&store, db.claim("k1", "a"), Isolation::ReadCommitted).await)
            .commit(&record("done"))
            .await
            .unwrap();
        let replayed = begin(&store, db.claim("k1", "a"), Isolation::ReadCommitted).await;
        assert!(matches!(replayed, Ok(Begun::Replay(_))));
    }
    pool.close().await;
    db.drop_schema().await;
}

/// An expired record of key `k1`, as a sweeper finds it.
async fn expired_row(db: &Db) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {}.keys (scope, principal, key, fingerprint, field_hashes, status, expires_at) \
         VALUES ('notes', '', 'k1', '\\x00', '\\x00', 201, now() - interval '1 day')",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Regression: a sweep holding the lock of an expired row made a request for that
/// (idle) key answer 409: the claim's short wait expired before the batch committed.
#[tokio::test]
async fn a_sweep_never_makes_an_idle_key_in_use() {
    let db = Db::new().await;
    expired_row(&db).await;
    // A sweeper's batch: it deletes the row and commits 300 ms later.
    let mut sweep = db.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {}.keys WHERE key = 'k1'",
        db.schema
    )))
    .execute(&mut *sweep)
    .await
    .unwrap();
    let sweeper = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        sweep.commit().await.unwrap();
    });
    run(db.begin("k1", "a").await)
        .commit(&record("after the sweep"))
        .await
        .unwrap();
    sweeper.await.unwrap();
    db.drop_schema().await;
}

/// The wait for an expired row's lock is bounded: a request that took the expired
/// key over and is still running keeps it, and its duplicate is in use.
#[tokio::test]
async fn a_request_taking_over_an_expired_key_holds_it() {
    let db = Db::new().await;
    expired_row(&db).await;
    let first = run(db.begin("k1", "a").await);
    assert!(matches!(db.begin("k1", "a").await, Err(Refusal::InUse)));
    first.commit(&record("first")).await.unwrap();
    assert!(matches!(db.begin("k1", "a").await, Ok(Begun::Replay(_))));
    db.drop_schema().await;
}

/// `isolation = serializable`: the transaction runs at that level, and a commit that
/// could not be serialized is a retryable [`CommitError::Serialization`], not a 500.
#[tokio::test]
async fn a_serialization_failure_at_commit_is_retryable() {
    let db = Db::new().await;
    let serializable = |key| begin(&db.store, db.claim(key, "a"), Isolation::Serializable);
    let mut first = run(serializable("k1").await);
    let mut second = run(serializable("k2").await);
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&mut *first.tx())
        .await
        .unwrap();
    assert_eq!(level, "serializable");
    // Write skew: each reads what the other writes.
    for attempt in [&mut first, &mut second] {
        let sql = format!("SELECT count(*) FROM {}.notes", db.schema);
        sqlx::query(AssertSqlSafe(sql.as_str()))
            .execute(&mut *attempt.tx())
            .await
            .unwrap();
    }
    db.write(&mut first).await;
    db.write(&mut second).await;
    first.commit(&record("first")).await.unwrap();
    assert!(matches!(
        second.commit(&record("second")).await,
        Err(CommitError::Serialization(_))
    ));
    // Nothing of the second was kept: its retry runs afresh.
    run(serializable("k2").await)
        .commit(&record("second"))
        .await
        .unwrap();
    assert_eq!(db.notes().await, 1);
    db.drop_schema().await;
}

/// Regression (issue 19, 3): `expires_at` counted from the claim, so a handler that
/// ran longer than its ttl committed a record that was already expired, and the next
/// retry ran it again.
#[tokio::test]
async fn a_record_lives_its_ttl_from_its_commit() {
    let db = Db::new().await;
    let claim = |payload| {
        db.claim("k1", payload).map(|c| Claim {
            ttl: Duration::from_millis(1500),
            ..c
        })
    };
    let mut attempt = run(begin(&db.store, claim("a"), Isolation::ReadCommitted).await);
    db.write(&mut attempt).await;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    attempt.commit(&record("slow")).await.unwrap();
    match begin(&db.store, claim("a"), Isolation::ReadCommitted).await {
        Ok(Begun::Replay(stored)) => assert_eq!(stored, record("slow")),
        Ok(Begun::Run(_)) => panic!("a record committed a moment ago ran again"),
        Err(refusal) => panic!("refused: {refusal:?}"),
    }
    assert_eq!(db.notes().await, 1);
    db.drop_schema().await;
}

/// Regression (issue 19, 4): above READ COMMITTED, a duplicate waiting for the
/// request in flight failed with 40001 when it committed, which was taken for "in
/// use": it waited the whole request and then answered 409 instead of the replay.
#[tokio::test]
async fn a_waiting_duplicate_above_read_committed_replays() {
    let db = Db::new().await;
    for isolation in [Isolation::RepeatableRead, Isolation::Serializable] {
        let key = format!("{isolation:?}");
        let claim = || {
            db.claim(&key, "a").map(|c| Claim {
                conflict_wait: Some(Duration::from_secs(10)),
                ..c
            })
        };
        let mut first = run(begin(&db.store, claim(), isolation).await);
        db.write(&mut first).await;
        let store = db.store.clone();
        let duplicate = tokio::spawn({
            let claim = claim();
            async move { begin(&store, claim, isolation).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        first.commit(&record("first")).await.unwrap();
        match duplicate.await.unwrap() {
            Ok(Begun::Replay(stored)) => assert_eq!(stored, record("first")),
            Ok(Begun::Run(_)) => panic!("{isolation:?}: the duplicate ran"),
            Err(refusal) => panic!("{isolation:?}: refused: {refusal:?}"),
        }
    }
    assert_eq!(db.notes().await, 2);
    db.drop_schema().await;
}

/// Regression (issue 19, 6): work that answered after one of its statements failed
/// could never store its answer (25P02), and every retry failed the same way. The
/// aborted attempt hands back a [`Retake`] that stores the answer alone.
#[tokio::test]
async fn an_answer_after_a_failed_statement_is_stored_alone() {
    let db = Db::new().await;
    let mut attempt = run(db.begin("k1", "a").await);
    db.write(&mut attempt).await;
    let failed = sqlx::query("SELECT 1 / 0")
        .execute(&mut *attempt.tx())
        .await;
    assert!(failed.is_err());
    let rejected = Record {
        status: 409,
        ..record("conflict")
    };
    let Err(CommitError::Aborted(Some(retake))) = attempt.commit(&rejected).await else {
        panic!("not aborted");
    };
    assert!(matches!(
        retake.store_alone(&rejected).await,
        Ok(Alone::Stored)
    ));
    match db.begin("k1", "a").await {
        Ok(Begun::Replay(stored)) => assert_eq!(stored, rejected),
        _ => panic!("not a replay"),
    }
    // PostgreSQL rolled back what the work wrote before its statement failed.
    assert_eq!(db.notes().await, 0);
    db.drop_schema().await;
}

/// The key is claimed afresh for the answer alone: a request that claimed it in
/// between wins (invariant 3), and its record is the answer.
#[tokio::test]
async fn an_answer_stored_alone_yields_to_a_request_in_between() {
    let db = Db::new().await;
    let mut attempt = run(db.begin("k1", "a").await);
    assert!(sqlx::query("SELECT 1 / 0")
        .execute(&mut *attempt.tx())
        .await
        .is_err());
    let Err(CommitError::Aborted(Some(retake))) = attempt.commit(&record("late")).await else {
        panic!("not aborted");
    };
    run(db.begin("k1", "a").await)
        .commit(&record("in between"))
        .await
        .unwrap();
    match retake.store_alone(&record("late")).await {
        Ok(Alone::Replay(stored)) => assert_eq!(stored, record("in between")),
        other => panic!("{other:?}"),
    }
    db.drop_schema().await;
}

/// Regression (issue 19, 8): the portable sweep deleted its batch in one statement
/// without `SKIP LOCKED`; waiting for a row a long request had taken over, it held
/// the locks of the rows it had already deleted, and claims of those keys waited the
/// expiry wait and were answered 409.
#[tokio::test]
async fn a_portable_sweep_never_makes_a_key_in_use() {
    let db = Db::new().await;
    let store = db.store_with(|b| b.portable(true));
    let expired = |key: &str, age: u32| {
        format!(
            "INSERT INTO {}.keys (scope, principal, key, fingerprint, field_hashes, status, expires_at) \
             VALUES ('notes', '', '{key}', '\\x00', '\\x00', 201, now() - interval '{age} minutes');",
            db.schema
        )
    };
    let mut sql: String = (0..20).map(|i| expired(&format!("idle{i}"), 5)).collect();
    // Inserted last (a scan meets it last), and oldest (a sweep picks it first).
    sql.push_str(&expired("k1", 60));
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&db.pool)
        .await
        .unwrap();
    // A long request takes the expired key k1 over and holds it.
    let held = run(begin(&store, db.claim("k1", "a"), Isolation::ReadCommitted).await);
    let sweeper = tokio::spawn({
        let store = store.clone();
        async move { store.purge_expired(100).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    for i in 0..20 {
        let claim = db.claim(&format!("idle{i}"), "a");
        run(begin(&store, claim, Isolation::ReadCommitted).await)
            .commit(&record("new"))
            .await
            .unwrap();
    }
    assert_eq!(
        sweeper.await.unwrap().unwrap(),
        20,
        "k1 is left to a later sweep"
    );
    held.commit(&record("held")).await.unwrap();
    db.drop_schema().await;
}

/// Regression (issue 19, 9): statements outside a request (the expiry check of the
/// 409 path, purge, inspect, forget) waited for a connection as long as the pool's
/// own bound (sqlx's 30 s default) instead of the store's `acquire_timeout`.
#[tokio::test]
async fn statements_outside_a_request_wait_the_acquire_timeout() {
    let db = Db::new().await;
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&url)
        .await
        .unwrap();
    let store = Store::builder(pool.clone())
        .table(format!("{}.keys", db.schema))
        .acquire_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let busy = pool.acquire().await.unwrap();
    let purged = tokio::time::timeout(Duration::from_secs(10), store.purge_expired(10)).await;
    assert!(
        matches!(purged, Ok(Err(sqlx::Error::PoolTimedOut))),
        "{purged:?}"
    );
    drop(busy);
    pool.close().await;
    db.drop_schema().await;
}

/// Holds the lock of `key` in a transaction of its own, as an attempt of another key
/// whose lock collides with it would (a 64-bit hash collision, forced).
async fn collide(db: &Db, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let claim = db.claim(key, "a").unwrap();
    let lock = db.store.inner.table.lock_id(&claim.key);
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(lock)
        .execute(&mut *holder)
        .await
        .unwrap();
    holder
}

/// A lock keyed by a hash can collide: two keys then share it. The cost is a refusal
/// (409, or a wait), never a second effect or another key's answer: the key is free
/// once the colliding attempt ends, and its own work runs and is stored.
#[tokio::test]
async fn a_colliding_lock_only_delays_a_key() {
    let db = Db::new().await;
    let holder = collide(&db, "k1").await;
    assert!(matches!(db.begin("k1", "a").await, Err(Refusal::InUse)));
    holder.commit().await.unwrap();
    let mut attempt = run(db.begin("k1", "a").await);
    db.write(&mut attempt).await;
    attempt.commit(&record("own")).await.unwrap();
    match db.begin("k1", "a").await {
        Ok(Begun::Replay(stored)) => assert_eq!(stored, record("own")),
        _ => panic!("not a replay"),
    }
    assert_eq!(db.notes().await, 1);
    // With a wait, a duplicate waits out the collision and then runs.
    let holder = collide(&db, "k2").await;
    let waiting = db.claim("k2", "a").map(|c| Claim {
        conflict_wait: Some(Duration::from_secs(10)),
        ..c
    });
    let store = db.store.clone();
    let duplicate =
        tokio::spawn(async move { begin(&store, waiting, Isolation::ReadCommitted).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.rollback().await.unwrap();
    run(duplicate.await.unwrap())
        .commit(&record("k2"))
        .await
        .unwrap();
    db.drop_schema().await;
}

/// A record is replayed while its key's lock is held elsewhere: replays take no lock.
#[tokio::test]
async fn a_replay_needs_no_lock() {
    let db = Db::new().await;
    run(db.begin("k1", "a").await)
        .commit(&record("done"))
        .await
        .unwrap();
    let holder = collide(&db, "k1").await;
    match db.begin("k1", "a").await {
        Ok(Begun::Replay(stored)) => assert_eq!(stored, record("done")),
        _ => panic!("not a replay"),
    }
    holder.rollback().await.unwrap();
    db.drop_schema().await;
}

/// Commits the complete row of key `k1` the way an attempt that took no lock would:
/// an instance of an earlier version during a rolling upgrade, which claimed by
/// inserting the row.
async fn commit_unlocked(db: &Db, payload: &str, body: &'static str) {
    let claim = db.claim("k1", payload).unwrap();
    let sql = format!(
        "INSERT INTO {}.keys (scope, principal, key, fingerprint, field_hashes, status, headers, body, expires_at) \
         VALUES ('notes', '', 'k1', $1, $2, 201, $3, $4, now() + interval '1 hour')",
        db.schema
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(claim.fingerprint.combined().as_slice())
        .bind(claim.fingerprint.parts())
        .bind(record(body).headers)
        .bind(body.as_bytes())
        .execute(&db.pool)
        .await
        .unwrap();
}

/// Invariant 3 beyond the lock: when an attempt the lock did not keep out commits the
/// key first, the primary key refuses the second row, nothing of the second attempt
/// commits, and its answer is the winner's record.
#[tokio::test]
async fn the_primary_key_decides_past_the_lock() {
    match outrun("a", false).await {
        Ok(Committed::Superseded(stored)) => assert_eq!(stored, record("winner")),
        other => panic!("{other:?}"),
    }
    // The winner's request differed: the loser is a mismatch (422), not a replay.
    assert!(matches!(
        outrun("b", false).await,
        Err(CommitError::Refused(Refusal::Mismatch))
    ));
}

/// The same over an expired row: the attempt that took the expired key over finds a
/// live record in its place at commit, and yields to it.
#[tokio::test]
async fn a_takeover_yields_to_a_record_committed_meanwhile() {
    match outrun("a", true).await {
        Ok(Committed::Superseded(stored)) => assert_eq!(stored, record("winner")),
        other => panic!("{other:?}"),
    }
}

/// An attempt of key `k1` (over an expired row when `over_expired`) that writes, while
/// an attempt the lock does not keep out commits the key first with `winner_payload`
/// (the expired row deleted before, as a sweeper would): how the first one's commit
/// ends. Nothing of it was committed, whatever the answer.
async fn outrun(winner_payload: &str, over_expired: bool) -> Result<Committed, CommitError> {
    let db = Db::new().await;
    if over_expired {
        expired_row(&db).await;
    }
    let mut attempt = run(db.begin("k1", "a").await);
    db.write(&mut attempt).await;
    if over_expired {
        let sql = format!("DELETE FROM {}.keys WHERE key = 'k1'", db.schema);
        sqlx::query(AssertSqlSafe(sql))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    commit_unlocked(&db, winner_payload, "winner").await;
    let committed = attempt.commit(&record("loser")).await;
    assert_eq!(db.notes().await, 0, "the loser's writes were rolled back");
    db.drop_schema().await;
    committed
}

#[tokio::test]
async fn another_fingerprint_is_a_mismatch() {
    let db = Db::new().await;
    run(db.begin("k1", "a").await)
        .commit(&record("done"))
        .await
        .unwrap();
    assert!(matches!(db.begin("k1", "b").await, Err(Refusal::Mismatch)));
    db.drop_schema().await;
}

#[tokio::test]
async fn a_key_in_flight_is_in_use_until_its_attempt_ends() {
    let db = Db::new().await;
    let first = run(db.begin("k1", "a").await);
    assert!(matches!(db.begin("k1", "a").await, Err(Refusal::InUse)));
    // Dropping an attempt rolls it back (a cancelled request): the key is free as
    // soon as the rollback reaches the server, which the pool sends as it takes the
    // connection back, in a task of its own.
    drop(first);
    let freed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match db.begin("k1", "a").await {
                Err(Refusal::InUse) => tokio::time::sleep(Duration::from_millis(1)).await,
                begun => return run(begun),
            }
        }
    });
    freed
        .await
        .expect("the key is never freed")
        .rollback()
        .await
        .unwrap();
    // An attempt that ends by its own rollback frees the key before it returns.
    let second = run(db.begin("k1", "a").await);
    second.rollback().await.unwrap();
    run(db.begin("k1", "a").await).rollback().await.unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn a_rollback_leaves_nothing() {
    let db = Db::new().await;
    let mut attempt = run(db.begin("k1", "a").await);
    db.write(&mut attempt).await;
    attempt.rollback().await.unwrap();
    assert_eq!(db.notes().await, 0);
    // The key is free, even for another payload.
    run(db.begin("k1", "b").await)
        .commit(&record("b"))
        .await
        .unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn a_commit_the_work_sends_is_refused_and_a_rollback_caught() {
    let db = Db::new().await;
    // COMMIT: refused, the write with it; the attempt then finds its transaction gone.
    let mut attempt = run(db.begin("k1", "a").await);
    db.write(&mut attempt).await;
    let refused = sqlx::Executor::execute(&mut *attempt.tx(), "COMMIT")
        .await
        .unwrap_err();
    assert!(
        refused
            .to_string()
            .contains(crate::transaction::REFUSED_COMMIT),
        "{refused}"
    );
    assert_eq!(db.notes().await, 0, "nothing committed");
    assert!(matches!(
        attempt.commit(&record("x")).await,
        Err(CommitError::Escaped)
    ));
    // ROLLBACK: the write is gone, and the attempt cannot commit a record without it.
    let mut attempt = run(db.begin("k1", "a").await);
    db.write(&mut attempt).await;
    sqlx::Executor::execute(&mut *attempt.tx(), "ROLLBACK")
        .await
        .unwrap();
    assert!(matches!(
        attempt.commit(&record("x")).await,
        Err(CommitError::Escaped)
    ));
    assert_eq!(db.notes().await, 0);
    // Nothing is replayed, and the key is not stuck.
    run(db.begin("k1", "a").await).rollback().await.unwrap();
    // Without a key too.
    let mut attempt = run(begin(&db.store, None, Isolation::ReadCommitted).await);
    db.write(&mut attempt).await;
    assert!(sqlx::Executor::execute(&mut *attempt.tx(), "COMMIT")
        .await
        .is_err());
    assert!(matches!(
        attempt.commit_unrecorded(true).await,
        Err(CommitError::Escaped)
    ));
    assert_eq!(db.notes().await, 0);
    db.drop_schema().await;
}

#[tokio::test]
async fn without_a_claim_the_attempt_records_nothing() {
    let db = Db::new().await;
    let mut attempt = run(begin(&db.store, None, Isolation::ReadCommitted).await);
    assert!(attempt.key().is_none());
    db.write(&mut attempt).await;
    attempt.commit_unrecorded(true).await.unwrap();
    assert_eq!(db.notes().await, 1);
    let keys: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.keys",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(keys, 0);
    db.drop_schema().await;
}
