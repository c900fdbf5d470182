//! The charges service: idem's reference example.
//!
//! * `POST /charges` creates a charge, idempotent per account and `Idempotency-Key`,
//!   fingerprinted on amount, currency and customer.
//! * `GET /charges/{id}` reads a charge of the caller's account.
//! * `POST /charges/{id}/refunds` refunds part of a charge, never more than remains.
//! * `POST /webhooks/payments` takes signed events from the payment provider, once each.
//!
//! Authentication is a stand-in: `Authorization: Bearer <account>` names the account,
//! which is also the principal idem keys are looked up under. Webhooks carry no bearer
//! token: their signature is their authentication.

pub mod consumer;

use std::ffi::OsString;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, Path, Request, State};
use axum::http::header::{LOCATION, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idem::webhook::{Signed, WebhookSecretError, WebhookVerifier};
use idem::{idempotent, Problem, Store, Tx};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};

/// The example's own tables; idem's table comes from [`Store::migrate`].
pub const SCHEMA_SQL: &str = include_str!("../schema.sql");

/// The base of this service's own problem `type` URIs.
pub const PROBLEM_BASE: &str = "https://example.com/problems/";

/// The webhook secret of [`Config::default`], for tests and a local try-out.
pub const TEST_WEBHOOK_SECRET: &str = "whsec_test_0123456789abcdef";

/// Settings read from the environment by the binary.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long the charge handler waits inside its transaction after writing the
    /// charge, standing in for a call to a payment processor (`PROCESSOR_DELAY_MS`).
    pub processor_delay: Duration,
    /// Checks the signatures of webhook deliveries; the binary makes it with
    /// [`webhook_verifier`] from `WEBHOOK_SECRET` and `WEBHOOK_SECRET_PREVIOUS`.
    pub webhooks: WebhookVerifier,
    /// How long the webhook handler works on an event (tests use it to overlap
    /// deliveries).
    pub webhook_delay: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            processor_delay: Duration::ZERO,
            webhooks: WebhookVerifier::new(TEST_WEBHOOK_SECRET)
                .expect("the test secret is long enough"),
            webhook_delay: Duration::ZERO,
        }
    }
}

/// The authenticated account, put in the request's extensions by [`authenticate`].
#[derive(Debug, Clone)]
pub struct Account(pub String);

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    pool: PgPool,
    config: Arc<Config>,
    webhooks: WebhookVerifier,
}

/// A pool sized for the service, with a short acquire timeout so that an unreachable
/// database answers 503 quickly instead of holding requests.
pub async fn connect(database_url: &str) -> Result<PgPool, sqlx::Error> {
    connect_with_size(database_url, 20).await
}

async fn connect_with_size(database_url: &str, size: u32) -> Result<PgPool, sqlx::Error> {
    // Debug builds warn when a handler writes around its `Tx`.
    idem::warn_on_escaping_writes(PgPoolOptions::new())
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(2))
        .connect(database_url)
        .await
}

/// The service as the binary runs it: settings from the environment (see `main.rs`),
/// tables created, expired records swept, serving until Ctrl-C.
pub async fn main_from_env() -> Result<(), Box<dyn std::error::Error>> {
    const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
    let bind = std::env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let database_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let number = |name: &str, default: u64| -> Result<u64, String> {
        match std::env::var(name) {
            Ok(v) => v
                .parse()
                .map_err(|_| format!("{name} must be a whole number, not {v:?}")),
            Err(_) => Ok(default),
        }
    };
    let delay_ms = number("PROCESSOR_DELAY_MS", 0)?;
    let pool_size = u32::try_from(number("DB_POOL_SIZE", 20)?.clamp(1, 1000)).unwrap_or(20);

    // Before connecting: a bad secret stops the service at once, with one message.
    let webhooks = webhook_verifier(
        std::env::var_os("WEBHOOK_SECRET"),
        std::env::var_os("WEBHOOK_SECRET_PREVIOUS"),
    )?;

    let pool = connect_with_size(&database_url, pool_size).await?;
    migrate(&pool).await?;
    // Expired idempotency records are ignored already; deleting them keeps the table small.
    let _sweeper = Store::new(pool.clone()).spawn_sweeper(Duration::from_secs(60), 1_000)?;
    let app = app(
        pool,
        Config {
            processor_delay: Duration::from_millis(delay_ms),
            webhooks,
            webhook_delay: Duration::ZERO,
        },
    );
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    tracing::info!(addr = %listener.local_addr()?, "charges service listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// The webhook verifier of `WEBHOOK_SECRET` (`current`) and, while rotating,
/// `WEBHOOK_SECRET_PREVIOUS` (`previous`); their raw bytes are the HMAC keys.
///
/// Unset, `WEBHOOK_SECRET` is a random secret, so that no delivery verifies. Set, it
/// must be at least [`MIN_SECRET_LEN`](idem::webhook::MIN_SECRET_LEN) bytes: an empty
/// `WEBHOOK_SECRET=` would otherwise verify deliveries signed with the empty key.
pub fn webhook_verifier(
    current: Option<OsString>,
    previous: Option<OsString>,
) -> Result<WebhookVerifier, String> {
    let refused = |name: &str, error: WebhookSecretError| format!("{name}: {error}");
    let current = match current {
        Some(secret) => secret.into_encoded_bytes(),
        None => {
            tracing::warn!("WEBHOOK_SECRET is not set: no webhook delivery will verify");
            unguessable_secret().map_err(|error| format!("no random secret: {error}"))?
        }
    };
    let verifier =
        WebhookVerifier::new(current).map_err(|error| refused("WEBHOOK_SECRET", error))?;
    match previous {
        Some(secret) => verifier
            .with_secret(secret.into_encoded_bytes())
            .map_err(|error| refused("WEBHOOK_SECRET_PREVIOUS", error)),
        None => Ok(verifier),
    }
}

/// 32 random bytes, so that an unconfigured service accepts no webhook at all.
fn unguessable_secret() -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut secret = vec![0; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut secret)?;
    Ok(secret)
}

/// Creates idem's table and the example's tables. Safe to run again, and from several
/// processes starting at once.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    Store::new(pool.clone()).migrate().await?;
    // Concurrent `CREATE TABLE IF NOT EXISTS` can race; one lock makes starts take turns.
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('charges-example-schema'))")
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(SCHEMA_SQL).execute(&mut *tx).await?;
    tx.commit().await
}

/// The service's router: the store keys requests per account.
pub fn app(pool: PgPool, config: Config) -> Router {
    let idempotency = Store::builder(pool.clone())
        .principal(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
        .build()
        .expect("the default store settings are valid");
    let webhooks = config.webhooks.clone();
    let state = AppState {
        idempotency,
        pool,
        config: Arc::new(config),
        webhooks,
    };
    let api = Router::new()
        .route("/charges", post(create_charge))
        .route("/charges/{id}", get(get_charge))
        .route("/charges/{id}/refunds", post(create_refund))
        .layer(middleware::from_fn(authenticate));
    // The signature authenticates a webhook; the bearer middleware does not apply.
    let webhooks = Router::new().route("/webhooks/payments", post(payment_event));
    api.merge(webhooks).with_state(state)
}

/// `Authorization: Bearer <account>`, or 401. Runs before idem, so idem's principal
/// resolver always finds the account.
pub async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|a| !a.is_empty() && a.len() <= 128 && a.bytes().all(|b| b.is_ascii_graphic()));
    let Some(account) = account else {
        let mut response = ApiError(
            Problem::new(
                StatusCode::UNAUTHORIZED,
                problem_type("unauthenticated"),
                "Unauthenticated",
            )
            .with_detail("send `Authorization: Bearer <account>`"),
        )
        .into_response();
        response
            .headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    };
    let account = Account(account.to_owned());
    request.extensions_mut().insert(account);
    next.run(request).await
}

fn problem_type(slug: &str) -> String {
    format!("{PROBLEM_BASE}{slug}")
}

/// The service's error: a problem+json response. Database failures that mean "the
/// database is unreachable" answer 503, anything else 500.
#[derive(Debug)]
pub struct ApiError(pub Problem);

impl ApiError {
    fn invalid(detail: impl Into<String>) -> Self {
        Self(
            Problem::new(
                StatusCode::BAD_REQUEST,
                problem_type("invalid-request"),
                "Invalid request",
            )
            .with_detail(detail),
        )
    }

    fn not_found(what: &str) -> Self {
        Self(
            Problem::new(
                StatusCode::NOT_FOUND,
                problem_type("not-found"),
                "Not found",
            )
            .with_detail(format!("no such {what}")),
        )
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        if idem::is_unavailable(&error) {
            tracing::warn!(%error, "database unavailable");
            Self(
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    problem_type("unavailable"),
                    "Service unavailable",
                )
                .with_retry_after(Duration::from_secs(1)),
            )
        } else {
            tracing::error!(%error, "database error");
            Self(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                problem_type("internal"),
                "Internal error",
            ))
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.0.into_response()
    }
}

/// The body of `POST /charges`.
#[derive(Debug, Deserialize, Serialize)]
pub struct NewCharge {
    /// In the currency's smallest unit; positive.
    pub amount: i64,
    /// Three ASCII letters, such as `usd`; lower-cased as it is read, so that `"USD"`
    /// and `"usd"` are one fingerprint and a retry that changes the case replays.
    #[serde(deserialize_with = "lower_case")]
    pub currency: String,
    /// Who is charged.
    pub customer: String,
    /// Free text; not part of the fingerprint, so a retry may change it.
    #[serde(default)]
    pub description: Option<String>,
}

/// Normalises a code before the fingerprint sees it: what the handler would treat as
/// one value must be one value in the fingerprint too.
fn lower_case<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    String::deserialize(deserializer).map(|code| code.to_ascii_lowercase())
}

/// A charge, as answered.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Charge {
    id: String,
    account: String,
    amount: i64,
    currency: String,
    customer: String,
    description: Option<String>,
    created_at: String,
}

const CHARGE_COLUMNS: &str = "id, account, amount, currency, customer, description, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS created_at";

/// Creates a charge. The key, the charge row and this response commit together.
#[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer])]
async fn create_charge(
    State(config): State<Arc<Config>>,
    Extension(account): Extension<Account>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<impl IntoResponse, ApiError> {
    // Validation failures are `Err`: nothing is stored, a corrected retry with the same
    // key runs.
    if req.amount <= 0 {
        return Err(ApiError::invalid("amount must be a positive integer"));
    }
    if req.currency.len() != 3 || !req.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(ApiError::invalid(
            "currency must be three ASCII letters, such as \"usd\"",
        ));
    }
    if req.customer.trim().is_empty() {
        return Err(ApiError::invalid("customer must not be empty"));
    }
    let charge: Charge = sqlx::query_as(&format!(
        "INSERT INTO charges (account, amount, currency, customer, description) \
         VALUES ($1, $2, $3, $4, $5) RETURNING {CHARGE_COLUMNS}"
    ))
    .bind(&account.0)
    .bind(req.amount)
    .bind(&req.currency)
    .bind(&req.customer)
    .bind(&req.description)
    .fetch_one(&mut *tx)
    .await?;

    // Stand-in for the payment processor. A real call would forward
    // `tx.derived_key("processor")` as the processor's own idempotency key: this
    // transaction cannot roll back another service's effects, and a retry after a
    // failure here calls the processor again.
    if !config.processor_delay.is_zero() {
        tokio::time::sleep(config.processor_delay).await;
    }

    let location = format!("/charges/{}", charge.id);
    Ok((StatusCode::CREATED, [(LOCATION, location)], Json(charge)))
}

/// Reads one charge of the caller's account.
async fn get_charge(
    State(pool): State<PgPool>,
    Extension(account): Extension<Account>,
    Path(id): Path<String>,
) -> Result<Json<Charge>, ApiError> {
    let charge: Option<Charge> = sqlx::query_as(&format!(
        "SELECT {CHARGE_COLUMNS} FROM charges WHERE id = $1 AND account = $2"
    ))
    .bind(&id)
    .bind(&account.0)
    .fetch_optional(&pool)
    .await?;
    charge
        .map(Json)
        .ok_or_else(|| ApiError::not_found("charge"))
}

/// The body of `POST /charges/{id}/refunds`.
#[derive(Debug, Deserialize, Serialize)]
pub struct NewRefund {
    /// Positive, at most what remains of the charge.
    pub amount: i64,
}

/// A refund, as answered.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Refund {
    id: String,
    charge_id: String,
    amount: i64,
    created_at: String,
}

/// Refunds part of a charge. The charge id is part of the fingerprint (a path
/// parameter), so one key used on another charge is refused with 422.
#[idempotent(scope = "refunds", ttl = "24h", fields = [amount])]
async fn create_refund(
    Extension(account): Extension<Account>,
    Path(charge_id): Path<String>,
    mut tx: Tx,
    Json(req): Json<NewRefund>,
) -> Result<Response, ApiError> {
    if req.amount <= 0 {
        return Err(ApiError::invalid("amount must be a positive integer"));
    }
    let Some(remaining) = lock_remaining(&mut tx, &charge_id, &account).await? else {
        return Err(ApiError::not_found("charge"));
    };
    if req.amount > remaining {
        // A final business answer: `Ok`, so it is committed and replayed to retries.
        let problem = Problem::new(
            StatusCode::BAD_REQUEST,
            problem_type("refund-exceeds-charge"),
            "Refund exceeds charge",
        )
        .with_detail(format!("{remaining} remains to be refunded on this charge"));
        return Ok(problem.into_response());
    }
    let refund: Refund = sqlx::query_as(
        "INSERT INTO refunds (charge_id, amount) VALUES ($1, $2) \
         RETURNING id, charge_id, amount, \
                   to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS created_at",
    )
    .bind(&charge_id)
    .bind(req.amount)
    .fetch_one(&mut *tx)
    .await?;
    Ok((StatusCode::CREATED, Json(refund)).into_response())
}

/// Locks the charge row and returns what remains to refund, or `None` if the account has
/// no such charge. The lock serializes refunds of one charge, whatever their keys.
async fn lock_remaining(
    conn: &mut PgConnection,
    charge_id: &str,
    account: &Account,
) -> Result<Option<i64>, sqlx::Error> {
    let amount: Option<i64> =
        sqlx::query_scalar("SELECT amount FROM charges WHERE id = $1 AND account = $2 FOR UPDATE")
            .bind(charge_id)
            .bind(&account.0)
            .fetch_optional(&mut *conn)
            .await?;
    let Some(amount) = amount else {
        return Ok(None);
    };
    // A separate statement, so its snapshot is taken after the lock was granted and sees
    // the refunds committed by whoever held the lock before us (READ COMMITTED).
    let refunded: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(amount), 0)::bigint FROM refunds WHERE charge_id = $1",
    )
    .bind(charge_id)
    .fetch_one(&mut *conn)
    .await?;
    Ok(Some(amount - refunded))
}

/// An event from the payment provider.
#[derive(Debug, Deserialize, Serialize)]
pub struct PaymentEvent {
    /// The provider's event id: the idempotency key.
    pub id: String,
    /// What happened, such as `charge.refunded`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The event's details.
    #[serde(default)]
    pub data: serde_json::Value,
}

/// Takes a signed event once. Providers redeliver (at least once): a redelivery, even
/// one racing the first, waits for it and gets its 200, so the provider stops; the same
/// event id with a different payload is a 422 and a warning in the log.
#[idempotent(scope = "payment_events", ttl = "7d", key = id, concurrency = wait("30s"))]
async fn payment_event(
    State(config): State<Arc<Config>>,
    mut tx: Tx,
    Signed(event): Signed<PaymentEvent>,
) -> Result<Json<serde_json::Value>, ApiError> {
    sqlx::query("INSERT INTO webhook_events (id, type, payload) VALUES ($1, $2, $3)")
        .bind(&event.id)
        .bind(&event.kind)
        .bind(sqlx::types::Json(&event.data))
        .execute(&mut *tx)
        .await?;
    if event.kind == "charge.refunded" {
        if let Some(charge_id) = event.data.get("charge_id").and_then(|v| v.as_str()) {
            sqlx::query("UPDATE charges SET refunded_by_provider = true WHERE id = $1")
                .bind(charge_id)
                .execute(&mut *tx)
                .await?;
        }
    }
    if !config.webhook_delay.is_zero() {
        tokio::time::sleep(config.webhook_delay).await;
    }
    Ok(Json(serde_json::json!({ "received": event.id })))
}
