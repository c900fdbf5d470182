//! What the broker consumers share: a received event, and what to do with a delivery
//! once its work ran (or could not).
//!
//! A consumer acknowledges a message only after its work committed (or replayed a
//! committed result), so a consumer killed between the commit and the ack gets the
//! message again, [`Store::run_once`](crate::Store::run_once) replays the stored result, and the redelivery is
//! acknowledged: the effect happened once.
//!
//! A delivery that did not succeed is one of three things (invariant 10: transient is
//! never final):
//!
//! - *transient*: it failed for a reason outside the message that can pass, whatever the
//!   message (the database unreachable or shutting down, a serialization failure or a
//!   deadlock, a key another delivery is running, a broker that refused a dead letter).
//!   It is tried again after a backoff that grows to a cap, for as long as the failure
//!   lasts, and it never counts toward the delivery limit: an outage of the database is
//!   not a fault of the events in flight.
//! - *failed*: the work itself failed (its `Err`, a statement it let fail, a commit its
//!   own writes broke). Tried again after a delay, and counted: at the consumer's
//!   delivery limit it is dead.
//! - *dead*: it can never succeed (no id, a body that does not decode as the event, the
//!   same id with another payload, a result that cannot be stored), or its work failed up
//!   to the limit. It goes to the dead-letter path with a log line saying why; nothing is
//!   retried.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::once::{OnceError, RunOnce};
use crate::sqlstate;
use crate::sqlstate::is_unavailable;
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

    /// How many times it has been delivered, this delivery included (1 the first time):
    /// the server's count on JetStream; on AMQP the queue's, where it counts deliveries
    /// (quorum queues), else 1 plus the failures of its work this consumer counted.
    pub fn delivered(&self) -> u32 {
        self.delivered
    }
}

impl<T: Serialize> Received<T> {
    /// [`Store::run_once`](crate::Store::run_once) keyed by the event's id, with its payload: a redelivery, or a
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
    /// Failed for a reason that can pass, whatever the message: try again after the
    /// backoff, for as long as it lasts, without counting it.
    Transient(String),
    /// The work itself failed: try again, counted toward the delivery limit.
    Failed(String),
    /// Can never succeed: the dead-letter path, with the reason.
    Dead(String),
}

impl Verdict {
    /// The verdict on a work's result.
    pub(crate) fn of<R, E: fmt::Display + 'static>(result: &Result<R, OnceError<E>>) -> Self {
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
            OnceError::InUse | OnceError::Unavailable(_) => Self::Transient(error.to_string()),
            OnceError::Database(e) if passes(e) => Self::Transient(error.to_string()),
            // The work's own error is its own failure, unless it is the database's
            // answer to every statement of the moment (the work's statement met the
            // outage first). Only a `sqlx::Error` can be read so.
            OnceError::Work(e)
                if (e as &dyn Any)
                    .downcast_ref::<sqlx::Error>()
                    .is_some_and(passes) =>
            {
                Self::Transient(error.to_string())
            }
            OnceError::Work(_)
            | OnceError::Database(_)
            | OnceError::Escaped
            | OnceError::Aborted => Self::Failed(error.to_string()),
        }
    }

    /// A failure of the work that is its `failures`-th reaches the limit `max` and is
    /// dead; nothing else is limited (a transient failure is never counted).
    pub(crate) fn limited(self, failures: u32, max: Option<u32>) -> Self {
        match (self, max) {
            (Self::Failed(reason), Some(max)) if failures >= max => Self::Dead(format!(
                "the work failed {failures} times, the most allowed; the last failure: {reason}"
            )),
            (verdict, _) => verdict,
        }
    }
}

/// Whether a database error can pass with time, whatever the statement and the message:
/// the server unreachable, restarting or shutting down ([`is_unavailable`]); the
/// transaction rolled back to let a concurrent one through (class 40: a serialization
/// failure, a deadlock); the server out of a resource (class 53: connections, memory,
/// disk); a lock not available now (55P03), or an object in use (55006); a server in
/// recovery or a standby that refuses writes (25006, as during a failover); an I/O error
/// of the server (class 58). A statement timeout (57014) is not among them: a work that
/// is too slow for its timeout is too slow every time.
pub(crate) fn passes(error: &sqlx::Error) -> bool {
    if is_unavailable(error) {
        return true;
    }
    let sqlx::Error::Database(e) = error else {
        return false;
    };
    e.code().is_some_and(|code| {
        matches!(code.get(..2), Some("40" | "53" | "58"))
            || matches!(
                &*code,
                sqlstate::LOCK_NOT_AVAILABLE
                    | sqlstate::OBJECT_IN_USE
                    | sqlstate::READ_ONLY_SQL_TRANSACTION
            )
    })
}

/// The pause after the `attempts`-th failure in a row: `first` doubled `attempts - 1`
/// times, at most `max` (as the relay's).
pub(crate) fn backoff((first, max): (Duration, Duration), attempts: u32) -> Duration {
    let doublings = attempts.saturating_sub(1).min(30);
    first.saturating_mul(1 << doublings).min(max)
}

/// Decodes one delivery's body, or says why it is dead: it carries no id (`missing` says
/// what is missing), or its body does not decode as `T`.
fn decode<T: DeserializeOwned>(
    id: Option<&str>,
    missing: impl FnOnce() -> String,
    topic: &str,
    body: &[u8],
    delivered: u32,
) -> Result<Received<T>, String> {
    let Some(id) = id else {
        return Err(missing());
    };
    let payload =
        serde_json::from_slice::<T>(body).map_err(|e| format!("the body does not decode: {e}"))?;
    Ok(Received {
        id: id.to_owned(),
        topic: topic.to_owned(),
        payload,
        delivered,
    })
}

/// The verdict on one delivery: dead when it does not [decode](decode), otherwise what
/// `handle`'s work made of it (not yet [limited](Verdict::limited)).
pub(crate) async fn judge<T, F, Fut, R, E>(
    id: Option<&str>,
    missing: impl FnOnce() -> String,
    topic: &str,
    body: &[u8],
    delivered: u32,
    handle: &mut F,
) -> Verdict
where
    T: DeserializeOwned,
    F: FnMut(Received<T>) -> Fut,
    Fut: Future<Output = Result<R, OnceError<E>>>,
    E: fmt::Display + 'static,
{
    match decode(id, missing, topic, body, delivered) {
        Err(reason) => Verdict::Dead(reason),
        Ok(received) => Verdict::of(&handle(received).await),
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
    use std::borrow::Cow;
    use std::error::Error as StdError;

    use sqlx::error::{DatabaseError, ErrorKind};

    use super::*;

    /// A database error with a SQLSTATE, as PostgreSQL answers it.
    #[derive(Debug)]
    struct Sqlstate(&'static str);

    impl fmt::Display for Sqlstate {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl StdError for Sqlstate {}

    impl DatabaseError for Sqlstate {
        fn message(&self) -> &str {
            self.0
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn StdError + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn StdError + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> ErrorKind {
            ErrorKind::Other
        }
    }

    fn sqlstate(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Sqlstate(code)))
    }

    fn verdict<E: fmt::Display + 'static>(error: OnceError<E>) -> Verdict {
        Verdict::of(&Err::<(), _>(error))
    }

    #[test]
    fn what_can_never_succeed_is_dead() {
        assert_eq!(Verdict::of(&Ok::<(), OnceError<String>>(())), Verdict::Ack);
        assert_eq!(
            verdict(OnceError::<String>::Mismatch),
            Verdict::Dead("an event with this id was processed before with another payload".into())
        );
        assert!(matches!(
            verdict(OnceError::<String>::Unreadable),
            Verdict::Dead(_)
        ));
        let result = serde_json::from_str::<u8>("x").unwrap_err();
        assert!(matches!(
            verdict(OnceError::<String>::Result(result)),
            Verdict::Dead(_)
        ));
    }

    #[test]
    fn what_can_pass_is_transient_and_never_limited() {
        let transient = [
            verdict(OnceError::<String>::InUse),
            verdict(OnceError::<String>::Unavailable(sqlx::Error::PoolTimedOut)),
            // A failover: the server shuts down (57P01), a standby refuses writes.
            verdict(OnceError::<String>::Database(sqlstate("57P01"))),
            verdict(OnceError::<String>::Database(sqlstate("25006"))),
            verdict(OnceError::<String>::Database(sqlstate("40001"))),
            verdict(OnceError::<String>::Database(sqlstate("53300"))),
            // The work's own statement met the outage first.
            verdict(OnceError::Work(sqlx::Error::Io(std::io::Error::from(
                std::io::ErrorKind::ConnectionReset,
            )))),
            verdict(OnceError::Work(sqlstate("40P01"))),
            verdict(OnceError::Work(sqlstate("08006"))),
        ];
        for verdict in transient {
            assert!(matches!(verdict, Verdict::Transient(_)), "{verdict:?}");
            // However many times it happened.
            assert_eq!(verdict.clone().limited(u32::MAX, Some(1)), verdict);
        }
    }

    #[test]
    fn the_works_own_failure_counts_to_the_limit() {
        let failed = [
            verdict(OnceError::Work("down".to_owned())),
            // A `sqlx::Error` of the work that no retry changes.
            verdict(OnceError::Work(sqlx::Error::Protocol(
                "a negative credit".into(),
            ))),
            verdict(OnceError::Work(sqlstate("23505"))),
            // Too slow for its statement timeout: every time.
            verdict(OnceError::Work(sqlstate("57014"))),
            verdict(OnceError::<String>::Database(sqlstate("23514"))),
            verdict(OnceError::<String>::Escaped),
            verdict(OnceError::<String>::Aborted),
        ];
        for verdict in failed {
            assert!(matches!(verdict, Verdict::Failed(_)), "{verdict:?}");
        }
        let work = verdict(OnceError::Work("down".to_owned()));
        assert_eq!(
            work.clone().limited(5, Some(5)),
            Verdict::Dead(
                "the work failed 5 times, the most allowed; the last failure: the work failed and was rolled back: down".into()
            )
        );
        assert!(matches!(
            work.clone().limited(4, Some(5)),
            Verdict::Failed(_)
        ));
        assert!(matches!(work.limited(99, None), Verdict::Failed(_)));
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap() {
        let ms = Duration::from_millis;
        let pauses: Vec<_> = (1..=6).map(|n| backoff((ms(100), ms(1_000)), n)).collect();
        assert_eq!(
            pauses,
            [ms(100), ms(200), ms(400), ms(800), ms(1_000), ms(1_000)]
        );
        // No overflow however long an outage lasts.
        assert_eq!(backoff((ms(100), ms(1_000)), u32::MAX), ms(1_000));
        assert_eq!(backoff((ms(100), ms(1_000)), 0), ms(100));
    }

    #[tokio::test]
    async fn a_delivery_without_an_id_or_a_decodable_body_is_dead_before_any_work() {
        let mut ran = 0;
        let mut handle = |_: Received<u8>| {
            ran += 1;
            async { Ok::<(), OnceError<String>>(()) }
        };
        let no_id = judge(None, || "no id".into(), "t", b"1", 1, &mut handle).await;
        assert_eq!(no_id, Verdict::Dead("no id".into()));
        let bad = judge(Some("a"), || "no id".into(), "t", b"x", 1, &mut handle).await;
        assert!(matches!(&bad, Verdict::Dead(r) if r.starts_with("the body does not decode")));
        let good = judge(Some("a"), || "no id".into(), "t", b"1", 1, &mut handle).await;
        assert_eq!((good, ran), (Verdict::Ack, 1));
    }
}
