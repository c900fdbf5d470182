//! What the charges service tells other services: `charge.created` and
//! `charge.refunded`, written to idem's outbox in the request's own transaction, relayed
//! to NATS JetStream, and read back by the service's own ledger consumer, which books
//! each event once.
//!
//! Enabled by `NATS_URL`; without it the service emits nothing and runs as before.
//! Subjects are `<prefix>.charge.created` and `<prefix>.charge.refunded`, captured by the
//! stream `<prefix>` (`NATS_SUBJECT_PREFIX`, default `charges`). The ledger's dead
//! letters go to `<prefix>_dead.ledger`, in a stream of their own, `<prefix>_dead`:
//! outside `<prefix>.>`, so that no consumer of the events (the ledger included) reads
//! them as events, and kept until someone looks at them.

use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream, Context};
use idem::jobs::OnceError;
use idem::outbox::nats::{JetStreamConsumer, JetStreamPublisher};
use idem::outbox::{Event, Received, Relay};
use idem::Store;
use serde::{Deserialize, Serialize};

use crate::persistent;

/// A charge event, as published: `charge.created` credits the account, `charge.refunded`
/// debits it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChargeEvent {
    /// `charge.created` or `charge.refunded`.
    pub kind: String,
    /// The charge.
    pub charge_id: String,
    /// The refund, for `charge.refunded`.
    pub refund_id: Option<String>,
    /// Whose charge.
    pub account: String,
    /// The amount charged or refunded.
    pub amount: i64,
}

impl ChargeEvent {
    /// The event to write to the outbox: on `<prefix>.<kind>`, ordered per charge, so
    /// that a charge's refunds are published after its creation.
    pub(crate) fn event(&self, prefix: &str) -> Event {
        Event::new(format!("{prefix}.{}", self.kind), self).ordering_key(&*self.charge_id)
    }
}

/// The stream of `prefix`'s events and the stream of the ledger's dead letters, created
/// if missing; the ledger's durable consumer on the first.
pub async fn stream(js: &Context, prefix: &str) -> Result<PullConsumer, async_nats::Error> {
    let stream = js
        .get_or_create_stream(stream::Config {
            name: prefix.to_owned(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await?;
    let (dead_stream, _) = dead_letters(prefix);
    js.get_or_create_stream(stream::Config {
        name: dead_stream.clone(),
        subjects: vec![format!("{dead_stream}.>")],
        ..Default::default()
    })
    .await?;
    let consumer = stream
        .get_or_create_consumer(
            "ledger",
            pull::Config {
                durable_name: Some("ledger".into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                // Counts the failures of the booking itself: a database outage holds
                // the event, however long, and counts nothing (idem's consumer).
                max_deliver: 10,
                ..Default::default()
            },
        )
        .await?;
    Ok(consumer)
}

/// The stream of the ledger's dead letters (`<prefix>_dead`) and their subject in it
/// (`<prefix>_dead.ledger`): outside the events' stream, which captures `<prefix>.>`.
pub fn dead_letters(prefix: &str) -> (String, String) {
    let stream = format!("{prefix}_dead");
    let subject = format!("{stream}.ledger");
    (stream, subject)
}

/// How the relay retries a publish that failed (`OUTBOX_MAX_ATTEMPTS`,
/// `OUTBOX_BACKOFF_MS`): after `max_attempts` failed attempts an event is parked as
/// dead (idem's console and `idem outbox dead` show it); the first wait is
/// `first_backoff`, doubling up to a minute.
#[derive(Debug, Clone, Copy)]
pub struct Delivery {
    /// Attempts before an event is parked (default 10).
    pub max_attempts: u32,
    /// The wait after the first failure (default 500 ms).
    pub first_backoff: Duration,
}

impl Default for Delivery {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            first_backoff: Duration::from_millis(500),
        }
    }
}

/// Starts the relay of the outbox to JetStream and the ledger consumer, with the default
/// [`Delivery`].
pub async fn start(
    store: &Store,
    nats_url: &str,
    prefix: &str,
) -> Result<(Relay, tokio::task::JoinHandle<()>), async_nats::Error> {
    start_with(store, nats_url, prefix, Delivery::default()).await
}

/// [`start`], retrying as `delivery` says.
pub async fn start_with(
    store: &Store,
    nats_url: &str,
    prefix: &str,
    delivery: Delivery,
) -> Result<(Relay, tokio::task::JoinHandle<()>), async_nats::Error> {
    let client = async_nats::connect(nats_url).await?;
    let js = jetstream::new(client);
    let consumer = stream(&js, prefix).await?;
    // Named, the stream's duplicate window is checked against the relay's lease and
    // backoff when the relay starts.
    let publisher = JetStreamPublisher::new(js.clone()).stream(prefix);
    let relay = store
        .relay(publisher)
        .max_attempts(delivery.max_attempts)
        .backoff(delivery.first_backoff, Duration::from_secs(60))
        .spawn()?;
    let store = store.clone();
    let (_, dead_subject) = dead_letters(prefix);
    let ledger = tokio::spawn(async move {
        let result = JetStreamConsumer::new(js, consumer)
            .dead_letter_subject(dead_subject)
            .run(async |event: Received<ChargeEvent>| book(&store, &event).await)
            .await;
        if let Err(error) = result {
            tracing::error!(%error, "the ledger consumer stopped");
        }
    });
    Ok((relay, ledger))
}

/// Books one event in the ledger, once per event id: a redelivery, or a copy published
/// past JetStream's duplicate window, replays instead.
pub async fn book(
    store: &Store,
    event: &Received<ChargeEvent>,
) -> Result<(), OnceError<sqlx::Error>> {
    let named = persistent(store.pooler());
    let e = event.payload();
    let amount = if e.kind.ends_with("refunded") {
        -e.amount
    } else {
        e.amount
    };
    event
        .once(store, "ledger_events")
        .ttl(Duration::from_secs(7 * 24 * 3600))
        .run(async |mut tx| {
            sqlx::query(
                "INSERT INTO ledger_entries (message_id, account, amount) VALUES ($1, $2, $3)",
            )
            .bind(event.id())
            .bind(&e.account)
            .bind(amount)
            .persistent(named)
            .execute(&mut *tx)
            .await?;
            Ok::<_, sqlx::Error>(())
        })
        .await
}
