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
    pub fn batch_size(mut self, size: u32) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// How often the relay looks for events when nothing woke it (default 1 s): the
    /// fallback to `LISTEN`, and the only way behind a transaction pooler or in portable
    /// mode, where the relay polls.
    pub fn poll_interval(mut self, every: Duration) -> Self {
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
        let stopping = Arc::new(Stopping::default());
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
            stopping: Arc::new(Stopping::default()),
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
    stopping: Arc<Stopping>,
}

/// Tells a relay's task to stop after its current round.
#[derive(Debug, Default)]
struct Stopping {
    asked: std::sync::atomic::AtomicBool,
    wake: tokio::sync::Notify,
}

impl Stopping {
    fn asked(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }
}

impl Relay {
    /// What this relay has done so far.
    pub fn stats(&self) -> RelayStats {
        self.counters.stats()
    }

    /// Stops the relay once the round it is in (publishing a batch and marking it) is
    /// done; [`Relay::stopped`] waits for that. Its task outlives a dropped `Relay`.
    pub fn stop(&self) {
        self.stopping.asked.store(true, Ordering::SeqCst);
        self.stopping.wake.notify_one();
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

struct Running<P> {
    builder: RelayBuilder<P>,
    counters: Arc<Counters>,
    stopping: Arc<Stopping>,
    listen: bool,
    /// Where to open the `LISTEN` connection when not on the store's pool
    /// ([`RelayBuilder::listen`]).
    listen_options: Option<PgConnectOptions>,
    /// Where to open the session that ties this relay's leases to its life; `None` where
    /// they end by their time only.
    session_options: Option<PgConnectOptions>,
    /// How many rounds in a row found the destination unavailable and published nothing:
    /// the backoff of an unavailable event grows with it, as its attempts do not.
    outage: AtomicU32,
}

/// A relay's session: a connection of its own, running nothing but the advisory lock of
/// `owner` that it holds while open. A take leases rows to `owner` while the lock is
/// held; when the connection ends (the process killed, the connection dropped),
/// PostgreSQL releases the lock and the other relays' takes treat those leases as ended.
struct Session {
    conn: PgConnection,
    owner: i32,
}

impl Session {
    async fn close(self) {
        // Closing releases the lock; a failure to say goodbye releases it too.
        self.conn.close().await.ok();
    }
}

/// How long a relay waits before it tries again to open a session that failed.
const SESSION_RETRY: Duration = Duration::from_secs(5);

/// What a relay keeps from one round to the next.
#[derive(Default)]
struct Kept {
    /// Where the last take's walks stopped: the next take starts there ([`Walk`]).
    walk: Walk,
    /// Events the destination did not answer.
    suspects: Suspects,
}

/// Events whose publish failed as unavailable (`PublishError::unavailable`: no answer in
/// time, the connection lost), with how many events the relay had published when they
/// did. Unavailable for everyone is an outage, and counts toward no limit (invariant 10);
/// unavailable for one event while the destination published others in between is that
/// event's own failure, which counts, so that an event the destination hangs on is parked
/// after `max_attempts` and its ordering key moves on. Kept in memory, so a relay that
/// restarts, or another relay that takes the event, counts from its next failure on: late,
/// never wrongly.
#[derive(Default)]
struct Suspects {
    failed_at: HashMap<i64, u64>,
}

/// How many suspects a relay keeps; past it, it starts afresh (a long outage of many
/// events: none of them would count yet anyway).
const SUSPECTS: usize = 100_000;

impl Suspects {
    /// Records that `seq` failed as unavailable when the relay had published `published`
    /// events: whether the destination published another between this failure and the
    /// event's previous one.
    fn failed_alone(&mut self, seq: i64, published: u64) -> bool {
        if self.failed_at.len() >= SUSPECTS && !self.failed_at.contains_key(&seq) {
            self.failed_at.clear();
        }
        self.failed_at
            .insert(seq, published)
            .is_some_and(|before| published > before)
    }

    /// The event was published or parked.
    fn forget(&mut self, seq: i64) {
        self.failed_at.remove(&seq);
    }
}

/// What one round did.
struct Round {
    /// How many events it took.
    taken: usize,
    /// Whether it took events without its session lock held: the session is gone.
    untied: bool,
}

impl<P: Publisher> Running<P> {
    async fn run(self) {
        let store = &self.builder.store;
        let outbox = &store.inner.outbox;
        let mut listener = None;
        let mut session = None;
        let mut session_warned = false;
        let mut session_retry: Option<Instant> = None;
        let mut last_lag: Option<Instant> = None;
        // Until when the relay keeps looking every tick ([`RelayBuilder::linger`]).
        let mut linger_until: Option<Instant> = None;
        let mut kept = Kept::default();
        let tick = LINGER_TICK.min(self.builder.poll_interval);
        while !self.stopping.asked() {
            if self.listen && listener.is_none() {
                listener = self.listener().await;
            }
            // After a failure, not at every poll: an unreachable server would otherwise
            // cost each round a connection attempt.
            if session.is_none() && session_retry.is_none_or(|at| Instant::now() >= at) {
                session = self.open_session(&mut session_warned).await;
                session_retry = Some(Instant::now() + SESSION_RETRY);
            }
            // A walk that stopped short (it looked at as many rows as it may, all of them
            // held back) goes on at once from where it stopped.
            let (taken, stopped_short) = match self
                .round(session.as_ref().map(|s| s.owner), &mut kept)
                .await
            {
                Ok(round) => {
                    if round.untied {
                        tracing::warn!("idem: the outbox relay's session lock is gone (its connection ended); opening another, its leases end by their time meanwhile");
                        session = None;
                    }
                    (round.taken, !kept.walk.round())
                }
                Err(error) => {
                    tracing::warn!(%error, "idem: the outbox relay could not read or mark events; retrying");
                    (0, false)
                }
            };
            // Once a second, busy or idle: under a steady backlog the lag is what an
            // operator most needs to see move.
            if last_lag.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                last_lag = Some(Instant::now());
                if let Ok(single) = store.inner.table.single(&store.inner.pool).await {
                    if let Ok(lag) = outbox.lag(single).await {
                        metrics::lag(lag.unwrap_or_default());
                    }
                }
            }
            if taken > 0 {
                linger_until = Some(Instant::now() + self.builder.linger);
                tokio::task::yield_now().await;
                continue;
            }
            if stopped_short {
                tokio::task::yield_now().await;
                continue;
            }
            // Nothing to take: look again in a tick while lingering, else wait for a
            // commit's NOTIFY or the next poll.
            let lingering = linger_until.is_some_and(|until| Instant::now() < until);
            let poll = tokio::time::sleep(if lingering {
                tick
            } else {
                self.builder.poll_interval
            });
            let stop = self.stopping.wake.notified();
            match &mut listener {
                Some(l) => {
                    tokio::select! {
                        received = l.recv() => match received {
                            Ok(_) => linger_until = Some(Instant::now() + self.builder.linger),
                            Err(error) => {
                                tracing::warn!(%error, "idem: the outbox relay lost its LISTEN connection; polling until it is back");
                                listener = None;
                            }
                        },
                        () = poll => {}
                        () = stop => {}
                    }
                }
                None => {
                    tokio::select! {
                        () = poll => {}
                        () = stop => {}
                    }
                }
            }
        }
        if let Some(session) = session {
            session.close().await;
        }
    }

    async fn listener(&self) -> Option<PgListener> {
        let store = &self.builder.store;
        let channel = store.inner.outbox.channel();
        let connect = async {
            let mut listener = match &self.listen_options {
                Some(options) => {
                    let direct = PgPoolOptions::new()
                        .max_connections(1)
                        .connect_lazy_with(options.clone());
                    PgListener::connect_with(&direct).await?
                }
                None => PgListener::connect_with(&store.inner.pool).await?,
            };
            listener.listen(channel).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match connect.await {
            Ok(listener) => Some(listener),
            Err(error) => {
                tracing::warn!(%error, "idem: the outbox relay cannot LISTEN; polling");
                None
            }
        }
    }

    /// Opens this relay's [`Session`] where its leases can end with it: a connection of
    /// its own, and the lock of an owner number no other session holds. `None` where they
    /// cannot, or when it fails (logged once until it works again): its takes then lease
    /// by time, and it tries again at its next round.
    async fn open_session(&self, warned: &mut bool) -> Option<Session> {
        let options = self.session_options.as_ref()?;
        let outbox = &self.builder.store.inner.outbox;
        let open = async {
            let mut conn = PgConnection::connect_with(options).await?;
            // Owner numbers are random: another relay holding the one drawn (once in
            // two billion) only costs a second draw.
            for _ in 0..4 {
                let owner = i32::try_from(random_u64() >> 33).unwrap_or_default();
                if outbox.lock(&mut conn, owner).await? {
                    return Ok(Session { conn, owner });
                }
            }
            Err(sqlx::Error::Protocol(
                "every owner number drawn was held by another session".into(),
            ))
        };
        let opened = tokio::time::timeout(self.builder.store.inner.acquire_timeout, open)
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut));
        match opened {
            Ok(session) => {
                *warned = false;
                Some(session)
            }
            Err(error) => {
                if !std::mem::replace(warned, true) {
                    tracing::warn!(%error, "idem: the outbox relay cannot open its session connection; its leases end by their time until it can");
                }
                None
            }
        }
    }

    /// Asks the publisher for its destinations' duplicate windows and logs an ERROR for
    /// each that this relay's copies can outlive.
    async fn check_windows(&self) {
        let b = &self.builder;
        check_windows(&*b.publisher, b.lease, b.publish_timeout, b.backoff.1).await;
    }

    /// One round: take a batch under a token of its own (leased to `owner`, the session's,
    /// while its lock is held), publish it, mark it.
    ///
    /// `kept` is what the relay keeps from one round to the next.
    async fn round(&self, owner: Option<i32>, kept: &mut Kept) -> Result<Round, sqlx::Error> {
        let builder = &self.builder;
        let store = &builder.store;
        let (pool, table, outbox) = (&store.inner.pool, &store.inner.table, &store.inner.outbox);
        // Every mark of this round is conditional on it (the module's docs).
        let token = random_u64() as i64;
        // The lease the database starts when the take runs ends no earlier than this.
        let lease_ends = Instant::now() + builder.lease;
        let rows = outbox
            .claim(
                table.single(pool).await?,
                i64::from(builder.batch_size),
                builder.lease,
                token,
                owner,
                &mut kept.walk,
            )
            .await?;
        let untied = owner.is_some() && rows.iter().any(|row| !row.tied);
        if rows.is_empty() {
            return Ok(Round { taken: 0, untied });
        }
        let started = Instant::now();
        let span = tracing::debug_span!(
            "idem.relay",
            taken = rows.len(),
            published = tracing::field::Empty,
            retried = tracing::field::Empty,
            dead = tracing::field::Empty,
            round_ms = tracing::field::Empty,
        );
        let taken = rows.len();
        // A key's events go in order, one at a time: the chain its take leased behind its
        // head, each event's publish started once the one before it was acknowledged.
        // The rest of a chain is given back unpublished after a
        // failure, once the round has run for CHAIN_TIME (the events the round did not
        // take wait for its end: a slow destination does not hold them back for the
        // whole lease), and when the lease would end before the next publish could.
        let (chains, mut release) = chains(rows);
        let last_start = lease_ends
            .checked_sub(builder.publish_timeout)
            .unwrap_or(started)
            .min(started + CHAIN_TIME);
        let mut publishing = JoinSet::new();
        // The row each task publishes, and the rest of its chain, to go on with once it
        // is acknowledged.
        let mut held = HashMap::with_capacity(taken);
        let publish = |publishing: &mut JoinSet<_>, row: &ClaimedRow| {
            let publisher = Arc::clone(&builder.publisher);
            let timeout = builder.publish_timeout;
            let event = to_event(row);
            let task = publishing.spawn(async move {
                match tokio::time::timeout(timeout, publisher.publish(&event)).await {
                    Ok(result) => result,
                    // No answer says nothing about the event: the destination is
                    // unreachable or too slow, the outage's case.
                    Err(_) => Err(PublishError::unavailable(format!(
                        "no acknowledgement within {timeout:?}"
                    ))),
                }
            });
            task.id()
        };
        for chain in chains {
            let mut rest = chain.into_iter();
            if let Some(row) = rest.next() {
                held.insert(publish(&mut publishing, &row), (row, rest));
            }
        }
        let mut published = Vec::with_capacity(taken);
        let mut failed = Vec::new();
        while let Some(joined) = publishing.join_next_with_id().await {
            let (task, result) = match joined {
                Ok((task, result)) => (task, result),
                // A publisher that panicked fails its event like any error that may pass:
                // retried after a backoff, parked at the limit. Left leased, the event was
                // taken again at every lease, panicked again, and held its ordering key
                // back for ever.
                Err(error) => {
                    let task = error.id();
                    let error = PublishError::retry(panicked(error));
                    if let Some((row, _)) = held.get(&task) {
                        tracing::error!(parent: &span, event_id = %row.id, topic = %row.topic, %error, "idem: an outbox publisher panicked");
                    }
                    (task, Err(error))
                }
            };
            let Some((row, mut rest)) = held.remove(&task) else {
                continue;
            };
            match result {
                Ok(()) => {
                    metrics::delay(row.age);
                    kept.suspects.forget(row.seq);
                    published.push(row.seq);
                    if Instant::now() <= last_start {
                        if let Some(next) = rest.next() {
                            held.insert(publish(&mut publishing, &next), (next, rest));
                            continue;
                        }
                    }
                }
                Err(error) => failed.push((row, error)),
            }
            release.extend(rest.map(|row| row.seq));
        }
        let mut overtaken = 0;
        let mut deleted = 0;
        if !published.is_empty() {
            deleted = self
                .marked(lease_ends, || async {
                    outbox
                        .done(table.single(pool).await?, &published, token)
                        .await
                })
                .await?;
            overtaken += (published.len() as u64).saturating_sub(deleted);
            metrics::published(deleted);
            self.counters
                .published
                .fetch_add(deleted, Ordering::Relaxed);
        }
        if !release.is_empty() {
            self.marked(lease_ends, || async {
                outbox
                    .release(table.single(pool).await?, &release, token)
                    .await
            })
            .await?;
        }
        // The outage's rounds: one more while the destination is unavailable and nothing
        // got through, none once something did.
        let outage = if !published.is_empty() {
            self.outage.store(0, Ordering::Relaxed);
            0
        } else if failed.iter().any(|(_, error)| error.is_unavailable()) {
            let bump = |rounds: u32| Some(rounds.saturating_add(1));
            let before = self
                .outage
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, bump);
            before.map_or(u32::MAX, |rounds| rounds.saturating_add(1))
        } else {
            self.outage.load(Ordering::Relaxed)
        };
        let (mut retried, mut unavailable, mut dead) = (0, 0, 0);
        let mut outage_error = None;
        for (row, error) in failed {
            let attempts = u32::try_from(row.attempts).unwrap_or(u32::MAX);
            // Invariant 10: an unavailable destination never parks, and its attempt is
            // given back; only the event's own failures count. Unavailable for one event
            // while the destination published others is that event's own failure.
            let published_so_far = self.counters.published.load(Ordering::Relaxed);
            let outage_alone =
                error.is_unavailable() && !kept.suspects.failed_alone(row.seq, published_so_far);
            let then = if outage_alone {
                Failed::Uncounted
            } else if error.is_permanent() || attempts >= builder.max_attempts {
                Failed::Park
            } else {
                Failed::Retry
            };
            let backoff = backoff(
                builder.backoff,
                if then == Failed::Uncounted {
                    outage
                } else {
                    attempts
                },
            );
            let marked = self
                .marked(lease_ends, || async {
                    outbox
                        .failed(
                            table.single(pool).await?,
                            row.seq,
                            error.message(),
                            backoff,
                            then,
                            token,
                        )
                        .await
                })
                .await?;
            if !marked {
                overtaken += 1;
            } else if then == Failed::Uncounted {
                retried += 1;
                unavailable += 1;
                metrics::retried();
                tracing::debug!(
                    parent: &span,
                    event_id = %row.id,
                    topic = %row.topic,
                    error = %error,
                    retry_in_ms = backoff.as_millis() as u64,
                    "idem: outbox event not published, its destination is unavailable; retrying"
                );
                outage_error.get_or_insert((error, backoff));
            } else if then == Failed::Park {
                kept.suspects.forget(row.seq);
                dead += 1;
                metrics::dead();
                tracing::error!(
                    parent: &span,
                    event_id = %row.id,
                    topic = %row.topic,
                    attempts,
                    error = %error,
                    "idem: outbox event parked as dead; re-drive it with `idem outbox redrive --id <event_id>` or Store::redrive_dead"
                );
            } else {
                retried += 1;
                metrics::retried();
                tracing::warn!(
                    parent: &span,
                    event_id = %row.id,
                    topic = %row.topic,
                    attempts,
                    error = %error,
                    retry_in_ms = backoff.as_millis() as u64,
                    "idem: outbox event not published; retrying"
                );
            }
        }
        // One line per round for an outage, not one per event of every batch.
        if let Some((error, backoff)) = outage_error {
            tracing::warn!(
                parent: &span,
                events = unavailable,
                rounds = outage,
                error = %error,
                retry_in_ms = backoff.as_millis() as u64,
                "idem: the outbox's destination is unavailable; its events are tried again, not counted toward max_attempts"
            );
        }
        if overtaken > 0 {
            tracing::warn!(
                parent: &span,
                overtaken,
                "idem: the outbox relay outlived its lease: another relay took events of this round meanwhile, and publishes and marks them"
            );
        }
        self.counters.retried.fetch_add(retried, Ordering::Relaxed);
        self.counters
            .unavailable
            .fetch_add(unavailable, Ordering::Relaxed);
        self.counters.dead.fetch_add(dead, Ordering::Relaxed);
        self.counters
            .overtaken
            .fetch_add(overtaken, Ordering::Relaxed);
        span.record("published", deleted);
        span.record("retried", retried);
        span.record("dead", dead);
        span.record("round_ms", started.elapsed().as_secs_f64() * 1000.0);
        Ok(Round { taken, untied })
    }

    /// Runs `mark` (the statement that records what became of events this relay holds
    /// leased), again after a failure (no connection in time, a dropped one) until the
    /// lease ends at `give_up`: the round never outlives its lease. An event whose mark is
    /// given up stays leased until its lease ends (or the relay's session does), holding
    /// back the next events of its ordering key all that time, and is published again
    /// then; the statements are idempotent, and refused once another relay took the
    /// events, so trying again is safe.
    async fn marked<T, F, Fut>(&self, give_up: Instant, mark: F) -> Result<T, sqlx::Error>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let mut pause = Duration::from_millis(10);
        loop {
            match mark().await {
                Ok(done) => return Ok(done),
                Err(error) if Instant::now() + pause < give_up => {
                    tracing::warn!(%error, "idem: the outbox relay could not mark events; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(error) => return Err(error),
            }
        }
    }
}

/// Logs an ERROR for each of `publisher`'s destinations that drops copies for less than
/// a copy of this relay can come after the first: one lost acknowledgement (the publish
/// timeout, then the longest backoff) and one relay that stalled past its lease.
async fn check_windows<P: Publisher>(
    publisher: &P,
    lease: Duration,
    publish_timeout: Duration,
    longest_backoff: Duration,
) {
    let needed = lease + publish_timeout + longest_backoff;
    let asked = tokio::time::timeout(Duration::from_secs(10), publisher.duplicate_windows());
    let windows = match asked.await {
        Ok(Ok(windows)) => windows,
        Ok(Err(error)) => {
            tracing::warn!(%error, "idem: the outbox relay could not read its destinations' duplicate windows");
            return;
        }
        Err(_) => {
            tracing::warn!("idem: the outbox relay could not read its destinations' duplicate windows within 10s");
            return;
        }
    };
    for DuplicateWindow {
        destination,
        window,
    } in windows
    {
        if needed <= window {
            continue;
        }
        let advice = match window.checked_sub(lease + publish_timeout) {
            Some(room) if !room.is_zero() => {
                format!("lower the relay's longest backoff to {room:?} or less")
            }
            _ => "shorten the relay's lease and publish timeout, which alone exceed it".to_owned(),
        };
        tracing::error!(
            destination = %destination,
            window_s = window.as_secs_f64(),
            needed_s = needed.as_secs_f64(),
            "idem: the outbox relay can send a copy of an event after {destination} stopped dropping copies: \
             its lease ({lease:?}) + publish timeout ({publish_timeout:?}) + longest backoff ({longest_backoff:?}) \
             = {needed:?} exceed the duplicate window ({window:?}). A copy sent after a lost acknowledgement \
             or by a relay that stalled past its lease would reach the consumers as a second message \
             (a consumer's run_once keyed by the event id still runs its work once); {advice}, or widen the window"
        );
    }
}

/// The failure of a publish task that did not return: its panic's message.
fn panicked(error: tokio::task::JoinError) -> String {
    if !error.is_panic() {
        return "the publish task was cancelled".to_owned();
    }
    let payload = error.into_panic();
    let message = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a payload that is not text");
    format!("the publisher panicked: {message}")
}

/// The `application_name` of a relay's session connection, by which operators tell the
/// relays apart ([`Operate::outbox_relays`](crate::operate::Operate::outbox_relays)): `idem relay`, the
/// host's name (`HOSTNAME`, else `/etc/hostname`) and the process's id, within the 63
/// bytes PostgreSQL keeps.
fn session_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown host".to_owned());
    let mut name = format!("idem relay {host} pid {}", std::process::id());
    if name.len() > 63 {
        let pid = format!(" pid {}", std::process::id());
        let mut cut = 63 - pid.len();
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
        name.push_str(&pid);
    }
    name
}

/// 64 random bits: a lease token, an owner number. From the standard library's hasher
/// keys (seeded by the operating system once per process) over a counter, so two calls
/// never repeat within a process and two processes draw apart.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(DRAWS.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

/// A take's rows as the chains that publish them, each in order: one per ordering key
/// (its head and the rows the take leased behind it), one per event without a key. A row
/// whose predecessor the take did not get (another relay took it first) is in none: its
/// `seq` is in the second list, to be given back unpublished.
fn chains(mut rows: Vec<ClaimedRow>) -> (Vec<Vec<ClaimedRow>>, Vec<i64>) {
    rows.sort_by_key(|row| row.seq);
    let mut chains: Vec<Vec<ClaimedRow>> = Vec::with_capacity(rows.len());
    // The chain of each key, by where its last row is: a row goes on the chain whose last
    // row is its predecessor.
    let mut ends: HashMap<i64, usize> = HashMap::new();
    let mut orphans = Vec::new();
    for row in rows {
        match row.prev {
            None => {
                ends.insert(row.seq, chains.len());
                chains.push(vec![row]);
            }
            Some(prev) => match ends.remove(&prev) {
                Some(chain) => {
                    ends.insert(row.seq, chain);
                    chains[chain].push(row);
                }
                None => orphans.push(row.seq),
            },
        }
    }
    (chains, orphans)
}

fn to_event(row: &ClaimedRow) -> OutboxEvent {
    OutboxEvent {
        id: row.id.clone(),
        topic: row.topic.clone(),
        ordering_key: row.ordering_key.clone(),
        headers: super::decode_headers(&row.headers),
        payload: row.payload.clone(),
        attempt: u32::try_from(row.attempts).unwrap_or(u32::MAX),
    }
}

/// The wait after the `attempts`-th failure (or the `attempts`-th round of an outage):
/// `first` doubled `attempts - 1` times, at most `max`.
fn backoff((first, max): (Duration, Duration), attempts: u32) -> Duration {
    let doublings = attempts.saturating_sub(1).min(30);
    first.saturating_mul(1 << doublings).min(max)
}

#[cfg(feature = "metrics")]
mod metrics {
    use std::time::Duration;

    pub(super) fn published(events: u64) {
        ::metrics::counter!("idem_outbox_published_total").increment(events);
    }

    pub(super) fn delay(age: Duration) {
        ::metrics::histogram!("idem_outbox_publish_delay_seconds").record(age.as_secs_f64());
    }

    pub(super) fn retried() {
        ::metrics::counter!("idem_outbox_retried_total").increment(1);
    }

    pub(super) fn dead() {
        ::metrics::counter!("idem_outbox_dead_total").increment(1);
    }

    pub(super) fn lag(lag: Duration) {
        ::metrics::gauge!("idem_outbox_lag_seconds").set(lag.as_secs_f64());
    }
}

#[cfg(not(feature = "metrics"))]
mod metrics {
    use std::time::Duration;

    pub(super) fn published(_: u64) {}

    pub(super) fn delay(_: Duration) {}

    pub(super) fn retried() {}

    pub(super) fn dead() {}

    pub(super) fn lag(_: Duration) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let b = (Duration::from_millis(500), Duration::from_secs(5));
        assert_eq!(backoff(b, 1), Duration::from_millis(500));
        assert_eq!(backoff(b, 2), Duration::from_secs(1));
        assert_eq!(backoff(b, 4), Duration::from_secs(4));
        assert_eq!(backoff(b, 5), Duration::from_secs(5));
        assert_eq!(backoff(b, u32::MAX), Duration::from_secs(5));
    }

    /// Regression (issue 27, finding 11): the defaults (lease 30 s, backoff up to 5 min)
    /// let a copy arrive after JetStream's default duplicate window (2 min), against the
    /// guide's own rule ("The outbox and its consumers", "Broker settings").
    #[test]
    fn the_defaults_keep_copies_inside_jetstreams_default_window() {
        let needed = DEFAULT_LEASE + DEFAULT_PUBLISH_TIMEOUT + DEFAULT_BACKOFF.1;
        assert!(needed <= Duration::from_secs(120), "{needed:?}");
        assert!(DEFAULT_PUBLISH_TIMEOUT < DEFAULT_LEASE);
    }

    #[test]
    fn a_sessions_name_names_the_process_within_63_bytes() {
        let name = super::session_name();
        assert!(name.starts_with("idem relay "), "{name}");
        assert!(
            name.ends_with(&format!(" pid {}", std::process::id())),
            "{name}"
        );
        assert!(name.len() <= 63, "{name}");
    }

    #[test]
    fn random_draws_differ() {
        let draws: std::collections::HashSet<u64> = (0..1000).map(|_| random_u64()).collect();
        assert_eq!(draws.len(), 1000);
    }
}
