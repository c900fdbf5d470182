//! An app served over real HTTP on a loopback port, with its pool and a client.

use std::net::SocketAddr;

use axum::Router;
use serde_json::Value;
use sqlx::PgPool;

use crate::{count, post, Answer, TestDb};

/// A delivery to one of the example's webhook endpoints: its path, body and headers.
pub type Delivery = (&'static str, String, Vec<(axum::http::HeaderName, String)>);

/// One delivery numbered `n` to each of the example's three webhook endpoints, signed
/// with the example's test secrets at `now`: `payments_body` as Standard Webhooks
/// message `msg_{n}`, Stripe event `evt_{n}`, and GitHub's pull request `n`.
pub fn example_deliveries(n: usize, payments_body: String, now: u64) -> [Delivery; 3] {
    use idem::webhook::{GitHub, StandardWebhooks, Stripe, Verifier};
    let payments = Verifier::<StandardWebhooks>::new(charges::TEST_WEBHOOK_SECRET)
        .expect("the example's secret")
        .sign(&format!("msg_{n}"), now, payments_body.as_bytes());
    let stripe_body =
        serde_json::json!({ "id": format!("evt_{n}"), "type": "charge.succeeded" }).to_string();
    let stripe = Verifier::<Stripe>::new(charges::TEST_STRIPE_SECRET)
        .expect("the example's secret")
        .sign("", now, stripe_body.as_bytes());
    let github_body = serde_json::json!({ "action": "opened", "number": n }).to_string();
    let github = Verifier::<GitHub>::new(charges::TEST_GITHUB_SECRET)
        .expect("the example's secret")
        .sign("", now, github_body.as_bytes());
    [
        ("/webhooks/payments", payments_body, payments),
        ("/webhooks/stripe", stripe_body, stripe),
        ("/webhooks/github", github_body, github),
    ]
}

/// A router served over real HTTP on a loopback port until dropped, the pool it works
/// on, and a client to call it with.
#[derive(Debug)]
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

/// A store on `pool`, in the portable mode or the default one, its table migrated.
pub async fn migrated_store(pool: PgPool, portable: bool) -> idem::Store {
    let builder = idem::Store::builder(pool);
    let store = if portable {
        builder.portable(true)
    } else {
        builder
    }
    .build()
    .expect("store");
    store.migrate().await.expect("migrate");
    store
}
