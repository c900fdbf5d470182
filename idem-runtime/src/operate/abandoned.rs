//! Abandoned requests: those that recorded a step (`Tx::step`, an outside call made) and
//! have not committed since. A request's COMMIT deletes its steps, so the steps table
//! holds only requests in flight, requests that failed after their steps and await their
//! client's retry, and requests whose process died or whose client went away: after a
//! while, the outside service did something the service has no record of, and nobody may
//! come back for it.

use std::time::{Duration, SystemTime};

use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::Audited;
use super::{instant, rfc3339, seconds};
use crate::store::Store;
use crate::table::{statement, PrincipalType};

/// The keys whose newest step was recorded at least $1 seconds ago and has not expired,
/// oldest first, at most $2; each with its steps, oldest first. Keys of a distributed
/// table's rows group on the shard that holds them (the principal is their distribution
/// column).
const ABANDONED: &str = "\
SELECT a.*, r.state, r.tries, r.failures, r.last_error,
       extract(epoch FROM r.error_at)::float8 AS error_at, r.method IS NOT NULL AS stored
  FROM (
    SELECT scope, principal, key,
           array_agg(step ORDER BY created_at, step) AS steps,
           array_agg(extract(epoch FROM created_at)::float8 ORDER BY created_at, step) AS recorded,
           extract(epoch FROM now() - max(created_at))::float8 AS idle,
           min(created_at) AS first
      FROM {steps}
     WHERE expires_at > now()
     GROUP BY scope, principal, key
    HAVING max(created_at) <= now() - $1::float8 * interval '1 second'
  ) AS a
  LEFT JOIN {requests} AS r
    ON r.scope = a.scope AND r.principal = a.principal AND r.key = a.key
 ORDER BY a.first, a.scope, a.principal, a.key
 LIMIT $2";

/// The fingerprint of a key's live steps and what is left of their ttl: what a request
/// that stored nothing is abandoned with. $1 its stored scope, $2 its principal, $3 the
/// key.
const STEPS_OF: &str = "\
SELECT fingerprint, extract(epoch FROM max(expires_at) - now())::float8 AS remaining
  FROM {steps}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND expires_at > now()
 GROUP BY fingerprint
 LIMIT 1";

/// How many keys [`ABANDONED`] would list without its limit. $1 as there.
const ABANDONED_COUNT: &str = "\
SELECT count(*) FROM (
    SELECT 1 FROM {steps}
     WHERE expires_at > now()
     GROUP BY scope, principal, key
    HAVING max(created_at) <= now() - $1::float8 * interval '1 second'
) AS abandoned";

/// A request that recorded steps and has not committed ([`Store::abandoned`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Abandoned {
    /// The scope.
    pub scope: String,
    /// For a key without a principal kept under a spread value: `key` or `tenant`, as
    /// in [`KeySummary::spread`](crate::operate::KeySummary::spread); `None` otherwise.
    pub spread: Option<String>,
    /// The principal, or the spread value; empty for a key without a principal.
    pub principal: String,
    /// The key.
    pub key: String,
    /// Its recorded steps, oldest first.
    pub steps: Vec<AbandonedStep>,
    /// How long ago its newest step was recorded.
    #[serde(serialize_with = "as_seconds")]
    pub idle: Duration,
    /// Where its completion stands, if its endpoint is completable or an operator
    /// abandoned it ([`crate::complete`]); `None` otherwise.
    pub completion: Option<CompletionState>,
}

/// Where the completion of an [`Abandoned`] request stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CompletionState {
    /// `pending` (the completer runs it), `abandoning` (an operator gave it up: its
    /// compensations run) or `failed` (parked after too many failed runs).
    pub state: String,
    /// Whether the request is stored (it can be completed; otherwise only abandoned).
    pub stored: bool,
    /// How often the completer ran it.
    pub tries: u32,
    /// How many of those runs failed for good (the limit parks it).
    pub failures: u32,
    /// The last run's error, and when.
    pub last_error: Option<String>,
    /// When the last run failed.
    #[serde(serialize_with = "optional_rfc3339")]
    pub error_at: Option<SystemTime>,
}

fn optional_rfc3339<S: serde::Serializer>(
    at: &Option<SystemTime>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match at {
        Some(at) => rfc3339(at, s),
        None => s.serialize_none(),
    }
}

/// One recorded step of an [`Abandoned`] request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AbandonedStep {
    /// The step's name, as `tx.step(name, ..)` gave it.
    pub step: String,
    /// When its result was recorded.
    #[serde(serialize_with = "rfc3339")]
    pub recorded_at: SystemTime,
}

fn as_seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Store {
    /// Requests that recorded at least one step and have not committed, the newest of
    /// their steps recorded at least `idle_for` ago (a request still making steps is not
    /// listed), oldest first, at most `limit`. Their outside calls happened; unless their
    /// clients retry (the steps replay, the call is not made again), the service has no
    /// record of them until the steps expire with their key's ttl. Reads the whole steps
    /// table, which holds only requests that have not committed.
    pub async fn abandoned(
        &self,
        idle_for: Duration,
        limit: u32,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let sql = statement(
            ABANDONED
                .replace("{steps}", &self.inner.steps_table.qualified())
                .replace("{requests}", &self.inner.requests_table.qualified()),
        );
        let mut conn = self.inner.table.single(&self.inner.pool).await?;
        let rows = sqlx::query(sql)
            .persistent(self.inner.table.persistent())
            .bind(idle_for.as_secs_f64())
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        rows.iter()
            .map(|row| abandoned(row, self.inner.dialect.principal_type))
            .collect()
    }
}

impl Store {
    /// How many requests [`Store::abandoned`] lists for [`Store::abandoned_after`],
    /// without a limit: the gauge `idem_abandoned_requests`.
    pub(crate) async fn abandoned_count(&self) -> Result<u64, sqlx::Error> {
        let sql =
            statement(ABANDONED_COUNT.replace("{steps}", &self.inner.steps_table.qualified()));
        let mut conn = self.inner.table.single(&self.inner.pool).await?;
        let count: i64 = sqlx::query_scalar(sql)
            .persistent(self.inner.table.persistent())
            .bind(self.inner.abandoned_after.as_secs_f64())
            .fetch_one(&mut *conn)
            .await?;
        conn.finish().await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }
}

fn abandoned(row: &PgRow, principal_type: PrincipalType) -> Result<Abandoned, sqlx::Error> {
    let (scope, spread, principal) = super::keys::owner(row, principal_type)?;
    let names: Vec<String> = row.try_get("steps")?;
    let recorded: Vec<f64> = row.try_get("recorded")?;
    Ok(Abandoned {
        scope,
        spread,
        principal,
        key: row.try_get("key")?,
        steps: names
            .into_iter()
            .zip(recorded)
            .map(|(step, at)| AbandonedStep {
                step,
                recorded_at: instant(at),
            })
            .collect(),
        idle: seconds(row.try_get("idle")?),
        completion: match row.try_get::<Option<String>, _>("state")? {
            None => None,
            Some(state) => Some(CompletionState {
                state,
                stored: row.try_get("stored")?,
                tries: u32::try_from(row.try_get::<i32, _>("tries")?).unwrap_or(0),
                failures: u32::try_from(row.try_get::<i32, _>("failures")?).unwrap_or(0),
                last_error: row.try_get("last_error")?,
                error_at: row.try_get::<Option<f64>, _>("error_at")?.map(instant),
            }),
        },
    })
}

impl Audited<'_> {
    /// Gives up, for good, a request that recorded steps and never committed: the
    /// service's completer ([`crate::complete::Completer`]) claims its key, runs the
    /// compensation of each of its steps (a refund for a charge) and commits a 410 for
    /// the key, which its client's late retry gets. Recorded as `abandon`, in the same
    /// transaction as the mark. `false` when the key has no live steps (nothing to
    /// abandon: it committed, expired, or never made a step).
    pub async fn abandon_request(
        &self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<bool, sqlx::Error> {
        self.mark_request(scope, principal, key, true).await
    }

    /// Sends a stored request (pending, or parked as `failed`) to be completed at the
    /// completer's next look, its failures forgotten. Recorded as `complete`. `false`
    /// when the key has no stored request to complete, or is being abandoned (an
    /// abandon is for good).
    pub async fn complete_request(
        &self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<bool, sqlx::Error> {
        self.mark_request(scope, principal, key, false).await
    }

    async fn mark_request(
        &self,
        scope: &str,
        principal: &str,
        key: &str,
        abandon: bool,
    ) -> Result<bool, sqlx::Error> {
        let store = self.store();
        let inner = &store.inner;
        let principal_type = inner.dialect.principal_type;
        let steps_of = store.key_sql(STEPS_OF);
        let mut tx = inner.table.acting(&inner.pool).await?;
        let mut marked = 0;
        for (spelling, stored, place) in store.spelled_places(scope, principal, key) {
            let bound = principal_type.bound(&place);
            let found = store
                .operator_query(steps_of.clone())
                .bind(&stored)
                .bind(bound)
                .bind(&spelling)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(found) = found else { continue };
            let fingerprint: Vec<u8> = found.try_get("fingerprint")?;
            let remaining = seconds(found.try_get::<f64, _>("remaining")?.max(1.0));
            let triple = (stored.as_str(), bound, spelling.as_str());
            if !abandon {
                let state = inner.requests.state_on(&mut tx, triple).await?;
                if state != Some(true) {
                    continue;
                }
            }
            if inner
                .requests
                .mark(&mut tx, triple, abandon, &fingerprint, remaining)
                .await?
            {
                marked += 1;
            }
        }
        if marked == 0 {
            return Ok(false);
        }
        let mut filter = format!("scope {scope:?}");
        if !principal.is_empty() {
            filter.push_str(&format!(", principal {principal:?}"));
        }
        filter.push_str(&format!(", key {key:?}"));
        let action = if abandon { "abandon" } else { "complete" };
        self.commit(tx, action, &filter, marked).await?;
        Ok(true)
    }
}
