//! A test kit that proves a service's own handlers exactly-once (feature `testing`, for
//! `[dev-dependencies]`).
//!
//! idem keeps its promise only as far as the handler lets it: a handler that calls a
//! processor outside [`Tx::step`](crate::Tx::step), writes through the pool instead of
//! `tx`, sends the processor a key of its own making, or leaves a write to a spawned task
//! breaks exactly-once however correct idem is. [`Kit`] finds out in a `cargo test`: it
//! sends each of the service's requests once, twice and several times at once; makes the
//! process die at each durable point the request passes (after each step's call, after
//! its record, before and after COMMIT), then restarts it with the completer running or
//! the client retrying; deploys the other version of the handler, where given; cuts the
//! database away. It counts the effects the test names ([`Effect`]) and the calls of the
//! outside services it stands in for ([`StandIn`]), and reports each property that broke
//! with the shortest history that shows it and what to change ([`Report`]).
//!
//! The deaths are the failpoints of [`crate::failpoint`], the same that idem's own model
//! of a key's lifecycle drives. Each process of the service is a thread with a runtime of
//! its own, dropped where it dies: its open transaction rolls back with its connection,
//! and its spawned tasks go with it, as a real death takes them (after a settling time of
//! 100 ms, in which they run on: what a history leaves does not depend on timing). The database is reached
//! through a [`Gate`], which the outage shuts. Nothing is global: two kits run in
//! parallel, each on its own database.
//!
//! ```no_run
//! use axum::body::Body;
//! use axum::http::Request;
//! use axum::{routing::post, Json, Router};
//! use idem::testing::{Effect, Kit, StandIn};
//! use idem::{idempotent, Store, Tx};
//! use serde::Deserialize;
//! use serde_json::{json, Value};
//!
//! #[derive(Deserialize)]
//! struct NewCharge { amount: i64 }
//!
//! #[idempotent(scope = "charges", fields = [amount])]
//! async fn charge(mut tx: Tx, Json(req): Json<NewCharge>) -> Result<Json<Value>, String> {
//!     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
//!         .bind(req.amount)
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|e| e.to_string())?;
//!     Ok(Json(json!({ "amount": req.amount })))
//! }
//!
//! fn app(store: Store) -> Router {
//!     Router::new().route("/charges", post(charge)).with_state(store)
//! }
//!
//! # async fn f(pool: sqlx::PgPool) {
//! // `pool`: the test's own database, where `charges` is created.
//! let report = Kit::new(pool, app)
//!     .request(|| {
//!         Request::post("/charges")
//!             .header("content-type", "application/json")
//!             .body(Body::from(r#"{"amount": 100}"#))
//!             .unwrap()
//!     })
//!     .effect(Effect::rows("charges"))
//!     .run()
//!     .await;
//! report.assert_exactly_once();
//! # }
//! ```
//!
//! The book's chapter "Testing your handlers" has a complete test, with a step and a
//! stand-in processor, and says what each finding means.

mod attempt;
mod gate;
mod process;
mod report;
mod runner;
mod stand_in;
mod words;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::Request;
use axum::Router;
use sqlx::PgPool;

use crate::store::{Store, StoreBuilder};

pub use gate::Gate;
pub use report::{Broke, Finding, Report};
pub use stand_in::StandIn;

use attempt::Attempts;
use runner::{Counts, Rng, Runner};

type App = Arc<dyn Fn(Store) -> Router + Send + Sync>;
type MakeRequest = Arc<dyn Fn() -> Request<Body> + Send + Sync>;
type Configure = Arc<dyn Fn(StoreBuilder) -> StoreBuilder + Send + Sync>;
type Count = Arc<
    dyn Fn(PgPool) -> Pin<Box<dyn Future<Output = Result<i64, sqlx::Error>> + Send>> + Send + Sync,
>;

/// An effect the kit counts before and after each history: rows of a table, the sum of
/// a column, or any count over the test's pool. Exactly-once means it changes as much
/// in every history as when the request runs once.
pub struct Effect {
    name: String,
    count: Count,
}

impl Effect {
    /// The rows of `table` (its name written into `SELECT count(*) FROM ..` as given).
    pub fn rows(table: &str) -> Self {
        let sql = format!("SELECT count(*) FROM {table}");
        Self::counted(table, move |pool| {
            let sql = sql.clone();
            async move {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                    .fetch_one(&pool)
                    .await
            }
        })
    }

    /// The sum of `column` over `table` (a balance an update changes twice, say), as a
    /// `bigint`.
    pub fn sum(table: &str, column: &str) -> Self {
        let sql = format!("SELECT coalesce(sum({column}), 0)::bigint FROM {table}");
        Self::counted(&format!("{table}.{column}"), move |pool| {
            let sql = sql.clone();
            async move {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                    .fetch_one(&pool)
                    .await
            }
        })
    }

    /// Any count, named `name`, read by `count` from the test's pool.
    pub fn counted<F, Fut>(name: &str, count: F) -> Self
    where
        F: Fn(PgPool) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<i64, sqlx::Error>> + Send + 'static,
    {
        Self {
            name: name.to_owned(),
            count: Arc::new(move |pool| Box::pin(count(pool))),
        }
    }
}

impl std::fmt::Debug for Effect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Effect")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The kit, set up for one service: its router, the requests to send, what to count.
/// See [the module's docs](self).
pub struct Kit {
    pool: PgPool,
    app: App,
    deployed: Option<App>,
    requests: Vec<MakeRequest>,
    configure: Configure,
    effects: Vec<Effect>,
    outside: Vec<StandIn>,
    at_once: usize,
    histories: usize,
    seed: Option<u64>,
}

impl std::fmt::Debug for Kit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kit")
            .field("requests", &self.requests.len())
            .field("effects", &self.effects)
            .field("outside", &self.outside)
            .field("at_once", &self.at_once)
            .field("histories", &self.histories)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl Kit {
    /// A kit for the service `app` builds from a store, on the test database `pool`
    /// reaches. Each process of the service gets a store of its own, on a pool of its own
    /// to the same database (through the kit's [`Gate`]), and `app` builds its router
    /// from it: give the handlers their outside clients there, not from outside the
    /// closure, since each process's tasks die with it. `pool` is where the kit counts
    /// effects and migrates idem's tables.
    pub fn new<F>(pool: PgPool, app: F) -> Self
    where
        F: Fn(Store) -> Router + Send + Sync + 'static,
    {
        Self {
            pool,
            app: Arc::new(app),
            deployed: None,
            requests: Vec::new(),
            configure: Arc::new(|builder| builder),
            effects: Vec::new(),
            outside: Vec::new(),
            at_once: 4,
            histories: 8,
            seed: None,
        }
    }

    /// A request to prove, made afresh for each send; the kit sets its
    /// `Idempotency-Key`. Each request gets the whole matrix of faults.
    pub fn request<F>(mut self, request: F) -> Self
    where
        F: Fn() -> Request<Body> + Send + Sync + 'static,
    {
        self.requests.push(Arc::new(request));
        self
    }

    /// Sets the stores up as the service does (a portable store, another table); the
    /// kit then sets its failpoints and a 250 ms acquire timeout (its outage's 503).
    pub fn store<F>(mut self, configure: F) -> Self
    where
        F: Fn(StoreBuilder) -> StoreBuilder + Send + Sync + 'static,
    {
        self.configure = Arc::new(configure);
        self
    }

    /// An effect to count.
    pub fn effect(mut self, effect: Effect) -> Self {
        self.effects.push(effect);
        self
    }

    /// An outside service the handler calls, whose calls and effects to count.
    pub fn outside(mut self, service: &StandIn) -> Self {
        self.outside.push(service.clone());
        self
    }

    /// The service's next version (the attribute's `fields` as it has them, another
    /// step): requests that a process of this one left behind are then retried, and
    /// completed, by that one.
    pub fn deploy<F>(mut self, app: F) -> Self
    where
        F: Fn(Store) -> Router + Send + Sync + 'static,
    {
        self.deployed = Some(Arc::new(app));
        self
    }

    /// How many copies of a request are sent at once (default 4).
    pub fn at_once(mut self, copies: usize) -> Self {
        self.at_once = copies.max(2);
        self
    }

    /// How many seeded histories of several faults follow the matrix of single faults,
    /// per request (default 8).
    pub fn histories(mut self, histories: usize) -> Self {
        self.histories = histories;
        self
    }

    /// The seed of the run's draws (default: `IDEM_KIT_SEED`, else the clock's).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Runs every history against every request and reports what broke.
    pub async fn run(self) -> Report {
        let seed = self.seed.unwrap_or_else(|| {
            std::env::var("IDEM_KIT_SEED")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| now_nanos() % 1_000_000_007)
        });
        let mut findings = Vec::new();
        let mut histories = 0;
        match self.migrated().await {
            Ok(home) => {
                let mut runner = Runner {
                    attempts: Attempts {
                        kit: &self,
                        gate: Gate::start(&self.pool.connect_options()).await,
                    },
                    rng: Rng(seed),
                    nonce: now_nanos(),
                    keys: 0,
                    histories: 0,
                    kit: &self,
                    home,
                };
                for request in &self.requests {
                    runner.prove(request, &mut findings).await;
                }
                histories = runner.histories;
            }
            Err(error) => findings.push(Finding {
                request: "the store".into(),
                broke: Broke::Setup {
                    what: format!("idem's tables cannot be migrated: {error}"),
                },
                history: Vec::new(),
                advice: "check the store's settings and the test database".into(),
            }),
        }
        if self.requests.is_empty() {
            findings.push(Finding {
                request: "the kit".into(),
                broke: Broke::Setup {
                    what: "no request to send".into(),
                },
                history: Vec::new(),
                advice: "name at least one with `Kit::request`".into(),
            });
        }
        Report {
            seed,
            histories,
            findings,
        }
    }

    /// A store on the test's own pool, set up as the service's, with idem's tables
    /// migrated: where the kit reads what an operator would see.
    async fn migrated(&self) -> Result<Store, String> {
        let store = (self.configure)(Store::builder(self.pool.clone()))
            .build()
            .map_err(|e| e.to_string())?;
        store.migrate().await.map_err(|e| e.to_string())?;
        Ok(store)
    }

    async fn counts(&self) -> Result<Counts, String> {
        let mut effects = Vec::new();
        for effect in &self.effects {
            let n = (effect.count)(self.pool.clone())
                .await
                .map_err(|e| format!("the effect `{}` cannot be counted: {e}", effect.name))?;
            effects.push(n);
        }
        Ok(Counts {
            effects,
            outside: self.outside.iter().map(StandIn::books).collect(),
        })
    }
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}
