//! Webhook deliveries, one endpoint per provider, each verified by its provider's own
//! scheme and taken once:
//!
//! * `POST /webhooks/payments`: the payment provider, [Standard Webhooks]; keyed by the
//!   signed `webhook-id` header.
//! * `POST /webhooks/stripe`: Stripe; keyed by the event's `id`, which the signed body
//!   carries.
//! * `POST /webhooks/github`: GitHub; keyed by the digest of the signed body, since
//!   GitHub signs neither its `X-GitHub-Delivery` id nor a timestamp.
//!
//! [Standard Webhooks]: https://www.standardwebhooks.com/

use std::ffi::OsString;
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use idem::webhook::{GitHub, Scheme, Signed, StandardWebhooks, Stripe, Verifier};
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::{persistent, ApiError, Config};

/// The verifier of `/webhooks/payments`: Standard Webhooks, with the secret of
/// `WEBHOOK_SECRET` and, while rotating, `WEBHOOK_SECRET_PREVIOUS`, each of the form
/// `whsec_<base64>` as Standard Webhooks issues them.
///
/// Unset, `WEBHOOK_SECRET` is a random secret, so that no delivery verifies. Set, it
/// must have the `whsec_` form and decode to at least
/// [`MIN_SECRET_LEN`](idem::webhook::MIN_SECRET_LEN) bytes: a secret pasted without
/// its prefix, or an empty `WEBHOOK_SECRET=`, stops the service at start.
pub fn webhook_verifier(
    current: Option<OsString>,
    previous: Option<OsString>,
) -> Result<Verifier<StandardWebhooks>, String> {
    let checked = |name: &str, secret: OsString| -> Result<Vec<u8>, String> {
        let secret = secret.into_encoded_bytes();
        if secret.starts_with(b"whsec_") {
            Ok(secret)
        } else {
            Err(format!(
                "{name}: a Standard Webhooks secret starts with whsec_ (whsec_<base64>, as the \
                 provider shows it)"
            ))
        }
    };
    let current = match current {
        Some(secret) => checked("WEBHOOK_SECRET", secret)?,
        None => unset("WEBHOOK_SECRET", |random| {
            format!("whsec_{}", hex(&random)).into_bytes()
        })?,
    };
    let verifier = Verifier::new(current).map_err(|error| format!("WEBHOOK_SECRET: {error}"))?;
    match previous {
        Some(secret) => verifier
            .with_secret(checked("WEBHOOK_SECRET_PREVIOUS", secret)?)
            .map_err(|error| format!("WEBHOOK_SECRET_PREVIOUS: {error}")),
        None => Ok(verifier),
    }
}

/// The verifier of a provider whose secret is taken as it is (`STRIPE_WEBHOOK_SECRET`,
/// `GITHUB_WEBHOOK_SECRET`); unset, a random secret that no delivery verifies.
pub fn provider_verifier<S: Scheme>(
    name: &str,
    secret: Option<OsString>,
) -> Result<Verifier<S>, String> {
    let secret = match secret {
        Some(secret) => secret.into_encoded_bytes(),
        None => unset(name, |random| hex(&random).into_bytes())?,
    };
    Verifier::new(secret).map_err(|error| format!("{name}: {error}"))
}

/// A random secret for a variable that is not set, with a warning: an unconfigured
/// service accepts no delivery at all.
fn unset(name: &str, encode: impl Fn([u8; 32]) -> Vec<u8>) -> Result<Vec<u8>, String> {
    use std::io::Read;
    tracing::warn!("{name} is not set: no delivery to its endpoint will verify");
    let mut random = [0; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut random))
        .map_err(|error| format!("no random secret for {name}: {error}"))?;
    Ok(encode(random))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An event from the payment provider, in the Standard Webhooks payload shape. Its id
/// is the signed `webhook-id` header, not a field.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct PaymentEvent {
    /// What happened, such as `charge.refunded`.
    #[serde(rename = "type")]
    pub kind: String,
    /// When it happened, as the provider states it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// The event's details.
    #[serde(default)]
    pub data: Value,
}

/// A Stripe event; only what this service reads.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct StripeEvent {
    /// Stripe's event id, such as `evt_1NG8Du2eZvKYlo2CUI79vXWy`: the idempotency key.
    pub id: String,
    /// The connected account the event concerns (Stripe Connect), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// What happened, such as `payment_intent.succeeded`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The event's object.
    #[serde(default)]
    pub data: Value,
}

/// The account a payment event concerns (`data.account`, as `charge.refunded` names
/// it): its key is kept on that account's shard, beside the charge it updates
/// (`spread`; events that name none spread by their id).
fn payment_account(event: &PaymentEvent) -> Option<&str> {
    event.data.get("account").and_then(Value::as_str)
}

/// The connected account a Stripe event concerns, if it names one.
fn stripe_account(event: &StripeEvent) -> Option<&str> {
    event.account.as_deref()
}

/// Takes a payment provider's event once. Providers redeliver (at least once): a
/// redelivery, even one racing the first, waits for it and gets its 200, so the
/// provider stops; the same `webhook-id` with a different payload is a 422 and a
/// warning in the log.
#[idempotent(scope = "payment_events", ttl = "7d", key = header("webhook-id"), spread = payment_account, concurrency = wait("30s"))]
#[utoipa::path(post, path = "/webhooks/payments", request_body = PaymentEvent, responses(
    (status = 200, description = "The event was taken", body = Object), crate::openapi::Unauthenticated))]
pub(crate) async fn payment_event(
    State(config): State<Arc<Config>>,
    mut tx: Tx,
    Signed(event, ..): Signed<PaymentEvent>,
) -> Result<Json<Value>, ApiError> {
    let id = event_id(&tx);
    let named = persistent(config.pooler);
    record(&mut tx, named, "payments", &id, &event.kind, &event.data).await?;
    if event.kind == "charge.refunded" {
        // By the charge's whole key, account first, as the table is distributed.
        let field = |name: &str| event.data.get(name).and_then(Value::as_str);
        if let (Some(account), Some(charge_id)) = (field("account"), field("charge_id")) {
            sqlx::query(
                "UPDATE charges SET refunded_by_provider = true WHERE account = $1 AND id = $2",
            )
            .bind(account)
            .bind(charge_id)
            .persistent(named)
            .execute(&mut *tx)
            .await?;
        }
    }
    if !config.webhook_delay.is_zero() {
        tokio::time::sleep(config.webhook_delay).await;
    }
    Ok(Json(json!({ "received": id })))
}

/// Takes a Stripe event once, keyed by its `id`: Stripe signs the body (and a
/// timestamp), not an id header.
#[idempotent(scope = "stripe_events", ttl = "7d", key = id, spread = stripe_account, concurrency = wait("30s"))]
#[utoipa::path(post, path = "/webhooks/stripe", request_body = StripeEvent, responses(
    (status = 200, description = "The event was taken", body = Object), crate::openapi::Unauthenticated))]
pub(crate) async fn stripe_event(
    State(config): State<Arc<Config>>,
    mut tx: Tx,
    Signed(event, ..): Signed<StripeEvent, Stripe>,
) -> Result<Json<Value>, ApiError> {
    let named = persistent(config.pooler);
    record(
        &mut tx,
        named,
        "stripe",
        &event.id,
        &event.kind,
        &event.data,
    )
    .await?;
    if !config.webhook_delay.is_zero() {
        tokio::time::sleep(config.webhook_delay).await;
    }
    Ok(Json(json!({ "received": event.id })))
}

/// Takes a GitHub delivery once. GitHub signs only the body, so the key is the body's
/// digest: a redelivery (the same body) replays, while a captured delivery sent again
/// under a fresh, unsigned `X-GitHub-Delivery` id replays too instead of acting twice.
/// The delivery id and the event name are recorded, not trusted as keys.
#[idempotent(scope = "github_deliveries", ttl = "7d", key = digest(body), spread = key, concurrency = wait("30s"))]
#[utoipa::path(post, path = "/webhooks/github", request_body = Object, responses(
    (status = 200, description = "The delivery was taken", body = Object), crate::openapi::Unauthenticated))]
pub(crate) async fn github_event(
    State(config): State<Arc<Config>>,
    headers: HeaderMap,
    mut tx: Tx,
    Signed(payload, ..): Signed<Value, GitHub>,
) -> Result<Json<Value>, ApiError> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map(str::to_owned)
    };
    // Recorded under the delivery's own id when it sent one, else under the key.
    let id = header("x-github-delivery").unwrap_or_else(|| event_id(&tx));
    let kind = header("x-github-event").unwrap_or_else(|| "unknown".to_owned());
    let named = persistent(config.pooler);
    record(&mut tx, named, "github", &id, &kind, &payload).await?;
    if !config.webhook_delay.is_zero() {
        tokio::time::sleep(config.webhook_delay).await;
    }
    Ok(Json(json!({ "received": id, "event": kind })))
}

/// The key the delivery is claimed under; an endpoint with a required key always has one.
fn event_id(tx: &Tx<'_>) -> String {
    tx.idempotency_key().unwrap_or_default().to_owned()
}

/// One row per event and provider: the business effect the tests count, kept under the
/// value the event's key is kept under (`tenant`, the table's distribution column), so
/// that it commits on the key's node. `named`: see [`persistent`].
async fn record(
    tx: &mut Tx<'_>,
    named: bool,
    provider: &str,
    id: &str,
    kind: &str,
    payload: &Value,
) -> Result<(), sqlx::Error> {
    let tenant = tx.principal().unwrap_or_default().to_owned();
    sqlx::query(
        "INSERT INTO webhook_events (tenant, provider, id, type, payload) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(tenant)
        .bind(provider)
        .bind(id)
        .bind(kind)
        .bind(sqlx::types::Json(payload))
        .persistent(named)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
