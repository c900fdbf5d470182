//! The engine: one idempotent attempt in PostgreSQL terms, from the claim of a key to
//! the commit of its record. It knows nothing of HTTP; the HTTP adapter
//! ([`crate::web`]) and [`Store::run_once`](crate::Store::run_once) sit above it and
//! decide what its refusals look like to their callers.
//!
//! [`begin`] opens the transaction and claims the key: either the caller runs its work
//! in the returned [`Attempt`], or a stored [`Record`] is replayed, or a [`Refusal`]
//! says why neither. The invariants this relies on (DESIGN.md):
//!
//! 1. **One transaction.** The claim, the work's writes and the stored record commit
//!    together ([`Attempt::commit`]). There is no "mark complete" step that could be lost.
//! 2. **No stuck keys.** An unfinished claim is an uncommitted row: a crash, a dropped
//!    connection or a dropped [`Attempt`] rolls it back. No lease, no reaper.
//! 3. **The primary key is the final arbiter.** Concurrent claims of one key serialize
//!    on the row; the loser waits (up to its lock timeout) and then replays, or is
//!    refused as [`Refusal::InUse`].
//! 4. **READ COMMITTED.** The read after a claim that waited is a new statement, so it
//!    sees the row the winner committed.
//! 7. **Cancellation-safe.** The transaction is sqlx's `Transaction`, rolled back when
//!    dropped.

use std::time::Duration;

use sqlx::{Postgres, Transaction};

use crate::fingerprint::Fingerprint;
use crate::store::{is_serialization_failure, is_unavailable, Store};
use crate::table::{Found, Isolation, Record, StoredRow, Timeouts};
use crate::tx::{KeyInScope, Tx};

/// What to claim: where the key lives, how long its record lasts, and what a retry must
/// match.
pub(crate) struct Claim {
    pub(crate) key: KeyInScope,
    pub(crate) ttl: Duration,
    pub(crate) fingerprint: Fingerprint,
    /// How long to wait for a request in flight with this key; `None` for the store's.
    pub(crate) conflict_wait: Option<Duration>,
    /// The bound on each statement of the work; `None` for the store's.
    pub(crate) statement_timeout: Option<Duration>,
}

/// How a claim began.
pub(crate) enum Begun {
    /// The key is claimed (or there is none): run the work in this attempt.
    Run(Attempt),
    /// The key's record, stored by an earlier attempt with the same fingerprint.
    Replay(Record),
}

/// Why the work must not run, when there is nothing to replay either.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// Another attempt with this key is running right now.
    InUse,
    /// The key was used before with another fingerprint.
    Mismatch,
    /// The database cannot be reached (no connection within the acquire timeout, or a
    /// connection-class error).
    Unavailable(sqlx::Error),
    /// Any other database error.
    Database(sqlx::Error),
    /// The stored record cannot be read back (its status is not a status).
    Unreadable,
}

impl Refusal {
    fn from_database(error: sqlx::Error) -> Self {
        if is_unavailable(&error) {
            Self::Unavailable(error)
        } else {
            Self::Database(error)
        }
    }
}

/// Why an attempt could not commit. Nothing it wrote is committed, except with
/// [`CommitError::Escaped`], where the work itself ended the transaction.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// The work ran `COMMIT` or `ROLLBACK` itself: its writes escaped the guarantee, and
    /// nothing was stored (invariant 6).
    Escaped,
    /// The database could not be reached; whether COMMIT happened is unknown only when
    /// the failure was COMMIT's own, and a retry finds out.
    Unavailable(sqlx::Error),
    /// The transaction could not be serialized with concurrent ones (40001, or a
    /// deadlock, 40P01): nothing was committed, and the same request can simply run
    /// again.
    Serialization(sqlx::Error),
    /// Any other database error.
    Database(sqlx::Error),
}

impl CommitError {
    fn from_database(error: sqlx::Error) -> Self {
        if is_unavailable(&error) {
            Self::Unavailable(error)
        } else if is_serialization_failure(&error) {
            Self::Serialization(error)
        } else {
            Self::Database(error)
        }
    }
}

/// Failures of one claim round.
enum ClaimError {
    /// Another request holds the key (lock timeout) or won the race (primary key).
    InUse,
    Database(sqlx::Error),
}

/// An open transaction that holds a key's claim (or, for an unkeyed request, records
/// nothing). Dropping it rolls everything back.
pub(crate) struct Attempt {
    store: Store,
    tx: Transaction<'static, Postgres>,
    key: Option<KeyInScope>,
}

/// How long a claim waits on the lock of an expired row: longer than a sweeper's batch
/// takes to delete (milliseconds), so that sweeping never answers 409.
const EXPIRY_WAIT: Duration = Duration::from_secs(1);

/// Opens the transaction and, with a claim, claims its key.
pub(crate) async fn begin(
    store: &Store,
    claim: Option<Claim>,
    isolation: Isolation,
) -> Result<Begun, Refusal> {
    let settings = &store.inner;
    let mut wait = claim
        .as_ref()
        .and_then(|c| c.conflict_wait)
        .unwrap_or(settings.conflict_wait);
    // A short lock_timeout also expires on locks that have nothing to do with this key,
    // such as the relation-extension lock of concurrent inserts. A duplicate in flight
    // holds its key for its whole handler and times out again; a passing lock does not.
    // So a short wait is tried three times, 5 ms and then 25 ms apart.
    let attempts = if wait < Duration::from_secs(1) { 3 } else { 1 };
    let mut round = 0;
    let mut checked_expiry = false;
    loop {
        round += 1;
        let begin = settings.pool.begin_with(isolation.begin());
        let mut tx = match tokio::time::timeout(settings.acquire_timeout, begin).await {
            Ok(Ok(tx)) => tx,
            Ok(Err(e)) => return Err(Refusal::from_database(e)),
            Err(_elapsed) => return Err(Refusal::Unavailable(sqlx::Error::PoolTimedOut)),
        };
        let Some(request) = &claim else {
            return Ok(Begun::Run(Attempt {
                store: store.clone(),
                tx,
                key: None,
            }));
        };
        match claim_row(store, &mut tx, request, wait).await {
            Ok(Found::Claimed) => {
                return Ok(Begun::Run(Attempt {
                    store: store.clone(),
                    tx,
                    key: claim.map(|c| c.key),
                }))
            }
            // Nothing was written; dropping the transaction frees the connection.
            Ok(Found::Stored(row)) => return replay(row, &request.fingerprint),
            Err(ClaimError::InUse) => {
                drop(tx);
                // The row is locked, but what is committed is an expired row: a sweeper
                // is deleting it, or a request is taking the expired key over. A sweep
                // must never answer 409, so this claim waits up to EXPIRY_WAIT, longer
                // than a sweeper's batch holds its locks; a request in flight holds the
                // key past that and is still answered 409. (A fresh key in flight has
                // no committed row, so its duplicates are not slowed.) Asked once.
                if !checked_expiry {
                    checked_expiry = true;
                    let expired = settings.table.expired(&settings.pool, &request.key).await;
                    if matches!(expired, Ok(Some(true))) {
                        wait = wait.max(EXPIRY_WAIT);
                        continue;
                    }
                }
                if round >= attempts {
                    return Err(Refusal::InUse);
                }
                let pause = if round == 1 { 5 } else { 25 };
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            Err(ClaimError::Database(e)) => return Err(Refusal::from_database(e)),
        }
    }
}

/// Claims the key in `tx`: the fresh claim, or the row that holds the key.
async fn claim_row(
    store: &Store,
    tx: &mut Transaction<'static, Postgres>,
    claim: &Claim,
    wait: Duration,
) -> Result<Found, ClaimError> {
    let table = &store.inner.table;
    let classify = |error: sqlx::Error| match &error {
        // 55P03: our lock_timeout expired while another request held the key's row.
        sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03") => ClaimError::InUse,
        // Above READ COMMITTED, a claim that waited for a concurrent request's row fails
        // with 40001 when that request commits: the key is (or was just) in use, and a
        // new transaction, with a new snapshot, sees what it committed.
        sqlx::Error::Database(e) if e.code().as_deref() == Some("40001") => ClaimError::InUse,
        // A unique violation of the key's own primary key: a concurrent request won.
        // Any other unique violation is not ours to interpret.
        _ if table.is_key_conflict(&error) => ClaimError::InUse,
        _ => ClaimError::Database(error),
    };
    let Claim {
        key,
        ttl,
        fingerprint,
        ..
    } = claim;
    let timeouts = Timeouts {
        ttl: *ttl,
        wait,
        statement: claim.statement_timeout.or(store.inner.statement_timeout),
    };
    // Portable mode only: the waits by `SET LOCAL`, for the whole claim.
    table.set_waits(tx, timeouts).await.map_err(classify)?;
    // Claims go round at most a few times, and only under races with expiry: a row seen
    // expired is reclaimed by another request first, or deleted by a sweeper.
    let claimed = 'rounds: {
        for _ in 0..4 {
            let found = match table
                .claim(tx, key, fingerprint, timeouts)
                .await
                .map_err(classify)?
            {
                Some(found) => found,
                // The conflicting row committed after the claim's snapshot began (the claim
                // waited for it): a new statement sees it.
                None => match table.read(tx, key).await.map_err(classify)? {
                    Some(found) => found,
                    None => continue,
                },
            };
            match found {
                Found::Stored(row) if row.expired || row.status.is_none() => {}
                Found::Claimed => break 'rounds true,
                found => return Ok(found),
            }
            if table
                .reclaim(tx, key, fingerprint, timeouts)
                .await
                .map_err(classify)?
            {
                break 'rounds true;
            }
        }
        false
    };
    if claimed {
        // Portable mode only: the handler does not inherit the claim's wait.
        table.restore_wait(tx).await.map_err(classify)?;
        return Ok(Found::Claimed);
    }
    Err(ClaimError::InUse)
}

/// A stored row: its record when the fingerprint matches.
fn replay(row: StoredRow, fingerprint: &Fingerprint) -> Result<Begun, Refusal> {
    if !fingerprint.matches(&row.fingerprint, &row.field_hashes) {
        return Err(Refusal::Mismatch);
    }
    let status = row
        .status
        .and_then(|s| u16::try_from(s).ok())
        .filter(|s| (100..=999).contains(s))
        .ok_or(Refusal::Unreadable)?;
    Ok(Begun::Replay(Record {
        status,
        headers: row.headers.unwrap_or_default(),
        body: row.body.unwrap_or_default().into(),
    }))
}

impl Attempt {
    /// The transaction, lent to the work.
    pub(crate) fn tx(&mut self) -> Tx<'_> {
        Tx::new(&mut self.tx, self.key.as_ref())
    }

    /// The claimed key; `None` for an attempt that records nothing.
    pub(crate) fn key(&self) -> Option<&KeyInScope> {
        self.key.as_ref()
    }

    /// Stores `record` with the key and commits it with everything the work wrote.
    /// Without a key, only commits.
    pub(crate) async fn commit(self, record: &Record) -> Result<(), CommitError> {
        let Self { store, mut tx, key } = self;
        if let Some(key) = &key {
            let table = &store.inner.table;
            match table.store(&mut tx, key, record).await {
                Ok(true) => {}
                Ok(false) => {
                    escaped(&store, tx, key).await;
                    return Err(CommitError::Escaped);
                }
                Err(e) => return Err(CommitError::from_database(e)),
            }
        }
        // If COMMIT's answer is lost, the caller cannot tell whether it happened; it
        // answers "unavailable", and the retry either replays the committed record or
        // runs afresh.
        tx.commit().await.map_err(CommitError::from_database)
    }

    /// Commits what the work wrote, storing nothing: only for an attempt without a key.
    pub(crate) async fn commit_unrecorded(self) -> Result<(), CommitError> {
        debug_assert!(self.key.is_none(), "a claimed key must commit its record");
        self.tx.commit().await.map_err(CommitError::from_database)
    }

    /// Rolls back everything the work wrote, and the claim with it.
    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

/// The work ran `COMMIT` or `ROLLBACK` itself (invariant 6): its writes may have
/// committed without the key's record. The committed claim, if any, is removed so the
/// key is not stuck (the claim path would take such a row over anyway).
async fn escaped(store: &Store, tx: Transaction<'static, Postgres>, key: &KeyInScope) {
    tracing::error!(
        scope = &*key.scope,
        "idem: the handler ended its transaction itself (raw COMMIT or ROLLBACK); \
         its writes escaped the idempotency guarantee; nothing was stored"
    );
    drop(tx);
    if let Err(e) = store.inner.table.forget(&store.inner.pool, key).await {
        tracing::warn!(error = %e, "idem: could not remove the escaped claim");
    }
}

/// The engine alone, on a real PostgreSQL (`DATABASE_URL`), without HTTP. Each test has
/// a schema of its own for idem's table and its business table.
#[cfg(test)]
mod tests {
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
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .connect(&url)
                .await
                .expect("PostgreSQL at DATABASE_URL");
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

        fn claim(&self, key: &str, payload: &str) -> Option<Claim> {
            let mut fingerprint = Fingerprint::builder("notes", "", "", []);
            fingerprint.whole_body(payload).unwrap();
            Some(Claim {
                key: KeyInScope {
                    scope: "notes".into(),
                    principal: String::new(),
                    key: crate::IdempotencyKey::parse(key.as_bytes()).unwrap(),
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
        // Dropping an attempt rolls it back (a cancelled request): the key is free.
        drop(first);
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
    async fn work_that_ends_the_transaction_itself_is_caught() {
        let db = Db::new().await;
        let mut attempt = run(db.begin("k1", "a").await);
        db.write(&mut attempt).await;
        sqlx::Executor::execute(&mut *attempt.tx(), "COMMIT")
            .await
            .unwrap();
        assert!(matches!(
            attempt.commit(&record("x")).await,
            Err(CommitError::Escaped)
        ));
        // Nothing is replayed, and the key is not stuck.
        run(db.begin("k1", "a").await).rollback().await.unwrap();
        db.drop_schema().await;
    }

    #[tokio::test]
    async fn without_a_claim_the_attempt_records_nothing() {
        let db = Db::new().await;
        let mut attempt = run(begin(&db.store, None, Isolation::ReadCommitted).await);
        assert!(attempt.key().is_none());
        db.write(&mut attempt).await;
        attempt.commit_unrecorded().await.unwrap();
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
}
