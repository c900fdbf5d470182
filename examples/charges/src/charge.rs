//! Charges and refunds: `POST /charges`, `GET /charges/{id}`, `POST /charges/{id}/refunds`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idem::{idempotent, Problem, Tx};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use crate::{problem_type, Account, ApiError, Config};

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
    created_at: String,
}

const CHARGE_COLUMNS: &str = "id, account, amount, currency, customer, description, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS created_at";

/// Creates a charge. The key, the charge row and this response commit together.
#[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer])]
#[utoipa::path(post, path = "/charges", request_body = NewCharge, security(("bearer" = [])), responses(
    (status = 201, description = "The charge", body = Charge, headers(("Location" = String))), crate::openapi::Unauthenticated))]
pub(crate) async fn create_charge(
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
#[utoipa::path(get, path = "/charges/{id}", params(("id" = String, Path)), security(("bearer" = [])), responses(
    (status = 200, description = "The charge", body = Charge), crate::openapi::Unauthenticated, crate::openapi::NotFound))]
pub(crate) async fn get_charge(
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
    created_at: String,
}

/// Refunds part of a charge. The charge id is part of the fingerprint (a path
/// parameter), so one key used on another charge is refused with 422.
#[idempotent(scope = "refunds", ttl = "24h", fields = [amount])]
#[utoipa::path(post, path = "/charges/{id}/refunds", params(("id" = String, Path)), request_body = NewRefund, security(("bearer" = [])), responses(
    (status = 201, description = "The refund", body = Refund), crate::openapi::Unauthenticated, crate::openapi::NotFound))]
pub(crate) async fn create_refund(
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
