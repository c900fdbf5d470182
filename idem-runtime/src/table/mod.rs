//! idem's tables: the idempotency table here (its name, its DDL, the connections its
//! statements run on), its claim and commit in [`claim`], its sweep in [`sweep`]; the
//! outbox's in [`outbox`], the steps' in [`steps`] and the operators' audit trail in
//! [`audit`]. Every statement is written whole beside the function that binds its
//! parameters and decodes its rows; only the table's name is filled in, once per store.
//! The store stands on this module, and the outbox and steps modules on the store.
//!
//! # How a key is held
//!
//! In the default mode (and behind a transaction pooler) a key is held by a
//! transaction-scoped advisory lock keyed by a hash of the table and the key
//! ([`Table::lock_id`]), tried by the claim's first statement ([`TRY`]) before its second
//! reads the key's committed row ([`TAKE`]). The key's row is written once, complete,
//! just before COMMIT ([`INSERT`]): one row version and one WAL record per request, a
//! 409 as soon as the lock is found taken, and a replay that writes nothing. The primary
//! key still decides what commits (invariant 3); the lock only keeps a duplicate from
//! running while the first is in flight. Two keys whose hashes collide (one pair in 2^64)
//! share a lock: the second waits for the first or is answered 409, and each stores its
//! own record. A lock can never make a second effect commit, because the key's row is
//! inserted, not assumed.
//!
//! In portable mode the uncommitted row is the lock, as a distributed engine has no
//! cluster-wide advisory lock: the claim inserts the row ([`CLAIM_PORTABLE`]) and the
//! response is stored by updating it ([`STORE`]).
//!
//! # The claim's lock timeout
//!
//! A duplicate that waits (`concurrency = wait(..)`) waits for at most the endpoint's
//! conflict wait; then PostgreSQL raises 55P03, which the engine answers as "in use"
//! (409). The handler's own statements must not inherit that timeout: [`WAIT`] sets it
//! and gives it back in one statement, with `set_config(.., true)`, the function form of
//! `SET LOCAL`. A duplicate that does not wait is answered after [`TRY`], which tries the
//! lock without waiting. Portable mode sets and resets the wait with `SET LOCAL`
//! ([`Table::begin_waiting`], [`Table::restore_wait`]).
//!
//! `lock_timeout = 0` means "wait forever" to PostgreSQL, so the shortest wait bound is
//! 1 ms ([`lock_timeout`]).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row, SqlSafeStr, SqlStr, Transaction};

use crate::fingerprint::Fingerprint;
use crate::identity::{stored_scope, KeyInScope, Place};
use crate::literal::{self, Literal};
use crate::sqlstate;
use crate::transaction::Prepared;

pub(crate) mod audit;
mod claim;
#[cfg(test)]
pub(crate) mod cost;
pub(crate) mod outbox;
pub(crate) mod requests;
pub(crate) mod steps;
mod sweep;
#[cfg(test)]
mod tests;

pub(crate) use claim::*;
pub(crate) use sweep::*;

/// The default table name.
pub(crate) const DEFAULT_TABLE: &str = "idempotency_keys";

/// The default name of the steps table (`Tx::step`), in the schema of the store's
/// idempotency table.
pub(crate) const DEFAULT_STEPS_TABLE: &str = "idempotency_steps";

/// The SQL that creates idem's table (under its default name) and its expiry index, for
/// services that run their own migrations. [`Store::migrate`](crate::Store::migrate)
/// runs exactly this for a store with the default table;
/// [`Store::schema`](crate::Store::schema_sql) gives it for any.
pub(crate) const SCHEMA_SQL: &str = include_str!("../../sql/idempotency_keys.sql");

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

/// A committed record, for operators. $1..$3 the key.
const INSPECT: &str = "\
SELECT extract(epoch FROM created_at)::float8 AS created_at,
       extract(epoch FROM expires_at)::float8 AS expires_at,
       expires_at <= now() AS expired, status,
       coalesce(octet_length(body), 0) AS body_bytes
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NOT NULL";

/// The statement Citus needs after [`DDL`], as a comment, for a portable store: the
/// table is distributed by `principal` and colocated with the user's tenant table.
/// [`Store::distribute`](crate::Store::distribute) runs it.
const DISTRIBUTION: &str = "
-- Distributed PostgreSQL (Citus): `Store::distribute` runs this at startup. Distribute by
-- principal, colocated with the table that holds your tenants (its distribution column
-- must also be {principal_type}):
--
--   SELECT create_distributed_table('{name_literal}', 'principal', colocate_with => 'accounts');
";

/// A validated, optionally schema-qualified table name: `name` or `schema.name`, each
/// part 1 to 48 characters of lowercase ASCII letters, digits and `_`, not starting with
/// a digit (names that need no quoting, and leave room for the index's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: Option<String>,
    name: String,
    /// As given: `name` or `schema.name`.
    text: String,
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
            text: text.to_owned(),
        })
    }

    /// The name as given: `name` or `schema.name`.
    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }

    /// The table's own name, without its schema.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Its schema, when qualified.
    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The statement that creates its schema, if it names one, for the head of a DDL
    /// script (`{create_schema}`); empty otherwise.
    pub(crate) fn create_schema(&self) -> String {
        match &self.schema {
            Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\";\n\n"),
            None => String::new(),
        }
    }

    /// `name` in the same schema as this table.
    pub(crate) fn sibling(&self, name: &str) -> Self {
        let text = match &self.schema {
            Some(schema) => format!("{schema}.{name}"),
            None => name.to_owned(),
        };
        Self {
            schema: self.schema.clone(),
            name: name.to_owned(),
            text,
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
            text: DEFAULT_TABLE.to_owned(),
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

/// What sits between the service and PostgreSQL ([`StoreBuilder::pooler`](crate::StoreBuilder::pooler)).
///
/// [`StoreBuilder::pooler`](crate::StoreBuilder::pooler): crate::StoreBuilder::pooler
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

/// The SQL type of the `principal` column ([`StoreBuilder::principal_type`](crate::StoreBuilder::principal_type)). A
/// distributed engine colocates tables whose distribution columns have equal types, so
/// it is the type of the tenant column of your own tables.
///
/// [`StoreBuilder::principal_type`](crate::StoreBuilder::principal_type): crate::StoreBuilder::principal_type
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrincipalType {
    /// `text` (the default): any principal.
    #[default]
    Text,
    /// `uuid`: the resolver answers a UUID in its text form; the nil UUID is the nobody
    /// value, which keys without a principal are kept under outside the
    /// [portable mode](crate::StoreBuilder::portable).
    Uuid,
    /// `bigint`: the resolver answers a decimal integer; 0 is the nobody value.
    Bigint,
}

impl PrincipalType {
    /// `principal` in the one spelling every hash of it uses (the key's lock, derived
    /// keys, the spread), `None` when it cannot key requests. PostgreSQL stores a `uuid`
    /// or a `bigint` in one form whatever text it was cast from, but idem hashes the text:
    /// two spellings of one principal would take two locks and derive two keys for a
    /// downstream service (ARCHITECTURE.md, invariant 8). So: any text as it is; a UUID of 32
    /// hex digits, plain or in the 8-4-4-4-12 groups, either optionally in braces, as
    /// lowercase 8-4-4-4-12; a decimal `bigint` (sign, leading zeros) as PostgreSQL
    /// prints it. Never the value that keeps keys without a principal (the nil UUID, 0;
    /// see [`Self::bound`]), which would share their namespace. The empty text is "no
    /// principal" itself, decided before this.
    pub(crate) fn canonical(self, principal: &str) -> Option<String> {
        match self {
            Self::Text => Some(principal.to_owned()),
            Self::Bigint => principal
                .parse::<i64>()
                .ok()
                .filter(|n| *n != 0)
                .map(|n| n.to_string()),
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
                if !valid || bare.bytes().all(|b| b == b'0' || b == b'-') {
                    return None;
                }
                let digits: String = bare
                    .chars()
                    .filter(|c| *c != '-')
                    .map(|c| c.to_ascii_lowercase())
                    .collect();
                Some(format!(
                    "{}-{}-{}-{}-{}",
                    &digits[..8],
                    &digits[8..12],
                    &digits[12..16],
                    &digits[16..20],
                    &digits[20..]
                ))
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
    pub(crate) fn parameter(self) -> &'static str {
        match self {
            Self::Text => "$2",
            Self::Uuid => "CAST($2 AS uuid)",
            Self::Bigint => "CAST($2 AS bigint)",
        }
    }

    /// The text bound for `principal`: "no principal" (`""`) as the type's zero value.
    /// Any other value is bound as given; one that is not of the type fails its cast
    /// (SQLSTATE 22P02), a resolver's fault.
    pub(crate) fn bound(self, principal: &str) -> &str {
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
    /// The table as written in SQL: part of every key's lock ([`Self::lock_id`]).
    qualified: String,
    try_lock: SqlStr,
    take: SqlStr,
    /// The default mode's claim and key row, prepared once per connection and executed
    /// by name ([`crate::transaction::Prepared`]); `None` behind a transaction pooler,
    /// whose server connections change under the client, and in the portable mode, whose
    /// claim is a bound statement.
    prepared: Option<Prepared>,
    /// Where a table of the store is named without its schema: the `search_path` of the
    /// store's first claim, which every later claim must find and every key row's
    /// COMMIT message sets again ([`Table::pinned_path`]). `None` where every table is
    /// named whole.
    path: Option<std::sync::OnceLock<String>>,
    wait: SqlStr,
    insert: SqlStr,
    overwrite: SqlStr,
    claim: SqlStr,
    claim_text: SqlStr,
    read: SqlStr,
    reclaim: SqlStr,
    store: SqlStr,
    expired: SqlStr,
    forget: SqlStr,
    /// [`PURGE`], or in portable mode [`EXPIRED_BATCH_PORTABLE`].
    purge: SqlStr,
    sweep_one: SqlStr,
    inspect: SqlStr,
    earlier_live: SqlStr,
    spread_live: SqlStr,
    hold_abandoning: SqlStr,
    abandoned: SqlStr,
}

/// One of idem's statements (this module's, the outbox's, the steps', the operators'
/// queries) with the table's name filled in. sqlx takes dynamic SQL only through
/// [`AssertSqlSafe`], and this is the one place idem asserts it: the text is a constant
/// of one of those modules, the name a [`TableName`] (lowercase ASCII letters, digits and
/// `_`, quoted) and the principal's cast a constant; values go as binds, or are written
/// in by [`crate::literal`], whose encoding no input can change.
pub(crate) fn statement(sql: String) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(sql)).into_sql_str()
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
        let qualified = table.clone();
        let render = |sql: &str| {
            statement(
                sql.replace("{table}", &table)
                    .replace("{p2}", dialect.principal_type.parameter())
                    .replace("{escaped}", ESCAPED)
                    .replace("{reached}", REACHED)
                    .replace("{reaches}", REACHES),
            )
        };
        let create_schema = name.create_schema();
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
        let mut table = Self {
            prepared: None,
            path: None,
            dialect,
            acquire_timeout,
            ddl,
            qualified,
            primary_key: format!("{}_pkey", name.name),
            try_lock: render(TRY),
            take: render(TAKE),
            wait: render(WAIT),
            insert: render(INSERT),
            overwrite: render(OVERWRITE),
            claim: render(CLAIM_PORTABLE),
            claim_text: render(CLAIM_PORTABLE_TEXT),
            read: render(READ_PORTABLE),
            reclaim: render(RECLAIM_PORTABLE),
            store: render(STORE),
            expired: render(EXPIRED),
            forget: render(FORGET),
            purge: pick(PURGE, EXPIRED_BATCH_PORTABLE),
            sweep_one: render(SWEEP_ONE_PORTABLE),
            inspect: render(INSPECT),
            earlier_live: render(EARLIER_LIVE),
            spread_live: render(SPREAD_LIVE),
            hold_abandoning: render(HOLD_ABANDONING),
            abandoned: render(ABANDONED),
        };
        table.prepared = table.preparing(&[]);
        table
    }

    /// The table, pinning the `search_path` its store's first claim finds, where the
    /// store names tables without their schema (`unqualified`, each quoted as the
    /// statements write it: [`Table::pinned_path`]); its prepared statements name them
    /// with the schema each connection finds them in ([`Prepared::qualifying`]).
    pub(crate) fn pin_path(mut self, unqualified: Vec<String>) -> Self {
        self.path = (!unqualified.is_empty()).then(std::sync::OnceLock::new);
        self.prepared = self
            .prepared
            .take()
            .map(|prepared| prepared.qualifying(unqualified));
        self
    }

    /// The table, its prepared statements joined by `more` (role, parameter types, text):
    /// statements of the store's other tables that ride the same messages, prepared on a
    /// connection when the claim's are, so that a message that rides a claim executed by
    /// name finds them too; each only where its table exists.
    pub(crate) fn prepare_also(mut self, more: &[(&str, &str, &str)]) -> Self {
        self.prepared = self.preparing(more);
        self
    }

    /// The set of statements executed by name: in the default mode only.
    fn preparing(&self, more: &[(&str, &str, &str)]) -> Option<Prepared> {
        if self.dialect.pooler != Pooler::Session || self.dialect.portable {
            return None;
        }
        let overwrite = checked_overwrite(self.overwrite.as_str());
        let mut set = vec![
            (TRY_ROLE, TRY_TYPES, self.try_lock.as_str()),
            (TAKE_ROLE, TAKE_TYPES, self.take.as_str()),
            (INSERT_ROLE, INSERT_TYPES, self.insert.as_str()),
            (OVERWRITE_ROLE, INSERT_TYPES, overwrite.as_str()),
        ];
        let own = set.len();
        set.extend_from_slice(more);
        // The other tables' statements are prepared where their tables exist.
        Some(Prepared::new(&set, own))
    }

    /// The statements this store's messages execute by name, if any.
    pub(crate) fn prepared(&self) -> Option<&Prepared> {
        self.prepared.as_ref()
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

    /// A connection of `pool` for one statement outside a request's transaction: in a
    /// transaction of its own behind a transaction pooler, so that the statement's parse
    /// and execute steps reach the same server connection.
    ///
    /// Waiting for the connection is bounded by the store's `acquire_timeout`, as a
    /// request's own transaction is: under pool exhaustion the 409 path (which asks
    /// whether a row is expired) and the operators' calls fail fast with
    /// [`sqlx::Error::PoolTimedOut`] instead of waiting for the pool's own bound.
    pub(crate) async fn single(&self, pool: &PgPool) -> Result<Single, sqlx::Error> {
        self.bounded(Single::open(self.dialect.pooler, pool)).await
    }

    /// A transaction of `pool` for an operator's action and its audit row
    /// ([`crate::operate::Operate::audited`]): opened at READ COMMITTED whatever the database's
    /// default (invariant 4), its connection waited for no longer than the store's
    /// `acquire_timeout`.
    pub(crate) async fn acting(
        &self,
        pool: &PgPool,
    ) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        self.bounded(pool.begin_with(Isolation::ReadCommitted.begin()))
            .await
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
/// them existing. The outbox's `ALTER TABLE .. SET (fillfactor)` after its `CREATE INDEX`
/// raises its lock in the same transaction, so two such scripts may deadlock (40P01):
/// PostgreSQL aborts one, which runs again once the other has committed.
pub(crate) async fn create(pool: &PgPool, ddl: &SqlStr) -> Result<(), sqlx::Error> {
    let mut attempt = 0;
    loop {
        match sqlx::raw_sql(ddl.clone()).execute(pool).await {
            Ok(_) => return Ok(()),
            Err(sqlx::Error::Database(e))
                if attempt < 5
                    && matches!(
                        e.code().as_deref(),
                        Some(
                            sqlstate::UNIQUE_VIOLATION
                                | sqlstate::DUPLICATE_TABLE
                                | sqlstate::DUPLICATE_OBJECT
                                | sqlstate::DEADLOCK_DETECTED
                        )
                    ) =>
            {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The connection of one statement sent outside a request's transaction.
pub(crate) enum Single {
    Direct(PoolConnection<Postgres>),
    Pinned(Transaction<'static, Postgres>),
}

impl Single {
    /// A connection of `pool` for one statement outside a request's transaction, behind
    /// `pooler`: in a transaction of its own behind a transaction pooler. sqlx sends a
    /// statement with arguments in two exchanges (parse, then bind and execute, each
    /// ending in a `Sync`); between them, outside a transaction, a transaction pooler
    /// may hand the client another server connection, or hand this one to another
    /// client who parses its own unnamed statement over this one (invariant 12).
    pub(crate) async fn open(pooler: Pooler, pool: &PgPool) -> Result<Self, sqlx::Error> {
        Ok(match pooler {
            Pooler::Session => Self::Direct(pool.acquire().await?),
            Pooler::Transaction => Self::Pinned(pool.begin().await?),
        })
    }

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

/// A bytea column written as hex by the statement (`encode(.., 'hex')`): its bytes.
pub(crate) fn unhex(hex: Option<String>) -> Result<Option<Vec<u8>>, sqlx::Error> {
    hex.map(|hex| {
        crate::fingerprint::unhex(&hex)
            .ok_or_else(|| sqlx::Error::Decode(format!("not hex: {hex:.16}").into()))
    })
    .transpose()
}
