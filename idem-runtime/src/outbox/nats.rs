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
//! The consumer acknowledges only after the work committed. What it does with a delivery
//! that did not succeed follows from how JetStream counts: the server counts every
//! delivery of a message, a redelivery after a NAK included, and once a message was
//! delivered `max_deliver` times it stops delivering it and tells nobody but an advisory
//! subject. So a failure that can pass must not cause a redelivery, or an outage of the
//! database would burn through `max_deliver` and strand every event in flight:
//!
//! - a failure that can pass (the database unreachable, a key in use ...) keeps the
//!   message: the consumer tries the work again after a backoff (`retry_delay` doubling
//!   up to `max_retry_delay`) for as long as it fails so, and meanwhile tells JetStream
//!   it is still working on it (`+WPI`, every third of the consumer's ack wait), which
//!   resets the ack wait without a redelivery. The count does not move;
//! - a failure of the work itself is NAKed with that backoff as its delay (a bare NAK
//!   redelivers at once and burns through `max_deliver` in milliseconds), and counts;
//! - what can never succeed, or a work failure on the last delivery `max_deliver`
//!   allows, goes to the dead-letter subject (if any), then is terminated.
//!
//! So the server's count is the deliveries whose work failed, plus redeliveries that no
//! consumer asked for: after a consumer died, or an ack or `+WPI` was lost with the
//! broker. A consumer cannot tell those from another consumer's work failure; they err
//! towards fewer tries of the work, never towards a dead letter for a transient failure.
//!
//! To keep a message without a redelivery, the consumer reports in progress every message
//! it holds, not only the one it works on. It fetches up to
//! [`batch`](JetStreamConsumer::batch) messages at once when that many are
//! waiting (one message at a time when none is, waiting on the server for the next), works
//! on them one after another in the stream's order, and reports each one still held in
//! progress every third of the ack wait, counted from the fetch: a fetched message waits
//! through the first one's outage, or behind slow work, without its ack wait running out.
//! Run several consumers on one durable consumer for parallel work.
//!
//! The dead-letter subject must be captured by a stream (JetStream refuses a publish no
//! stream takes) other than the consumed one: in the consumed stream, every consumer of it
//! would read the dead letters as new events (the example's own ledger consumer did, and
//! booked them under `dead-<id>`). [`JetStreamConsumer::run`] checks both before it
//! consumes anything.

use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::{ConsumerInfoErrorKind, GetStreamByNameErrorKind};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::jetstream::{Context, Message};
use async_nats::HeaderMap;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::consume::{backoff, judge, log_dead, Verdict};
use super::{DuplicateWindow, OutboxEvent, PublishError, Publisher, Received};
use crate::once::OnceError;

/// The header JetStream deduplicates on.
pub const MSG_ID: &str = "Nats-Msg-Id";

/// A dead letter's headers: the event's id, the subject it was consumed from, and why the
/// consumer gave up on it.
const EVENT_ID: &str = "Idem-Event-Id";
const DEAD_SUBJECT: &str = "Idem-Dead-Subject";
const DEAD_REASON: &str = "Idem-Dead-Reason";

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
            .map_err(|e| publish_failure("JetStream publish", &e))?;
        // The stream's acknowledgement: stored, or dropped as a duplicate of a message
        // stored before. Either way the event is in the stream once.
        ack.await
            .map(drop)
            .map_err(|e| publish_failure("JetStream acknowledgement", &e))
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

/// What a failed JetStream publish (`what`: the publish, or its acknowledgement) tells the
/// relay. The server out of reach (no acknowledgement in time, the connection gone, the
/// client's acknowledgements all pending, JetStream answering that it is temporarily
/// unavailable) is [`PublishError::unavailable`]: waited for, never counted. The rest,
/// "no responders" (no stream captures the subject) first among them, is about where this
/// event goes: [`PublishError::retry`], parked after the relay's attempts.
fn publish_failure(
    what: &str,
    error: &async_nats::jetstream::context::PublishError,
) -> PublishError {
    use async_nats::jetstream::context::PublishErrorKind as Kind;
    let message = format!("{what}: {error}");
    let unavailable = match error.kind() {
        Kind::TimedOut | Kind::BrokenPipe | Kind::MaxAckPending => true,
        // An error the JetStream API answered with.
        Kind::Other => std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
            .is_some_and(|api| {
                api.error_code() == async_nats::jetstream::ErrorCode::CLUSTER_NOT_AVAILABLE
            }),
        Kind::StreamNotFound
        | Kind::WrongLastMessageId
        | Kind::WrongLastSequence
        | Kind::MaxPayloadExceeded => false,
    };
    if unavailable {
        PublishError::unavailable(message)
    } else {
        PublishError::retry(message)
    }
}

/// Consumes events from a JetStream pull consumer (explicit acks), runs each one's work
/// once, and acknowledges after the commit. See the [module's docs](self).
#[must_use = "a consumer does nothing until `.run(..)` is awaited"]
#[derive(Debug)]
pub struct JetStreamConsumer {
    jetstream: Context,
    consumer: PullConsumer,
    retry_delay: Duration,
    max_retry_delay: Duration,
    dead_letter_subject: Option<String>,
    id_header: String,
    batch_size: usize,
}

/// How many waiting messages one fetch takes by default.
const DEFAULT_BATCH: usize = 32;

/// How long one pull waits on the server for a message before it is sent again.
const PULL_WAIT: Duration = Duration::from_secs(5);

impl JetStreamConsumer {
    /// Consumes from `consumer` (made with `AckPolicy::Explicit`); `jetstream` publishes
    /// to the dead-letter subject.
    pub fn new(jetstream: Context, consumer: PullConsumer) -> Self {
        Self {
            jetstream,
            consumer,
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(10),
            dead_letter_subject: None,
            id_header: MSG_ID.to_owned(),
            batch_size: DEFAULT_BATCH,
        }
    }

    /// How many messages one fetch takes when they are waiting (default 32; at least 1).
    /// They are worked on in order, and held meanwhile (see the [module's docs](self)):
    /// a larger batch costs fewer round trips per message, and keeps more messages from
    /// the other consumers of the same durable consumer while this one works. The
    /// consumer's `max_ack_pending` bounds it too.
    pub fn batch(mut self, size: usize) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// The pause after the first failure of a delivery (default 1 s); it doubles at each
    /// failure that follows, up to [`max_retry_delay`](Self::max_retry_delay).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The longest pause between two tries (default 10 s): after an outage, the work is
    /// tried again at most this long after the database is back.
    pub fn max_retry_delay(mut self, delay: Duration) -> Self {
        self.max_retry_delay = delay;
        self
    }

    /// Where messages that can never succeed go, with the headers `Idem-Event-Id` (the
    /// event's id), `Idem-Dead-Reason` and `Idem-Dead-Subject`, and `dead-<id>` as their
    /// `Nats-Msg-Id` (default: none; they are logged and terminated). It must be captured
    /// by a stream of its own, not by the stream consumed: [`run`](Self::run) refuses it
    /// otherwise.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// The header the event's id is read from (default `Nats-Msg-Id`).
    pub fn id_header(mut self, name: impl Into<String>) -> Self {
        self.id_header = name.into();
        self
    }

    /// Runs `handle` for each message, decoded as `T`, until the consumer (or its stream)
    /// is deleted. `handle` runs the work, usually `received.once(&store, scope).run(..)`;
    /// its result decides the acknowledgement. A broker that cannot be reached is waited
    /// for.
    ///
    /// Refuses to start (before it consumes anything) when the dead-letter subject is not
    /// one subject, no stream captures it, or the consumed stream does (or copies it in
    /// from its stream): see the [module's docs](self).
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store, js: async_nats::jetstream::Context, consumer: async_nats::jetstream::consumer::PullConsumer) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem::outbox::nats::JetStreamConsumer;
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Charge { id: i64, amount: i64 }
    ///
    /// // The dead letters' stream: its own subjects, outside the events' stream.
    /// js.get_or_create_stream(async_nats::jetstream::stream::Config {
    ///     name: "charges_dead".into(),
    ///     subjects: vec!["charges_dead.>".into()],
    ///     ..Default::default()
    /// })
    /// .await?;
    /// JetStreamConsumer::new(js, consumer)
    ///     .dead_letter_subject("charges_dead.ledger")
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
        E: fmt::Display + 'static,
    {
        if let Some(subject) = &self.dead_letter_subject {
            self.check_dead_letter_subject(subject).await?;
        }
        let config = &self.consumer.cached_info().config;
        let limits = Limits {
            max_deliver: u32::try_from(config.max_deliver).ok().filter(|&m| m > 0),
            // The server's default ack wait is 30 s.
            keep_alive: if config.ack_wait.is_zero() {
                Duration::from_secs(10)
            } else {
                (config.ack_wait / 3).max(Duration::from_millis(10))
            },
        };
        // Pulls in a row that failed: the broker away.
        let mut failed_pulls = 0;
        loop {
            // The messages waiting, fetched together, worked on in order.
            match self.fetch().await {
                Ok(batch) if !batch.is_empty() => {
                    failed_pulls = 0;
                    let mut held = Held::new(batch, limits.keep_alive);
                    while let Some(message) = held.next() {
                        self.settle(message, &mut held, &mut handle, &limits).await;
                    }
                    continue;
                }
                // None waiting, or the fetch failed: the pull below waits for the next
                // message, or says what failed.
                Ok(_) | Err(_) => {}
            }
            let started = tokio::time::Instant::now();
            let error = match self.pull().await {
                Ok(Some(message)) => {
                    failed_pulls = 0;
                    let mut held = Held::new(Vec::new(), limits.keep_alive);
                    self.settle(message, &mut held, &mut handle, &limits).await;
                    continue;
                }
                // The pull's wait ran out with nothing to consume.
                Ok(None) if started.elapsed() >= PULL_WAIT / 2 => continue,
                Ok(None) => "the pull ended at once".to_owned(),
                Err(error) => error.to_string(),
            };
            if self.deleted().await {
                return Ok(());
            }
            failed_pulls += 1;
            let pause = backoff((self.retry_delay, self.max_retry_delay), failed_pulls);
            tracing::warn!(%error, ?pause, "idem: JetStream consumer: pulling failed; pulling again after a pause");
            tokio::time::sleep(pause).await;
        }
    }

    /// The messages waiting now, up to the batch size, without waiting on the server for
    /// more (one subscription and one round trip for the lot).
    async fn fetch(&self) -> Result<Vec<Message>, async_nats::Error> {
        if self.batch_size == 1 {
            return Ok(Vec::new());
        }
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(self.batch_size)
            .messages()
            .await?;
        let mut messages = Vec::with_capacity(self.batch_size);
        loop {
            // A fetch that waits for nothing has no deadline of its own: an answer lost
            // with the connection would hold the consumer for ever.
            let next = match tokio::time::timeout(PULL_WAIT, batch.next()).await {
                Ok(next) => next,
                Err(_) if messages.is_empty() => return Err("the fetch got no answer".into()),
                Err(_) => break,
            };
            match next {
                Some(Ok(message)) => messages.push(message),
                None => break,
                // What was fetched before the failure is held, and worked on.
                Some(Err(error)) if messages.is_empty() => return Err(error),
                Some(Err(_)) => break,
            }
        }
        Ok(messages)
    }

    /// The next message, pulled alone (see the [module's docs](self)); `None` when the
    /// pull's wait ran out first.
    async fn pull(&self) -> Result<Option<Message>, async_nats::Error> {
        let mut batch = self
            .consumer
            .batch()
            .max_messages(1)
            .expires(PULL_WAIT)
            .messages()
            .await?;
        batch.next().await.transpose()
    }

    /// Whether the consumer or its stream is gone: the end of [`run`](Self::run).
    async fn deleted(&self) -> bool {
        match self.consumer.get_info().await {
            Err(error) => matches!(
                error.kind(),
                ConsumerInfoErrorKind::NotFound | ConsumerInfoErrorKind::StreamNotFound
            ),
            Ok(_) => false,
        }
    }

    /// Runs one message's work until its verdict is final, and acknowledges, NAKs or
    /// dead-letters it (see the [module's docs](self)).
    async fn settle<T, F, Fut, R, E>(
        &self,
        message: Message,
        held: &mut Held,
        handle: &mut F,
        limits: &Limits,
    ) where
        T: DeserializeOwned,
        F: FnMut(Received<T>) -> Fut,
        Fut: Future<Output = Result<R, OnceError<E>>>,
        E: fmt::Display + 'static,
    {
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
        let event_id = id.as_deref().unwrap_or_default();
        let mut tries = 0;
        loop {
            let work = judge(
                id.as_deref(),
                || format!("no {} header", self.id_header),
                &topic,
                &message.payload,
                delivered,
                handle,
            );
            // Every delivery whose work failed counts (see the module's docs).
            let verdict = working(&message, held, work)
                .await
                .limited(delivered, limits.max_deliver);
            let acked = match verdict {
                Verdict::Ack => message.double_ack().await,
                Verdict::Transient(reason) => {
                    tries += 1;
                    let pause = backoff((self.retry_delay, self.max_retry_delay), tries);
                    tracing::warn!(event_id, topic, tries, ?pause, %reason, "idem: JetStream consumer: a failure that can pass; trying again after a pause, holding the message (not counted as a delivery)");
                    working(&message, held, tokio::time::sleep(pause)).await;
                    continue;
                }
                Verdict::Failed(reason) => {
                    let pause = backoff((self.retry_delay, self.max_retry_delay), delivered);
                    tracing::warn!(event_id, topic, delivered, ?pause, %reason, "idem: JetStream consumer: the work failed; redelivering after a pause");
                    message.ack_with(AckKind::Nak(Some(pause))).await
                }
                Verdict::Dead(reason) => {
                    log_dead(event_id, &topic, &reason);
                    if let Some(subject) = &self.dead_letter_subject {
                        self.bury(&message, held, subject, event_id, &topic, &reason)
                            .await;
                    }
                    message.double_ack_with(AckKind::Term).await
                }
            };
            if let Err(error) = acked {
                // Redelivered after the ack wait; the work replays then, or fails again.
                tracing::warn!(%error, event_id, "idem: JetStream consumer: acknowledgement failed");
            }
            return;
        }
    }

    /// Publishes a dead letter, trying again after a pause while the broker refuses it
    /// (a transient failure: the message is held meanwhile, not redelivered).
    async fn bury(
        &self,
        message: &Message,
        held: &mut Held,
        subject: &str,
        id: &str,
        topic: &str,
        reason: &str,
    ) {
        let mut tries = 0;
        loop {
            let published = working(
                message,
                held,
                self.dead_letter(subject, id, topic, reason, &message.payload),
            )
            .await;
            let Err(error) = published else {
                return;
            };
            tries += 1;
            let pause = backoff((self.retry_delay, self.max_retry_delay), tries);
            tracing::error!(%error, event_id = id, ?pause, "idem: JetStream consumer: the dead-letter subject refused the message; trying again after a pause");
            working(message, held, tokio::time::sleep(pause)).await;
        }
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
        // Not the event's own id, so that a dead letter never passes for its event (a
        // stream holding both would drop one as the other's duplicate); the same dead
        // letter sent twice (its termination lost) is still dropped as a duplicate.
        headers.insert(MSG_ID, format!("dead-{id}").as_str());
        headers.insert(EVENT_ID, id);
        headers.insert(DEAD_SUBJECT, topic);
        // A header value holds one line.
        headers.insert(DEAD_REASON, reason.replace(['\r', '\n'], " ").as_str());
        let ack = self
            .jetstream
            .publish_with_headers(subject.to_owned(), headers, payload.to_vec().into())
            .await
            .map_err(|e| e.to_string())?;
        ack.await.map(drop).map_err(|e| e.to_string())
    }

    /// Refuses a dead-letter subject whose dead letters would be lost or read as events
    /// (see the [module's docs](self)); waits for a broker that does not answer.
    async fn check_dead_letter_subject(&self, subject: &str) -> Result<(), ConsumeError> {
        if subject.is_empty() || subject.contains(['*', '>', ' ', '\t']) {
            return Err(ConsumeError(format!(
                "the dead-letter subject must be one subject, without wildcards or spaces, not {subject:?}"
            )));
        }
        let mut tries = 0;
        loop {
            match self.dead_letter_check(subject).await {
                Ok(()) => return Ok(()),
                Err(Check::Refused(why)) => return Err(ConsumeError(why)),
                Err(Check::Unanswered(error)) => {
                    tries += 1;
                    let pause = backoff((self.retry_delay, self.max_retry_delay), tries);
                    tracing::warn!(%error, ?pause, "idem: JetStream consumer: cannot check the dead-letter subject; asking again after a pause");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    async fn dead_letter_check(&self, subject: &str) -> Result<(), Check> {
        let consumed = &self.consumer.cached_info().stream_name;
        let stream = match self.jetstream.stream_by_subject(subject).await {
            Ok(stream) => stream,
            Err(error) if error.kind() == GetStreamByNameErrorKind::NotFound => {
                return Err(Check::Refused(format!(
                    "no stream captures the dead-letter subject {subject:?}: JetStream would refuse \
                     every dead letter. Create a stream for the dead letters (not {consumed:?}, \
                     the stream this consumer reads)"
                )))
            }
            Err(error) => return Err(Check::Unanswered(error.to_string())),
        };
        if stream == *consumed {
            return Err(Check::Refused(format!(
                "the dead-letter subject {subject:?} is captured by the stream {consumed:?}, the \
                 one this consumer reads: its consumers would read the dead letters as new events. \
                 Give the dead letters a stream of their own, outside {consumed:?}'s subjects"
            )));
        }
        let config = self
            .jetstream
            .get_stream(consumed)
            .await
            .map_err(|e| Check::Unanswered(e.to_string()))?
            .cached_info()
            .config
            .clone();
        let copies = config
            .mirror
            .iter()
            .chain(config.sources.iter().flatten())
            .any(|source| source.name == stream);
        if copies {
            return Err(Check::Refused(format!(
                "the dead-letter subject {subject:?} is captured by the stream {stream:?}, which \
                 the stream this consumer reads ({consumed:?}) copies in: its consumers would \
                 read the dead letters as new events"
            )));
        }
        Ok(())
    }
}

/// What a message's settling needs of the consumer's settings on the server.
struct Limits {
    max_deliver: Option<u32>,
    /// How often a held message is reported in progress: a third of the ack wait.
    keep_alive: Duration,
}

/// Why a dead-letter subject was not accepted.
enum Check {
    /// For good, with the reason.
    Refused(String),
    /// JetStream did not answer; ask again.
    Unanswered(String),
}

/// The messages of one fetch not yet settled, and when JetStream was last told that the
/// consumer is working on them: each message's ack wait runs from its delivery, not from
/// when its own work starts.
struct Held {
    waiting: std::collections::VecDeque<Message>,
    /// A third of the ack wait.
    every: Duration,
    reported: tokio::time::Instant,
}

impl Held {
    /// `batch` as just fetched (or pulled), reported every `every`.
    fn new(batch: Vec<Message>, every: Duration) -> Self {
        Self {
            waiting: batch.into(),
            every,
            reported: tokio::time::Instant::now(),
        }
    }

    /// The next message to work on, in the stream's order.
    fn next(&mut self) -> Option<Message> {
        self.waiting.pop_front()
    }
}

/// Runs `work` on `message` while telling JetStream every third of the ack wait that
/// `message` and every message still `held` are being worked on (`+WPI`), which resets
/// their ack waits: none is redelivered meanwhile, so the server counts no delivery.
async fn working<O>(message: &Message, held: &mut Held, work: impl Future<Output = O>) -> O {
    let mut work = std::pin::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => return out,
            () = tokio::time::sleep_until(held.reported + held.every) => {
                held.reported = tokio::time::Instant::now();
                for message in std::iter::once(message).chain(&held.waiting) {
                    if let Err(error) = message.ack_with(AckKind::Progress).await {
                        // The broker away: the next report tries again. Past the ack wait
                        // the message is redelivered, and the work replays or fails again
                        // then.
                        tracing::debug!(%error, "idem: JetStream consumer: cannot report progress");
                    }
                }
            }
        }
    }
}

/// Why a consumer stopped: its settings were refused (a dead-letter subject no stream
/// captures, or one its own stream reads), said in one sentence that names the fix. It has
/// no source: JetStream's own errors are not returned but waited out and asked again.
#[derive(Debug)]
pub struct ConsumeError(String);

impl fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the JetStream consumer stopped: {}", self.0)
    }
}

impl std::error::Error for ConsumeError {}

/// A [`JetStreamConsumer`]'s dead letter, read back from the stream that captures its
/// dead-letter subject ([`dead_letters`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its sequence in the dead letters' stream.
    pub sequence: u64,
    /// The event's id (its `Idem-Event-Id` header).
    pub event_id: String,
    /// The subject the event was consumed from (`Idem-Dead-Subject`).
    pub subject: String,
    /// Why the consumer gave up on it (`Idem-Dead-Reason`).
    pub reason: String,
    /// When the stream stored it.
    #[serde(serialize_with = "crate::operate::rfc3339")]
    pub at: SystemTime,
    /// The event's payload, as the consumer received it (as text in JSON, invalid UTF-8
    /// replaced).
    #[serde(serialize_with = "crate::operate::lossy")]
    pub payload: Vec<u8>,
}

/// The newest dead letters of the stream `stream` (the one that captures a consumer's
/// [`dead_letter_subject`](JetStreamConsumer::dead_letter_subject)), newest first, at
/// most `limit` (messages without an `Idem-Event-Id` header are not idem's, and skipped): what the consumers gave up on, for operators (the outbox's own dead
/// events are in [`Store::dead_events`](crate::operate::Operate::dead_page)). Looks at no more
/// than `limit` and a hundred of the stream's last sequences, so that messages deleted
/// from the stream cost a bounded walk.
///
/// ```no_run
/// # async fn f(jetstream: async_nats::jetstream::Context) -> Result<(), Box<dyn std::error::Error>> {
/// for letter in idem::outbox::nats::dead_letters(&jetstream, "charges_dead", 20).await? {
///     println!("{} {} {}", letter.event_id, letter.subject, letter.reason);
/// }
/// # Ok(()) }
/// ```
pub async fn dead_letters(
    jetstream: &Context,
    stream: &str,
    limit: usize,
) -> Result<Vec<DeadLetter>, DeadLettersError> {
    let failed = |error: Box<dyn std::error::Error + Send + Sync>| DeadLettersError {
        stream: stream.to_owned(),
        error,
    };
    let mut found = jetstream
        .get_stream(stream)
        .await
        .map_err(|e| failed(Box::new(e)))?;
    let state = found
        .info()
        .await
        .map_err(|e| failed(Box::new(e)))?
        .state
        .clone();
    let mut letters = Vec::with_capacity(limit.min(1_000));
    let oldest = state
        .first_sequence
        .max(state.last_sequence.saturating_sub(limit as u64 + 100))
        .max(1);
    let mut sequence = state.last_sequence;
    while letters.len() < limit && sequence >= oldest {
        match found.get_raw_message(sequence).await {
            // A message without the event's id is no dead letter of idem's: skipped.
            Ok(message) if message.headers.get(EVENT_ID).is_none() => {}
            Ok(message) => {
                let header = |name: &str| {
                    message
                        .headers
                        .get(name)
                        .map(|value| value.as_str().to_owned())
                        .unwrap_or_default()
                };
                letters.push(DeadLetter {
                    sequence: message.sequence,
                    event_id: header(EVENT_ID),
                    subject: header(DEAD_SUBJECT),
                    reason: header(DEAD_REASON),
                    at: SystemTime::from(message.time),
                    payload: message.payload.to_vec(),
                });
            }
            // Deleted from the stream (or never stored): the next one down.
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {}
            Err(error) => return Err(failed(Box::new(error))),
        }
        sequence -= 1;
    }
    Ok(letters)
}

/// Why [`dead_letters`] could not read a stream.
#[derive(Debug)]
pub struct DeadLettersError {
    stream: String,
    error: Box<dyn std::error::Error + Send + Sync>,
}

impl fmt::Display for DeadLettersError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot read the dead letters of the JetStream stream {:?}: {}",
            self.stream, self.error
        )
    }
}

impl std::error::Error for DeadLettersError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.error)
    }
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::context::{PublishError as NatsError, PublishErrorKind as Kind};

    use super::*;

    /// An error the JetStream API answers with, as the server sends it.
    fn api(code: usize, err_code: u64, description: &str) -> async_nats::jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": code, "err_code": err_code, "description": description,
        }))
        .unwrap()
    }

    /// Invariant 10: the server out of reach is waited for (uncounted); a subject no
    /// stream captures is counted, and parks after the relay's attempts.
    #[test]
    fn an_unreachable_server_is_unavailable_and_a_missing_stream_counts() {
        for kind in [Kind::TimedOut, Kind::BrokenPipe, Kind::MaxAckPending] {
            let failure = publish_failure("JetStream publish", &NatsError::new(kind));
            assert!(failure.is_unavailable(), "{kind:?}: {failure:?}");
            assert!(
                failure.message().starts_with("JetStream publish: "),
                "{failure}"
            );
        }
        let down = NatsError::with_source(
            Kind::Other,
            api(503, 10008, "JetStream system temporarily unavailable"),
        );
        assert!(publish_failure("JetStream acknowledgement", &down).is_unavailable());
        for error in [
            NatsError::new(Kind::StreamNotFound),
            NatsError::new(Kind::MaxPayloadExceeded),
            NatsError::new(Kind::Other),
            NatsError::with_source(Kind::Other, api(400, 10077, "maximum messages exceeded")),
        ] {
            let failure = publish_failure("JetStream acknowledgement", &error);
            assert!(!failure.is_unavailable(), "{failure:?}");
            assert!(!failure.is_permanent(), "{failure:?}");
        }
        let missing = publish_failure(
            "JetStream acknowledgement",
            &NatsError::new(Kind::StreamNotFound),
        );
        assert_eq!(
            missing.message(),
            "JetStream acknowledgement: no stream found for given subject"
        );
    }
}
