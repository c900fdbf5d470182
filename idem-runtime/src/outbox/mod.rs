//! Effects beyond the database: a transactional outbox, the relay that delivers it, and
//! the brokers it delivers to.
//!
//! An event that must leave PostgreSQL (a message to other services) is *recorded* in the
//! request's transaction with [`Tx::emit`], beside the key's row and the stored response,
//! and *delivered* after the commit by a [`Relay`] ([`Store::relay`](crate::Store::relay)), with a stable id
//! the receiver deduplicates on. So a replayed request emits nothing new, a rolled-back
//! one emits nothing at all, and a process that dies after its commit loses nothing: the
//! row is there for the next relay.
//!
//! - the table (its DDL is in [`Store::schema`](crate::Store::schema)): written by [`Tx::emit`];
//! - the [`Relay`]: takes committed events, hands them to a [`Publisher`], deletes
//!   them once the broker acknowledged them, retries with backoff, parks what fails too
//!   often ([`Operate::dead_page`](crate::operate::Operate::dead_page), [`Audited::redrive_dead`](crate::operate::Audited::redrive_dead));
//! - `nats` (feature `nats`): a JetStream [`Publisher`] and consumer;
//! - `amqp` (feature `amqp`): an AMQP 0.9.1 (RabbitMQ) [`Publisher`] and consumer.
//!
//! Nothing here knows HTTP: a handler's [`Tx`] and a [`Store::run_once`](crate::Store::run_once) work's write
//! events the same way.

#[cfg(any(feature = "nats", feature = "amqp"))]
mod consume;
mod relay;

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub mod amqp;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;

use std::fmt;

use serde::Serialize;

#[cfg(any(feature = "nats", feature = "amqp"))]
pub use consume::Received;
pub use relay::{
    DuplicateWindow, OutboxEvent, PublishError, Publisher, Relay, RelayBuilder, RelayError,
    RelayStats,
};

pub use crate::table::outbox::DeadEvent;

use crate::table::outbox::{attempt_hash, attempt_prefix};
use crate::tx::Tx;

/// An event to record in the outbox with [`Tx::emit`]: where it goes (a NATS subject, an
/// AMQP routing key ...), its payload, and optionally headers and an ordering key.
#[derive(Debug)]
#[must_use = "an `Event` is recorded only by `Tx::emit`"]
pub struct Event {
    topic: String,
    payload: Result<Vec<u8>, String>,
    headers: Vec<(String, String)>,
    ordering_key: Option<String>,
}

impl Event {
    /// An event whose payload is `payload` as JSON.
    pub fn new<P: Serialize + ?Sized>(topic: impl Into<String>, payload: &P) -> Self {
        Self {
            topic: topic.into(),
            payload: serde_json::to_vec(payload).map_err(|e| e.to_string()),
            headers: Vec::new(),
            ordering_key: None,
        }
    }

    /// An event whose payload is `bytes` as they are.
    pub fn bytes(topic: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            topic: topic.into(),
            payload: Ok(bytes.into()),
            headers: Vec::new(),
            ordering_key: None,
        }
    }

    /// Events with the same ordering key (a charge's id, an account's) are published in
    /// the order they were written, one at a time across every relay; events without one
    /// are published in any order, many at once.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// A header sent with the event (a NATS or AMQP header). The name is visible ASCII
    /// without `:`, the value has no line break.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    fn encoded_headers(&self) -> Result<Vec<u8>, EmitError> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            let name_ok =
                !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic() && b != b':');
            if !name_ok || value.contains(['\r', '\n']) {
                return Err(EmitError::Header(name.clone()));
            }
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.push(b'\n');
        }
        Ok(out)
    }
}

/// Whether `topic` can name a destination: 1 to 255 visible ASCII characters (a NATS
/// subject has no spaces, an AMQP routing key at most 255 bytes).
fn valid_topic(topic: &str) -> bool {
    (1..=255).contains(&topic.len()) && topic.bytes().all(|b| b.is_ascii_graphic())
}

/// Decodes the headers [`Event::header`] stored.
pub(crate) fn decode_headers(stored: &[u8]) -> Vec<(String, String)> {
    String::from_utf8_lossy(stored)
        .lines()
        .filter_map(|line| line.split_once(": "))
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect()
}

impl Tx<'_> {
    /// Records `event` in the outbox, in this transaction: it is published after the
    /// commit (by a [`Relay`]), and never if the transaction rolls back. Returns the
    /// event's id, which the relay sends as the broker's deduplication id (`Nats-Msg-Id`,
    /// AMQP `message_id`) and a consumer keys [`Store::run_once`](crate::Store::run_once) on.
    ///
    /// The id is derived from this attempt's scope, principal and key, the event's topic,
    /// its place among the events this attempt writes, and the transaction's start: the
    /// same event written by the same attempt always gets the same id, and a key reused
    /// after it expired writes new ones. Without a key (an endpoint with
    /// `required = false` called without one), the id is random.
    ///
    /// With a key, the event's row rides the message that carries the key's row (or, in
    /// the portable mode, its response) and COMMIT: no round trip of its own, and the
    /// table it names is the one the claim resolved, whatever `search_path` the handler
    /// set since. So a failure to write it (the outbox table missing, say) fails the
    /// commit: the request answers 500 and nothing commits. Without a key it is written
    /// at once, and such a failure is this call's `Err`.
    ///
    /// ```no_run
    /// # async fn f(mut tx: idem::Tx<'_>, charge_id: i64) -> Result<(), idem::outbox::EmitError> {
    /// use idem::outbox::Event;
    ///
    /// let payload = serde_json::json!({ "id": charge_id, "amount": 500 });
    /// tx.emit(Event::new("charge.created", &payload).ordering_key(charge_id.to_string()))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn emit(&mut self, event: Event) -> Result<String, EmitError> {
        if !valid_topic(&event.topic) {
            return Err(EmitError::Topic(event.topic));
        }
        let headers = event.encoded_headers()?;
        let payload = event
            .payload
            .as_deref()
            .map_err(|e| EmitError::Payload(e.clone()))?;
        let place = self.next_event();
        let attempt = self.key_in_scope().map(|key| {
            let prefix = attempt_prefix(&key.scope, &key.principal, key.key.as_str(), &event.topic);
            attempt_hash(&prefix, place)
        });
        let outbox = self.outbox();
        // Where a key's row (or its response) rides COMMIT, the event rides it too: no
        // round trip of its own. Without a key it is written now.
        let began = self.request().and_then(|request| request.began);
        if let (Some(attempt), Some(began)) = (&attempt, began) {
            let id = crate::table::outbox::event_id(attempt, began);
            let insert = outbox.riding(
                self.store().inner.table.prepared(),
                &id,
                &event.topic,
                event.ordering_key.as_deref(),
                &headers,
                payload,
            );
            let (_, state) = self.parts();
            state.ride(insert);
            // Whether the COMMIT message also wakes the relays is asked as it is written.
            state.wakes_relays = true;
            return Ok(id);
        }
        outbox
            .write(
                self,
                attempt.as_deref(),
                &event.topic,
                event.ordering_key.as_deref(),
                &headers,
                payload,
            )
            .await
            .map_err(EmitError::Database)
    }
}

/// Why [`Tx::emit`] did not record an event. A database error leaves the transaction
/// aborted: return it as the handler's `Err`, so everything rolls back.
#[derive(Debug)]
#[non_exhaustive]
pub enum EmitError {
    /// The topic is empty, longer than 255 bytes, or has characters other than visible
    /// ASCII.
    Topic(String),
    /// A header name is empty or not visible ASCII without `:`, or its value has a line
    /// break.
    Header(String),
    /// The payload did not serialize to JSON.
    Payload(String),
    /// The outbox table could not be written.
    Database(sqlx::Error),
}

impl fmt::Display for EmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Topic(t) => write!(
                f,
                "invalid event topic {t:?}: use 1 to 255 visible ASCII characters"
            ),
            Self::Header(h) => write!(
                f,
                "invalid event header {h:?}: a name is visible ASCII without ':', a value has no line break"
            ),
            Self::Payload(e) => write!(f, "the event's payload does not serialize: {e}"),
            Self::Database(e) => write!(f, "the outbox could not be written: {e}"),
        }
    }
}

impl std::error::Error for EmitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(e) => Some(e),
            _ => None,
        }
    }
}

impl From<EmitError> for sqlx::Error {
    /// For work that answers `sqlx::Error` ([`Store::run_once`](crate::Store::run_once)'s usual error type).
    fn from(error: EmitError) -> Self {
        match error {
            EmitError::Database(e) => e,
            other => sqlx::Error::Protocol(other.to_string()),
        }
    }
}
