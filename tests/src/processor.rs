//! A stand-in payment processor over real HTTP, for the tests of steps (`Tx::step`):
//! `POST /v1/charges` with a JSON body and an `Idempotency-Key` header answers 200 with
//! `{"id": "ch_.."}`, counting every call per key. It can honour keys (a repeated key
//! gets its first answer) or ignore them (a new charge each call), answer 500 (or
//! another status, such as a 402 that declines) a number of times, answer slowly, and end a database session named in the body (`"pid"`)
//! before it answers, as a connection lost while the call ran. `POST /v1/refunds` (a
//! compensation's undo) answers 200, keeping every call's key and body.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use sqlx::PgPool;

/// The processor's state, shared with the test that drives it.
#[derive(Debug, Default)]
pub struct Processor {
    /// Calls per `Idempotency-Key` (`""` for a call without one).
    calls: Mutex<HashMap<String, u32>>,
    /// The first answer per key, when keys are honoured.
    answers: Mutex<HashMap<String, String>>,
    /// Whether a repeated key gets a new charge.
    ignore_keys: AtomicBool,
    /// How many of the next calls answer [`Processor::failing_status`].
    failing: AtomicU32,
    /// What they answer (0: 500).
    failing_status: AtomicU16,
    /// Every call's key and body, in the order they came.
    bodies: Mutex<Vec<(String, Value)>>,
    /// How long each call takes, in milliseconds.
    delay_ms: AtomicU64,
    /// Where to end the session whose `pid` a call's body names.
    terminate: Mutex<Option<PgPool>>,
    made: AtomicU64,
    /// Every refund's key and body, in the order they came.
    refunds: Mutex<Vec<(String, Value)>>,
}

/// A [`Processor`] served on a loopback port until dropped.
#[derive(Debug)]
pub struct ProcessorServer {
    /// Its state.
    pub processor: Arc<Processor>,
    /// Where it listens.
    pub addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl ProcessorServer {
    /// Serves a processor that honours keys and answers at once.
    pub async fn start() -> Self {
        let processor = Arc::new(Processor::default());
        let app = Router::new()
            .route("/v1/charges", post(charge))
            .route("/v1/refunds", post(refund))
            .with_state(processor.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve");
        });
        Self {
            processor,
            addr,
            server,
        }
    }

    /// Its base URL (`PROCESSOR_URL`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for ProcessorServer {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Processor {
    /// How many calls came with `key`.
    pub fn calls(&self, key: &str) -> u32 {
        self.lock_calls().get(key).copied().unwrap_or(0)
    }

    /// How many calls came in all.
    pub fn total(&self) -> u32 {
        self.lock_calls().values().sum()
    }

    /// The keys calls came with, each once.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.lock_calls().keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Makes a repeated key a new charge (a processor without idempotency keys).
    pub fn ignore_keys(&self, ignore: bool) {
        self.ignore_keys.store(ignore, Ordering::SeqCst);
    }

    /// Makes the next `calls` calls answer 500.
    pub fn fail_next(&self, calls: u32) {
        self.fail_next_with(StatusCode::INTERNAL_SERVER_ERROR, calls);
    }

    /// Makes the next `calls` calls answer `status`, with the body
    /// `{"error": {"message": "<its reason>"}}` (a 402's: `card declined`).
    pub fn fail_next_with(&self, status: StatusCode, calls: u32) {
        self.failing_status.store(status.as_u16(), Ordering::SeqCst);
        self.failing.store(calls, Ordering::SeqCst);
    }

    /// The bodies of the calls that came with `key`, in order.
    pub fn bodies(&self, key: &str) -> Vec<Value> {
        self.bodies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, body)| body.clone())
            .collect()
    }

    /// Makes each call take `delay`.
    pub fn delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Ends, through `pool`, the database session a call's body names as `"pid"`, and
    /// waits until it has ended (its transaction aborted), before answering the call.
    pub fn terminate_through(&self, pool: PgPool) {
        *self.terminate.lock().unwrap_or_else(|e| e.into_inner()) = Some(pool);
    }

    /// Every refund asked for: its `Idempotency-Key` and body, in order.
    pub fn refunds(&self) -> Vec<(String, Value)> {
        self.refunds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn lock_calls(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn charge(
    State(processor): State<Arc<Processor>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    *processor.lock_calls().entry(key.clone()).or_default() += 1;
    processor
        .bodies
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((key.clone(), body.clone()));
    let delay = processor.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let terminate = processor
        .terminate
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if let (Some(pool), Some(pid)) = (terminate, body["pid"].as_i64()) {
        sqlx::query("SELECT pg_terminate_backend($1::int, 10000)")
            .bind(pid)
            .execute(&pool)
            .await
            .expect("terminate the handler's session");
    }
    let failing = processor
        .failing
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    if failing.is_ok() {
        let status = match processor.failing_status.load(Ordering::SeqCst) {
            0 => StatusCode::INTERNAL_SERVER_ERROR,
            code => StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        };
        let message = match status {
            StatusCode::PAYMENT_REQUIRED => "card declined",
            StatusCode::INTERNAL_SERVER_ERROR => "processor down",
            other => other.canonical_reason().unwrap_or("refused"),
        };
        return (status, Json(json!({ "error": { "message": message } })));
    }
    let made = || format!("ch_{}", processor.made.fetch_add(1, Ordering::SeqCst) + 1);
    let id = if key.is_empty() || processor.ignore_keys.load(Ordering::SeqCst) {
        made()
    } else {
        processor
            .answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_insert_with(made)
            .clone()
    };
    (StatusCode::OK, Json(json!({ "id": id })))
}

async fn refund(
    State(processor): State<Arc<Processor>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut refunds = processor.refunds.lock().unwrap_or_else(|e| e.into_inner());
    refunds.push((key, body.clone()));
    let id = format!("re_{}", refunds.len());
    (
        StatusCode::OK,
        Json(json!({ "id": id, "charge": body["charge"] })),
    )
}
