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
//! 2. **No stuck keys.** An unfinished claim is a transaction-scoped lock (in portable
//!    mode, an uncommitted row): a crash, a dropped connection or a dropped [`Attempt`]
//!    releases it. No lease, no reaper.
//! 3. **The primary key is the final arbiter.** The key's lock keeps a duplicate from
//!    running while the first attempt is in flight (it waits, up to its conflict wait,
//!    and then replays, or is refused as [`Refusal::InUse`]); what commits is decided by
//!    the primary key, which the record is inserted under. An attempt the lock did not
//!    keep out (a colliding hash only delays; an instance of an earlier version takes
//!    no lock) loses at commit and answers the winner's record
//!    ([`Committed::Superseded`]). The arbiter needs both attempts under one primary
//!    key: a key without a principal that a new version keeps under its spread, and an
//!    earlier version under the nobody value, has two ([`crate::spread`]).
//! 4. **READ COMMITTED.** The read after a claim that waited is a new statement, so it
//!    sees the record the winner committed.
//! 7. **Cancellation-safe.** The transaction is an [`OpenTransaction`], rolled back when
//!    dropped.
//!
//! Round trips: in the default mode (and behind a pooler) the claim rides `BEGIN` and
//! the key's row rides `COMMIT` ([`crate::transaction`]), so a fresh request costs idem
//! no round trip beyond the two its transaction needs anyway, and a replay or a 409 one
//! (the `ROLLBACK` that follows is sent after the answer). `tests/tests/round_trips.rs`
//! counts them.

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::identity::KeyInScope;
use crate::store::{is_serialization_failure, is_unavailable, Store};
use crate::table::{self, Found, Inserting, Isolation, Record, StoredRow, Timeouts};
use crate::transaction::OpenTransaction;
use crate::tx::{AttemptState, Request, Tx};

/// What to claim: where the key lives, how long its record lasts, and what a retry must
/// match.
#[derive(Clone)]
pub(crate) struct Claim {
    pub(crate) key: KeyInScope,
    pub(crate) ttl: Duration,
    pub(crate) fingerprint: Fingerprint,
    /// How long to wait for a request in flight with this key; `None` for the store's.
    pub(crate) conflict_wait: Option<Duration>,
    /// The bound on each statement of the work; `None` for the store's.
    pub(crate) statement_timeout: Option<Duration>,
}

/// How a claim began. Returned once per request and matched at once: boxing the attempt
/// would cost an allocation per request to save a move of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
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
    /// A statement of the work failed and the work answered all the same: PostgreSQL
    /// refuses every statement of the transaction after that (25P02), so nothing of it
    /// can commit. It was rolled back; for a claimed key, [`Retake::store_alone`] can
    /// store the answer by itself (`None`: an attempt without a key).
    Aborted(Option<Retake>),
    /// Another attempt with the same key committed first, and the primary key refused
    /// this one's row (invariant 3): nothing of it was committed, and the winner's record
    /// cannot be answered, for this reason (its request differed: a mismatch).
    Refused(Refusal),
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

/// How an attempt committed.
#[derive(Debug)]
pub(crate) enum Committed {
    /// Its writes and its record.
    Stored,
    /// Nothing of it: another attempt with the same key committed first, and the primary
    /// key refused this one's row (invariant 3). The key's answer is that attempt's
    /// record.
    Superseded(Record),
}

/// Failures of one claim round.
enum ClaimError {
    /// Another request holds the key (lock timeout) or won the race (primary key).
    InUse,
    /// Above READ COMMITTED: the claim waited for a concurrent request's row, which then
    /// committed (40001). A new transaction, with a new snapshot, sees what it committed.
    NewSnapshot,
    Database(sqlx::Error),
}

/// An open transaction that holds a key's claim (or, for an unkeyed request, records
/// nothing). Dropping it rolls everything back.
pub(crate) struct Attempt {
    store: Store,
    tx: OpenTransaction,
    claim: Option<Claim>,
    /// The default mode's hold on the claimed key; `None` in portable mode, where the
    /// claim inserted the key's row.
    held: Option<Held>,
    isolation: Isolation,
    /// What the work leaves for the commit.
    state: AttemptState,
}

/// What is needed to claim a key again after its attempt was aborted.
pub(crate) struct Retake {
    store: Store,
    claim: Claim,
    isolation: Isolation,
}

impl std::fmt::Debug for Retake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retake")
            .field("scope", &self.claim.key.scope)
            .finish_non_exhaustive()
    }
}

/// How many new snapshots a claim above READ COMMITTED takes after 40001 before it
/// answers "in use": each follows a commit of the key's row, so the next one sees it.
const NEW_SNAPSHOTS: u32 = 3;

/// How long a claim waits on the lock of an expired row: longer than a sweeper's batch
/// takes to delete (milliseconds), so that sweeping never answers 409.
const EXPIRY_WAIT: Duration = Duration::from_secs(1);

/// Opens the transaction and, with a claim, claims its key.
pub(crate) async fn begin(
    store: &Store,
    claim: Option<Claim>,
    isolation: Isolation,
) -> Result<Begun, Refusal> {
    if let Some(request) = &claim {
        if let Some(row) = earlier(store, request).await? {
            return replay(row, &request.fingerprint);
        }
    }
    if store.inner.table.portable() {
        return begin_portable(store, claim, isolation).await;
    }
    let Some(request) = &claim else {
        return Ok(Begun::Run(Attempt {
            store: store.clone(),
            tx: open(store, isolation).await?,
            claim: None,
            held: None,
            isolation,
            state: AttemptState::default(),
        }));
    };
    let mut snapshots = 0;
    loop {
        match take(store, request, isolation).await {
            Ok((tx, Took::Held(held))) => {
                return Ok(Begun::Run(Attempt {
                    store: store.clone(),
                    tx,
                    claim,
                    held: Some(held),
                    isolation,
                    state: AttemptState::default(),
                }))
            }
            // Nothing was written, and no lock taken: the transaction's ROLLBACK goes out
            // after the answer.
            Ok((_, Took::Stored(row))) => return replay(row, &request.fingerprint),
            Err(ClaimError::InUse) => return Err(Refusal::InUse),
            // The request it waited for has ended; a new snapshot sees its record.
            Err(ClaimError::NewSnapshot) if snapshots < NEW_SNAPSHOTS => snapshots += 1,
            Err(ClaimError::NewSnapshot) => return Err(Refusal::InUse),
            Err(ClaimError::Database(e)) => return Err(Refusal::from_database(e)),
        }
    }
}

/// The key's live record where an earlier configuration kept it
/// ([`crate::spread::earlier_places`]), in each place while its scope has live records
/// there ([`crate::spread::Earlier`]): once they have expired, this costs nothing.
async fn earlier(store: &Store, claim: &Claim) -> Result<Option<StoredRow>, Refusal> {
    let settings = &store.inner;
    let places =
        crate::spread::earlier_places(&claim.key, settings.dialect, settings.require_principal);
    for place in places {
        let live = settings
            .earlier
            .live(&settings.table, &settings.pool, &place.scope, place.place)
            .await;
        if !live {
            continue;
        }
        match settings.table.earlier(&settings.pool, &place).await {
            Ok(Some(Found::Stored(row))) if !row.expired && row.status.is_some() => {
                return Ok(Some(row))
            }
            Ok(_) => {}
            Err(e) => return Err(Refusal::from_database(e)),
        }
    }
    Ok(None)
}

/// A transaction of the store's pool at `isolation`, waited for no longer than the
/// store's acquire timeout.
async fn open(store: &Store, isolation: Isolation) -> Result<OpenTransaction, Refusal> {
    open_with(store, isolation.begin().to_owned(), Duration::ZERO)
        .await
        .map(|(tx, _)| tx)
        .map_err(Refusal::from_database)
}

/// A transaction of the store's pool, begun by `sql` (BEGIN and what rides it), and the
/// rows `sql` returned. Waiting for a connection and for the message's answer is bounded
/// by the store's acquire timeout, as sqlx's own BEGIN was, plus `wait`, how long a claim
/// riding BEGIN may wait for another request (its `lock_timeout`).
async fn open_with(
    store: &Store,
    sql: String,
    wait: Duration,
) -> Result<(OpenTransaction, Vec<sqlx::postgres::PgRow>), sqlx::Error> {
    let settings = &store.inner;
    let begin = async {
        let conn = settings.pool.acquire().await?;
        OpenTransaction::begin(conn, sql, settings.table.prepared()).await
    };
    match tokio::time::timeout(settings.acquire_timeout + wait, begin).await {
        Ok(begun) => begun,
        Err(_elapsed) => Err(sqlx::Error::PoolTimedOut),
    }
}

/// How [`take`] ended.
enum Took {
    /// This transaction holds the key.
    Held(Held),
    /// The key's live record.
    Stored(StoredRow),
}

/// A key held by its advisory lock (the default mode): what its row's insert needs.
#[derive(Clone, Copy)]
struct Held {
    /// The transaction's start ([`Taken::began`](crate::table::Taken::began)).
    began: f64,
    /// Whether the claim saw a row to write over.
    over: bool,
}

/// The default mode's claim ([`Table::begin_taking`](crate::table::Table::begin_taking)):
/// tries the key's lock, then reads its row, in the message that begins the transaction;
/// a duplicate in flight is answered at once, or, with a conflict wait, waited for
/// ([`Table::wait`](crate::table::Table::wait)) and read again.
async fn take(
    store: &Store,
    claim: &Claim,
    isolation: Isolation,
) -> Result<(OpenTransaction, Took), ClaimError> {
    let settings = &store.inner;
    let table = &settings.table;
    let lock = table.lock_id(&claim.key);
    let statement_timeout = claim.statement_timeout.or(settings.statement_timeout);
    let sql = table.begin_taking(isolation.begin(), &claim.key, lock, statement_timeout);
    // The claim tries the key's lock; it does not wait for it.
    let (mut tx, rows) = open_with(store, sql, Duration::ZERO)
        .await
        .map_err(ClaimError::Database)?;
    let (tried, stored) = match &rows[..] {
        [tried] => (tried, None),
        [tried, row] => (tried, Some(row)),
        _ => {
            return Err(ClaimError::Database(sqlx::Error::Protocol(format!(
                "the claim returned {} rows",
                rows.len()
            ))))
        }
    };
    let tried = table::tried(tried).map_err(ClaimError::Database)?;
    let mut stored = stored
        .map(table::stored)
        .transpose()
        .map_err(ClaimError::Database)?;
    // Its message names the setting; the adapter logs it (a 500).
    table
        .pinned_path(&tried.search_path)
        .map_err(ClaimError::Database)?;
    // A live record is replayed, whoever holds the lock.
    if let Some(row) = stored.take_if(|row| row.live()) {
        return Ok((tx, Took::Stored(row)));
    }
    table::Table::writable(tried.read_only).map_err(ClaimError::Database)?;
    if !tried.locked {
        let wait = claim.conflict_wait.unwrap_or(settings.conflict_wait);
        // The shortest wait is no wait: the lock was just tried.
        if wait <= Duration::from_millis(1) {
            return Err(ClaimError::InUse);
        }
        // The request's own statement timeout, else the session's, is given back.
        let restore = statement_timeout.map_or(tried.statement_timeout, table::lock_timeout);
        table
            .wait(&mut tx, lock, wait, &restore)
            .await
            .map_err(|error| match &error {
                // 55P03: the request in flight did not end within the wait.
                sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03") => {
                    ClaimError::InUse
                }
                _ => ClaimError::Database(error),
            })?;
        // Above READ COMMITTED the transaction's snapshot was taken before the
        // request it waited for committed: only a new transaction sees its record.
        if isolation != Isolation::ReadCommitted {
            return Err(ClaimError::NewSnapshot);
        }
        // A new statement sees what it committed (invariant 4).
        stored = table
            .take(&mut tx, &claim.key)
            .await
            .map_err(ClaimError::Database)?;
        if let Some(row) = stored.take_if(|row| row.live()) {
            return Ok((tx, Took::Stored(row)));
        }
    }
    Ok((
        tx,
        Took::Held(Held {
            began: tried.began,
            over: stored.is_some(),
        }),
    ))
}

/// Portable mode: the claim inserts the key's row, which holds the key until the
/// transaction ends ([`claim_row`]).
async fn begin_portable(
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
    let mut snapshots = 0;
    let mut checked_expiry = false;
    loop {
        round += 1;
        let Some(request) = &claim else {
            return Ok(Begun::Run(Attempt {
                store: store.clone(),
                tx: open(store, isolation).await?,
                claim: None,
                held: None,
                isolation,
                state: AttemptState::default(),
            }));
        };
        match claim_row(store, request, isolation, wait).await {
            Ok((tx, Found::Claimed)) => {
                return Ok(Begun::Run(Attempt {
                    store: store.clone(),
                    tx,
                    claim,
                    held: None,
                    isolation,
                    state: AttemptState::default(),
                }))
            }
            // Nothing was written; the transaction's ROLLBACK goes out after the answer.
            Ok((_, Found::Stored(row))) => return replay(row, &request.fingerprint),
            Err(ClaimError::InUse) => {
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
            // Not a round of waiting: the row it waited for has committed, and the next
            // snapshot replays it (or finds it expired, or mismatched).
            Err(ClaimError::NewSnapshot) if snapshots < NEW_SNAPSHOTS => {
                snapshots += 1;
                round -= 1;
            }
            Err(ClaimError::NewSnapshot) => return Err(Refusal::InUse),
            Err(ClaimError::Database(e)) => return Err(Refusal::from_database(e)),
        }
    }
}

/// Portable mode: opens the transaction, its waits riding `BEGIN`
/// ([`Table::begin_waiting`](crate::table::Table::begin_waiting)), and claims the key in
/// it: the fresh claim, or the row that holds the key.
async fn claim_row(
    store: &Store,
    claim: &Claim,
    isolation: Isolation,
    wait: Duration,
) -> Result<(OpenTransaction, Found), ClaimError> {
    let table = &store.inner.table;
    let classify = |error: sqlx::Error| match &error {
        // 55P03: our lock_timeout expired while another request held the key's row.
        sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03") => ClaimError::InUse,
        // Above READ COMMITTED, a claim that waited for a concurrent request's row fails
        // with 40001 when that request commits: a new transaction, with a new snapshot,
        // sees what it committed.
        sqlx::Error::Database(e) if e.code().as_deref() == Some("40001") => ClaimError::NewSnapshot,
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
    // BEGIN and the waits by `SET LOCAL` for the whole claim: one message.
    let sql = crate::table::Table::begin_waiting(isolation.begin(), timeouts);
    let (mut tx, rows) = open_with(store, sql, wait).await.map_err(classify)?;
    let settings = rows.first().ok_or_else(|| {
        ClaimError::Database(sqlx::Error::Protocol(
            "the claim's settings were not read".into(),
        ))
    })?;
    let saved = crate::table::Table::saved(settings, timeouts).map_err(classify)?;
    // As in the default mode's claim: each names the setting, and the adapter logs it.
    table
        .pinned_path(&saved.search_path)
        .and_then(|()| crate::table::Table::writable(saved.read_only))
        .map_err(ClaimError::Database)?;
    // Claims go round at most a few times, and only under races with expiry: a row seen
    // expired is reclaimed by another request first, or deleted by a sweeper.
    let claimed = 'rounds: {
        for _ in 0..4 {
            let found = match table
                .claim(&mut tx, key, fingerprint, timeouts)
                .await
                .map_err(classify)?
            {
                Some(found) => found,
                // The conflicting row committed after the claim's snapshot began (the claim
                // waited for it): a new statement sees it.
                None => match table.read(&mut tx, key).await.map_err(classify)? {
                    Some(found) => found,
                    None => continue,
                },
            };
            match found {
                Found::Stored(row) if row.expired || row.status.is_none() => {}
                Found::Claimed => break 'rounds true,
                found => return Ok((tx, found)),
            }
            if table
                .reclaim(&mut tx, key, fingerprint, timeouts)
                .await
                .map_err(classify)?
            {
                break 'rounds true;
            }
        }
        false
    };
    if claimed {
        // The handler does not inherit the claim's wait.
        table
            .restore_wait(&mut tx, &saved)
            .await
            .map_err(classify)?;
        return Ok((tx, Found::Claimed));
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
        let key = self.claim.as_ref().map(|c| &c.key);
        let began = self.held.map(|held| held.began);
        let request = self.claim.as_ref().map(|c| Request {
            fingerprint: &c.fingerprint,
            ttl: c.ttl,
            began,
        });
        Tx::new(&mut self.tx, &self.store, key, request, &mut self.state)
    }

    /// The claimed key; `None` for an attempt that records nothing.
    pub(crate) fn key(&self) -> Option<&KeyInScope> {
        self.claim.as_ref().map(|c| &c.key)
    }

    /// Stores `record` with the key and commits it with everything the work wrote.
    /// Without a key, only commits.
    pub(crate) async fn commit(self, record: &Record) -> Result<Committed, CommitError> {
        let Self {
            store,
            tx,
            claim,
            held,
            isolation,
            mut state,
        } = self;
        let Some(claim) = claim else {
            return tx
                .commit()
                .await
                .map_err(CommitError::from_database)
                .map(|()| Committed::Stored);
        };
        let table = &store.inner.table;
        if state.wakes_relays {
            if let Some(wake) = store.inner.outbox.wake() {
                state.rides_commit.push(wake.to_owned());
            }
        }
        let written = match held {
            // The key's row rides COMMIT: committed when the message succeeds. If its
            // answer is lost, the caller cannot tell whether COMMIT happened: it answers
            // "unavailable", and the retry either replays the record or runs afresh.
            Some(held) => {
                let row = Inserting {
                    key: &claim.key,
                    fingerprint: &claim.fingerprint,
                    ttl: claim.ttl,
                    began: held.began,
                    over: held.over,
                };
                match tx
                    .finish(
                        table.inserting_commit(&row, record, &state.rides_commit),
                        table.prepared(),
                    )
                    .await
                {
                    Ok(()) => return Ok(Committed::Stored),
                    Err(sqlx::Error::Database(e))
                        if e.code().as_deref() == Some("22P02")
                            && e.message().contains(table::LOST) =>
                    {
                        Written::Lost
                    }
                    Err(sqlx::Error::Database(e))
                        if e.code().as_deref() == Some("22P02")
                            && e.message().contains(table::ESCAPED) =>
                    {
                        Written::Escaped
                    }
                    Err(e) if table.is_key_conflict(&e) => Written::Lost,
                    Err(e) => Written::Failed(e),
                }
            }
            // Portable mode: the response rides COMMIT, into the row the claim inserted.
            None => match tx
                .finish(
                    table.storing_commit(&claim.key, claim.ttl, record, &state.rides_commit),
                    None,
                )
                .await
            {
                Ok(()) => return Ok(Committed::Stored),
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some("22P02")
                        && e.message().contains(table::ESCAPED) =>
                {
                    Written::Escaped
                }
                Err(e) => Written::Failed(e),
            },
        };
        match written {
            Written::Escaped => {
                escaped(&store, &claim.key).await;
                Err(CommitError::Escaped)
            }
            // Another attempt with this key committed first (invariant 3): one that the
            // lock did not keep out, such as an instance of an earlier version during a
            // rolling upgrade, or a duplicate that committed between the claim's read and
            // its lock. Nothing of this attempt commits; the key's answer is the winner's.
            Written::Lost => {
                let retake = Retake {
                    store,
                    claim,
                    isolation,
                };
                match retake.winner().await {
                    Ok(record) => Ok(Committed::Superseded(record)),
                    Err(refusal) => Err(CommitError::Refused(refusal)),
                }
            }
            // 25P02: a statement of the work failed, and it answered all the same.
            Written::Failed(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => {
                Err(CommitError::Aborted(Some(Retake {
                    store,
                    claim,
                    isolation,
                })))
            }
            Written::Failed(e) => Err(CommitError::from_database(e)),
        }
    }

    /// Commits what the work wrote, storing nothing: only for an attempt without a key.
    ///
    /// With `claims_success` (the answer is a 2xx or 3xx), one statement before COMMIT,
    /// in the same message, asks whether a statement of the work failed: PostgreSQL
    /// answers the COMMIT of such a transaction with a silent ROLLBACK, and the success
    /// would claim writes that never happened ([`CommitError::Aborted`], as for a keyed
    /// attempt); the failed question makes PostgreSQL skip the COMMIT. Any other answer
    /// commits at once: a rejection after a failed statement is true either way.
    pub(crate) async fn commit_unrecorded(self, claims_success: bool) -> Result<(), CommitError> {
        debug_assert!(self.claim.is_none(), "a claimed key must commit its record");
        let sql = if claims_success {
            "SELECT 1;\nCOMMIT"
        } else {
            "COMMIT"
        };
        match self.tx.finish(sql.to_owned(), None).await {
            Ok(()) => Ok(()),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => {
                Err(CommitError::Aborted(None))
            }
            Err(e) => Err(CommitError::from_database(e)),
        }
    }

    /// Rolls back everything the work wrote, and the claim with it.
    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

/// What [`Retake::store_alone`] did.
#[derive(Debug)]
pub(crate) enum Alone {
    /// The answer is stored, and committed by itself.
    Stored,
    /// Another attempt claimed the key after the aborted one rolled back, and committed
    /// this record: it is the key's answer now.
    Replay(Record),
}

impl Retake {
    /// Stores `record` as the key's answer in a transaction of its own, with none of the
    /// aborted work's writes (PostgreSQL rolled all of them back). The key is claimed
    /// afresh, so the primary key still decides (invariant 3): a concurrent attempt that
    /// claimed it in between wins, and its outcome is answered.
    pub(crate) async fn store_alone(self, record: &Record) -> Result<Alone, Refusal> {
        let Self {
            store,
            claim,
            isolation,
        } = self;
        match begin(&store, Some(claim), isolation).await? {
            Begun::Run(attempt) => match attempt.commit(record).await {
                Ok(Committed::Stored) => Ok(Alone::Stored),
                Ok(Committed::Superseded(record)) => Ok(Alone::Replay(record)),
                Err(CommitError::Refused(refusal)) => Err(refusal),
                Err(CommitError::Unavailable(e)) => Err(Refusal::Unavailable(e)),
                Err(CommitError::Serialization(e) | CommitError::Database(e)) => {
                    Err(Refusal::Database(e))
                }
                // Nothing runs in this attempt but the store itself, so nothing can end
                // or abort its transaction.
                Err(CommitError::Escaped | CommitError::Aborted(_)) => Err(Refusal::Database(
                    sqlx::Error::Protocol("the answer's own transaction was aborted".into()),
                )),
            },
            Begun::Replay(record) => Ok(Alone::Replay(record)),
        }
    }
}

impl Retake {
    /// The record of the attempt that committed this key first, read by a new claim.
    async fn winner(self) -> Result<Record, Refusal> {
        match begin(&self.store, Some(self.claim), self.isolation).await? {
            Begun::Replay(record) => Ok(record),
            // The winner's record is gone already (expired and swept): the key is free,
            // and a retry runs afresh.
            Begun::Run(_) => Err(Refusal::InUse),
        }
    }
}

/// Why the key's record was not committed.
enum Written {
    /// The work ended the transaction itself (invariant 6).
    Escaped,
    /// Another attempt's record holds the key (invariant 3).
    Lost,
    Failed(sqlx::Error),
}

/// The work ran `COMMIT` or `ROLLBACK` itself (invariant 6): its writes may have
/// committed without the key's record. In portable mode the claim's row may have
/// committed with them, and is removed so the key is not stuck (the claim path would
/// take such a row over anyway); in the default mode the key's row is only ever written
/// with its record, so nothing of idem's committed.
async fn escaped(store: &Store, key: &KeyInScope) {
    tracing::error!(
        scope = &*key.scope,
        "idem: the handler ended its transaction itself (raw COMMIT or ROLLBACK); \
         its writes escaped the idempotency guarantee; nothing was stored"
    );
    if !store.inner.table.portable() {
        return;
    }
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
                    key: crate::IdempotencyKey::parse(key.as_bytes()).unwrap(),
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
        let store = db.store_with(crate::StoreBuilder::portable);
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
}
