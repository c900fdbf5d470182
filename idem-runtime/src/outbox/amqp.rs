//! AMQP 0.9.1 (RabbitMQ): a [`Publisher`] for the relay, and a consumer that runs each
//! event's work once.
//!
//! The publisher publishes to one exchange with the event's topic as the routing key,
//! its id as `message_id`, persistent, `mandatory`, on a channel in confirm mode, and
//! counts a publish as done only when the broker confirmed it *and* did not return it: a
//! confirmed `mandatory` message that no queue was bound for comes back as a returned
//! message, which is not a success (the event is retried, then parked). RabbitMQ does not
//! deduplicate on `message_id`: a republish after a crash is a second message, and the
//! consumer's [`Store::run_once`](crate::Store::run_once) keyed by the id keeps the
//! effect single.
//!
//! The consumer acknowledges only after the work committed. AMQP has no delayed negative
//! acknowledgement, so a delivery that failed is held for a pause, then requeued:
//!
//! - a failure that can pass (the database unreachable, a key in use ...) is requeued
//!   after a backoff that grows while such failures follow each other (`retry_delay`
//!   doubling up to `max_retry_delay`, back to `retry_delay` once a delivery gets
//!   through), for as long as they last, and never counts toward `max_deliver`;
//! - a failure of the work itself is requeued after `retry_delay`, and counts: at
//!   `max_deliver` the message is dead;
//! - what can never succeed, or is dead, is rejected without requeue, which sends it to
//!   the queue's dead-letter exchange (`x-dead-letter-exchange`) with a log line saying
//!   why. A queue without one drops it (the log line is what is left): give the queue a
//!   dead-letter exchange, and a queue it routes to, which [`dead_letters`] reads back
//!   for operators without consuming it.
//!
//! The consumer counts the work's failures itself, by message id: a quorum queue's
//! `x-delivery-count` counts every requeue, those after a transient failure too. It
//! keeps the counts of the last 10 000 ids that failed and were not settled since,
//! forgetting the oldest first: a forgotten id starts from zero again (more tries, never
//! fewer), and so does every id when the consumer restarts. A quorum queue's own
//! `x-delivery-limit` (RabbitMQ 4 sets 20 by default) also counts the requeues after
//! transient failures, and drops or dead-letters the message at it: leave it unset, or
//! `-1` on RabbitMQ 4.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use serde::de::DeserializeOwned;
use tokio::sync::Mutex;

use super::consume::{backoff, judge, log_dead, Verdict};
use super::{OutboxEvent, PublishError, Publisher, Received};
use crate::once::OnceError;

mod dead_letters;

pub use dead_letters::{dead_letters, DeadLetter, DeadLettersError};

/// Publishes outbox events to an AMQP exchange, with publisher confirms. It connects on
/// first use and again after the connection is lost.
pub struct AmqpPublisher {
    uri: String,
    exchange: String,
    channel: Mutex<Option<Channel>>,
}

impl AmqpPublisher {
    /// A publisher to `exchange` (`""`: the default exchange, where the routing key is a
    /// queue's name) of the broker at `uri` (`amqp://user:password@host:5672/vhost`).
    pub fn new(uri: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            uri: uri.into(),
            exchange: exchange.into(),
            channel: Mutex::new(None),
        }
    }

    async fn channel(&self) -> Result<Channel, lapin::Error> {
        let mut slot = self.channel.lock().await;
        if let Some(channel) = slot.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let connection = Connection::connect(&self.uri, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        *slot = Some(channel.clone());
        Ok(channel)
    }
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URI may carry a password.
        f.debug_struct("AmqpPublisher")
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

impl Publisher for AmqpPublisher {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        // No channel says nothing about the event, whatever the cause: the broker
        // unreachable, or refusing this publisher.
        let channel = self
            .channel()
            .await
            .map_err(|e| PublishError::unavailable(format!("AMQP connection: {e}")))?;
        let mut headers = FieldTable::default();
        for (name, value) in &event.headers {
            if let Ok(name) = ShortString::try_new(name.as_str()) {
                headers.insert(name, AMQPValue::LongString(value.as_str().into()));
            }
        }
        let properties = BasicProperties::default()
            .with_message_id(event.id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let confirm = channel
            .basic_publish(
                self.exchange.as_str().into(),
                event.topic.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &event.payload,
                properties,
            )
            .await
            .map_err(|e| publish_failure("AMQP publish", &e))?
            .await
            .map_err(|e| publish_failure("AMQP confirm", &e))?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                Err(PublishError::retry(format!(
                    "returned by the broker: {} {} (no queue is bound for routing key {:?} on exchange {:?})",
                    returned.reply_code, returned.reply_text, event.topic, self.exchange
                )))
            }
            Confirmation::Nack(None) => Err(PublishError::retry("the broker refused the message (nack)")),
            Confirmation::NotRequested => Err(PublishError::permanent(
                "the channel is not in confirm mode",
            )),
        }
    }
}

/// What a failed AMQP publish (`what`: the publish, or its confirm) tells the relay. The
/// connection or channel lost (an I/O error, no heartbeat, the broker closing the
/// connection because it shuts down, lacks resources or failed inside) is
/// [`PublishError::unavailable`]: waited for, never counted. The rest, a channel error
/// the broker raised for this publish (no such exchange, access refused) first among
/// them, is [`PublishError::retry`], parked after the relay's attempts.
fn publish_failure(what: &str, error: &lapin::Error) -> PublishError {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError};
    use lapin::ErrorKind;
    let message = format!("{what}: {error}");
    let unavailable = match error.kind() {
        ErrorKind::IOError(_)
        | ErrorKind::MissingHeartbeatError
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::InvalidChannelState(..)
        | ErrorKind::InvalidChannel(_) => true,
        ErrorKind::ProtocolError(error) => matches!(
            error.kind(),
            AMQPErrorKind::Hard(
                AMQPHardError::CONNECTIONFORCED
                    | AMQPHardError::RESOURCEERROR
                    | AMQPHardError::INTERNALERROR
            )
        ),
        _ => false,
    };
    if unavailable {
        PublishError::unavailable(message)
    } else {
        PublishError::retry(message)
    }
}

/// Consumes events from an AMQP queue, runs each one's work once, and acknowledges after
/// the commit. See the [module's docs](self). One consumer handles one delivery at a
/// time (and holds a failed one for its pause): run several, on channels of their own,
/// for parallel work.
#[must_use = "a consumer does nothing until `.run(..)` is awaited"]
#[derive(Debug)]
pub struct AmqpConsumer {
    channel: Channel,
    queue: String,
    retry_delay: Duration,
    max_retry_delay: Duration,
    max_deliver: Option<u32>,
    prefetch: u16,
}

/// How many message ids with failed work an [`AmqpConsumer`] keeps counts for.
const FAILURES_KEPT: usize = 10_000;

impl AmqpConsumer {
    /// Consumes `queue` on `channel`.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        Self {
            channel,
            queue: queue.into(),
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(10),
            max_deliver: Some(10),
            prefetch: 32,
        }
    }

    /// How long a failed delivery is held before it is requeued (default 1 s); after
    /// failures that can pass, one after the other, it doubles up to
    /// [`max_retry_delay`](Self::max_retry_delay).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The longest pause before a requeue (default 10 s): after an outage, deliveries are
    /// tried again at most this long after the database is back.
    pub fn max_retry_delay(mut self, delay: Duration) -> Self {
        self.max_retry_delay = delay;
        self
    }

    /// After how many failures of its work a message goes to the dead-letter path
    /// (default 10; `None`: never). Failures that can pass do not count. Counted by this
    /// consumer (see the [module's docs](self)).
    pub fn max_deliver(mut self, max: Option<u32>) -> Self {
        self.max_deliver = max;
        self
    }

    /// How many unacknowledged messages the broker sends at once (default 32).
    pub fn prefetch(mut self, count: u16) -> Self {
        self.prefetch = count;
        self
    }

    /// Runs `handle` for each message, decoded as `T`, until the channel closes. As
    /// [`JetStreamConsumer::run`](super::nats::JetStreamConsumer::run) (feature `nats`):
    /// `handle` runs the work, usually `received.once(&store, scope).run(..)`, and its
    /// result decides the acknowledgement.
    pub async fn run<T, F, Fut, R, E>(self, mut handle: F) -> Result<(), lapin::Error>
    where
        T: DeserializeOwned,
        F: FnMut(Received<T>) -> Fut,
        Fut: Future<Output = Result<R, OnceError<E>>>,
        E: fmt::Display + 'static,
    {
        self.channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let mut deliveries = self
            .channel
            .basic_consume(
                self.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut failures = Failures::new(FAILURES_KEPT);
        // Transient failures in a row: how long the outage has lasted.
        let mut transient = 0;
        while let Some(delivery) = deliveries.next().await {
            let delivery = delivery?;
            let topic = delivery.routing_key.to_string();
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string());
            let event_id = id.as_deref().unwrap_or_default();
            let counted = delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("x-delivery-count").and_then(count));
            let delivered = counted
                .unwrap_or_else(|| failures.get(event_id))
                .saturating_add(1);
            let verdict = match judge(
                id.as_deref(),
                || "no message_id".into(),
                &topic,
                &delivery.data,
                delivered,
                &mut handle,
            )
            .await
            {
                Verdict::Failed(reason) => {
                    Verdict::Failed(reason).limited(failures.add(event_id), self.max_deliver)
                }
                verdict => verdict,
            };
            let done = match verdict {
                Verdict::Ack => {
                    transient = 0;
                    failures.forget(event_id);
                    delivery.ack(BasicAckOptions::default()).await
                }
                Verdict::Transient(reason) => {
                    transient += 1;
                    let pause = backoff((self.retry_delay, self.max_retry_delay), transient);
                    tracing::warn!(event_id, topic, ?pause, %reason, "idem: AMQP consumer: a failure that can pass; requeued after a pause (not counted)");
                    tokio::time::sleep(pause).await;
                    delivery.nack(REQUEUE).await
                }
                Verdict::Failed(reason) => {
                    transient = 0;
                    tracing::warn!(event_id, topic, failures = failures.get(event_id), %reason, "idem: AMQP consumer: the work failed; requeued after a pause");
                    tokio::time::sleep(self.retry_delay).await;
                    delivery.nack(REQUEUE).await
                }
                Verdict::Dead(reason) => {
                    failures.forget(event_id);
                    log_dead(event_id, &topic, &reason);
                    delivery.reject(BasicRejectOptions { requeue: false }).await
                }
            };
            if let Err(error) = done {
                // Redelivered when the channel closes; the work replays then.
                tracing::warn!(%error, event_id, "idem: AMQP consumer: acknowledgement failed");
            }
        }
        Ok(())
    }
}

/// A negative acknowledgement that puts the message back in its queue.
const REQUEUE: BasicNackOptions = BasicNackOptions {
    multiple: false,
    requeue: true,
};

/// The failures of the work of each message id that failed and was not settled since,
/// for at most `kept` ids: past that, the id whose last failure is the oldest is
/// forgotten (it starts from zero again: more tries, never fewer).
#[derive(Debug)]
struct Failures {
    /// Failures and the age of the last one, by id.
    counts: HashMap<String, (u32, u64)>,
    /// Ids by the age of their last failure.
    ages: BTreeMap<u64, String>,
    next_age: u64,
    kept: usize,
}

impl Failures {
    fn new(kept: usize) -> Self {
        Self {
            counts: HashMap::new(),
            ages: BTreeMap::new(),
            next_age: 0,
            kept,
        }
    }

    /// The failures counted for `id`.
    fn get(&self, id: &str) -> u32 {
        self.counts.get(id).map_or(0, |&(failures, _)| failures)
    }

    /// Counts one more failure of `id`'s work; how many now.
    fn add(&mut self, id: &str) -> u32 {
        let age = self.next_age;
        self.next_age += 1;
        let failures = match self.counts.get_mut(id) {
            Some((failures, last)) => {
                self.ages.remove(last);
                *last = age;
                *failures = failures.saturating_add(1);
                *failures
            }
            None => {
                self.counts.insert(id.to_owned(), (1, age));
                1
            }
        };
        self.ages.insert(age, id.to_owned());
        while self.counts.len() > self.kept {
            let Some((_, oldest)) = self.ages.pop_first() else {
                break;
            };
            self.counts.remove(&oldest);
        }
        failures
    }

    /// `id` is settled: acknowledged or dead.
    fn forget(&mut self, id: &str) {
        if let Some((_, last)) = self.counts.remove(id) {
            self.ages.remove(&last);
        }
    }
}

/// A delivery count header's value.
fn count(value: &AMQPValue) -> Option<u32> {
    match value {
        AMQPValue::LongLongInt(n) => u32::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u32::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(*n),
        AMQPValue::ShortInt(n) => u32::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u32::from(*n)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError, AMQPSoftError};

    use super::*;

    fn protocol(kind: AMQPErrorKind) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(AMQPError::new(kind, "closed".into())).into()
    }

    /// Invariant 10: a lost connection is waited for (uncounted); what the broker refused
    /// this publish for is counted, and parks after the relay's attempts.
    #[test]
    fn a_lost_connection_is_unavailable_and_a_refusal_counts() {
        for error in [
            lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            lapin::ErrorKind::MissingHeartbeatError.into(),
            lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed).into(),
            lapin::ErrorKind::InvalidChannelState(lapin::ChannelState::Closed, "publish").into(),
            protocol(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED)),
            protocol(AMQPErrorKind::Hard(AMQPHardError::INTERNALERROR)),
        ] {
            let failure = publish_failure("AMQP confirm", &error);
            assert!(failure.is_unavailable(), "{error:?}: {failure:?}");
            assert!(failure.message().starts_with("AMQP confirm: "), "{failure}");
        }
        for error in [
            protocol(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)),
            protocol(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)),
            protocol(AMQPErrorKind::Hard(AMQPHardError::FRAMEERROR)),
            lapin::ErrorKind::ChannelsLimitReached.into(),
        ] {
            let failure = publish_failure("AMQP publish", &error);
            assert!(!failure.is_unavailable(), "{error:?}: {failure:?}");
            assert!(!failure.is_permanent(), "{error:?}: {failure:?}");
        }
    }

    #[test]
    fn failures_are_counted_per_id_and_forgotten_when_settled() {
        let mut failures = Failures::new(10);
        assert_eq!(
            (failures.add("a"), failures.add("a"), failures.add("b")),
            (1, 2, 1)
        );
        assert_eq!(
            (failures.get("a"), failures.get("b"), failures.get("c")),
            (2, 1, 0)
        );
        failures.forget("a");
        assert_eq!(failures.get("a"), 0);
        assert_eq!(failures.add("a"), 1);
        failures.forget("never seen");
        assert_eq!((failures.counts.len(), failures.ages.len()), (2, 2));
    }

    #[test]
    fn failures_keep_at_most_their_bound_forgetting_the_oldest() {
        let mut failures = Failures::new(3);
        for id in ["a", "b", "c"] {
            failures.add(id);
        }
        // "a" failed again: "b" is now the oldest.
        failures.add("a");
        failures.add("d");
        assert_eq!(
            ["a", "b", "c", "d"].map(|id| failures.get(id)),
            [2, 0, 1, 1]
        );
        for n in 0..10_000 {
            failures.add(&format!("id-{n}"));
        }
        assert_eq!((failures.counts.len(), failures.ages.len()), (3, 3));
        assert_eq!(failures.get("id-9999"), 1);
    }
}
