//! The completer: runs abandoned requests again through the application's router, and
//! abandons for good, with their compensations, those an operator gave up.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::Router;
use futures_core::future::BoxFuture;
use http::StatusCode;
use serde::de::DeserializeOwned;
use tower_service::Service;
use tracing::field::Empty;
use tracing::Instrument;

use super::Completion;
use crate::background::Stop;
use crate::engine::{self, Attempt, Begun, Claim, Committed, Refusal};
use crate::fingerprint::Fingerprint;
use crate::identity::{KeyInScope, Place};
use crate::store::Store;
use crate::table::audit::AuditWrite;
use crate::table::requests::{Due, Failure, Leased, StoredRequest};
use crate::table::steps::RecordedStep;
use crate::table::{Isolation, Record, ABANDONING};
use crate::web::problem::Problems;
use crate::web::response::{self, IDEMPOTENT_REPLAYED};
use crate::StepError;

/// A compensation's error, whatever its type, with its sources.
type UndoError = Box<dyn std::error::Error + Send + Sync>;

/// A step's undo, registered by the step's name ([`Completer::compensate`]).
type Compensation = Arc<dyn Fn(Undo) -> BoxFuture<'static, Result<(), UndoError>> + Send + Sync>;

/// What a compensation is given: the step it undoes, its recorded result, and a key of
/// its own to send the outside service (the same on every try, so a service that honours
/// keys undoes once).
#[derive(Debug, Clone)]
pub struct Undo {
    step: String,
    result: String,
    key: String,
    principal: Option<String>,
    idempotency_key: String,
}

impl Undo {
    /// The name of the step this undoes.
    pub fn step(&self) -> &str {
        &self.step
    }

    /// The step's recorded result, read as its type.
    pub fn result<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.result)
    }

    /// The key to send with the undo's own call (its `Idempotency-Key`): derived from the
    /// request's key and the undo's name, as [`Tx::derived_key`](crate::Tx::derived_key)
    /// derives a step's.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The request's principal; `None` for a key kept without one.
    pub fn principal(&self) -> Option<&str> {
        self.principal.as_deref()
    }

    /// The request's idempotency key.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }
}

/// How a completer's run of one request ended ([`Completer::run_due`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completed {
    /// The request committed: its answer is stored, and its client's retry replays it.
    Completed,
    /// The request was abandoned for good: the undos registered for its steps ran, and
    /// the key answers 410, naming any step that had none.
    Abandoned,
    /// The run failed; the request is tried again later. The error says why.
    Retrying(String),
    /// The run failed once too often: the request is parked as `failed`.
    Parked(String),
}

/// Runs the requests of completable endpoints whose clients went away: see
/// [the module](crate::complete).
///
/// ```no_run
/// # async fn f(store: idem::Store, app: axum::Router) {
/// use std::time::Duration;
/// use idem::complete::Completer;
///
/// let completer = Completer::new(store, app)
///     .after(Duration::from_secs(60))
///     .compensate("processor", |undo| async move {
///         // POST /v1/refunds with `Idempotency-Key: {undo.key()}`
///         Ok::<_, std::io::Error>(())
///     })
///     .spawn();
/// # }
/// ```
#[derive(Clone)]
pub struct Completer {
    store: Store,
    router: Router,
    after: Duration,
    every: Duration,
    backoff: (Duration, Duration),
    limit: u32,
    abandon_parked: bool,
    batch: u32,
    compensations: HashMap<String, Compensation>,
}

impl fmt::Debug for Completer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("after", &self.after)
            .field("every", &self.every)
            .field("backoff", &self.backoff)
            .field("limit", &self.limit)
            .field("compensations", &self.compensations.keys())
            .finish_non_exhaustive()
    }
}

impl Completer {
    /// A completer for `store`'s completable requests, run through `router`: the
    /// application's whole router, as it is served (with its state, its layers and its
    /// authentication, which lets a [`Completion`] through).
    pub fn new(store: Store, router: Router) -> Self {
        Self {
            store,
            router,
            after: Duration::from_secs(60),
            every: Duration::from_secs(1),
            backoff: (Duration::from_secs(1), Duration::from_secs(300)),
            limit: 5,
            abandon_parked: false,
            batch: 16,
            compensations: HashMap::new(),
        }
    }

    /// How long after its first step a request that has not committed is completed
    /// (default a minute): longer than a client's retries usually take, so that the
    /// completer finishes what its client gave up on, not what it is still retrying.
    pub fn after(mut self, after: Duration) -> Self {
        self.after = after;
        self
    }

    /// How often the completer looks for requests to run (default every second).
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(10));
        self
    }

    /// The wait before a failed run is tried again: `first`, doubled after each try up
    /// to `cap` (default one second up to five minutes).
    pub fn backoff(mut self, first: Duration, cap: Duration) -> Self {
        self.backoff = (first, cap.max(first));
        self
    }

    /// How many definitive failures park a request as `failed` (default 5). Transient
    /// ones (409, 429, 502, 503, 504, the database unreachable) never count.
    pub fn max_attempts(mut self, limit: u32) -> Self {
        self.limit = limit.max(1);
        self
    }

    /// Whether a request parked at the limit is abandoned for good at once, its steps'
    /// compensations run and its key answering 410 (default `false`: it waits as
    /// `failed` for an operator, who may fix the cause and complete it, or abandon it).
    pub fn abandon_parked(mut self, abandon: bool) -> Self {
        self.abandon_parked = abandon;
        self
    }

    /// How many requests one look takes at most (default 16).
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Registers the undo of the step `step` (as `tx.step(step, ..)` names it): run once,
    /// recorded as a step of its own (`compensate:<step>`), when a request that recorded
    /// that step is abandoned for good. `undo` gets the step's result and a key of its
    /// own ([`Undo`]); an `Err` is retried with the backoff, and logged and kept as the
    /// request's last error with its sources (any error, a `String` or a
    /// `Box<dyn Error + Send + Sync>`). Registered by name, so that a restarted service,
    /// or another instance, can run it.
    pub fn compensate<F, Fut, E>(mut self, step: &str, undo: F) -> Self
    where
        F: Fn(Undo) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<UndoError>,
    {
        let undo: Compensation = Arc::new(move |what: Undo| {
            let run = undo(what);
            Box::pin(async move { run.await.map_err(Into::into) })
        });
        self.compensations.insert(step.to_owned(), undo);
        self
    }

    /// Starts a tokio task that runs [`Completer::run_due`] every
    /// [`every`](Completer::every) until [`CompleterTask::stop`]. Failures (the database
    /// restarting) are logged and tried again at the next look.
    pub fn spawn(self) -> CompleterTask {
        let stop = Arc::new(Stop::default());
        let asked = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(self.every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !asked
                .tick_or_stop(async {
                    ticks.tick().await;
                })
                .await
            {
                if let Err(error) = self.run_due().await {
                    tracing::warn!(%error, "idem: looking for requests to complete failed; retrying at the next look");
                }
            }
        });
        CompleterTask { task, stop }
    }

    /// One look: runs each request that is due (older than the window and not
    /// committed, or abandoned by an operator), up to the batch, one at a time. Each is
    /// leased first, so that another completer skips it. Returns the runs, by key.
    pub async fn run_due(&self) -> Result<Vec<(String, Completed)>, sqlx::Error> {
        let pool = self.store.outside();
        let due = self
            .store
            .inner
            .requests
            .due(pool, self.after, self.batch)
            .await?;
        let mut ran = Vec::with_capacity(due.len());
        for due in due {
            if let Some(completed) = self.run_one(&due).await? {
                ran.push((due.key, completed));
            }
        }
        Ok(ran)
    }

    /// The lease of one run: longer than a step's call may take, and than a handler
    /// usually runs.
    fn lease(&self) -> Duration {
        (self.store.inner.step_timeout * 2).max(Duration::from_secs(60))
    }

    /// The wait after the `tries`th run.
    fn retry_in(&self, tries: i32) -> Duration {
        let (first, cap) = self.backoff;
        let doublings = u32::try_from(tries.saturating_sub(1)).unwrap_or(0).min(20);
        first.saturating_mul(1 << doublings).min(cap)
    }

    async fn run_one(&self, due: &Due) -> Result<Option<Completed>, sqlx::Error> {
        let requests = &self.store.inner.requests;
        let pool = self.store.outside();
        let stored = (due.scope.as_str(), due.principal.as_str(), due.key.as_str());
        let Some(leased) = requests.lease(pool, due, self.lease()).await? else {
            // Another completer took it, or it committed meanwhile.
            return Ok(None);
        };
        let (scope, principal, key) = stored;
        let principal_type = self.store.inner.dialect.principal_type;
        let key_in_scope = KeyInScope::from_stored(scope, principal, key, principal_type.bound(""));
        let action = if leased.abandoning {
            "abandon"
        } else {
            "complete"
        };
        let span = tracing::info_span!(
            "idem.complete",
            scope = &*key_in_scope.scope,
            key,
            action,
            outcome = Empty,
        );
        async {
            let run = if leased.abandoning {
                self.abandon(&key_in_scope, &leased).await
            } else {
                self.complete(&key_in_scope, stored, leased.request.clone())
                    .await
            };
            let completed = match run {
                Run::Done(completed) => completed,
                Run::Failed { error, counted } => {
                    let failure = Failure {
                        error: &error,
                        counted,
                        retry_in: self.retry_in(leased.tries),
                        limit: self.limit,
                        abandon_parked: self.abandon_parked,
                        tries: leased.tries,
                    };
                    let left = requests.failed(pool, stored, &failure).await?;
                    // An abandon that failed is tried again: it is never parked.
                    let parked = !leased.abandoning
                        && matches!(left.as_deref(), Some("failed" | "abandoning"));
                    if parked {
                        Completed::Parked(error)
                    } else {
                        Completed::Retrying(error)
                    }
                }
            };
            let outcome = match &completed {
                Completed::Completed => "completed",
                Completed::Abandoned => "abandoned",
                Completed::Retrying(_) => "retrying",
                Completed::Parked(_) => "parked",
            };
            tracing::Span::current().record("outcome", outcome);
            crate::observe::metrics::completion(&key_in_scope.scope, outcome);
            match &completed {
                Completed::Completed => {
                    tracing::info!(scope, key, outcome, "idem: completed a request its client abandoned");
                }
                // Its own line, naming what was undone and what was not.
                Completed::Abandoned => {}
                Completed::Retrying(error) => {
                    tracing::warn!(scope, key, %error, "idem: a request's {action} failed; it is tried again later");
                }
                Completed::Parked(error) if self.abandon_parked => {
                    tracing::error!(scope, key, %error, "idem: a request's completion failed too often; it is abandoned: its steps' compensations run");
                }
                Completed::Parked(error) => {
                    tracing::error!(scope, key, %error, "idem: a request's completion failed too often; parked as failed (`idem key abandoned` lists it, `idem key abandon` gives it up)");
                }
            }
            Ok(Some(completed))
        }
        .instrument(span)
        .await
    }

    /// Runs the stored request through the router, as its client sent it, under its
    /// principal.
    async fn complete(
        &self,
        key: &KeyInScope,
        (scope, principal, stored_key): (&str, &str, &str),
        request: Option<StoredRequest>,
    ) -> Run {
        let Some(request) = request else {
            return Run::Failed {
                error: "its endpoint stores no request (it is not `completable`): it can only be abandoned".into(),
                counted: true,
            };
        };
        let mut builder = http::Request::builder()
            .method(request.method.as_str())
            .uri(&request.target);
        for (name, value) in &request.headers {
            builder = builder.header(name, value);
        }
        let mut req = match builder.body(Body::from(request.body)) {
            Ok(req) => req,
            Err(error) => {
                return Run::Failed {
                    error: format!("the stored request cannot be rebuilt: {error}"),
                    counted: true,
                }
            }
        };
        req.extensions_mut().insert(Completion {
            stored_scope: scope.to_owned(),
            scope: key.scope.to_string(),
            stored_principal: principal.to_owned(),
            principal: (key.place == Place::Principal).then(|| key.principal.clone()),
            key: stored_key.to_owned(),
        });
        // A task of its own: a handler that panics fails this run, not the completer.
        let mut router = self.router.clone();
        let call = tokio::spawn(async move {
            std::future::poll_fn(|cx| Service::<http::Request<Body>>::poll_ready(&mut router, cx))
                .await?;
            router.call(req).await
        });
        let response = match call.await {
            Ok(Ok(response)) => response,
            Ok(Err(never)) => match never {},
            Err(error) => {
                return Run::Failed {
                    error: format!("the handler panicked: {error}"),
                    counted: true,
                }
            }
        };
        let status = response.status();
        let replayed = response
            .headers()
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v == "true");
        // The request's COMMIT deleted its stored copy; a replay means another attempt
        // committed it.
        let pool = self.store.outside();
        let requests = &self.store.inner.requests;
        match requests.state(pool, (scope, principal, stored_key)).await {
            Ok(None) => return Run::Done(Completed::Completed),
            Ok(Some(_)) if replayed => return forgotten(requests.forget(pool, key).await),
            Ok(Some(_)) => {}
            Err(error) => {
                return Run::Failed {
                    error: error.to_string(),
                    counted: false,
                }
            }
        }
        let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
            .await
            .unwrap_or_default();
        let mut detail = String::from_utf8_lossy(&body).into_owned();
        if detail.len() > 300 {
            let cut = (0..=300)
                .rev()
                .find(|i| detail.is_char_boundary(*i))
                .unwrap_or(0);
            detail.truncate(cut);
            detail.push_str("...");
        }
        Run::Failed {
            error: format!("answered {status}: {detail}"),
            counted: !transient(status),
        }
    }

    /// Abandons the request for good (invariant 14). First the decision, durable under the
    /// key before any undo runs: claimed like any request, the key commits the abandoning
    /// marker ([`ABANDONING`]), and from then on every claim of it, its own client's
    /// included, is answered 409 `request-abandoning`; a request that committed first
    /// (its client's retry, a completion) is left as it is, with nothing to undo. Then,
    /// holding the marker, the undo of each recorded step, the last step's first (as a
    /// saga undoes), each a step of its own (`compensate:<step>`: a run that dies after
    /// one does not repeat it); a failing undo is tried again with the backoff, the key
    /// still answering 409. Last, the key's 410 over the marker, naming the steps undone
    /// and those that had no undo registered (nothing claims an undo that did not run),
    /// with the steps and the stored request deleted, in one COMMIT; then one log line
    /// and an `abandoned` audit row saying the same.
    async fn abandon(&self, key: &KeyInScope, leased: &Leased) -> Run {
        let store = &self.store;
        let Ok(combined) = <[u8; 32]>::try_from(leased.fingerprint.as_slice()) else {
            return Run::Failed {
                error: "the stored fingerprint is unreadable".into(),
                counted: true,
            };
        };
        let claim = Claim {
            key: key.clone(),
            ttl: leased.remaining,
            fingerprint: Fingerprint::stored(combined, &leased.field_hashes),
            conflict_wait: None,
            statement_timeout: None,
        };
        let fingerprint = claim.fingerprint.clone();
        let retry = |error: String| Run::Failed {
            error,
            counted: false,
        };
        if let Some(ended) = self.decide(key, &claim).await {
            return ended;
        }
        let mut attempt = match engine::hold_abandoning(store, claim).await {
            Ok(Some(attempt)) => attempt,
            // Another run ended it.
            Ok(None) => return forgotten(store.inner.requests.forget(store.outside(), key).await),
            Err(refusal) => {
                return retry(format!("its key cannot be held: {}", describe(&refusal)))
            }
        };
        let recorded = match store.steps().read(store.outside(), key).await {
            Ok(recorded) => recorded,
            Err(error) => {
                let _ = attempt.rollback().await;
                return retry(error.to_string());
            }
        };
        let (undone, not_undone) = match self.undo(&mut attempt, key, &fingerprint, &recorded).await
        {
            Ok(done) => done,
            Err(failed) => {
                let _ = attempt.rollback().await;
                return failed;
            }
        };
        {
            let mut tx = attempt.tx();
            let (_, state) = tx.parts();
            state.ride(store.steps().forgetting(store.inner.table.prepared(), key));
            state.ride(store.inner.requests.forgetting(key));
        }
        let problem = Problems::of(store)
            .request_abandoned(&undone, &not_undone)
            .into_response();
        let record = match response::capture(
            problem,
            Some(&store.inner.replay_headers),
            store.inner.max_response_bytes,
        )
        .await
        {
            Ok((record, _, _)) => record,
            Err(error) => {
                let _ = attempt.rollback().await;
                return Run::Failed {
                    error: error.to_string(),
                    counted: true,
                };
            }
        };
        if let Err(error) = attempt.commit_abandoned(&record).await {
            return retry(format!("the abandonment could not commit: {error:?}"));
        }
        let scope = &*key.scope;
        let idempotency_key = key.key.as_str();
        if not_undone.is_empty() {
            tracing::info!(scope, key = idempotency_key, ?undone, "idem: abandoned a request for good: the undo of each of its steps ran; its key answers 410");
        } else {
            tracing::warn!(scope, key = idempotency_key, ?undone, ?not_undone, "idem: abandoned a request for good, but NOT the work of its steps without a registered undo (`Completer::compensate`); its key answers 410, which names them");
        }
        self.audit_abandoned(key, &undone, &not_undone).await;
        Run::Done(Completed::Abandoned)
    }

    /// An abandon's decision: the abandoning marker committed under the key, or found
    /// there from an earlier run (`None`: go on to the undos); or how the run ended
    /// (another attempt committed the key first, or it cannot be claimed now).
    async fn decide(&self, key: &KeyInScope, claim: &Claim) -> Option<Run> {
        let store = &self.store;
        match engine::begin(store, Some(claim.clone()), Isolation::ReadCommitted).await {
            Ok(Begun::Run(attempt)) => {
                let marker = Record {
                    status: ABANDONING,
                    headers: Vec::new(),
                    body: bytes::Bytes::new(),
                };
                match attempt.commit(&marker).await {
                    Ok(Committed::Stored) => {}
                    // Another attempt committed the key first: its answer stands.
                    Ok(Committed::Superseded(_)) => {
                        return Some(forgotten(
                            store.inner.requests.forget(store.outside(), key).await,
                        ))
                    }
                    Err(error) => {
                        return Some(Run::Failed {
                            error: format!("the abandon could not be decided: {error:?}"),
                            counted: false,
                        })
                    }
                }
            }
            // Its client's retry, or a completion, committed it first: its answer
            // stands, and there is nothing to undo.
            Ok(Begun::Replay(_)) => {
                return Some(forgotten(
                    store.inner.requests.forget(store.outside(), key).await,
                ))
            }
            // Decided by an earlier run, which did not finish its undos.
            Err(Refusal::Abandoning) => {}
            Err(refusal) => {
                let counted = !matches!(refusal, Refusal::InUse | Refusal::Unavailable(_));
                return Some(Run::Failed {
                    error: format!("its key cannot be claimed: {}", describe(&refusal)),
                    counted,
                });
            }
        }
        None
    }

    /// The undo of each of `recorded`'s steps under the held marker, the last step's
    /// first, each a step of its own: the steps undone, and those with no undo
    /// registered; or how the run failed (the caller rolls back).
    async fn undo(
        &self,
        attempt: &mut Attempt,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        recorded: &[RecordedStep],
    ) -> Result<(Vec<String>, Vec<String>), Run> {
        let store = &self.store;
        let (mut undone, mut not_undone) = (Vec::new(), Vec::new());
        // The steps as they were recorded, the last first.
        for step in recorded.iter().rev() {
            if step.step.starts_with(COMPENSATE)
                || !fingerprint.matches(&step.fingerprint, &step.field_hashes)
            {
                continue;
            }
            let Some(undo) = self.compensations.get(&step.step) else {
                not_undone.push(step.step.clone());
                continue;
            };
            let name = format!("{COMPENSATE}{}", step.step);
            let what = Undo {
                step: step.step.clone(),
                result: step.result.clone(),
                key: String::new(),
                principal: (key.place == Place::Principal).then(|| key.principal.clone()),
                idempotency_key: key.key.as_str().to_owned(),
            };
            store.failpoint(crate::failpoint::Point::BeforeUndo).await;
            let span = tracing::info_span!("idem.compensate", step = %step.step);
            let ran = attempt
                .tx()
                .step(&name, |derived| {
                    undo(Undo {
                        key: derived,
                        ..what
                    })
                })
                .instrument(span)
                .await;
            if let Err(error) = ran {
                return Err(Run::Failed {
                    error: format!(
                        "the compensation of step {:?} failed: {}",
                        step.step,
                        told(&error)
                    ),
                    counted: true,
                });
            }
            undone.push(step.step.clone());
        }
        Ok((undone, not_undone))
    }

    /// The `abandoned` audit row of an abandon that committed, naming what it undid and
    /// what it did not: written after its COMMIT, by itself (a failure is logged; the
    /// abandon stands).
    async fn audit_abandoned(&self, key: &KeyInScope, undone: &[String], not_undone: &[String]) {
        let inner = &self.store.inner;
        let mut filter = format!("scope {:?}", &*key.scope);
        if key.place == Place::Principal {
            filter.push_str(&format!(", principal {:?}", key.principal));
        }
        filter.push_str(&format!(
            ", key {:?}; undone: {undone:?}; not undone (no undo registered): {not_undone:?}",
            key.key.as_str()
        ));
        let row = AuditWrite {
            operator: "completer",
            via: "idem::complete",
            action: "abandoned",
            filter: &filter,
            rows: 1,
        };
        let written = async {
            let mut conn = inner.table.single(&inner.pool).await?;
            inner
                .audit
                .write(&mut conn, inner.table.persistent(), &row)
                .await?;
            conn.finish().await
        };
        if let Err(error) = written.await {
            tracing::warn!(%error, "idem: the abandon's audit row could not be written");
        }
    }
}

/// A request another attempt committed, its stored copy deleted: completed (a failed
/// delete is tried again).
fn forgotten(deleted: Result<(), sqlx::Error>) -> Run {
    match deleted {
        Ok(()) => Run::Done(Completed::Completed),
        Err(error) => Run::Failed {
            error: error.to_string(),
            counted: false,
        },
    }
}

/// The prefix of a compensation's step name.
pub(crate) const COMPENSATE: &str = "compensate:";

/// How one run ended.
enum Run {
    Done(Completed),
    Failed { error: String, counted: bool },
}

/// Answers that say "later", not "never": they do not count toward the limit.
fn transient(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::CONFLICT
            | StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT
    )
}

/// A compensation's failure in words, its own error's sources included.
fn told(error: &StepError<UndoError>) -> String {
    match error {
        StepError::Call(error) => format!("the step's call failed: {}", with_sources(&**error)),
        other => other.to_string(),
    }
}

/// `error`, then each of its sources after a colon, but for a source its error's own
/// message already ends with (idem's errors, as sqlx's, say their source and return it).
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !line.ends_with(&said) {
            line.push_str(": ");
            line.push_str(&said);
        }
        source = cause.source();
    }
    line
}

fn describe(refusal: &Refusal) -> String {
    match refusal {
        Refusal::InUse => "a request with this key is running".into(),
        Refusal::Abandoning => "the request is being abandoned".into(),
        Refusal::Mismatch => "the key holds another request".into(),
        Refusal::Unavailable(error) | Refusal::Database(error) => error.to_string(),
        Refusal::Unreadable => "its stored response is unreadable".into(),
    }
}

/// A running completer ([`Completer::spawn`]).
#[derive(Debug)]
pub struct CompleterTask {
    task: tokio::task::JoinHandle<()>,
    stop: Arc<Stop>,
}

impl CompleterTask {
    /// Stops the completer once the look it is in is done; [`CompleterTask::stopped`]
    /// waits for that. Its task outlives a dropped handle.
    pub fn stop(&self) {
        self.stop.ask();
    }

    /// Stops the completer and waits until it has.
    pub async fn stopped(self) {
        self.stop();
        self.task.await.ok();
    }

    /// Stops the completer at once, even in the middle of a run (as a crash would): the
    /// run's transaction rolls back, and its request is taken again when its lease runs
    /// out.
    pub fn abort(&self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_later_answers_are_transient() {
        for status in [409, 429, 502, 503, 504] {
            assert!(transient(StatusCode::from_u16(status).unwrap()), "{status}");
        }
        for status in [400, 404, 410, 422, 500] {
            assert!(
                !transient(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
    }

    /// An error that keeps its source out of its message.
    #[derive(Debug)]
    struct Refused(std::io::Error);

    impl fmt::Display for Refused {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("the refund was refused")
        }
    }

    impl std::error::Error for Refused {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_compensations_error_is_told_with_its_sources_each_once() {
        let down = || std::io::Error::other("connection refused");
        let step: StepError<UndoError> = StepError::Call(Box::new(Refused(down())));
        assert_eq!(
            told(&step),
            "the step's call failed: the refund was refused: connection refused"
        );
        let step: StepError<UndoError> = StepError::Call("the processor is down".into());
        assert_eq!(told(&step), "the step's call failed: the processor is down");
    }
}
