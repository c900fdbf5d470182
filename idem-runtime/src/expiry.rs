//! Removing expired records: a purge call for cron, and a sweeper task.
//!
//! Expired rows are already ignored by the claim (an expired key is treated as new and
//! its row taken over in place); deleting them only keeps the table small. Each batch is
//! one short statement that locks only the rows it deletes, oldest first, and skips rows
//! a request is reclaiming right now, so sweeping never waits behind a request and no
//! request waits behind a sweep for longer than one batch's delete.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::background::Stop;
use crate::observe::metrics;
use crate::Store;

impl Store {
    /// Deletes expired records, `batch_size` rows per statement, until none is left, and
    /// returns how many it deleted; then the expired steps of requests that never
    /// committed ([`Tx::step`](crate::Tx::step)), which the count leaves out. A request for a key whose row a batch is deleting
    /// waits for that batch, up to a second, so keep batches well under a second (1 000
    /// rows take milliseconds). [`Store::spawn_sweeper`](crate::Store::spawn_sweeper) runs it periodically; an
    /// operator, through [`Audited::purge_expired`](crate::operate::Audited::purge_expired).
    pub(crate) async fn purge_expired(&self, batch_size: u32) -> Result<u64, sqlx::Error> {
        let mut removed = 0;
        self.purge_expired_counting(batch_size, &mut removed)
            .await?;
        Ok(removed)
    }

    /// [`Audited::purge_expired`](crate::operate::Audited::purge_expired), adding to `removed` the records each batch deleted as it
    /// commits, so that a sweep that fails part way still knows what it did
    /// ([`Audited::purge_expired`](crate::operate::Audited::purge_expired) records it).
    pub(crate) async fn purge_expired_counting(
        &self,
        batch_size: u32,
        removed: &mut u64,
    ) -> Result<(), sqlx::Error> {
        let batch_size = i64::from(batch_size.max(1));
        // Where the last batch stopped: each starts there (issue 36).
        let mut reached = None;
        loop {
            let deleted = self
                .inner
                .table
                .purge(&self.inner.pool, batch_size, &mut reached)
                .await?;
            *removed += deleted;
            metrics::swept(deleted);
            if deleted < batch_size as u64 {
                break;
            }
            // Let requests waiting for a connection or a lock go first.
            tokio::task::yield_now().await;
        }
        self.purge_expired_steps(batch_size).await
    }

    /// Deletes expired steps (`Tx::step`): those of requests that never committed, once
    /// their key's time has passed. Steps of a committed request went with its COMMIT.
    async fn purge_expired_steps(&self, batch_size: i64) -> Result<(), sqlx::Error> {
        let steps = self.steps();
        // As for the keys: each batch starts where the previous stopped.
        let mut reached = None;
        loop {
            let mut conn = self.inner.table.single(&self.inner.pool).await?;
            let deleted = steps.purge(&mut conn, batch_size, &mut reached).await?;
            conn.finish().await?;
            metrics::swept(deleted);
            if deleted < batch_size as u64 {
                break;
            }
            tokio::task::yield_now().await;
        }
        // The stored requests of those that never committed, which expire with them: each
        // a request whose outside calls happened and whose key never answered. Said, one
        // line each, before nothing lists them any more.
        let mut reached = None;
        loop {
            let mut conn = self.inner.table.single(&self.inner.pool).await?;
            let mut unresolved = Vec::new();
            let deleted = self
                .inner
                .requests
                .purge(&mut conn, batch_size, &mut reached, &mut unresolved)
                .await?;
            conn.finish().await?;
            for gone in &unresolved {
                tracing::error!(
                    scope = %gone.scope,
                    key = %gone.key,
                    state = %gone.state,
                    "idem: a request that made a step expired unresolved (never committed, completed \
                     or abandoned): its outside calls stand and its key answers as new from now on"
                );
            }
            metrics::swept(deleted);
            if deleted < batch_size as u64 {
                return Ok(());
            }
            tokio::task::yield_now().await;
        }
    }

    /// Starts a tokio task that purges expired records every `every`, in batches of
    /// `batch_size`, until [`Sweeper::stop`] (the task outlives a dropped handle).
    /// Failures (the database restarting, say) are logged and retried at the next tick.
    /// A zero interval is refused: it would sweep in a busy loop. With the `metrics`
    /// feature, each tick also counts the requests abandoned after their steps
    /// ([`Operate::abandoned`](crate::operate::Operate::abandoned), [`StoreBuilder::abandoned_after`](crate::StoreBuilder::abandoned_after)) into the gauge
    /// `idem_abandoned_requests`.
    ///
    /// [`StoreBuilder::abandoned_after`](crate::StoreBuilder::abandoned_after): crate::StoreBuilder::abandoned_after
    pub fn spawn_sweeper(&self, every: Duration, batch_size: u32) -> Result<Sweeper, SweeperError> {
        if every.is_zero() {
            return Err(SweeperError::ZeroInterval);
        }
        let removed = Arc::new(AtomicU64::new(0));
        let store = self.clone();
        let counter = Arc::clone(&removed);
        let stop = Arc::new(Stop::default());
        let asked = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !asked
                .tick_or_stop(async {
                    ticks.tick().await;
                })
                .await
            {
                match store.purge_expired(batch_size).await {
                    Ok(0) => {}
                    Ok(n) => {
                        counter.fetch_add(n, Ordering::Relaxed);
                        tracing::info!(rows = n, "idem: swept expired records");
                    }
                    Err(error) => {
                        tracing::warn!(%error, "idem: sweeping expired records failed; retrying at the next tick")
                    }
                }
                match store.operate().outbox_lag().await {
                    Ok(lag) => {
                        if let Some(warning) = unrelayed(lag) {
                            tracing::warn!("{warning}");
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "idem: reading the outbox's lag failed; retrying at the next tick")
                    }
                }
                if cfg!(feature = "metrics") {
                    match store.operate().abandoned_count().await {
                        Ok(n) => crate::observe::metrics::abandoned(n),
                        Err(error) => {
                            tracing::warn!(%error, "idem: counting abandoned requests failed; retrying at the next tick")
                        }
                    }
                }
            }
        });
        Ok(Sweeper {
            task,
            removed,
            stop,
        })
    }
}

/// How old the oldest pending event may be before the sweeper says that the outbox is
/// not being relayed: a relay publishes within seconds, so minutes mean none runs (or
/// none keeps up).
const UNRELAYED_AFTER: Duration = Duration::from_secs(300);

/// What the sweeper says, at each tick, when the oldest pending event is `lag` old and
/// that is past [`UNRELAYED_AFTER`]: events written by requests that no relay publishes
/// pile up unseen otherwise (issue 48).
fn unrelayed(lag: Option<Duration>) -> Option<String> {
    let lag = lag.filter(|lag| *lag >= UNRELAYED_AFTER)?;
    Some(format!(
        "idem: the outbox's oldest pending event has waited {}: is a relay running? \
         Events are published only by a relay (`idem::outbox::Relay`); \
         `idem outbox pending` lists them",
        crate::operate::format_age(lag)
    ))
}

/// Why [`Store::spawn_sweeper`](crate::Store::spawn_sweeper) did not start.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SweeperError {
    /// The interval is zero.
    ZeroInterval,
}

impl std::fmt::Display for SweeperError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ZeroInterval => {
                f.write_str("the sweeper's interval is zero; give it a period such as 60 s")
            }
        }
    }
}

impl std::error::Error for SweeperError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outbox_left_unrelayed_is_named_after_minutes() {
        assert_eq!(unrelayed(None), None);
        assert_eq!(unrelayed(Some(Duration::from_secs(30))), None);
        let said = unrelayed(Some(Duration::from_secs(600))).expect("a warning");
        assert!(
            said.contains("10m") && said.contains("is a relay running?"),
            "{said}"
        );
    }

    /// Regression: a zero interval used to panic inside the sweeper's task
    /// (`tokio::time::interval` refuses a zero period), leaving no sweeper and no error.
    #[tokio::test]
    async fn a_zero_interval_is_an_error() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://localhost/none")
            .unwrap();
        let store = Store::new(pool);
        assert_eq!(
            store.spawn_sweeper(Duration::ZERO, 10).err(),
            Some(SweeperError::ZeroInterval)
        );
        let sweeper = store.spawn_sweeper(Duration::from_secs(3600), 10).unwrap();
        sweeper.stop();
    }
}

/// A running sweeper; see [`Store::spawn_sweeper`](crate::Store::spawn_sweeper).
#[derive(Debug)]
pub struct Sweeper {
    task: tokio::task::JoinHandle<()>,
    removed: Arc<AtomicU64>,
    stop: Arc<Stop>,
}

impl Sweeper {
    /// How many expired records this sweeper has deleted so far.
    pub fn removed(&self) -> u64 {
        self.removed.load(Ordering::Relaxed)
    }

    /// Stops the sweeper once the sweep it is in is done; [`Sweeper::stopped`] waits for
    /// that. Its task outlives a dropped handle.
    pub fn stop(&self) {
        self.stop.ask();
    }

    /// Stops the sweeper and waits until it has.
    pub async fn stopped(self) {
        self.stop();
        self.task.await.ok();
    }

    /// Stops the sweeper at once, after its current statement (as a crash would: a batch
    /// in progress rolls back).
    pub fn abort(&self) {
        self.task.abort();
    }
}
