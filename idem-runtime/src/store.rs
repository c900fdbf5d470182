//! [`Store`]: the pool, the table, and the settings every idempotent endpoint of a
//! service shares; [`StoreBuilder`] configures one, and checks it once, in
//! [`StoreBuilder::build`](crate::StoreBuilder::build).

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::header::{self, HeaderName};
use http::request::Parts;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::answers::Answers;
use crate::spread::Earlier;
use crate::table::audit::{AuditTable, DEFAULT_AUDIT_TABLE};
use crate::table::outbox::{OutboxTable, DEFAULT_OUTBOX_TABLE};
use crate::table::requests::RequestsTable;
use crate::table::steps::StepsTable;
use crate::table::{
    Dialect, Pooler, PrincipalType, Table, TableName, DEFAULT_STEPS_TABLE, DEFAULT_TABLE,
};

/// How long [`Store::run_once`](crate::Store::run_once) keeps a result by default
/// ([`RunOnce::ttl`](crate::jobs::RunOnce::ttl)): one day. [`StoreBuilder::redrive_max_age`](crate::StoreBuilder::redrive_max_age)
/// defaults to it.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// At most one NOTIFY per this interval from one store ([`StoreBuilder::outbox_notify_interval`](crate::StoreBuilder::outbox_notify_interval)).
const DEFAULT_NOTIFY_INTERVAL: Duration = Duration::from_millis(5);

/// How a store finds the principal of a request.
type PrincipalResolver = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The idempotency store of a service: a PostgreSQL pool, idem's table in it, and the
/// settings its idempotent endpoints share.
///
/// Put it in the router's state and make it reachable with
/// [`FromRef`](axum::extract::FromRef); every `#[idempotent]` handler takes it from
/// there. Cloning is cheap.
///
/// ```no_run
/// use axum::extract::FromRef;
/// use idem::Store;
///
/// #[derive(Clone, FromRef)]
/// struct AppState {
///     store: Store,
/// }
///
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let store = Store::builder(pool)
///     // Keys are looked up per account: one account never sees another's responses.
///     .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
///     .build()?;
/// store.migrate().await?;
/// let state = AppState { store };
/// # Ok(()) }
/// # #[derive(Clone)] struct Account(String);
/// ```
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<Settings>,
}

pub(crate) struct Settings {
    pub(crate) pool: PgPool,
    pub(crate) table: Table,
    pub(crate) table_name: TableName,
    pub(crate) acquire_timeout: Duration,
    pub(crate) conflict_wait: Duration,
    pub(crate) statement_timeout: Option<Duration>,
    pub(crate) principal: Option<Box<PrincipalResolver>>,
    pub(crate) require_principal: bool,
    pub(crate) retry_after: Duration,
    pub(crate) max_response_bytes: usize,
    pub(crate) replay_headers: Vec<HeaderName>,
    /// `None` for [`DEFAULT_PROBLEM_BASE`](crate::problem::DEFAULT_PROBLEM_BASE).
    pub(crate) problem_base: Option<String>,
    pub(crate) dialect: Dialect,
    pub(crate) outbox: OutboxTable,
    /// Which scopes still have records kept before the spread ([`crate::spread`]).
    pub(crate) earlier: Earlier,
    /// Where steps are recorded (`Tx::step`).
    pub(crate) steps_table: TableName,
    /// Its statements, rendered.
    pub(crate) steps: StepsTable,
    /// Where events are written ([`StoreBuilder::outbox_table`](crate::StoreBuilder::outbox_table)).
    pub(crate) outbox_table: TableName,
    /// Where completable requests are stored with their first step
    /// ([`StoreBuilder::requests_table`](crate::StoreBuilder::requests_table)).
    pub(crate) requests_table: TableName,
    /// Its statements, rendered.
    pub(crate) requests: RequestsTable,
    /// The headers a completable request is stored with, besides the key's
    /// ([`StoreBuilder::stored_headers`](crate::StoreBuilder::stored_headers)).
    pub(crate) stored_headers: Vec<HeaderName>,
    /// The longest a step's call may take.
    pub(crate) step_timeout: Duration,
    /// How old a dead event may be for a re-drive that is not forced
    /// ([`StoreBuilder::redrive_max_age`](crate::StoreBuilder::redrive_max_age)).
    pub(crate) redrive_max_age: Duration,
    /// Committed answers replayed from memory ([`StoreBuilder::replay_cache`](crate::StoreBuilder::replay_cache)); `None`:
    /// every replay asks PostgreSQL.
    pub(crate) answers: Option<Answers>,
    /// How long a request that recorded a step may make none before it counts as
    /// abandoned ([`StoreBuilder::abandoned_after`](crate::StoreBuilder::abandoned_after)).
    pub(crate) abandoned_after: Duration,
    /// Where operators' actions are recorded ([`StoreBuilder::audit_table`](crate::StoreBuilder::audit_table)).
    pub(crate) audit_table: TableName,
    /// Its statements, rendered.
    pub(crate) audit: AuditTable,
    /// The connections for writes that must commit outside a request's transaction
    /// ([`Store::outside`](crate::Store::outside)): given, or made on first use.
    outside: OnceLock<PgPool>,
    /// Whether `outside` was given ([`StoreBuilder::step_pool`](crate::StoreBuilder::step_pool)): [`Store::verify`](crate::Store::verify)
    /// checks it too.
    pub(crate) step_pool_given: bool,
    outside_connections: u32,
    /// Where a test makes the process die ([`StoreBuilder::failpoints`](crate::StoreBuilder::failpoints)).
    #[cfg(feature = "failpoints")]
    pub(crate) failpoints: Option<Arc<crate::failpoint::Failpoints>>,
}

impl Store {
    /// A store on `pool` with the default settings.
    pub fn new(pool: PgPool) -> Self {
        Self::builder(pool).settings(TableName::default())
    }

    /// Starts configuring a store on `pool`.
    pub fn builder(pool: PgPool) -> StoreBuilder {
        StoreBuilder {
            pool,
            table: DEFAULT_TABLE.to_owned(),
            outbox_table: None,
            outbox_notify: true,
            outbox_notify_interval: DEFAULT_NOTIFY_INTERVAL,
            redrive_max_age: DEFAULT_TTL,
            steps_table: None,
            requests_table: None,
            stored_headers: vec![header::CONTENT_TYPE],
            audit_table: None,
            step_timeout: Duration::from_secs(30),
            step_pool: None,
            step_connections: 4,
            replay_cache: None,
            abandoned_after: Duration::from_secs(300),
            #[cfg(feature = "failpoints")]
            failpoints: None,
            principal: None,
            require_principal: false,
            acquire_timeout: Duration::from_secs(3),
            conflict_wait: Duration::from_millis(1),
            statement_timeout: None,
            retry_after: Duration::from_secs(1),
            max_response_bytes: 1 << 20,
            problem_base: None,
            dialect: Dialect::default(),
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

    /// What this store was told sits in front of PostgreSQL ([`StoreBuilder::pooler`](crate::StoreBuilder::pooler)),
    /// for statements of one's own that must follow the same rule, such as a queue
    /// consumer's inside [`Store::run_once`](crate::Store::run_once): behind [`Pooler::Transaction`], send them
    /// unnamed (sqlx's `.persistent(false)`).
    pub fn pooler(&self) -> Pooler {
        self.inner.dialect.pooler
    }

    /// The pool for writes that must commit outside a request's transaction (a step's
    /// record), apart from the requests' pool: a request holds its own connection while
    /// such a write waits for one, so sharing one pool could leave every connection
    /// held by a request that waits for another. Made on first use from the main pool's
    /// connect options, unless one was given ([`StoreBuilder::step_pool`](crate::StoreBuilder::step_pool)).
    pub(crate) fn outside(&self) -> &PgPool {
        let settings = &self.inner;
        settings.outside.get_or_init(|| {
            PgPoolOptions::new()
                .max_connections(settings.outside_connections)
                .min_connections(0)
                .acquire_timeout(settings.acquire_timeout)
                .connect_lazy_with((*settings.pool.connect_options()).clone())
        })
    }

    /// The principal of a request by the store's resolver; `None` when no resolver is
    /// configured or it found none.
    pub(crate) fn resolve_principal(&self, parts: &Parts) -> Option<String> {
        self.inner
            .principal
            .as_ref()
            .and_then(|resolve| resolve(parts))
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("table", &self.inner.table_name.to_string())
            .field("principal_resolver", &self.inner.principal.is_some())
            .field("acquire_timeout", &self.inner.acquire_timeout)
            .field("conflict_wait", &self.inner.conflict_wait)
            .field("statement_timeout", &self.inner.statement_timeout)
            .field("max_response_bytes", &self.inner.max_response_bytes)
            .field("pooler", &self.inner.dialect.pooler)
            .field("portable", &self.inner.dialect.portable)
            .field("principal_type", &self.inner.dialect.principal_type)
            .field("redrive_max_age", &self.inner.redrive_max_age)
            .field("replay_cache", &self.inner.answers.is_some())
            .finish_non_exhaustive()
    }
}

/// Configures a [`Store`]; see [`Store::builder`](crate::Store::builder). Setters only record; [`build`]
/// checks everything at once.
///
/// [`build`]: StoreBuilder::build
#[must_use]
pub struct StoreBuilder {
    pool: PgPool,
    table: String,
    outbox_table: Option<String>,
    outbox_notify: bool,
    outbox_notify_interval: Duration,
    redrive_max_age: Duration,
    principal: Option<Box<PrincipalResolver>>,
    require_principal: bool,
    acquire_timeout: Duration,
    conflict_wait: Duration,
    statement_timeout: Option<Duration>,
    retry_after: Duration,
    max_response_bytes: usize,
    replay_headers: Vec<HeaderName>,
    problem_base: Option<String>,
    dialect: Dialect,
    steps_table: Option<String>,
    requests_table: Option<String>,
    stored_headers: Vec<HeaderName>,
    audit_table: Option<String>,
    step_timeout: Duration,
    step_pool: Option<PgPool>,
    step_connections: u32,
    replay_cache: Option<(usize, Duration)>,
    abandoned_after: Duration,
    #[cfg(feature = "failpoints")]
    failpoints: Option<Arc<crate::failpoint::Failpoints>>,
}

impl std::fmt::Debug for StoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreBuilder")
            .field("table", &self.table)
            .field("outbox_table", &self.outbox_table)
            .field("require_principal", &self.require_principal)
            .field("acquire_timeout", &self.acquire_timeout)
            .finish_non_exhaustive()
    }
}

impl StoreBuilder {
    /// The failpoints a test arms to make this store's requests and completer stop at a
    /// durable boundary, as if their process had died ([`crate::failpoint`]; feature
    /// `failpoints`, for tests only).
    #[cfg(feature = "failpoints")]
    pub fn failpoints(mut self, failpoints: Arc<crate::failpoint::Failpoints>) -> Self {
        self.failpoints = Some(failpoints);
        self
    }

    /// How long a request that recorded a step ([`Tx::step`](crate::Tx::step)) may go
    /// without committing or recording another before it counts as abandoned (default 5
    /// minutes): what the console's "Abandoned" page lists by default, and what the
    /// sweeper ([`Store::spawn_sweeper`](crate::Store::spawn_sweeper)) counts in the gauge `idem_abandoned_requests`
    /// (feature `metrics`). Set it above the longest a handler of yours takes after a
    /// step, or requests in flight are counted.
    pub fn abandoned_after(mut self, idle: Duration) -> Self {
        self.abandoned_after = idle;
        self
    }

    /// Replays committed answers from memory (default: off, every replay asks
    /// PostgreSQL). The answers this store commits, and those it reads to replay, are
    /// kept up to `max_bytes` in all (keys and answers; the oldest go first), each for at
    /// most `max_stale`, and never past its key's expiry for an answer this store
    /// committed. A retry whose key's answer is kept, with the same fingerprint, is
    /// answered without a round trip to PostgreSQL or a connection of the pool; any other
    /// request goes to PostgreSQL as before.
    ///
    /// What it costs: a purge of a key on another instance (`idem key purge`, the
    /// console, [`Audited::purge_key`](crate::operate::Audited::purge_key) on another store), or the expiry of an answer this
    /// store only read, is seen here up to `max_stale` late, and a retry meanwhile replays
    /// the answer that was purged or expired. A purge through this store empties the
    /// cache at once. Keep `max_stale` short (a second or a few) where operators purge
    /// keys to let a request run again; `Duration::ZERO` or `max_bytes` 0 turn it off.
    pub fn replay_cache(mut self, max_bytes: usize, max_stale: Duration) -> Self {
        self.replay_cache =
            (max_bytes > 0 && !max_stale.is_zero()).then_some((max_bytes, max_stale));
        self
    }

    /// What sits between the service and PostgreSQL (default [`Pooler::Session`]: nothing,
    /// or a pooler in session mode). Behind a pooler in transaction mode (PgBouncer's
    /// `pool_mode = transaction`), set [`Pooler::Transaction`]: idem then prepares
    /// nothing that outlives a statement, at the cost of one more parse per statement,
    /// and wraps the few statements it sends outside a request (sweeper, inspection) in
    /// a transaction. Your own statements must follow the same two rules: send them with
    /// sqlx's `.persistent(false)` (build the pool with
    /// `PgConnectOptions::statement_cache_capacity(0)` as well, but that alone is not
    /// enough: sqlx still parses a persistent statement under a name, only without
    /// caching it), and run those with parameters inside a transaction, since sqlx parses
    /// and executes them in two exchanges that a pooler may send to two server
    /// connections. See the guide's "Topologies", "Behind a transaction pooler".
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.dialect.pooler = pooler;
        self
    }

    /// Portable mode, for engines that run a statement on other nodes than the one the
    /// session is connected to (Citus first). idem then depends on no custom setting,
    /// sets the claim's `lock_timeout` (and `statement_timeout`) with `SET LOCAL` (one
    /// more statement per request, and one more after a fresh claim to give the handler
    /// the session's default `lock_timeout` back), and sweeps without row locks.
    /// [`Store::schema`](crate::Store::schema) then ends with the distribution statement, as a comment;
    /// [`Store::distribute`](crate::Store::distribute) runs it. The claim's `SET LOCAL` batch also sets
    /// `citus.propagate_set_commands = 'local'`, so that on Citus its wait bound reaches
    /// the worker holding the key (without it, duplicates wait for the request in flight
    /// instead of being answered 409); elsewhere that is an unused placeholder setting.
    /// Plain PostgreSQL runs it too.
    ///
    /// A portable store keeps keys without a principal under a hash of the key rather
    /// than the principal column's nobody value, so that they spread over the shards
    /// ([`Tx::principal`](crate::Tx::principal) gives the value). It still answers
    /// records kept under the nobody value, but a store of another mode does not find
    /// a portable store's: switching a service out of the portable mode (or back to an
    /// earlier version) while such records are live runs their keys once more.
    pub fn portable(mut self, portable: bool) -> Self {
        self.dialect.portable = portable;
        self
    }

    /// The SQL type of the `principal` column (default [`PrincipalType::Text`]): the
    /// type of your tenant column, so that a distributed engine can colocate idem's table
    /// with your tables. The [resolver](StoreBuilder::principal) still answers text: a
    /// UUID in its usual form, or a decimal integer. The type's zero value (the nil
    /// UUID, 0) is the nobody value, where keys without a principal are kept outside the
    /// portable mode, so a request whose principal is that value is refused with 400
    /// (`invalid-principal`). Set it before [`Store::migrate`](crate::Store::migrate)
    /// creates the table; it does not change an existing one.
    pub fn principal_type(mut self, principal_type: PrincipalType) -> Self {
        self.dialect.principal_type = principal_type;
        self
    }

    /// The table idem keeps its records in: `name` or `schema.name` (default
    /// `idempotency_keys` in the connection's default schema), each part 1 to 48
    /// characters of lowercase ASCII letters, digits and `_`, not starting with a digit.
    /// [`Store::migrate`](crate::Store::migrate) creates the schema too.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The outbox table events are written to ([`Tx::emit`](crate::Tx::emit)): `name` or
    /// `schema.name`, as for [`StoreBuilder::table`](crate::StoreBuilder::table) (default `idem_outbox`, in the
    /// schema of the idempotency table).
    pub fn outbox_table(mut self, name: impl Into<String>) -> Self {
        self.outbox_table = Some(name.into());
        self
    }

    /// Whether a commit that wrote events ([`Tx::emit`](crate::Tx::emit)) NOTIFYs the
    /// relays, so that a listening relay publishes them at once (default on; never in
    /// portable mode). Off, the relays find events at their polling interval ([`every`]).
    ///
    /// [`every`]: crate::outbox::RelayBuilder::every
    pub fn outbox_notify(mut self, notify: bool) -> Self {
        self.outbox_notify = notify;
        self
    }

    /// At most one NOTIFY per `every` from this store (default 5 ms; zero for one per
    /// commit that wrote events). PostgreSQL serializes the commits of the transactions
    /// that sent a NOTIFY (one lock on the database, held through the commit's WAL
    /// flush), so a NOTIFY per event makes concurrent emitting requests commit one at a
    /// time (BENCHMARKS.md, "An event rides COMMIT"). The commits let go without one
    /// follow the one that carried it within `every`, and a relay it woke keeps looking
    /// for a while ([`linger`], longer than this interval): an event no relay saw that
    /// way is published at the next poll, later, never lost.
    ///
    /// [`linger`]: crate::outbox::RelayBuilder::linger
    pub fn outbox_notify_interval(mut self, every: Duration) -> Self {
        self.outbox_notify_interval = every;
        self
    }

    /// The re-drive window (default one day, [`Store::run_once`](crate::Store::run_once)'s default ttl): a dead
    /// event written at least this long ago (its age counted from its `created_at`, by
    /// the database's clock) is made pending again only by a forced re-drive
    /// ([`Audited::redrive_dead_forced`](crate::operate::Audited::redrive_dead_forced)); [`Audited::redrive_dead`](crate::operate::Audited::redrive_dead) refuses a selection
    /// that holds one, and moves nothing.
    ///
    /// Set it to the ttl of the records your consumers deduplicate deliveries on
    /// ([`RunOnce::ttl`](crate::jobs::RunOnce::ttl), which `Received::once` uses), less the
    /// time a re-driven event may take to reach them (its retries, the consumers' lag):
    /// the default leaves no such margin, as it cannot know your consumers. A dead event may have reached its consumers even though its publish failed (the
    /// broker took it, its acknowledgement was lost). A consumer recorded that delivery
    /// after the event was written, so its record is still kept while the event is
    /// younger than the record's ttl; past it, the record may be gone, and a re-driven
    /// copy would be applied a second time. `Duration::ZERO` makes every re-drive a
    /// forced one; `Duration::MAX` never asks (consumers that keep their records for
    /// ever, or that apply an event twice harmlessly).
    pub fn redrive_max_age(mut self, max_age: Duration) -> Self {
        self.redrive_max_age = max_age;
        self
    }

    /// The table steps are recorded in ([`Tx::step`](crate::Tx::step)): `name` or
    /// `schema.name`, as for [`StoreBuilder::table`](crate::StoreBuilder::table) (default `idempotency_steps`, in the
    /// schema of the idempotency table).
    pub fn steps_table(mut self, name: impl Into<String>) -> Self {
        self.steps_table = Some(name.into());
        self
    }

    /// The table a completable endpoint's requests are stored in with their first step
    /// (`#[idempotent(.., completable = true)]`, [`crate::complete`]): `name` or
    /// `schema.name`, as for [`StoreBuilder::table`](crate::StoreBuilder::table) (default `idempotency_requests`, in
    /// the schema of the idempotency table). It lives where the steps do.
    pub fn requests_table(mut self, name: impl Into<String>) -> Self {
        self.requests_table = Some(name.into());
        self
    }

    /// The headers a completable request is stored with, so that its completion reads
    /// them as the handler did: `Content-Type` by default, and always the header its key
    /// came from. `Authorization`, `Proxy-Authorization` and `Cookie` are never stored
    /// (left out of `names`): a completion runs under the request's principal as it was
    /// resolved ([`crate::complete::Completion`]), never under a credential.
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.stored_headers = names
            .into_iter()
            .filter(|name| !crate::complete::is_credential(name))
            .collect();
        self
    }

    /// The table operators' actions are recorded in ([`Operate::audited`](crate::operate::Operate::audited)): `name` or
    /// `schema.name`, as for [`StoreBuilder::table`](crate::StoreBuilder::table) (default `idem_audit`, in the schema
    /// of the idempotency table).
    pub fn audit_table(mut self, name: impl Into<String>) -> Self {
        self.audit_table = Some(name.into());
        self
    }

    /// The longest a step's call may take ([`Tx::step`](crate::Tx::step); default
    /// 30 s): the request's transaction, and its connection, stay open while the call
    /// runs. A call that takes longer is dropped, nothing is recorded, and the step
    /// answers [`StepError::Timeout`](crate::StepError::Timeout): the request rolls
    /// back, and its retry calls again with the same key.
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// The pool steps record their results on (default: one made from the main pool's
    /// connect options, of [`step_connections`](StoreBuilder::step_connections)
    /// connections, on first use). A step's record commits outside the request's
    /// transaction, so it needs a connection besides the request's: from a pool of its
    /// own, so that requests holding every connection of the main pool still record
    /// their steps. Give one to set its own options (an `after_connect` hook, TLS
    /// settings made outside the connect options).
    pub fn step_pool(mut self, pool: PgPool) -> Self {
        self.step_pool = Some(pool);
        self
    }

    /// How many connections the default step pool opens at most (default 4). Each step
    /// holds one for one statement at a time: two statements for the first step of a
    /// request, one for each later one. Where many requests make steps at once, size it
    /// near the number of requests in flight: at 16 concurrent requests with a step each,
    /// 16 connections served 1.7 to 1.8 times the steps that 4 did (BENCHMARKS.md, "Steps and
    /// the claim's curve").
    pub fn step_connections(mut self, connections: u32) -> Self {
        self.step_connections = connections;
        self
    }

    /// The base of the `type` URI of idem's own problems (default `urn:idem:problem:`):
    /// with `https://example.com/problems/`, a 409 has the type
    /// `https://example.com/problems/key-in-use`. See [`crate::problem::problem_type`].
    pub fn problem_base(mut self, base: impl Into<String>) -> Self {
        self.problem_base = Some(base.into());
        self
    }

    /// Replaces the response headers stored and replayed (see
    /// [`StoreBuilder::replay_header`](crate::StoreBuilder::replay_header) for the default list).
    pub fn replay_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.replay_headers = Vec::new();
        for name in names {
            self = self.replay_header(name);
        }
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

    /// How to find the principal (account, tenant) of a request, for example from the
    /// authenticated account an auth middleware put in the request's extensions. Keys
    /// are then looked up per (scope, principal, key): one principal never sees
    /// another's stored response.
    ///
    /// Without a resolver, or when it answers `None` (or an empty principal, which is
    /// no principal), keys are global to their scope:
    /// two tenants that pick the same key share one stored response. Multi-tenant
    /// services must configure a resolver (or `principal = ...` on each handler), and
    /// must run authentication before idem sees the request.
    ///
    /// An endpoint whose body is signed (`Signed<..>`, a webhook) does not ask the
    /// resolver: a delivery is named by what its signature covers and by the endpoint's
    /// own code, never by request data nothing vouches for. A principal is used in its
    /// canonical spelling (a lowercase UUID, a `bigint` without leading zeros).
    pub fn principal<F>(mut self, resolve: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.principal = Some(Box::new(resolve));
        self
    }

    /// Strict mode for multi-tenant services: a keyed request for which neither the
    /// handler's `principal = ...` nor the [resolver](StoreBuilder::principal) names a
    /// principal (or names the empty one) is refused with 401 (`missing-principal`)
    /// instead of running with keys global to its scope, so a missing authentication
    /// layer cannot make one tenant's key replay another's response. Signed webhook
    /// deliveries are still served: their sender has no principal.
    pub fn require_principal(mut self, required: bool) -> Self {
        self.require_principal = required;
        self
    }

    /// How long a request waits for a database connection before it is answered 503
    /// (default 3 s). The request never runs without its claim.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long a duplicate waits for the request in flight with its key to finish
    /// before it is answered 409 (default 1 ms: no wait; the claim tries the key's lock
    /// and answers at once). A longer wait turns more concurrent duplicates into
    /// replays, at the cost of holding a connection while waiting; the duplicate reads
    /// the record as soon as the first request commits.
    pub fn conflict_wait(mut self, wait: Duration) -> Self {
        self.conflict_wait = wait;
        self
    }

    /// The longest any statement of a keyed request's handler may run (PostgreSQL's
    /// `statement_timeout`, set by the claim for that transaction only; default: the
    /// session's own). Set it to what your timeout layer allows a request: when a layer
    /// (or a client that disconnects) drops a request, its transaction is rolled back,
    /// but a statement already sent keeps running on the server and keeps the key held,
    /// so duplicates get 409 until it ends. This bounds that time.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = Some(timeout);
        self
    }

    /// The `Retry-After` of 409 and 503 answers, in whole seconds, rounded up (default
    /// 1 s).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// The largest response body stored for replay (default 1 MiB). A larger response
    /// rolls the request back and answers 500, saying why.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Checks the settings and finishes the store.
    pub fn build(self) -> Result<Store, BuildError> {
        let table =
            TableName::parse(&self.table).ok_or(BuildError::TableName(self.table.clone()))?;
        for name in [
            &self.outbox_table,
            &self.steps_table,
            &self.requests_table,
            &self.audit_table,
        ]
        .into_iter()
        .flatten()
        {
            TableName::parse(name).ok_or(BuildError::TableName(name.clone()))?;
        }
        if self.step_timeout.is_zero() {
            return Err(BuildError::ZeroStepTimeout);
        }
        if self.step_connections == 0 {
            return Err(BuildError::NoStepConnections);
        }
        if self.acquire_timeout.is_zero() {
            return Err(BuildError::ZeroAcquireTimeout);
        }
        if self.statement_timeout.is_some_and(|t| t.is_zero()) {
            return Err(BuildError::ZeroStatementTimeout);
        }
        Ok(self.settings(table))
    }

    fn settings(self, table_name: TableName) -> Store {
        let outbox = match self.outbox_table.as_deref().and_then(TableName::parse) {
            Some(name) => name,
            None => table_name.sibling(DEFAULT_OUTBOX_TABLE),
        };
        let steps_table = match self.steps_table.as_deref().and_then(TableName::parse) {
            Some(name) => name,
            None => table_name.sibling(DEFAULT_STEPS_TABLE),
        };
        let requests_table = match self.requests_table.as_deref().and_then(TableName::parse) {
            Some(name) => name,
            None => table_name.sibling(crate::table::requests::DEFAULT_REQUESTS_TABLE),
        };
        let audit_table = match self.audit_table.as_deref().and_then(TableName::parse) {
            Some(name) => name,
            None => table_name.sibling(DEFAULT_AUDIT_TABLE),
        };
        let outside = OnceLock::new();
        let step_pool_given = self.step_pool.is_some();
        if let Some(pool) = self.step_pool {
            let _ = outside.set(pool);
        }
        // Invariant 12: a table named without its schema is resolved by the session's
        // search_path, which the store pins (`Table::pinned_path`).
        let unqualified = [&table_name, &outbox, &steps_table, &requests_table]
            .iter()
            .filter(|name| name.schema().is_none())
            .map(|name| name.qualified())
            .collect();
        let steps = StepsTable::new(&steps_table, self.dialect);
        let outbox_table = outbox.clone();
        let outbox = OutboxTable::new(
            outbox,
            self.dialect,
            self.outbox_notify,
            self.outbox_notify_interval,
        );
        // An event, and the delete of a request's steps, ride the key row's COMMIT
        // message: they are prepared with it.
        let table = Table::new(&table_name, self.dialect, self.acquire_timeout)
            .prepare_also(&[outbox.prepared_ride(), steps.prepared_forget()])
            .pin_path(unqualified);
        Store {
            inner: Arc::new(Settings {
                pool: self.pool,
                table,
                table_name,
                acquire_timeout: self.acquire_timeout,
                conflict_wait: self.conflict_wait,
                statement_timeout: self.statement_timeout,
                principal: self.principal,
                require_principal: self.require_principal,
                retry_after: self.retry_after,
                max_response_bytes: self.max_response_bytes,
                replay_headers: self.replay_headers,
                problem_base: self.problem_base,
                dialect: self.dialect,
                outbox,
                earlier: Earlier::default(),
                steps_table,
                steps,
                outbox_table,
                requests: RequestsTable::new(&requests_table, self.dialect),
                requests_table,
                stored_headers: self.stored_headers,
                step_timeout: self.step_timeout,
                redrive_max_age: self.redrive_max_age,
                answers: self
                    .replay_cache
                    .map(|(max_bytes, max_stale)| Answers::new(max_bytes, max_stale)),
                abandoned_after: self.abandoned_after,
                audit: AuditTable::new(&audit_table),
                audit_table,
                outside,
                step_pool_given,
                outside_connections: self.step_connections,
                #[cfg(feature = "failpoints")]
                failpoints: self.failpoints,
            }),
        }
    }
}

/// A [`StoreBuilder`] setting that cannot work.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BuildError {
    /// The table name is not `name` or `schema.name` of lowercase ASCII letters, digits
    /// and `_`, each part 1 to 48 characters, not starting with a digit.
    TableName(String),
    /// An acquire timeout of zero would answer every request 503.
    ZeroAcquireTimeout,
    /// A statement timeout of zero would cancel every statement of every handler.
    ZeroStatementTimeout,
    /// A step timeout of zero would end every step before its call.
    ZeroStepTimeout,
    /// A step pool of no connections could record no step.
    NoStepConnections,
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TableName(name) => write!(
                f,
                "invalid idempotency table name {name:?}: use `name` or `schema.name`, lowercase letters, digits and `_`"
            ),
            Self::ZeroAcquireTimeout => {
                f.write_str("the acquire timeout is zero: every request would be answered 503")
            }
            Self::ZeroStatementTimeout => f.write_str(
                "the statement timeout is zero: every statement of every handler would be cancelled",
            ),
            Self::ZeroStepTimeout => {
                f.write_str("the step timeout is zero: every step would end before its call")
            }
            Self::NoStepConnections => {
                f.write_str("the step pool has no connections: no step could be recorded")
            }
        }
    }
}

impl std::error::Error for BuildError {}

impl Store {
    /// A pass through `point`: never returns where the store's failpoints stop it there.
    #[cfg(feature = "failpoints")]
    pub(crate) async fn failpoint(&self, point: crate::failpoint::Point) {
        if let Some(failpoints) = &self.inner.failpoints {
            if failpoints.take(point) {
                tracing::warn!(%point, "idem: a failpoint stopped here, as a process death would");
                std::future::pending::<()>().await;
            }
        }
    }

    /// A pass through `point`: nothing, without the feature `failpoints`.
    #[cfg(not(feature = "failpoints"))]
    #[inline(always)]
    pub(crate) async fn failpoint(&self, _point: crate::failpoint::Point) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lazy_pool() -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/none")
            .unwrap()
    }

    #[tokio::test]
    async fn build_checks_every_setting_once() {
        let error = Store::builder(lazy_pool())
            .table("Bad Name")
            .build()
            .unwrap_err();
        assert_eq!(error, BuildError::TableName("Bad Name".into()));
        assert!(error.to_string().contains("\"Bad Name\""));
        let error = Store::builder(lazy_pool())
            .acquire_timeout(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(error, BuildError::ZeroAcquireTimeout);
        let error = Store::builder(lazy_pool())
            .statement_timeout(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(error, BuildError::ZeroStatementTimeout);
        let store = Store::builder(lazy_pool())
            .table("ops.keys")
            .build()
            .unwrap();
        assert!(store.schema().keys_sql.contains("\"ops\".\"keys\""));
        assert!(format!("{store:?}").contains("ops.keys"));
        // The audit table sits beside the idempotency table unless named.
        assert!(store
            .schema()
            .audit_sql
            .contains("CREATE TABLE IF NOT EXISTS \"ops\".\"idem_audit\""));
        let error = Store::builder(lazy_pool())
            .audit_table("ops.Audit")
            .build()
            .unwrap_err();
        assert_eq!(error, BuildError::TableName("ops.Audit".into()));
        let store = Store::builder(lazy_pool())
            .audit_table("trail.actions")
            .build()
            .unwrap();
        assert!(store
            .schema()
            .audit_sql
            .contains("CREATE TABLE IF NOT EXISTS \"trail\".\"actions\""));
    }

    #[tokio::test]
    async fn the_default_store_uses_the_shipped_sql() {
        assert_eq!(
            Store::new(lazy_pool()).schema().keys_sql,
            crate::schema::DEFAULT.keys_sql
        );
    }
}
