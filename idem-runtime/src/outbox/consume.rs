//! What the broker consumers share: a received event, and what to do with a delivery
//! once its work ran (or could not).
//!
//! A consumer acknowledges a message only after its work committed (or replayed a
//! committed result), so a consumer killed between the commit and the ack gets the
//! message again, [`Store::run_once`] replays the stored result, and the redelivery is
//! acknowledged: the effect happened once. A failure that can pass is redelivered after a
//! delay (a bare negative acknowledgement redelivers at once and burns through a
//! broker's delivery limit in milliseconds); one that never can (a body that does not
//! decode, the same id with another payload) goes to the dead-letter path with a log line
//! saying why, and so does a message that has reached the delivery limit.

use std::fmt;
use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::once::{OnceError, RunOnce};
use crate::store::Store;

/// An event a consumer received: its id (the broker's deduplication id), where it came
/// from, its decoded payload, and how many times it has been delivered.
#[derive(Debug, Clone)]
pub struct Received<T> {
    pub(crate) id: String,
    pub(crate) topic: String,
    pub(crate) payload: T,
    pub(crate) delivered: u32,
}

impl<T> Received<T> {
    /// The event's id: `Nats-Msg-Id` on JetStream, `message_id` on AMQP (or the header
    /// the consumer was told to read).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The subject or routing key it came on.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The decoded payload.
    pub fn payload(&self) -> &T {
        &self.payload
    }

    /// How many times the broker has delivered it, this delivery included (1 the first
    /// time; on AMQP, 1 unless the queue counts deliveries, as quorum queues do).
    pub fn delivered(&self) -> u32 {
        self.delivered
    }
}

impl<T: Serialize> Received<T> {
    /// [`Store::run_once`] keyed by the event's id, with its payload: a redelivery, or a
    /// second copy published after the broker's deduplication window, replays instead of
    /// running again; the same id with another payload is refused
    /// ([`OnceError::Mismatch`], sent to the dead-letter path).
    pub fn once<'s>(&self, store: &'s Store, scope: &str) -> RunOnce<'s> {
        store.run_once(scope, &self.id).payload(&self.payload)
    }
}

/// What a consumer does with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Done (committed now or before): acknowledge.
    Ack,
    /// May succeed later: redeliver after the consumer's delay.
    Retry(String),
    /// Can never succeed: the dead-letter path, with the reason.
    Dead(String),
}

impl Verdict {
    /// The verdict on a work's result.
    pub(crate) fn of<R, E: fmt::Display>(result: &Result<R, OnceError<E>>) -> Self {
        let Err(error) = result else {
            return Self::Ack;
        };
        match error {
            OnceError::Mismatch => {
                Self::Dead("an event with this id was processed before with another payload".into())
            }
            OnceError::Key(_)
            | OnceError::Scope(_)
            | OnceError::Payload(_)
            | OnceError::Result(_)
            | OnceError::Unreadable => Self::Dead(error.to_string()),
            OnceError::Work(_)
            | OnceError::InUse
            | OnceError::Unavailable(_)
            | OnceError::Database(_)
            | OnceError::Escaped
            | OnceError::Aborted => Self::Retry(error.to_string()),
        }
    }

    /// A retry of a delivery that reached the limit goes to the dead-letter path.
    pub(crate) fn limited(self, delivered: u32, max_deliver: Option<u32>) -> Self {
        match (self, max_deliver) {
            (Self::Retry(reason), Some(max)) if delivered >= max => Self::Dead(format!(
                "delivered {delivered} times, the most allowed; the last failure: {reason}"
            )),
            (verdict, _) => verdict,
        }
    }
}

/// The verdict on one delivery: dead when it carries no id (`missing` says what is
/// missing) or its body does not decode as `T`; otherwise what `handle`'s work made of
/// it, a retry of a delivery that reached `max_deliver` being dead too.
pub(crate) async fn judge<T, F, Fut, R, E>(
    id: Option<String>,
    missing: impl FnOnce() -> String,
    topic: &str,
    body: &[u8],
    delivered: u32,
    max_deliver: Option<u32>,
    handle: &mut F,
) -> Verdict
where
    T: DeserializeOwned,
    F: FnMut(Received<T>) -> Fut,
    Fut: Future<Output = Result<R, OnceError<E>>>,
    E: fmt::Display,
{
    let Some(id) = id else {
        return Verdict::Dead(missing());
    };
    match serde_json::from_slice::<T>(body) {
        Err(e) => Verdict::Dead(format!("the body does not decode: {e}")),
        Ok(payload) => {
            let received = Received {
                id,
                topic: topic.to_owned(),
                payload,
                delivered,
            };
            Verdict::of(&handle(received).await).limited(delivered, max_deliver)
        }
    }
}

/// The log line of a message sent to the dead-letter path.
pub(crate) fn log_dead(id: &str, topic: &str, reason: &str) {
    tracing::error!(
        event_id = id,
        topic,
        reason,
        "idem: message sent to the dead-letter path; it can never succeed"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_can_never_succeed_is_dead_and_the_rest_is_retried() {
        let ok: Result<(), OnceError<String>> = Ok(());
        assert_eq!(Verdict::of(&ok), Verdict::Ack);
        let mismatch: Result<(), OnceError<String>> = Err(OnceError::Mismatch);
        assert!(matches!(Verdict::of(&mismatch), Verdict::Dead(_)));
        let in_use: Result<(), OnceError<String>> = Err(OnceError::InUse);
        assert!(matches!(Verdict::of(&in_use), Verdict::Retry(_)));
        let work: Result<(), OnceError<String>> = Err(OnceError::Work("down".into()));
        assert_eq!(
            Verdict::of(&work).limited(5, Some(5)),
            Verdict::Dead(
                "delivered 5 times, the most allowed; the last failure: the work failed and was rolled back: down".into()
            )
        );
        assert!(matches!(
            Verdict::of(&work).limited(4, Some(5)),
            Verdict::Retry(_)
        ));
        assert!(matches!(
            Verdict::of(&work).limited(99, None),
            Verdict::Retry(_)
        ));
    }
}
