//! The idempotency table as an operator sees it: one key's record, a list of records,
//! counts per scope, and purging one key.

use super::Operate;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use http::StatusCode;
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row, SqlStr};

use super::{instant, rfc3339, Page};
use crate::header::IdempotencyKey;
use crate::table::{statement, PrincipalType};

/// A committed record. $1 its stored scope, $2 its principal, $3 the key, $4 whether to
/// read the body.
const KEY: &str = "\
SELECT extract(epoch FROM created_at)::float8 AS created_at,
       extract(epoch FROM expires_at)::float8 AS expires_at,
       expires_at <= now() AS expired, status, fingerprint,
       coalesce(octet_length(body), 0) AS body_bytes, headers,
       CASE WHEN $4::bool THEN body END AS body
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NOT NULL";

/// Committed records, newest first (ties in the order of their primary key, backwards).
/// $1 a scope (its spread places included) or NULL, $2 a principal or NULL, $3 a least
/// age in seconds or NULL, $4 whether expired records are listed, $5 how many, $6 a key
/// prefix or NULL; $7 to $10 the record the page starts after ([`KeyCursor`]: its
/// `created_at` in microseconds since the epoch, its stored scope, principal and key) or
/// NULL. Keyset, not an offset: a page costs what the filter's first rows cost (a scope
/// and a principal narrow it by the primary key; the order by `created_at`, which no
/// index keeps, sorts what the filter selects).
const LIST: &str = "\
SELECT scope, principal::text AS principal, key,
       extract(epoch FROM created_at)::float8 AS created_at,
       (extract(epoch FROM created_at) * 1000000)::bigint AS created_us,
       extract(epoch FROM expires_at)::float8 AS expires_at,
       expires_at <= now() AS expired, status,
       coalesce(octet_length(body), 0) AS body_bytes
  FROM {table}
 WHERE status IS NOT NULL
   AND ($1::text IS NULL OR scope = $1 OR left(scope, length($1) + 1) = $1 || chr(31))
   AND ($2::text IS NULL OR principal = {p2})
   AND ($3::float8 IS NULL OR created_at <= now() - $3::float8 * interval '1 second')
   AND ($4::bool OR expires_at > now())
   AND ($6::text IS NULL OR left(key, length($6)) = $6)
   AND ($7::bigint IS NULL
        OR (created_at, scope, principal::text, key)
           < (timestamptz 'epoch' + $7::bigint * interval '1 microsecond', $8::text, $9::text, $10::text))
 ORDER BY created_at DESC, scope DESC, principal::text DESC, key DESC
 LIMIT $5";

/// Committed records per scope (spread places counted with their scope): live, live
/// and expiring within $1 seconds, expired.
const COUNTS: &str = "\
SELECT split_part(scope, chr(31), 1) AS scope,
       sum(CASE WHEN expires_at > now() THEN 1 ELSE 0 END)::bigint AS live,
       sum(CASE WHEN expires_at > now()
                 AND expires_at <= now() + $1::float8 * interval '1 second'
                THEN 1 ELSE 0 END)::bigint AS expiring,
       sum(CASE WHEN expires_at <= now() THEN 1 ELSE 0 END)::bigint AS expired
  FROM {table}
 WHERE status IS NOT NULL
 GROUP BY 1
 ORDER BY 1";

/// One committed record, by its primary key (binds as [`KEY`]'s first three). A record
/// whose request is still in flight is not committed, and not touched.
const PURGE_KEY: &str = "\
DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NOT NULL";

/// The recorded steps (`Tx::step`) of a key whose request has not committed, by name.
/// $1 its stored scope, $2 its principal, $3 the key, $4 whether to read the results.
const STEPS: &str = "\
SELECT step, extract(epoch FROM created_at)::float8 AS created_at,
       extract(epoch FROM expires_at)::float8 AS expires_at,
       expires_at <= now() AS expired, octet_length(result) AS result_bytes,
       CASE WHEN $4::bool THEN result END AS result
  FROM {steps}
 WHERE scope = $1 AND principal = {p2} AND key = $3
 ORDER BY created_at, step";

/// The principals that hold a key in a scope, in the idempotency table or the steps
/// table, first $4 of them, with how many there are. $1 the scope (its authenticated
/// principals' place: a spread place holds no principal), $2 the column's nobody value,
/// $3 the key's spellings.
const HOLDERS: &str = "\
SELECT principal, count(*) OVER () AS holders
  FROM (SELECT principal::text AS principal FROM {table}
         WHERE scope = $1 AND principal <> {p2} AND key = ANY($3)
        UNION
        SELECT principal::text FROM {steps}
         WHERE scope = $1 AND principal <> {p2} AND key = ANY($3)) AS held
 ORDER BY principal
 LIMIT $4";

/// The mark between a scope and its spread in a stored scope ([`crate::identity`]).
const SPREAD_MARK: char = '\u{1f}';

/// One key's committed record, as [`Operate::key`](crate::operate::Operate::key) finds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct KeyDetail {
    /// When the request that ran committed its transaction's start time.
    #[serde(serialize_with = "rfc3339")]
    pub created_at: SystemTime,
    /// When the record stops being replayed.
    #[serde(serialize_with = "rfc3339")]
    pub expires_at: SystemTime,
    /// Whether `expires_at` has passed.
    pub expired: bool,
    /// The status of the stored response.
    #[serde(serialize_with = "status_code")]
    pub status: StatusCode,
    /// The request's fingerprint (SHA-256), in hex.
    pub fingerprint: String,
    /// The size of the stored response body.
    pub body_bytes: usize,
    /// The stored, allow-listed response headers, one `name: value` per line.
    pub headers: String,
    /// The stored body, when asked for (as text in JSON, invalid UTF-8 replaced).
    #[serde(serialize_with = "super::lossy_text")]
    pub body: Option<Vec<u8>>,
}

/// A recorded step of a request that has not committed ([`Operate::key_steps`](crate::operate::Operate::key_steps)): an outside
/// call its retry will not make again. A committed request's steps are gone with its
/// COMMIT.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StepRecord {
    /// The step's name.
    pub step: String,
    /// When its result was recorded.
    #[serde(serialize_with = "rfc3339")]
    pub created_at: SystemTime,
    /// When it expires with its key.
    #[serde(serialize_with = "rfc3339")]
    pub expires_at: SystemTime,
    /// Whether `expires_at` has passed (a retry calls again).
    pub expired: bool,
    /// The size of the recorded result (JSON).
    pub result_bytes: usize,
    /// The recorded result, when asked for: it may carry personal data.
    pub result: Option<String>,
}

/// A committed record in a list ([`Operate::keys`](crate::operate::Operate::keys)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct KeySummary {
    /// The scope.
    pub scope: String,
    /// For a key without a principal kept under a spread value: `key` (a hash of the key)
    /// or `tenant` (the tenant its event concerns); `None` otherwise.
    pub spread: Option<String>,
    /// The principal, or the spread value; empty for a key without a principal kept
    /// under the nobody value.
    pub principal: String,
    /// The key.
    pub key: String,
    /// When it was created.
    #[serde(serialize_with = "rfc3339")]
    pub created_at: SystemTime,
    /// When it expires.
    #[serde(serialize_with = "rfc3339")]
    pub expires_at: SystemTime,
    /// Whether it has expired.
    pub expired: bool,
    /// The status of the stored response.
    pub status: u16,
    /// The size of the stored response body.
    pub body_bytes: usize,
}

/// Which records [`Operate::keys`](crate::operate::Operate::keys) and [`Operate::keys_page`](crate::operate::Operate::keys_page) list. The default lists the 50
/// newest live records of every scope.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyFilter {
    /// Only this scope's records (with its spread keys).
    pub scope: Option<String>,
    /// Only this principal's records (or those kept under this spread value).
    pub principal: Option<String>,
    /// Only records at least this old.
    pub older_than: Option<Duration>,
    /// Only keys that start with this (as stored: a `run_once` id or a body field's value
    /// that is stored hashed is not found by a prefix of its text).
    pub key_prefix: Option<String>,
    /// Expired records too.
    pub include_expired: bool,
    /// At most this many.
    pub limit: u32,
}

impl Default for KeyFilter {
    fn default() -> Self {
        Self {
            scope: None,
            principal: None,
            older_than: None,
            key_prefix: None,
            include_expired: false,
            limit: 50,
        }
    }
}

/// Where a page of [`Operate::keys_page`](crate::operate::Operate::keys_page) ends: its last record's creation, stored scope,
/// principal and key. Written as text (`Display`) and read back (`FromStr`) for a link
/// to the next page: four fields, the last three in hex, dot-separated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCursor {
    created_us: i64,
    scope: String,
    principal: String,
    key: String,
}

impl fmt::Display for KeyCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        super::write_cursor(f, self.created_us, &self.scope, &self.principal, &self.key)
    }
}

impl FromStr for KeyCursor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (created_us, scope, principal, key) = super::read_cursor(text, "the keys' list")?;
        Ok(Self {
            created_us,
            scope,
            principal,
            key,
        })
    }
}

/// The records of one scope ([`Operate::key_counts`](crate::operate::Operate::key_counts)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct KeyCounts {
    /// The scope.
    pub scope: String,
    /// Records still replayed.
    pub live: u64,
    /// Live records that expire within the window asked for.
    pub expiring: u64,
    /// Expired records a sweep has not deleted yet.
    pub expired: u64,
}

fn status_code<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

/// The statements of this module, rendered for one store's table.
struct Statements {
    key: SqlStr,
    list: SqlStr,
    counts: SqlStr,
    purge_key: SqlStr,
    steps: SqlStr,
    holders: SqlStr,
}

impl Operate<'_> {
    /// `sql` for this store: `{table}` its idempotency table, `{steps}` its steps table,
    /// `{p2}` the principal's parameter $2 cast to the column's type.
    pub(super) fn key_sql(self, sql: &str) -> SqlStr {
        let table = self.store.inner.table_name.qualified();
        let p2 = self.store.inner.dialect.principal_type.parameter();
        let steps = self.store.inner.steps_table.qualified();
        statement(
            sql.replace("{table}", &table)
                .replace("{steps}", &steps)
                .replace("{p2}", p2),
        )
    }

    fn key_statements(self) -> Statements {
        let render = |sql: &str| self.key_sql(sql);
        Statements {
            key: render(KEY),
            list: render(LIST),
            counts: render(COUNTS),
            purge_key: render(PURGE_KEY),
            steps: render(STEPS),
            holders: render(HOLDERS),
        }
    }

    /// Where `key` may be kept, under each spelling it may be stored with: as given (a
    /// header's key, or a plain text of visible ASCII), and hashed where a plain-text key
    /// is ([`IdempotencyKey::from_text`]: a `run_once` id or a body field's value that is
    /// long or has spaces, control characters or non-ASCII), so that an operator finds a
    /// record by the id they know. Each: the stored key, the stored scope, the principal.
    pub(super) fn spelled_places(
        self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Vec<(String, String, String)> {
        let mut spellings = vec![key.to_owned()];
        if let Ok(text) = IdempotencyKey::from_text(key) {
            if text.as_str() != key {
                spellings.push(text.as_str().to_owned());
            }
        }
        spellings
            .into_iter()
            .flat_map(|spelling| {
                self.store
                    .places(scope, principal, &spelling)
                    .unwrap_or_default()
                    .into_iter()
                    .map(move |(stored, place)| (spelling.clone(), stored.into_owned(), place))
            })
            .collect()
    }

    /// A statement of this module as the store sends it: unnamed behind a transaction
    /// pooler.
    pub(super) fn operator_query(
        self,
        sql: SqlStr,
    ) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql).persistent(self.store.inner.table.persistent())
    }

    /// The committed record of `key` for `principal` (`""` for none) in `scope`, found
    /// where [`Store::inspect`](crate::Store::inspect) finds it, with its fingerprint and stored headers, and
    /// its body when `with_body` (it may carry personal data: ask only when needed).
    /// `key` as the request or the caller of `run_once` gave it: a plain-text key that
    /// is stored hashed (long, or not visible ASCII) is found by its text too.
    pub async fn key(
        self,
        scope: &str,
        principal: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<KeyDetail>, sqlx::Error> {
        let sql = self.key_statements().key;
        let principal_type = self.store.inner.dialect.principal_type;
        let mut found: Option<KeyDetail> = None;
        for (key, stored, place) in self.spelled_places(scope, principal, key) {
            let mut conn = self
                .store
                .inner
                .table
                .single(&self.store.inner.pool)
                .await?;
            let row = self
                .operator_query(sql.clone())
                .bind(stored)
                .bind(principal_type.bound(&place))
                .bind(key)
                .bind(with_body)
                .fetch_optional(&mut *conn)
                .await?;
            conn.finish().await?;
            let Some(row) = row else { continue };
            let detail = detail(&row)?;
            // The first live record, else the first expired one.
            if !detail.expired {
                return Ok(Some(detail));
            }
            found.get_or_insert(detail);
        }
        Ok(found)
    }

    /// The recorded steps of `key` for `principal` (`""` for none) in `scope`, found
    /// where [`Operate::key`](crate::operate::Operate::key) looks, oldest first: what a request that has not committed
    /// (it failed after its steps, or its process died) will not call again on retry.
    /// Their results only `with_results`.
    pub async fn key_steps(
        self,
        scope: &str,
        principal: &str,
        key: &str,
        with_results: bool,
    ) -> Result<Vec<StepRecord>, sqlx::Error> {
        let sql = self.key_statements().steps;
        let principal_type = self.store.inner.dialect.principal_type;
        let mut steps = Vec::new();
        for (key, stored, place) in self.spelled_places(scope, principal, key) {
            let mut conn = self
                .store
                .inner
                .table
                .single(&self.store.inner.pool)
                .await?;
            let rows = self
                .operator_query(sql.clone())
                .bind(stored)
                .bind(principal_type.bound(&place))
                .bind(key)
                .bind(with_results)
                .fetch_all(&mut *conn)
                .await?;
            conn.finish().await?;
            for row in rows {
                steps.push(StepRecord {
                    step: row.try_get("step")?,
                    created_at: instant(row.try_get("created_at")?),
                    expires_at: instant(row.try_get("expires_at")?),
                    expired: row.try_get("expired")?,
                    result_bytes: usize::try_from(row.try_get::<i32, _>("result_bytes")?)
                        .unwrap_or(0),
                    result: row.try_get("result")?,
                });
            }
            if !steps.is_empty() {
                break;
            }
        }
        Ok(steps)
    }

    /// The authenticated principals that hold `key` in `scope` (a committed record or a
    /// recorded step), in order, at most `limit` of them, and how many there are: where
    /// to look when [`Operate::key`](crate::operate::Operate::key) finds nothing without a principal. Keys without a
    /// principal are not counted, whatever value they are kept under. `key` as for
    /// [`Operate::key`](crate::operate::Operate::key). It reads the whole scope (no index leads with the key): an
    /// operator's question, not a request's.
    pub async fn key_principals(
        self,
        scope: &str,
        key: &str,
        limit: u32,
    ) -> Result<(Vec<String>, u64), sqlx::Error> {
        let principal_type = self.store.inner.dialect.principal_type;
        let mut spellings: Vec<String> = self
            .spelled_places(scope, "", key)
            .into_iter()
            .map(|(spelling, _, _)| spelling)
            .collect();
        spellings.dedup();
        let mut conn = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let rows = self
            .operator_query(self.key_statements().holders)
            .bind(scope)
            .bind(principal_type.bound(""))
            .bind(spellings)
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        let holders = match rows.first() {
            Some(row) => u64::try_from(row.try_get::<i64, _>("holders")?).unwrap_or(0),
            None => 0,
        };
        let principals = rows
            .iter()
            .map(|row| row.try_get("principal"))
            .collect::<Result<_, _>>()?;
        Ok((principals, holders))
    }

    /// Committed records, newest first, as `filter` selects them: the first
    /// [`Operate::keys_page`](crate::operate::Operate::keys_page).
    pub async fn keys(self, filter: &KeyFilter) -> Result<Vec<KeySummary>, sqlx::Error> {
        Ok(self.keys_page(filter, None).await?.rows)
    }

    /// Committed records, newest first, as `filter` selects them, at most
    /// `filter.limit`, those after the record `after` (`None`: from the newest). The
    /// page's [`Page::next`] is the next page's `after`: a keyset, so records written
    /// meanwhile (newer than the first page) neither shift nor repeat a row.
    pub async fn keys_page(
        self,
        filter: &KeyFilter,
        after: Option<&KeyCursor>,
    ) -> Result<Page<KeySummary, KeyCursor>, sqlx::Error> {
        let principal_type = self.store.inner.dialect.principal_type;
        let principal = match filter.principal.as_deref() {
            None => None,
            Some(p) => match principal_type.canonical(p) {
                Some(p) => Some(p),
                None => {
                    return Ok(Page {
                        rows: Vec::new(),
                        next: None,
                    })
                }
            },
        };
        let limit = filter.limit.max(1);
        let mut conn = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let rows = self
            .operator_query(self.key_statements().list)
            .bind(filter.scope.as_deref())
            .bind(principal)
            .bind(filter.older_than.map(|d| d.as_secs_f64()))
            .bind(filter.include_expired)
            .bind(i64::from(limit) + 1)
            .bind(filter.key_prefix.as_deref())
            .bind(after.map(|a| a.created_us))
            .bind(after.map(|a| a.scope.clone()))
            .bind(after.map(|a| a.principal.clone()))
            .bind(after.map(|a| a.key.clone()))
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        let rows = rows
            .iter()
            .map(|row| {
                let cursor = KeyCursor {
                    created_us: row.try_get("created_us")?,
                    scope: row.try_get("scope")?,
                    principal: row.try_get("principal")?,
                    key: row.try_get("key")?,
                };
                Ok((summary(row, principal_type)?, cursor))
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(Page::of(rows, limit))
    }

    /// Committed records per scope: live, expiring within `within`, and expired.
    pub async fn key_counts(self, within: Duration) -> Result<Vec<KeyCounts>, sqlx::Error> {
        let mut conn = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let rows = self
            .operator_query(self.key_statements().counts)
            .bind(within.as_secs_f64())
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        let count = |row: &PgRow, column: &str| -> Result<u64, sqlx::Error> {
            Ok(u64::try_from(row.try_get::<i64, _>(column)?).unwrap_or(0))
        };
        rows.iter()
            .map(|row| {
                Ok(KeyCounts {
                    scope: row.try_get("scope")?,
                    live: count(row, "live")?,
                    expiring: count(row, "expiring")?,
                    expired: count(row, "expired")?,
                })
            })
            .collect()
    }

    /// [`Audited::purge_key`](crate::operate::Audited::purge_key)'s deletes on `conn`: how many records went.
    pub(super) async fn purge_key_on(
        self,
        conn: &mut PgConnection,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<u64, sqlx::Error> {
        let sql = self.key_statements().purge_key;
        let principal_type = self.store.inner.dialect.principal_type;
        let mut purged = 0;
        for (key, stored, place) in self.spelled_places(scope, principal, key) {
            let done = self
                .operator_query(sql.clone())
                .bind(stored)
                .bind(principal_type.bound(&place))
                .bind(key)
                .execute(&mut *conn)
                .await?;
            purged += done.rows_affected();
        }
        Ok(purged)
    }

    /// After a purge: whatever this store kept in memory
    /// ([`StoreBuilder::replay_cache`](crate::StoreBuilder::replay_cache)) goes too.
    pub(super) fn purged_answers(self) {
        if let Some(answers) = &self.store.inner.answers {
            answers.clear();
        }
    }
}

fn detail(row: &PgRow) -> Result<KeyDetail, sqlx::Error> {
    let status: i16 = row.try_get("status")?;
    let status = u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| {
            sqlx::Error::Decode(format!("stored status {status} is not an HTTP status").into())
        })?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let headers: Option<Vec<u8>> = row.try_get("headers")?;
    Ok(KeyDetail {
        created_at: instant(row.try_get("created_at")?),
        expires_at: instant(row.try_get("expires_at")?),
        expired: row.try_get("expired")?,
        status,
        fingerprint: fingerprint.iter().map(|b| format!("{b:02x}")).collect(),
        body_bytes: usize::try_from(row.try_get::<i32, _>("body_bytes")?).unwrap_or(0),
        headers: String::from_utf8_lossy(&headers.unwrap_or_default()).into_owned(),
        body: row.try_get("body")?,
    })
}

/// The row's `scope` and `principal` columns as an operator reads them: the scope, its
/// spread (`key`, `tenant`) if the key is kept under one, and the principal, empty for a
/// key kept under the column's nobody value.
pub(super) fn owner(
    row: &PgRow,
    principal_type: PrincipalType,
) -> Result<(String, Option<String>, String), sqlx::Error> {
    let stored: String = row.try_get("scope")?;
    let (scope, spread) = match stored.split_once(SPREAD_MARK) {
        Some((scope, spread)) => (scope.to_owned(), Some(spread.to_owned())),
        None => (stored, None),
    };
    let mut principal: String = row.try_get("principal")?;
    if spread.is_none() && principal == principal_type.bound("") {
        principal.clear();
    }
    Ok((scope, spread, principal))
}

fn summary(row: &PgRow, principal_type: PrincipalType) -> Result<KeySummary, sqlx::Error> {
    let (scope, spread, principal) = owner(row, principal_type)?;
    Ok(KeySummary {
        scope,
        spread,
        principal,
        key: row.try_get("key")?,
        created_at: instant(row.try_get("created_at")?),
        expires_at: instant(row.try_get("expires_at")?),
        expired: row.try_get("expired")?,
        status: u16::try_from(row.try_get::<i16, _>("status")?).unwrap_or(0),
        body_bytes: usize::try_from(row.try_get::<i32, _>("body_bytes")?).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_is_read_back_as_it_was_written() {
        let cursor = KeyCursor {
            created_us: 1_795_860_530_123_456,
            scope: "webhooks\u{1f}key".into(),
            principal: "acct.1 é".into(),
            key: "order-1".into(),
        };
        let text = cursor.to_string();
        assert_eq!(text.split('.').count(), 4, "{text}");
        assert_eq!(text.parse::<KeyCursor>(), Ok(cursor));
        for wrong in [
            "",
            "1.2.3",
            "x.61.62.63",
            "1.6.62.63",
            "1.zz.62.63",
            "1.61.62.63.64",
        ] {
            assert!(wrong.parse::<KeyCursor>().is_err(), "{wrong}");
        }
    }
}
