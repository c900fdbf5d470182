//! One idempotent request: claim the key, run the handler, store the response, commit,
//! all in one PostgreSQL transaction; or replay what a previous request stored.
//!
//! The invariants this relies on (DESIGN.md):
//!
//! 1. **One transaction.** The claim, the handler's writes and the stored response
//!    commit together. There is no "mark complete" step that could be lost.
//! 2. **No stuck keys.** An unfinished claim is an uncommitted row: a crash, a dropped
//!    connection or a dropped future rolls it back. No lease, no reaper.
//! 3. **The primary key is the final arbiter.** Concurrent claims of one key serialize
//!    on the row; the loser waits (up to `lock_timeout`) and then replays, or gets 409.
//! 4. **READ COMMITTED.** The read after a claim that waited is a new statement, so it
//!    sees the row the winner committed.
//! 7. **Cancellation-safe.** The transaction is sqlx's `Transaction`, rolled back when
//!    dropped: a client that disconnects mid-request leaves nothing behind.

use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres, Row, Transaction};

use crate::fingerprint::Fingerprint;
use crate::observe::{Observation, Outcome};
use crate::problem::types;
use crate::response::{CaptureError, StoredResponse, IDEMPOTENT_RECORDED};
use crate::store::{is_unavailable, Idempotency};
use crate::tx::{KeyInScope, Tx};

/// What a handler answered, and whether it may commit: `Ok` below 500 commits and is
/// replayed; `Err`, or any 5xx, rolls everything back so the client may retry.
#[derive(Debug)]
pub struct Answer {
    pub(crate) response: Response,
    pub(crate) commit: bool,
}

impl Answer {
    /// An `Ok` answer: final unless it is a 5xx.
    pub fn ok(response: impl IntoResponse) -> Self {
        let response = response.into_response();
        let commit = !response.status().is_server_error();
        Self { response, commit }
    }

    /// An `Err` answer: rolled back, retryable.
    pub fn err(response: impl IntoResponse) -> Self {
        Self {
            response: response.into_response(),
            commit: false,
        }
    }
}

/// One request's claim: where the key lives and what it must match.
pub(crate) struct Request {
    pub(crate) key: KeyInScope,
    pub(crate) ttl: Duration,
    pub(crate) fingerprint: Fingerprint,
    /// The endpoint's own wait for a request in flight, in milliseconds, instead of
    /// the store's.
    pub(crate) conflict_wait: Option<u64>,
}

/// A row found by the claim.
struct Stored {
    fingerprint: Vec<u8>,
    field_hashes: Vec<u8>,
    status: Option<i16>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
    expired: bool,
}

enum Claim {
    Fresh,
    Stored(Stored),
}

/// Failures of the claim, each with its answer.
enum ClaimError {
    /// Another request with this key holds it (lock_timeout) or won the race.
    InUse,
    Database(sqlx::Error),
}

/// The open transaction the handler runs in, lent to it as [`Tx`], then finished with
/// its [`Answer`]. With a key, the transaction holds the key's claim; without one (an
/// endpoint with `required = false`), it records nothing. Dropping it (a client that
/// disconnects, a timeout, a panic) rolls everything back.
pub struct Claimed {
    store: Idempotency,
    tx: Transaction<'static, Postgres>,
    key: Option<KeyInScope>,
    observation: Observation,
}

/// Answers that end a request before its handler runs.
pub(crate) fn refuse(observation: Observation, outcome: Outcome, response: Response) -> Response {
    observation.finish(outcome, response.status());
    response
}

/// Opens the transaction and, with a request key, claims it. `Err` is the answer when
/// the handler must not run: a replay, 409, 422, 503.
pub(crate) async fn claim(
    store: Idempotency,
    request: Option<Request>,
    mut observation: Observation,
) -> Result<Claimed, Response> {
    let settings = &store.inner;
    let problems = settings.problems();
    let short_wait = request
        .as_ref()
        .and_then(|r| r.conflict_wait)
        .map_or(settings.conflict_wait, Duration::from_millis)
        < Duration::from_secs(1);
    let mut attempt = 0;
    let tx = loop {
        attempt += 1;
        let begin = settings.pool.begin_with(settings.sql.begin);
        let mut tx = match tokio::time::timeout(settings.acquire_timeout, begin).await {
            Ok(Ok(tx)) => tx,
            Ok(Err(e)) => return Err(database_failure(&store, observation, &e, "begin")),
            Err(_elapsed) => {
                return Err(refuse(
                    observation,
                    Outcome::Unavailable,
                    problems.unavailable().into_response(),
                ))
            }
        };
        let Some(request) = &request else { break tx };
        match claim_row(&store, &mut tx, request).await {
            Ok(Claim::Fresh) => break tx,
            // Nothing was written; dropping the transaction frees the connection.
            Ok(Claim::Stored(stored)) => {
                return Err(replay_or_refuse(
                    &store,
                    observation,
                    stored,
                    &request.fingerprint,
                ))
            }
            // A short lock_timeout also expires on locks that have nothing to do with
            // this key, such as the relation-extension lock of concurrent inserts. A
            // duplicate in flight holds its key for its whole handler and times out
            // again; a passing lock does not. So a short wait is tried three times, 5 ms
            // and then 25 ms apart.
            Err(ClaimError::InUse) if short_wait && attempt < 3 => {
                drop(tx);
                tokio::time::sleep(Duration::from_millis(if attempt == 1 { 5 } else { 25 })).await;
                continue;
            }
            Err(ClaimError::InUse) => {
                return Err(refuse(
                    observation,
                    Outcome::Conflict,
                    problems.key_in_use().into_response(),
                ))
            }
            Err(ClaimError::Database(e)) => {
                return Err(database_failure(&store, observation, &e, "claim"))
            }
        }
    };
    observation.claimed();
    Ok(Claimed {
        store,
        tx,
        key: request.map(|r| r.key),
        observation,
    })
}

impl Claimed {
    /// The transaction, lent to the handler.
    pub fn tx(&mut self) -> Tx<'_> {
        Tx::new(&mut self.tx, self.key.as_ref())
    }

    /// The request's span, for the handler to run in.
    pub fn span(&self) -> tracing::Span {
        self.observation.span().clone()
    }

    /// Commits the handler's answer with its stored response, or rolls it back.
    pub async fn finish(self, answer: Answer) -> Response {
        let Self {
            store,
            mut tx,
            key,
            observation,
        } = self;
        let settings = &store.inner;
        let problems = settings.problems();

        if !answer.commit {
            return match tx.rollback().await {
                Ok(()) => refuse(observation, Outcome::RolledBack, answer.response),
                // The handler's error may be the symptom (its query failed because the
                // connection died); the failed rollback tells us the database is gone.
                Err(e) if is_unavailable(&e) => refuse(
                    observation,
                    Outcome::Unavailable,
                    problems.unavailable().into_response(),
                ),
                Err(e) => {
                    tracing::warn!(parent: observation.span(), error = %e, "idem: rollback failed");
                    refuse(observation, Outcome::RolledBack, answer.response)
                }
            };
        }

        let Some(key) = key else {
            // `required = false` and no key: the handler's writes commit, nothing is
            // recorded, and the response says so.
            if let Err(e) = tx.commit().await {
                return database_failure(&store, observation, &e, "commit");
            }
            let mut response = answer.response;
            response
                .headers_mut()
                .insert(IDEMPOTENT_RECORDED, HeaderValue::from_static("false"));
            return refuse(observation, Outcome::Unkeyed, response);
        };

        let captured = StoredResponse::capture(
            answer.response,
            &settings.replay_headers,
            settings.max_response_bytes,
        )
        .await;
        let (stored, parts) = match captured {
            Ok(captured) => captured,
            Err(CaptureError::TooLarge { limit }) => {
                tracing::error!(
                    scope = key.scope,
                    limit,
                    "idem: response over the stored-response cap; rolled back"
                );
                let problem = problems
                    .problem(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        types::RESPONSE_TOO_LARGE,
                        "Response too large to store",
                    )
                    .with_detail(format!(
                        "the response body exceeds the {limit}-byte cap for stored responses; nothing was committed"
                    ));
                return refuse(observation, Outcome::RolledBack, problem.into_response());
            }
            Err(CaptureError::Body(e)) => {
                tracing::error!(error = %e, scope = key.scope, "idem: response body failed; rolled back");
                let problem =
                    problems.internal("the response body could not be read; nothing was committed");
                return refuse(observation, Outcome::RolledBack, problem.into_response());
            }
        };

        match store_response(&store, &mut tx, &key, &stored).await {
            Ok(true) => {}
            Ok(false) => return escaped(&store, observation, tx, &key).await,
            Err(e) => return database_failure(&store, observation, &e, "store"),
        }

        // If COMMIT's answer is lost, the client cannot tell whether it happened; a 503
        // makes it retry, and the retry either replays the committed response or runs
        // afresh.
        if let Err(e) = tx.commit().await {
            return database_failure(&store, observation, &e, "commit");
        }
        observation.finish(Outcome::Fresh, stored.status);
        Response::from_parts(parts, Body::from(stored.body))
    }
}

async fn claim_row(
    store: &Idempotency,
    tx: &mut Transaction<'static, Postgres>,
    request: &Request,
) -> Result<Claim, ClaimError> {
    let sql = &store.inner.sql;
    let parts = request.fingerprint.parts();
    let own_wait = request.conflict_wait.map(|ms| format!("{ms}ms"));
    let conflict_wait = own_wait.as_deref().unwrap_or(&sql.conflict_wait);
    let classify = |error: sqlx::Error| match &error {
        // 55P03: our lock_timeout expired while another request held the key's row.
        sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03") => ClaimError::InUse,
        // A unique violation of the key's own primary key: a concurrent request won.
        // Any other unique violation is not ours to interpret.
        sqlx::Error::Database(e) if e.constraint() == Some(sql.primary_key.as_str()) => {
            ClaimError::InUse
        }
        _ => ClaimError::Database(error),
    };
    // Claims go round at most a few times, and only under races with expiry: a row seen
    // expired is reclaimed by another request first, or deleted by a sweeper.
    for _ in 0..4 {
        let claim = keyed(&sql.claim, &request.key)
            .bind(request.fingerprint.combined().as_slice())
            .bind(&parts)
            .bind(request.ttl.as_secs_f64())
            .bind(conflict_wait);
        let found = match fetch(&mut *tx, claim).await.map_err(classify)? {
            Some(found) => found,
            // The conflicting row committed after the claim's snapshot began (the claim
            // waited for it): a new statement sees it.
            None => match fetch(&mut *tx, keyed(&sql.read, &request.key))
                .await
                .map_err(classify)?
            {
                Some(found) => found,
                None => continue,
            },
        };
        match found {
            Claim::Stored(stored) if stored.expired || stored.status.is_none() => {}
            claim => return Ok(claim),
        }
        let reclaimed = keyed(&sql.reclaim, &request.key)
            .bind(request.fingerprint.combined().as_slice())
            .bind(&parts)
            .bind(request.ttl.as_secs_f64())
            .bind(conflict_wait)
            .fetch_optional(&mut **tx)
            .await
            .map_err(classify)?;
        if reclaimed.is_some() {
            return Ok(Claim::Fresh);
        }
    }
    Err(ClaimError::InUse)
}

/// A statement whose first three parameters are the key: (scope, principal, key).
fn keyed<'q>(sql: &'q str, key: &'q KeyInScope) -> Query<'q, Postgres, PgArguments> {
    sqlx::query(sql)
        .bind(key.scope)
        .bind(key.principal.as_str())
        .bind(key.key.as_str())
}

/// Runs the claim or the read; `None` when neither sees a row.
async fn fetch(
    conn: &mut PgConnection,
    query: Query<'_, Postgres, PgArguments>,
) -> Result<Option<Claim>, sqlx::Error> {
    let row: Option<PgRow> = query.fetch_optional(conn).await?;
    let Some(row) = row else { return Ok(None) };
    if row.try_get::<bool, _>("fresh")? {
        return Ok(Some(Claim::Fresh));
    }
    Ok(Some(Claim::Stored(Stored {
        fingerprint: row.try_get("fingerprint")?,
        field_hashes: row.try_get("field_hashes")?,
        status: row.try_get("status")?,
        headers: row.try_get("headers")?,
        body: row.try_get("body")?,
        expired: row.try_get("expired")?,
    })))
}

fn replay_or_refuse(
    store: &Idempotency,
    observation: Observation,
    stored: Stored,
    fingerprint: &Fingerprint,
) -> Response {
    let problems = store.inner.problems();
    if !fingerprint.matches(&stored.fingerprint, &stored.field_hashes) {
        return refuse(
            observation,
            Outcome::Mismatch,
            problems.key_reused().into_response(),
        );
    }
    let status = stored
        .status
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok());
    let Some(status) = status else {
        tracing::error!("idem: stored row has an invalid status");
        let problem = problems.internal("the stored response is unreadable");
        return refuse(observation, Outcome::Failed, problem.into_response());
    };
    let replay = StoredResponse {
        status,
        headers: stored.headers.unwrap_or_default(),
        body: stored.body.unwrap_or_default().into(),
    }
    .replay();
    refuse(observation, Outcome::Replayed, replay)
}

/// Writes the response into the claimed row. `Ok(false)`: the row is not this
/// transaction's any more (the handler ended the transaction itself).
async fn store_response(
    store: &Idempotency,
    tx: &mut Transaction<'static, Postgres>,
    key: &KeyInScope,
    response: &StoredResponse,
) -> Result<bool, sqlx::Error> {
    let done = keyed(&store.inner.sql.store, key)
        .bind(i16::try_from(response.status.as_u16()).unwrap_or(i16::MAX))
        .bind(&response.headers)
        .bind(response.body.as_ref())
        .execute(&mut **tx)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// The handler ran `COMMIT` or `ROLLBACK` itself (invariant 6): its writes may have
/// committed without the key's response. Nothing is stored; the committed claim, if any,
/// is removed so the key is not stuck, and the request fails loudly.
async fn escaped(
    store: &Idempotency,
    observation: Observation,
    tx: Transaction<'static, Postgres>,
    key: &KeyInScope,
) -> Response {
    tracing::error!(
        scope = key.scope,
        "idem: the handler ended its transaction itself (raw COMMIT or ROLLBACK); \
         its writes escaped the idempotency guarantee; nothing was stored"
    );
    drop(tx);
    let forget = keyed(&store.inner.sql.forget, key)
        .execute(&store.inner.pool)
        .await;
    if let Err(e) = forget {
        // The claim path takes over such a row anyway.
        tracing::warn!(error = %e, "idem: could not remove the escaped claim");
    }
    let problem = store
        .inner
        .problems()
        .problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            types::TRANSACTION_ESCAPED,
            "Transaction ended by the handler",
        )
        .with_detail(
            "the handler committed or rolled back idem's transaction itself; nothing was stored",
        );
    refuse(observation, Outcome::Failed, problem.into_response())
}

fn database_failure(
    store: &Idempotency,
    observation: Observation,
    error: &sqlx::Error,
    step: &'static str,
) -> Response {
    let problems = store.inner.problems();
    if is_unavailable(error) {
        tracing::warn!(%error, step, "idem: database unavailable");
        refuse(
            observation,
            Outcome::Unavailable,
            problems.unavailable().into_response(),
        )
    } else {
        tracing::error!(%error, step, "idem: database error");
        let problem = problems.internal("a database error occurred; nothing was committed");
        refuse(observation, Outcome::Failed, problem.into_response())
    }
}
