//! The default mode's claim (and behind a transaction pooler): the key's advisory lock
//! tried and its row read in the message that begins the transaction, and, with a
//! conflict wait, the wait for a duplicate in flight.

use super::*;
use crate::sqlstate;

/// How [`take`] ended.
pub(super) enum Took {
    /// This transaction holds the key.
    Held(Held),
    /// The key's live record.
    Stored(StoredRow),
}

/// A key held by its advisory lock (the default mode): what its row's insert needs.
#[derive(Clone, Copy)]
pub(super) struct Held {
    /// The transaction's start ([`Tried::began`](crate::table::Tried::began)).
    pub(super) began: f64,
    /// Whether the claim saw a row to write over.
    pub(super) over: bool,
}

/// The default mode's claim ([`Table::begin_taking`](crate::table::Table::begin_taking)):
/// tries the key's lock, then reads its row, in the message that begins the transaction;
/// a duplicate in flight is answered at once, or, with a conflict wait, waited for
/// ([`Table::wait`](crate::table::Table::wait)) and read again.
pub(super) async fn take(
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
    let (mut tx, rows) = open_with(store, sql, Duration::ZERO, false)
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
    table::Table::writable(&tried.access)?;
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
                sqlx::Error::Database(e)
                    if e.code().as_deref() == Some(sqlstate::LOCK_NOT_AVAILABLE) =>
                {
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
