//! The engine: one idempotent attempt in PostgreSQL terms, from the claim of a key to
//! the commit of its record. It knows nothing of HTTP; the HTTP adapter
//! ([`crate::web`]) and [`Store::run_once`](crate::Store::run_once) sit above it and
//! decide what its refusals look like to their callers.
//!
//! [`begin`] opens the transaction and claims the key: either the caller runs its work
//! in the returned [`Attempt`], or a stored [`Record`] is replayed, or a [`Refusal`]
//! says why neither. The invariants this relies on (ARCHITECTURE.md):
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

mod portable;
mod take;
#[cfg(test)]
mod tests;

use portable::begin_portable;
use take::{take, Held, Took};

use std::time::{Duration, Instant};

use crate::fingerprint::Fingerprint;
use crate::identity::KeyInScope;
use crate::sqlstate;
use crate::sqlstate::{is_serialization_failure, is_unavailable};
use crate::store::Store;
use crate::table::{self, Found, Inserting, Isolation, Record, StoredRow, Timeouts};
use crate::transaction::{is_unguarded, OpenTransaction};
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
    /// The key's request is being abandoned ([`crate::complete`]): its undos are running,
    /// and once they have, the key answers its 410 (invariant 14).
    Abandoning,
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

/// Whether a finishing message failed because the work ended the transaction itself
/// (invariant 6): its check found the transaction gone ([`table::ESCAPED`]), or idem's
/// guard was gone with it ([`is_unguarded`]).
fn ended_by_work(error: &sqlx::Error) -> bool {
    is_unguarded(error)
        || matches!(error, sqlx::Error::Database(e)
            if e.code().as_deref() == Some(sqlstate::INVALID_TEXT_REPRESENTATION) && e.message().contains(table::ESCAPED))
}

impl CommitError {
    /// A finishing message's failure.
    fn from_finish(error: sqlx::Error) -> Self {
        if ended_by_work(&error) {
            Self::Escaped
        } else {
            Self::from_database(error)
        }
    }

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
    /// The database cannot take the request's writes now (a standby).
    Unavailable(sqlx::Error),
    Database(sqlx::Error),
}

impl From<table::Unwritable> for ClaimError {
    fn from(unwritable: table::Unwritable) -> Self {
        match unwritable {
            table::Unwritable::Standby(e) => Self::Unavailable(e),
            table::Unwritable::ReadOnly(e) => Self::Database(e),
        }
    }
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
    /// The transaction's start, as the claim read it (the event ids' and the key row's
    /// `began`); `None` without a key.
    began: Option<f64>,
    isolation: Isolation,
    /// What the work leaves for the commit.
    state: AttemptState,
    /// When the claim was asked for, before its transaction began: the database counts
    /// the key's expiry from later ([`crate::answers`]).
    opened: Instant,
}

/// A record just committed for `claim`: kept in the store's
/// [`replay_cache`](crate::StoreBuilder::replay_cache), if it has one, until its key's
/// expiry counted from `opened`.
fn kept(store: &Store, claim: &Claim, record: &Record, opened: Instant, since: u64) -> Committed {
    // An abandon's marker is no answer: the 410 replaces it.
    if record.status == table::ABANDONING {
        return Committed::Stored;
    }
    if let Some(answers) = &store.inner.answers {
        answers.keep(
            &claim.key,
            claim.fingerprint.combined(),
            claim.fingerprint.parts(),
            record,
            opened.checked_add(claim.ttl),
            since,
        );
    }
    Committed::Stored
}

/// Where the store's replay cache stands, read before the database is asked for what it
/// may keep ([`crate::answers::Answers::generation`]).
fn generation(store: &Store) -> u64 {
    store
        .inner
        .answers
        .as_ref()
        .map_or(0, crate::answers::Answers::generation)
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
    let opened = Instant::now();
    // Without a key there is nothing to claim, in every mode.
    let Some(claim) = claim else {
        return Ok(Begun::Run(Attempt {
            store: store.clone(),
            tx: open(store, isolation).await?,
            claim: None,
            held: None,
            began: None,
            isolation,
            state: AttemptState::default(),
            opened,
        }));
    };
    // A retry of an answer kept in memory asks PostgreSQL nothing.
    if let Some(answers) = &store.inner.answers {
        if let Some(record) = answers.get(&claim.key, &claim.fingerprint) {
            return Ok(Begun::Replay(record));
        }
    }
    // Before anything is read that the cache may keep.
    let since = generation(store);
    if let Some(row) = earlier(store, &claim).await? {
        return replay(store, row, &claim, since);
    }
    if store.inner.table.portable() {
        return begin_portable(store, claim, isolation, opened, since).await;
    }
    let request = &claim;
    let mut snapshots = 0;
    loop {
        match take(store, request, isolation).await {
            Ok((tx, Took::Held(held))) => {
                return Ok(Begun::Run(Attempt {
                    store: store.clone(),
                    tx,
                    claim: Some(claim),
                    held: Some(held),
                    began: Some(held.began),
                    isolation,
                    state: AttemptState::default(),
                    opened,
                }))
            }
            // Nothing was written, and no lock taken: the transaction's ROLLBACK goes out
            // after the answer.
            Ok((_, Took::Stored(row))) => return replay(store, row, request, since),
            Err(ClaimError::InUse) => return Err(Refusal::InUse),
            // The request it waited for has ended; a new snapshot sees its record.
            Err(ClaimError::NewSnapshot) if snapshots < NEW_SNAPSHOTS => snapshots += 1,
            Err(ClaimError::NewSnapshot) => return Err(Refusal::InUse),
            Err(ClaimError::Unavailable(e)) => return Err(Refusal::Unavailable(e)),
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
    open_with(store, isolation.begin().to_owned(), Duration::ZERO, false)
        .await
        .map(|(tx, _)| tx)
        .map_err(Refusal::from_database)
}

/// A transaction of the store's pool, begun by `sql` (BEGIN and what rides it), and the
/// rows `sql` returned. Waiting for a connection and for the message's answer is bounded
/// by the store's acquire timeout, as sqlx's own BEGIN was, plus `wait`, how long a claim
/// riding BEGIN may wait for another request (its `lock_timeout`). With `prepare_first`,
/// the connection prepares the store's statements before `sql` is sent, for a
/// transaction whose first message executes none of them but whose later ones may.
async fn open_with(
    store: &Store,
    sql: String,
    wait: Duration,
    prepare_first: bool,
) -> Result<(OpenTransaction, Vec<sqlx::postgres::PgRow>), sqlx::Error> {
    let settings = &store.inner;
    let begin = async {
        let mut conn = settings.pool.acquire().await?;
        if let Some(prepared) = settings.table.prepared().filter(|_| prepare_first) {
            prepared.ensure(&mut conn).await?;
        }
        OpenTransaction::begin(
            conn,
            sql,
            settings.table.prepared(),
            !settings.table.portable(),
        )
        .await
    };
    match tokio::time::timeout(settings.acquire_timeout + wait, begin).await {
        Ok(begun) => begun,
        Err(_elapsed) => Err(sqlx::Error::PoolTimedOut),
    }
}

/// A stored row: its record when the fingerprint matches, kept in the store's
/// [`replay_cache`](crate::StoreBuilder::replay_cache) if it has one.
fn replay(store: &Store, row: StoredRow, claim: &Claim, since: u64) -> Result<Begun, Refusal> {
    if !claim
        .fingerprint
        .matches(&row.fingerprint, &row.field_hashes)
    {
        return Err(Refusal::Mismatch);
    }
    if row.status == Some(table::ABANDONING as i16) {
        return Err(Refusal::Abandoning);
    }
    let status = row
        .status
        .and_then(|s| u16::try_from(s).ok())
        .filter(|s| (100..=999).contains(s))
        .ok_or(Refusal::Unreadable)?;
    let record = Record {
        status,
        headers: row.headers.unwrap_or_default(),
        body: row.body.unwrap_or_default().into(),
    };
    if let Some(answers) = &store.inner.answers {
        answers.keep(
            &claim.key,
            &row.fingerprint,
            row.field_hashes,
            &record,
            None,
            since,
        );
    }
    Ok(Begun::Replay(record))
}

impl Attempt {
    /// The transaction, lent to the work.
    pub(crate) fn tx(&mut self) -> Tx<'_> {
        let key = self.claim.as_ref().map(|c| &c.key);
        let began = self.began;
        let request = self.claim.as_ref().map(|c| Request {
            fingerprint: &c.fingerprint,
            ttl: c.ttl,
            began,
        });
        Tx::new(&mut self.tx, &self.store, key, request, &mut self.state)
    }

    /// Makes the attempt completable ([`crate::complete`]): its stored request is
    /// deleted with its steps at COMMIT, and `request` (none for a completion, whose
    /// request is stored already) is stored with its first step record.
    pub(crate) fn capture(
        &mut self,
        request: Option<std::sync::Arc<crate::table::requests::StoredRequest>>,
    ) {
        self.state.completable = true;
        self.state.capture = request;
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
            opened,
            ..
        } = self;
        let Some(claim) = claim else {
            return tx
                .commit()
                .await
                .map_err(CommitError::from_finish)
                .map(|()| Committed::Stored);
        };
        let table = &store.inner.table;
        // Before the COMMIT: a purge after it may delete what it stores.
        let since = generation(&store);
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
                    Ok(()) => return Ok(kept(&store, &claim, record, opened, since)),
                    Err(sqlx::Error::Database(e))
                        if e.code().as_deref() == Some(sqlstate::INVALID_TEXT_REPRESENTATION)
                            && e.message().contains(table::LOST) =>
                    {
                        Written::Lost
                    }
                    Err(e) if ended_by_work(&e) => Written::Escaped,
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
                Ok(()) => return Ok(kept(&store, &claim, record, opened, since)),
                Err(e) if ended_by_work(&e) => Written::Escaped,
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
            Written::Failed(sqlx::Error::Database(e))
                if e.code().as_deref() == Some(sqlstate::IN_FAILED_SQL_TRANSACTION) =>
            {
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
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some(sqlstate::IN_FAILED_SQL_TRANSACTION) =>
            {
                Err(CommitError::Aborted(None))
            }
            Err(e) => Err(CommitError::from_finish(e)),
        }
    }

    /// Rolls back everything the work wrote, and the claim with it.
    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

/// Opens a transaction holding the abandoning marker of `claim`'s key (committed by an
/// earlier attempt of the abandon, [`table::ABANDONING`]), in which the abandon's undos
/// run as steps, fenced by it, and its 410 commits over the marker
/// ([`Attempt::commit_abandoned`]). `None` when the key holds no marker (the abandon
/// has ended).
pub(crate) async fn hold_abandoning(
    store: &Store,
    claim: Claim,
) -> Result<Option<Attempt>, Refusal> {
    let opened = Instant::now();
    let sql = store.inner.table.holding_abandoning(&claim.key);
    // The undos' steps ride statements executed by name: the connection prepares them
    // first, as no statement of this message would make it.
    let (tx, rows) = open_with(store, sql, Duration::ZERO, true)
        .await
        .map_err(Refusal::from_database)?;
    if rows.is_empty() {
        return Ok(None);
    }
    Ok(Some(Attempt {
        store: store.clone(),
        tx,
        claim: Some(claim),
        held: None,
        began: None,
        isolation: Isolation::ReadCommitted,
        state: AttemptState::default(),
        opened,
    }))
}

impl Attempt {
    /// Commits `record` over the key's abandoning marker, which this attempt holds
    /// ([`hold_abandoning`]), with what rides the COMMIT.
    pub(crate) async fn commit_abandoned(self, record: &Record) -> Result<(), CommitError> {
        let Self {
            store,
            tx,
            claim,
            state,
            ..
        } = self;
        let Some(claim) = claim else {
            return Err(CommitError::Escaped);
        };
        let sql = store
            .inner
            .table
            .abandoned_commit(&claim.key, record, &state.rides_commit);
        tx.finish(sql, None).await.map_err(CommitError::from_finish)
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
        "idem: the handler ended its transaction itself (a raw ROLLBACK, or sqlx's \
         rollback() of a unit begun on the request's connection); nothing was stored, and \
         what it wrote after that escaped the idempotency guarantee: write its statements \
         on the connection it is given, without begin(), commit() or rollback()"
    );
    if !store.inner.table.portable() {
        return;
    }
    if let Err(e) = store.inner.table.forget(&store.inner.pool, key).await {
        tracing::warn!(error = %e, "idem: could not remove the escaped claim");
    }
}
