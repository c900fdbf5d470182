//! The operators' audit trail: every action taken through [`Operate::audited`](crate::operate::Operate::audited) (a purge, a
//! sweep, a re-drive, a discard) writes one row to the audit table, naming who acted,
//! through what, on what, and how many rows moved; [`Operate::audit_log`](crate::operate::Operate::audit_log) reads it back.
//!
//! The row is written in the transaction of the action itself: an action that committed
//! has its row, and one that failed or was refused (a re-drive outside the window) has
//! none, whatever crashes between the two. A sweep is the exception: it deletes in many
//! short transactions, so that no request waits behind it, and writes its row in a
//! transaction of its own after its last batch, with the total (after a failure part way,
//! with what the finished batches deleted).

use super::Operate;
use std::time::SystemTime;

use serde::Serialize;
use sqlx::{Postgres, Row, Transaction};

use super::{
    instant, rfc3339, ConfirmError, Confirmed, DeadBound, DeadSelection, EventFilter, RedriveError,
};
use crate::table::audit::AuditWrite;
use crate::Store;

/// Who acts on idem's tables, and through what: each of [`Audited`]'s actions is
/// recorded with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    name: String,
    via: String,
}

impl Operator {
    /// The operator `name` (a person, or a job), acting through `via`: idem's console
    /// says `console`, its command line `cli`; name your own tools as you like.
    pub fn new(name: impl Into<String>, via: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            via: via.into(),
        }
    }

    /// Who acts.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Through what.
    pub fn via(&self) -> &str {
        &self.via
    }
}

/// One row of the audit trail ([`Operate::audit_log`](crate::operate::Operate::audit_log)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AuditEntry {
    /// The row's id: later rows have higher ids. [`Operate::audit_log`](crate::operate::Operate::audit_log) pages by it.
    pub id: i64,
    /// When the action ran (the start of its transaction, by the database's clock).
    #[serde(serialize_with = "rfc3339")]
    pub at: SystemTime,
    /// Who acted ([`Operator::name`]).
    pub operator: String,
    /// Through what ([`Operator::via`]): `console`, `cli`, or what the service named.
    pub via: String,
    /// What was done: `purge` (one key's record), `sweep` (expired records),
    /// `redrive` or `redrive_forced` (dead events made pending again, within the
    /// re-drive window or past it), `discard` (dead events deleted).
    pub action: String,
    /// What the action selected: the key with its scope and principal, the events' ids,
    /// their reason or `all` ([`DeadSelection`]'s text), the sweep's batch size; for an
    /// action confirmed after its preview, the [`EventFilter`] and then, after `; as
    /// previewed: `, its [`DeadBound`].
    pub filter: String,
    /// How many rows it moved.
    pub rows: u64,
}

/// A store's operator actions, each recorded in the audit table with the [`Operator`]
/// who took it, in the action's own transaction ([`Operate::audited`]). Every change an
/// operator makes to idem's tables goes through here: there is no unrecorded way.
#[derive(Debug, Clone)]
pub struct Audited<'a> {
    store: &'a Store,
    operator: Operator,
}

impl<'a> Operate<'a> {
    /// The operator actions of this store, recorded in the audit table
    /// ([`StoreBuilder::audit_table`](crate::StoreBuilder::audit_table), default
    /// `idem_audit`) as taken by `operator`: what the console and the command line use,
    /// and what a service's own admin tools should.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), sqlx::Error> {
    /// use idem::operate::{DeadSelection, Operator};
    ///
    /// let ops = store.operate().audited(Operator::new("ana@example.com", "support-tool"));
    /// let purged = ops.purge_key("charges", "acct_1", "order-42").await?;
    /// let discarded = ops
    ///     .discard_dead(&DeadSelection::Reason("the stream was deleted".into()))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn audited(self, operator: Operator) -> Audited<'a> {
        Audited {
            store: self.store(),
            operator,
        }
    }

    /// The audit trail, newest first: at most `limit` rows, those older than the row
    /// `before` (an [`AuditEntry::id`]; `None`: from the newest). The next page starts
    /// before the last row's id.
    pub async fn audit_log(
        self,
        limit: u32,
        before: Option<i64>,
    ) -> Result<Vec<AuditEntry>, sqlx::Error> {
        let persistent = self.store().inner.table.persistent();
        let mut conn = self
            .store()
            .inner
            .table
            .single(&self.store().inner.pool)
            .await?;
        let rows = self
            .store()
            .inner
            .audit
            .list(&mut conn, persistent, limit, before)
            .await?;
        conn.finish().await?;
        rows.iter()
            .map(|row| {
                Ok(AuditEntry {
                    id: row.try_get("id")?,
                    at: instant(row.try_get("at")?),
                    operator: row.try_get("operator")?,
                    via: row.try_get("via")?,
                    action: row.try_get("action")?,
                    filter: row.try_get("filter")?,
                    rows: u64::try_from(row.try_get::<i64, _>("rows")?).unwrap_or(0),
                })
            })
            .collect()
    }
}

impl Audited<'_> {
    /// Who these actions are recorded as taken by.
    pub fn operator(&self) -> &Operator {
        &self.operator
    }

    /// The store they act on: its unrecorded reads (and actions) stay at hand.
    pub fn store(&self) -> &Store {
        self.store
    }

    /// Deletes the committed record of `key` for `principal` in `scope` in every place
    /// [`Store::inspect`](crate::Store::inspect) looks, so that the next request with the key runs afresh.
    /// Returns how many records went (0: none was there). A request in flight with the
    /// key is not touched (in the portable mode, where such a request holds the key's
    /// row, the delete waits for it to end). This store's
    /// [`replay_cache`](crate::StoreBuilder::replay_cache) is emptied; another
    /// instance's replays from its own within its `max_stale`.
    ///
    /// Recorded as `purge` with the key, its scope and its principal, in the same
    /// transaction.
    pub async fn purge_key(
        &self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<u64, sqlx::Error> {
        let store = self.store;
        let mut tx = store.inner.table.acting(&store.inner.pool).await?;
        let purged = store
            .operate()
            .purge_key_on(&mut tx, scope, principal, key)
            .await?;
        let mut filter = format!("scope {scope:?}");
        if !principal.is_empty() {
            filter.push_str(&format!(", principal {principal:?}"));
        }
        filter.push_str(&format!(", key {key:?}"));
        self.commit(tx, "purge", &filter, purged).await?;
        store.operate().purged_answers();
        Ok(purged)
    }

    /// Deletes expired records, `batch_size` rows per statement, until none is left, and
    /// returns how many it deleted; then the expired steps of requests that never
    /// committed ([`Tx::step`](crate::Tx::step)), which the count leaves out. A request
    /// for a key whose row a batch is deleting waits for that batch, up to a second, so
    /// keep batches well under a second (1 000 rows take milliseconds). For a cron job;
    /// [`Store::spawn_sweeper`](crate::Store::spawn_sweeper) runs the same deletes periodically.
    ///
    /// Recorded as `sweep` with its batch size. A sweep
    /// commits batch by batch (no request waits behind it), so its row is written in a
    /// transaction of its own after its last batch, with the total; after a failure part
    /// way, with what the finished batches deleted, and the failure is returned. Its row
    /// is first written and rolled back before the first batch: a sweep that could not
    /// record itself (no audit table, no `INSERT` on it) deletes nothing.
    pub async fn purge_expired(&self, batch_size: u32) -> Result<u64, sqlx::Error> {
        let store = self.store;
        let filter = format!("expired, batch {}", batch_size.max(1));
        let mut tried = store.inner.table.acting(&store.inner.pool).await?;
        let row = AuditWrite {
            operator: &self.operator.name,
            via: &self.operator.via,
            action: "sweep",
            filter: &filter,
            rows: 0,
        };
        store
            .inner
            .audit
            .write(&mut tried, store.inner.table.persistent(), &row)
            .await?;
        tried.rollback().await?;
        let mut removed = 0;
        let swept = store.purge_expired_counting(batch_size, &mut removed).await;
        if swept.is_ok() || removed > 0 {
            let tx = store.inner.table.acting(&store.inner.pool).await;
            let written = match tx {
                Ok(tx) => self.commit(tx, "sweep", &filter, removed).await,
                Err(e) => Err(e),
            };
            // The sweep's own failure says more than the record's.
            swept?;
            written?;
        }
        Ok(removed)
    }

    /// Makes the dead events `selection` names pending again, their attempts reset, and
    /// returns how many, if all of them are within the re-drive window: written less
    /// than [`Operate::redrive_max_age`](crate::operate::Operate::redrive_max_age) ago. If one is not, it re-drives none and answers
    /// [`RedriveError::OutsideWindow`], with how many are outside and the oldest's age,
    /// so that the operator decides: a partial re-drive would leave them guessing which
    /// moved. Check and move are one statement: no event ages between them.
    ///
    /// The window is what keeps a re-drive exactly-once for consumers that deduplicate
    /// deliveries with [`Store::run_once`](crate::Store::run_once): a dead event may have reached them before
    /// (its publish failed after the broker took it), and their record of it expires
    /// with its ttl. Past the window, [`Audited::redrive_dead_forced`] re-drives anyway.
    ///
    /// Their ordering keys' later events, published meanwhile, are not held back for
    /// them.
    ///
    /// Recorded as `redrive` with the selection. A re-drive refused for an event outside
    /// the window moves nothing and records nothing.
    pub async fn redrive_dead(&self, selection: &DeadSelection) -> Result<u64, RedriveError> {
        let store = self.store;
        let mut tx = store.inner.table.acting(&store.inner.pool).await?;
        let moved = store
            .operate()
            .redrive_on(&mut tx, &EventFilter::from(selection), None, false)
            .await?
            .unforced(store.inner.redrive_max_age)?;
        self.commit(tx, "redrive", &selection.to_string(), moved)
            .await?;
        Ok(moved)
    }

    /// Makes the dead events `selection` names pending again, their attempts reset, and
    /// returns how many, whatever their age: [`Audited::redrive_dead`] without the
    /// re-drive window. For events whose consumers are known to take them again
    /// safely, or that never reached them.
    ///
    /// Recorded as `redrive_forced` with the selection.
    pub async fn redrive_dead_forced(&self, selection: &DeadSelection) -> Result<u64, sqlx::Error> {
        let store = self.store;
        let mut tx = store.inner.table.acting(&store.inner.pool).await?;
        let filter = EventFilter::from(selection);
        let moved = store
            .operate()
            .redrive_on(&mut tx, &filter, None, true)
            .await?
            .moved;
        self.commit(tx, "redrive_forced", &selection.to_string(), moved)
            .await?;
        Ok(moved)
    }

    /// Deletes the dead events `selection` names, and returns how many: they are never
    /// published.
    ///
    /// Recorded as `discard` with the selection.
    pub async fn discard_dead(&self, selection: &DeadSelection) -> Result<u64, sqlx::Error> {
        let store = self.store;
        let mut tx = store.inner.table.acting(&store.inner.pool).await?;
        let filter = EventFilter::from(selection);
        let (discarded, _) = store.operate().discard_on(&mut tx, &filter, None).await?;
        self.commit(tx, "discard", &selection.to_string(), discarded)
            .await?;
        Ok(discarded)
    }

    /// Re-drives the dead events `filter` names within `bound`, the bound of their
    /// preview ([`Operate::dead_preview`](crate::operate::Operate::dead_preview)): those the operator saw counted, not an event
    /// parked since, which is left as it is and counted in [`Confirmed::left`]. Recorded
    /// as `redrive` (`redrive_forced` when `force`) with the filter and the bound. Within
    /// the re-drive window unless `force`, as [`Audited::redrive_dead`]. Nothing moves, and
    /// nothing is recorded, when the bound holds more events than the preview counted
    /// ([`ConfirmError::Changed`]) or, unforced, when one is outside the window.
    pub async fn redrive_confirmed(
        &self,
        filter: &EventFilter,
        bound: &DeadBound,
        force: bool,
    ) -> Result<Confirmed, ConfirmError> {
        let store = self.store;
        let mut tx = store.inner.table.acting(&store.inner.pool).await?;
        let done = store
            .operate()
            .redrive_on(&mut tx, filter, Some(bound), force)
            .await?;
        if done.selected > bound.events() {
            return Err(ConfirmError::Changed {
                bounded: done.selected,
                previewed: bound.events(),
            });
        }
        if !force && done.outside > 0 {
            return Err(ConfirmError::OutsideWindow {
                selected: done.selected,
                outside: done.outside,
                oldest: done.oldest,
                max_age: store.inner.redrive_max_age,
            });
        }
        let action = if force { "redrive_forced" } else { "redrive" };
        self.commit(tx, action, &bounded(filter, bound), done.moved)
            .await?;
        self.confirmed(filter, bound, done.moved).await
    }

    /// Deletes the dead events `filter` names within `bound`, the bound of their preview
    /// ([`Operate::dead_preview`](crate::operate::Operate::dead_preview)), as [`Audited::redrive_confirmed`] re-drives them:
    /// recorded as `discard` with the filter and the bound; nothing deleted nor recorded
    /// when the bound holds more events than the preview counted.
    pub async fn discard_confirmed(
        &self,
        filter: &EventFilter,
        bound: &DeadBound,
    ) -> Result<Confirmed, ConfirmError> {
        let store = self.store;
        let mut tx = store.inner.table.acting(&store.inner.pool).await?;
        let (discarded, selected) = store
            .operate()
            .discard_on(&mut tx, filter, Some(bound))
            .await?;
        if selected > bound.events() {
            return Err(ConfirmError::Changed {
                bounded: selected,
                previewed: bound.events(),
            });
        }
        self.commit(tx, "discard", &bounded(filter, bound), discarded)
            .await?;
        self.confirmed(filter, bound, discarded).await
    }

    /// What a confirmed action that moved `moved` events reports, with the events of
    /// `filter` it left (read after its commit).
    async fn confirmed(
        &self,
        filter: &EventFilter,
        bound: &DeadBound,
        moved: u64,
    ) -> Result<Confirmed, ConfirmError> {
        Ok(Confirmed {
            moved,
            previewed: bound.events(),
            left: self.store.operate().dead_matching(filter).await?,
        })
    }

    /// Writes the action's row in `tx`, the action's transaction, and commits both.
    pub(super) async fn commit(
        &self,
        mut tx: Transaction<'static, Postgres>,
        action: &str,
        filter: &str,
        rows: u64,
    ) -> Result<(), sqlx::Error> {
        let inner = &self.store.inner;
        let row = AuditWrite {
            operator: &self.operator.name,
            via: &self.operator.via,
            action,
            filter,
            rows,
        };
        inner
            .audit
            .write(&mut tx, inner.table.persistent(), &row)
            .await?;
        tx.commit().await
    }
}

/// A confirmed action's filter as the audit trail records it: the filter, then the bound
/// of its preview.
fn bounded(filter: &EventFilter, bound: &DeadBound) -> String {
    format!("{filter}; as previewed: {bound}")
}
