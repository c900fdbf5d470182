//! The requests table: what a completable endpoint's request that made a step needs to
//! run again (its method, target, allowed headers, body and principal), and where the
//! completer keeps its progress on it. Its DDL and every statement on it, each written
//! whole beside the function that binds it.
//!
//! A row is written with the request's first step record, in the same message
//! ([`RequestsTable::recording`]), outside the request's transaction; the request's
//! COMMIT deletes it ([`RequestsTable::forgetting`]), as it deletes the steps. A row
//! that stays is a request whose client went away after an outside call: the completer
//! ([`crate::complete`]) runs it again, or abandons it for good and runs the steps'
//! compensations. It lives beside the steps (the step pool's database) and, on a
//! distributed engine, on the shard of its key.

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row, SqlStr};

use super::{statement, Dialect, Pooler, Single, TableName};
use crate::identity::KeyInScope;
use crate::literal::{self, Literal};

/// The SQL that creates the requests table (under its default name) and its index, for
/// services that run their own migrations. [`Store::migrate`](crate::Store::migrate)
/// runs it for a store with the default tables;
/// [`Store::requests_schema_sql`](crate::Store::requests_schema_sql) gives it for any.
pub(crate) const REQUESTS_SCHEMA_SQL: &str = include_str!("../../sql/idempotency_requests.sql");

/// The default name of the requests table, in the schema of the store's idempotency
/// table.
pub(crate) const DEFAULT_REQUESTS_TABLE: &str = "idempotency_requests";

/// The DDL, with `{create_schema}`, `{table}`, `{name}` and `{principal_type}` to fill
/// in.
const DDL: &str = "-- idem: the requests table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is a request of a completable endpoint (`#[idempotent(.., completable = true)]`)
-- that recorded a step and has not committed: what it takes to run it again, written
-- with its first step, and the completer's progress on it. The request's COMMIT deletes
-- it; the sweeper removes rows whose key has expired.
{create_schema}CREATE TABLE IF NOT EXISTS {table} (
    scope        text        NOT NULL,
    principal    {principal_type} NOT NULL,
    key          text        NOT NULL,
    -- SHA-256 of the request's canonical fingerprint, as its steps have it
    fingerprint  bytea       NOT NULL,
    -- the request as it arrived: method, path and query, the allowed headers (a JSON
    -- array of [name, value]) and the body; NULL for a request an operator abandoned
    -- whose endpoint stores none
    method       text,
    target       text,
    headers      text,
    body         bytea,
    -- 'pending' (to complete), 'abandoning' (an operator gave it up: compensate),
    -- 'failed' (parked after too many definitive failures)
    state        text        NOT NULL DEFAULT 'pending',
    -- every run of the completer, and the definitive failures among them
    tries        integer     NOT NULL DEFAULT 0,
    failures     integer     NOT NULL DEFAULT 0,
    next_at      timestamptz NOT NULL DEFAULT now(),
    leased_until timestamptz,
    last_error   text,
    error_at     timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    CONSTRAINT \"{name}_pkey\" PRIMARY KEY (scope, principal, key)
);

-- The sweeper deletes expired rows.
CREATE INDEX IF NOT EXISTS \"{name}_expires_at_idx\" ON {table} (expires_at);

-- The request's per-field hashes (`Fingerprint::parts`, as the keys' rows keep them),
-- added after the table's first migration: after a deploy that reorders or adds `fields`,
-- a retry is compared on the fields both versions share.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS field_hashes bytea;
";

/// The request, written in the message of its first step's record, after the step's
/// insert (so the fence skips it too). A live row stays as it is (another step of the
/// same request, or a run of the completer, stores nothing new); an expired one is
/// replaced (`{keep_live}`, left out on a distributed engine, which refuses a function
/// that is not immutable there: there the request's content is rewritten, its progress
/// kept). $1 scope, $2 principal, $3 key, $4 fingerprint, $5 method, $6 target, $7
/// headers, $8 body, $9 ttl in seconds, $10 the per-field hashes.
const RECORD: &str = "\
INSERT INTO {table} AS r (scope, principal, key, fingerprint, field_hashes, method, target, headers,
                          body, expires_at)
VALUES ($1, {p2}, $3, $4, $10, $5, $6, $7, $8, now() + $9 * interval '1 second')
ON CONFLICT (scope, principal, key) DO UPDATE
   SET fingerprint = excluded.fingerprint, field_hashes = excluded.field_hashes,
       method = excluded.method, target = excluded.target,
       headers = excluded.headers, body = excluded.body, expires_at = excluded.expires_at{keep_live}";

/// What an expired row's replacement also resets.
const KEEP_LIVE: &str = ",
       state = 'pending', tries = 0, failures = 0, next_at = now(), leased_until = NULL,
       last_error = NULL, error_at = NULL, created_at = now()
 WHERE r.expires_at <= now()";

/// The request's row, deleted by its COMMIT message. $1 scope, $2 principal, $3 key.
const FORGET: &str = "DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3";

/// Requests the completer may take now, oldest first, at most $2: not parked, not
/// leased, due, and either given up by an operator, sent to be completed now by one
/// ([`MARK`]), or older than the window ($1 seconds). The table holds only requests that
/// have not committed.
const DUE: &str = "\
SELECT scope, principal::text AS principal, key,
       extract(epoch FROM expires_at - now())::float8 AS remaining
  FROM {table}
 WHERE state <> 'failed' AND expires_at > now() AND next_at <= now()
   AND (leased_until IS NULL OR leased_until <= now())
   AND (state = 'abandoning' OR leased_until = '-infinity'
        OR created_at <= now() - $1 * interval '1 second')
 ORDER BY created_at
 LIMIT $2";

/// Leases one request for $4 seconds, if no other completer holds it: one statement on
/// the row's own shard (its `RETURNING` calls no function that is not immutable, which a
/// distributed engine refuses there), so that two completers never run a request at once (the key's
/// claim fences a second run anyway: it waits, or is answered 409). $1 scope, $2
/// principal, $3 key.
const LEASE: &str = "\
UPDATE {table}
   SET leased_until = now() + $4 * interval '1 second', tries = tries + 1
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND state <> 'failed'
   AND expires_at > now() AND (leased_until IS NULL OR leased_until <= now())
RETURNING encode(fingerprint, 'hex') AS fingerprint, encode(field_hashes, 'hex') AS field_hashes,
          method, target, headers, body, state, tries";

/// A run that did not finish the request: the lease given back, the next try in $4
/// seconds, the error kept; a definitive failure ($6) counts, and parks the request at
/// the limit ($7): as `failed`, or as `abandoning` at once where the completer abandons
/// what it parks ($8). $5 the error. (`now()` stays out of the `CASE`s: a distributed
/// engine refuses a function that is not immutable in one.)
///
/// Fenced (invariant 11): only while the run still holds its lease, $9 the `tries` its
/// lease returned. Each lease counts a try, so a completer whose lease ran out, and was
/// taken by another, writes nothing over the other's progress.
const FAILED: &str = "\
UPDATE {table}
   SET leased_until = NULL, last_error = $5, error_at = now(),
       failures = failures + CASE WHEN $6 THEN 1 ELSE 0 END,
       next_at = now() + CASE WHEN $6 AND $8 AND state = 'pending' AND failures + 1 >= $7
                              THEN 0 ELSE $4 END * interval '1 second',
       state = CASE WHEN $6 AND state = 'pending' AND failures + 1 >= $7
                    THEN CASE WHEN $8 THEN 'abandoning' ELSE 'failed' END
                    ELSE state END
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND tries = $9
RETURNING state, failures";

/// Marks a request as given up by an operator ($4 true) or sends it back to be
/// completed at once ($4 false), unless it is being abandoned: an abandon is for good.
/// A completion asked for now is due at the completer's next look, however young the
/// request ([`DUE`]): its lease reads `-infinity` until a completer takes it. $1 scope,
/// $2 principal, $3 key.
const MARK: &str = "\
UPDATE {table}
   SET state = CASE WHEN $4 THEN 'abandoning' ELSE 'pending' END, next_at = now(),
       leased_until = CASE WHEN $4 THEN NULL ELSE timestamptz '-infinity' END,
       failures = CASE WHEN $4 THEN failures ELSE 0 END
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND ($4 OR state <> 'abandoning')
RETURNING true AS marked";

/// A row for a request that stored nothing (its endpoint is not completable), to be
/// abandoned with: [`MARK`] found none. Its fingerprint $4 and ttl $5 seconds are its
/// steps'. (One statement of an upsert would do, but a distributed engine refuses a
/// function that is not immutable in its `DO UPDATE`.)
const ABANDON_UNSTORED: &str = "\
INSERT INTO {table} (scope, principal, key, fingerprint, state, expires_at)
VALUES ($1, {p2}, $3, $4, 'abandoning', now() + $5 * interval '1 second')
ON CONFLICT (scope, principal, key) DO NOTHING";

/// Whether a request has a row, and whether the request itself is stored in it. $1
/// scope, $2 principal, $3 key.
const STATE: &str = "\
SELECT method IS NOT NULL AS stored FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3";

/// Expired requests, oldest first, in a batch, as the steps' purge does: $1 the batch
/// size, $2 where the previous batch stopped. Each was a request that made a step and
/// never committed, nor was completed or abandoned: `scopes`, `keys` and `states` name
/// them, for the sweeper to say so ([`ExpiredRequest`]).
const PURGE: &str = "\
WITH gone AS (
DELETE FROM {table}
 WHERE (scope, principal, key) IN (
        SELECT scope, principal, key FROM {table}
         WHERE expires_at <= now() AND expires_at >= {reached}
         ORDER BY expires_at
         LIMIT $1)
   AND expires_at <= now()
RETURNING expires_at, scope, key, state)
SELECT count(*) AS deleted, {reaches}, coalesce(array_agg(scope), '{}') AS scopes,
       coalesce(array_agg(key), '{}') AS keys, coalesce(array_agg(state), '{}') AS states
  FROM gone";

/// [`PURGE`] for a distributed engine: a read of a batch, then [`SWEEP_ONE_PORTABLE`]
/// for each, on its own shard.
const EXPIRED_PORTABLE: &str = "\
SELECT scope, principal::text AS principal, key, state,
       (extract(epoch FROM expires_at) * 1000000)::bigint AS reached
  FROM {table}
 WHERE expires_at <= now() AND expires_at >= {reached}
 ORDER BY expires_at LIMIT $1";

/// One expired request, by its primary key. $1 scope, $2 principal, $3 key.
const SWEEP_ONE_PORTABLE: &str = "\
DELETE FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND expires_at <= now()";

/// The requests table of one store.
pub(crate) struct RequestsTable {
    dialect: Dialect,
    ddl: String,
    record: String,
    forget: String,
    due: SqlStr,
    lease: SqlStr,
    failed: SqlStr,
    mark: SqlStr,
    abandon_unstored: SqlStr,
    state: SqlStr,
    purge: SqlStr,
    sweep_one: SqlStr,
}

/// A request as it arrived, to be stored with its first step.
#[derive(Debug, Clone)]
pub(crate) struct StoredRequest {
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: bytes::Bytes,
}

/// A request the completer may take ([`RequestsTable::due`]).
pub(crate) struct Due {
    /// The scope as stored.
    pub(crate) scope: String,
    /// The principal column's value, as text.
    pub(crate) principal: String,
    pub(crate) key: String,
    /// What is left of the key's ttl.
    pub(crate) remaining: Duration,
}

/// A stored request that expired unresolved ([`RequestsTable::purge`]): it made a step,
/// and its key's time passed before it committed, completed or was abandoned.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ExpiredRequest {
    /// The scope as stored.
    pub(crate) scope: String,
    pub(crate) key: String,
    /// `pending`, `failed` (parked) or `abandoning`.
    pub(crate) state: String,
}

/// A request a completer holds the lease of ([`RequestsTable::lease`]).
pub(crate) struct Leased {
    pub(crate) fingerprint: Vec<u8>,
    /// The request's per-field hashes (empty for a request stored before they were
    /// kept, or one that stored nothing).
    pub(crate) field_hashes: Vec<u8>,
    /// `None` for a request whose endpoint stored nothing (an operator abandoned it).
    pub(crate) request: Option<StoredRequest>,
    pub(crate) abandoning: bool,
    pub(crate) tries: i32,
    /// What is left of the key's ttl.
    pub(crate) remaining: Duration,
}

/// How a run ended that did not finish its request ([`RequestsTable::failed`]).
pub(crate) struct Failure<'a> {
    pub(crate) error: &'a str,
    /// Whether it counts toward the limit (a definitive failure).
    pub(crate) counted: bool,
    pub(crate) retry_in: Duration,
    pub(crate) limit: u32,
    /// Whether a request parked at the limit is abandoned at once.
    pub(crate) abandon_parked: bool,
    /// The `tries` its lease returned: the fence ([`FAILED`]).
    pub(crate) tries: i32,
}

impl RequestsTable {
    /// The table `name` in `dialect`.
    pub(crate) fn new(name: &TableName, dialect: Dialect) -> Self {
        let table = name.qualified();
        let render = |sql: &str| {
            sql.replace("{table}", &table)
                .replace("{p2}", dialect.principal_type.parameter())
                .replace("{reached}", crate::table::REACHED)
                .replace("{reaches}", crate::table::REACHES)
        };
        let ddl = DDL
            .replace("{create_schema}", &name.create_schema())
            .replace("{table}", &table)
            .replace("{name}", name.name())
            .replace(
                "{principal_type}",
                &format!("{:<11}", dialect.principal_type.sql()),
            );
        let keep_live = if dialect.portable { "" } else { KEEP_LIVE };
        let purge = if dialect.portable {
            EXPIRED_PORTABLE
        } else {
            PURGE
        };
        Self {
            dialect,
            ddl,
            record: render(RECORD).replace("{keep_live}", keep_live),
            forget: render(FORGET),
            due: statement(render(DUE)),
            lease: statement(render(LEASE)),
            failed: statement(render(FAILED)),
            mark: statement(render(MARK)),
            abandon_unstored: statement(render(ABANDON_UNSTORED)),
            state: statement(render(STATE)),
            purge: statement(render(purge)),
            sweep_one: statement(render(SWEEP_ONE_PORTABLE)),
        }
    }

    /// The DDL.
    pub(crate) fn ddl(&self) -> &str {
        &self.ddl
    }

    fn persistent(&self) -> bool {
        self.dialect.pooler == Pooler::Session
    }

    /// The key's three literals: scope, principal, key.
    fn key<'a>(&self, key: &'a KeyInScope, scope: &'a str) -> [Literal<'a>; 3] {
        [
            Literal::Text(scope),
            Literal::Text(self.dialect.principal_type.bound(&key.principal)),
            Literal::Text(key.key.as_str()),
        ]
    }

    /// [`RECORD`] for `request`, its values written in, to follow a step's record in
    /// its message.
    pub(crate) fn recording(
        &self,
        key: &KeyInScope,
        fingerprint: &[u8],
        field_hashes: &[u8],
        request: &StoredRequest,
        ttl: Duration,
    ) -> String {
        let scope = key.stored_scope();
        let [scope, principal, key] = self.key(key, &scope);
        let headers = serde_json::to_string(&request.headers).unwrap_or_else(|_| "[]".into());
        literal::render(
            &self.record,
            &[
                scope,
                principal,
                key,
                Literal::Bytes(fingerprint),
                Literal::Text(&request.method),
                Literal::Text(&request.target),
                Literal::Text(&headers),
                Literal::Bytes(&request.body),
                Literal::Float(ttl.as_secs_f64()),
                Literal::Bytes(field_hashes),
            ],
        )
    }

    /// [`FORGET`] for `key`, its values written in, for the request's COMMIT message.
    pub(crate) fn forgetting(&self, key: &KeyInScope) -> String {
        let scope = key.stored_scope();
        literal::render(&self.forget, &self.key(key, &scope))
    }

    /// [`FORGET`] now, on its own: a request another attempt committed, whose COMMIT did
    /// not carry the delete.
    pub(crate) async fn forget(&self, pool: &PgPool, key: &KeyInScope) -> Result<(), sqlx::Error> {
        let sql = statement(self.forgetting(key));
        sqlx::raw_sql(sql).execute(pool).await.map(drop)
    }

    /// [`DUE`]: the keys of up to `limit` requests to take now.
    pub(crate) async fn due(
        &self,
        pool: &PgPool,
        after: Duration,
        limit: u32,
    ) -> Result<Vec<Due>, sqlx::Error> {
        let mut conn = Single::open(self.dialect.pooler, pool).await?;
        let rows = sqlx::query(self.due.clone())
            .persistent(self.persistent())
            .bind(after.as_secs_f64())
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        rows.iter()
            .map(|row| {
                Ok(Due {
                    scope: row.try_get("scope")?,
                    principal: row.try_get("principal")?,
                    key: row.try_get("key")?,
                    remaining: Duration::from_secs_f64(
                        row.try_get::<f64, _>("remaining")?.max(1.0),
                    ),
                })
            })
            .collect()
    }

    /// [`LEASE`]: the request, if this completer now holds it for `lease`.
    pub(crate) async fn lease(
        &self,
        pool: &PgPool,
        due: &Due,
        lease: Duration,
    ) -> Result<Option<Leased>, sqlx::Error> {
        let mut conn = Single::open(self.dialect.pooler, pool).await?;
        let row = sqlx::query(self.lease.clone())
            .persistent(self.persistent())
            .bind(&due.scope)
            .bind(&due.principal)
            .bind(&due.key)
            .bind(lease.as_secs_f64())
            .fetch_optional(&mut *conn)
            .await?;
        conn.finish().await?;
        row.as_ref()
            .map(|row| leased(row, due.remaining))
            .transpose()
    }

    /// [`FAILED`]: the state the request was in and is left in (`failed`, or
    /// `abandoning`, once parked); `None` when the run no longer holds its lease (or the
    /// request is gone).
    pub(crate) async fn failed(
        &self,
        pool: &PgPool,
        (scope, principal, key): (&str, &str, &str),
        failure: &Failure<'_>,
    ) -> Result<Option<String>, sqlx::Error> {
        let mut conn = Single::open(self.dialect.pooler, pool).await?;
        let row = sqlx::query(self.failed.clone())
            .persistent(self.persistent())
            .bind(scope)
            .bind(principal)
            .bind(key)
            .bind(failure.retry_in.as_secs_f64())
            .bind(failure.error)
            .bind(failure.counted)
            .bind(i32::try_from(failure.limit).unwrap_or(i32::MAX))
            .bind(failure.abandon_parked)
            .bind(failure.tries)
            .fetch_optional(&mut *conn)
            .await?;
        conn.finish().await?;
        row.map(|row| row.try_get("state")).transpose()
    }

    /// [`MARK`] on `conn` (in the operator's audited transaction), and for an abandon
    /// of a request that has no row, [`ABANDON_UNSTORED`] with its steps' `fingerprint`
    /// and `ttl`: whether a row was marked (`false` for a completion of a request being
    /// abandoned).
    pub(crate) async fn mark(
        &self,
        conn: &mut sqlx::PgConnection,
        (scope, principal, key): (&str, &str, &str),
        abandon: bool,
        fingerprint: &[u8],
        ttl: Duration,
    ) -> Result<bool, sqlx::Error> {
        let marked: Option<bool> = sqlx::query_scalar(self.mark.clone())
            .persistent(self.persistent())
            .bind(scope)
            .bind(principal)
            .bind(key)
            .bind(abandon)
            .fetch_optional(&mut *conn)
            .await?;
        if marked.is_none() && abandon {
            sqlx::query(self.abandon_unstored.clone())
                .persistent(self.persistent())
                .bind(scope)
                .bind(principal)
                .bind(key)
                .bind(fingerprint)
                .bind(ttl.as_secs_f64())
                .execute(conn)
                .await?;
            return Ok(true);
        }
        Ok(marked.is_some())
    }

    /// [`STATE`]: `None` when the request has no row; whether the request is stored in
    /// it otherwise.
    pub(crate) async fn state(
        &self,
        pool: &PgPool,
        key: (&str, &str, &str),
    ) -> Result<Option<bool>, sqlx::Error> {
        let mut conn = Single::open(self.dialect.pooler, pool).await?;
        let state = self.state_on(&mut conn, key).await?;
        conn.finish().await?;
        Ok(state)
    }

    /// [`Self::state`] on `conn`.
    pub(crate) async fn state_on(
        &self,
        conn: &mut sqlx::PgConnection,
        (scope, principal, key): (&str, &str, &str),
    ) -> Result<Option<bool>, sqlx::Error> {
        sqlx::query_scalar(self.state.clone())
            .persistent(self.persistent())
            .bind(scope)
            .bind(principal)
            .bind(key)
            .fetch_optional(conn)
            .await
    }

    /// [`PURGE`]: how many rows one batch deleted; `reached` as for the steps' purge.
    pub(crate) async fn purge(
        &self,
        conn: &mut sqlx::PgConnection,
        batch_size: i64,
        reached: &mut Option<i64>,
        unresolved: &mut Vec<ExpiredRequest>,
    ) -> Result<u64, sqlx::Error> {
        let query = sqlx::query(self.purge.clone())
            .persistent(self.persistent())
            .bind(batch_size)
            .bind(*reached);
        if !self.dialect.portable {
            let row = query.fetch_one(conn).await?;
            let [scopes, keys, states]: [Vec<String>; 3] = [
                row.try_get("scopes")?,
                row.try_get("keys")?,
                row.try_get("states")?,
            ];
            unresolved.extend(
                scopes
                    .into_iter()
                    .zip(keys)
                    .zip(states)
                    .map(|((scope, key), state)| ExpiredRequest { scope, key, state }),
            );
            return super::purged(&row, reached);
        }
        let expired = query.fetch_all(&mut *conn).await?;
        let mut deleted = 0;
        for row in expired {
            let [scope, principal, key, state]: [String; 4] = [
                row.try_get("scope")?,
                row.try_get("principal")?,
                row.try_get("key")?,
                row.try_get("state")?,
            ];
            *reached = Some(row.try_get("reached")?);
            let gone = sqlx::query(self.sweep_one.clone())
                .persistent(self.persistent())
                .bind(&scope)
                .bind(principal)
                .bind(&key)
                .execute(&mut *conn)
                .await?
                .rows_affected();
            if gone > 0 {
                unresolved.push(ExpiredRequest { scope, key, state });
            }
            deleted += gone;
        }
        Ok(deleted)
    }
}

fn leased(row: &PgRow, remaining: Duration) -> Result<Leased, sqlx::Error> {
    let method: Option<String> = row.try_get("method")?;
    let request = match method {
        None => None,
        Some(method) => {
            let headers: Option<String> = row.try_get("headers")?;
            let headers = serde_json::from_str(headers.as_deref().unwrap_or("[]"))
                .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            Some(StoredRequest {
                method,
                target: row
                    .try_get::<Option<String>, _>("target")?
                    .unwrap_or_default(),
                headers,
                body: row
                    .try_get::<Option<Vec<u8>>, _>("body")?
                    .unwrap_or_default()
                    .into(),
            })
        }
    };
    let state: String = row.try_get("state")?;
    Ok(Leased {
        fingerprint: crate::table::unhex(row.try_get("fingerprint")?)?.unwrap_or_default(),
        field_hashes: crate::table::unhex(row.try_get("field_hashes")?)?.unwrap_or_default(),
        request,
        abandoning: state == "abandoning",
        tries: row.try_get("tries")?,
        remaining,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_schema_is_the_default_table_s() {
        let name = TableName::parse(DEFAULT_REQUESTS_TABLE).expect("a valid name");
        assert_eq!(
            RequestsTable::new(&name, Dialect::default()).ddl(),
            REQUESTS_SCHEMA_SQL
        );
    }

    #[test]
    fn a_record_writes_its_values_as_literals() {
        let name = TableName::parse("app.requests").expect("a valid name");
        let table = RequestsTable::new(&name, Dialect::default());
        let key = KeyInScope {
            scope: "charges".into(),
            principal: "acct_1".to_owned(),
            key: crate::key::IdempotencyKey::from_text("k'1").expect("a key"),
            place: crate::identity::Place::Principal,
        };
        let request = StoredRequest {
            method: "POST".into(),
            target: "/charges?x='1'".into(),
            headers: vec![("content-type".into(), "application/json".into())],
            body: bytes::Bytes::from_static(b"{\"amount\": 1}'; DROP TABLE x; --"),
        };
        let sql = table.recording(&key, &[1, 2], &[3], &request, Duration::from_secs(60));
        assert!(sql.starts_with("INSERT INTO \"app\".\"requests\""), "{sql}");
        assert!(
            !sql.contains("DROP") && !sql.contains("k'1") && !sql.contains('$'),
            "{sql}"
        );
        assert!(sql.contains("WHERE r.expires_at <= now()"), "{sql}");
        let portable = RequestsTable::new(
            &name,
            Dialect {
                portable: true,
                ..Dialect::default()
            },
        );
        let sql = portable.recording(&key, &[1, 2], &[3], &request, Duration::from_secs(60));
        assert!(
            !sql.contains("now() WHERE") && !sql.contains("WHERE"),
            "{sql}"
        );
    }

    /// Invariant 11 (issue 48): a completer whose lease ran out, and was taken by
    /// another, recorded its failure over the other's run (the update was not fenced).
    #[tokio::test(flavor = "multi_thread")]
    async fn a_failure_is_recorded_only_under_its_own_lease() {
        use crate::table::cost::{drop_schema, pool, schema};
        use sqlx::AssertSqlSafe;

        let pool = pool().await;
        let schema = schema("requests_fence");
        let name = TableName::parse(&format!("{schema}.requests")).unwrap();
        let table = RequestsTable::new(&name, Dialect::default());
        crate::table::create(&pool, &statement(table.ddl().to_owned()))
            .await
            .expect("the requests table");
        let key = KeyInScope {
            scope: "charges".into(),
            principal: String::new(),
            key: crate::key::IdempotencyKey::from_text("k1").expect("a key"),
            place: crate::identity::Place::Nobody,
        };
        let request = StoredRequest {
            method: "POST".into(),
            target: "/charges".into(),
            headers: Vec::new(),
            body: bytes::Bytes::new(),
        };
        let record = table.recording(&key, &[1], &[2], &request, Duration::from_secs(600));
        sqlx::raw_sql(AssertSqlSafe(record))
            .execute(&pool)
            .await
            .unwrap();
        let due = Due {
            scope: "charges".into(),
            principal: String::new(),
            key: "k1".into(),
            remaining: Duration::from_secs(600),
        };
        let first = table
            .lease(&pool, &due, Duration::from_secs(60))
            .await
            .unwrap();
        let first = first.expect("leased");
        // Its lease runs out; another completer leases the request.
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET leased_until = now() - interval '1 second'",
            name.qualified()
        )))
        .execute(&pool)
        .await
        .unwrap();
        let second = table
            .lease(&pool, &due, Duration::from_secs(60))
            .await
            .unwrap();
        let second = second.expect("leased again");
        let failure = |tries| Failure {
            error: "late",
            counted: true,
            retry_in: Duration::from_secs(1),
            limit: 1,
            abandon_parked: false,
            tries,
        };
        let triple = ("charges", "", "k1");
        let late = table
            .failed(&pool, triple, &failure(first.tries))
            .await
            .unwrap();
        assert_eq!(late, None, "the first run no longer holds the request");
        let state: (String, i32, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT state, failures, last_error FROM {}",
            name.qualified()
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            state,
            ("pending".to_owned(), 0, None),
            "left to the second run"
        );
        let own = table
            .failed(&pool, triple, &failure(second.tries))
            .await
            .unwrap();
        assert_eq!(
            own.as_deref(),
            Some("failed"),
            "its own run parks it at the limit"
        );
        drop_schema(&pool, &schema).await;
    }

    /// Issue 48: a parked request vanished, unlisted and unsaid, when its key's ttl
    /// passed. The purge now names each request it deletes: every one made a step and
    /// never committed (the sweeper logs an ERROR line for each).
    #[tokio::test(flavor = "multi_thread")]
    async fn a_purge_names_the_requests_that_expired_unresolved() {
        use crate::table::cost::{drop_schema, pool, schema};
        use sqlx::AssertSqlSafe;

        let pool = pool().await;
        for portable in [false, true] {
            let schema = schema("requests_expired");
            let name = TableName::parse(&format!("{schema}.requests")).unwrap();
            let dialect = Dialect {
                portable,
                ..Dialect::default()
            };
            let table = RequestsTable::new(&name, dialect);
            crate::table::create(&pool, &statement(table.ddl().to_owned()))
                .await
                .expect("the requests table");
            let request = StoredRequest {
                method: "POST".into(),
                target: "/charges".into(),
                headers: Vec::new(),
                body: bytes::Bytes::new(),
            };
            for (key, ttl) in [("parked", 0), ("live", 600)] {
                let key = KeyInScope {
                    scope: "charges".into(),
                    principal: String::new(),
                    key: crate::key::IdempotencyKey::from_text(key).expect("a key"),
                    place: crate::identity::Place::Nobody,
                };
                let record = table.recording(&key, &[1], &[2], &request, Duration::from_secs(ttl));
                sqlx::raw_sql(AssertSqlSafe(record))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {} SET state = 'failed' WHERE key = 'parked'",
                name.qualified()
            )))
            .execute(&pool)
            .await
            .unwrap();
            let mut conn = pool.acquire().await.unwrap();
            let (mut reached, mut unresolved) = (None, Vec::new());
            let deleted = table
                .purge(&mut conn, 100, &mut reached, &mut unresolved)
                .await
                .unwrap();
            drop(conn);
            assert_eq!(deleted, 1, "portable: {portable}");
            assert_eq!(
                unresolved,
                [ExpiredRequest {
                    scope: "charges".into(),
                    key: "parked".into(),
                    state: "failed".into(),
                }],
                "portable: {portable}"
            );
            drop_schema(&pool, &schema).await;
        }
    }
}
