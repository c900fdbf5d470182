//! Webhook deliveries from the payment provider: `POST /webhooks/payments`.

use std::ffi::OsString;
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use idem::webhook::{Custom, Signed, WebhookSecretError, WebhookVerifier};
use idem::{idempotent, Tx};
use serde::{Deserialize, Serialize};

use crate::{ApiError, Config};

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
    let verifier = WebhookVerifier::new(current)
        .map_err(|error| refused("WEBHOOK_SECRET", error))?
        .header(axum::http::HeaderName::from_static("webhook-signature"));
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

/// An event from the payment provider.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
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
#[utoipa::path(post, path = "/webhooks/payments", request_body = PaymentEvent, responses(
    (status = 200, description = "The event was taken", body = Object), crate::openapi::Unauthenticated))]
pub(crate) async fn payment_event(
    State(config): State<Arc<Config>>,
    mut tx: Tx,
    Signed(event, ..): Signed<PaymentEvent, Custom>,
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
