//! NATS JetStream: a [`Publisher`] for the relay, and a consumer that runs each event's
//! work once.
//!
//! The publisher sends each event with its id as `Nats-Msg-Id`: JetStream drops a second
//! message with the same id inside the stream's duplicate window (2 minutes by default),
//! so a relay that republishes after a crash does not add a copy (name the stream with
//! [`JetStreamPublisher::stream`] and the relay checks at its start that its settings keep
//! its copies inside the window). Past the window a republish is a second message; the consumer's [`Store::run_once`](crate::Store::run_once) keyed by the same
//! id is what keeps the effect single then.
//!
//! The consumer acknowledges only after the work committed, answers a failure that can
//! pass with a NAK *with a delay* (a bare NAK redelivers at once and burns through
//! `max_deliver` in milliseconds), and sends what can never succeed, or what reached
//! `max_deliver`, to a dead-letter subject (JetStream itself only publishes an advisory
//! at `max_deliver` and keeps the message), then terminates it.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::Context;
use async_nats::HeaderMap;
use futures::StreamExt;
use serde::de::DeserializeOwned;

use super::consume::{judge, log_dead, Verdict};
use super::{DuplicateWindow, OutboxEvent, PublishError, Publisher, Received};
use crate::once::OnceError;

/// The header JetStream deduplicates on.
pub const MSG_ID: &str = "Nats-Msg-Id";

/// Publishes outbox events to JetStream, on the event's topic as the subject, with its id
/// as `Nats-Msg-Id`. A stream must capture the subjects.
#[derive(Debug, Clone)]
pub struct JetStreamPublisher {
    jetstream: Context,
    streams: Vec<String>,
}

impl JetStreamPublisher {
    /// A publisher on `jetstream` (`async_nats::jetstream::new(client)`).
    pub fn new(jetstream: Context) -> Self {
        Self {
            jetstream,
            streams: Vec::new(),
        }
    }

    /// Names a stream the events go to (call it once per stream): a relay reads its
    /// `duplicate_window` when it starts, and logs an ERROR if its lease, publish timeout
    /// and longest backoff add up to more, so that a copy it sends could arrive after
    /// JetStream forgot the event's id (see [`RelayBuilder::backoff`]).
    ///
    /// [`RelayBuilder::backoff`]: super::RelayBuilder::backoff
    pub fn stream(mut self, name: impl Into<String>) -> Self {
        self.streams.push(name.into());
        self
    }
}

impl Publisher for JetStreamPublisher {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        let mut headers = HeaderMap::new();
        for (name, value) in &event.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        headers.insert(MSG_ID, event.id.as_str());
        let ack = self
            .jetstream
            .publish_with_headers(event.topic.clone(), headers, event.payload.clone().into())
            .await
            .map_err(|e| PublishError::retry(format!("JetStream publish: {e}")))?;
        // The stream's acknowledgement: stored, or dropped as a duplicate of a message
        // stored before. Either way the event is in the stream once.
        ack.await
            .map(drop)
            .map_err(|e| PublishError::retry(format!("JetStream acknowledgement: {e}")))
    }

    /// The `duplicate_window` of each stream named with [`JetStreamPublisher::stream`].
    async fn duplicate_windows(&self) -> Result<Vec<DuplicateWindow>, PublishError> {
        let mut windows = Vec::with_capacity(self.streams.len());
        for name in &self.streams {
            let stream = self
                .jetstream
                .get_stream(name)
                .await
                .map_err(|e| PublishError::retry(format!("JetStream stream {name:?}: {e}")))?;
            windows.push(DuplicateWindow::new(
                format!("JetStream stream {name:?}"),
                stream.cached_info().config.duplicate_window,
            ));
        }
        Ok(windows)
    }
}

/// Consumes events from a JetStream pull consumer (explicit acks), runs each one's work
/// once, and acknowledges after the commit. See the [module's docs](self).
#[must_use = "a consumer does nothing until `.run(..)` is awaited"]
pub struct JetStreamConsumer {
    jetstream: Context,
    consumer: PullConsumer,
    retry_delay: Duration,
    dead_letter_subject: Option<String>,
    id_header: String,
}

impl JetStreamConsumer {
    /// Consumes from `consumer` (made with `AckPolicy::Explicit`); `jetstream` publishes
    /// to the dead-letter subject.
    pub fn new(jetstream: Context, consumer: PullConsumer) -> Self {
        Self {
            jetstream,
            consumer,
            retry_delay: Duration::from_secs(1),
            dead_letter_subject: None,
            id_header: MSG_ID.to_owned(),
        }
    }

    /// How long a failed delivery waits before JetStream redelivers it (default 1 s).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Where messages that can never succeed go, with the headers `Idem-Event-Id` (the
    /// event's id), `Idem-Dead-Reason` and `Idem-Dead-Subject`, and `dead-<id>` as their
    /// `Nats-Msg-Id` (default: none; they are logged and terminated).
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// The header the event's id is read from (default `Nats-Msg-Id`).
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Runs `handle` for each message, decoded as `T`, until the consumer is deleted or
    /// the connection closes for good. `handle` runs the work, usually
    /// `received.once(&store, scope).run(..)`; its result decides the acknowledgement.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store, js: async_nats::jetstream::Context, consumer: async_nats::jetstream::consumer::PullConsumer) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem::outbox::nats::JetStreamConsumer;
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Charge { id: i64, amount: i64 }
    ///
    /// JetStreamConsumer::new(js, consumer)
    ///     .dead_letter_subject("dead.ledger")
    ///     .run(|charge: idem::outbox::Received<Charge>| {
    ///         let store = store.clone();
    ///         async move {
    ///             let amount = charge.payload().amount;
    ///             charge.once(&store, "ledger").run(async |mut tx| {
    ///                 sqlx::query("UPDATE balance SET total = total + $1")
    ///                     .bind(amount)
    ///                     .execute(&mut *tx)
    ///                     .await?;
    ///                 Ok::<_, sqlx::Error>(())
    ///             })
    ///             .await
    ///         }
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run<T, F, Fut, R, E>(self, mut handle: F) -> Result<(), ConsumeError>
    where
        T: DeserializeOwned,
        F: FnMut(Received<T>) -> Fut,
        Fut: Future<Output = Result<R, OnceError<E>>>,
        E: fmt::Display,
    {
        let max_deliver = u32::try_from(self.consumer.cached_info().config.max_deliver)
            .ok()
            .filter(|&m| m > 0);
        let mut messages = self
            .consumer
            .messages()
            .await
            .map_err(|e| ConsumeError(e.to_string()))?;
        while let Some(message) = messages.next().await {
            let message = match message {
                Ok(message) => message,
                Err(error) => {
                    // The client reconnects by itself; the stream goes on after it. A
                    // pause, so that an error that repeats does not spin.
                    tracing::warn!(%error, "idem: JetStream consumer: receiving failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let delivered = message
                .info()
                .map(|info| u32::try_from(info.delivered).unwrap_or(u32::MAX))
                .unwrap_or(1);
            let topic = message.subject.to_string();
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get(self.id_header.as_str()))
                .map(|v| v.as_str().to_owned());
            let verdict = judge(
                id.clone(),
                || format!("no {} header", self.id_header),
                &topic,
                &message.payload,
                delivered,
                max_deliver,
                &mut handle,
            )
            .await;
            let id = id.unwrap_or_default();
            let acked = match verdict {
                Verdict::Ack => message.double_ack().await,
                Verdict::Retry(reason) => {
                    tracing::warn!(event_id = %id, topic, delivered, %reason, "idem: JetStream consumer: redelivering later");
                    message.ack_with(AckKind::Nak(Some(self.retry_delay))).await
                }
                Verdict::Dead(reason) => {
                    log_dead(&id, &topic, &reason);
                    if let Some(subject) = &self.dead_letter_subject {
                        if let Err(error) = self
                            .dead_letter(subject, &id, &topic, &reason, &message.payload)
                            .await
                        {
                            // Not terminated: redelivered, and sent again next time.
                            tracing::error!(%error, "idem: JetStream consumer: the dead-letter subject refused the message");
                            message
                                .ack_with(AckKind::Nak(Some(self.retry_delay)))
                                .await
                                .ok();
                            continue;
                        }
                    }
                    message.double_ack_with(AckKind::Term).await
                }
            };
            if let Err(error) = acked {
                // Redelivered after the ack wait; the work replays then.
                tracing::warn!(%error, event_id = %id, "idem: JetStream consumer: acknowledgement failed");
            }
        }
        Ok(())
    }

    async fn dead_letter(
        &self,
        subject: &str,
        id: &str,
        topic: &str,
        reason: &str,
        payload: &[u8],
    ) -> Result<(), String> {
        let mut headers = HeaderMap::new();
        // Not the event's own id: a dead letter in the same stream would be dropped as a
        // duplicate of the original inside the duplicate window.
        headers.insert(MSG_ID, format!("dead-{id}").as_str());
        headers.insert("Idem-Event-Id", id);
        headers.insert("Idem-Dead-Subject", topic);
        // A header value holds one line.
        headers.insert(
            "Idem-Dead-Reason",
            reason.replace(['\r', '\n'], " ").as_str(),
        );
        let ack = self
            .jetstream
            .publish_with_headers(subject.to_owned(), headers, payload.to_vec().into())
            .await
            .map_err(|e| e.to_string())?;
        ack.await.map(drop).map_err(|e| e.to_string())
    }
}

/// Why a consumer stopped.
#[derive(Debug)]
pub struct ConsumeError(String);

impl fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the JetStream consumer stopped: {}", self.0)
    }
}

impl std::error::Error for ConsumeError {}
