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
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row, SqlSafeStr, SqlStr, Transaction};

use crate::fingerprint::Fingerprint;
use crate::tx::KeyInScope;

/// The default table name.
pub const DEFAULT_TABLE: &str = "idempotency_keys";

/// The SQL that creates idem's table (under its default name) and its expiry index, for
/// services that run their own migrations. [`Store::migrate`](crate::Store::migrate)
/// runs exactly this for a store with the default table;
/// [`Store::schema_sql`](crate::Store::schema_sql) gives it for any.
pub const SCHEMA_SQL: &str = include_str!("../sql/idempotency_keys.sql");

/// The DDL, with `{create_schema}`, `{table}`, `{name}`, `{principal_type}` to fill in.
const DDL: &str = "-- idem: the idempotency table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is written by the claiming request's own transaction and commits together with
-- that request's business writes and its stored response, or not at all. `status` is
-- NULL only while that transaction is open, so a committed row is always complete.
{create_schema}CREATE TABLE IF NOT EXISTS {table} (
    scope        text        NOT NULL,
    principal    {principal_type} NOT NULL,
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
    SELECT $1, {p2}, $3, $4, $5, now() + $6::float8 * interval '1 second'
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
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND NOT EXISTS (SELECT 1 FROM claimed)";

/// The row a claim waited for, read by a new statement, which sees it committed.
const READ: &str = "\
SELECT false AS fresh, fingerprint, field_hashes, status, headers, body,
       expires_at <= now() AS expired,
       set_config('lock_timeout', current_setting('idem.lock_timeout'), true) AS restored
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3";

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
 WHERE scope = $1 AND principal = {p2} AND key = $3
   AND (expires_at <= now() OR status IS NULL)
RETURNING set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";

/// `created_at = now()` holds only inside the transaction that claimed the row (`now()`
/// is the transaction's start time): if the handler ran a raw COMMIT or ROLLBACK, this
/// matches nothing and the escape is caught instead of stored.
///
/// The record's lifetime counts from here, just before COMMIT, not from the claim: a
/// handler that runs longer than its ttl must not commit a record that is already
/// expired, which the next retry would run again. (`statement_timestamp()` is stable,
/// so a distributed engine evaluates it once, as it does `now()`.)
///
/// $1..$3 the key, $4 status, $5 headers, $6 body, $7 ttl in seconds.
const STORE: &str = "\
UPDATE {table}
   SET status = $4, headers = $5, body = $6,
       expires_at = statement_timestamp() + $7::float8 * interval '1 second'
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NULL AND created_at = now()";

/// Whether the committed row of a key is expired, read without waiting for locks: tells
/// a sweeper's (or a reclaim's) lock on an expired row from a request's on a live one.
const EXPIRED: &str = "\
SELECT expires_at <= now() FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3";

/// Removes a claim that committed without its response (a handler's raw COMMIT).
const FORGET: &str = "\
DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NULL";

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
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NOT NULL";

/// [`CLAIM`] in portable mode: the waits are set by `SET LOCAL` before it
/// ([`Table::set_waits`]), so it reads and writes no setting. Binds as [`CLAIM`]; $7 and
/// $8 are not sent.
const CLAIM_PORTABLE: &str = "\
WITH claimed AS (
    INSERT INTO {table} (scope, principal, key, fingerprint, field_hashes, expires_at)
    VALUES ($1, {p2}, $3, $4, $5, now() + $6::float8 * interval '1 second')
    ON CONFLICT (scope, principal, key) DO NOTHING
    RETURNING 1
)
SELECT true AS fresh, NULL::bytea AS fingerprint, NULL::bytea AS field_hashes,
       NULL::smallint AS status, NULL::bytea AS headers, NULL::bytea AS body,
       false AS expired
  FROM claimed
UNION ALL
SELECT false, fingerprint, field_hashes, status, headers, body, expires_at <= now()
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND NOT EXISTS (SELECT 1 FROM claimed)";

/// [`READ`] in portable mode.
const READ_PORTABLE: &str = "\
SELECT false AS fresh, fingerprint, field_hashes, status, headers, body,
       expires_at <= now() AS expired
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3";

/// [`RECLAIM`] in portable mode. Binds as [`CLAIM_PORTABLE`].
const RECLAIM_PORTABLE: &str = "\
UPDATE {table}
   SET fingerprint = $4, field_hashes = $5, status = NULL, headers = NULL, body = NULL,
       created_at = now(), expires_at = now() + $6::float8 * interval '1 second'
 WHERE scope = $1 AND principal = {p2} AND key = $3
   AND (expires_at <= now() OR status IS NULL)
RETURNING 1";

/// The oldest expired rows, read without locks: the candidates of a portable sweep. $1
/// the batch size.
const EXPIRED_BATCH_PORTABLE: &str = "\
SELECT scope, principal::text AS principal, key FROM {table}
 WHERE expires_at <= now()
 ORDER BY expires_at
 LIMIT $1";

/// One expired row, by its primary key, in a transaction of its own, after `SET LOCAL
/// lock_timeout` ([`SWEEP_WAIT`]): the portable sweep. A distributed engine refuses row
/// locks across shards (`FOR UPDATE SKIP LOCKED`), and one `DELETE` of the whole batch
/// that waits for a row a request is taking over holds the locks of every row it already
/// deleted, so claims of those keys would wait behind it and be answered 409. One row
/// per statement holds no other row's lock; a row a request holds is skipped when the
/// wait expires, as `SKIP LOCKED` would skip it, and is not expired any more once that
/// request commits. Binds as [`FORGET`].
const SWEEP_ONE_PORTABLE: &str = "\
DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3 AND expires_at <= now()";

/// How long a portable sweep waits for a row's lock before it leaves the row to a
/// later sweep: far below a claim's wait for an expired row (one second), so that no
/// claim waits for a sweep long enough to be answered 409.
const SWEEP_WAIT: &str = "SET LOCAL lock_timeout = '50ms'";

/// The statements Citus needs after [`DDL`], as comments, for a portable store: the
/// table is distributed by `principal` and colocated with the user's tenant table.
const DISTRIBUTION: &str = "
-- Distributed PostgreSQL (Citus): distribute by principal, colocated with the table
-- that holds your tenants (its distribution column must also be {principal_type}), and
-- let Citus send idem's `SET LOCAL lock_timeout` to the workers:
--
--   SELECT create_distributed_table('{name_literal}', 'principal', colocate_with => 'accounts');
--   ALTER DATABASE your_database SET citus.propagate_set_commands = 'local';
";

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

    /// Its schema, when qualified.
    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// `name` in the same schema as this table.
    pub(crate) fn sibling(&self, name: &str) -> Self {
        Self {
            schema: self.schema.clone(),
            name: name.to_owned(),
        }
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

/// How a store talks to its database: [`Pooler`], portability and the principal's
/// column type, as the [`StoreBuilder`](crate::StoreBuilder) set them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Dialect {
    pub(crate) pooler: Pooler,
    pub(crate) portable: bool,
    pub(crate) principal_type: PrincipalType,
}

/// What sits between the service and PostgreSQL ([`StoreBuilder::pooler`]).
///
/// [`StoreBuilder::pooler`]: crate::StoreBuilder::pooler
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Pooler {
    /// Nothing, or a pooler in session mode: one server connection per client
    /// connection. idem's statements are prepared once per connection and reused.
    #[default]
    Session,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction`, and the like):
    /// consecutive transactions of one client connection may run on different server
    /// connections. idem then sends every statement unnamed (nothing prepared outlives
    /// it), and runs the statements it sends outside a request's transaction in a
    /// transaction of their own, so their parse and execute steps reach the same server
    /// connection.
    Transaction,
}

/// The SQL type of the `principal` column ([`StoreBuilder::principal_type`]). A
/// distributed engine colocates tables whose distribution columns have equal types, so
/// it is the type of the tenant column of your own tables.
///
/// [`StoreBuilder::principal_type`]: crate::StoreBuilder::principal_type
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrincipalType {
    /// `text` (the default): any principal.
    #[default]
    Text,
    /// `uuid`: the resolver answers a UUID in its text form; keys without a principal are
    /// kept under the nil UUID.
    Uuid,
    /// `bigint`: the resolver answers a decimal integer; keys without a principal are kept
    /// under 0.
    Bigint,
}

impl PrincipalType {
    /// Whether `principal` can key requests: a value of the column's type that PostgreSQL
    /// casts (any text; a UUID as 32 hex digits, plain or in the 8-4-4-4-12 groups, either
    /// optionally in braces; a decimal `bigint`), other than the value that keeps keys
    /// without a principal (the nil UUID, 0; see [`Self::bound`]), which would share their
    /// namespace. The empty text is "no principal" itself, decided before this.
    pub(crate) fn accepts(self, principal: &str) -> bool {
        match self {
            Self::Text => true,
            Self::Bigint => principal.parse::<i64>().is_ok_and(|n| n != 0),
            Self::Uuid => {
                let bare = principal
                    .strip_prefix('{')
                    .and_then(|p| p.strip_suffix('}'))
                    .unwrap_or(principal);
                let hex = |part: &str, len: usize| {
                    part.len() == len && part.bytes().all(|b| b.is_ascii_hexdigit())
                };
                let groups: Vec<&str> = bare.split('-').collect();
                let valid = match groups[..] {
                    [all] => hex(all, 32),
                    [a, b, c, d, e] => {
                        hex(a, 8) && hex(b, 4) && hex(c, 4) && hex(d, 4) && hex(e, 12)
                    }
                    _ => false,
                };
                valid && !bare.bytes().all(|b| b == b'0' || b == b'-')
            }
        }
    }

    /// The column's SQL type.
    pub(crate) fn sql(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Uuid => "uuid",
            Self::Bigint => "bigint",
        }
    }

    /// The bound principal ($2) as the column's type: bound as text, cast in SQL.
    fn parameter(self) -> &'static str {
        match self {
            Self::Text => "$2",
            Self::Uuid => "CAST($2 AS uuid)",
            Self::Bigint => "CAST($2 AS bigint)",
        }
    }

    /// The text bound for `principal`: "no principal" (`""`) as the type's zero value.
    /// Any other value is bound as given; one that is not of the type fails its cast
    /// (SQLSTATE 22P02), a resolver's fault.
    fn bound(self, principal: &str) -> &str {
        match (self, principal) {
            (Self::Uuid, "") => "00000000-0000-0000-0000-000000000000",
            (Self::Bigint, "") => "0",
            (_, principal) => principal,
        }
    }
}

/// The table of one store: its statements, rendered once. Each is an [`SqlStr`] shared
/// by reference count, so a request's statement costs no copy of its text.
pub(crate) struct Table {
    dialect: Dialect,
    acquire_timeout: Duration,
    ddl: SqlStr,
    /// The primary key's name: a unique violation of *this* constraint means a concurrent
    /// request with the same key won (invariant 3); any other belongs to the business
    /// tables.
    primary_key: String,
    claim: SqlStr,
    read: SqlStr,
    reclaim: SqlStr,
    store: SqlStr,
    expired: SqlStr,
    forget: SqlStr,
    /// [`PURGE`], or in portable mode [`EXPIRED_BATCH_PORTABLE`].
    purge: SqlStr,
    sweep_one: SqlStr,
    inspect: SqlStr,
}

/// One of this module's statements (or the outbox's, [`crate::outbox`]) with the table's
/// name filled in. sqlx takes dynamic SQL only through [`AssertSqlSafe`], and this is the
/// one place idem asserts it: the text is a constant of this module or the outbox's, the
/// name a [`TableName`] (lowercase ASCII letters, digits and `_`, quoted) and the
/// principal's cast a constant; nothing a client sends reaches it, values go as binds.
pub(crate) fn statement(sql: String) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(sql)).into_sql_str()
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
    /// The table `name` in `dialect`; `acquire_timeout` bounds the wait for a connection
    /// of the statements run outside a request ([`Self::single`]).
    pub(crate) fn new(name: &TableName, dialect: Dialect, acquire_timeout: Duration) -> Self {
        let table = name.qualified();
        let render = |sql: &str| {
            statement(
                sql.replace("{table}", &table)
                    .replace("{p2}", dialect.principal_type.parameter()),
            )
        };
        let create_schema = match &name.schema {
            Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\";\n\n"),
            None => String::new(),
        };
        let mut ddl = DDL.replace(
            "{principal_type}",
            &format!("{:<11}", dialect.principal_type.sql()),
        );
        if dialect.portable {
            ddl.push_str(
                &DISTRIBUTION
                    .replace("{principal_type}", dialect.principal_type.sql())
                    .replace("{name_literal}", &name.to_string()),
            );
        }
        let ddl = statement(
            ddl.replace("{create_schema}", &create_schema)
                .replace("{table}", &table)
                .replace("{name}", &name.name),
        );
        let pick =
            |fast: &str, portable: &str| render(if dialect.portable { portable } else { fast });
        Self {
            dialect,
            acquire_timeout,
            ddl,
            primary_key: format!("{}_pkey", name.name),
            claim: pick(CLAIM, CLAIM_PORTABLE),
            read: pick(READ, READ_PORTABLE),
            reclaim: pick(RECLAIM, RECLAIM_PORTABLE),
            store: render(STORE),
            expired: render(EXPIRED),
            forget: render(FORGET),
            purge: pick(PURGE, EXPIRED_BATCH_PORTABLE),
            sweep_one: render(SWEEP_ONE_PORTABLE),
            inspect: render(INSPECT),
        }
    }

    /// Whether this store is in portable mode.
    pub(crate) fn portable(&self) -> bool {
        self.dialect.portable
    }

    /// Whether this store's statements are prepared once per connection and reused: not
    /// behind a transaction pooler, where they go unnamed.
    pub(crate) fn persistent(&self) -> bool {
        self.dialect.pooler == Pooler::Session
    }

    /// A statement as this store sends it: unnamed behind a transaction pooler.
    fn query(&self, sql: &SqlStr) -> Query<'static, Postgres, PgArguments> {
        sqlx::query(sql.clone()).persistent(self.persistent())
    }

    /// A statement whose first three parameters are the key: (scope, principal, key).
    fn keyed(&self, sql: &SqlStr, key: &KeyInScope) -> Query<'static, Postgres, PgArguments> {
        self.query(sql)
            .bind(&*key.scope)
            .bind(self.dialect.principal_type.bound(&key.principal))
            .bind(key.key.as_str())
    }

    /// [`CLAIM`] and [`RECLAIM`] (or their portable forms), bound.
    fn claiming(
        &self,
        sql: &SqlStr,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        timeouts: Timeouts,
    ) -> Query<'static, Postgres, PgArguments> {
        let query = self
            .keyed(sql, key)
            .bind(fingerprint.combined().as_slice())
            .bind(fingerprint.parts())
            .bind(timeouts.ttl.as_secs_f64());
        if self.dialect.portable {
            return query;
        }
        query
            .bind(lock_timeout(timeouts.wait))
            .bind(timeouts.statement.map(lock_timeout))
    }

    /// A connection of `pool` for one statement outside a request's transaction: in a
    /// transaction of its own behind a transaction pooler, so that the statement's parse
    /// and execute steps reach the same server connection.
    ///
    /// Waiting for the connection is bounded by the store's `acquire_timeout`, as a
    /// request's own transaction is: under pool exhaustion the 409 path (which asks
    /// whether a row is expired) and the operators' calls fail fast with
    /// [`sqlx::Error::PoolTimedOut`] instead of waiting for the pool's own bound.
    pub(crate) async fn single(&self, pool: &PgPool) -> Result<Single, sqlx::Error> {
        let connect = async {
            Ok(match self.dialect.pooler {
                Pooler::Session => Single::Direct(pool.acquire().await?),
                Pooler::Transaction => Single::Pinned(pool.begin().await?),
            })
        };
        self.bounded(connect).await
    }

    /// `connect`, waited for no longer than the store's `acquire_timeout`.
    async fn bounded<T>(
        &self,
        connect: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        tokio::time::timeout(self.acquire_timeout, connect)
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
    }

    /// Portable mode: sets the claim's waits with `SET LOCAL`, which a distributed
    /// engine forwards to the nodes that run the claim (Citus with
    /// `citus.propagate_set_commands = 'local'`). One statement; none in the default
    /// mode, where the claim sets them itself.
    pub(crate) async fn set_waits(
        &self,
        conn: &mut PgConnection,
        timeouts: Timeouts,
    ) -> Result<(), sqlx::Error> {
        if !self.dialect.portable {
            return Ok(());
        }
        // Both values are whole milliseconds written by `lock_timeout`: digits and "ms".
        let mut sql = format!("SET LOCAL lock_timeout = '{}'", lock_timeout(timeouts.wait));
        if let Some(statement) = timeouts.statement {
            sql.push_str(&format!(
                "; SET LOCAL statement_timeout = '{}'",
                lock_timeout(statement)
            ));
        }
        // A query without arguments goes by the simple protocol: unnamed, and several
        // statements at once, as `raw_sql` sends them. Asserted safe: both values are
        // digits and "ms" (above), nothing from a client.
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(conn)
            .await
            .map(drop)
    }

    /// Portable mode: after a successful claim, gives the handler the session's default
    /// `lock_timeout` back (the value it connected with, by its role, database or
    /// connection options; not one set later by a session-level `SET`). None in the
    /// default mode, where the claim's row restored it.
    pub(crate) async fn restore_wait(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        if !self.dialect.portable {
            return Ok(());
        }
        sqlx::raw_sql("SET LOCAL lock_timeout TO DEFAULT")
            .execute(conn)
            .await
            .map(drop)
    }

    /// The table's DDL.
    pub(crate) fn ddl(&self) -> &str {
        self.ddl.as_str()
    }

    /// Whether `error` is a unique violation of this table's primary key.
    pub(crate) fn is_key_conflict(&self, error: &sqlx::Error) -> bool {
        matches!(error, sqlx::Error::Database(e) if e.constraint() == Some(self.primary_key.as_str()))
    }

    /// Creates the table and its index if they do not exist ([`create`]).
    pub(crate) async fn create(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        create(pool, &self.ddl).await
    }

    /// [`CLAIM`]: `None` when the row it waited for committed after its snapshot.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        timeouts: Timeouts,
    ) -> Result<Option<Found>, sqlx::Error> {
        let query = self.claiming(&self.claim, key, fingerprint, timeouts);
        decode_found(query.fetch_optional(conn).await?)
    }

    /// [`READ`].
    pub(crate) async fn read(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
    ) -> Result<Option<Found>, sqlx::Error> {
        let query = self.keyed(&self.read, key);
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
        let query = self.claiming(&self.reclaim, key, fingerprint, timeouts);
        Ok(query.fetch_optional(conn).await?.is_some())
    }

    /// [`STORE`]: `false` when the claimed row is not this transaction's any more.
    pub(crate) async fn store(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        ttl: Duration,
        record: &Record,
    ) -> Result<bool, sqlx::Error> {
        let done = self
            .keyed(&self.store, key)
            .bind(i16::try_from(record.status).unwrap_or(i16::MAX))
            .bind(&record.headers)
            .bind(record.body.as_ref())
            .bind(ttl.as_secs_f64())
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
        let mut conn = self.single(pool).await?;
        let row = self
            .keyed(&self.expired, key)
            .fetch_optional(&mut *conn)
            .await?;
        conn.finish().await?;
        row.map(|row| row.try_get(0)).transpose()
    }

    /// [`FORGET`].
    pub(crate) async fn forget(&self, pool: &PgPool, key: &KeyInScope) -> Result<(), sqlx::Error> {
        let mut conn = self.single(pool).await?;
        self.keyed(&self.forget, key).execute(&mut *conn).await?;
        conn.finish().await
    }

    /// [`PURGE`]: how many rows one batch deleted.
    /// In portable mode, [`EXPIRED_BATCH_PORTABLE`] and then [`SWEEP_ONE_PORTABLE`] for each
    /// row it found: one statement and one short transaction a row.
    pub(crate) async fn purge(&self, pool: &PgPool, batch_size: i64) -> Result<u64, sqlx::Error> {
        if self.dialect.portable {
            return self.purge_portable(pool, batch_size).await;
        }
        let mut conn = self.single(pool).await?;
        let done = self
            .query(&self.purge)
            .bind(batch_size)
            .execute(&mut *conn)
            .await?;
        conn.finish().await?;
        Ok(done.rows_affected())
    }

    async fn purge_portable(&self, pool: &PgPool, batch_size: i64) -> Result<u64, sqlx::Error> {
        let mut conn = self.single(pool).await?;
        let candidates = self
            .query(&self.purge)
            .bind(batch_size)
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        let mut deleted = 0;
        for row in candidates {
            let [scope, principal, key]: [String; 3] =
                [row.try_get(0)?, row.try_get(1)?, row.try_get(2)?];
            let mut tx = self.single_transaction(pool).await?;
            sqlx::Executor::execute(&mut *tx, SWEEP_WAIT).await?;
            let done = self
                .query(&self.sweep_one)
                .bind(&scope)
                .bind(&principal)
                .bind(&key)
                .execute(&mut *tx)
                .await;
            match done {
                Ok(done) => {
                    tx.commit().await?;
                    deleted += done.rows_affected();
                }
                // 55P03: a request holds the row; it is left for a later sweep.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {}
                Err(e) => return Err(e),
            }
        }
        Ok(deleted)
    }

    /// A transaction of `pool`, waited for no longer than the store's `acquire_timeout`.
    async fn single_transaction(
        &self,
        pool: &PgPool,
    ) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        self.bounded(pool.begin()).await
    }

    /// [`INSPECT`] of (scope, principal, key) as stored.
    pub(crate) async fn inspect(
        &self,
        pool: &PgPool,
        [scope, principal, key]: [&str; 3],
    ) -> Result<Option<InspectedRow>, sqlx::Error> {
        let mut conn = self.single(pool).await?;
        let query = self
            .query(&self.inspect)
            .bind(scope)
            .bind(self.dialect.principal_type.bound(principal))
            .bind(key);
        let row = query.fetch_optional(&mut *conn).await?;
        conn.finish().await?;
        let Some(row) = row else {
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

/// Runs `ddl`, made of `IF NOT EXISTS` statements. Two processes starting at once can
/// both pass `IF NOT EXISTS`; the loser fails on a catalog unique index (23505) or with
/// 42P07/42710. The winner has committed by then, so running the statements again finds
/// them existing.
pub(crate) async fn create(pool: &PgPool, ddl: &SqlStr) -> Result<(), sqlx::Error> {
    let mut attempt = 0;
    loop {
        match sqlx::raw_sql(ddl.clone()).execute(pool).await {
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

/// The connection of one statement sent outside a request's transaction.
pub(crate) enum Single {
    Direct(PoolConnection<Postgres>),
    Pinned(Transaction<'static, Postgres>),
}

impl Single {
    /// Commits the statement's own transaction, if it has one.
    pub(crate) async fn finish(self) -> Result<(), sqlx::Error> {
        match self {
            Self::Direct(_) => Ok(()),
            Self::Pinned(tx) => tx.commit().await,
        }
    }
}

impl std::ops::Deref for Single {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pinned(tx) => tx,
        }
    }
}

impl std::ops::DerefMut for Single {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Self::Direct(conn) => conn,
            Self::Pinned(tx) => tx,
        }
    }
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

    #[test]
    fn principal_types_accept_what_postgres_casts() {
        let uuid = "6f1c8a52-3b7e-4a59-9a1d-2f0c5e9b7d41";
        for ok in [
            uuid,
            &uuid.to_uppercase(),
            &uuid.replace('-', ""),
            &format!("{{{uuid}}}"),
        ] {
            assert!(PrincipalType::Uuid.accepts(ok), "{ok}");
        }
        for bad in [
            "",
            "acct_1",
            &uuid[1..],
            &format!("{uuid}0"),
            "6f1c8a52-3b7e4a59-9a1d-2f0c5e9b7d41",
            "{6f1c8a523b7e4a599a1d2f0c5e9b7d41",
        ] {
            assert!(!PrincipalType::Uuid.accepts(bad), "{bad}");
        }
        for ok in ["1", "42", "-7", "9223372036854775807"] {
            assert!(PrincipalType::Bigint.accepts(ok), "{ok}");
        }
        for bad in ["", "4.2", "acct_1", "9223372036854775808", "0x10"] {
            assert!(!PrincipalType::Bigint.accepts(bad), "{bad}");
        }
        assert!(PrincipalType::Text.accepts("anything at all"));
    }

    /// Regression (issue 19, 7): a resolver answering the nil UUID or 0 shared the
    /// namespace of keys without a principal (global keys), and so their responses.
    #[test]
    fn no_principal_can_equal_the_value_of_none() {
        let nil = "00000000-0000-0000-0000-000000000000";
        for none in [nil, &nil.replace('-', ""), &format!("{{{nil}}}")] {
            assert!(!PrincipalType::Uuid.accepts(none), "{none}");
        }
        assert_eq!(PrincipalType::Uuid.bound(""), nil);
        for none in ["0", "-0", "+0", "000"] {
            assert!(!PrincipalType::Bigint.accepts(none), "{none}");
        }
        assert_eq!(PrincipalType::Bigint.bound(""), "0");
    }

    /// Invariant 5: the request path keeps to SQL that PostgreSQL-compatible distributed
    /// engines also run: INSERT .. ON CONFLICT, SELECT, UPDATE, DELETE, and lock_timeout
    /// (set through `set_config`, the function form of `SET LOCAL`). A construct outside
    /// this set needs a measured reason.
    #[test]
    fn request_sql_stays_portable() {
        let table = Table::new(
            &TableName::default(),
            Dialect::default(),
            Duration::from_secs(3),
        );
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
            let statement = statement.as_str();
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
            .as_str()
            .contains("ON CONFLICT (scope, principal, key) DO NOTHING"));
    }

    /// Portable mode reads and sets no setting in its statements (a distributed engine
    /// runs them on nodes where a custom setting was never set), sweeps without row
    /// locks, and binds the principal as the column's type.
    #[test]
    fn portable_sql_depends_on_no_setting() {
        for principal_type in [
            PrincipalType::Text,
            PrincipalType::Uuid,
            PrincipalType::Bigint,
        ] {
            let dialect = Dialect {
                pooler: Pooler::Transaction,
                portable: true,
                principal_type,
            };
            let table = Table::new(&TableName::default(), dialect, Duration::from_secs(3));
            for statement in [
                &table.claim,
                &table.read,
                &table.reclaim,
                &table.store,
                &table.expired,
                &table.forget,
                &table.purge,
                &table.sweep_one,
                &table.inspect,
            ] {
                let is_purge = *statement == table.purge;
                let statement = statement.as_str();
                let lower = statement.to_lowercase();
                for setting in ["set_config", "current_setting", "for update", "skip locked"] {
                    assert!(!lower.contains(setting), "{setting:?} in: {statement}");
                }
                assert!(!statement.contains('{'), "unrendered: {statement}");
                assert!(
                    is_purge || statement.contains(principal_type.parameter()),
                    "{statement}"
                );
            }
            let column = format!("principal    {:<11} NOT NULL", principal_type.sql());
            assert!(table.ddl().contains(&column), "{}", table.ddl());
            assert!(table.ddl().contains(
                "create_distributed_table('idempotency_keys', 'principal', colocate_with =>"
            ));
            assert!(table
                .ddl()
                .contains("citus.propagate_set_commands = 'local'"));
        }
        assert_eq!(
            PrincipalType::Uuid.bound(""),
            "00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(PrincipalType::Bigint.bound(""), "0");
        assert_eq!(PrincipalType::Text.bound(""), "");
        assert_eq!(PrincipalType::Bigint.bound("42"), "42");
    }

    #[test]
    fn the_shipped_sql_is_the_default_table() {
        assert_eq!(TableName::parse(DEFAULT_TABLE), Some(TableName::default()));
        assert_eq!(
            Table::new(
                &TableName::default(),
                Dialect::default(),
                Duration::from_secs(3)
            )
            .ddl(),
            SCHEMA_SQL
        );
    }

    #[test]
    fn table_names() {
        let name = TableName::parse("ops.idem_keys").unwrap();
        assert_eq!(name.qualified(), "\"ops\".\"idem_keys\"");
        assert_eq!(name.to_string(), "ops.idem_keys");
        let table = Table::new(&name, Dialect::default(), Duration::from_secs(3));
        assert_eq!(table.primary_key, "idem_keys_pkey");
        assert!(table.ddl().starts_with("-- idem"));
        assert!(table.ddl().contains("CREATE SCHEMA IF NOT EXISTS \"ops\";"));
        assert!(table
            .ddl()
            .contains("CONSTRAINT \"idem_keys_pkey\" PRIMARY KEY"));
        assert!(table
            .claim
            .as_str()
            .contains("INSERT INTO \"ops\".\"idem_keys\""));
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
