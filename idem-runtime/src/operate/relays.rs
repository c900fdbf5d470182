//! The outbox's relays, as operators tell them apart: each relay that holds its session
//! lock now, with the host and process its session names, so that "relay 1873542264"
//! in a lease is a machine and a process.

use super::Operate;
use std::time::SystemTime;

use serde::Serialize;

use super::{instant, rfc3339};

/// A relay whose session holds its lock now ([`Operate::outbox_relays`](crate::operate::Operate::outbox_relays)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RelaySession {
    /// Its owner number: the `lease_owner` of the events it leases
    /// ([`Lease::owner`](crate::operate::Lease::owner)).
    pub owner: i64,
    /// Its session's `application_name`: `idem relay`, the host's name and the process's
    /// id (the relay sets it, over any the connection options given to
    /// [`RelayBuilder::session`](crate::outbox::RelayBuilder::session) had).
    pub name: String,
    /// The session's client address, as the database sees it: `None` over a Unix socket,
    /// and for a role that may not see other roles' sessions (below).
    pub client_addr: Option<String>,
    /// When the session connected: `None` for a role that may not see other roles'
    /// sessions (below).
    #[serde(serialize_with = "rfc3339_or_none")]
    pub since: Option<SystemTime>,
}

fn rfc3339_or_none<S: serde::Serializer>(
    time: &Option<SystemTime>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match time {
        Some(time) => rfc3339(time, s),
        None => s.serialize_none(),
    }
}

impl Operate<'_> {
    /// The relays of this store's outbox whose sessions hold their locks now, oldest
    /// first: where a lease's owner number runs. None in the portable mode, and for relays
    /// without a session (their leases end by time only). PostgreSQL shows a session's
    /// start and client address only to its own role, a superuser, and roles granted
    /// `pg_read_all_stats`: ask as one of them to see those of relays running as
    /// another role.
    pub async fn outbox_relays(self) -> Result<Vec<RelaySession>, sqlx::Error> {
        if !self.store.inner.outbox.can_tie() {
            return Ok(Vec::new());
        }
        let single = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let relays = self.store.inner.outbox.relays(single).await?;
        Ok(relays
            .into_iter()
            .map(|(owner, name, client_addr, since)| RelaySession {
                owner,
                name,
                client_addr,
                since: since.map(instant),
            })
            .collect())
    }
}
