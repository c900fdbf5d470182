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

mod gate;
mod process;
mod report;
mod stand_in;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::{HeaderValue, Request};
use axum::Router;
use bytes::Bytes;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tower_service::Service;

use crate::complete::Completer;
use crate::failpoint::{Failpoints, Point};
use crate::operate::AbandonedFilter;
use crate::store::{Store, StoreBuilder};
use crate::web::response::IDEMPOTENT_REPLAYED;

pub use gate::Gate;
pub use report::{Broke, Finding, Report};
pub use stand_in::StandIn;

use process::Died;
use stand_in::Books;

type App = Arc<dyn Fn(Store) -> Router + Send + Sync>;
type MakeRequest = Arc<dyn Fn() -> Request<Body> + Send + Sync>;
type Configure = Arc<dyn Fn(StoreBuilder) -> StoreBuilder + Send + Sync>;
type Count =
    Arc<dyn Fn(PgPool) -> Pin<Box<dyn Future<Output = Result<i64, sqlx::Error>> + Send>> + Send + Sync>;

/// How long a process goes on after its job, so that the tasks it spawned do their work
/// before it stops (a write left to a spawned task is then counted when nothing dies).
const SETTLE: Duration = Duration::from_millis(100);
/// How long one process may take before the kit gives up on the request.
const PATIENCE: Duration = Duration::from_secs(60);
/// The largest answer body the kit reads.
const MAX_BODY: usize = 16 << 20;

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
            async move { sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql)).fetch_one(&pool).await }
        })
    }

    /// The sum of `column` over `table` (a balance an update changes twice, say), as a
    /// `bigint`.
    pub fn sum(table: &str, column: &str) -> Self {
        let sql = format!("SELECT coalesce(sum({column}), 0)::bigint FROM {table}");
        Self::counted(&format!("{table}.{column}"), move |pool| {
            let sql = sql.clone();
            async move { sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql)).fetch_one(&pool).await }
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
        let mut runner = Runner {
            gate: Gate::start(&self.pool.connect_options()).await,
            rng: Rng(seed),
            nonce: now_nanos(),
            keys: 0,
            histories: 0,
            kit: &self,
        };
        let mut findings = Vec::new();
        if let Err(error) = self.migrate().await {
            findings.push(Finding {
                request: "the store".into(),
                broke: Broke::Setup {
                    what: format!("idem's tables cannot be migrated: {error}"),
                },
                history: Vec::new(),
                advice: "check the store's settings and the test database".into(),
            });
        } else {
            for request in &self.requests {
                runner.prove(request, &mut findings).await;
            }
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
            histories: runner.histories,
            findings,
        }
    }

    async fn migrate(&self) -> Result<(), String> {
        let store = (self.configure)(Store::builder(self.pool.clone()))
            .build()
            .map_err(|e| e.to_string())?;
        store.migrate().await.map_err(|e| e.to_string())
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

/// What the kit counts, at one moment.
struct Counts {
    effects: Vec<i64>,
    outside: Vec<Books>,
}

/// One move of a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    /// The client sends the request; the process dies at the point's pass, if armed.
    Send { dies: Option<(Point, u32)> },
    /// A restarted instance's completer looks once; its process dies where armed.
    Complete { dies: Option<(Point, u32)> },
    /// Copies of the request at once, in one process.
    AtOnce(usize),
    /// The next version is deployed.
    Deploy,
    /// The database is unreachable while the client sends.
    Outage,
}

/// What one request does when nothing goes wrong.
struct Once {
    status: u16,
    effects: Vec<i64>,
    calls: Vec<usize>,
    outside_effects: Vec<u64>,
    /// The passes through each point ([`Point::ALL`]'s order).
    passes: Vec<u32>,
    /// The same, by the next version, where [`Kit::deploy`] gave one.
    next: Option<Box<Once>>,
}

impl Once {
    /// The least and the most one run changes a count by: this version's, or, in a
    /// history with a deploy, either version's (the next one may add a step).
    fn bounds<T: Ord + Copy>(&self, deploys: bool, of: impl Fn(&Once) -> T) -> (T, T) {
        let this = of(self);
        match (&self.next, deploys) {
            (Some(next), true) => {
                let next = of(next);
                (this.min(next), this.max(next))
            }
            _ => (this, this),
        }
    }
}

/// What a history did.
struct Outcome {
    words: Vec<String>,
    broke: Vec<Broke>,
    /// Calls of each stand-in in the history, with their keys.
    calls: Vec<Vec<Option<String>>>,
}

struct Runner<'k> {
    kit: &'k Kit,
    gate: Gate,
    rng: Rng,
    nonce: u64,
    keys: u64,
    histories: usize,
}

/// A process's answer: status, body, and whether it was a replay.
type Answer = (u16, Bytes, bool);

impl Runner<'_> {
    /// Runs the matrix and the seeded histories against `request`.
    async fn prove(&mut self, request: &MakeRequest, findings: &mut Vec<Finding>) {
        let name = {
            let r = request();
            format!("{} {}", r.method(), r.uri())
        };
        let mut once = self.once(request, false).await;
        if let (Ok(this), Some(_)) = (&mut once, &self.kit.deployed) {
            match self.once(request, true).await {
                Ok(next) => this.next = Some(Box::new(next)),
                Err(what) => once = Err(format!("by the next version: {what}")),
            }
        }
        let once = match once {
            Ok(once) => once,
            Err(what) => {
                findings.push(Finding {
                    request: name,
                    broke: Broke::Setup { what },
                    history: Vec::new(),
                    advice: "make the request succeed when sent once, with nothing going wrong"
                        .into(),
                });
                return;
            }
        };
        let mut found: Vec<(Vec<Move>, Outcome)> = Vec::new();
        for moves in self.matrix(&once) {
            let outcome = self.history(request, &once, &moves).await;
            if !outcome.broke.is_empty() {
                found.push((moves, outcome));
            }
        }
        for _ in 0..self.kit.histories {
            let moves = self.draw(&once);
            let outcome = self.history(request, &once, &moves).await;
            if !outcome.broke.is_empty() {
                let (moves, outcome) = self.shrink(request, &once, moves, outcome).await;
                found.push((moves, outcome));
            }
        }
        let mut kept: Vec<Finding> = Vec::new();
        for (moves, outcome) in found {
            for broke in &outcome.broke {
                let advice = self.advise(broke, &moves, &outcome);
                let finding = Finding {
                    request: name.clone(),
                    broke: broke.clone(),
                    history: outcome.words.clone(),
                    advice,
                };
                match kept.iter_mut().find(|k| k.broke.same_as(broke)) {
                    Some(k) if k.history.len() > finding.history.len() => *k = finding,
                    Some(_) => {}
                    None => kept.push(finding),
                }
            }
        }
        findings.extend(kept);
    }

    /// The request sent once, nothing going wrong: what every history is held to.
    async fn once(&mut self, request: &MakeRequest, deployed: bool) -> Result<Once, String> {
        self.histories += 1;
        let key = self.key();
        let before = self.kit.counts().await?;
        let failpoints = Arc::new(Failpoints::new());
        let (status, body, _) = self
            .send(request, &key, Arc::clone(&failpoints), deployed)
            .await
            .map_err(|died| match died {
                Died::At(point) => format!("it died {point} with nothing armed"),
                Died::NotStarted(what) => what,
            })?;
        let after = self.kit.counts().await?;
        if !(200..300).contains(&status) {
            return Err(format!(
                "sent once, it answered {}",
                answer_words(status, &body)
            ));
        }
        Ok(Once {
            status,
            effects: deltas(&before.effects, &after.effects),
            calls: before
                .outside
                .iter()
                .zip(&after.outside)
                .map(|(b, a)| a.calls.len() - b.calls.len())
                .collect(),
            outside_effects: before
                .outside
                .iter()
                .zip(&after.outside)
                .map(|(b, a)| a.effects - b.effects)
                .collect(),
            passes: Point::ALL.iter().map(|p| failpoints.passes(*p)).collect(),
            next: None,
        })
    }

    /// Every single fault: each send's copies, a death at each pass of each point the
    /// request passed with each way back, the deploy, the outage.
    fn matrix(&self, once: &Once) -> Vec<Vec<Move>> {
        let mut matrix = vec![
            vec![Move::Send { dies: None }],
            vec![Move::AtOnce(self.kit.at_once)],
        ];
        for (point, passes) in request_points(once) {
            for pass in 1..=passes {
                let dies = Some((point, pass));
                matrix.push(vec![Move::Send { dies }]);
                matrix.push(vec![Move::Send { dies }, Move::Complete { dies: None }]);
                if self.kit.deployed.is_some() && point != Point::AfterCommit {
                    matrix.push(vec![
                        Move::Send { dies },
                        Move::Deploy,
                        Move::Complete { dies: None },
                    ]);
                    matrix.push(vec![Move::Send { dies }, Move::Deploy]);
                }
            }
        }
        matrix.push(vec![Move::Outage]);
        matrix
    }

    /// A seeded history of up to three moves.
    fn draw(&mut self, once: &Once) -> Vec<Move> {
        let points: Vec<(Point, u32)> = request_points(once)
            .flat_map(|(point, passes)| (1..=passes).map(move |pass| (point, pass)))
            .collect();
        let len = 1 + self.rng.below(3) as usize;
        let mut moves = Vec::with_capacity(len);
        for _ in 0..len {
            let dies = if points.is_empty() || self.rng.below(3) == 0 {
                None
            } else {
                Some(points[self.rng.below(points.len() as u64) as usize])
            };
            let kinds = if self.kit.deployed.is_some() { 6 } else { 5 };
            moves.push(match self.rng.below(kinds) {
                0 | 1 => Move::Send { dies },
                2 => Move::Complete { dies },
                3 => Move::AtOnce(2),
                4 => Move::Outage,
                _ => Move::Deploy,
            });
        }
        moves
    }

    /// The shortest history found by leaving moves out of `moves` that still breaks the
    /// first property `outcome` broke.
    async fn shrink(
        &mut self,
        request: &MakeRequest,
        once: &Once,
        mut moves: Vec<Move>,
        mut outcome: Outcome,
    ) -> (Vec<Move>, Outcome) {
        let target = outcome.broke[0].clone();
        let mut at = 0;
        while at < moves.len() && moves.len() > 1 {
            let mut shorter = moves.clone();
            shorter.remove(at);
            let tried = self.history(request, once, &shorter).await;
            if tried.broke.iter().any(|b| b.same_as(&target)) {
                moves = shorter;
                outcome = tried;
            } else {
                at += 1;
            }
        }
        (moves, outcome)
    }

    fn key(&mut self) -> String {
        self.keys += 1;
        format!("idem-kit-{:x}-{}", self.nonce, self.keys)
    }

    /// Runs `moves`, then the client's last retry, and checks what they did against
    /// `once`.
    async fn history(&mut self, request: &MakeRequest, once: &Once, moves: &[Move]) -> Outcome {
        self.histories += 1;
        let key = self.key();
        let mut words = Vec::new();
        let mut broke = Vec::new();
        let mut finals: Vec<(u16, Bytes)> = Vec::new();
        let mut deployed = false;
        let mut lost_calls = 0usize;
        let before = match self.kit.counts().await {
            Ok(counts) => counts,
            Err(what) => return setup(what),
        };
        for m in moves {
            let failpoints = Arc::new(Failpoints::new());
            let armed = match m {
                Move::Send { dies } | Move::Complete { dies } => *dies,
                _ => None,
            };
            if let Some((point, pass)) = armed {
                failpoints.arm_at(point, pass);
            }
            let died = |point: Point| {
                format!(
                    "its process dies {point}{}",
                    armed.map_or(String::new(), |(_, pass)| ordinal(pass))
                )
            };
            match m {
                Move::Send { .. } => {
                    match self
                        .send(request, &key, Arc::clone(&failpoints), deployed)
                        .await
                    {
                        Ok((status, body, replayed)) => {
                            words.push(format!(
                                "the client sends the request: {}{}",
                                answer_words(status, &body),
                                replayed_words(replayed)
                            ));
                            finals.push((status, body));
                        }
                        Err(Died::At(point)) => {
                            words.push(format!("the client sends the request; {}", died(point)));
                            if point == Point::StepCalled {
                                lost_calls += 1;
                            }
                        }
                        Err(Died::NotStarted(what)) => return setup(what),
                    }
                }
                Move::Complete { .. } => match self.complete(Arc::clone(&failpoints), deployed).await {
                    Ok(Ok(n)) => words.push(format!(
                        "a restarted instance's completer looks, and completes {n} request{}",
                        if n == 1 { "" } else { "s" }
                    )),
                    Ok(Err(error)) => {
                        words.push(format!("a restarted instance's completer fails: {error}"))
                    }
                    Err(Died::At(point)) => {
                        words.push(format!(
                            "a restarted instance's completer looks; {}",
                            died(point)
                        ));
                        if point == Point::StepCalled {
                            lost_calls += 1;
                        }
                    }
                    Err(Died::NotStarted(what)) => return setup(what),
                },
                Move::AtOnce(copies) => match self.at_once(request, &key, *copies, deployed).await {
                    Ok(answers) => {
                        words.push(format!(
                            "the client sends {copies} copies at once: {}",
                            answers
                                .iter()
                                .map(|(s, _, r)| format!("{s}{}", replayed_words(*r)))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ));
                        finals.extend(answers.into_iter().map(|(s, b, _)| (s, b)));
                    }
                    Err(Died::At(point)) => {
                        return setup(format!("copies at once died {point} with nothing armed"))
                    }
                    Err(Died::NotStarted(what)) => return setup(what),
                },
                Move::Deploy => {
                    deployed = true;
                    words.push("the next version is deployed".into());
                }
                Move::Outage => {
                    let counted = match self.kit.counts().await {
                        Ok(counts) => counts,
                        Err(what) => return setup(what),
                    };
                    self.gate.shut().await;
                    let sent = self
                        .send(request, &key, Arc::clone(&failpoints), deployed)
                        .await;
                    self.gate.open().await;
                    let after = match self.kit.counts().await {
                        Ok(counts) => counts,
                        Err(what) => return setup(what),
                    };
                    let changed = changes(&counted, &after);
                    match sent {
                        Ok((status, body, _)) => {
                            words.push(format!(
                                "the database is unreachable while the client sends: {}",
                                answer_words(status, &body)
                            ));
                            if status != 503 {
                                broke.push(Broke::RanWithoutDatabase {
                                    what: format!("it answered {}", answer_words(status, &body)),
                                });
                            }
                        }
                        Err(Died::At(point)) => {
                            return setup(format!("the outage's send died {point} with nothing armed"))
                        }
                        Err(Died::NotStarted(what)) => return setup(what),
                    }
                    if let Some(changed) = changed {
                        broke.push(Broke::RanWithoutDatabase {
                            what: format!("{changed} changed"),
                        });
                    }
                }
            }
        }
        // Before the last retry: is what happened visible?
        let middle = match self.kit.counts().await {
            Ok(counts) => counts,
            Err(what) => return setup(what),
        };
        let listed = self.listed(&key).await;
        let last = self
            .send(request, &key, Arc::new(Failpoints::new()), deployed)
            .await;
        let (status, body, replayed) = match last {
            Ok(answer) => answer,
            Err(Died::At(point)) => return setup(format!("the last retry died {point} unarmed")),
            Err(Died::NotStarted(what)) => return setup(what),
        };
        words.push(format!(
            "the client retries: {}{}",
            answer_words(status, &body),
            replayed_words(replayed)
        ));
        let after = match self.kit.counts().await {
            Ok(counts) => counts,
            Err(what) => return setup(what),
        };
        let deploys = moves.contains(&Move::Deploy);
        let next_status = once.next.as_ref().map(|next| next.status);
        if status != once.status && !(deploys && next_status == Some(status)) {
            broke.push(Broke::NotCompleted {
                answer: answer_words(status, &body),
            });
        }
        finals.push((status, body));
        let settled: Vec<&(u16, Bytes)> = finals
            .iter()
            .filter(|(s, _)| *s != 409 && *s < 500)
            .collect();
        if let Some(first) = settled.first() {
            if let Some(then) = settled.iter().find(|a| **a != *first) {
                broke.push(Broke::AnswerChanged {
                    first: answer_words(first.0, &first.1),
                    then: answer_words(then.0, &then.1),
                });
            }
        }
        for (n, effect) in self.kit.effects.iter().enumerate() {
            let found = after.effects[n] - before.effects[n];
            let (least, most) = once.bounds(deploys, |o| o.effects[n]);
            if found > most {
                broke.push(Broke::EffectTwice {
                    effect: effect.name.clone(),
                    once: most,
                    found,
                });
            } else if found < least {
                broke.push(Broke::EffectLost {
                    effect: effect.name.clone(),
                    once: least,
                    found,
                });
            }
        }
        let mut calls = Vec::new();
        for (n, service) in self.kit.outside.iter().enumerate() {
            let (b, m, a) = (&before.outside[n], &middle.outside[n], &after.outside[n]);
            let made = a.effects - b.effects;
            let called = a.calls.len() - b.calls.len();
            let (least, most) = once.bounds(deploys, |o| o.outside_effects[n]);
            if made > most {
                broke.push(Broke::OutsideEffectTwice {
                    service: service.name().to_owned(),
                    once: most,
                    found: made,
                });
            } else if made < least {
                broke.push(Broke::OutsideEffectLost {
                    service: service.name().to_owned(),
                    once: least,
                    found: made,
                });
            }
            // A death between a step's call and its record is the one window where the
            // call is made again (with the same key): each allows one more.
            let (_, most) = once.bounds(deploys, |o| o.calls[n]);
            if called > most + lost_calls * most.max(1) {
                broke.push(Broke::OutsideCalledAgain {
                    service: service.name().to_owned(),
                    once: most,
                    found: called,
                });
            }
            let unrecorded = (m.calls.len() - b.calls.len()).saturating_sub(lost_calls);
            if unrecorded > 0 && !listed && !replayed {
                broke.push(Broke::Invisible {
                    service: service.name().to_owned(),
                });
            }
            calls.push(a.calls[b.calls.len()..].to_vec());
        }
        Outcome {
            words,
            broke,
            calls,
        }
    }

    /// Whether an operator sees `key` among the requests with a recorded step.
    async fn listed(&self, key: &str) -> bool {
        let Ok(store) = (self.kit.configure)(Store::builder(self.kit.pool.clone())).build() else {
            return false;
        };
        let filter = AbandonedFilter {
            key_prefix: Some(key.to_owned()),
            idle_for: Some(Duration::ZERO),
            ..AbandonedFilter::default()
        };
        store
            .abandoned_page(&filter, None, 10)
            .await
            .is_ok_and(|page| page.rows.iter().any(|r| r.key == key))
    }

    /// The process's store: on a pool of its own through the gate, with `failpoints`.
    fn store_maker(
        &self,
        failpoints: Arc<Failpoints>,
        connections: u32,
    ) -> impl FnOnce() -> Result<Store, String> + Send + 'static {
        let options = self
            .gate
            .options((*self.kit.pool.connect_options()).clone());
        let configure = Arc::clone(&self.kit.configure);
        move || {
            let pool = PgPoolOptions::new()
                .max_connections(connections)
                .connect_lazy_with(options);
            configure(Store::builder(pool))
                .acquire_timeout(Duration::from_millis(250))
                .failpoints(failpoints)
                .build()
                .map_err(|e| format!("the store cannot be built: {e}"))
        }
    }

    fn app(&self, deployed: bool) -> App {
        match (&self.kit.deployed, deployed) {
            (Some(next), true) => Arc::clone(next),
            _ => Arc::clone(&self.kit.app),
        }
    }

    /// One send of `request` with `key`, in a new process.
    async fn send(
        &self,
        request: &MakeRequest,
        key: &str,
        failpoints: Arc<Failpoints>,
        deployed: bool,
    ) -> Result<Answer, Died> {
        let store = self.store_maker(Arc::clone(&failpoints), 2);
        let app = self.app(deployed);
        let request = Arc::clone(request);
        let key = key.to_owned();
        in_process(failpoints, move || async move {
            let store = store()?;
            let router = app(store);
            Ok(call(router, keyed(&request, &key)?).await)
        })
        .await
    }

    /// `copies` sends of `request` at once, in one new process.
    async fn at_once(
        &mut self,
        request: &MakeRequest,
        key: &str,
        copies: usize,
        deployed: bool,
    ) -> Result<Vec<Answer>, Died> {
        let failpoints = Arc::new(Failpoints::new());
        let store = self.store_maker(Arc::clone(&failpoints), copies as u32 + 1);
        let app = self.app(deployed);
        let request = Arc::clone(request);
        let key = key.to_owned();
        let delays: Vec<u64> = (0..copies).map(|_| self.rng.below(3)).collect();
        in_process(failpoints, move || async move {
            let store = store()?;
            let router = app(store);
            let mut sends = tokio::task::JoinSet::new();
            for (n, delay) in delays.into_iter().enumerate() {
                let router = router.clone();
                let request = keyed(&request, &key)?;
                sends.spawn(async move {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    (n, call(router, request).await)
                });
            }
            let mut answers = Vec::new();
            while let Some(done) = sends.join_next().await {
                answers.push(done.map_err(|e| format!("a copy panicked: {e}"))?);
            }
            answers.sort_by_key(|(n, _)| *n);
            Ok(answers.into_iter().map(|(_, a)| a).collect())
        })
        .await
    }

    /// A restarted instance's completer, looking once: how many requests it completed.
    async fn complete(
        &self,
        failpoints: Arc<Failpoints>,
        deployed: bool,
    ) -> Result<Result<usize, String>, Died> {
        let store = self.store_maker(Arc::clone(&failpoints), 2);
        let app = self.app(deployed);
        in_process(failpoints, move || async move {
            let store = store()?;
            let router = app(store.clone());
            let completer = Completer::new(store, router)
                .after(Duration::ZERO)
                .backoff(Duration::from_millis(1), Duration::from_millis(1));
            Ok(completer
                .run_due()
                .await
                .map(|ran| ran.len())
                .map_err(|e| e.to_string()))
        })
        .await
    }

    /// What to change, for `broke` in the history `moves`.
    fn advise(&self, broke: &Broke, moves: &[Move], outcome: &Outcome) -> String {
        let deaths: Vec<Point> = moves
            .iter()
            .filter_map(|m| match m {
                Move::Send { dies: Some((p, _)) } | Move::Complete { dies: Some((p, _)) } => {
                    Some(*p)
                }
                _ => None,
            })
            .collect();
        let concurrent = moves.iter().any(|m| matches!(m, Move::AtOnce(_)));
        match broke {
            Broke::Setup { .. } => "make the request succeed when sent once".into(),
            Broke::EffectTwice { effect, .. } if concurrent && deaths.is_empty() => format!(
                "`{effect}` was written by more than one of the copies sent at once: write it through `tx` (`&mut *tx`), where idem's claim lets one copy run"
            ),
            Broke::EffectTwice { effect, .. } => format!(
                "`{effect}` was written again when the request ran again: its first write was not rolled back with the request. Write it through `tx` (`&mut *tx`), not through a pool, a connection of its own or a spawned task"
            ),
            Broke::EffectLost { effect, .. } => format!(
                "`{effect}` is missing though the request answered: a write left to a spawned task (or made after the answer) dies with its process. Make it in the handler, through `tx`"
            ),
            Broke::OutsideCalledAgain { service, .. } => format!(
                "the call to `{service}` happened again after a crash after it: make it a `tx.step`, whose recorded result a retry replays"
            ),
            Broke::OutsideEffectTwice { service, .. } => {
                let stand_in = self.kit.outside.iter().position(|s| s.name() == service);
                let keys: Vec<&Option<String>> = stand_in
                    .map(|n| outcome.calls[n].iter().collect())
                    .unwrap_or_default();
                let honours = stand_in.is_some_and(|n| self.kit.outside[n].honours_keys());
                if !honours && deaths.contains(&Point::StepCalled) {
                    format!(
                        "`{service}` ignores Idempotency-Key, so a death between its call and the step's record makes it act twice, and nothing in the handler can prevent it: use the service's own key, or reconcile with it"
                    )
                } else if keys.iter().any(|k| k.is_none()) {
                    format!(
                        "`{service}` was called without an Idempotency-Key: send the step's key (the argument `tx.step` gives its closure)"
                    )
                } else if keys.iter().collect::<std::collections::HashSet<_>>().len() > 1 {
                    format!(
                        "`{service}` was sent another Idempotency-Key when the call was made again: send the step's key (the argument `tx.step` gives its closure), not one of the handler's making"
                    )
                } else {
                    format!(
                        "`{service}` acted more than once: make the call a `tx.step` and send it the step's key"
                    )
                }
            }
            Broke::OutsideEffectLost { service, .. } => format!(
                "`{service}` was not called though the request answered: a call left to a spawned task dies with its process. Make it in the handler, as a `tx.step`"
            ),
            Broke::AnswerChanged { .. } => "a key's answer changed: is the handler `#[idempotent]`, and does the request reach it?".into(),
            Broke::NotCompleted { .. } => "a request the faults interrupted did not come back to its answer: see the history's last moves".into(),
            Broke::Invisible { service } => format!(
                "the call to `{service}` was made and nothing records it: no answer committed, no step for an operator to see. Make it a `tx.step`"
            ),
            Broke::RanWithoutDatabase { .. } => "with the database unreachable the request must not run: is the handler `#[idempotent]`, and does it take `Tx`?".into(),
        }
    }
}

/// Runs `job` in a new process, giving up after [`PATIENCE`].
async fn in_process<T, F, Fut>(failpoints: Arc<Failpoints>, job: F) -> Result<T, Died>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, String>> + 'static,
{
    match tokio::time::timeout(PATIENCE, process::run(failpoints, SETTLE, job)).await {
        Ok(Ok(Ok(done))) => Ok(done),
        Ok(Ok(Err(what))) => Err(Died::NotStarted(what)),
        Ok(Err(died)) => Err(died),
        Err(_) => Err(Died::NotStarted(format!(
            "a process took more than {} s",
            PATIENCE.as_secs()
        ))),
    }
}

/// `request()` with `key` as its `Idempotency-Key`.
fn keyed(request: &MakeRequest, key: &str) -> Result<Request<Body>, String> {
    let mut request = request();
    let value = HeaderValue::from_str(key).map_err(|e| e.to_string())?;
    request.headers_mut().insert("idempotency-key", value);
    Ok(request)
}

/// `router`'s answer to `request`.
async fn call(mut router: Router, request: Request<Body>) -> Answer {
    let response = match Service::call(&mut router, request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v == "true");
    let body = axum::body::to_bytes(response.into_body(), MAX_BODY)
        .await
        .unwrap_or_default();
    (status, body, replayed)
}

fn setup(what: String) -> Outcome {
    Outcome {
        words: Vec::new(),
        broke: vec![Broke::Setup { what }],
        calls: Vec::new(),
    }
}

/// The points a request passes (not an abandon's), with how often it passed each.
fn request_points(once: &Once) -> impl Iterator<Item = (Point, u32)> + '_ {
    Point::ALL
        .iter()
        .zip(&once.passes)
        .filter(|(point, passes)| **point != Point::BeforeUndo && **passes > 0)
        .map(|(point, passes)| (*point, *passes))
}

fn deltas(before: &[i64], after: &[i64]) -> Vec<i64> {
    before.iter().zip(after).map(|(b, a)| a - b).collect()
}

/// What changed between two counts, in words, if anything.
fn changes(before: &Counts, after: &Counts) -> Option<String> {
    let effects = before.effects != after.effects;
    let calls = before
        .outside
        .iter()
        .zip(&after.outside)
        .any(|(b, a)| b.calls.len() != a.calls.len());
    match (effects, calls) {
        (false, false) => None,
        (true, false) => Some("a counted effect".into()),
        (false, true) => Some("an outside service's calls".into()),
        (true, true) => Some("a counted effect and an outside service's calls".into()),
    }
}

fn answer_words(status: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text: String = text.chars().take(200).collect();
    if text.is_empty() {
        status.to_string()
    } else {
        format!("{status} {text}")
    }
}

fn replayed_words(replayed: bool) -> &'static str {
    if replayed {
        " (replayed)"
    } else {
        ""
    }
}

/// " (at its 2nd pass)" past the first.
fn ordinal(pass: u32) -> String {
    match pass {
        1 => String::new(),
        2 => " (at its 2nd pass)".into(),
        3 => " (at its 3rd pass)".into(),
        n => format!(" (at its {n}th pass)"),
    }
}

/// splitmix64: the run's draws, repeatable from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}
