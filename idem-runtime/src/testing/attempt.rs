//! The attempts a history makes, each in a process of its own: a client's send, copies
//! at once, a restarted instance's completer.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Request};
use axum::Router;
use bytes::Bytes;
use sqlx::postgres::PgPoolOptions;
use tower_service::Service;

use super::gate::Gate;
use super::process::{self, Died};
use super::{App, Kit, MakeRequest};
use crate::complete::Completer;
use crate::failpoint::Failpoints;
use crate::store::Store;
use crate::web::response::IDEMPOTENT_REPLAYED;

/// How long a process goes on after its job, or after it was stopped at a failpoint, so
/// that the tasks it spawned do their work before it stops.
const SETTLE: Duration = Duration::from_millis(100);
/// How long one process may take before the kit gives up on the request.
const PATIENCE: Duration = Duration::from_secs(60);
/// The largest answer body the kit reads.
const MAX_BODY: usize = 16 << 20;

/// A process's answer: status, body, and whether it was a replay.
pub(super) type Answer = (u16, Bytes, bool);

/// Where the attempts run: the kit's service, reached through `gate`.
pub(super) struct Attempts<'k> {
    pub(super) kit: &'k Kit,
    pub(super) gate: Gate,
}

impl Attempts<'_> {
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
    pub(super) async fn send(
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
            let router = app(store()?);
            Ok(call(router, keyed(&request, &key)?).await)
        })
        .await
    }

    /// Copies of `request` at once in one new process, each after its delay in
    /// milliseconds.
    pub(super) async fn at_once(
        &self,
        request: &MakeRequest,
        key: &str,
        delays: &[u64],
        deployed: bool,
    ) -> Result<Vec<Answer>, Died> {
        let failpoints = Arc::new(Failpoints::new());
        let store = self.store_maker(Arc::clone(&failpoints), delays.len() as u32 + 1);
        let app = self.app(deployed);
        let request = Arc::clone(request);
        let key = key.to_owned();
        let delays = delays.to_vec();
        in_process(failpoints, move || async move {
            let router = app(store()?);
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
    pub(super) async fn complete(
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
