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

use super::{instant, rfc3339, seconds};
use crate::store::Store;
use crate::table::{statement, PrincipalType};

/// The keys whose newest step was recorded at least $1 seconds ago and has not expired,
/// oldest first, at most $2; each with its steps, oldest first. Keys of a distributed
/// table's rows group on the shard that holds them (the principal is their distribution
/// column).
const ABANDONED: &str = "\
SELECT scope, principal, key,
       array_agg(step ORDER BY created_at, step) AS steps,
       array_agg(extract(epoch FROM created_at)::float8 ORDER BY created_at, step) AS recorded,
       extract(epoch FROM now() - max(created_at))::float8 AS idle
  FROM {steps}
 WHERE expires_at > now()
 GROUP BY scope, principal, key
HAVING max(created_at) <= now() - $1::float8 * interval '1 second'
 ORDER BY min(created_at), scope, principal, key
 LIMIT $2";

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
        let sql = statement(ABANDONED.replace("{steps}", &self.inner.steps_table.qualified()));
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
    })
}
