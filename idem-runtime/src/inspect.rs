//! Answering an operator's "did key K of principal P in scope S run, when, and with what
//! status?".

use std::time::SystemTime;

use http::StatusCode;

use crate::Store;

/// A committed idempotency record, as [`Store::inspect`] finds it. Requests still
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

impl Store {
    /// The committed record of `key` (as the client meant it, without sf-string quotes)
    /// for `principal` (`""` when keys are global) in `scope`, if any.
    pub async fn inspect(
        &self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<Option<KeyRecord>, sqlx::Error> {
        let found = self
            .inner
            .table
            .inspect(&self.inner.pool, [scope, principal, key]);
        let Some(row) = found.await? else {
            return Ok(None);
        };
        let status = u16::try_from(row.status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| {
                sqlx::Error::Decode(
                    format!("stored status {} is not an HTTP status", row.status).into(),
                )
            })?;
        Ok(Some(KeyRecord {
            created_at: row.created_at,
            expires_at: row.expires_at,
            expired: row.expired,
            status,
            body_bytes: row.body_bytes,
        }))
    }
}
