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
//! The consumer acknowledges only after the work committed; a failure that can pass is
//! requeued after a delay (AMQP has no delayed negative acknowledgement, so the consumer
//! holds the message for the delay, then requeues it); what can never succeed, or has
//! been delivered the most times allowed, is rejected without requeue, which sends it to
//! the queue's dead-letter exchange (`x-dead-letter-exchange`) if it has one, with a log
//! line saying why.

use std::collections::HashMap;
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

use super::consume::{judge, log_dead, Verdict};
use super::{OutboxEvent, PublishError, Publisher, Received};
use crate::once::OnceError;

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
        let channel = self
            .channel()
            .await
            .map_err(|e| PublishError::retry(format!("AMQP connection: {e}")))?;
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
            .map_err(|e| PublishError::retry(format!("AMQP publish: {e}")))?
            .await
            .map_err(|e| PublishError::retry(format!("AMQP confirm: {e}")))?;
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

/// Consumes events from an AMQP queue, runs each one's work once, and acknowledges after
/// the commit. See the [module's docs](self). One consumer handles one delivery at a
/// time (and holds a failed one for its retry delay): run several, on channels of their
/// own, for parallel work.
#[must_use = "a consumer does nothing until `.run(..)` is awaited"]
pub struct AmqpConsumer {
    channel: Channel,
    queue: String,
    retry_delay: Duration,
    max_deliver: Option<u32>,
    prefetch: u16,
}

impl AmqpConsumer {
    /// Consumes `queue` on `channel`.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        Self {
            channel,
            queue: queue.into(),
            retry_delay: Duration::from_secs(1),
            max_deliver: Some(10),
            prefetch: 32,
        }
    }

    /// How long a failed delivery waits before it is requeued (default 1 s).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// After how many deliveries a message that keeps failing goes to the dead-letter
    /// path (default 10; `None`: never). Counted by the queue (`x-delivery-count`, quorum
    /// queues) or else by this consumer.
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
        E: fmt::Display,
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
        // Deliveries of ids this consumer saw fail, for queues that do not count them.
        let mut seen: HashMap<String, u32> = HashMap::new();
        while let Some(delivery) = deliveries.next().await {
            let delivery = delivery?;
            let topic = delivery.routing_key.to_string();
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string());
            let counted = delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("x-delivery-count").and_then(count));
            let delivered = match (&id, counted) {
                (_, Some(n)) => n + 1,
                (Some(id), None) => seen.get(id).copied().unwrap_or(0) + 1,
                (None, None) => 1,
            };
            let verdict = judge(
                id.clone(),
                || "no message_id".into(),
                &topic,
                &delivery.data,
                delivered,
                self.max_deliver,
                &mut handle,
            )
            .await;
            let id = id.unwrap_or_default();
            let done = match verdict {
                Verdict::Ack => {
                    seen.remove(&id);
                    delivery.ack(BasicAckOptions::default()).await
                }
                Verdict::Retry(reason) => {
                    seen.insert(id.clone(), delivered);
                    tracing::warn!(event_id = %id, topic, delivered, %reason, "idem: AMQP consumer: redelivering later");
                    tokio::time::sleep(self.retry_delay).await;
                    delivery
                        .nack(BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        })
                        .await
                }
                Verdict::Dead(reason) => {
                    seen.remove(&id);
                    log_dead(&id, &topic, &reason);
                    delivery.reject(BasicRejectOptions { requeue: false }).await
                }
            };
            if let Err(error) = done {
                // Redelivered when the channel closes; the work replays then.
                tracing::warn!(%error, event_id = %id, "idem: AMQP consumer: acknowledgement failed");
            }
        }
        Ok(())
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
