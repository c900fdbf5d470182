//! The guide's Rust snippets, compiled. Every ```rust block of every chapter of
//! `docs/book/src` is either a whole file of the new service (marked
//! `<!-- compatibility: .. -->`, built and run by `compatibility.rs` from crates.io's
//! newest releases) or appears here, whitespace aside, inside the few definitions it
//! says it leaves to the reader (`Account`, `NewCharge`, `ApiError` ...).
//! `every_rust_block_of_the_guide_is_compiled` holds that: a snippet edited in a chapter
//! and not here fails it, and so does a chapter this file does not read. Nothing here
//! runs; it must build.

// The snippets are never called, and so neither is what they use.
#![allow(dead_code)]

mod docs;

use std::error::Error;

use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use idem::schema::PrincipalType;
use idem::webhook::{GitHub, Signed, StandardWebhooks, Verifier};
use idem::{idempotent, Pooler, Problem, Store, Tx};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;

use docs::{rust_blocks, squashed, CHAPTERS, PROGRAMS, SUMMARY};

const THIS_FILE: &str = include_str!("book.rs");

#[test]
fn every_rust_block_of_the_guide_is_compiled() {
    let here = squashed(THIS_FILE);
    let mut programs = Vec::new();
    let mut checked = 0;
    for (chapter, text) in CHAPTERS {
        for (file, block) in rust_blocks(text) {
            if let Some(file) = file {
                assert!(
                    PROGRAMS.contains(&file),
                    "{chapter}: `compatibility.rs` does not build a file called {file}"
                );
                programs.push(file);
                continue;
            }
            assert!(
                here.contains(&squashed(block)),
                "this block of {chapter} is not compiled by tests/tests/book.rs:\n{block}"
            );
            checked += 1;
        }
    }
    assert!(checked > 10, "the guide's blocks were not found");
    programs.sort_unstable();
    let mut expected = PROGRAMS
        .iter()
        .filter(|f| f.ends_with(".rs"))
        .copied()
        .collect::<Vec<_>>();
    expected.sort_unstable();
    assert_eq!(
        programs, expected,
        "each Rust file of the new service is in one chapter"
    );
}

/// The guide's whole programs are also the workspace's `examples/guide`, word for word:
/// the example a newcomer runs is the one the guide explains.
#[test]
fn the_guides_programs_are_the_guide_example() {
    let mut compared = 0;
    for (chapter, text) in CHAPTERS {
        for (file, block) in rust_blocks(text) {
            let Some(file) = file else { continue };
            let path = format!("{}/../examples/guide/{file}", env!("CARGO_MANIFEST_DIR"));
            let example = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{chapter}: examples/guide/{file}: {e}"));
            assert_eq!(
                squashed(&example),
                squashed(block),
                "{chapter}: its {file} is not examples/guide/{file}"
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 3, "the guide's three programs");
}

#[test]
fn every_chapter_is_read_and_listed_in_the_summary() {
    let mut read: Vec<&str> = CHAPTERS.iter().map(|(name, _)| *name).collect();
    read.sort_unstable();
    assert_eq!(
        docs::chapters_on_disk(),
        read,
        "docs/book/src and the chapters `tests/tests/docs/mod.rs` reads differ"
    );
    for (name, _) in CHAPTERS {
        assert!(
            SUMMARY.contains(&format!("]({name})")),
            "SUMMARY.md does not list {name}"
        );
    }
}

// What the snippets leave to the reader.

#[derive(Clone)]
struct Account(String);

#[derive(Clone)]
struct Tenant(String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .extensions
            .get::<Self>()
            .cloned()
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl idem::extract::Principal for Tenant {
    fn principal_id(&self) -> String {
        self.0.clone()
    }
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
struct NewCharge {
    amount: i64,
}

#[derive(Serialize, utoipa::ToSchema)]
struct Charge {
    id: i64,
}

#[derive(Deserialize, Serialize)]
struct PaymentEvent {
    #[serde(rename = "type")]
    kind: String,
    data: Value,
}

#[derive(Deserialize, Serialize)]
struct Message {
    message_id: String,
    account: String,
    amount: i64,
}

#[derive(Deserialize, Serialize)]
struct Credited {
    balance: i64,
}

/// A service's own error type, as the webhook snippet assumes one.
struct ApiError(sqlx::Error);

#[derive(Deserialize, Serialize)]
struct Booked {
    entry: String,
}

#[derive(Deserialize, Serialize)]
struct LedgerEntry {
    id: String,
}

/// The ledger the consumer's step posts to.
struct Ledger;

impl Ledger {
    async fn post(&self, _key: &str, _message: &Message) -> Result<LedgerEntry, std::io::Error> {
        Ok(LedgerEntry { id: String::new() })
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0.to_string()).into_response()
    }
}

fn app(store: Store) -> Router {
    Router::new().with_state(store)
}

/// The snippets, as written in the guide (rustfmt would reflow them).
#[rustfmt::skip]
#[allow(dead_code, unused, unnameable_test_items, clippy::all)]
mod snippets {
    use super::*;

    // Setup.
    async fn setup(pool: PgPool) -> Result<(), Box<dyn Error>> {
        use axum::extract::FromRef;
        use idem::Store;

        #[derive(Clone, FromRef)]
        struct AppState {
            store: Store,
            pool: sqlx::PgPool,
        }

        let store = Store::builder(pool.clone())
            // keys are looked up per (scope, principal, key): one account never sees another's responses
            .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
            .build()?;                  // every setting is checked here, once (`BuildError`)
        store.migrate().await?;         // CREATE TABLE IF NOT EXISTS; safe from many processes
        Ok(())
    }

    // Setup: verify, and sqlx's test harness (`tests/migrations` is idem's, as a
    // service copies them).
    async fn verify(store: Store) -> Result<(), Box<dyn Error>> {
        store.verify().await?;

        // Tests: sqlx's own harness, a fresh database per test, your migrations and idem's.
        #[sqlx::test(migrations = "./migrations")]
        async fn a_retry_is_replayed(pool: PgPool) {
            let app = app(Store::new(pool.clone()));   // your router, served or driven with tower's oneshot
            /* ... */
        }
        Ok(())
    }

    // Operating idem: the audit trail.
    async fn audited(store: Store) -> Result<(), Box<dyn Error>> {
        use idem::operate::Operator;

        let ops = store.operate().audited(Operator::new("ana@example.com", "support-tool"));
        ops.purge_key("charges", "acct_1", "order-42").await?;   // its row commits with the delete
        let page = store.operate().audit_log(50, None).await?;              // newest first
        let next = store.operate().audit_log(50, page.last().map(|e| e.id)).await?;
        Ok(())
    }

    // The attribute.
    #[idempotent(scope = "refunds", ttl = "24h", fields = [amount], principal = Tenant)]
    async fn refund(mut tx: Tx, Json(req): Json<NewCharge>) -> StatusCode {
        StatusCode::CREATED
    }

    // OpenAPI (utoipa).
    #[idempotent(scope = "charges")]
    #[utoipa::path(post, path = "/charges", request_body = NewCharge,
        responses((status = 201, body = Charge)))]
    async fn create_charge(mut tx: Tx, Json(req): Json<NewCharge>) -> Result<StatusCode, Problem> {
        /* ... */
        Ok(StatusCode::CREATED)
    }

    // Webhooks.
    mod webhooks {
        use super::*;

        #[derive(Clone, FromRef)]
        struct AppState {
            idempotency: Store,
            payments: Verifier<StandardWebhooks>, // Verifier::new("whsec_...")?
            github: Verifier<GitHub>,
        }

        // `ApiError`: your own error type, an `IntoResponse` with `From<sqlx::Error>` for `?`.
        #[idempotent(scope = "payment_events", ttl = "7d", key = header("webhook-id"), concurrency = wait("30s"))]
        async fn payment_event(mut tx: Tx, Signed(event, ..): Signed<PaymentEvent>) -> Result<Json<Value>, ApiError> {
            let id = tx.idempotency_key().unwrap_or_default().to_owned(); // the webhook-id
            sqlx::query("INSERT INTO webhook_events (provider, id, type, payload) VALUES ('payments', $1, $2, $3)")
                .bind(&id).bind(&event.kind).bind(sqlx::types::Json(&event.data))
                .execute(&mut *tx).await?;
            Ok(Json(json!({ "received": id })))
        }

        #[idempotent(scope = "github_deliveries", ttl = "7d", key = digest(body), concurrency = wait("30s"))]
        async fn github_event(mut tx: Tx, Signed(payload, ..): Signed<Value, GitHub>) -> Result<Json<Value>, ApiError> {
            /* ... */
            Ok(Json(json!({ "received": true })))
        }
    }

    // Queue consumers and jobs.
    async fn consume(store: Store, message: Message) -> Result<(), Box<dyn Error>> {
        use std::time::Duration;

        let credited: Credited = store
            .run_once("ledger_credits", &message.message_id)
            .ttl(Duration::from_secs(7 * 86_400))
            .payload(&message)          // the same key with another payload is a mismatch
            .run(async |mut tx| {
                sqlx::query("INSERT INTO ledger_entries (message_id, account, amount) VALUES ($1, $2, $3)")
                    .bind(&message.message_id).bind(&message.account).bind(message.amount)
                    .execute(&mut *tx).await?;
                Ok::<_, sqlx::Error>(Credited { balance: 0 })
            })
            .await?;
        Ok(())
    }

    // Steps, in a consumer.
    async fn consume_with_a_step(store: Store, message: Message, ledger: &Ledger) -> Result<(), Box<dyn Error>> {
        let booked: Booked = store
            .run_once("ledger_credits", &message.message_id)
            .payload(&message)
            .run(async |mut tx| {
                let entry: LedgerEntry = tx
                    .step("ledger", |key| async move { ledger.post(&key, &message).await })
                    .await?;            // the ledger's `Err`, not recorded: the redelivery calls again
                Ok::<_, idem::StepError<std::io::Error>>(Booked { entry: entry.id })
            })
            .await?;
        Ok(())
    }

    // Events: run a relay.
    async fn relays(store: Store) -> Result<(), Box<dyn Error>> {
        // features = ["nats"]
        let js = async_nats::jetstream::new(async_nats::connect(std::env::var("NATS_URL")?).await?);
        let relay = store.relay(idem::outbox::nats::JetStreamPublisher::new(js)).spawn()?;
        // features = ["amqp"]: publisher confirms, `mandatory`, persistent
        let relay = store.relay(idem::outbox::amqp::AmqpPublisher::new(std::env::var("AMQP_URL")?, "events")).spawn()?;
        // at shutdown
        relay.stopped().await;
        Ok(())
    }

    // Running in production: behind a transaction pooler.
    async fn pooler(url: String, mut tx: Tx<'_>) -> Result<(), Box<dyn Error>> {
        use std::str::FromStr;
        use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

        let options = PgConnectOptions::from_str(&url)?.statement_cache_capacity(0);
        let pool = PgPoolOptions::new().connect_with(options).await?;
        let store = Store::builder(pool.clone()).pooler(Pooler::Transaction).build()?;
        // Your own statements: unnamed too (capacity 0 alone still names them).
        sqlx::query("INSERT ...").persistent(false).execute(&mut *tx).await?;
        Ok(())
    }

    // Running in production: Citus.
    async fn citus(pool: PgPool) -> Result<(), Box<dyn Error>> {
        let store = Store::builder(pool)
            .portable(true)
            .principal_type(PrincipalType::Uuid)      // your tenant column's type: Text, Uuid or Bigint
            .principal(|parts| parts.extensions.get::<Tenant>().map(|t| t.0.to_string()))
            .build()?;
        store.migrate().await?;
        store.distribute(Some("accounts")).await?;    // by principal, colocated with your tenant table
        store.verify().await?;
        Ok(())
    }
}

/// "Performance": replays from memory.
mod replay_cache {
    use std::time::Duration;

    use idem::Store;

    fn store(pool: sqlx::PgPool) -> Store {
        Store::builder(pool)
            // 64 MiB of keys and answers at most, each kept for at most 5 s.
            .replay_cache(64 << 20, Duration::from_secs(5))
            .build()
            .expect("valid settings")
    }
}

/// "The console": mounted behind a layer that gives two bearer tokens their roles.
mod console {
    use std::sync::Arc;

    use axum::extract::{Request, State};
    use axum::http::{HeaderName, HeaderValue, StatusCode};
    use axum::middleware::{self, Next};
    use axum::response::{IntoResponse, Response};
    use axum::Router;
    use idem::console::{Console, Role};
    use idem::Store;

    /// The console's bearer tokens: `admin` acts, `viewer` only looks.
    struct Tokens {
        admin: String,
        viewer: String,
    }

    /// Whether `sent` is `Bearer <token>`, in constant time: how long a refusal takes must
    /// not tell how much of a guess was right.
    fn bears(sent: &[u8], token: &str) -> bool {
        let expected = format!("Bearer {token}");
        sent.len() == expected.len()
            && sent
                .iter()
                .zip(expected.as_bytes())
                .fold(0, |acc, (a, b)| acc | (a ^ b))
                == 0
    }

    /// Each token's holder is an operator, with a role; any other request gets 401.
    async fn operators(
        State(tokens): State<Arc<Tokens>>,
        mut request: Request,
        next: Next,
    ) -> Response {
        let sent = request
            .headers()
            .get("authorization")
            .map_or(&b""[..], |v| v.as_bytes());
        let (admin, viewer) = (bears(sent, &tokens.admin), bears(sent, &tokens.viewer));
        let (operator, role) = match (admin, viewer) {
            (true, _) => ("admin", Role::Admin),
            (false, true) => ("viewer", Role::ReadOnly),
            (false, false) => return StatusCode::UNAUTHORIZED.into_response(),
        };
        request
            .headers_mut()
            .insert("x-operator", HeaderValue::from_static(operator));
        request.extensions_mut().insert(role);
        next.run(request).await
    }

    fn with_console(app: Router, store: Store, admin: String, viewer: String) -> Router {
        let tokens = Arc::new(Tokens { admin, viewer });
        let console = Console::new(store)
            .actions(true)
            .operator_header(HeaderName::from_static("x-operator"))
            .router()
            .layer(middleware::from_fn_with_state(tokens, operators));
        app.nest("/admin/idem", console)
    }
}

/// "Without the macro": the attribute chapter's layered handler and router.
mod layer_chapter {
    use super::{ApiError, Charge, NewCharge};
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::{Json, Router};
    use idem::layer::{IdempotencyLayer, Locked};
    use idem::Store;

    async fn create_charge(
        mut locked: Locked,
        Json(req): Json<NewCharge>,
    ) -> Result<(StatusCode, Json<Charge>), ApiError> {
        let mut tx = locked.tx();
        let id = sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
            .bind(req.amount)
            .fetch_one(&mut *tx)
            .await?;
        Ok((StatusCode::CREATED, Json(Charge { id })))
    }

    fn charges(store: Store) -> Router {
        let layer = IdempotencyLayer::new(store, "charges").fields(["/amount"]);
        Router::new().route("/charges", post(create_charge).layer(layer))
    }
}

/// "gRPC: tonic's service methods": the service, and the same one under the layer.
#[rustfmt::skip]
#[allow(unreachable_pub, missing_docs)] // tonic-build's code
mod grpc_chapter {
mod pb {
    tonic::include_proto!("idem.charges.v1");
}

use axum::extract::FromRef;
use idem::{idempotent, Store, Tx};
use pb::charges_server::{Charges, ChargesServer};
use pb::{Charge, CreateChargeRequest};
use tonic::{Request, Response, Status};

#[derive(Clone, FromRef)]
struct ChargeService {
    store: Store,
}

#[idem::grpc]
#[tonic::async_trait]
impl Charges for ChargeService {
    #[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer.id], key = request_id)]
    async fn create_charge(
        &self,
        request: Request<CreateChargeRequest>,
        mut tx: Tx,
    ) -> Result<Response<Charge>, Status> {
        let new = request.into_inner();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO charges (amount, currency) VALUES ($1, $2) RETURNING id",
        )
        .bind(new.amount)
        .bind(&new.currency)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(Charge { id, amount: new.amount, currency: new.currency }))
    }

    #[idempotent(scope = "captures", fields = [amount, currency])]
    async fn capture(
        &self,
        request: Request<CreateChargeRequest>,
        mut tx: Tx,
    ) -> Result<Response<Charge>, Status> {
        let new = request.into_inner();
        sqlx::query("UPDATE charges SET captured = true WHERE amount = $1")
            .bind(new.amount)
            .execute(&mut *tx)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(Charge { id: 0, amount: new.amount, currency: new.currency }))
    }
}

async fn serve(store: Store) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(ChargesServer::new(ChargeService { store }))
        .serve("127.0.0.1:50051".parse().unwrap())
        .await
}

mod layered {
    use super::pb::charges_server::{Charges, ChargesServer};
    use super::pb::{Charge, CreateChargeRequest};
    use idem::layer::{IdempotencyLayer, Transaction};
    use idem::Store;
    use tonic::{Request, Response, Status};

    struct LayeredCharges;

    #[tonic::async_trait]
    impl Charges for LayeredCharges {
        async fn create_charge(
            &self,
            request: Request<CreateChargeRequest>,
        ) -> Result<Response<Charge>, Status> {
            let transaction = request.extensions().get::<Transaction>().cloned();
            let transaction = transaction.ok_or_else(|| Status::internal("no IdempotencyLayer"))?;
            let mut locked = transaction.lock().await.map_err(|e| Status::internal(e.to_string()))?;
            let new = request.into_inner();
            let id: i64 = sqlx::query_scalar("INSERT INTO charges (amount, currency) VALUES ($1, $2) RETURNING id")
                .bind(new.amount)
                .bind(&new.currency)
                .fetch_one(&mut *locked.tx())
                .await
                .map_err(|e| Status::internal(e.to_string()))?;
            Ok(Response::new(Charge { id, amount: new.amount, currency: new.currency }))
        }

        async fn capture(
            &self,
            _: Request<CreateChargeRequest>,
        ) -> Result<Response<Charge>, Status> {
            Err(Status::unimplemented("capture"))
        }
    }

    async fn serve(store: Store) -> Result<(), tonic::transport::Error> {
        tonic::transport::Server::builder()
            .layer(IdempotencyLayer::new(store, "charges"))
            .add_service(ChargesServer::new(LayeredCharges))
            .serve("127.0.0.1:50051".parse().unwrap())
            .await
    }
}
}

/// "Testing your handlers": the complete test, as written (it runs, on a database of its
/// own).
#[rustfmt::skip]
mod testing_chapter {
use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idem::testing::{Effect, Kit, StandIn};
use idem::{idempotent, Store, Tx};
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::PgPool;

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    processor: String,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
}

type Failure = (StatusCode, String);

#[idempotent(scope = "charges", fields = [amount], completable = true)]
async fn create_charge(
    State(state): State<AppState>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Value>), Failure> {
    let (http, url) = (state.http.clone(), format!("{}/v1/charges", state.processor));
    let charged: Value = tx
        .step("processor", |key| async move {
            let sent = http.post(url).header("Idempotency-Key", key);
            let answer = sent.json(&json!({ "amount": req.amount })).send().await?;
            answer.error_for_status()?.json::<Value>().await
        })
        .await
        .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
    let id = charged["id"].as_str().unwrap_or_default().to_owned();
    sqlx::query("INSERT INTO charges (processor_id, amount) VALUES ($1, $2)")
        .bind(&id)
        .bind(req.amount)
        .execute(&mut *tx)
        .await
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

/// The service's router on `store`, calling the processor at `processor`.
fn app(store: Store, processor: String) -> Router {
    let http = reqwest::Client::new();
    let state = AppState { store, processor, http };
    Router::new().route("/charges", post(create_charge)).with_state(state)
}

#[sqlx::test(migrations = false)]
async fn a_charge_is_made_exactly_once(pool: PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE charges (id bigserial PRIMARY KEY, processor_id text NOT NULL, amount bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let processor = StandIn::honouring_keys("processor").await.unwrap();
    let url = processor.url();
    let report = Kit::new(pool, move |store| app(store, url.clone()))
        .request(|| {
            Request::post("/charges")
                .header("content-type", "application/json")
                .body(Body::from(r#"{"amount": 1250}"#))
                .unwrap()
        })
        .effect(Effect::rows("charges"))
        .outside(&processor)
        .run()
        .await;
    report.assert_exactly_once();
}

use sqlx::postgres::PgConnectOptions;

/// A new database on `DATABASE_URL`'s server, named `name`, for one test.
async fn fresh_database(name: &str) -> PgPool {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL names the server");
    let server = PgPool::connect(&url).await.expect("the server");
    let (drop, create) = (format!("DROP DATABASE IF EXISTS {name}"), format!("CREATE DATABASE {name}"));
    // sqlx runs a statement it cannot check only when told that it was checked.
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(&server).await.expect("dropped");
    sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&server).await.expect("created");
    let options: PgConnectOptions = url.parse().expect("a URL");
    PgPool::connect_with(options.database(name)).await.expect("the new database")
}
}
