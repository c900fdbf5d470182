//! The store handle: the pool, the table, and the settings every idempotent endpoint
//! of a service shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName};
use http::request::Parts;
use sqlx::PgPool;

use crate::problem::Problems;

/// The SQL that creates idem's table (under its default name) and its expiry index, for
/// services that run their own migrations. [`Idempotency::migrate`] runs exactly this
/// for a store with the default table; [`Idempotency::schema_sql`] gives it for any.
pub const SCHEMA_SQL: &str = include_str!("../sql/idempotency_keys.sql");

/// The default table name.
pub const DEFAULT_TABLE: &str = "idempotency_keys";

/// How a store finds the principal (account, tenant) a request acts for.
pub type PrincipalResolver = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The idempotency store of a service: a PostgreSQL pool and shared settings.
///
/// Put it in the router's state and make it reachable with
/// [`FromRef`](axum::extract::FromRef); every `#[idempotent]` handler takes it from
/// there. Cloning is cheap.
///
/// ```no_run
/// use axum::extract::FromRef;
/// use idem_runtime::Idempotency;
///
/// #[derive(Clone, FromRef)]
/// struct AppState {
///     idempotency: Idempotency,
/// }
///
/// # async fn f(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// let idempotency = Idempotency::builder(pool)
///     // Keys are looked up per account: one account never sees another's responses.
///     .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
///     .build();
/// idempotency.migrate().await?;
/// let state = AppState { idempotency };
/// # Ok(()) }
/// # #[derive(Clone)] struct Account(String);
/// ```
#[derive(Clone)]
pub struct Idempotency {
    pub(crate) inner: Arc<Settings>,
}

pub(crate) struct Settings {
    pub(crate) pool: PgPool,
    pub(crate) principal: Option<Box<PrincipalResolver>>,
    pub(crate) acquire_timeout: Duration,
    pub(crate) retry_after: u32,
    pub(crate) max_response_bytes: usize,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) problem_base: String,
    pub(crate) table: TableName,
    pub(crate) conflict_wait: Duration,
    pub(crate) sql: Sql,
}

impl Settings {
    pub(crate) fn problems(&self) -> Problems<'_> {
        Problems {
            base: &self.problem_base,
            retry_after: self.retry_after,
        }
    }
}

/// A validated, optionally schema-qualified table name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: Option<String>,
    name: String,
}

impl TableName {
    fn parse(text: &str) -> Result<Self, InvalidTableName> {
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
            return Err(InvalidTableName(text.to_owned()));
        }
        Ok(Self {
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        })
    }

    /// As written in SQL: `"schema"."name"` or `"name"` (the default, unqualified, as in
    /// [`SCHEMA_SQL`], so it lands in the connection's default schema).
    fn qualified(&self) -> String {
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{}\"", self.name),
            None => self.name.clone(),
        }
    }

    /// The primary key's name: a unique violation of *this* constraint means a concurrent
    /// request with the same key won; any other belongs to the business tables.
    pub(crate) fn primary_key(&self) -> String {
        format!("{}_pkey", self.name)
    }

    fn render_schema(&self) -> String {
        let table = self.qualified();
        let pkey = self.primary_key();
        let index = format!("{}_expires_at_idx", self.name);
        let create_schema = match &self.schema {
            Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\";\n\n"),
            None => String::new(),
        };
        format!(
            "-- idem: the idempotency table, for users who run their own migrations.
-- `Idempotency::migrate` runs exactly this; it is safe to run again.
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
    -- the target hash and one hash per named field (see idem_runtime::Fingerprint::parts)
    field_hashes bytea       NOT NULL,
    status       smallint,
    -- allow-listed response headers, one \"name: value\" per line
    headers      bytea,
    body         bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    CONSTRAINT {pkey} PRIMARY KEY (scope, principal, key)
);

-- The sweeper deletes expired rows oldest first, in small batches.
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
"
        )
    }
}

/// A table name `Idempotency` cannot use: it must be `name` or `schema.name`, each part
/// 1 to 48 characters of lowercase ASCII letters, digits and `_`, not starting with a
/// digit (names that need no quoting, and leave room for the index's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTableName(String);

impl fmt::Display for InvalidTableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid idempotency table name {:?}: use `name` or `schema.name`, lowercase letters, digits and `_`",
            self.0
        )
    }
}

impl std::error::Error for InvalidTableName {}

/// The statements of the request cycle, built once per store.
pub(crate) struct Sql {
    pub(crate) begin: &'static str,
    pub(crate) claim: String,
    pub(crate) read: String,
    pub(crate) reclaim: String,
    pub(crate) store: String,
    pub(crate) forget: String,
    pub(crate) purge: String,
    pub(crate) inspect: String,
    /// The name of the table's primary key, for telling its violations from others.
    pub(crate) primary_key: String,
    /// The claim's `lock_timeout`, bound as `$7`.
    pub(crate) conflict_wait: String,
}

impl Sql {
    fn new(table: &str, primary_key: String, conflict_wait: Duration) -> Self {
        // lock_timeout = 0 would mean "wait forever": the shortest wait is 1 ms.
        let wait_ms = conflict_wait.as_millis().clamp(1, i32::MAX as u128);
        let key = "scope = $1 AND principal = $2 AND key = $3";
        let expires = "now() + $6::float8 * interval '1 second'";
        // The claim waits on a concurrent request's uncommitted row for at most
        // `conflict_wait` (then 55P03, answered 409); the handler's own statements must
        // not inherit that timeout. `SET LOCAL` before and after the claim would cost two
        // statements on every request, so the claim sets it in the row it inserts
        // (computed before the insert can wait) and restores it in the row it returns
        // (computed after the insert finished), with `set_config(.., true)`, the function
        // form of `SET LOCAL`. The session's own value is kept in `idem.lock_timeout`,
        // saved once per transaction. Every path that reaches the handler passes through
        // a statement that returned a row, so the timeout is always restored by then.
        let wait = "set_config('idem.lock_timeout', \
                        coalesce(nullif(current_setting('idem.lock_timeout', true), ''), \
                                 current_setting('lock_timeout')), true), \
                    set_config('lock_timeout', $7, true)";
        let restore = "set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";
        Self {
            // Explicit READ COMMITTED: a database whose default is REPEATABLE READ would
            // otherwise fail the read after a blocked claim with 40001.
            begin: "BEGIN ISOLATION LEVEL READ COMMITTED",
            // One statement: insert the claim, or return the stored row. ON CONFLICT DO
            // NOTHING takes no lock on a live row, so concurrent replays do not serialize.
            // When the conflicting row was committed after this statement's snapshot began
            // (we waited for it), neither branch returns a row and `read` follows.
            claim: format!(
                "WITH claimed AS ( \
                     INSERT INTO {table} (scope, principal, key, fingerprint, field_hashes, expires_at) \
                     SELECT $1, $2, $3, $4, $5, {expires} FROM (SELECT {wait}) AS wait \
                     ON CONFLICT (scope, principal, key) DO NOTHING \
                     RETURNING 1 \
                 ) \
                 SELECT true AS fresh, NULL::bytea AS fingerprint, NULL::bytea AS field_hashes, \
                        NULL::smallint AS status, NULL::bytea AS headers, NULL::bytea AS body, \
                        false AS expired, {restore} AS restored \
                   FROM claimed \
                 UNION ALL \
                 SELECT false, fingerprint, field_hashes, status, headers, body, expires_at <= now(), {restore} \
                   FROM {table} \
                  WHERE {key} AND NOT EXISTS (SELECT 1 FROM claimed)"
            ),
            read: format!(
                "SELECT false AS fresh, fingerprint, field_hashes, status, headers, body, \
                        expires_at <= now() AS expired, {restore} AS restored \
                   FROM {table} WHERE {key}"
            ),
            // An expired row is taken over in place. A committed row with no status can
            // only be left by a handler that ended the transaction itself; it is taken
            // over too, so that key is never stuck. It waits like the claim does.
            reclaim: format!(
                "UPDATE {table} \
                    SET fingerprint = $4, field_hashes = $5, status = NULL, headers = NULL, \
                        body = NULL, created_at = now(), expires_at = {expires} \
                   FROM (SELECT {wait}) AS wait \
                  WHERE {key} AND (expires_at <= now() OR status IS NULL) \
                 RETURNING {restore}"
            ),
            // `created_at = now()` holds only inside the transaction that claimed the row
            // (now() is the transaction's start time): if the handler ran a raw COMMIT or
            // ROLLBACK, this matches nothing and the escape is caught instead of stored.
            store: format!(
                "UPDATE {table} SET status = $4, headers = $5, body = $6 \
                  WHERE {key} AND status IS NULL AND created_at = now()"
            ),
            forget: format!("DELETE FROM {table} WHERE {key} AND status IS NULL"),
            // Expired rows, oldest first, skipping rows a request is reclaiming. The outer
            // `expires_at` test is not redundant: it is re-checked on a row that changed
            // while we waited, which the subquery's is not.
            purge: format!(
                "DELETE FROM {table} \
                  WHERE (scope, principal, key) IN ( \
                        SELECT scope, principal, key FROM {table} \
                         WHERE expires_at <= now() \
                         ORDER BY expires_at \
                         LIMIT $1 \
                           FOR UPDATE SKIP LOCKED) \
                    AND expires_at <= now()"
            ),
            inspect: format!(
                "SELECT extract(epoch FROM created_at)::float8 AS created_at, \
                        extract(epoch FROM expires_at)::float8 AS expires_at, \
                        expires_at <= now() AS expired, status, \
                        coalesce(octet_length(body), 0) AS body_bytes \
                   FROM {table} WHERE {key} AND status IS NOT NULL"
            ),
            conflict_wait: format!("{wait_ms}ms"),
            primary_key,
        }
    }
}

impl Idempotency {
    /// A store on `pool` with the default settings.
    pub fn new(pool: PgPool) -> Self {
        Self::builder(pool).build()
    }

    /// Starts configuring a store on `pool`.
    pub fn builder(pool: PgPool) -> IdempotencyBuilder {
        IdempotencyBuilder {
            pool,
            principal: None,
            acquire_timeout: Duration::from_secs(3),
            conflict_wait: Duration::from_millis(1),
            retry_after: 1,
            max_response_bytes: 1 << 20,
            problem_base: crate::problem::DEFAULT_PROBLEM_BASE.to_owned(),
            table: TableName {
                schema: None,
                name: DEFAULT_TABLE.to_owned(),
            },
            replay_headers: vec![
                header::CONTENT_TYPE,
                header::CONTENT_LANGUAGE,
                header::CONTENT_LOCATION,
                header::LOCATION,
                header::ETAG,
                header::LAST_MODIFIED,
                header::LINK,
            ],
        }
    }

    /// The pool this store runs on.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Creates the idempotency table and its index if they do not exist
    /// ([`Idempotency::schema_sql`]). Safe to call from several processes starting at once.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        migrate(&self.inner.pool, &self.schema_sql()).await
    }

    /// The DDL of this store's table: [`SCHEMA_SQL`] with its configured name.
    pub fn schema_sql(&self) -> String {
        self.inner.table.render_schema()
    }

    /// The principal of a request by the store's resolver; `None` when no resolver is
    /// configured or it found none, which makes keys global to the scope.
    pub(crate) fn principal_of(&self, parts: &Parts) -> Option<String> {
        self.inner
            .principal
            .as_ref()
            .and_then(|resolve| resolve(parts))
    }
}

impl fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("principal_resolver", &self.inner.principal.is_some())
            .field("acquire_timeout", &self.inner.acquire_timeout)
            .field("max_response_bytes", &self.inner.max_response_bytes)
            .finish_non_exhaustive()
    }
}

/// Runs `CREATE ... IF NOT EXISTS` statements so that processes starting together all
/// succeed. Two concurrent `CREATE TABLE IF NOT EXISTS` can both pass the existence
/// check; the loser fails on a catalog unique index (23505) or with 42P07/42710. The
/// winner has committed by then, so running the statements again finds them existing.
pub(crate) async fn migrate(pool: &PgPool, sql: &str) -> Result<(), sqlx::Error> {
    let mut attempt = 0;
    loop {
        match sqlx::raw_sql(sql).execute(pool).await {
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

/// Configures an [`Idempotency`] store; see [`Idempotency::builder`].
#[must_use]
pub struct IdempotencyBuilder {
    pool: PgPool,
    principal: Option<Box<PrincipalResolver>>,
    acquire_timeout: Duration,
    conflict_wait: Duration,
    retry_after: u32,
    max_response_bytes: usize,
    replay_headers: Vec<HeaderName>,
    problem_base: String,
    table: TableName,
}

impl IdempotencyBuilder {
    /// The table idem keeps its records in: `name` or `schema.name` (default
    /// `idempotency_keys` in the connection's default schema). [`Idempotency::migrate`]
    /// creates the schema too.
    pub fn table(mut self, name: &str) -> Result<Self, InvalidTableName> {
        self.table = TableName::parse(name)?;
        Ok(self)
    }

    /// The base of the `type` URI of idem's own problems (default `urn:idem:problem:`):
    /// with `https://example.com/problems/`, a 409 has the type
    /// `https://example.com/problems/key-in-use`. See [`crate::problem::types`].
    pub fn problem_base(mut self, base: impl Into<String>) -> Self {
        self.problem_base = base.into();
        self
    }

    /// Replaces the response headers stored and replayed (see
    /// [`IdempotencyBuilder::replay_header`] for the default list).
    pub fn replay_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.replay_headers = Vec::new();
        for name in names {
            self = self.replay_header(name);
        }
        self
    }

    /// How to find the principal (account, tenant) of a request, for example from the
    /// authenticated account an auth middleware put in the request's extensions. Keys
    /// are then looked up per (scope, principal, key): one principal never sees
    /// another's stored response.
    ///
    /// Without a resolver, or when it answers `None`, keys are global to their scope:
    /// two tenants that pick the same key share one stored response. Multi-tenant
    /// services must configure a resolver (or `principal = ...` on each handler), and
    /// must run authentication before idem sees the request.
    pub fn principal<F>(mut self, resolve: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.principal = Some(Box::new(resolve));
        self
    }

    /// How long a request waits for a database connection before it is answered 503
    /// (default 3 s). The request never runs without its claim.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long a duplicate waits for the request in flight with its key to finish
    /// before it is answered 409 (default 1 ms, the shortest PostgreSQL's `lock_timeout`
    /// allows). A longer wait turns more concurrent duplicates into replays, at the cost
    /// of holding a connection while waiting.
    pub fn conflict_wait(mut self, wait: Duration) -> Self {
        self.conflict_wait = wait;
        self
    }

    /// The `Retry-After` seconds of 409 and 503 answers (default 1).
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = seconds;
        self
    }

    /// The largest response body stored for replay (default 1 MiB). A larger response
    /// rolls the request back and answers 500, saying why.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Adds a response header to those stored and replayed. By default: content-type,
    /// content-language, content-location, location, etag, last-modified and link.
    /// Headers that describe one connection or one client (`set-cookie`, `date`,
    /// `content-length`, `transfer-encoding` ...) should not be replayed.
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        if !self.replay_headers.contains(&name) {
            self.replay_headers.push(name);
        }
        self
    }

    /// Finishes the store.
    pub fn build(self) -> Idempotency {
        Idempotency {
            inner: Arc::new(Settings {
                pool: self.pool,
                principal: self.principal,
                acquire_timeout: self.acquire_timeout,
                retry_after: self.retry_after,
                max_response_bytes: self.max_response_bytes,
                replay_headers: self.replay_headers,
                problem_base: self.problem_base,
                conflict_wait: self.conflict_wait,
                sql: Sql::new(
                    &self.table.qualified(),
                    self.table.primary_key(),
                    self.conflict_wait,
                ),
                table: self.table,
            }),
        }
    }
}

/// Whether a database error means "the database cannot be reached right now" (I/O, TLS,
/// pool timeout or closed, SQLSTATE class 08, 57P01–57P03), as opposed to a fault in
/// the request or the code. idem answers these 503 with `Retry-After`; handlers that
/// map `sqlx::Error` to responses can use this to do the same.
pub fn is_unavailable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(e) => e.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
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
        let sql = Sql::new(
            "idempotency_keys",
            "idempotency_keys_pkey".into(),
            Duration::from_millis(5),
        );
        assert_eq!(sql.begin, "BEGIN ISOLATION LEVEL READ COMMITTED");
        assert_eq!(sql.conflict_wait, "5ms");
        // The request path; purge and inspect run outside it.
        for statement in [&sql.claim, &sql.read, &sql.reclaim, &sql.store, &sql.forget] {
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
                settings
                    .iter()
                    .all(|s| s.starts_with("lock_timeout'") || s.starts_with("idem.lock_timeout'")),
                "only lock_timeout is ever set: {statement}"
            );
        }
        assert!(sql
            .claim
            .contains("ON CONFLICT (scope, principal, key) DO NOTHING"));
    }

    #[test]
    fn the_shipped_sql_is_the_default_table() {
        assert_eq!(
            TableName::parse(DEFAULT_TABLE).unwrap().render_schema(),
            SCHEMA_SQL
        );
    }

    #[test]
    fn table_names() {
        let t = TableName::parse("ops.idem_keys").unwrap();
        assert_eq!(t.qualified(), "\"ops\".\"idem_keys\"");
        assert_eq!(t.primary_key(), "idem_keys_pkey");
        assert!(t.render_schema().starts_with("-- idem"));
        assert!(t
            .render_schema()
            .contains("CREATE SCHEMA IF NOT EXISTS \"ops\";"));
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
            assert!(TableName::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_zero_conflict_wait_never_means_wait_forever() {
        // lock_timeout = 0 disables the timeout in PostgreSQL.
        assert_eq!(
            Sql::new("t", "t_pkey".into(), Duration::ZERO).conflict_wait,
            "1ms"
        );
    }
}
