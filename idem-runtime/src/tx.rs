//! [`Tx`]: the handler's view of the request's transaction.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use futures_core::future::BoxFuture;
use futures_core::stream::BoxStream;
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Either, Error, Execute, Executor, PgConnection, Postgres, SqlStr};
use sqlx_core::describe::Describe;

use crate::fingerprint::{hex, Fingerprint};
use crate::identity::KeyInScope;
use crate::store::Store;
use crate::table::outbox::OutboxTable;
use crate::table::requests::StoredRequest;

/// The request's transaction, lent to an `#[idempotent]` handler.
///
/// A handler receives it only through `#[idempotent]`: the attribute opens the
/// transaction, claims the key and lends the `Tx` to the handler. Without the attribute,
/// axum has nothing to extract it from.
///
/// `&mut tx` is an sqlx [`Executor`](sqlx::Executor), and so is `&mut *tx`, the
/// transaction's [`PgConnection`] that `Tx` derefs to, as `&mut *transaction` is for
/// sqlx's own `Transaction`. A function taking `&mut PgConnection` takes `&mut tx` too,
/// by deref coercion:
///
/// ```
/// use sqlx::{PgConnection, PgExecutor};
///
/// async fn insert(db: impl PgExecutor<'_>, amount: i64) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO charges (amount) VALUES ($1)").bind(amount).execute(db).await?;
///     Ok(())
/// }
///
/// async fn count(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
///     sqlx::query_scalar("SELECT count(*) FROM charges").fetch_one(conn).await
/// }
///
/// # async fn f(mut tx: idem::Tx<'_>, amount: i64) -> Result<(), sqlx::Error> {
/// sqlx::query("INSERT INTO charges (amount) VALUES ($1)").bind(amount).execute(&mut tx).await?;
/// sqlx::query("INSERT INTO charges (amount) VALUES ($1)").bind(amount).execute(&mut *tx).await?;
/// insert(&mut tx, amount).await?;
/// let _n = count(&mut tx).await?;
/// # Ok(()) }
/// ```
///
/// A function that takes `&mut Transaction<'_, Postgres>` cannot be given a `Tx`: a
/// `Transaction` can commit, and idem owns the commit. Change its parameter to
/// `&mut PgConnection` (or `impl PgExecutor<'_>`): its body keeps working, since it used
/// the transaction through `&mut **tx` or `&mut *tx`, and its other callers pass
/// `&mut *transaction`.
///
/// idem owns the transaction: the claim of the key, the handler's writes and the stored
/// response commit together, or not at all. `Tx` is therefore only a borrow. It has no
/// `commit` or `rollback`, and its lifetime keeps it out of `tokio::spawn`, so writes
/// cannot escape the transaction. What the type system cannot stop is refused or caught:
///
/// - A `COMMIT` idem did not send fails, and rolls everything back (its error says
///   "idem refused this COMMIT"): a raw `COMMIT` statement, and sqlx's nested unit of
///   work, `conn.begin()` … `commit()` on the request's connection (a helper taking
///   `&mut PgConnection` given `&mut tx`). In every mode; a request without a key in
///   the portable mode has no guard, and such a `COMMIT` is caught after the handler. sqlx does not see idem's `BEGIN`, so that
///   `begin()` is no `SAVEPOINT`: write the helper without `begin()` and `commit()`, its
///   statements on the connection it is given; the request's transaction is their unit
///   of work, and the handler's `Err` rolls them back. Where part of the work must be
///   undone alone, send `SAVEPOINT name` and `ROLLBACK TO SAVEPOINT name` yourself.
/// - A `ROLLBACK` idem did not send (a raw one, or that nested unit's `rollback()`)
///   ends the request's transaction: the request answers 500 and nothing is stored. A
///   handler that goes on writing after it writes outside any transaction.
///
/// ```
/// # use sqlx::{Connection, PgConnection};
/// // Refused inside an idempotent handler: `commit()` answers an error, nothing commits.
/// async fn nested(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
///     let mut unit = conn.begin().await?;
///     sqlx::query("INSERT INTO charges (amount) VALUES (1)").execute(&mut *unit).await?;
///     unit.commit().await
/// }
///
/// // What to write instead: the request's transaction is the unit of work.
/// async fn flat(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO charges (amount) VALUES (1)").execute(&mut *conn).await?;
///     Ok(())
/// }
/// ```
pub struct Tx<'t> {
    conn: &'t mut PgConnection,
    store: &'t Store,
    key: Option<&'t KeyInScope>,
    request: Option<Request<'t>>,
    state: &'t mut AttemptState,
    /// How many events this attempt has written ([`Tx::emit`]): the next one's place.
    emitted: u32,
}

/// What an attempt with a key claimed, besides the key: what its steps record.
#[derive(Clone, Copy)]
pub(crate) struct Request<'t> {
    pub(crate) fingerprint: &'t Fingerprint,
    pub(crate) ttl: Duration,
    /// The transaction's start (`extract(epoch FROM now())`, exact to the microsecond),
    /// as the claim read it: the events' ids, which ride COMMIT.
    pub(crate) began: Option<f64>,
}

/// What an attempt's work leaves for its commit, kept by the attempt across the `Tx`s it
/// lends.
#[derive(Debug, Default)]
pub(crate) struct AttemptState {
    /// Statements that ride the COMMIT message, before COMMIT and after the key's row:
    /// run only when the key's row was written, and in the same round trip.
    pub(crate) rides_commit: Vec<String>,
    /// Events ride the COMMIT message: it may wake the relays too
    /// ([`crate::table::outbox::OutboxTable::wake`]).
    pub(crate) wakes_relays: bool,
    /// The transaction's id (`txid_current()`), once asked: what a write outside the
    /// transaction checks is still in progress (invariant 11).
    pub(crate) txid: Option<i64>,
    /// The request as it arrived, for a completable endpoint: stored with its first
    /// step record ([`crate::complete`]).
    pub(crate) capture: Option<std::sync::Arc<StoredRequest>>,
    /// Whether this attempt has stored it.
    pub(crate) request_stored: bool,
    /// Whether the request is completable: its stored copy goes with its steps at
    /// COMMIT (a completion's too, which stores nothing itself).
    pub(crate) completable: bool,
}

impl AttemptState {
    /// Adds `sql` to the statements that ride the COMMIT message, once.
    pub(crate) fn ride(&mut self, sql: String) {
        if !self.rides_commit.contains(&sql) {
            self.rides_commit.push(sql);
        }
    }
}

impl<'t> Tx<'t> {
    pub(crate) fn new(
        conn: &'t mut PgConnection,
        store: &'t Store,
        key: Option<&'t KeyInScope>,
        request: Option<Request<'t>>,
        state: &'t mut AttemptState,
    ) -> Self {
        Self {
            conn,
            store,
            key,
            request,
            state,
            emitted: 0,
        }
    }

    /// The key this attempt claimed.
    pub(crate) fn key_in_scope(&self) -> Option<&'t KeyInScope> {
        self.key
    }

    /// The store's outbox table.
    pub(crate) fn outbox(&self) -> &'t OutboxTable {
        &self.store.inner.outbox
    }

    /// The store the attempt runs on.
    pub(crate) fn store(&self) -> &'t Store {
        self.store
    }

    /// What the attempt claimed besides its key; `None` without a key.
    pub(crate) fn request(&self) -> Option<Request<'t>> {
        self.request
    }

    /// The transaction's connection and the attempt's state, together.
    pub(crate) fn parts(&mut self) -> (&mut PgConnection, &mut AttemptState) {
        (self.conn, self.state)
    }

    /// The place of the next event this attempt writes.
    pub(crate) fn next_event(&mut self) -> u32 {
        self.emitted += 1;
        self.emitted - 1
    }

    /// The request's idempotency key, as the client meant it (without sf-string quotes);
    /// `None` only on an endpoint with `required = false` that was called without one.
    pub fn idempotency_key(&self) -> Option<&str> {
        self.key.map(|k| k.key.as_str())
    }

    /// The value this request's key is kept under, and on a distributed engine
    /// distributed by: its principal, or for a key without one the endpoint's spread
    /// (`spread = ..`, [`crate::jobs::RunOnce::spread_by`]; without either, a hash of the key in
    /// the portable mode and `""` in the others). Write it into
    /// the distribution column of the rows the handler inserts, so that they live on the
    /// key's shard and the request commits on one node. `None` without a key.
    pub fn principal(&self) -> Option<&str> {
        self.key.map(|k| k.principal.as_str())
    }

    /// A key for a downstream API that accepts one (a payment processor, say), derived
    /// from this request's scope, principal and key and from `purpose`: a retry of this
    /// request derives the same key, another request or another purpose a different one.
    /// 64 hex characters. A key without a principal derives from `""`, whatever value it
    /// is kept under ([`Tx::principal`]), so its derived keys stay the same across the
    /// upgrade that spread it.
    ///
    /// The database transaction cannot roll back a call to another service; forwarding a
    /// derived key is how that call becomes idempotent too. `None` without a key.
    pub fn derived_key(&self, purpose: &str) -> Option<String> {
        let key = self.key?;
        let mut hasher = Sha256::new();
        for part in [
            "idem.derived-key.v1",
            &key.scope,
            key.owner(),
            key.key.as_str(),
            purpose,
        ] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        Some(hex(&hasher.finalize()))
    }
}

impl Deref for Tx<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn
    }
}

impl DerefMut for Tx<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn
    }
}

/// `&mut tx` runs its statements on the transaction's connection, exactly as `&mut *tx`
/// does: every method hands the query to the connection's own `Executor`, so what runs,
/// and in how many round trips, is sqlx's.
///
/// The trait has one method only while sqlx-core's `offline` feature is on (`describe`,
/// for the query macros), so an implementation outside sqlx must know that feature: idem
/// turns it on itself (its `Cargo.toml`), and this impl always forwards `describe` too.
impl<'c> sqlx::Executor<'c> for &'c mut Tx<'_> {
    type Database = Postgres;

    fn execute<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<PgQueryResult, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Executor::execute(&mut *self.conn, query)
    }

    fn execute_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<PgQueryResult, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Executor::execute_many(&mut *self.conn, query)
    }

    fn fetch<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<PgRow, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Executor::fetch(&mut *self.conn, query)
    }

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Executor::fetch_many(&mut *self.conn, query)
    }

    fn fetch_all<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Vec<PgRow>, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Executor::fetch_all(&mut *self.conn, query)
    }

    fn fetch_one<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<PgRow, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Executor::fetch_one(&mut *self.conn, query)
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Executor::fetch_optional(&mut *self.conn, query)
    }

    fn prepare<'e>(self, query: SqlStr) -> BoxFuture<'e, Result<PgStatement, Error>>
    where
        'c: 'e,
    {
        Executor::prepare(&mut *self.conn, query)
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, Error>>
    where
        'c: 'e,
    {
        Executor::prepare_with(&mut *self.conn, sql, parameters)
    }

    fn describe<'e>(self, sql: SqlStr) -> BoxFuture<'e, Result<Describe<Postgres>, Error>>
    where
        'c: 'e,
    {
        Executor::describe(&mut *self.conn, sql)
    }
}

impl std::fmt::Debug for Tx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("scope", &self.key.map(|k| &*k.scope))
            .finish_non_exhaustive()
    }
}
