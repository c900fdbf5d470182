//! An outbox event's failed publishes: the last ten, each with its time, kept on the
//! event's row by the relay (`error_at`, `errors`) and through a re-drive, so that an
//! operator sees whether a dead event always failed the same way before re-driving it.

use super::Operate;
use std::time::SystemTime;

use serde::Serialize;

use super::{instant, rfc3339};

/// One failed publish of an outbox event ([`Operate::event_errors`](crate::operate::Operate::event_errors)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct FailedPublish {
    /// When the relay recorded the failure.
    #[serde(serialize_with = "rfc3339")]
    pub at: SystemTime,
    /// What the publisher answered (or the relay's own reason: a timeout, a panic).
    pub error: String,
}

impl Operate<'_> {
    /// The last ten failed publishes of the outbox event `id` (a pending or a dead one),
    /// oldest first; none for an event that never failed, or that is gone (published, or
    /// discarded). Its latest is also its `last_error`.
    pub async fn event_errors(self, id: &str) -> Result<Vec<FailedPublish>, sqlx::Error> {
        let single = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let errors = self.store.inner.outbox.errors(single, id).await?;
        Ok(errors
            .into_iter()
            .map(|(at, error)| FailedPublish {
                at: instant(at),
                error,
            })
            .collect())
    }
}
