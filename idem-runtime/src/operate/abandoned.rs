//! Abandoned requests: those that recorded a step (`Tx::step`, an outside call made) and
//! have not committed since. A request's COMMIT deletes its steps, so the steps table
//! holds only requests in flight, requests that failed after their steps and await their
//! client's retry, and requests whose process died or whose client went away: after a
//! while, the outside service did something the service has no record of, and nobody may
//! come back for it.

use super::Operate;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::Audited;
use super::{instant, rfc3339, seconds, Page};
use crate::table::{statement, PrincipalType};

/// The keys with live steps, the newest recorded at least $1 seconds ago (or, whatever
/// their idle time, parked as `failed` or being abandoned: an operator's to see), oldest
/// first
/// step first (ties in the order of their scope, principal and key), at most $10; each
/// with its steps, oldest first, and its row of the requests table if it has one. $2 a
/// principal or NULL, $3 a scope (its spread places included) or NULL, $4 a key prefix
/// or NULL, $5 a completion stage ([`CompletionStage::as_str`]) or NULL; $6 to $9 the
/// request the page starts after ([`AbandonedCursor`]: its first step's time in
/// microseconds since the epoch, its stored scope, principal and key) or NULL. Keyset,
/// not an offset. Keys of a distributed table's rows group on the shard that holds them
/// (the principal is their distribution column, which the join matches too); the
/// cursor's condition is on the group, before the join, so that it narrows each shard's
/// rows.
const ABANDONED: &str = "\
SELECT a.scope, a.principal::text AS principal, a.key, a.steps, a.recorded, a.idle,
       (extract(epoch FROM a.first) * 1000000)::bigint AS first_us,
       r.state, r.tries, r.failures, r.last_error,
       extract(epoch FROM r.error_at)::float8 AS error_at, r.method IS NOT NULL AS stored
  FROM (
    SELECT scope, principal, key,
           array_agg(step ORDER BY created_at, step) AS steps,
           array_agg(extract(epoch FROM created_at)::float8 ORDER BY created_at, step) AS recorded,
           extract(epoch FROM now() - max(created_at))::float8 AS idle,
           min(created_at) AS first
      FROM {steps}
     WHERE expires_at > now()
       AND ($2::text IS NULL OR principal = {p2})
       AND ($3::text IS NULL OR scope = $3 OR left(scope, length($3) + 1) = $3 || chr(31))
       AND ($4::text IS NULL OR left(key, length($4)) = $4)
     GROUP BY scope, principal, key
    HAVING ($6::bigint IS NULL
            OR (min(created_at), scope, principal::text, key)
               > (timestamptz 'epoch' + $6::bigint * interval '1 microsecond',
                  $7::text, $8::text, $9::text))
  ) AS a
  LEFT JOIN {requests} AS r
    ON r.scope = a.scope AND r.principal = a.principal AND r.key = a.key
 WHERE ($5::text IS NULL OR r.state = $5 OR ($5 = 'not-completable' AND r.method IS NULL))
   AND (a.idle >= $1::float8 OR r.state IN ('failed', 'abandoning'))
 ORDER BY a.first, a.scope, a.principal::text, a.key
 LIMIT $10";

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

/// Which abandoned requests [`Operate::abandoned_page`](crate::operate::Operate::abandoned_page) lists: every field narrows, and
/// the default lists those whose newest step is as old as the store's
/// [`abandoned_after`](crate::StoreBuilder::abandoned_after).
///
/// ```
/// use std::time::Duration;
/// use idem::operate::{AbandonedFilter, CompletionStage};
///
/// let mut filter = AbandonedFilter::default();
/// filter.scope = Some("charges".into());
/// filter.completion = Some(CompletionStage::Failed);
/// filter.idle_for = Some(Duration::from_secs(3_600));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AbandonedFilter {
    /// Only this scope's requests (with its spread keys).
    pub scope: Option<String>,
    /// Only this principal's requests (or those kept under this spread value).
    pub principal: Option<String>,
    /// Only keys that start with this (as stored, as [`KeyFilter::key_prefix`] says).
    ///
    /// [`KeyFilter::key_prefix`]: crate::operate::KeyFilter::key_prefix
    pub key_prefix: Option<String>,
    /// Only requests whose completion is at this stage.
    pub completion: Option<CompletionStage>,
    /// Only requests whose newest step is at least this old (a request still making
    /// steps is not abandoned); `None`: the store's
    /// [`abandoned_after`](crate::StoreBuilder::abandoned_after).
    pub idle_for: Option<Duration>,
}

/// Where an abandoned request's completion stands, as [`AbandonedFilter::completion`]
/// selects it; written (`Display`) and read back (`FromStr`) as the console's form and
/// `idem key abandoned --completion` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CompletionStage {
    /// `pending`: stored, and the service's completer runs it.
    Pending,
    /// `failed`: parked after too many failed runs; it runs again only when sent.
    Failed,
    /// `abandoning`: an operator gave it up; its compensations run, then its key answers
    /// 410.
    Abandoning,
    /// `not-completable`: its endpoint stored no request, so that it can only be
    /// abandoned (those an operator abandoned since are `Abandoning` too).
    NotCompletable,
}

impl CompletionStage {
    /// Every stage, in the order the console offers them.
    pub const ALL: [Self; 4] = [
        Self::Pending,
        Self::Failed,
        Self::Abandoning,
        Self::NotCompletable,
    ];

    /// `pending`, `failed`, `abandoning` or `not-completable`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Failed => "failed",
            Self::Abandoning => "abandoning",
            Self::NotCompletable => "not-completable",
        }
    }
}

impl fmt::Display for CompletionStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CompletionStage {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|stage| stage.as_str() == text)
            .ok_or_else(|| {
                format!(
                    "the completion is pending, failed, abandoning or not-completable, not \
                     {text:?}"
                )
            })
    }
}

/// Where a page of [`Operate::abandoned_page`](crate::operate::Operate::abandoned_page) ends: a request's first step's time, its
/// stored scope, principal and key ([`Abandoned::cursor`]). Written as text (`Display`)
/// and read back (`FromStr`) for a link or a flag to the next page: four fields, the last
/// three in hex, dot-separated, as [`KeyCursor`](crate::operate::KeyCursor)'s.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AbandonedCursor {
    first_us: i64,
    scope: String,
    principal: String,
    key: String,
}

impl fmt::Display for AbandonedCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        super::write_cursor(f, self.first_us, &self.scope, &self.principal, &self.key)
    }
}

impl FromStr for AbandonedCursor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (first_us, scope, principal, key) =
            super::read_cursor(text, "the abandoned requests' list")?;
        Ok(Self {
            first_us,
            scope,
            principal,
            key,
        })
    }
}

impl Serialize for AbandonedCursor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A request that recorded steps and has not committed ([`Operate::abandoned`](crate::operate::Operate::abandoned),
/// [`Operate::abandoned_page`](crate::operate::Operate::abandoned_page)).
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
    /// Where it stands in the list: the `after` of [`Operate::abandoned_page`](crate::operate::Operate::abandoned_page) that starts
    /// the page after it (`idem key abandoned --after`). In JSON, as its text.
    pub cursor: AbandonedCursor,
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

impl Operate<'_> {
    /// Requests that recorded at least one step and have not committed, the newest of
    /// their steps recorded at least `idle_for` ago (a request still making steps is not
    /// listed), oldest first, at most `limit`: the first [`Operate::abandoned_page`](crate::operate::Operate::abandoned_page) of
    /// those. Their outside calls happened; unless their clients retry (the steps replay,
    /// the call is not made again), the service has no record of them until the steps
    /// expire with their key's ttl. Reads the whole steps table, which holds only
    /// requests that have not committed.
    pub async fn abandoned(
        self,
        idle_for: Duration,
        limit: u32,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let filter = AbandonedFilter {
            idle_for: Some(idle_for),
            ..AbandonedFilter::default()
        };
        Ok(self.abandoned_page(&filter, None, limit).await?.rows)
    }

    /// The abandoned requests `filter` names (see [`Operate::abandoned`](crate::operate::Operate::abandoned)), oldest first
    /// step first, at most `limit`, those after the request `after` (`None`: from the
    /// oldest). The page's [`Page::next`] is the next page's `after`, as is each row's
    /// [`Abandoned::cursor`]: a keyset, so a request that commits or is abandoned
    /// meanwhile neither shifts nor repeats a row.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), sqlx::Error> {
    /// use idem::operate::{AbandonedFilter, CompletionStage};
    ///
    /// let mut filter = AbandonedFilter::default();
    /// filter.completion = Some(CompletionStage::Failed);
    /// let mut after = None;
    /// loop {
    ///     let page = store.operate().abandoned_page(&filter, after.as_ref(), 100).await?;
    ///     for request in &page.rows {
    ///         println!("{} {} {}", request.scope, request.principal, request.key);
    ///     }
    ///     match page.next {
    ///         Some(next) => after = Some(next),
    ///         None => break,
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn abandoned_page(
        self,
        filter: &AbandonedFilter,
        after: Option<&AbandonedCursor>,
        limit: u32,
    ) -> Result<Page<Abandoned, AbandonedCursor>, sqlx::Error> {
        let principal_type = self.store.inner.dialect.principal_type;
        let principal = match filter.principal.as_deref() {
            None => None,
            Some(p) => match principal_type.canonical(p) {
                Some(p) => Some(p),
                // Not of the column's type: no request is kept under it.
                None => {
                    return Ok(Page {
                        rows: Vec::new(),
                        next: None,
                    })
                }
            },
        };
        let idle_for = filter.idle_for.unwrap_or(self.store.inner.abandoned_after);
        let limit = limit.max(1);
        let sql = self.key_sql(
            &ABANDONED.replace("{requests}", &self.store.inner.requests_table.qualified()),
        );
        let mut conn = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let rows = self
            .operator_query(sql)
            .bind(idle_for.as_secs_f64())
            .bind(principal)
            .bind(filter.scope.as_deref())
            .bind(filter.key_prefix.as_deref())
            .bind(filter.completion.map(CompletionStage::as_str))
            .bind(after.map(|a| a.first_us))
            .bind(after.map(|a| a.scope.as_str()))
            .bind(after.map(|a| a.principal.as_str()))
            .bind(after.map(|a| a.key.as_str()))
            .bind(i64::from(limit) + 1)
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        let rows = rows
            .iter()
            .map(|row| {
                let found = abandoned(row, principal_type)?;
                let cursor = found.cursor.clone();
                Ok((found, cursor))
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(Page::of(rows, limit))
    }
}

impl Operate<'_> {
    /// How many requests [`Operate::abandoned`](crate::operate::Operate::abandoned) lists for [`Operate::abandoned_after`](crate::operate::Operate::abandoned_after),
    /// without a limit: the gauge `idem_abandoned_requests`.
    pub(crate) async fn abandoned_count(self) -> Result<u64, sqlx::Error> {
        let sql = statement(
            ABANDONED_COUNT.replace("{steps}", &self.store.inner.steps_table.qualified()),
        );
        let mut conn = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let count: i64 = sqlx::query_scalar(sql)
            .persistent(self.store.inner.table.persistent())
            .bind(self.store.inner.abandoned_after.as_secs_f64())
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
        cursor: AbandonedCursor {
            first_us: row.try_get("first_us")?,
            scope: row.try_get("scope")?,
            principal: row.try_get("principal")?,
            key: row.try_get("key")?,
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
        let steps_of = store.operate().key_sql(STEPS_OF);
        let mut tx = inner.table.acting(&inner.pool).await?;
        let mut marked = 0;
        for (spelling, stored, place) in store.operate().spelled_places(scope, principal, key) {
            let bound = principal_type.bound(&place);
            let found = store
                .operate()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_is_read_back_as_it_was_written() {
        let cursor = AbandonedCursor {
            first_us: 1_795_860_530_123_456,
            scope: "charges\u{1f}key".into(),
            principal: "acct.1 é".into(),
            key: "order-1".into(),
        };
        let text = cursor.to_string();
        assert_eq!(text.split('.').count(), 4, "{text}");
        assert_eq!(text.parse::<AbandonedCursor>(), Ok(cursor.clone()));
        assert_eq!(
            serde_json::to_value(&cursor).unwrap(),
            serde_json::Value::String(text)
        );
        for wrong in [
            "",
            "1.2.3",
            "x.61.62.63",
            "1.6.62.63",
            "1.zz.62.63",
            "1.61.62.63.64",
        ] {
            assert!(wrong.parse::<AbandonedCursor>().is_err(), "{wrong}");
        }
    }

    #[test]
    fn a_completion_stage_is_read_as_it_is_written() {
        for stage in CompletionStage::ALL {
            assert_eq!(stage.to_string().parse::<CompletionStage>(), Ok(stage));
        }
        let wrong = "done".parse::<CompletionStage>().unwrap_err();
        assert!(wrong.contains("not-completable"), "{wrong}");
    }
}
