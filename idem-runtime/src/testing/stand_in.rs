//! A stand-in for an outside service the handler calls over HTTP, which counts every call.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::any;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// An outside service (a payment processor, a mailer) served over HTTP on a loopback
/// port until dropped: every request to any path answers 200 with `{"id": "<name>_<n>"}`
/// and is counted, with the `Idempotency-Key` it carried.
///
/// A stand-in that honours keys answers a repeated key with its first answer and makes
/// nothing new, as Stripe does; one that ignores them makes a new effect at each call, as
/// a service without keys does. Hand it to [`Kit::outside`](super::Kit::outside), and
/// give the handler [`StandIn::url`] where it would call the real service. Clones share
/// the one server, which stops when the last is dropped.
#[derive(Clone)]
pub struct StandIn {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    addr: SocketAddr,
    seen: Arc<Seen>,
    server: JoinHandle<()>,
}

/// What a stand-in saw.
struct Seen {
    honours_keys: bool,
    name: String,
    books: Mutex<Books>,
}

#[derive(Default, Clone)]
pub(super) struct Books {
    /// Every call's `Idempotency-Key` (`None` without one), in the order they came.
    pub(super) calls: Vec<Option<String>>,
    /// The effects made: one per call, or one per key when keys are honoured.
    pub(super) effects: u64,
    /// The answer given to each key, when keys are honoured.
    answers: HashMap<String, Value>,
}

impl StandIn {
    /// A stand-in named `name` (the report's word for it) that honours `Idempotency-Key`.
    pub async fn honouring_keys(name: &str) -> std::io::Result<Self> {
        Self::start(name, true).await
    }

    /// A stand-in named `name` that ignores `Idempotency-Key`: each call is a new effect.
    pub async fn ignoring_keys(name: &str) -> std::io::Result<Self> {
        Self::start(name, false).await
    }

    async fn start(name: &str, honours_keys: bool) -> std::io::Result<Self> {
        let seen = Arc::new(Seen {
            honours_keys,
            name: name.to_owned(),
            books: Mutex::default(),
        });
        let app = Router::new()
            .fallback(any(call))
            .with_state(Arc::clone(&seen));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.ok();
        });
        Ok(Self {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                addr,
                seen,
                server,
            }),
        })
    }

    /// Its base URL, such as `http://127.0.0.1:43127` (any path answers).
    pub fn url(&self) -> String {
        format!("http://{}", self.inner.addr)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether it honours `Idempotency-Key`.
    pub fn honours_keys(&self) -> bool {
        self.inner.seen.honours_keys
    }

    /// The calls it has answered.
    pub fn calls(&self) -> usize {
        self.books().calls.len()
    }

    /// The effects it has made: its calls, or their distinct keys when it honours keys.
    pub fn effects(&self) -> u64 {
        self.books().effects
    }

    pub(super) fn books(&self) -> Books {
        self.inner
            .seen
            .books
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl std::fmt::Debug for StandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StandIn")
            .field("name", &self.inner.name)
            .field("addr", &self.inner.addr)
            .field("honours_keys", &self.inner.seen.honours_keys)
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn call(State(seen): State<Arc<Seen>>, headers: HeaderMap) -> Json<Value> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut books = seen
        .books
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    books.calls.push(key.clone());
    if let (true, Some(key)) = (seen.honours_keys, &key) {
        if let Some(answer) = books.answers.get(key) {
            return Json(answer.clone());
        }
    }
    books.effects += 1;
    let answer = json!({ "id": format!("{}_{}", seen.name, books.effects) });
    if let (true, Some(key)) = (seen.honours_keys, key) {
        books.answers.insert(key, answer.clone());
    }
    Json(answer)
}
