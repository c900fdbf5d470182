//! A running relay: its rounds (take a batch under a lease, publish it, mark it), its
//! session, and what it keeps from one round to the next.

use super::*;
use std::sync::atomic::AtomicUsize;

pub(super) struct Running<P> {
    pub(super) builder: RelayBuilder<P>,
    pub(super) counters: Arc<Counters>,
    pub(super) stopping: Arc<Stop>,
    pub(super) listen: bool,
    /// Where to open the `LISTEN` connection when not on the store's pool
    /// ([`RelayBuilder::listen`]).
    pub(super) listen_options: Option<PgConnectOptions>,
    /// Where to open the session that ties this relay's leases to its life; `None` where
    /// they end by their time only.
    pub(super) session_options: Option<PgConnectOptions>,
    /// How many rounds in a row found the destination unavailable and published nothing:
    /// the backoff of an unavailable event grows with it, as its attempts do not.
    pub(super) outage: AtomicU32,
}

/// A relay's session: a connection of its own, running nothing but the advisory lock of
/// `owner` that it holds while open. A take leases rows to `owner` while the lock is
/// held; when the connection ends (the process killed, the connection dropped),
/// PostgreSQL releases the lock and the other relays' takes treat those leases as ended.
pub(super) struct Session {
    conn: PgConnection,
    pub(super) owner: i32,
}

impl Session {
    pub(super) async fn close(self) {
        // Closing releases the lock; a failure to say goodbye releases it too.
        self.conn.close().await.ok();
    }
}

/// How long a relay waits before it tries again to open a session that failed.
pub(super) const SESSION_RETRY: Duration = Duration::from_secs(5);

/// What a relay keeps from one round to the next.
#[derive(Default)]
pub(super) struct Kept {
    /// Where the last take's walks stopped: the next take starts there ([`Walk`]).
    pub(super) walk: Walk,
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
pub(super) struct Suspects {
    failed_at: HashMap<i64, u64>,
}

/// How many suspects a relay keeps; past it, it starts afresh (a long outage of many
/// events: none of them would count yet anyway).
pub(super) const SUSPECTS: usize = 100_000;

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
/// A round's lease: the token every mark of the round is conditional on, and when the
/// lease the database started ends at the earliest.
#[derive(Clone, Copy)]
pub(super) struct Lease {
    token: i64,
    ends: Instant,
}

/// What became of a round's failed events, and how many of its events another relay
/// took meanwhile.
#[derive(Default)]
pub(super) struct Tally {
    retried: u64,
    unavailable: u64,
    dead: u64,
    overtaken: u64,
}

pub(super) struct Round {
    /// How many events it took.
    pub(super) taken: usize,
    /// Whether it took events without its session lock held: the session is gone.
    pub(super) untied: bool,
}

impl<P: Publisher> Running<P> {
    pub(super) async fn run(self) {
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
            let stop = self.stopping.notified();
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
    pub(super) async fn open_session(&self, warned: &mut bool) -> Option<Session> {
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
    pub(super) async fn check_windows(&self) {
        let b = &self.builder;
        check_windows(&*b.publisher, b.lease, b.publish_timeout, b.backoff.1).await;
    }

    /// One round: take a batch under a token of its own (leased to `owner`, the session's,
    /// while its lock is held), publish it, mark it.
    ///
    /// `kept` is what the relay keeps from one round to the next.
    pub(super) async fn round(
        &self,
        owner: Option<i32>,
        kept: &mut Kept,
    ) -> Result<Round, sqlx::Error> {
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
        let lease = Lease {
            token,
            ends: lease_ends,
        };
        let (published, failed, release) = self.publish(rows, started, lease, kept, &span).await;
        let deleted = self.mark_published(lease, &published, &release).await?;
        let mut tally = Tally {
            overtaken: (published.len() as u64).saturating_sub(deleted),
            ..Tally::default()
        };
        let outage = self.outage_rounds(!published.is_empty(), &failed);
        self.mark_failed(failed, outage, lease, kept, &span, &mut tally)
            .await?;
        if tally.overtaken > 0 {
            tracing::warn!(
                parent: &span,
                overtaken = tally.overtaken,
                "idem: the outbox relay outlived its lease: another relay took events of this round meanwhile, and publishes and marks them"
            );
        }
        let counters = &self.counters;
        counters.retried.fetch_add(tally.retried, Ordering::Relaxed);
        counters
            .unavailable
            .fetch_add(tally.unavailable, Ordering::Relaxed);
        counters.dead.fetch_add(tally.dead, Ordering::Relaxed);
        counters
            .overtaken
            .fetch_add(tally.overtaken, Ordering::Relaxed);
        span.record("published", deleted);
        span.record("retried", tally.retried);
        span.record("dead", tally.dead);
        span.record("round_ms", started.elapsed().as_secs_f64() * 1000.0);
        Ok(Round { taken, untied })
    }

    /// Publishes a round's `rows`: a key's events in order, one at a time, the chain its
    /// take leased behind its head, each event's publish started once the one before it
    /// was acknowledged. The rest of a chain is given back unpublished after a failure,
    /// once the round has run for [`CHAIN_TIME`] (the events the round did not take wait
    /// for its end: a slow destination does not hold them back for the whole lease), and
    /// when the lease would end before the next publish could. What was published (by
    /// `seq`), what failed, and what is given back.
    async fn publish(
        &self,
        rows: Vec<ClaimedRow>,
        started: Instant,
        lease: Lease,
        kept: &mut Kept,
        span: &tracing::Span,
    ) -> (Vec<i64>, Vec<(ClaimedRow, PublishError)>, Vec<i64>) {
        let builder = &self.builder;
        let taken = rows.len();
        let (chains, mut release) = chains(rows);
        let last_start = lease
            .ends
            .checked_sub(builder.publish_timeout)
            .unwrap_or(started)
            .min(started + CHAIN_TIME);
        // One task per chain, not one per event: with one ordering key the whole take is
        // one chain, and a spawn and a join for each of its events (the round spawning a
        // chain's next publish once it heard of the one before) took nearly a third of one
        // key's drain. The chains still run concurrently, each in its own task.
        let mut publishing = JoinSet::new();
        // Each task's chain, shared with it: the task counts the rows acknowledged there,
        // so that a task that panicked still tells which row it was publishing.
        let mut held = HashMap::with_capacity(chains.len());
        for rows in chains {
            let chain = Arc::new(Chain {
                rows,
                acknowledged: AtomicUsize::new(0),
            });
            let task = publishing.spawn(publish_chain(
                Arc::clone(&builder.publisher),
                Arc::clone(&chain),
                builder.publish_timeout,
                last_start,
            ));
            held.insert(task.id(), chain);
        }
        let mut published = Vec::with_capacity(taken);
        let mut failed = Vec::new();
        while let Some(joined) = publishing.join_next_with_id().await {
            let (task, error, panic) = match joined {
                Ok((task, error)) => (task, error, false),
                // A publisher that panicked fails its event like any error that may pass:
                // retried after a backoff, parked at the limit. Left leased, the event was
                // taken again at every lease, panicked again, and held its ordering key
                // back for ever. The panic ends its chain's task, as it ended the event's
                // own task before, and the chain's count says which event it was: no
                // publish needs wrapping to catch it (nor a crate to wrap it with).
                Err(error) => (error.id(), Some(PublishError::retry(panicked(error))), true),
            };
            let Some(chain) = held.remove(&task) else {
                continue;
            };
            let acknowledged = chain.acknowledged.load(Ordering::Acquire);
            // A task's future, and its share of the chain with it, is dropped before its
            // end is reported: the rows come back without a copy.
            let rows = Arc::try_unwrap(chain)
                .map_or_else(|shared| shared.rows.clone(), |chain| chain.rows);
            let mut rows = rows.into_iter();
            for row in rows.by_ref().take(acknowledged) {
                metrics::delay(row.age);
                kept.suspects.forget(row.seq);
                published.push(row.seq);
            }
            // The row after the acknowledged ones failed, or its chain ran out of time
            // before it; either way the rest of the chain goes back.
            if let Some(error) = error {
                if let Some(row) = rows.next() {
                    if panic {
                        tracing::error!(parent: span, event_id = %row.id, topic = %row.topic, %error, "idem: an outbox publisher panicked");
                    }
                    failed.push((row, error));
                }
            }
            release.extend(rows.map(|row| row.seq));
        }
        (published, failed, release)
    }

    /// Marks the round's published events done and gives back the unpublished rest of
    /// their chains, under the round's lease: how many of the published it deleted (the
    /// others were taken by another relay meanwhile).
    async fn mark_published(
        &self,
        lease: Lease,
        published: &[i64],
        release: &[i64],
    ) -> Result<u64, sqlx::Error> {
        let store = &self.builder.store;
        let (pool, table, outbox) = (&store.inner.pool, &store.inner.table, &store.inner.outbox);
        let mut deleted = 0;
        if !published.is_empty() {
            deleted = self
                .marked(lease.ends, || async {
                    outbox
                        .done(table.single(pool).await?, published, lease.token)
                        .await
                })
                .await?;
            metrics::published(deleted);
            self.counters
                .published
                .fetch_add(deleted, Ordering::Relaxed);
        }
        if !release.is_empty() {
            self.marked(lease.ends, || async {
                outbox
                    .release(table.single(pool).await?, release, lease.token)
                    .await
            })
            .await?;
        }
        Ok(deleted)
    }

    /// The outage's rounds: one more while the destination is unavailable and nothing got
    /// through, none once something did.
    fn outage_rounds(&self, published: bool, failed: &[(ClaimedRow, PublishError)]) -> u32 {
        if published {
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
        }
    }

    /// Marks each failed event: given back uncounted while its destination is out
    /// (invariant 10), retried after its backoff, or parked at the limit; one log line
    /// per event, and one per round for an outage.
    async fn mark_failed(
        &self,
        failed: Vec<(ClaimedRow, PublishError)>,
        outage: u32,
        lease: Lease,
        kept: &mut Kept,
        span: &tracing::Span,
        tally: &mut Tally,
    ) -> Result<(), sqlx::Error> {
        let builder = &self.builder;
        let store = &builder.store;
        let (pool, table, outbox) = (&store.inner.pool, &store.inner.table, &store.inner.outbox);
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
            let counted = if then == Failed::Uncounted {
                outage
            } else {
                attempts
            };
            let backoff = backoff(builder.backoff, counted);
            let marked = self
                .marked(lease.ends, || async {
                    let conn = table.single(pool).await?;
                    let message = error.message();
                    outbox
                        .failed(conn, row.seq, message, backoff, then, lease.token)
                        .await
                })
                .await?;
            if !marked {
                tally.overtaken += 1;
                continue;
            }
            let retry_in_ms = backoff.as_millis() as u64;
            match then {
                Failed::Uncounted => {
                    tally.retried += 1;
                    tally.unavailable += 1;
                    metrics::retried();
                    tracing::debug!(parent: span, event_id = %row.id, topic = %row.topic, error = %error, retry_in_ms, "idem: outbox event not published, its destination is unavailable; retrying");
                    outage_error.get_or_insert((error, backoff));
                }
                Failed::Park => {
                    kept.suspects.forget(row.seq);
                    tally.dead += 1;
                    metrics::dead();
                    tracing::error!(parent: span, event_id = %row.id, topic = %row.topic, attempts, error = %error, "idem: outbox event parked as dead; re-drive it with `idem outbox redrive --id <event_id>` or Audited::redrive_dead");
                }
                Failed::Retry => {
                    tally.retried += 1;
                    metrics::retried();
                    tracing::warn!(parent: span, event_id = %row.id, topic = %row.topic, attempts, error = %error, retry_in_ms, "idem: outbox event not published; retrying");
                }
            }
        }
        // One line per round for an outage, not one per event of every batch.
        if let Some((error, backoff)) = outage_error {
            tracing::warn!(
                parent: span,
                events = tally.unavailable,
                rounds = outage,
                error = %error,
                retry_in_ms = backoff.as_millis() as u64,
                "idem: the outbox's destination is unavailable; its events are tried again, not counted toward max_attempts"
            );
        }
        Ok(())
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
pub(super) async fn check_windows<P: Publisher>(
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
pub(super) fn panicked(error: tokio::task::JoinError) -> String {
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
pub(super) fn session_name() -> String {
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
pub(super) fn random_u64() -> u64 {
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
pub(super) fn chains(mut rows: Vec<ClaimedRow>) -> (Vec<Vec<ClaimedRow>>, Vec<i64>) {
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

/// A chain of a round, shared by the round and the task that publishes it: its rows in
/// order, and how many of them the destination acknowledged so far.
struct Chain {
    rows: Vec<ClaimedRow>,
    acknowledged: AtomicUsize,
}

/// Publishes `chain`'s rows in order, each within `timeout` and only once the one before
/// it was acknowledged, starting none after the first past `last_start`: the error of the
/// row that failed, if one did (the one after the acknowledged ones).
async fn publish_chain<P: Publisher>(
    publisher: Arc<P>,
    chain: Arc<Chain>,
    timeout: Duration,
    last_start: Instant,
) -> Option<PublishError> {
    for (done, row) in chain.rows.iter().enumerate() {
        if done > 0 && Instant::now() > last_start {
            return None;
        }
        let event = to_event(row);
        match tokio::time::timeout(timeout, publisher.publish(&event)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Some(error),
            // No answer says nothing about the event: the destination is unreachable or
            // too slow, the outage's case.
            Err(_) => {
                return Some(PublishError::unavailable(format!(
                    "no acknowledgement within {timeout:?}"
                )))
            }
        }
        chain.acknowledged.store(done + 1, Ordering::Release);
    }
    None
}

pub(super) fn to_event(row: &ClaimedRow) -> OutboxEvent {
    OutboxEvent {
        id: row.id.clone(),
        topic: row.topic.clone(),
        ordering_key: row.ordering_key.clone(),
        headers: crate::outbox::decode_headers(&row.headers),
        payload: row.payload.clone(),
        attempt: u32::try_from(row.attempts).unwrap_or(u32::MAX),
    }
}

/// The wait after the `attempts`-th failure (or the `attempts`-th round of an outage):
/// `first` doubled `attempts - 1` times, at most `max`.
pub(super) fn backoff((first, max): (Duration, Duration), attempts: u32) -> Duration {
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
