//! The store handle: the pool, the table, and the settings every idempotent endpoint
//! of a service shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName};
use http::request::Parts;
use sqlx::PgPool;

/// The SQL that creates idem's table and its expiry index, for services that run their
/// own migrations. [`Idempotency::migrate`] runs exactly this.
pub const SCHEMA_SQL: &str = include_str!("../sql/idempotency_keys.sql");

/// The name of the primary key of the idempotency table. A unique violation of *this*
/// constraint means a concurrent request with the same key won; a violation of any other
/// constraint belongs to the business tables.
pub const PRIMARY_KEY: &str = "idempotency_keys_pkey";

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
    pub(crate) sql: Sql,
}

/// The statements of the request cycle, built once per store.
pub(crate) struct Sql {
    pub(crate) begin: &'static str,
    pub(crate) claim: String,
    pub(crate) read: String,
    pub(crate) reclaim: String,
    pub(crate) store: String,
    pub(crate) forget: String,
    /// The claim's `lock_timeout`, bound as `$7`.
    pub(crate) conflict_wait: String,
}

impl Sql {
    fn new(table: &str, conflict_wait: Duration) -> Self {
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
            conflict_wait: format!("{wait_ms}ms"),
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
    /// ([`SCHEMA_SQL`]). Safe to call from several processes starting at once.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        migrate(&self.inner.pool, SCHEMA_SQL).await
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
}

impl IdempotencyBuilder {
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
                sql: Sql::new("idempotency_keys", self.conflict_wait),
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
        let sql = Sql::new("idempotency_keys", Duration::from_millis(5));
        assert_eq!(sql.begin, "BEGIN ISOLATION LEVEL READ COMMITTED");
        assert_eq!(sql.conflict_wait, "5ms");
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
    fn a_zero_conflict_wait_never_means_wait_forever() {
        // lock_timeout = 0 disables the timeout in PostgreSQL.
        assert_eq!(Sql::new("t", Duration::ZERO).conflict_wait, "1ms");
    }
}
