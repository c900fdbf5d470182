//! The relay: takes committed events from the outbox table, hands them to a
//! [`Publisher`], and deletes those the broker acknowledged when its round's publishes
//! have ended.
//!
//! At least once, never lost: a row is deleted only after its publish succeeded, so a
//! relay that dies in between leaves it leased, and another relay (or this one,
//! restarted) takes it again and publishes it again under the same id, which the broker
//! or the consumer drops: what a round published before its relay died (up to a batch,
//! or a second of one key's events) is published again. A failed publish (or a publisher that panicked) makes the row
//! available again after a backoff; after [`RelayBuilder::max_attempts`] it is parked
//! (kept, visible in [`Operate::dead_page`](crate::operate::Operate::dead_page), re-drivable), and the rest flow on.
//!
//! Transient is never final (invariant 10): a destination that is unavailable (a broker
//! unreachable, a connection lost, no acknowledgement within the publish timeout:
//! [`PublishError::unavailable`]) says nothing about the event, so such a failure is
//! tried again, after a backoff that grows while the outage lasts, for as long as it
//! lasts, and never counts toward `max_attempts`: its mark gives back the attempt its take
//! counted. Only an event the destination keeps refusing ([`PublishError::retry`]) is
//! parked after its attempts, and one it can never take ([`PublishError::permanent`]) at
//! once.
//!
//! Whoever marks holds (invariant 11): every mark is conditional on the token of the take
//! that leased the rows, so a relay that stalled past its lease marks nothing another
//! relay took since. A relay's leases end with its session: it holds a session advisory
//! lock on a connection of its own, and the other relays take what it leased as soon as
//! that lock is free (its process killed, its connection gone), not when the lease runs
//! out; see [`RelayBuilder::session`] for where that cannot work.
//!
//! The relay's connections never sit in a transaction: each statement is its own short
//! transaction, and the `LISTEN` and session connections run nothing else (the session's
//! lock is no transaction), so the relay never holds back vacuum (an old snapshot would
//! keep every deleted outbox row).

use crate::background::Stop;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use tokio::task::JoinSet;

use crate::store::Store;
use crate::table::outbox::{ClaimedRow, Failed, Walk};

/// An event as the relay hands it to a [`Publisher`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxEvent {
    /// The event's stable id: send it as the broker's deduplication id.
    pub id: String,
    /// Where it goes (a NATS subject, an AMQP routing key).
    pub topic: String,
    /// Its ordering key, if any.
    pub ordering_key: Option<String>,
    /// The headers written with it.
    pub headers: Vec<(String, String)>,
    /// The payload, as written (JSON for [`Event::new`](super::Event::new)).
    pub payload: Vec<u8>,
    /// Which counted attempt this is, from 1: attempts that failed because the
    /// destination was unavailable ([`PublishError::unavailable`]) are not counted.
    pub attempt: u32,
}

/// Delivers outbox events somewhere: a broker (the `nats` and `amqp` features provide
/// JetStream and AMQP ones), an HTTP endpoint, Kafka.
///
/// `publish` returns `Ok` only once the destination has durably accepted the event (a
/// broker's acknowledgement): the relay deletes the row on `Ok`. It may be called again
/// for an event it already delivered (after a crash, or a timeout): send the event's
/// [`id`](OutboxEvent::id) as the destination's deduplication id.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot publish outbox events",
    note = "implement `idem::outbox::Publisher` for it, or use the `nats` or `amqp` feature's publisher"
)]
pub trait Publisher: Send + Sync + 'static {
    /// Publishes one event and waits for the destination's acknowledgement.
    fn publish(&self, event: &OutboxEvent)
        -> impl Future<Output = Result<(), PublishError>> + Send;

    /// How long each destination this publisher knows drops a copy of an event it
    /// already accepted, by the event's id (JetStream's `duplicate_window`). A relay asks
    /// when it starts, and says so loudly when a copy it can send (after a lost
    /// acknowledgement, or a relay that stalled) may arrive later than that. The default:
    /// none known.
    fn duplicate_windows(
        &self,
    ) -> impl Future<Output = Result<Vec<DuplicateWindow>, PublishError>> + Send {
        async { Ok(Vec::new()) }
    }
}

/// How long a destination drops a copy of an event it already accepted
/// ([`Publisher::duplicate_windows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DuplicateWindow {
    /// The destination, as a log line names it (`JetStream stream "charges"`).
    pub destination: String,
    /// The window.
    pub window: Duration,
}

impl DuplicateWindow {
    /// `destination` drops copies within `window`.
    pub fn new(destination: impl Into<String>, window: Duration) -> Self {
        Self {
            destination: destination.into(),
            window,
        }
    }
}

/// Why a publish failed, and so what the relay does with the event: try it again
/// without counting the attempt ([`unavailable`](Self::unavailable)), try it again and
/// count the attempt ([`retry`](Self::retry)), or park it at once
/// ([`permanent`](Self::permanent)). Whichever it is, the message is kept as the event's
/// `last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishError {
    message: String,
    kind: FailureKind,
}

/// The three kinds of [`PublishError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailureKind {
    Unavailable,
    Retry,
    Permanent,
}

impl PublishError {
    /// The destination is unavailable (the broker unreachable, the connection lost, no
    /// acknowledgement in time): nothing is wrong with the event. It is tried again after
    /// the relay's backoff, which grows while the outage lasts, for as long as it lasts;
    /// the attempt does not count toward the relay's `max_attempts`, so an outage never
    /// parks an event (invariant 10). A publish that outlives the relay's
    /// [`publish_timeout`](RelayBuilder::publish_timeout) counts as this.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            kind: FailureKind::Unavailable,
        }
    }

    /// This event failed and may pass (the destination refused it, has nowhere to put
    /// it yet): the event is tried again after a backoff, and parked after the relay's
    /// `max_attempts`. For a destination that cannot be reached, use
    /// [`PublishError::unavailable`], which does not count.
    pub fn retry(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            kind: FailureKind::Retry,
        }
    }

    /// A failure that no retry can fix (the destination refuses this event): the event
    /// is parked at once.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            kind: FailureKind::Permanent,
        }
    }

    /// What went wrong.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether it was [`PublishError::permanent`].
    pub fn is_permanent(&self) -> bool {
        self.kind == FailureKind::Permanent
    }

    /// Whether it was [`PublishError::unavailable`].
    pub fn is_unavailable(&self) -> bool {
        self.kind == FailureKind::Unavailable
    }
}

impl std::fmt::Display for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PublishError {}

/// Configures a relay; see [`Store::relay`](crate::Store::relay).
#[must_use = "a relay does nothing until `.spawn()` or `.run_until_idle()`"]
#[derive(Debug)]
pub struct RelayBuilder<P> {
    store: Store,
    publisher: Arc<P>,
    batch_size: u32,
    poll_interval: Duration,
    linger: Duration,
    lease: Duration,
    publish_timeout: Duration,
    max_attempts: u32,
    backoff: (Duration, Duration),
    listen: Option<bool>,
    session: Option<PgConnectOptions>,
}

/// The default linger: 100 ms ([`RelayBuilder::linger`]).
const DEFAULT_LINGER: Duration = Duration::from_millis(100);
/// How often a lingering relay looks: every 10 ms ([`RelayBuilder::linger`]).
const LINGER_TICK: Duration = Duration::from_millis(10);

/// The default lease: 30 s.
///
/// The defaults keep the rule of JetStream's default duplicate window (2 minutes): a copy
/// the relay can send, after a lost acknowledgement (the publish timeout, then the
/// longest backoff) and a relay that stalled past its lease, arrives within
/// `lease + publish timeout + longest backoff` = 30 + 10 + 60 = 100 s of the first.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default publish timeout: 10 s.
const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// The default backoff: 500 ms, doubling to 1 min.
const DEFAULT_BACKOFF: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(60));

impl Store {
    /// A relay of this store's outbox to `publisher`. Start it with
    /// [`RelayBuilder::spawn`], like the sweeper; any number of service instances may run
    /// one at once.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store, publisher: impl idem::outbox::Publisher) -> Result<(), Box<dyn std::error::Error>> {
    /// let relay = store.relay(publisher).max_attempts(20).spawn()?;
    /// // ... at shutdown:
    /// relay.stop();
    /// # Ok(()) }
    /// ```
    pub fn relay<P: Publisher>(&self, publisher: P) -> RelayBuilder<P> {
        RelayBuilder {
            store: self.clone(),
            publisher: Arc::new(publisher),
            batch_size: 256,
            poll_interval: Duration::from_secs(1),
            linger: DEFAULT_LINGER,
            lease: DEFAULT_LEASE,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            max_attempts: 10,
            backoff: DEFAULT_BACKOFF,
            listen: None,
            session: None,
        }
    }
}

/// How long a round goes on publishing the events of a key after its first: the rest go
/// back to the table for the next round, so that a slow destination holds the events the
/// round did not take back for about this long, not for its lease.
const CHAIN_TIME: Duration = Duration::from_secs(1);

impl<P: Publisher> RelayBuilder<P> {
    /// How many events one round takes (default 256). Events of different ordering keys
    /// (and events without one) are published concurrently. The events of one key go one
    /// after another, each once the destination acknowledged the one before; when fewer
    /// keys than the batch are ready, a round takes several events of each, and goes on
    /// publishing them for up to a second.
    pub fn batch(mut self, size: u32) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// How often the relay looks for events when nothing woke it (default 1 s): the
    /// fallback to `LISTEN`, and the only way behind a transaction pooler or in portable
    /// mode, where the relay polls.
    pub fn every(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// How long the relay keeps looking after a NOTIFY woke it or a round found events
    /// (default 100 ms), a round every 10 ms (or every poll interval if that is
    /// shorter): the commits that a store lets go without a NOTIFY follow
    /// the one that carried it closely
    /// ([`StoreBuilder::outbox_notify_interval`](crate::StoreBuilder::outbox_notify_interval),
    /// 5 ms by default); keep the linger longer than that interval plus a commit's time.
    /// Zero: the relay waits for the next NOTIFY or poll as soon as a round finds
    /// nothing.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// How long a relay keeps the events it took before another relay may take them
    /// (default 30 s), even if it is still alive: how long a relay that stalls (or, where
    /// its leases cannot end with its session, one that died) delays its events. Longer
    /// than the publish timeout. A round never outlives it: marks that fail are tried
    /// again until it ends, and a mark after it is refused if another relay took the
    /// events meanwhile.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long one publish may wait for the broker's acknowledgement (default 10 s)
    /// before it fails as [`PublishError::unavailable`]: tried again, not counted toward
    /// [`max_attempts`](Self::max_attempts).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// After how many failed attempts an event is parked as dead (default 10). Only the
    /// failures of the event count ([`PublishError::retry`], a publisher that panicked):
    /// a destination that is unavailable ([`PublishError::unavailable`], a publish past
    /// the publish timeout) is waited for as long as it is, and parks nothing.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait after a failed attempt: `first`, doubled after each further failure, at
    /// most `max` (default 500 ms and 1 min). While the destination is unavailable, the
    /// wait doubles with each round of the outage instead (the attempts do not grow), up
    /// to the same `max`, and starts again from `first` once a publish gets through.
    /// Keep `lease + publish timeout + max` within the broker's duplicate window
    /// (JetStream's is 2 minutes by default): the relay says at its start when it is not.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = (first, max.max(first));
        self
    }

    /// Whether to wake on the outbox's `NOTIFY` (default: yes, unless the store is behind
    /// a transaction pooler, where `LISTEN` does not work through the pooler, or
    /// portable, whose writes do not notify). Without it the relay polls. A listening
    /// relay keeps one connection of the store's pool for `LISTEN` (it runs nothing else
    /// on it, so it holds no snapshot back); size the pool for it. (Its session,
    /// [`RelayBuilder::session`], is one more connection, outside the pool.) Behind a
    /// transaction pooler, a relay given a direct connection for its session listens on
    /// a direct connection of its own too (the commits' `NOTIFY` goes through the pooler
    /// to PostgreSQL, which delivers it to every listener).
    pub fn listen(mut self, listen: bool) -> Self {
        self.listen = Some(listen);
        self
    }

    /// Where the relay opens the connection of its own that holds its session lock, so
    /// that its leases end as soon as it dies (killed, its connection gone) instead of
    /// when they run out. By default it opens it with the store's pool's options, except
    /// behind a transaction pooler ([`Pooler::Transaction`](crate::Pooler::Transaction)),
    /// where a session lock would stay on a server connection the pooler hands to other
    /// clients: there give it a direct connection to PostgreSQL here, or its leases end
    /// only by their time. In the portable mode leases always end by their time (a
    /// distributed engine has no cluster-wide advisory lock).
    pub fn session(mut self, options: PgConnectOptions) -> Self {
        self.session = Some(options);
        self
    }

    fn check(&self) -> Result<(), RelayError> {
        if self.poll_interval.is_zero() {
            return Err(RelayError::ZeroPollInterval);
        }
        if self.publish_timeout >= self.lease {
            return Err(RelayError::LeaseTooShort);
        }
        Ok(())
    }

    /// The options of the session's connection, if this relay's leases can end with it.
    fn session_options(&self) -> Option<PgConnectOptions> {
        let store = &self.store.inner;
        if !store.outbox.can_tie() {
            return None;
        }
        let options = match (&self.session, store.dialect.pooler) {
            (Some(options), _) => options.clone(),
            (None, crate::Pooler::Session) => (*store.pool.connect_options()).clone(),
            (None, _) => return None,
        };
        Some(options.application_name(&session_name()))
    }

    /// Where the relay listens when not on the store's pool: behind a transaction pooler,
    /// on the direct connection options given for its session.
    fn listen_options(&self) -> Option<PgConnectOptions> {
        let store = &self.store.inner;
        match (&self.session, store.dialect.pooler) {
            (Some(options), crate::Pooler::Transaction) if store.outbox.notifies() => {
                Some(options.clone())
            }
            _ => None,
        }
    }

    /// Starts the relay in a tokio task, until [`Relay::stop`]. Database and broker
    /// failures are logged and retried; they never stop it. The task first asks the
    /// publisher for its destinations' duplicate windows ([`Publisher::duplicate_windows`])
    /// and logs an ERROR for each that `lease + publish timeout + longest backoff`
    /// exceeds.
    pub fn spawn(self) -> Result<Relay, RelayError> {
        self.check()?;
        // Beside the relay, so that a slow answer does not hold back its first round.
        let publisher = Arc::clone(&self.publisher);
        let (lease, timeout, longest) = (self.lease, self.publish_timeout, self.backoff.1);
        tokio::spawn(async move { check_windows(&*publisher, lease, timeout, longest).await });
        let counters = Arc::new(Counters::default());
        let stopping = Arc::new(Stop::default());
        let listen_options = self.listen_options();
        let running = Running {
            counters: Arc::clone(&counters),
            stopping: Arc::clone(&stopping),
            listen: self.listen.unwrap_or_else(|| {
                self.store.inner.outbox.can_listen() || listen_options.is_some()
            }),
            listen_options,
            session_options: self.session_options(),
            outage: AtomicU32::new(0),
            builder: self,
        };
        let task = tokio::spawn(running.run());
        Ok(Relay {
            task,
            counters,
            stopping,
        })
    }

    /// Publishes every event that is available now, round after round, and returns what
    /// it did once a round finds nothing to take: for a cron job, or a test. Events in
    /// their backoff are left for later.
    pub async fn run_until_idle(self) -> Result<RelayStats, RelayError> {
        self.check()?;
        let running = Running {
            counters: Arc::new(Counters::default()),
            stopping: Arc::new(Stop::default()),
            listen: false,
            listen_options: None,
            session_options: self.session_options(),
            outage: AtomicU32::new(0),
            builder: self,
        };
        running.check_windows().await;
        let mut session = running.open_session(&mut false).await;
        let mut kept = Kept::default();
        loop {
            let round = running
                .round(session.as_ref().map(|s| s.owner), &mut kept)
                .await
                .map_err(RelayError::Database)?;
            if round.untied {
                session = None;
            }
            if round.taken == 0 && kept.walk.round() {
                break;
            }
        }
        if let Some(session) = session {
            session.close().await;
        }
        Ok(running.counters.stats())
    }
}

/// Why a relay did not start, or a drain stopped.
#[derive(Debug)]
#[non_exhaustive]
pub enum RelayError {
    /// The poll interval is zero: the relay would poll in a busy loop.
    ZeroPollInterval,
    /// The publish timeout is not shorter than the lease: a slow publish could outlive
    /// the lease, and another relay would publish the same event at the same time.
    LeaseTooShort,
    /// The outbox could not be read or written.
    Database(sqlx::Error),
}

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ZeroPollInterval => f.write_str("the relay's poll interval is zero"),
            Self::LeaseTooShort => {
                f.write_str("the relay's publish timeout must be shorter than its lease")
            }
            Self::Database(e) => write!(f, "the outbox could not be read or written: {e}"),
        }
    }
}

impl std::error::Error for RelayError {}

/// A running relay; see [`RelayBuilder::spawn`].
#[derive(Debug)]
pub struct Relay {
    task: tokio::task::JoinHandle<()>,
    counters: Arc<Counters>,
    stopping: Arc<Stop>,
}

impl Relay {
    /// What this relay has done so far.
    pub fn stats(&self) -> RelayStats {
        self.counters.stats()
    }

    /// Stops the relay once the round it is in (publishing a batch and marking it) is
    /// done; [`Relay::stopped`] waits for that. Its task outlives a dropped `Relay`.
    pub fn stop(&self) {
        self.stopping.ask();
    }

    /// Stops the relay and waits until it has.
    pub async fn stopped(self) {
        self.stop();
        self.task.await.ok();
    }

    /// Stops the relay at once, even in the middle of a round (as a crash would): events
    /// it took and had not marked yet are taken again by another relay, and published
    /// again under the same id: at its next round where its session lock ended with the
    /// task, else when their lease runs out.
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Counts of what a relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Events published and deleted.
    pub published: u64,
    /// Failed attempts that will be tried again.
    pub retried: u64,
    /// Of [`retried`](Self::retried), the attempts that failed because the destination
    /// was unavailable ([`PublishError::unavailable`]): not counted toward
    /// [`RelayBuilder::max_attempts`].
    pub unavailable: u64,
    /// Events parked as dead.
    pub dead: u64,
    /// Events this relay tried and could not mark because another relay had taken them
    /// meanwhile (this one stalled past its lease, or lost its session): that relay
    /// publishes and marks them; what this one published was a copy under the same id.
    pub overtaken: u64,
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    retried: AtomicU64,
    unavailable: AtomicU64,
    dead: AtomicU64,
    overtaken: AtomicU64,
}

impl Counters {
    fn stats(&self) -> RelayStats {
        RelayStats {
            published: self.published.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            unavailable: self.unavailable.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            overtaken: self.overtaken.load(Ordering::Relaxed),
        }
    }
}

mod running;

use running::{check_windows, session_name, Kept, Running};

#[cfg(test)]
mod tests;
