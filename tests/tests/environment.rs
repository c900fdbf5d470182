//! The environment suite (issue 37, invariant 12): the contract under what a database, a
//! role or a handler may set, generated rather than written case by case.
//!
//! Four axes: a setting (the output formats, `search_path`, the client's encoding, the
//! date, interval and time zone styles, `standard_conforming_strings = off`, the default
//! isolation and access mode of transactions, the three timeouts, and a role without the
//! privileges idem needs), who sets it (the database's default, the role's default in that
//! database, a handler's session-wide `SET`, a handler's `SET LOCAL`), the server encoding
//! (`UTF8`, `SQL_ASCII`, `LATIN1`) and the mode (the default, behind a PgBouncer of its
//! own in transaction mode, portable). A pairwise cover of them
//! ([`idem_tests::pairwise`]) gives 55 cells, and four more try the refusals of each request in every mode.
//!
//! Each cell has a database of its own in its encoding, its tables migrated by the
//! database's owner, and a service that connects as a role of its own (as services are
//! deployed: the owner migrates, the service's role reads and writes), granted what idem
//! and the handler need. The setting is set after the migration, then two instances of the
//! service start (one connection each, so that what a handler sets on its connection
//! reaches every later request of that instance): a warm-up request on each, both in
//! flight at once, so that a handler's session-wide `SET` is on every server connection
//! (behind the pooler, whose two server connections both run one), then the checks:
//!
//! - a fresh request answers 201, its retry replays it byte for byte with
//!   `Idempotent-Replayed: true`, and its effect, its event and its outside call happen
//!   once;
//! - the key with another payload gets 422;
//! - a copy sent while the first is in its handler gets 409, and the effect is once;
//! - a request that fails after its step (503) leaves no effect and no event, and its
//!   retry resumes after the recorded step: the outside call happens once.
//!
//! A cell either keeps all of that, or is refused where [`expect`] says, with one line that
//! names the setting: at start (`Store::verify`), or each request it reaches (500, an
//! ERROR event naming the setting, nothing written). Every cell runs, and the test fails
//! at the end with the list of cells that did otherwise and what they did.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use futures::stream::{self, StreamExt};
use idem::outbox::Event;
use idem::{idempotent, Pooler, Store, Tx};
use idem_tests::pairwise::{self, Axis, Choice};
use idem_tests::{admin_options, axis, Answer, ClosedSpans, Pgbouncer, TestApp, TestDb};
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use tokio::sync::Notify;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// What broke a promise, said.
type Broken = String;

macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err(format!($($arg)*));
        }
    };
}

axis! {
    /// What the environment changes.
    Setting as "setting" {
        /// Bytes as escapes instead of hex.
        ByteaEscape = "bytea_output=escape",
        /// Floats rounded in their text form.
        FloatDigits = "extra_float_digits=0",
        /// Another schema first, a tenant's, with the handler's table and idem's own.
        SearchPath = "search_path=tenant,public",
        /// The client's encoding, where sqlx asks for UTF8.
        ClientEncoding = "client_encoding=LATIN1",
        /// Dates written the SQL way, day first.
        DateStyle = "DateStyle=SQL,DMY",
        /// Intervals written the SQL standard's way.
        IntervalStyle = "IntervalStyle=sql_standard",
        /// A time zone 12:45 (or 13:45) from UTC.
        TimeZone = "TimeZone=Pacific/Chatham",
        /// Backslashes in plain string literals as escapes.
        NonStandardStrings = "standard_conforming_strings=off",
        /// Transactions serializable unless they say otherwise.
        Serializable = "default_transaction_isolation=serializable",
        /// Transactions read-only unless they say otherwise.
        ReadOnly = "default_transaction_read_only=on",
        /// Statements cancelled after 250 ms (every statement of a cell takes less).
        StatementTimeout = "statement_timeout=250ms",
        /// Lock waits cancelled after 100 ms.
        LockTimeout = "lock_timeout=100ms",
        /// Sessions idle in a transaction for 2 s ended (the slow handler idles 300 ms).
        IdleTimeout = "idle_in_transaction_session_timeout=2s",
        /// The service's role was granted the handler's tables, and only to read idem's.
        Privileges = "role without idem's privileges",
    }
}

axis! {
    /// Who sets it.
    Setter as "set by" {
        /// `ALTER DATABASE .. SET`.
        Database = "database",
        /// `ALTER ROLE .. IN DATABASE .. SET`.
        Role = "role",
        /// The handler, session-wide: `SET` (it stays on the connection).
        Handler = "handler SET",
        /// The handler, for its transaction: `SET LOCAL`.
        HandlerLocal = "handler SET LOCAL",
    }
}

axis! {
    /// The server encoding of the cell's database.
    Encoding as "encoding" {
        Utf8 = "UTF8",
        SqlAscii = "SQL_ASCII",
        Latin1 = "LATIN1",
    }
}

axis! {
    /// How the service reaches PostgreSQL, and how its store is built.
    Mode as "mode" {
        /// Directly, the default store.
        Default = "default",
        /// Through a PgBouncer of the cell's own in transaction mode,
        /// `Pooler::Transaction`.
        Pooler = "pooler",
        /// Directly, `portable()`.
        Portable = "portable",
    }
}

/// The axes, in the cover's order.
const AXES: [Axis; 4] = [Setting::AXIS, Setter::AXIS, Encoding::AXIS, Mode::AXIS];

/// Why two values cannot be configured together, or `None` when they can.
fn refuse(a: Choice, b: Choice) -> Option<&'static str> {
    let setting = [a, b]
        .into_iter()
        .find(|c| c.0 == 0)
        .map(|c| Setting::ALL[c.1]);
    let setter = [a, b]
        .into_iter()
        .find(|c| c.0 == 1)
        .map(|c| Setter::ALL[c.1]);
    match (setting, setter) {
        (Some(Setting::Privileges), Some(setter)) if setter != Setter::Role => {
            Some("privileges are granted to a role: no database default or handler sets them")
        }
        _ => None,
    }
}

/// One cell of the cover.
#[derive(Debug, Clone, Copy)]
struct Cell {
    n: usize,
    setting: Setting,
    setter: Setter,
    encoding: Encoding,
    mode: Mode,
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cell {:2} ({} by {}, {}, {})",
            self.n,
            self.setting.name(),
            self.setter.name(),
            self.encoding.name(),
            self.mode.name()
        )
    }
}

/// The cover's cells, then a cell for each mode the cover leaves a per-request refusal
/// untried in: a pair covers a refused setting in one mode only, and each mode refuses by
/// its own statements.
fn cells() -> (pairwise::Cover, Vec<Cell>) {
    let cover = pairwise::cover(&AXES, refuse);
    let mut cells: Vec<Cell> = cover
        .cells
        .iter()
        .enumerate()
        .map(|(n, c)| Cell {
            n,
            setting: Setting::ALL[c[0]],
            setter: Setter::ALL[c[1]],
            encoding: Encoding::ALL[c[2]],
            mode: Mode::ALL[c[3]],
        })
        .collect();
    for &setting in Setting::ALL {
        for &mode in Mode::ALL {
            let cell = Cell {
                n: cells.len(),
                setting,
                setter: Setter::Handler,
                encoding: Encoding::Utf8,
                mode,
            };
            let refused = matches!(expect(&cell), Expect::Refused(_));
            let tried = cells
                .iter()
                .any(|c| (c.setting, c.setter, c.mode) == (setting, Setter::Handler, mode));
            if refused && !tried {
                cells.push(cell);
            }
        }
    }
    (cover, cells)
}

impl Setting {
    /// The setting's name and value, as `SET` takes them; `None` for the privileges.
    fn assignment(self) -> Option<(&'static str, &'static str)> {
        Some(match self {
            Self::ByteaEscape => ("bytea_output", "escape"),
            Self::FloatDigits => ("extra_float_digits", "0"),
            Self::SearchPath => ("search_path", "tenant, public"),
            Self::ClientEncoding => ("client_encoding", "LATIN1"),
            Self::DateStyle => ("DateStyle", "SQL, DMY"),
            Self::IntervalStyle => ("IntervalStyle", "sql_standard"),
            Self::TimeZone => ("TimeZone", "Pacific/Chatham"),
            Self::NonStandardStrings => ("standard_conforming_strings", "off"),
            Self::Serializable => ("default_transaction_isolation", "serializable"),
            Self::ReadOnly => ("default_transaction_read_only", "on"),
            Self::StatementTimeout => ("statement_timeout", "250ms"),
            Self::LockTimeout => ("lock_timeout", "100ms"),
            Self::IdleTimeout => ("idle_in_transaction_session_timeout", "2s"),
            Self::Privileges => return None,
        })
    }

    /// The value as `SET` and `ALTER .. SET` take it: the path as a list, anything else
    /// quoted.
    fn value_sql(self, value: &str) -> String {
        if self == Self::SearchPath {
            value.to_owned()
        } else {
            format!("'{value}'")
        }
    }
}

/// What a cell is expected to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Keep the whole contract.
    Holds,
    /// `Store::verify` refuses to start, with a line naming this.
    RefusedAtStart(&'static str),
    /// Each keyed request after the warm-up answers 500 with an ERROR event naming this,
    /// and writes nothing.
    Refused(&'static str),
}

/// What each cell must do: the contract, or a refusal that names the setting.
fn expect(cell: &Cell) -> Expect {
    match (cell.setting, cell.setter) {
        (Setting::Privileges, _) => Expect::RefusedAtStart("privilege"),
        // The store's tables are named without their schema, resolved by the path of its
        // first claim; a connection whose path a handler changed for good would resolve
        // them elsewhere (the guide's "Topologies", "What idem needs of a session").
        (Setting::SearchPath, Setter::Handler) => Expect::Refused("search_path"),
        // A read-only database (or role) refuses idem's writes: a start refuses it. A
        // handler that makes its connection's later transactions read-only gets each
        // later request refused before it runs (a stored answer still replays).
        (Setting::ReadOnly, Setter::Database | Setter::Role) => {
            Expect::RefusedAtStart("default_transaction_read_only")
        }
        (Setting::ReadOnly, Setter::Handler) => Expect::Refused("read_only"),
        _ => Expect::Holds,
    }
}

// ---------------------------------------------------------------------------------------
// The service.

/// The step's answer, with characters outside ASCII (in `LATIN1` too).
const SAYS: &str = "Zoë paid 5 €";
/// How long the slow handler idles in its transaction.
const SLOW: Duration = Duration::from_millis(300);

#[derive(Clone)]
struct Handler {
    /// What the handler runs first, where the handler is the setter.
    set: Option<String>,
    /// Outside calls, by note text.
    calls: Arc<Mutex<HashMap<String, usize>>>,
    /// Told when a slow request is in its handler.
    started: Arc<Notify>,
}

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    handler: Handler,
}

#[derive(Debug, Deserialize)]
struct Note {
    text: String,
    /// Idle in the transaction for [`SLOW`], and say so ([`Handler::started`]).
    #[serde(default)]
    slow: bool,
    /// Idle for [`SLOW`] without saying so: the warm-up.
    #[serde(default)]
    warm: bool,
    #[serde(default)]
    fail: bool,
}

/// The setting (where the handler sets it), a step (the outside call, counted), a
/// business write, an event; slow or failing on request.
#[idempotent(scope = "notes", fields = [text])]
async fn note(
    State(handler): State<Handler>,
    mut tx: Tx,
    Json(note): Json<Note>,
) -> Result<(StatusCode, Json<Value>), (StatusCode, String)> {
    let failed = |e: String| (StatusCode::INTERNAL_SERVER_ERROR, e);
    if let Some(set) = &handler.set {
        sqlx::query(AssertSqlSafe(set.clone()))
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(|e| failed(e.to_string()))?;
    }
    let calls = Arc::clone(&handler.calls);
    let text = note.text.clone();
    let (call, says): (usize, String) = tx
        .step("processor", |_key| async move {
            let mut calls = calls.lock().unwrap();
            let n = calls.entry(text).or_default();
            *n += 1;
            Ok::<_, String>((*n, SAYS.to_owned()))
        })
        .await
        .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
    sqlx::query("INSERT INTO notes (text) VALUES ($1)")
        .bind(&note.text)
        .persistent(false)
        .execute(&mut *tx)
        .await
        .map_err(|e| failed(e.to_string()))?;
    tx.emit(Event::new("note.created", &json!({ "text": note.text })))
        .await
        .map_err(|e| failed(e.to_string()))?;
    if note.slow {
        handler.started.notify_one();
    }
    if note.slow || note.warm {
        tokio::time::sleep(SLOW).await;
    }
    if note.fail {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            "failed after the step".into(),
        ));
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "text": note.text, "call": call, "says": says })),
    ))
}

/// The ERROR events of every cell (one subscriber for the process).
fn errors() -> &'static ClosedSpans {
    static SPANS: OnceLock<ClosedSpans> = OnceLock::new();
    SPANS.get_or_init(|| {
        let spans = ClosedSpans::default();
        tracing_subscriber::registry().with(spans.clone()).init();
        spans
    })
}

/// A cell's database, its service's role, and the test's own connection as its owner.
struct Site {
    db: TestDb,
    /// The schema of the service's idem tables, and the other one ([`Site::home`]).
    home: (&'static str, &'static str),
    role: String,
    owner: PgPool,
    /// PgBouncer in front of it, as the role, in the pooler mode.
    bouncer: Option<Pgbouncer>,
}

/// One instance of the service.
struct Instance {
    app: TestApp,
}

impl Site {
    /// The database in the cell's encoding, migrated by its owner, the role granted what
    /// it needs (all but idem's writes for [`Setting::Privileges`]), then the setting.
    async fn create(cell: &Cell) -> Self {
        let db = match cell.encoding {
            Encoding::Utf8 => TestDb::create().await,
            Encoding::SqlAscii => TestDb::create_encoded("SQL_ASCII").await,
            Encoding::Latin1 => TestDb::create_encoded("LATIN1").await,
        };
        let role = format!("{}_svc", db.name);
        let owner = db.pool(2).await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE ROLE {role} LOGIN; \
             CREATE SCHEMA tenant; \
             CREATE TABLE public.notes (id bigserial PRIMARY KEY, text text NOT NULL); \
             CREATE TABLE tenant.notes (id bigserial PRIMARY KEY, text text NOT NULL)"
        )))
        .execute(&owner)
        .await
        .expect("the role and the handler's tables");
        // idem's tables in `public`, and a tenant's own in `tenant` (a schema per tenant):
        // a path that finds the tenant's first must not move a request's rows between
        // them.
        for table in ["public.idempotency_keys", "tenant.idempotency_keys"] {
            let mut store = Store::builder(owner.clone()).table(table);
            if cell.mode == Mode::Portable {
                store = store.portable(true);
            }
            store
                .build()
                .expect("the owner's store")
                .migrate()
                .await
                .expect("migrate");
        }
        let grant = if cell.setting == Setting::Privileges {
            format!(
                "GRANT USAGE ON SCHEMA public, tenant TO {role}; \
                 GRANT SELECT, INSERT ON public.notes, tenant.notes TO {role}; \
                 GRANT SELECT ON idempotency_keys, idempotency_steps, idem_outbox TO {role}; \
                 GRANT USAGE ON public.notes_id_seq, tenant.notes_id_seq TO {role}"
            )
        } else {
            format!(
                "GRANT USAGE ON SCHEMA public, tenant TO {role}; \
                 GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public, tenant \
                   TO {role}; \
                 GRANT USAGE ON ALL SEQUENCES IN SCHEMA public, tenant TO {role}"
            )
        };
        sqlx::raw_sql(AssertSqlSafe(grant))
            .execute(&owner)
            .await
            .expect("grant");
        if let Some((name, value)) = cell.setting.assignment() {
            let value = cell.setting.value_sql(value);
            let set = match cell.setter {
                Setter::Database => {
                    Some(format!("ALTER DATABASE {} SET {name} = {value}", db.name))
                }
                Setter::Role => Some(format!(
                    "ALTER ROLE {role} IN DATABASE {} SET {name} = {value}",
                    db.name
                )),
                Setter::Handler | Setter::HandlerLocal => None,
            };
            if let Some(set) = set {
                sqlx::raw_sql(AssertSqlSafe(set))
                    .execute(&owner)
                    .await
                    .expect("set the setting");
            }
        }
        let bouncer = (cell.mode == Mode::Pooler).then(|| {
            let as_role = TestDb {
                name: db.name.clone(),
                options: db.options.clone().username(&role),
            };
            // Three server connections: the warm-up's two, and one for a step's record
            // while both are held.
            Pgbouncer::start_sized(&as_role, 3)
        });
        Self {
            db,
            home: Self::home(cell),
            role,
            owner,
            bouncer,
        }
    }

    /// Where the service connects, as its role.
    fn service_options(&self) -> PgConnectOptions {
        match &self.bouncer {
            Some(bouncer) => bouncer.options().statement_cache_capacity(0),
            None => self.db.options.clone().username(&self.role),
        }
    }

    /// Starts an instance as a service starts: connect, build, verify, serve.
    async fn start(&self, cell: &Cell, handler: &Handler) -> Result<Instance, String> {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(self.service_options())
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut builder = Store::builder(pool.clone());
        builder = match cell.mode {
            Mode::Default => builder,
            Mode::Pooler => builder.pooler(Pooler::Transaction),
            Mode::Portable => builder.portable(true),
        };
        let store = builder.build().map_err(|e| format!("build: {e}"))?;
        store.verify().await.map_err(|e| format!("verify: {e}"))?;
        let router = Router::new()
            .route("/notes", post(note))
            .with_state(AppState {
                idempotency: store,
                handler: handler.clone(),
            });
        Ok(Instance {
            app: TestApp::serve(pool, router).await,
        })
    }

    /// The schema whose idem tables the service's unqualified names resolve to: the
    /// tenant's where the database's or the role's path puts it first, else `public`.
    fn home(cell: &Cell) -> (&'static str, &'static str) {
        match (cell.setting, cell.setter) {
            (Setting::SearchPath, Setter::Database | Setter::Role) => ("tenant", "public"),
            _ => ("public", "tenant"),
        }
    }

    /// How many times `text` was written by a handler, in either schema.
    async fn effects(&self, text: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM public.notes WHERE text = $1) \
                  + (SELECT count(*) FROM tenant.notes WHERE text = $1)",
        )
        .bind(text)
        .fetch_one(&self.owner)
        .await
        .expect("count the effects")
    }

    /// How many events name `text`, in the service's schema; `Err` when the other
    /// schema's outbox or key table holds a row: a request's rows moved.
    async fn events(&self, text: &str) -> Result<i64, Broken> {
        self.elsewhere().await?;
        let (home, _) = self.home;
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {home}.idem_outbox WHERE position($1 in payload) > 0"
        )))
        .bind(format!("\"text\":\"{text}\"").into_bytes())
        .fetch_one(&self.owner)
        .await
        .expect("count the events"))
    }

    /// How many key rows `key` has, in the service's schema.
    async fn key_rows(&self, key: &str) -> Result<i64, Broken> {
        self.elsewhere().await?;
        let (home, _) = self.home;
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {home}.idempotency_keys WHERE key = $1"
        )))
        .bind(key)
        .fetch_one(&self.owner)
        .await
        .expect("count the key rows"))
    }

    /// `Err` when idem's tables in the schema the service does not resolve hold a row.
    async fn elsewhere(&self) -> Result<(), Broken> {
        let (_, other) = self.home;
        let moved: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {other}.idempotency_keys) \
                  + (SELECT count(*) FROM {other}.idem_outbox) \
                  + (SELECT count(*) FROM {other}.idempotency_steps)"
        )))
        .fetch_one(&self.owner)
        .await
        .expect("count the other schema's rows");
        ensure!(
            moved == 0,
            "{moved} of idem's rows landed in {other}'s tables"
        );
        Ok(())
    }

    /// Drops the database and the role.
    async fn drop(self) {
        drop(self.bouncer);
        self.owner.close().await;
        let role = self.role.clone();
        self.db.drop_database().await.ok();
        if let Ok(mut admin) = PgConnection::connect_with(&admin_options()).await {
            sqlx::raw_sql(AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
                .execute(&mut admin)
                .await
                .ok();
            admin.close().await.ok();
        }
    }
}

// ---------------------------------------------------------------------------------------
// The checks.

fn said(answer: &Answer) -> String {
    format!(
        "{} {}",
        answer.status,
        String::from_utf8_lossy(&answer.body)
    )
}

struct Run<'a> {
    site: &'a Site,
    handler: &'a Handler,
    a: &'a Instance,
    b: &'a Instance,
}

impl<'a> Run<'a> {
    fn new(site: &'a Site, handler: &'a Handler, a: &'a Instance, b: &'a Instance) -> Self {
        Self {
            site,
            handler,
            a,
            b,
        }
    }

    /// The warm-up, then every check of the contract.
    async fn contract(&self) -> Result<(), Broken> {
        self.warm_up().await?;
        self.replay().await?;
        self.payload().await?;
        self.conflict().await?;
        self.resume().await
    }

    async fn send(instance: &Instance, key: &str, body: Value) -> Answer {
        instance.app.post("/notes", Some(key), &body).await
    }

    fn calls(&self, text: &str) -> usize {
        self.handler
            .calls
            .lock()
            .unwrap()
            .get(text)
            .copied()
            .unwrap_or(0)
    }

    /// Each of `text`'s effect, event and outside call happened `n` times.
    async fn once(&self, text: &str, n: i64, what: &str) -> Result<(), Broken> {
        let effects = self.site.effects(text).await;
        let events = self.site.events(text).await?;
        let calls = self.calls(text);
        ensure!(
            effects == n && events == n && calls == usize::try_from(n).unwrap_or(0),
            "{what}: {effects} effects, {events} events, {calls} outside calls, not {n} of each"
        );
        Ok(())
    }

    /// Both instances' connections through one request each, at once: a handler's
    /// session-wide `SET` is then on each (and on both of the pooler's server
    /// connections).
    async fn warm_up(&self) -> Result<(), Broken> {
        let (a, b) = tokio::join!(
            Self::send(self.a, "warm-a", json!({ "text": "warm-a", "warm": true })),
            Self::send(self.b, "warm-b", json!({ "text": "warm-b", "warm": true })),
        );
        for answer in [a, b] {
            ensure!(answer.status == 201, "the warm-up: {}", said(&answer));
        }
        Ok(())
    }

    async fn replay(&self) -> Result<(), Broken> {
        let first = Self::send(self.a, "k-replay", json!({ "text": "replay" })).await;
        ensure!(first.status == 201, "the first request: {}", said(&first));
        let retry = Self::send(self.a, "k-replay", json!({ "text": "replay" })).await;
        ensure!(
            retry.status == 201 && retry.replayed() && retry.body == first.body,
            "the retry: expected the replay of {}, got {}",
            said(&first),
            said(&retry)
        );
        let from_b = Self::send(self.b, "k-replay", json!({ "text": "replay" })).await;
        ensure!(
            from_b.replayed() && from_b.body == first.body,
            "the retry through the other instance: {}",
            said(&from_b)
        );
        let says = first.json()["says"].as_str().map(str::to_owned);
        ensure!(
            says.as_deref() == Some(SAYS),
            "the step's answer came back as {says:?}"
        );
        self.once("replay", 1, "after the retries").await
    }

    async fn payload(&self) -> Result<(), Broken> {
        let other = Self::send(self.a, "k-replay", json!({ "text": "another" })).await;
        ensure!(
            other.status == 422,
            "the key with another payload: {}",
            said(&other)
        );
        self.once("another", 0, "the other payload").await
    }

    async fn conflict(&self) -> Result<(), Broken> {
        let body = json!({ "text": "slow", "slow": true });
        let (first, copy) = tokio::join!(Self::send(self.a, "k-slow", body.clone()), async {
            self.handler.started.notified().await;
            Self::send(self.b, "k-slow", body.clone()).await
        });
        ensure!(first.status == 201, "the slow request: {}", said(&first));
        ensure!(
            copy.status == 409,
            "the copy in flight: expected 409, got {}",
            said(&copy)
        );
        self.once("slow", 1, "after the copy").await
    }

    async fn resume(&self) -> Result<(), Broken> {
        let failed = Self::send(self.a, "k-fail", json!({ "text": "fail", "fail": true })).await;
        ensure!(
            failed.status == 503,
            "the failing request: {}",
            said(&failed)
        );
        let effects = self.site.effects("fail").await + self.site.events("fail").await?;
        ensure!(
            effects == 0,
            "the failed request left {effects} effects and events"
        );
        let retry = Self::send(self.b, "k-fail", json!({ "text": "fail" })).await;
        ensure!(retry.status == 201, "its retry: {}", said(&retry));
        self.once("fail", 1, "after the retry").await
    }

    /// Requests the setting reaches: each answers 500, with an ERROR event that names
    /// `setting`, and writes nothing (no key row, no effect, no event, no outside call).
    /// Behind the pooler, a handler's session-wide `SET` is on the server connections that
    /// ran one, and a request may land on another: up to four are sent, and one at least
    /// must be refused; those not refused keep the contract's first promise.
    async fn refused(&self, setting: &str) -> Result<(), Broken> {
        let mut refusals = 0;
        for n in 0..4 {
            let (key, text) = (format!("k-refused-{n}"), format!("refused-{n}"));
            let before = errors().errors().len();
            let answer = Self::send(self.a, &key, json!({ "text": text })).await;
            if answer.status == 201 && self.site.bouncer.is_some() {
                self.once(&text, 1, "a request the setting did not reach")
                    .await?;
                continue;
            }
            ensure!(answer.status == 500, "expected 500, got {}", said(&answer));
            refusals += 1;
            // The ERROR events since this request was sent (other cells' among them).
            let named = errors().errors()[before..]
                .iter()
                .any(|e| e.0.values().any(|v| v.contains(setting)));
            ensure!(named, "no ERROR event names {setting}");
            ensure!(
                self.site.key_rows(&key).await? == 0,
                "the refused request wrote its key row"
            );
            self.once(&text, 0, "the refused request").await?;
        }
        ensure!(refusals > 0, "no request was refused");
        Ok(())
    }
}

/// Runs `cell`: `Ok` with what it did when that is what [`expect`] says, `Err` otherwise.
async fn run_cell(cell: Cell) -> Result<String, Broken> {
    let site = Site::create(&cell).await;
    let outcome = tokio::time::timeout(Duration::from_secs(60), check_cell(&cell, &site))
        .await
        .unwrap_or_else(|_| Err("did not finish within 60 s".to_owned()));
    site.drop().await;
    outcome
}

async fn check_cell(cell: &Cell, site: &Site) -> Result<String, Broken> {
    let expect = expect(cell);
    let set = match (cell.setting.assignment(), cell.setter) {
        (Some((name, value)), Setter::Handler) => {
            Some(format!("SET {name} = {}", cell.setting.value_sql(value)))
        }
        (Some((name, value)), Setter::HandlerLocal) => Some(format!(
            "SET LOCAL {name} = {}",
            cell.setting.value_sql(value)
        )),
        _ => None,
    };
    let handler = Handler {
        set,
        calls: Arc::default(),
        started: Arc::default(),
    };
    let started = tokio::try_join!(site.start(cell, &handler), site.start(cell, &handler));
    let (a, b) = match (started, expect) {
        (Err(error), Expect::RefusedAtStart(names)) => {
            ensure!(
                error.contains(names) && error.lines().count() == 1,
                "refused at start without naming {names}: {error}"
            );
            if cell.setting != Setting::Privileges {
                return Ok(format!("refused at start: {error}"));
            }
            // The line names the role, each table and the sequence, and the GRANT it
            // suggests is enough.
            for name in [
                site.role.as_str(),
                "idempotency_keys",
                "idem_outbox",
                "idempotency_steps",
                "idem_outbox_seq_seq",
            ] {
                ensure!(
                    error.contains(name),
                    "the refusal does not name {name}: {error}"
                );
            }
            let grant = error
                .split('`')
                .nth(1)
                .ok_or_else(|| format!("the refusal suggests no GRANT: {error}"))?;
            sqlx::raw_sql(AssertSqlSafe(grant.to_owned()))
                .execute(&site.owner)
                .await
                .map_err(|e| format!("the suggested {grant:?}: {e}"))?;
            let again = tokio::try_join!(site.start(cell, &handler), site.start(cell, &handler));
            let (a, b) = again.map_err(|e| format!("after the suggested GRANT: {e}"))?;
            Run::new(site, &handler, &a, &b).contract().await?;
            return Ok(format!(
                "refused at start, then kept the contract after its GRANT: {error}"
            ));
        }
        (Err(error), _) => return Err(format!("refused at start: {error}")),
        (Ok(_), Expect::RefusedAtStart(names)) => {
            return Err(format!(
                "started, where a start should refuse naming {names}"
            ))
        }
        (Ok(instances), _) => instances,
    };
    let run = Run::new(site, &handler, &a, &b);
    if let Expect::Refused(setting) = expect {
        run.warm_up().await?;
        run.refused(setting).await?;
        return Ok(format!("each request refused, naming {setting}"));
    }
    run.contract().await?;
    Ok("kept the contract".to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_environment_keeps_the_contract_or_names_what_it_refuses() {
    errors();
    let (cover, cells) = cells();
    println!("{cover}");
    let started = Instant::now();
    let outcomes: Vec<(Cell, Result<String, Broken>, f64)> = stream::iter(cells.clone())
        .map(|cell| async move {
            let at = Instant::now();
            let outcome = run_cell(cell).await;
            (cell, outcome, at.elapsed().as_secs_f64())
        })
        .buffer_unordered(4)
        .collect()
        .await;
    let mut broken = Vec::new();
    let mut outcomes = outcomes;
    outcomes.sort_by_key(|(cell, ..)| cell.n);
    for (cell, outcome, seconds) in &outcomes {
        match outcome {
            Ok(did) => println!("{cell}, {seconds:.1} s: {did}"),
            Err(why) => {
                println!("{cell}, {seconds:.1} s: BROKEN: {why}");
                broken.push(format!("{cell}: {why}"));
            }
        }
    }
    println!(
        "{} cells in {:.1} s",
        outcomes.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        broken.is_empty(),
        "{} of {} cells did not do what they should:\n  {}",
        broken.len(),
        cells.len(),
        broken.join("\n  ")
    );
}

/// The cover holds every allowed pair and no refused one, the same twice.
#[test]
fn the_cover_holds_every_allowed_pair() {
    let (cover, cells) = cells();
    let held: std::collections::HashSet<pairwise::Pair> = cover
        .cells
        .iter()
        .flat_map(|c| pairwise::pairs_of(c).collect::<Vec<_>>())
        .collect();
    for pair in pairwise::pairs(&AXES) {
        assert_eq!(
            held.contains(&pair),
            refuse(pair.0, pair.1).is_none(),
            "{pair:?}"
        );
    }
    assert_eq!(pairwise::cover(&AXES, refuse), cover, "deterministic");
    assert!(cells
        .iter()
        .all(|c| c.setting != Setting::Privileges || c.setter == Setter::Role));
}
