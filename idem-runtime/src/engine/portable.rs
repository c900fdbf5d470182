//! The portable mode's claim: the key's uncommitted row is its lock, a duplicate's
//! insert waits for it under `lock_timeout`, and an expired row is taken over in place.

use super::*;
use crate::sqlstate;

/// Portable mode: the claim inserts the key's row, which holds the key until the
/// transaction ends ([`claim_row`]).
pub(super) async fn begin_portable(
    store: &Store,
    claim: Claim,
    isolation: Isolation,
    opened: Instant,
    since: u64,
) -> Result<Begun, Refusal> {
    let settings = &store.inner;
    let mut wait = claim.conflict_wait.unwrap_or(settings.conflict_wait);
    // A short lock_timeout also expires on locks that have nothing to do with this key,
    // such as the relation-extension lock of concurrent inserts. A duplicate in flight
    // holds its key for its whole handler and times out again; a passing lock does not.
    // So a short wait is tried three times, 5 ms and then 25 ms apart.
    let attempts = if wait < Duration::from_secs(1) { 3 } else { 1 };
    let mut round = 0;
    let mut snapshots = 0;
    let mut checked_expiry = false;
    let request = &claim;
    let (tx, began) = loop {
        round += 1;
        match claim_row(store, request, isolation, wait).await {
            Ok((tx, Found::Claimed, began)) => break (tx, began),
            // Nothing was written; the transaction's ROLLBACK goes out after the answer.
            Ok((_, Found::Stored(row), _)) => return replay(store, row, request, since),
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
            Err(ClaimError::Unavailable(e)) => return Err(Refusal::Unavailable(e)),
            Err(ClaimError::Database(e)) => return Err(Refusal::from_database(e)),
        }
    };
    Ok(Begun::Run(Attempt {
        store: store.clone(),
        tx,
        claim: Some(claim),
        held: None,
        began: Some(began),
        isolation,
        state: AttemptState::default(),
        opened,
    }))
}

/// Portable mode: opens the transaction, its waits riding `BEGIN`
/// ([`Table::begin_waiting`](crate::table::Table::begin_waiting)), and claims the key in
/// it: the fresh claim, or the row that holds the key.
pub(super) async fn claim_row(
    store: &Store,
    claim: &Claim,
    isolation: Isolation,
    wait: Duration,
) -> Result<(OpenTransaction, Found, f64), ClaimError> {
    let table = &store.inner.table;
    let classify = |error: sqlx::Error| match &error {
        // 55P03: our lock_timeout expired while another request held the key's row.
        sqlx::Error::Database(e) if e.code().as_deref() == Some(sqlstate::LOCK_NOT_AVAILABLE) => {
            ClaimError::InUse
        }
        // Above READ COMMITTED, a claim that waited for a concurrent request's row fails
        // with 40001 when that request commits: a new transaction, with a new snapshot,
        // sees what it committed.
        sqlx::Error::Database(e)
            if e.code().as_deref() == Some(sqlstate::SERIALIZATION_FAILURE) =>
        {
            ClaimError::NewSnapshot
        }
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
    let (mut tx, rows) = open_with(store, sql, wait, false).await.map_err(classify)?;
    let settings = rows.first().ok_or_else(|| {
        ClaimError::Database(sqlx::Error::Protocol(
            "the claim's settings were not read".into(),
        ))
    })?;
    let saved = crate::table::Table::saved(settings, timeouts).map_err(classify)?;
    // As in the default mode's claim: each names the setting, and the adapter logs it.
    table
        .pinned_path(&saved.search_path)
        .map_err(ClaimError::Database)?;
    crate::table::Table::writable(&saved.access)?;
    // Claims go round at most a few times, and only under races with expiry: a row seen
    // expired is reclaimed by another request first, or deleted by a sweeper.
    let claimed = 'rounds: {
        for round in 0..4 {
            // The first claim declares idem's guard too (invariant 6).
            let found = if round == 0 {
                let found = table
                    .claim_guarded(&mut tx, key, fingerprint, timeouts)
                    .await;
                tx.guarded_since_claim();
                found
            } else {
                table.claim(&mut tx, key, fingerprint, timeouts).await
            };
            let found = match found.map_err(classify)? {
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
                found => return Ok((tx, found, saved.began)),
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
        return Ok((tx, Found::Claimed, saved.began));
    }
    Err(ClaimError::InUse)
}
