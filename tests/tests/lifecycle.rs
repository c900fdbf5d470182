//! Every actor on a few keys, checked against a model (issue 48; RELIABILITY.md, "The
//! lifecycle of a key").
//!
//! A generated history (proptest: seeded, shrinking) drives three keys of one service
//! through interleavings of its actors: clients sending, retrying and sending twice at
//! once, their handler failing after its step (the client gone); the process dying at
//! each durable boundary ([`idem::failpoint::Point`]: after a step's call, after its
//! record, before and after COMMIT, before an undo), then restarted; the completer of
//! a restarted instance; an operator's complete, abandon and purge; a deploy that
//! reorders and adds `fields` and adds a step; the database unreachable while a client
//! sends (a TCP gate shut in front of it). The service calls a stand-in processor in a
//! step (it honours `Idempotency-Key`, and counts every call), writes a charge and emits
//! its event to the outbox; a compensation refunds.
//!
//! After each history, and after a final drain (handlers healed, the completer run until
//! nothing is due), the model checks, per key:
//!
//! - the charge is written at most once (once more after each purge, by the operator's
//!   decision), and at least once where the key answered 2xx;
//! - the processor (and the added step's service) is called at most once, plus once more
//!   for each death between a call and its record (the one window left, where the same
//!   key is sent again) and each purge;
//! - with the database unreachable, the answer is 503 and nothing runs;
//! - each charge's event is in the outbox once, and no request that did not commit
//!   wrote one;
//! - a refund only where the processor was called, at most once, and never beside a
//!   charge (one decision per key);
//! - every final answer (not a 409, not a 5xx) after the key's first is that one, byte
//!   for byte (until a purge);
//! - nothing is invisible: a key whose processor's call was recorded ends charged,
//!   answering 410, or listed by `Operate::abandoned` for an operator.
//!
//! The histories run in two topologies, each a test: the service directly on PostgreSQL,
//! and behind PgBouncer in transaction mode (`Pooler::Transaction`), the gate in front of
//! the pooler.
//!
//! A failure prints the shrunk history and the seed. CI runs `IDEM_MODEL_CASES` histories
//! (default 16) from a seed of the day's date unless `IDEM_MODEL_SEED` is set; long runs
//! by hand (RELIABILITY.md).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem::complete::Completer;
use idem::failpoint::{Failpoints, Point};
use idem::operate::Operator;
use idem::outbox::Event;
use idem::testing::Gate;
use idem::{idempotent, Pooler, Store, Tx};
use idem_tests::{with_test_db, Pgbouncer};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

const KEYS: u8 = 3;

/// What the service's outside world saw.
#[derive(Default)]
struct World {
    /// Every processor call, by the request's key.
    calls: HashMap<String, u32>,
    /// The processor's charges, by the key it was sent (it honours keys).
    charged: HashSet<String>,
    /// Every refund, by the request's key, with the key it was sent.
    refunds: HashMap<String, HashSet<String>>,
    /// Every receipt sent (the step the new version adds), by the request's key.
    receipts: HashMap<String, u32>,
}

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    world: Arc<Mutex<World>>,
    /// Whether the handler fails after its step (its client is gone).
    failing: Arc<Mutex<bool>>,
}

#[derive(Deserialize, Serialize)]
struct NewCharge {
    key: String,
    amount: i64,
    #[serde(default)]
    note: String,
}

async fn charge(
    tx: &mut Tx<'_>,
    state: &AppState,
    req: &NewCharge,
    receipt: bool,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    let world = Arc::clone(&state.world);
    let key = req.key.clone();
    let processor_id: String = tx
        .step("processor", |derived| async move {
            let mut world = world.lock().unwrap();
            *world.calls.entry(key).or_default() += 1;
            world.charged.insert(derived.clone());
            Ok::<_, std::convert::Infallible>(format!("ch_{}", &derived[..8]))
        })
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    if receipt {
        let world = Arc::clone(&state.world);
        let key = req.key.clone();
        tx.step("receipt", |_derived| async move {
            *world.lock().unwrap().receipts.entry(key).or_default() += 1;
            Ok::<_, std::convert::Infallible>(())
        })
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    }
    if *state.failing.lock().unwrap() {
        return Err(StatusCode::INTERNAL_SERVER_ERROR);
    }
    // Unnamed, as a statement behind a transaction pooler must be (the model also runs
    // there), and as it may be anywhere.
    sqlx::query("INSERT INTO charges (key, processor_id) VALUES ($1, $2)")
        .bind(&req.key)
        .bind(&processor_id)
        .persistent(false)
        .execute(&mut **tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let created = json!({ "key": req.key, "processor_id": processor_id });
    tx.emit(Event::new("charge.created", &created).ordering_key(req.key.clone()))
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(created)))
}

#[idempotent(scope = "charges", fields = [key, amount], completable = true)]
async fn charge_v1(
    State(state): State<AppState>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    charge(&mut tx, &state, &req, false).await
}

/// After the deploy: `fields` reordered and one added, and a step added after the
/// processor's.
#[idempotent(scope = "charges", fields = [amount, note, key], completable = true)]
async fn charge_v2(
    State(state): State<AppState>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    charge(&mut tx, &state, &req, true).await
}

/// One actor's move.
#[derive(Debug, Clone)]
enum Action {
    /// A client sends (or retries) `key`; its handler fails after the step unless
    /// healed; the process dies at `dies`, if the request passes it.
    Send {
        key: u8,
        healed: bool,
        dies: Option<Point>,
    },
    /// Two copies of `key`'s request at once.
    Twice { key: u8 },
    /// The completer of a (restarted) instance looks once; it dies before an undo, if
    /// one runs and `dies`.
    Complete { dies: bool },
    /// The completer looks while `key`'s client retries: the two race for the key, and
    /// their statements for the database's (and a pooler's) connections.
    Race { key: u8 },
    /// An operator gives `key` up for good.
    Abandon { key: u8 },
    /// An operator sends `key` to be completed now.
    CompleteNow { key: u8 },
    /// The new version is deployed.
    Deploy,
    /// An operator purges `key`'s record: its next request runs again, by that decision.
    Purge { key: u8 },
    /// The database is unreachable while `key`'s client sends.
    Outage { key: u8 },
}

fn action() -> impl Strategy<Value = Action> {
    let request_points = prop_oneof![
        Just(None),
        Just(None),
        Just(Some(Point::StepCalled)),
        Just(Some(Point::StepRecorded)),
        Just(Some(Point::BeforeCommit)),
        Just(Some(Point::AfterCommit)),
    ];
    prop_oneof![
        6 => (0..KEYS, any::<bool>(), request_points)
            .prop_map(|(key, healed, dies)| Action::Send { key, healed, dies }),
        1 => (0..KEYS).prop_map(|key| Action::Twice { key }),
        2 => any::<bool>().prop_map(|dies| Action::Complete { dies }),
        1 => (0..KEYS).prop_map(|key| Action::Race { key }),
        2 => (0..KEYS).prop_map(|key| Action::Abandon { key }),
        1 => (0..KEYS).prop_map(|key| Action::CompleteNow { key }),
        1 => Just(Action::Deploy),
        1 => (0..KEYS).prop_map(|key| Action::Purge { key }),
        1 => (0..KEYS).prop_map(|key| Action::Outage { key }),
    ]
}

/// One running instance of the service and what the model saw of it.
struct Service {
    store: Store,
    state: AppState,
    failpoints: Arc<Failpoints>,
    deployed: bool,
    /// Each key's first final answer (status, body), and every answer's status.
    finals: HashMap<String, (u16, Vec<u8>)>,
    answered_2xx: HashSet<String>,
    /// Deaths between a processor call and its record, by key.
    lost_calls: HashMap<String, u32>,
    /// Records an operator purged, by key: each lets the key run once more.
    purges: HashMap<String, u32>,
    /// Between the store and PostgreSQL: shut for an outage.
    gate: Gate,
    history: Vec<String>,
}

impl Service {
    fn router(&self) -> Router {
        let handler = if self.deployed {
            post(charge_v2)
        } else {
            post(charge_v1)
        };
        Router::new()
            .route("/charges", handler)
            .with_state(self.state.clone())
    }

    fn completer(&self) -> Completer {
        let world = Arc::clone(&self.state.world);
        Completer::new(self.store.clone(), self.router())
            .after(Duration::ZERO)
            .backoff(Duration::from_millis(1), Duration::from_millis(1))
            .max_attempts(2)
            .compensate("processor", move |undo| {
                let world = Arc::clone(&world);
                async move {
                    let processor_id: String = undo.result().map_err(|e| e.to_string())?;
                    let key = undo.idempotency_key().to_owned();
                    let mut world = world.lock().unwrap();
                    assert!(processor_id.starts_with("ch_"), "a refund of a charge");
                    world
                        .refunds
                        .entry(key)
                        .or_default()
                        .insert(undo.key().to_owned());
                    Ok::<_, String>(())
                }
            })
    }

    fn body(&self, key: &str) -> Value {
        json!({ "key": key, "amount": 100, "note": "" })
    }

    /// Runs `fut` as the process would: to its end, or until a failpoint makes it die,
    /// when it is dropped (its transaction rolls back) and `Err(point)` returned.
    async fn run<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, Point> {
        let task = tokio::spawn(fut);
        let died = self.failpoints.died();
        tokio::pin!(task);
        tokio::select! {
            done = &mut task => Ok(done.expect("no panic")),
            point = died => {
                task.abort();
                let _ = task.await;
                // The dropped transaction's ROLLBACK is sent by a task of its own.
                tokio::time::sleep(Duration::from_millis(20)).await;
                Err(point)
            }
        }
    }

    async fn send(&mut self, key: &str) -> Result<(u16, Vec<u8>), Point> {
        let request = Request::post("/charges")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(self.body(key).to_string()))
            .unwrap();
        let router = self.router();
        let response = self
            .run(router.oneshot(request))
            .await?
            .expect("infallible");
        let status = response.status().as_u16();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap()
            .to_vec();
        Ok((status, body))
    }

    /// Checks an answer of `key` against its first final one.
    fn answered(&mut self, key: &str, status: u16, body: Vec<u8>) -> Result<(), String> {
        if (200..300).contains(&status) {
            self.answered_2xx.insert(key.to_owned());
        }
        if status == 409 || status >= 500 {
            return Ok(());
        }
        match self.finals.get(key) {
            None => {
                self.finals.insert(key.to_owned(), (status, body));
                Ok(())
            }
            Some((first, first_body)) if *first == status && *first_body == body => Ok(()),
            Some((first, first_body)) => Err(format!(
                "{key} answered {status} {} after its first final answer {first} {}",
                String::from_utf8_lossy(&body),
                String::from_utf8_lossy(first_body)
            )),
        }
    }

    async fn act(&mut self, action: &Action) -> Result<(), String> {
        self.failpoints.disarm();
        let _ = self.failpoints.take_died();
        match action {
            Action::Send { key, healed, dies } => {
                let key = format!("k{key}");
                *self.state.failing.lock().unwrap() = !healed;
                if let Some(point) = dies {
                    self.failpoints.arm(*point);
                }
                match self.send(&key).await {
                    Ok((status, body)) => {
                        self.history.push(format!("{action:?} -> {status}"));
                        self.answered(&key, status, body)?;
                    }
                    Err(point) => {
                        self.history.push(format!("{action:?} -> died {point}"));
                        if point == Point::StepCalled {
                            *self.lost_calls.entry(key).or_default() += 1;
                        }
                    }
                }
            }
            Action::Twice { key } => {
                let key = format!("k{key}");
                *self.state.failing.lock().unwrap() = false;
                let (a, b) = {
                    let (first, second) = (self.send_detached(&key), self.send_detached(&key));
                    tokio::join!(first, second)
                };
                self.history
                    .push(format!("{action:?} -> {} and {}", a.0, b.0));
                self.answered(&key, a.0, a.1)?;
                self.answered(&key, b.0, b.1)?;
            }
            Action::Complete { dies } => {
                *self.state.failing.lock().unwrap() = false;
                if *dies {
                    self.failpoints.arm(Point::BeforeUndo);
                }
                let completer = self.completer();
                match self.run(async move { completer.run_due().await }).await {
                    Ok(ran) => self.history.push(format!("{action:?} -> {ran:?}")),
                    Err(point) => self.history.push(format!("{action:?} -> died {point}")),
                }
            }
            Action::Race { key } => {
                let key = format!("k{key}");
                *self.state.failing.lock().unwrap() = false;
                let completer = self.completer();
                let (ran, (status, body)) =
                    tokio::join!(completer.run_due(), self.send_detached(&key));
                let ran = ran.map_err(|e| format!("the completer's look failed: {e}"))?;
                self.history
                    .push(format!("{action:?} -> {ran:?} and {status}"));
                self.answered(&key, status, body)?;
            }
            Action::Abandon { key } => {
                let operator = self.store.operate().audited(Operator::new("ops", "model"));
                let marked = operator
                    .abandon_request("charges", "", &format!("k{key}"))
                    .await
                    .map_err(|e| e.to_string())?;
                self.history.push(format!("{action:?} -> {marked}"));
            }
            Action::CompleteNow { key } => {
                let operator = self.store.operate().audited(Operator::new("ops", "model"));
                let marked = operator
                    .complete_request("charges", "", &format!("k{key}"))
                    .await
                    .map_err(|e| e.to_string())?;
                self.history.push(format!("{action:?} -> {marked}"));
            }
            Action::Deploy => {
                self.deployed = true;
                self.history.push(format!("{action:?}"));
            }
            Action::Purge { key } => {
                let key = format!("k{key}");
                let operator = self.store.operate().audited(Operator::new("ops", "model"));
                let purged = operator
                    .purge_key("charges", "", &key)
                    .await
                    .map_err(|e| e.to_string())?;
                self.history.push(format!("{action:?} -> {purged}"));
                if purged > 0 {
                    *self.purges.entry(key.clone()).or_default() += 1;
                    self.finals.remove(&key);
                    self.answered_2xx.remove(&key);
                }
            }
            Action::Outage { key } => {
                let key = format!("k{key}");
                *self.state.failing.lock().unwrap() = false;
                self.gate.shut().await;
                let answer = self.send(&key).await;
                self.gate.open().await;
                self.history.push(format!("{action:?} -> {answer:?}"));
                match answer {
                    Ok((503, _)) => {}
                    Ok((status, body)) => {
                        return Err(format!(
                            "{key} answered {status} {} with the database unreachable",
                            String::from_utf8_lossy(&body)
                        ))
                    }
                    Err(point) => return Err(format!("{key} died at {point} unarmed")),
                }
            }
        }
        Ok(())
    }

    /// A send that no failpoint stops (none is armed while two run at once).
    async fn send_detached(&self, key: &str) -> (u16, Vec<u8>) {
        let request = Request::post("/charges")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(self.body(key).to_string()))
            .unwrap();
        let response = self.router().oneshot(request).await.expect("infallible");
        let status = response.status().as_u16();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap()
            .to_vec();
        (status, body)
    }

    /// Heals the handler, runs the completer until nothing is due, and asks each key
    /// once more; then checks what the world and the database hold against the model.
    async fn drain_and_check(&mut self, pool: &sqlx::PgPool) -> Result<(), String> {
        self.failpoints.disarm();
        *self.state.failing.lock().unwrap() = false;
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let ran = self
                .completer()
                .run_due()
                .await
                .map_err(|e| e.to_string())?;
            if ran.is_empty() {
                break;
            }
            self.history.push(format!("drain -> {ran:?}"));
        }
        let listed: HashSet<String> = self
            .store
            .operate()
            .abandoned(Duration::ZERO, 100)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|a| a.key)
            .collect();
        let (calls, refunds, receipts) = {
            let world = self.state.world.lock().unwrap();
            (
                world.calls.clone(),
                world.refunds.clone(),
                world.receipts.clone(),
            )
        };
        for n in 0..KEYS {
            let key = format!("k{n}");
            let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges WHERE key = $1")
                .bind(&key)
                .fetch_one(pool)
                .await
                .map_err(|e| e.to_string())?;
            let called = calls.get(&key).copied().unwrap_or(0);
            let lost = self.lost_calls.get(&key).copied().unwrap_or(0);
            let purges = self.purges.get(&key).copied().unwrap_or(0);
            let refunded = refunds.get(&key).map_or(0, HashSet::len);
            let receipted = receipts.get(&key).copied().unwrap_or(0);
            // Each purge lets the key run once more, by the operator's decision.
            let runs = 1 + i64::from(purges);
            if charges > runs {
                return Err(format!(
                    "{key}: charged {charges} times, with {purges} purges"
                ));
            }
            if self.answered_2xx.contains(&key) && charges == 0 {
                return Err(format!("{key}: answered 2xx with no charge"));
            }
            if called > 1 + lost + purges {
                return Err(format!(
                    "{key}: the processor was called {called} times, with {lost} deaths between a call and its record and {purges} purges"
                ));
            }
            if receipted > 1 + lost + purges {
                return Err(format!("{key}: {receipted} receipts sent"));
            }
            if refunded > 1 || (refunded == 1 && called == 0) {
                return Err(format!("{key}: {refunded} refunds for {called} calls"));
            }
            if purges == 0 && refunded == 1 && charges == 1 {
                return Err(format!("{key}: both charged and refunded"));
            }
            // Each committed charge wrote its event with it, and nothing else did.
            let events: i64 =
                sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE ordering_key = $1")
                    .bind(&key)
                    .fetch_one(pool)
                    .await
                    .map_err(|e| e.to_string())?;
            if events != charges {
                return Err(format!("{key}: {events} events for {charges} charges"));
            }
            // A request that recorded its call is committed, abandoned or listed; a call
            // whose record was lost (the one window left) has nothing to list, and one
            // that was refunded was abandoned, even where an operator purged the 410
            // since (the key is free again, by that decision).
            let status: Option<i16> = sqlx::query_scalar(
                "SELECT status FROM idempotency_keys WHERE scope = 'charges' AND key = $1",
            )
            .bind(&key)
            .fetch_optional(pool)
            .await
            .map_err(|e| e.to_string())?
            .flatten();
            let undone = u32::try_from(refunded).unwrap_or(u32::MAX);
            if called > lost + undone
                && charges == 0
                && status != Some(410)
                && !listed.contains(&key)
            {
                return Err(format!(
                    "{key}: its processor's call was recorded, and it is neither charged, \
                     abandoned, nor listed for an operator (its row's status: {status:?})"
                ));
            }
            // Its client, once more: the key's answer is the one it gave before, and a
            // retry never charges twice.
            if called > 0 {
                let (status, body) = self.send(&key).await.map_err(|p| p.to_string())?;
                self.answered(&key, status, body)?;
                let charges: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM charges WHERE key = $1")
                        .bind(&key)
                        .fetch_one(pool)
                        .await
                        .map_err(|e| e.to_string())?;
                if charges > runs || (self.answered_2xx.contains(&key) && charges == 0) {
                    return Err(format!("{key}: {charges} charges after its last retry"));
                }
            }
        }
        Ok(())
    }
}

/// Where the service reaches PostgreSQL.
#[derive(Debug, Clone, Copy)]
enum Topology {
    /// Directly.
    Direct,
    /// Through PgBouncer in transaction mode (four server connections for the store's
    /// eight), with `Pooler::Transaction`: where a statement's parse and its execute may
    /// reach two server connections (the completer's did).
    Pooler,
}

async fn history(actions: Vec<Action>, topology: Topology) -> Result<(), String> {
    let outcome = Arc::new(Mutex::new(Ok(())));
    let out = Arc::clone(&outcome);
    with_test_db(async move |db| {
        let pool = db.pool(12).await;
        sqlx::raw_sql(
            "CREATE TABLE charges (id bigserial PRIMARY KEY, key text NOT NULL, processor_id text NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let failpoints = Arc::new(Failpoints::new());
        // The gate stands where the network does: before the pooler, when there is one.
        let (bouncer, target, pooler) = match topology {
            Topology::Direct => (None, db.options.clone(), Pooler::Session),
            Topology::Pooler => {
                let bouncer = Pgbouncer::start(db);
                let options = bouncer.options().statement_cache_capacity(0);
                (Some(bouncer), options, Pooler::Transaction)
            }
        };
        let gate = Gate::start(&target).await;
        let gated = PgPoolOptions::new()
            .max_connections(8)
            .connect_lazy_with(gate.options(target));
        let store = Store::builder(gated)
            .pooler(pooler)
            .acquire_timeout(Duration::from_millis(250))
            .failpoints(Arc::clone(&failpoints))
            .step_timeout(Duration::from_secs(5))
            .build()
            .expect("a store");
        store.migrate().await.expect("migrate");
        let mut service = Service {
            state: AppState {
                store: store.clone(),
                world: Arc::default(),
                failing: Arc::default(),
            },
            store,
            failpoints,
            deployed: false,
            finals: HashMap::new(),
            answered_2xx: HashSet::new(),
            lost_calls: HashMap::new(),
            purges: HashMap::new(),
            gate,
            history: Vec::new(),
        };
        let mut result = Ok(());
        for action in &actions {
            if let Err(e) = service.act(action).await {
                result = Err(e);
                break;
            }
        }
        if result.is_ok() {
            result = service.drain_and_check(&pool).await;
        }
        if let Err(e) = &mut result {
            e.push_str(&format!("\nwhat happened:\n  {}", service.history.join("\n  ")));
        }
        *out.lock().unwrap() = result;
        drop(bouncer);
    })
    .await;
    let result = outcome.lock().unwrap().clone();
    result
}

#[test]
fn every_actor_on_a_key_keeps_the_model() {
    keeps_the_model(Topology::Direct);
}

#[test]
fn every_actor_on_a_key_keeps_the_model_behind_pgbouncer() {
    keeps_the_model(Topology::Pooler);
}

/// `IDEM_MODEL_CASES` generated histories in `topology`, from the seed of the day (or
/// `IDEM_MODEL_SEED`); a failure panics with the shrunk history.
fn keeps_the_model(topology: Topology) {
    let cases: u32 = std::env::var("IDEM_MODEL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(16);
    let seed: u64 = std::env::var("IDEM_MODEL_SEED")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() / 86_400)
        });
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases,
        max_shrink_iters: 200,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let histories = prop::collection::vec(action(), 1..12);
    let result = runner.run(&histories, |actions| {
        runtime
            .block_on(history(actions, topology))
            .map_err(TestCaseError::fail)
    });
    if let Err(failure) = result {
        panic!(
            "the model found a history that breaks it ({topology:?}, IDEM_MODEL_SEED={seed}):\n{failure}"
        );
    }
    println!("{cases} histories kept the model ({topology:?}, IDEM_MODEL_SEED={seed})");
}
