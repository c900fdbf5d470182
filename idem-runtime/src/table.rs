//! The idempotency table: its name, its DDL, and every statement idem runs on it, each
//! written whole beside the function that binds its parameters and decodes its rows.
//! Only the table's name is filled in, once per store.
//!
//! # The claim's lock timeout
//!
//! A claim that finds another request's uncommitted row waits for it, for at most the
//! endpoint's conflict wait; then PostgreSQL raises 55P03, which the engine answers as
//! "in use" (409). The handler's own statements must not inherit that timeout. `SET
//! LOCAL` before and after the claim would cost two statements on every request, so the
//! claim sets `lock_timeout` in the row it inserts (computed before the insert can wait)
//! and restores it in the row it returns (computed after the insert finished), with
//! `set_config(.., true)`, the function form of `SET LOCAL`. The session's own value is
//! kept in the custom setting `idem.lock_timeout`, saved once per transaction. Every path
//! that reaches the handler passes through a statement that returned a row ([`Table::claim`],
//! [`Table::read`] or [`Table::reclaim`]), so the timeout is always restored by then.
//!
//! `lock_timeout = 0` means "wait forever" to PostgreSQL, so the shortest wait bound is
//! 1 ms ([`lock_timeout`]).

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, PgPool, Postgres, Row};

use crate::fingerprint::Fingerprint;
use crate::tx::KeyInScope;

/// The default table name.
pub const DEFAULT_TABLE: &str = "idempotency_keys";

/// The SQL that creates idem's table (under its default name) and its expiry index, for
/// services that run their own migrations. [`Store::migrate`](crate::Store::migrate)
/// runs exactly this for a store with the default table;
/// [`Store::schema_sql`](crate::Store::schema_sql) gives it for any.
pub const SCHEMA_SQL: &str = include_str!("../sql/idempotency_keys.sql");

/// The DDL, with `{create_schema}`, `{table}`, `{name}` to fill in.
const DDL: &str = "-- idem: the idempotency table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is written by the claiming request's own transaction and commits together with
-- that request's business writes and its stored response, or not at all. `status` is
-- NULL only while that transaction is open, so a committed row is always complete.
{create_schema}CREATE TABLE IF NOT EXISTS {table} (
    scope        text        NOT NULL,
    principal    text        NOT NULL,
    key          text        NOT NULL,
    -- SHA-256 of the request's canonical fingerprint
    fingerprint  bytea       NOT NULL,
    -- the target hash and one hash per named field
    field_hashes bytea       NOT NULL,
    status       smallint,
    -- allow-listed response headers, one \"name: value\" per line
    headers      bytea,
    body         bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    CONSTRAINT \"{name}_pkey\" PRIMARY KEY (scope, principal, key)
);

-- The sweeper deletes expired rows oldest first, in small batches.
CREATE INDEX IF NOT EXISTS \"{name}_expires_at_idx\" ON {table} (expires_at);
";

/// The isolation level of a request's transaction (`#[idempotent(isolation = ..)]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// PostgreSQL's default, and idem's (invariant 4).
    #[default]
    ReadCommitted,
    /// One snapshot for the whole handler.
    RepeatableRead,
    /// Serializable snapshot isolation: a transaction that could not have run serially
    /// fails with 40001, answered 503 with `Retry-After`.
    Serializable,
}

impl Isolation {
    /// The statement that opens a transaction at this level. Always explicit: a database
    /// whose default is REPEATABLE READ would otherwise fail the read after a blocked
    /// claim with 40001 (invariant 4).
    pub(crate) fn begin(self) -> &'static str {
        match self {
            Self::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Self::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Self::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

/// One statement: insert the claim, or return the stored row. `ON CONFLICT DO NOTHING`
/// takes no lock on a live row, so concurrent replays do not serialize. When the
/// conflicting row was committed after this statement's snapshot began (we waited for
/// it), neither branch returns a row and [`READ`] follows.
///
/// $1..$3 the key, $4 fingerprint, $5 field hashes, $6 ttl in seconds, $7 lock timeout,
/// $8 the request's statement timeout (NULL: the session's own). The statement timeout
/// stays set for the rest of the transaction: it bounds the handler's statements.
const CLAIM: &str = "\
WITH claimed AS (
    INSERT INTO {table} (scope, principal, key, fingerprint, field_hashes, expires_at)
    SELECT $1, $2, $3, $4, $5, now() + $6::float8 * interval '1 second'
      FROM (SELECT set_config('idem.lock_timeout',
                              coalesce(nullif(current_setting('idem.lock_timeout', true), ''),
                                       current_setting('lock_timeout')), true),
                   set_config('lock_timeout', $7, true),
                   set_config('statement_timeout', coalesce($8, current_setting('statement_timeout')), true)) AS wait
    ON CONFLICT (scope, principal, key) DO NOTHING
    RETURNING 1
)
SELECT true AS fresh, NULL::bytea AS fingerprint, NULL::bytea AS field_hashes,
       NULL::smallint AS status, NULL::bytea AS headers, NULL::bytea AS body,
       false AS expired,
       set_config('lock_timeout', current_setting('idem.lock_timeout'), true) AS restored
  FROM claimed
UNION ALL
SELECT false, fingerprint, field_hashes, status, headers, body, expires_at <= now(),
       set_config('lock_timeout', current_setting('idem.lock_timeout'), true)
  FROM {table}
 WHERE scope = $1 AND principal = $2 AND key = $3 AND NOT EXISTS (SELECT 1 FROM claimed)";

/// The row a claim waited for, read by a new statement, which sees it committed.
const READ: &str = "\
SELECT false AS fresh, fingerprint, field_hashes, status, headers, body,
       expires_at <= now() AS expired,
       set_config('lock_timeout', current_setting('idem.lock_timeout'), true) AS restored
  FROM {table}
 WHERE scope = $1 AND principal = $2 AND key = $3";

/// An expired row is taken over in place. A committed row with no status can only be
/// left by a handler that ended the transaction itself; it is taken over too, so that
/// key is never stuck. It waits like the claim does. Binds as [`CLAIM`].
const RECLAIM: &str = "\
UPDATE {table}
   SET fingerprint = $4, field_hashes = $5, status = NULL, headers = NULL, body = NULL,
       created_at = now(), expires_at = now() + $6::float8 * interval '1 second'
  FROM (SELECT set_config('idem.lock_timeout',
                          coalesce(nullif(current_setting('idem.lock_timeout', true), ''),
                                   current_setting('lock_timeout')), true),
               set_config('lock_timeout', $7, true),
               set_config('statement_timeout', coalesce($8, current_setting('statement_timeout')), true)) AS wait
 WHERE scope = $1 AND principal = $2 AND key = $3
   AND (expires_at <= now() OR status IS NULL)
RETURNING set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";

/// `created_at = now()` holds only inside the transaction that claimed the row (`now()`
/// is the transaction's start time): if the handler ran a raw COMMIT or ROLLBACK, this
/// matches nothing and the escape is caught instead of stored.
///
/// $1..$3 the key, $4 status, $5 headers, $6 body.
const STORE: &str = "\
UPDATE {table} SET status = $4, headers = $5, body = $6
 WHERE scope = $1 AND principal = $2 AND key = $3 AND status IS NULL AND created_at = now()";

/// Whether the committed row of a key is expired, read without waiting for locks: tells
/// a sweeper's (or a reclaim's) lock on an expired row from a request's on a live one.
const EXPIRED: &str = "\
SELECT expires_at <= now() FROM {table} WHERE scope = $1 AND principal = $2 AND key = $3";

/// Removes a claim that committed without its response (a handler's raw COMMIT).
const FORGET: &str = "\
DELETE FROM {table} WHERE scope = $1 AND principal = $2 AND key = $3 AND status IS NULL";

/// Expired rows, oldest first, skipping rows a request is reclaiming. The outer
/// `expires_at` test is not redundant: it is re-checked on a row that changed while we
/// waited, which the subquery's is not. $1 the batch size.
const PURGE: &str = "\
DELETE FROM {table}
 WHERE (scope, principal, key) IN (
        SELECT scope, principal, key FROM {table}
         WHERE expires_at <= now()
         ORDER BY expires_at
         LIMIT $1
           FOR UPDATE SKIP LOCKED)
   AND expires_at <= now()";

/// A committed record, for operators. $1..$3 the key.
const INSPECT: &str = "\
SELECT extract(epoch FROM created_at)::float8 AS created_at,
       extract(epoch FROM expires_at)::float8 AS expires_at,
       expires_at <= now() AS expired, status,
       coalesce(octet_length(body), 0) AS body_bytes
  FROM {table}
 WHERE scope = $1 AND principal = $2 AND key = $3 AND status IS NOT NULL";

/// A validated, optionally schema-qualified table name: `name` or `schema.name`, each
/// part 1 to 48 characters of lowercase ASCII letters, digits and `_`, not starting with
/// a digit (names that need no quoting, and leave room for the index's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: Option<String>,
    name: String,
}

impl TableName {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let valid = |part: &str| {
            !part.is_empty()
                && part.len() <= 48
                && part.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        };
        let (schema, name) = match text.split_once('.') {
            Some((schema, name)) => (Some(schema), name),
            None => (None, text),
        };
        if !valid(name) || schema.is_some_and(|s| !valid(s)) {
            return None;
        }
        Some(Self {
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        })
    }

    /// The table's own name, without its schema.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// As written in SQL: `"schema"."name"`, or `"name"` unqualified (the default, as in
    /// [`SCHEMA_SQL`], so it lands in the connection's default schema). Always quoted, so
    /// that a name that is also a keyword (`user`, `order`) works; the names are
    /// lowercase, so quoting does not change which table they name.
    pub(crate) fn qualified(&self) -> String {
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{}\"", self.name),
            None => format!("\"{}\"", self.name),
        }
    }
}

impl Default for TableName {
    /// [`DEFAULT_TABLE`], unqualified.
    fn default() -> Self {
        Self {
            schema: None,
            name: DEFAULT_TABLE.to_owned(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// The table of one store: its statements, rendered once.
pub(crate) struct Table {
    ddl: String,
    /// The primary key's name: a unique violation of *this* constraint means a concurrent
    /// request with the same key won (invariant 3); any other belongs to the business
    /// tables.
    primary_key: String,
    claim: String,
    read: String,
    reclaim: String,
    store: String,
    expired: String,
    forget: String,
    purge: String,
    inspect: String,
}

/// What a claim found.
pub(crate) enum Found {
    /// The row was inserted: this transaction holds the key.
    Claimed,
    /// A row exists.
    Stored(StoredRow),
}

/// A row of the table as the claim reads it.
pub(crate) struct StoredRow {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) field_hashes: Vec<u8>,
    /// `None` only for a row whose transaction ended without storing a response.
    pub(crate) status: Option<i16>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) expired: bool,
}

/// What is stored with a key: the answer's status, its allow-listed headers (one
/// `name: value` per line) and its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) status: u16,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Bytes,
}

/// A committed row as [`Table::inspect`] reads it.
pub(crate) struct InspectedRow {
    pub(crate) created_at: SystemTime,
    pub(crate) expires_at: SystemTime,
    pub(crate) expired: bool,
    pub(crate) status: i16,
    pub(crate) body_bytes: usize,
}

impl Table {
    pub(crate) fn new(name: &TableName) -> Self {
        let table = name.qualified();
        let render = |sql: &str| sql.replace("{table}", &table);
        let create_schema = match &name.schema {
            Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\";\n\n"),
            None => String::new(),
        };
        Self {
            ddl: DDL
                .replace("{create_schema}", &create_schema)
                .replace("{table}", &table)
                .replace("{name}", &name.name),
            primary_key: format!("{}_pkey", name.name),
            claim: render(CLAIM),
            read: render(READ),
            reclaim: render(RECLAIM),
            store: render(STORE),
            expired: render(EXPIRED),
            forget: render(FORGET),
            purge: render(PURGE),
            inspect: render(INSPECT),
        }
    }

    /// The table's DDL.
    pub(crate) fn ddl(&self) -> &str {
        &self.ddl
    }

    /// Whether `error` is a unique violation of this table's primary key.
    pub(crate) fn is_key_conflict(&self, error: &sqlx::Error) -> bool {
        matches!(error, sqlx::Error::Database(e) if e.constraint() == Some(self.primary_key.as_str()))
    }

    /// Creates the table and its index if they do not exist. Two processes starting at
    /// once can both pass `IF NOT EXISTS`; the loser fails on a catalog unique index
    /// (23505) or with 42P07/42710. The winner has committed by then, so running the
    /// statements again finds them existing.
    pub(crate) async fn create(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let mut attempt = 0;
        loop {
            match sqlx::raw_sql(&self.ddl).execute(pool).await {
                Ok(_) => return Ok(()),
                Err(sqlx::Error::Database(e))
                    if attempt < 5
                        && matches!(e.code().as_deref(), Some("23505" | "42P07" | "42710")) =>
                {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// [`CLAIM`]: `None` when the row it waited for committed after its snapshot.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        timeouts: Timeouts,
    ) -> Result<Option<Found>, sqlx::Error> {
        let query = claiming(&self.claim, key, fingerprint, timeouts);
        decode_found(query.fetch_optional(conn).await?)
    }

    /// [`READ`].
    pub(crate) async fn read(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
    ) -> Result<Option<Found>, sqlx::Error> {
        let query = keyed(&self.read, key);
        decode_found(query.fetch_optional(conn).await?)
    }

    /// [`RECLAIM`]: whether the row was taken over.
    pub(crate) async fn reclaim(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        timeouts: Timeouts,
    ) -> Result<bool, sqlx::Error> {
        let query = claiming(&self.reclaim, key, fingerprint, timeouts);
        Ok(query.fetch_optional(conn).await?.is_some())
    }

    /// [`STORE`]: `false` when the claimed row is not this transaction's any more.
    pub(crate) async fn store(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        record: &Record,
    ) -> Result<bool, sqlx::Error> {
        let done = keyed(&self.store, key)
            .bind(i16::try_from(record.status).unwrap_or(i16::MAX))
            .bind(&record.headers)
            .bind(record.body.as_ref())
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// [`EXPIRED`]: `None` when no committed row exists.
    pub(crate) async fn expired(
        &self,
        pool: &PgPool,
        key: &KeyInScope,
    ) -> Result<Option<bool>, sqlx::Error> {
        let query = sqlx::query_scalar(&self.expired)
            .bind(&*key.scope)
            .bind(key.principal.as_str())
            .bind(key.key.as_str());
        query.fetch_optional(pool).await
    }

    /// [`FORGET`].
    pub(crate) async fn forget(&self, pool: &PgPool, key: &KeyInScope) -> Result<(), sqlx::Error> {
        keyed(&self.forget, key).execute(pool).await.map(drop)
    }

    /// [`PURGE`]: how many rows one batch deleted.
    pub(crate) async fn purge(&self, pool: &PgPool, batch_size: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(&self.purge)
            .bind(batch_size)
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// [`INSPECT`] of (scope, principal, key) as stored.
    pub(crate) async fn inspect(
        &self,
        pool: &PgPool,
        [scope, principal, key]: [&str; 3],
    ) -> Result<Option<InspectedRow>, sqlx::Error> {
        let query = sqlx::query(&self.inspect)
            .bind(scope)
            .bind(principal)
            .bind(key);
        let Some(row) = query.fetch_optional(pool).await? else {
            return Ok(None);
        };
        let instant = |epoch: f64| UNIX_EPOCH + Duration::from_secs_f64(epoch.max(0.0));
        Ok(Some(InspectedRow {
            created_at: instant(row.try_get("created_at")?),
            expires_at: instant(row.try_get("expires_at")?),
            expired: row.try_get("expired")?,
            status: row.try_get("status")?,
            body_bytes: usize::try_from(row.try_get::<i32, _>("body_bytes")?).unwrap_or(0),
        }))
    }
}

/// A timeout as bound to a claim (`lock_timeout`, `statement_timeout`): whole
/// milliseconds, at least 1, since 0 would mean "no limit".
pub(crate) fn lock_timeout(wait: Duration) -> String {
    format!("{}ms", wait.as_millis().clamp(1, i32::MAX as u128))
}

/// A statement whose first three parameters are the key: (scope, principal, key).
fn keyed<'q>(sql: &'q str, key: &'q KeyInScope) -> Query<'q, Postgres, PgArguments> {
    sqlx::query(sql)
        .bind(&*key.scope)
        .bind(key.principal.as_str())
        .bind(key.key.as_str())
}

/// The durations a claim binds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// How long the record lives.
    pub(crate) ttl: Duration,
    /// How long the claim waits for another request's lock on the key.
    pub(crate) wait: Duration,
    /// The bound on each of the handler's statements; `None` for the session's own.
    pub(crate) statement: Option<Duration>,
}

/// [`CLAIM`] and [`RECLAIM`], bound.
fn claiming<'q>(
    sql: &'q str,
    key: &'q KeyInScope,
    fingerprint: &'q Fingerprint,
    timeouts: Timeouts,
) -> Query<'q, Postgres, PgArguments> {
    keyed(sql, key)
        .bind(fingerprint.combined().as_slice())
        .bind(fingerprint.parts())
        .bind(timeouts.ttl.as_secs_f64())
        .bind(lock_timeout(timeouts.wait))
        .bind(timeouts.statement.map(lock_timeout))
}

fn decode_found(row: Option<PgRow>) -> Result<Option<Found>, sqlx::Error> {
    let Some(row) = row else { return Ok(None) };
    if row.try_get::<bool, _>("fresh")? {
        return Ok(Some(Found::Claimed));
    }
    Ok(Some(Found::Stored(StoredRow {
        fingerprint: row.try_get("fingerprint")?,
        field_hashes: row.try_get("field_hashes")?,
        status: row.try_get("status")?,
        headers: row.try_get("headers")?,
        body: row.try_get("body")?,
        expired: row.try_get("expired")?,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Invariant 5: the request path keeps to SQL that PostgreSQL-compatible distributed
    /// engines also run: INSERT .. ON CONFLICT, SELECT, UPDATE, DELETE, and lock_timeout
    /// (set through `set_config`, the function form of `SET LOCAL`). A construct outside
    /// this set needs a measured reason.
    #[test]
    fn request_sql_stays_portable() {
        let table = Table::new(&TableName::default());
        assert_eq!(
            Isolation::default().begin(),
            "BEGIN ISOLATION LEVEL READ COMMITTED"
        );
        // The request path; purge and inspect run outside it.
        for statement in [
            &table.claim,
            &table.read,
            &table.reclaim,
            &table.store,
            &table.expired,
            &table.forget,
        ] {
            let first = statement.split_whitespace().next().unwrap_or_default();
            assert!(
                ["WITH", "SELECT", "UPDATE", "DELETE"].contains(&first),
                "unexpected statement: {statement}"
            );
            let lower = statement.to_lowercase();
            for exotic in [
                "pg_",
                "advisory",
                "skip locked",
                "for update",
                "xmin",
                "ctid",
                "notify",
                "listen",
                "make_interval",
            ] {
                assert!(!lower.contains(exotic), "{exotic:?} in: {statement}");
            }
            let settings: Vec<&str> = lower
                .match_indices("set_config('")
                .map(|(i, _)| &lower[i + 12..])
                .collect();
            assert!(
                settings.iter().all(|s| s.starts_with("lock_timeout'")
                    || s.starts_with("idem.lock_timeout'")
                    || s.starts_with("statement_timeout'")),
                "only lock_timeout and statement_timeout are ever set: {statement}"
            );
            assert!(!statement.contains('{'), "unrendered: {statement}");
        }
        assert!(table
            .claim
            .contains("ON CONFLICT (scope, principal, key) DO NOTHING"));
    }

    #[test]
    fn the_shipped_sql_is_the_default_table() {
        assert_eq!(TableName::parse(DEFAULT_TABLE), Some(TableName::default()));
        assert_eq!(Table::new(&TableName::default()).ddl(), SCHEMA_SQL);
    }

    #[test]
    fn table_names() {
        let name = TableName::parse("ops.idem_keys").unwrap();
        assert_eq!(name.qualified(), "\"ops\".\"idem_keys\"");
        assert_eq!(name.to_string(), "ops.idem_keys");
        let table = Table::new(&name);
        assert_eq!(table.primary_key, "idem_keys_pkey");
        assert!(table.ddl().starts_with("-- idem"));
        assert!(table.ddl().contains("CREATE SCHEMA IF NOT EXISTS \"ops\";"));
        assert!(table
            .ddl()
            .contains("CONSTRAINT \"idem_keys_pkey\" PRIMARY KEY"));
        assert!(table.claim.contains("INSERT INTO \"ops\".\"idem_keys\""));
        for bad in [
            "",
            "Keys",
            "a.b.c",
            "1keys",
            "keys; DROP TABLE x",
            "\"keys\"",
            ".keys",
            "keys.",
            &"k".repeat(49),
        ] {
            assert!(TableName::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn a_zero_conflict_wait_never_means_wait_forever() {
        // lock_timeout = 0 disables the timeout in PostgreSQL.
        assert_eq!(lock_timeout(Duration::ZERO), "1ms");
        assert_eq!(lock_timeout(Duration::from_millis(5)), "5ms");
    }
}
