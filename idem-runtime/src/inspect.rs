//! Answering an operator's "did key K of principal P in scope S run, when, and with what
//! status?".

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use sqlx::Row;

use crate::Idempotency;

/// A committed idempotency record, as [`Idempotency::inspect`] finds it. Requests still
/// in flight are invisible: their record commits with them, or never exists.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// When the request that ran committed its transaction's start time.
    pub created_at: SystemTime,
    /// When the record stops being replayed.
    pub expires_at: SystemTime,
    /// Whether `expires_at` has passed (a new request with this key runs afresh).
    pub expired: bool,
    /// The status of the stored response.
    pub status: StatusCode,
    /// The size of the stored response body.
    pub body_bytes: usize,
}

impl Idempotency {
    /// The committed record of `key` (as the client meant it, without sf-string quotes)
    /// for `principal` (`""` when keys are global) in `scope`, if any.
    pub async fn inspect(
        &self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<Option<KeyRecord>, sqlx::Error> {
        let row = sqlx::query(&self.inner.sql.inspect)
            .bind(scope)
            .bind(principal)
            .bind(key)
            .fetch_optional(&self.inner.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let status: i16 = row.try_get("status")?;
        let status = u16::try_from(status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| {
                sqlx::Error::Decode(format!("stored status {status} is not an HTTP status").into())
            })?;
        Ok(Some(KeyRecord {
            created_at: instant(row.try_get("created_at")?),
            expires_at: instant(row.try_get("expires_at")?),
            expired: row.try_get("expired")?,
            status,
            body_bytes: usize::try_from(row.try_get::<i32, _>("body_bytes")?).unwrap_or(0),
        }))
    }
}

fn instant(epoch_seconds: f64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs_f64(epoch_seconds.max(0.0))
}
