//! Charges and refunds: `POST /charges`, `GET /charges/{id}`, `POST /charges/{id}/refunds`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idem::{idempotent, Pooler, Problem, Tx};
use serde::{Deserialize, Serialize, Serializer};
use sqlx::types::time::{OffsetDateTime, UtcOffset};
use sqlx::{PgConnection, PgPool};

use crate::events::ChargeEvent;
use crate::processor::{Outcome, ProcessorCharge};
use crate::{persistent, problem_type, Account, ApiError, Config};

/// The body of `POST /charges`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct NewCharge {
    /// In the currency's smallest unit; positive.
    #[schema(minimum = 1)]
    pub amount: i64,
    /// Three ASCII letters, such as `usd`; lower-cased as it is read, so that `"USD"`
    /// and `"usd"` are one fingerprint and a retry that changes the case replays.
    #[serde(deserialize_with = "lower_case")]
    #[schema(pattern = "^[A-Za-z]{3}$")]
    pub currency: String,
    /// Who is charged; not blank.
    #[schema(min_length = 1, pattern = "\\S")]
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
#[derive(Debug, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Charge {
    id: String,
    account: String,
    amount: i64,
    currency: String,
    customer: String,
    description: Option<String>,
    /// The payment processor's id of the charge; absent when the service runs without
    /// one (`PROCESSOR_URL`).
    #[serde(skip_serializing_if = "Option::is_none")]
    processor_id: Option<String>,
    #[serde(serialize_with = "utc_micros")]
    #[schema(value_type = String, format = DateTime, example = "2026-11-23T17:00:00.123456Z")]
    created_at: OffsetDateTime,
}

/// The columns of a [`Charge`], as stored: formatting is done here, not in SQL, so that
/// `RETURNING` calls no function (a distributed engine refuses non-immutable ones there,
/// and `to_char` of a `timestamptz` depends on the session's time zone). A macro, so that
/// each statement stays one `&'static str` (sqlx 0.9 takes other text only through
/// `AssertSqlSafe`).
macro_rules! charge_columns {
    () => {
        "id, account, amount, currency, customer, description, processor_id, created_at"
    };
}

/// A timestamp as answered: RFC 3339 in UTC, with PostgreSQL's microseconds
/// (`2026-11-23T17:00:00.123456Z`), always six digits so that every answer has one shape.
fn utc_micros<S: Serializer>(at: &OffsetDateTime, serializer: S) -> Result<S::Ok, S::Error> {
    let at = at.to_offset(UtcOffset::UTC);
    serializer.collect_str(&format_args!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.microsecond()
    ))
}

/// Creates a charge. The key, the charge row and this response commit together. With a
/// payment processor, the charge is made there first, in a step: its answer is recorded
/// before the row is written, so a retry after a failure or a crash resumes from it
/// instead of charging again (see `processor.rs` for what each answer becomes).
///
/// Completable: a charge whose client went away after the processor's answer is finished
/// by the service itself, `COMPLETE_AFTER_MS` after its step (`idem::complete`).
#[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer], completable = true)]
#[utoipa::path(post, path = "/charges", request_body = NewCharge, security(("bearer" = [])), responses(
    (status = 201, description = "The charge", body = Charge, headers(("Location" = String))), crate::openapi::Unauthenticated, crate::openapi::ProcessorProblems))]
pub(crate) async fn create_charge(
    State(config): State<Arc<Config>>,
    Extension(account): Extension<Account>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<Response, ApiError> {
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
    // The processor's call cannot be rolled back with this transaction: as a step, it
    // runs once per request, with a key of its own that the processor dedupes on, and
    // its answer is recorded (outside this transaction) before the charge is written.
    let processor_id = match &config.processor {
        Some(processor) => {
            let charge = ProcessorCharge {
                amount: req.amount,
                currency: &req.currency,
                customer: &req.customer,
            };
            let outcome = tx
                .step("processor", |key| async move {
                    processor.charge(&key, &charge).await
                })
                .await?;
            match outcome {
                Outcome::Charged { id } => Some(id),
                // The processor's final word: `Ok`, so it commits and retries replay it.
                Outcome::Declined { status, message } => {
                    let detail = match message {
                        Some(message) => {
                            format!(
                                "the payment processor refused the charge ({status}): {message}"
                            )
                        }
                        None => format!("the payment processor refused the charge ({status})"),
                    };
                    let problem = Problem::new(
                        StatusCode::PAYMENT_REQUIRED,
                        problem_type("payment-declined"),
                        "Payment declined",
                    )
                    .with_detail(detail);
                    return Ok(problem.into_response());
                }
            }
        }
        None => None,
    };

    let charge: Charge = sqlx::query_as(concat!(
        "INSERT INTO charges (account, amount, currency, customer, description, processor_id) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING ",
        charge_columns!()
    ))
    .bind(&account.0)
    .bind(req.amount)
    .bind(&req.currency)
    .bind(&req.customer)
    .bind(&req.description)
    .bind(&processor_id)
    .persistent(persistent(config.pooler))
    .fetch_one(&mut *tx)
    .await?;

    // A slow handler, inside the transaction and after the processor's call: what a
    // crash or a duplicate meets while the request is in flight.
    if !config.processor_delay.is_zero() {
        tokio::time::sleep(config.processor_delay).await;
    }

    // Recorded in this transaction, published after the commit by the relay: a retry
    // that replays emits nothing, a request that fails emits nothing at all.
    if let Some(prefix) = &config.events {
        let event = ChargeEvent {
            kind: "charge.created".into(),
            charge_id: charge.id.clone(),
            refund_id: None,
            account: account.0.clone(),
            amount: charge.amount,
        };
        tx.emit(event.event(prefix)).await?;
    }

    let location = format!("/charges/{}", charge.id);
    Ok((StatusCode::CREATED, [(LOCATION, location)], Json(charge)).into_response())
}

/// Reads one charge of the caller's account.
#[utoipa::path(get, path = "/charges/{id}", params(("id" = String, Path)), security(("bearer" = [])), responses(
    (status = 200, description = "The charge", body = Charge), crate::openapi::Unauthenticated, crate::openapi::NotFound))]
pub(crate) async fn get_charge(
    State(pool): State<PgPool>,
    State(config): State<Arc<Config>>,
    Extension(account): Extension<Account>,
    Path(id): Path<String>,
) -> Result<Json<Charge>, ApiError> {
    // No id holds a NUL, and PostgreSQL's text cannot take one: no such charge.
    if id.contains('\0') {
        return Err(ApiError::not_found("charge"));
    }
    let charge = if config.pooler == Pooler::Transaction {
        // sqlx parses a statement and runs it in two exchanges; a transaction pooler
        // keeps one client on one server connection only inside a transaction.
        let mut tx = pool.begin().await?;
        let charge = read_charge(&mut tx, &account, &id, config.pooler).await?;
        tx.commit().await?;
        charge
    } else {
        read_charge(&mut *pool.acquire().await?, &account, &id, config.pooler).await?
    };
    charge
        .map(Json)
        .ok_or_else(|| ApiError::not_found("charge"))
}

/// The charge `id` of `account`, if there is one.
async fn read_charge(
    conn: &mut PgConnection,
    account: &Account,
    id: &str,
    pooler: Pooler,
) -> Result<Option<Charge>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT ",
        charge_columns!(),
        " FROM charges WHERE account = $1 AND id = $2"
    ))
    .bind(&account.0)
    .bind(id)
    .persistent(persistent(pooler))
    .fetch_optional(conn)
    .await
}

/// The body of `POST /charges/{id}/refunds`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct NewRefund {
    /// Positive, at most what remains of the charge.
    #[schema(minimum = 1)]
    pub amount: i64,
}

/// A refund, as answered.
#[derive(Debug, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Refund {
    id: String,
    charge_id: String,
    amount: i64,
    #[serde(serialize_with = "utc_micros")]
    #[schema(value_type = String, format = DateTime, example = "2026-11-23T17:00:00.123456Z")]
    created_at: OffsetDateTime,
}

/// Refunds part of a charge. The charge id is part of the fingerprint (a path
/// parameter), so one key used on another charge is refused with 422.
#[idempotent(scope = "refunds", ttl = "24h", fields = [amount])]
#[utoipa::path(post, path = "/charges/{id}/refunds", params(("id" = String, Path)), request_body = NewRefund, security(("bearer" = [])), responses(
    (status = 201, description = "The refund", body = Refund), crate::openapi::Unauthenticated, crate::openapi::NotFound))]
pub(crate) async fn create_refund(
    State(config): State<Arc<Config>>,
    Extension(account): Extension<Account>,
    Path(charge_id): Path<String>,
    mut tx: Tx,
    Json(req): Json<NewRefund>,
) -> Result<Response, ApiError> {
    if req.amount <= 0 {
        return Err(ApiError::invalid("amount must be a positive integer"));
    }
    let Some(remaining) = lock_remaining(&mut tx, &account, &charge_id, config.pooler).await?
    else {
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
        "INSERT INTO refunds (account, charge_id, amount) VALUES ($1, $2, $3) \
         RETURNING id, charge_id, amount, created_at",
    )
    .bind(&account.0)
    .bind(&charge_id)
    .bind(req.amount)
    .persistent(persistent(config.pooler))
    .fetch_one(&mut *tx)
    .await?;
    if let Some(prefix) = &config.events {
        let event = ChargeEvent {
            kind: "charge.refunded".into(),
            charge_id: refund.charge_id.clone(),
            refund_id: Some(refund.id.clone()),
            account: account.0.clone(),
            amount: refund.amount,
        };
        tx.emit(event.event(prefix)).await?;
    }
    Ok((StatusCode::CREATED, Json(refund)).into_response())
}

/// Locks the charge row and returns what remains to refund, or `None` if the account has
/// no such charge. The lock serializes refunds of one charge, whatever their keys.
async fn lock_remaining(
    conn: &mut PgConnection,
    account: &Account,
    charge_id: &str,
    pooler: Pooler,
) -> Result<Option<i64>, sqlx::Error> {
    let amount: Option<i64> =
        sqlx::query_scalar("SELECT amount FROM charges WHERE account = $1 AND id = $2 FOR UPDATE")
            .bind(&account.0)
            .bind(charge_id)
            .persistent(persistent(pooler))
            .fetch_optional(&mut *conn)
            .await?;
    let Some(amount) = amount else {
        return Ok(None);
    };
    // A separate statement, so its snapshot is taken after the lock was granted and sees
    // the refunds committed by whoever held the lock before us (READ COMMITTED).
    let refunded: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(amount), 0)::bigint FROM refunds \
         WHERE account = $1 AND charge_id = $2",
    )
    .bind(&account.0)
    .bind(charge_id)
    .persistent(persistent(pooler))
    .fetch_one(&mut *conn)
    .await?;
    Ok(Some(amount - refunded))
}
