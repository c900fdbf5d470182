//! An app served over real HTTP on a loopback port, with its pool and a client.

use std::net::SocketAddr;

use axum::Router;
use serde_json::Value;
use sqlx::PgPool;

use crate::{count, post, Answer, TestDb};

/// A router served over real HTTP on a loopback port until dropped, the pool it works
/// on, and a client to call it with.
pub struct TestApp {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The app's database pool, to look at what it wrote.
    pub pool: PgPool,
    /// A client for requests of one's own making.
    pub client: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
}

impl TestApp {
    /// Serves `app`, which works on `pool`, on an ephemeral port.
    pub async fn serve(pool: PgPool, app: Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve");
        });
        Self {
            addr,
            pool,
            client: reqwest::Client::new(),
            server,
        }
    }

    /// The charges example on `db`, migrated, with a pool of `connections`.
    pub async fn charges(db: &TestDb, connections: u32, config: charges::Config) -> Self {
        let pool = db.pool(connections).await;
        charges::migrate(&pool).await.expect("migrate");
        Self::serve(pool.clone(), charges::app(pool, config)).await
    }

    /// The absolute URL of `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `POST path` with a JSON body and an optional `Idempotency-Key`; see [`post`].
    pub async fn post(&self, path: &str, key: Option<&str>, body: &Value) -> Answer {
        self.post_with(path, key, body, &[]).await
    }

    /// The same with extra headers.
    pub async fn post_with(
        &self,
        path: &str,
        key: Option<&str>,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Answer {
        post(&self.client, &self.url(path), key, body, headers).await
    }

    /// `POST path` with the JSON text `body` and `headers`, as a webhook provider
    /// sends a delivery.
    pub async fn deliver_to<N, V>(
        &self,
        path: &str,
        body: &str,
        headers: impl IntoIterator<Item = (N, V)>,
    ) -> Answer
    where
        N: AsRef<str>,
        V: AsRef<str>,
    {
        let mut request = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body.to_owned());
        for (name, value) in headers {
            request = request.header(name.as_ref(), value.as_ref());
        }
        crate::send(request).await
    }

    /// Counts the rows of a table (or any `FROM` clause) of the app's database.
    pub async fn count(&self, from: &str) -> i64 {
        count(&self.pool, from).await
    }

    /// Counts the stored idempotency keys.
    pub async fn keys(&self) -> i64 {
        self.count("idempotency_keys").await
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.server.abort();
    }
}
