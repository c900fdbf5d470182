//! The charges service: idem's reference example.
//!
//! * `POST /charges` creates a charge, idempotent per account and `Idempotency-Key`,
//!   fingerprinted on amount, currency and customer; with a payment processor
//!   (`PROCESSOR_URL`), it charges there first, once per request, as a step.
//! * `GET /charges/{id}` reads a charge of the caller's account.
//! * `POST /charges/{id}/refunds` refunds part of a charge, never more than remains.
//! * `POST /webhooks/payments`, `/webhooks/stripe` and `/webhooks/github` take signed
//!   deliveries from three providers (Standard Webhooks, Stripe, GitHub), once each.
//!
//! Authentication is a stand-in: `Authorization: Bearer <account>` names the account,
//! which is also the principal idem keys are looked up under. Webhooks carry no bearer
//! token: their signature is their authentication.

mod admin;
mod charge;
pub mod consumer;
mod error;
pub mod events;
pub mod openapi;
mod processor;
mod webhook;

pub use admin::OPERATOR_HEADER;
pub use charge::{Charge, NewCharge, NewRefund, Refund};
pub use error::ApiError;

use admin::{admin, Operators};
use error::problem_type;
pub use processor::{Processor, ProcessorError};
pub use webhook::{provider_verifier, webhook_verifier, PaymentEvent, StripeEvent};

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, Request};
use axum::http::header::WWW_AUTHENTICATE;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use idem::webhook::{GitHub, StandardWebhooks, Stripe, Verifier};
use idem::{Pooler, Problem, Store, StoreBuilder};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// The example's own tables; idem's table comes from [`Store::migrate`].
pub const SCHEMA_SQL: &str = include_str!("../schema.sql");

/// The base of this service's own problem `type` URIs.
pub const PROBLEM_BASE: &str = "https://example.com/problems/";

/// The Standard Webhooks secret of [`Config::default`], for tests and a local try-out
/// (24 random bytes, base64).
pub const TEST_WEBHOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// The Stripe secret of [`Config::default`].
pub const TEST_STRIPE_SECRET: &str = "whsec_test_stripe_0123456789abcdef";

/// The GitHub secret of [`Config::default`].
pub const TEST_GITHUB_SECRET: &str = "github_test_secret_0123456789";

/// Settings read from the environment by the binary.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long the charge handler waits inside its transaction after writing the
    /// charge, after the processor's call if there is one: a stand-in for a slow
    /// handler (`PROCESSOR_DELAY_MS`).
    pub processor_delay: Duration,
    /// The payment processor `POST /charges` charges first, once per request, in a step
    /// (the binary makes it with [`Processor::new`] from `PROCESSOR_URL` and
    /// `PROCESSOR_TIMEOUT_MS`); `None` calls nobody, and charges have no
    /// `processor_id`.
    pub processor: Option<Processor>,
    /// Checks the Standard Webhooks deliveries of `/webhooks/payments`; the binary makes
    /// it with [`webhook_verifier`] from `WEBHOOK_SECRET` and `WEBHOOK_SECRET_PREVIOUS`.
    pub payments: Verifier<StandardWebhooks>,
    /// Checks the Stripe deliveries of `/webhooks/stripe` (`STRIPE_WEBHOOK_SECRET`).
    pub stripe: Verifier<Stripe>,
    /// Checks the GitHub deliveries of `/webhooks/github` (`GITHUB_WEBHOOK_SECRET`).
    pub github: Verifier<GitHub>,
    /// How long the webhook handler works on an event (tests use it to overlap
    /// deliveries).
    pub webhook_delay: Duration,
    /// What sits between the service and PostgreSQL (`DB_POOLER`): nothing or a pooler in
    /// session mode ([`Pooler::Session`], the default), or a pooler in transaction mode
    /// such as PgBouncer's `pool_mode = transaction` ([`Pooler::Transaction`]). idem's
    /// store and the service's own statements follow it; connect the pool with
    /// [`connect_with`] and the same value.
    pub pooler: Pooler,
    /// idem's portable mode (`DB_PORTABLE=true`), for distributed PostgreSQL (Citus):
    /// see [`StoreBuilder::portable`](|b| b.portable(true)) and `schema.sql`.
    pub portable: bool,
    /// The subject prefix of the charge events written to idem's outbox (`NATS_URL` sets
    /// it, to `NATS_SUBJECT_PREFIX` or `charges`); `None` emits nothing.
    pub events: Option<String>,
    /// Whether a commit with events NOTIFYs the relay (`StoreBuilder::outbox_notify`;
    /// default true). Off, the relay polls.
    pub events_notify: bool,
    /// At most one NOTIFY per this interval (`StoreBuilder::outbox_notify_interval`);
    /// `None` for idem's default.
    pub events_notify_interval: Option<Duration>,
    /// The bearer token of idem's console at `/admin/idem` (`ADMIN_TOKEN`), whose holder
    /// is the operator `admin` and may act; with `admin_readonly_token` also `None`,
    /// nothing is mounted there.
    pub admin_token: Option<String>,
    /// The bearer token of the console's read-only level (`ADMIN_READONLY_TOKEN`), whose
    /// holder is the operator `readonly`: every page, no action.
    pub admin_readonly_token: Option<String>,
    /// The JetStream the ledger's dead letters are read back from, in the stream
    /// `<events prefix>_dead` ([`events::dead_letters`]): the console's "Dead letters"
    /// page (the binary connects one when `NATS_URL` is set); `None`, no such page.
    pub jetstream: Option<async_nats::jetstream::Context>,
    /// The relay this process runs (the binary's, when `NATS_URL` is set): the console
    /// shows what it published, retried and parked per minute.
    pub relay: Option<Arc<idem::outbox::Relay>>,
    /// How charges whose clients went away after the processor's answer are finished
    /// ([`completer`]).
    pub completion: Completion,
}

/// How the service completes charges its clients abandoned ([`completer`]).
#[derive(Debug, Clone)]
pub struct Completion {
    /// How long after its processor step a charge that has not committed is finished by
    /// the service (`COMPLETE_AFTER_MS`, default a minute).
    pub after: Duration,
    /// The first wait after a failed completion, doubled up to five minutes
    /// (`COMPLETE_BACKOFF_MS`, default a second).
    pub backoff: Duration,
    /// How many definitive failures park a completion as `failed`
    /// (`COMPLETE_LIMIT`, default 5).
    pub limit: u32,
    /// How often the completer looks (a tenth of `after`, between 10 ms and a second).
    pub every: Duration,
}

impl Default for Completion {
    fn default() -> Self {
        Self::new(Duration::from_secs(60), Duration::from_secs(1), 5)
    }
}

impl Completion {
    /// Completion after `after`, retried from `backoff`, parked after `limit` failures.
    pub fn new(after: Duration, backoff: Duration, limit: u32) -> Self {
        Self {
            after,
            backoff,
            limit,
            every: (after / 10).clamp(Duration::from_millis(10), Duration::from_secs(1)),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            processor_delay: Duration::ZERO,
            processor: None,
            payments: Verifier::new(TEST_WEBHOOK_SECRET).expect("a valid test secret"),
            stripe: Verifier::new(TEST_STRIPE_SECRET).expect("a valid test secret"),
            github: Verifier::new(TEST_GITHUB_SECRET).expect("a valid test secret"),
            webhook_delay: Duration::ZERO,
            pooler: Pooler::Session,
            portable: false,
            events: None,
            events_notify: true,
            events_notify_interval: None,
            admin_token: None,
            admin_readonly_token: None,
            jetstream: None,
            relay: None,
            completion: Completion::default(),
        }
    }
}

/// Whether the service's own statements may be prepared once per connection and reused
/// (sqlx's `persistent`, its default). Behind a transaction pooler they may not: a named
/// statement stays on the server connection it was parsed on, which the pooler then
/// lends to other clients, whose statements of the same name fail ("prepared statement
/// \"sqlx_s_1\" already exists"), and a client's next transaction may run on a server
/// connection that never saw it. So there each statement goes unnamed,
/// `.persistent(false)`: sqlx's `statement_cache_capacity(0)` alone does not do that,
/// it still parses persistent statements under a name, only without caching (or closing)
/// them.
fn persistent(pooler: Pooler) -> bool {
    pooler == Pooler::Session
}

/// Reads `DB_POOLER`: `session` (also when unset) or `transaction`.
fn pooler_from_env(value: Option<&str>) -> Result<Pooler, String> {
    match value {
        None | Some("session") => Ok(Pooler::Session),
        Some("transaction") => Ok(Pooler::Transaction),
        Some(other) => Err(format!(
            "DB_POOLER must be \"session\" (the default: no pooler, or one in session mode) \
             or \"transaction\" (a pooler in transaction mode, such as PgBouncer's \
             pool_mode = transaction), not {other:?}"
        )),
    }
}

/// Reads the console's token `name` (`ADMIN_TOKEN`, `ADMIN_READONLY_TOKEN`): unset or
/// empty, none; else at least 16 characters, so that a placeholder such as `admin` does
/// not guard the console.
fn admin_token_from_env(name: &str, value: Option<String>) -> Result<Option<String>, String> {
    match value.filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(token) if token.len() >= 16 && token.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(token))
        }
        Some(_) => Err(format!(
            "{name} must be at least 16 visible ASCII characters (it guards idem's console \
             at /admin/idem), or unset"
        )),
    }
}

/// Reads `ADMIN_TOKEN` and `ADMIN_READONLY_TOKEN`: two different tokens, for there is no
/// telling which level one token shared by both would give.
fn admin_tokens_from_env(
    admin: Option<String>,
    readonly: Option<String>,
) -> Result<(Option<String>, Option<String>), String> {
    let admin = admin_token_from_env("ADMIN_TOKEN", admin)?;
    let readonly = admin_token_from_env("ADMIN_READONLY_TOKEN", readonly)?;
    if admin.is_some() && admin == readonly {
        return Err("ADMIN_READONLY_TOKEN must differ from ADMIN_TOKEN".into());
    }
    Ok((admin, readonly))
}

/// Reads `DB_PORTABLE`: `false` (also when unset) or `true`.
fn portable_from_env(value: Option<&str>) -> Result<bool, String> {
    match value {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(format!(
            "DB_PORTABLE must be \"true\" (idem's portable mode, for distributed PostgreSQL \
             such as Citus) or \"false\" (the default), not {other:?}"
        )),
    }
}

/// Reads `PROCESSOR_URL` (unset or empty: no processor) and `PROCESSOR_TIMEOUT_MS`.
fn processor_from_env(url: Option<&str>, timeout_ms: u64) -> Result<Option<Processor>, String> {
    match url.filter(|u| !u.is_empty()) {
        None => Ok(None),
        Some(url) => Processor::new(url, Duration::from_millis(timeout_ms)).map(Some),
    }
}

/// The authenticated account, put in the request's extensions by [`authenticate`].
#[derive(Debug, Clone)]
pub struct Account(pub String);

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    pool: PgPool,
    config: Arc<Config>,
    payments: Verifier<StandardWebhooks>,
    stripe: Verifier<Stripe>,
    github: Verifier<GitHub>,
}

/// A pool sized for the service, with a short acquire timeout so that an unreachable
/// database answers 503 quickly instead of holding requests; for PostgreSQL itself or a
/// pooler in session mode (see [`connect_with`]).
pub async fn connect(database_url: &str) -> Result<PgPool, sqlx::Error> {
    connect_with(database_url.parse()?, Pooler::Session, 20).await
}

/// A pool of `size` connections on `options`, as [`connect`] makes it, for what sits in
/// front of PostgreSQL: behind a transaction pooler ([`Pooler::Transaction`]) sqlx caches
/// no statement, so that none of a connection's cached statements can be looked for on a
/// server connection that never prepared it. (The service's statements also go unnamed
/// there; see [`Config::pooler`].)
pub async fn connect_with(
    options: PgConnectOptions,
    pooler: Pooler,
    size: u32,
) -> Result<PgPool, sqlx::Error> {
    let options = match pooler {
        Pooler::Transaction => options.statement_cache_capacity(0),
        _ => options,
    };
    // Debug builds warn when a handler writes around its `Tx`.
    idem::extract::warn_on_escaping_writes(PgPoolOptions::new())
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options)
        .await
}

/// Why the service did not start, or stopped serving: what it was doing, and the cause.
#[derive(Debug)]
pub struct ServiceError {
    doing: String,
    cause: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl ServiceError {
    /// A setting that is wrong: the message says which and what would be valid.
    fn setting(message: String) -> Self {
        Self {
            doing: message,
            cause: None,
        }
    }
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.doing)
    }
}

impl std::error::Error for ServiceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.as_deref().map(|c| c as _)
    }
}

/// `result`, its error as the step of starting that failed.
fn doing<T, E>(result: Result<T, E>, step: impl FnOnce() -> String) -> Result<T, ServiceError>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    result.map_err(|e| ServiceError {
        doing: step(),
        cause: Some(e.into()),
    })
}

/// Logs to stdout, filtered by `RUST_LOG` (else `default_filter`), in colour only on a
/// terminal: logs written to a file or a pipe carry no escape codes. `NO_COLOR` turns
/// colour off on a terminal too.
pub fn init_logging(default_filter: &str) {
    use std::io::IsTerminal;
    let colour = std::io::stdout().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_ansi(colour)
        .init();
}

/// `error` and its causes on one line, each cause once: `cannot connect to PostgreSQL at
/// 127.0.0.1:5432: error communicating with database: Connection refused (os error 111)`.
/// How a binary should print a startup failure, instead of the `Debug` dump that
/// `fn main() -> Result<..>` prints.
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // sqlx's errors repeat their source's text ("error returned from database: ..").
        if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line.replace('\n', " ")
}

/// The service as the binary runs it: settings from the environment (see `main.rs`),
/// tables created, the store verified, expired records swept, serving until Ctrl-C.
pub async fn main_from_env() -> Result<(), ServiceError> {
    const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
    let bind = std::env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let database_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let number = |name: &str, default: u64| -> Result<u64, ServiceError> {
        match std::env::var(name) {
            Ok(v) => v.parse().map_err(|_| {
                ServiceError::setting(format!("{name} must be a whole number, not {v:?}"))
            }),
            Err(_) => Ok(default),
        }
    };
    let delay_ms = number("PROCESSOR_DELAY_MS", 0)?;
    let processor = processor_from_env(
        std::env::var("PROCESSOR_URL").ok().as_deref(),
        number("PROCESSOR_TIMEOUT_MS", 10_000)?,
    )
    .map_err(ServiceError::setting)?;
    let sweep_every = number("SWEEP_PERIOD_SECS", 60)?;
    if sweep_every == 0 {
        return Err(ServiceError::setting(
            "SWEEP_PERIOD_SECS must be at least 1: a sweep every 0 s would never pause".into(),
        ));
    }
    let within = |name: &str, default: u64, range: std::ops::RangeInclusive<u64>| {
        let value = number(name, default)?;
        match u32::try_from(value) {
            Ok(value) if range.contains(&u64::from(value)) => Ok(value),
            _ => Err(ServiceError::setting(format!(
                "{name} must be from {} to {}, not {value}",
                range.start(),
                range.end()
            ))),
        }
    };
    let sweep_batch = within("SWEEP_BATCH", 1_000, 1..=100_000)?;
    let completion = Completion::new(
        Duration::from_millis(number("COMPLETE_AFTER_MS", 60_000)?),
        Duration::from_millis(number("COMPLETE_BACKOFF_MS", 1_000)?),
        within("COMPLETE_LIMIT", 5, 1..=1_000)?,
    );
    let pool_size = within("DB_POOL_SIZE", 20, 1..=1_000)?;
    let pooler = pooler_from_env(std::env::var("DB_POOLER").ok().as_deref())
        .map_err(ServiceError::setting)?;
    let portable = portable_from_env(std::env::var("DB_PORTABLE").ok().as_deref())
        .map_err(ServiceError::setting)?;
    let nats_url = std::env::var("NATS_URL").ok().filter(|u| !u.is_empty());
    let (admin_token, admin_readonly_token) = admin_tokens_from_env(
        std::env::var("ADMIN_TOKEN").ok(),
        std::env::var("ADMIN_READONLY_TOKEN").ok(),
    )
    .map_err(ServiceError::setting)?;
    let delivery = events::Delivery {
        max_attempts: within("OUTBOX_MAX_ATTEMPTS", 10, 1..=1_000)?,
        first_backoff: Duration::from_millis(number("OUTBOX_BACKOFF_MS", 500)?),
    };
    let subject_prefix = std::env::var("NATS_SUBJECT_PREFIX").unwrap_or_else(|_| "charges".into());
    if !subject_prefix
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        || subject_prefix.is_empty()
    {
        return Err(ServiceError::setting(format!(
            "NATS_SUBJECT_PREFIX must be letters, digits and `_` (it also names the stream), not {subject_prefix:?}"
        )));
    }

    // Before connecting: a bad secret stops the service at once, with one message.
    let payments = webhook_verifier(
        std::env::var_os("WEBHOOK_SECRET"),
        std::env::var_os("WEBHOOK_SECRET_PREVIOUS"),
    )
    .map_err(ServiceError::setting)?;
    let stripe = provider_verifier(
        "STRIPE_WEBHOOK_SECRET",
        std::env::var_os("STRIPE_WEBHOOK_SECRET"),
    )
    .map_err(ServiceError::setting)?;
    let github = provider_verifier(
        "GITHUB_WEBHOOK_SECRET",
        std::env::var_os("GITHUB_WEBHOOK_SECRET"),
    )
    .map_err(ServiceError::setting)?;

    let options: PgConnectOptions = doing(database_url.parse(), || {
        "DATABASE_URL is not a PostgreSQL URL".into()
    })?;
    // Where, without the password, for the messages below.
    let server = format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or_default()
    );
    let pool = doing(connect_with(options, pooler, pool_size).await, || {
        format!("cannot connect to PostgreSQL at {server}")
    })?;
    doing(migrate(&pool).await, || {
        format!("cannot create the tables in {server}")
    })?;
    let mut config = Config {
        processor_delay: Duration::from_millis(delay_ms),
        processor,
        payments,
        stripe,
        github,
        webhook_delay: Duration::ZERO,
        pooler,
        portable,
        events: nats_url.as_ref().map(|_| subject_prefix.clone()),
        events_notify: true,
        events_notify_interval: None,
        admin_token,
        admin_readonly_token,
        jetstream: None,
        relay: None,
        completion,
    };
    let store = store(pool.clone(), &config);
    if portable {
        doing(distribute(&store).await, || {
            format!("cannot distribute the tables in {server}")
        })?;
    }
    // `CREATE TABLE IF NOT EXISTS` keeps an outdated table as it is: name what is wrong
    // with it now, not in a 500 on the first request.
    doing(store.verify().await, || {
        format!(
            "{server} does not suit the idempotency store as configured (DB_POOLER={}, \
             DB_PORTABLE={portable})",
            match pooler {
                Pooler::Transaction => "transaction",
                _ => "session",
            }
        )
    })?;
    // Expired idempotency records are ignored already; deleting them keeps the table small.
    let sweeper = store.spawn_sweeper(Duration::from_secs(sweep_every), sweep_batch);
    let _sweeper = doing(sweeper, || "cannot start the sweeper".into())?;
    // Charge events: relayed from the outbox to JetStream, booked by the ledger consumer;
    // the console shows the relay's figures and reads the ledger's dead letters back.
    let _ledger = match &nats_url {
        Some(url) => {
            let (relay, ledger) = doing(
                events::start_with(&store, url, &subject_prefix, delivery).await,
                || format!("cannot start the charge events on NATS at {url}"),
            )?;
            config.relay = Some(Arc::new(relay));
            let client = doing(async_nats::connect(url.as_str()).await, || {
                format!("cannot connect the console to NATS at {url}")
            })?;
            config.jetstream = Some(async_nats::jetstream::new(client));
            Some(ledger)
        }
        None => None,
    };
    let completion = config.completion.clone();
    let processor = config.processor.clone();
    let app = app(pool, config);
    // Charges whose clients went away after the processor's answer: finished through
    // the service's own router, or refunded when an operator abandons them.
    let _completer = completer(store, app.clone(), &completion, processor).spawn();
    let listener = doing(tokio::net::TcpListener::bind(&bind).await, || {
        format!("cannot listen on {bind}")
    })?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "charges service listening");
    }
    doing(
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await,
        || "the server stopped".into(),
    )
}

/// Creates idem's table and the example's tables. Safe to run again, and from several
/// processes starting at once, and behind any pooler: it sends no prepared statement.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    Store::new(pool.clone()).migrate().await?;
    // Concurrent `CREATE TABLE IF NOT EXISTS` can race; one lock makes starts take turns.
    let mut tx = pool.begin().await?;
    sqlx::raw_sql("SELECT pg_advisory_xact_lock(hashtext('charges-example-schema'))")
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(SCHEMA_SQL).execute(&mut *tx).await?;
    tx.commit().await
}

/// The example's tables on a distributed engine (Citus), each by its tenant column and
/// colocated with idem's table, whose principal is the account: every row a request
/// writes lives on the shard of its idempotency record, so each endpoint commits on one
/// worker. Nothing on plain PostgreSQL. Safe to run again and from several instances at
/// once, as [`Store::distribute`] is; the binary runs it at every start with
/// `DB_PORTABLE=true`, after [`migrate`].
pub async fn distribute(store: &Store) -> Result<(), idem::VerifyError> {
    /// Each table and the column it is spread by, parents before the tables that refer
    /// to them.
    const TABLES: &[(&str, &str)] = &[
        ("charges", "account"),
        ("refunds", "account"),
        ("webhook_events", "tenant"),
        ("ledger_entries", "account"),
    ];
    if store.distribute(None).await? == idem::schema::Distribution::SingleNode {
        return Ok(());
    }
    let named = persistent(store.pooler());
    for &(table, column) in TABLES {
        let mut tx = store.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('charges-example-schema'))")
            .persistent(named)
            .execute(&mut *tx)
            .await?;
        let done: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass($1))",
        )
        .bind(table)
        .persistent(named)
        .fetch_one(&mut *tx)
        .await?;
        if !done {
            sqlx::query(
                "SELECT create_distributed_table(CAST($1 AS regclass), $2, \
                 colocate_with => 'idempotency_keys')",
            )
            .bind(table)
            .bind(column)
            .persistent(named)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
    }
    Ok(())
}

/// The service's idempotency store: keys per account, statements as `config.pooler`
/// allows, portable when `config.portable`; with a processor, steps bounded a second
/// past its timeout, so that the client's own timeout ends a slow call first (idem's
/// default bound, 30 s, would cut a longer `PROCESSOR_TIMEOUT_MS` short).
pub fn store(pool: PgPool, config: &Config) -> Store {
    configure(Store::builder(pool), config)
        .build()
        .expect("the service's store settings are valid")
}

/// [`store`]'s settings on `builder` (idem's test kit builds a store per process of the
/// service with them: `tests/exactly_once.rs`).
pub fn configure(builder: StoreBuilder, config: &Config) -> StoreBuilder {
    let store = builder
        .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
        .pooler(config.pooler)
        .outbox_notify(config.events_notify);
    let store = match config.events_notify_interval {
        Some(every) => store.outbox_notify_interval(every),
        None => store,
    };
    let store = match &config.processor {
        Some(processor) => store.step_timeout(processor.timeout() + Duration::from_secs(1)),
        None => store,
    };
    if config.portable {
        store.portable(true)
    } else {
        store
    }
}

/// The completer of charges whose clients went away ([`idem::complete`]): through `app`,
/// after `completion.after`; an abandoned charge is refunded at `processor`.
pub fn completer(
    store: Store,
    app: Router,
    completion: &Completion,
    processor: Option<Processor>,
) -> idem::complete::Completer {
    let completer = idem::complete::Completer::new(store, app)
        .after(completion.after)
        .every(completion.every)
        .backoff(completion.backoff, Duration::from_secs(300))
        .max_attempts(completion.limit);
    match processor {
        Some(processor) => completer.compensate("processor", move |undo| {
            let processor = processor.clone();
            async move {
                let outcome: processor::Outcome = undo.result()?;
                processor.undo(undo.key(), outcome).await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            }
        }),
        None => completer,
    }
}

/// The service's router: the store keys requests per account.
pub fn app(pool: PgPool, config: Config) -> Router {
    router(store(pool, &config), config)
}

/// The service's router on `idempotency`, a store with [`configure`]'s settings, whose
/// pool the service's own queries share.
pub fn router(idempotency: Store, config: Config) -> Router {
    let pool = idempotency.pool().clone();
    let operators = Operators {
        admin: config.admin_token.clone(),
        readonly: config.admin_readonly_token.clone(),
    };
    let admin = (operators.admin.is_some() || operators.readonly.is_some())
        .then(|| admin(idempotency.clone(), operators, &config));
    let state = AppState {
        idempotency,
        pool,
        payments: config.payments.clone(),
        stripe: config.stripe.clone(),
        github: config.github.clone(),
        config: Arc::new(config),
    };
    let api = Router::new()
        .route("/charges", post(charge::create_charge))
        .route("/charges/{id}", get(charge::get_charge))
        .route("/charges/{id}/refunds", post(charge::create_refund))
        .layer(middleware::from_fn(authenticate));
    // The signature authenticates a webhook; the bearer middleware does not apply.
    let webhooks = Router::new()
        .route("/webhooks/payments", post(webhook::payment_event))
        .route("/webhooks/stripe", post(webhook::stripe_event))
        .route("/webhooks/github", post(webhook::github_event));
    let app = api
        .merge(webhooks)
        .route("/openapi.json", get(openapi::document))
        .with_state(state);
    match admin {
        // A nested router answers at its prefix, not at the prefix with a slash: the
        // console's address as people type it is sent there.
        Some(admin) => app.nest("/admin/idem", admin).route(
            "/admin/idem/",
            get(|| async { axum::response::Redirect::permanent("/admin/idem") }),
        ),
        None => app,
    }
}

/// `Authorization: Bearer <account>`, or 401. Runs before idem, so idem's principal
/// resolver always finds the account. A completion of a charge whose client went away
/// ([`idem::complete::Completion`], which only idem's completer can put on a request)
/// runs under the account its client had.
pub async fn authenticate(mut request: Request, next: Next) -> Response {
    if let Some(completion) = request.extensions().get::<idem::complete::Completion>() {
        let account = Account(completion.principal().unwrap_or_default().to_owned());
        request.extensions_mut().insert(account);
        return next.run(request).await;
    }
    let account = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|a| !a.is_empty() && a.len() <= 128 && a.bytes().all(|b| b.is_ascii_graphic()));
    let Some(account) = account else {
        let mut response = ApiError(
            Problem::new(
                StatusCode::UNAUTHORIZED,
                problem_type("unauthenticated"),
                "Unauthenticated",
            )
            .with_detail("send `Authorization: Bearer <account>`"),
        )
        .into_response();
        response
            .headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    };
    let account = Account(account.to_owned());
    request.extensions_mut().insert(account);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn db_pooler_is_session_unless_set_to_transaction() {
        assert_eq!(pooler_from_env(None), Ok(Pooler::Session));
        assert_eq!(pooler_from_env(Some("session")), Ok(Pooler::Session));
        assert_eq!(
            pooler_from_env(Some("transaction")),
            Ok(Pooler::Transaction)
        );
        for wrong in ["", "Transaction", "statement", "pgbouncer"] {
            let error = pooler_from_env(Some(wrong)).unwrap_err();
            assert!(
                error.starts_with("DB_POOLER must be \"session\"") && error.contains("transaction"),
                "{error}"
            );
        }
    }

    #[test]
    fn processor_url_unset_or_empty_calls_nobody() {
        assert!(processor_from_env(None, 10_000).unwrap().is_none());
        assert!(processor_from_env(Some(""), 10_000).unwrap().is_none());
        let processor = processor_from_env(Some("http://127.0.0.1:9000"), 2_500)
            .unwrap()
            .expect("a processor");
        assert_eq!(processor.timeout(), Duration::from_millis(2_500));
        let error = processor_from_env(Some("https://api.example.com"), 10_000).unwrap_err();
        assert!(error.contains("no TLS"), "{error}");
        let error = processor_from_env(Some("http://127.0.0.1:9000"), 0).unwrap_err();
        assert!(error.starts_with("PROCESSOR_TIMEOUT_MS"), "{error}");
    }

    #[test]
    fn admin_token_is_long_or_unset() {
        assert_eq!(admin_token_from_env("ADMIN_TOKEN", None), Ok(None));
        assert_eq!(
            admin_token_from_env("ADMIN_TOKEN", Some(String::new())),
            Ok(None)
        );
        let token = "0123456789abcdef".to_owned();
        assert_eq!(
            admin_token_from_env("ADMIN_TOKEN", Some(token.clone())),
            Ok(Some(token.clone()))
        );
        for wrong in ["admin", "0123456789 abcdef"] {
            let error =
                admin_token_from_env("ADMIN_READONLY_TOKEN", Some(wrong.into())).unwrap_err();
            assert!(error.starts_with("ADMIN_READONLY_TOKEN must be"), "{error}");
        }
        let other = "fedcba9876543210".to_owned();
        assert_eq!(
            admin_tokens_from_env(Some(token.clone()), Some(other.clone())),
            Ok((Some(token.clone()), Some(other.clone())))
        );
        assert_eq!(
            admin_tokens_from_env(None, Some(other.clone())),
            Ok((None, Some(other)))
        );
        let error = admin_tokens_from_env(Some(token.clone()), Some(token)).unwrap_err();
        assert_eq!(error, "ADMIN_READONLY_TOKEN must differ from ADMIN_TOKEN");
        assert!(admin::same(b"abc", b"abc"));
        assert!(!admin::same(b"abc", b"abd"));
        assert!(!admin::same(b"abc", b"ab"));
    }

    #[test]
    fn db_portable_is_false_unless_set_to_true() {
        assert_eq!(portable_from_env(None), Ok(false));
        assert_eq!(portable_from_env(Some("false")), Ok(false));
        assert_eq!(portable_from_env(Some("true")), Ok(true));
        for wrong in ["", "1", "yes", "citus"] {
            let error = portable_from_env(Some(wrong)).unwrap_err();
            assert!(error.starts_with("DB_PORTABLE must be \"true\""), "{error}");
        }
    }
}
